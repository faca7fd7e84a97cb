#!/usr/bin/env python3
"""Capture the q/k/v of chosen attention layers and steps of a pipeline run to safetensors.

Runs the pipeline (default: the built-in tiny random video DiT) with every attention call routed
through nvfp4_dit's processors and saves, for each selected call, q, k, v, the mask (if any) and
the live output, with the call's metadata (layer, step, layout, causal, scale, GQA, which path
ran and why) in the file's metadata.  ``replay_attention.py`` then runs the captured calls through
every back-end against exact attention -- the way to judge FP4 on your own model.

    python scripts/capture_attention.py --out out/capture.safetensors              # tiny model, dense run
    python scripts/capture_attention.py --attention nvfp4 --capture-layers 'transformer.blocks.0.*' --capture-steps 0,4
    python scripts/capture_attention.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --steps 30 \\
        --capture-layers 'transformer.blocks.10.attn1,transformer.blocks.20.attn1' --capture-steps 0,10,29 --max-calls 12

--attention sdpa (default) captures a dense run (outputs are exact); --attention nvfp4 captures the
NVFP4 run as configured by the policy arguments (outputs are what the model actually used).
Tensors are stored in their memory layout, so a replay sees the same strides as the live call.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nvfp4_dit import cli  # noqa: E402
from nvfp4_dit.processors import generation  # noqa: E402
from nvfp4_dit.processors import apply, routing  # noqa: E402

FORMAT = "nvfp4_dit.capture/1"


def physical(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(contiguous tensor in t's memory order, permutation that gives back a view with t's strides)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    phys = t.detach().permute(order).contiguous().cpu()
    inverse = [order.index(d) for d in range(t.dim())]
    return phys, inverse


class Capturer:
    """Router observer that keeps the selected calls (CPU copies) and their metadata."""

    def __init__(self, layers, steps, max_calls: int):
        self.layers, self.steps, self.max_calls = layers, steps, max_calls
        self.tensors: dict[str, torch.Tensor] = {}
        self.calls: list[dict] = []
        self.skipped = 0

    def wanted(self, info) -> bool:
        if self.layers and not any(fnmatch.fnmatchcase(info.layer or "", p) for p in self.layers):
            return False
        step = info.step[0] if info.step else None
        return not self.steps or step in self.steps

    def __call__(self, info, q, k, v, out):
        if not self.wanted(info):
            return
        if len(self.calls) >= self.max_calls:
            self.skipped += 1
            return
        i = len(self.calls)
        out = out[0] if isinstance(out, tuple) else out
        meta = {"index": i, "layer": info.layer, "step": info.step[0] if info.step else None,
                "steps_total": info.step[1] if info.step else None, "layout": info.layout,
                "is_causal": info.is_causal, "scale": info.scale, "enable_gqa": info.enable_gqa,
                "path": info.path, "reason": info.reason, "backend": info.backend, "has_mask": info.attn_mask is not None,
                "perm": {}}
        named = {"q": q, "k": k, "v": v, "out": out}
        if info.attn_mask is not None:
            named["mask"] = info.attn_mask
        for name, t in named.items():
            phys, perm = physical(t)
            self.tensors[f"{i:05d}.{name}"] = phys
            meta["perm"][name] = perm
        self.calls.append(meta)


def load_capture(path) -> tuple[list[dict], dict]:
    """(calls with their tensors as views with the live strides, file metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not an nvfp4_dit attention capture (format {meta.get('format')!r})")
        calls = json.loads(meta["calls"])
        for c in calls:
            for name, perm in c["perm"].items():
                c[name] = f.get_tensor(f"{c['index']:05d}.{name}").permute(perm)
    return calls, meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_generation_args(ap)
    ap.add_argument("--attention", choices=("sdpa", "nvfp4"), default="sdpa",
                    help="sdpa: capture a dense run (default); nvfp4: the NVFP4 run under the policy arguments")
    ap.add_argument("--capture-layers", default=None,
                    help="comma-separated fnmatch patterns of the layers to save, e.g. 'transformer.blocks.0.*' "
                         "(default: all)")
    ap.add_argument("--capture-steps", default=None, help="comma-separated step indices to save (default: all)")
    ap.add_argument("--max-calls", type=int, default=64, help="stop saving after this many calls (default 64)")
    ap.add_argument("--out", default="out/capture.safetensors")
    args = ap.parse_args(cli.join_pair_values(sys.argv[1:] if argv is None else argv))

    from safetensors.torch import save_file

    device = generation.resolve_device(args)
    dtype = generation.resolve_dtype(args, device)
    backend = generation.resolve_backend(args, device)
    pipe, defaults, name = generation.load_pipeline(args, device, dtype)
    try:
        generation.check_call(pipe, generation.call_kwargs(pipe, args, defaults, None, None))
    except generation.InvalidArguments as e:
        ap.error(str(e))
    layers = [s.strip() for s in args.capture_layers.split(",")] if args.capture_layers else None
    steps = {int(s) for s in args.capture_steps.split(",")} if args.capture_steps else None
    cap = Capturer(layers, steps, args.max_calls)
    if args.attention == "nvfp4":
        handle = apply(pipe, policy=generation.policy_from_args(ap, args, backend, defaults))
    else:
        handle = apply(pipe, observe_only=True, cross_attention=True, min_seq_len=0)
    print(f"model: {name} on {device}; capturing a {args.attention} run", flush=True)
    routing.add_observer(cap)
    try:
        generator = torch.Generator("cpu").manual_seed(args.seed)
        pipe(**generation.call_kwargs(pipe, args, defaults, generator, None))
    finally:
        routing.remove_observer(cap)
        handle.restore()
    if not cap.calls:
        print("no attention call matched --capture-layers/--capture-steps", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": FORMAT, "model": name, "attention": args.attention, "dtype": str(dtype),
                "calls": json.dumps(cap.calls), "args": json.dumps({k: v for k, v in vars(args).items()
                                                                     if isinstance(v, (str, int, float, type(None)))})}
    save_file(cap.tensors, str(out), metadata=metadata)
    size = sum(t.numel() * t.element_size() for t in cap.tensors.values())
    print(f"saved {len(cap.calls)} calls ({size / 2**20:.1f} MiB) to {out}"
          + (f"; {cap.skipped} more matched past --max-calls" if cap.skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
