#!/usr/bin/env python3
"""Host cost of one attention call through each entry point, against SDPA's in the same run.

At a tiny shape (B1, H1, 128 tokens, D 64) the GPU work is a few microseconds, so the wall time
of many back-to-back calls (one synchronise at the end) is the host's cost per call. Rows:

* ``nvfp4_dit.attention`` (backend ``cuda``): validation, back-end choice, one workspace
  allocation, the quantiser and attention launches;
* the diffusers route: the registered ``"nvfp4"`` backend as a processor calls it (the router and
  the call planner, then the op), with a bool key-padding mask ``[B, 1, 1, S]``;
* the ComfyUI override as a model calls it, with an additive key-padding mask ``[B, 1, S]``;
* SDPA on the same tensors (the peer every ratio is to), and a CUDA-graph replay of the op's call,
  which removes the host cost.

Prints a markdown table (µs per call and the ratio to SDPA); --json for the numbers; --profile N
adds the N functions with the most host time of the op's call (cProfile, own time; the profiler
slows every Python call, so read it as shares, not µs).

    python scripts/bench_launch.py [--calls 2000] [--profile 25]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def entry_points(q, k, v):
    """name -> a zero-argument call, for every entry point timed."""
    import nvfp4_dit
    from nvfp4_dit.comfyui_node.attention_override import NVFP4AttentionOverride
    from nvfp4_dit.policy import AttentionPolicy

    b, s, h, d = q.shape
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    rows = {"SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh),
            "nvfp4_dit.attention (backend='cuda')": lambda: nvfp4_dit.attention(q, k, v, backend="cuda")}
    policy = AttentionPolicy(backend="cuda", min_seq_len=0, dense_steps=(0, 0))
    keep = torch.ones(b, 1, 1, s, dtype=torch.bool, device=q.device)
    keep[..., s - 16:] = False
    try:
        from nvfp4_dit.processors import backend as diffusers_backend, routing
    except ImportError:
        print("diffusers is not installed: no diffusers row", file=sys.stderr)
    else:
        def diffusers_call():
            prev = routing.push_route(policy, None, "blocks.0.attn1", None)
            try:
                return diffusers_backend._nvfp4_attention(q, k, v, attn_mask=keep)
            finally:
                routing.pop_route(prev)

        rows["diffusers route, key-padding mask"] = diffusers_call
    override = NVFP4AttentionOverride(policy)
    additive = torch.where(keep[:, 0], 0.0, -torch.inf)   # [B, 1, S]: ComfyUI adds the head dim
    comfy_q, comfy_k, comfy_v = (t.reshape(b, s, h * d) for t in (q, k, v))

    def comfy_exact(*args, **kwargs):
        raise RuntimeError("the override declined a call it should run")

    rows["ComfyUI override, key-padding mask"] = lambda: override(comfy_exact, comfy_q, comfy_k, comfy_v, h,
                                                                  mask=additive)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the N functions with the most own host time in the attention call")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_launch.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    import nvfp4_dit
    from nvfp4_dit import selftest
    from nvfp4_dit.cuda import build

    reason = build.unavailable_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    selftest.verify(head_dims=(64,))
    rows = {name: per_call_us(fn, args.calls) for name, fn in entry_points(q, k, v).items()}

    static = [t.clone() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            nvfp4_dit.attention(*static, backend="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nvfp4_dit.attention(*static, backend="cuda")
    rows["the op's call replayed from a CUDA graph"] = per_call_us(graph.replay, args.calls)

    if args.profile > 0:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(min(args.calls, 500)):
            nvfp4_dit.attention(q, k, v, backend="cuda")
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)

    sdpa = rows["SDPA"]
    if args.json:
        print(json.dumps({"us_per_call": rows, "vs_sdpa": {n: us / sdpa for n, us in rows.items()},
                          "device": torch.cuda.get_device_name()}, indent=1))
        return 0
    print(f"{torch.cuda.get_device_name()}, B1 H1 S128 D64 bf16, {args.calls} calls back to back")
    print("| call | µs per call | / SDPA |\n|---|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} | {us / sdpa:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
