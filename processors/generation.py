"""Running a diffusers video pipeline with NVFP4 attention: what the video tools share.

Used by ``scripts/generate_video.py``, ``capture_attention.py`` and ``report.py``:

* the generation arguments every tool takes (model, prompt, size, steps, seed, dtype, offload,
  and the NVFP4 policy: back-end, dense steps, cross-attention, min_seq_len, layers), defined in
  the torch-free :mod:`nvfp4_dit.cli` and turned into a pipeline and a policy here;
* loading a pipeline: a hub id or local path through ``DiffusionPipeline.from_pretrained``, or,
  with no ``--model``, the built-in tiny random video DiT (``processors/tiny_models``);
* :class:`RunRecorder`: per-step DiT time, attention time and share, sequence lengths per
  attention call, peak memory -- from forward hooks on the denoisers and a router observer.
"""

from __future__ import annotations

import argparse
import inspect
import resource
import time
from collections import defaultdict
from typing import Optional

import torch

from nvfp4_dit.cli import DTYPE_NAMES, POLICY_GROUP, TINY_MIN_SEQ_LEN
from nvfp4_dit.policy import AttentionPolicy
from nvfp4_dit.processors import apply, routing

DTYPES = dict(zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32)))


def resolve_device(args) -> torch.device:
    """The device of ``--device``; SystemExit with one line for a device this machine lacks."""
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise SystemExit(f"--device {args.device!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: no CUDA GPU is visible to torch {torch.__version__} "
                             f"(CUDA build {torch.version.cuda or 'none'}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def init_context_parallel(device: torch.device) -> tuple[int, int, torch.device]:
    """Join the process group ``torchrun`` describes: (rank, world size, this rank's device).

    One rank per GPU with NCCL (``cuda`` becomes ``cuda:LOCAL_RANK``), or CPU processes with gloo.
    """
    import os

    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise SystemExit("--context-parallel needs one process per GPU: launch with "
                         "`torchrun --nproc-per-node N scripts/generate_video.py --context-parallel ...` "
                         f"({', '.join(missing)} not set)")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def enable_context_parallel(pipe, mode: str) -> list[str]:
    """Context parallelism (``mode`` "ulysses" or "ring") on every denoiser of ``pipe``; their names."""
    from nvfp4_dit.processors import enable_context_parallel as enable
    from nvfp4_dit.processors.apply import _denoisers

    names = []
    for name, model in _denoisers(pipe):
        enable(model, mode)
        names.append(name)
    return names


def resolve_dtype(args, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[args.dtype]


def resolve_backend(args, device: torch.device) -> str:
    if args.backend is not None:
        return args.backend
    return "auto" if device.type == "cuda" else "reference"


def load_pipeline(args, device: torch.device, dtype: torch.dtype):
    """(pipeline, defaults for the call, model name)."""
    if args.cpu_offload != "none" and device.type != "cuda":
        raise SystemExit(f"--cpu-offload {args.cpu_offload} needs a CUDA device (got {device})")
    if args.model is None:
        from nvfp4_dit.processors.tiny_models.pipeline import build_tiny_pipeline

        pipe = build_tiny_pipeline(args.tiny_config, dtype=dtype)
        defaults, name = dict(pipe.tiny_config["defaults"]), "tiny-wan-t2v (built-in, random weights)"
        defaults.setdefault("min_seq_len", TINY_MIN_SEQ_LEN)
        defaults.setdefault("sparse_min_seq_len", TINY_MIN_SEQ_LEN)
    else:
        pipe = _from_pretrained(args.model, dtype)
        defaults, name = {"fps": 16}, args.model
    if args.cpu_offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif args.cpu_offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        pipe.to(device)
    if args.image and "image" not in inspect.signature(pipe.__call__).parameters:
        raise SystemExit(f"--image given, but {type(pipe).__name__} takes no image (not an image-to-video pipeline)")
    return pipe, defaults, name


def _from_pretrained(model: str, dtype: torch.dtype):
    """``DiffusionPipeline.from_pretrained``; SystemExit with one line when ``model`` is no pipeline:
    a missing folder, a folder without ``model_index.json``, or a hub id that cannot be fetched."""
    import os

    from diffusers import DiffusionPipeline

    looks_local = os.path.isabs(model) or model.startswith((".", "~")) or os.path.exists(model)
    if looks_local:
        folder = os.path.expanduser(model)
        if not os.path.isdir(folder):
            raise SystemExit(f"--model {model}: no such folder")
        if not os.path.isfile(os.path.join(folder, "model_index.json")):
            raise SystemExit(f"--model {model}: not a diffusers pipeline folder (no model_index.json)")
    try:
        return DiffusionPipeline.from_pretrained(model, dtype=dtype)
    except (OSError, ValueError, EnvironmentError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"--model {model}: cannot load a pipeline ({first})") from None


class InvalidArguments(ValueError):
    """The pipeline rejects the generation arguments (sizes, frame count): a usage error."""


def check_call(pipe, kwargs: dict) -> None:
    """Run the pipeline's own ``check_inputs`` on the call's arguments before any work, so that a
    size the model cannot take is a usage error (InvalidArguments) rather than a traceback from
    inside the run. Arguments it names that the call does not give are passed as None (what
    diffusers pipelines default them to); a ``check_inputs`` that cannot be called so is skipped."""
    check = getattr(pipe, "check_inputs", None)
    if check is None:
        return
    try:
        params = inspect.signature(check).parameters
    except (TypeError, ValueError):
        return
    named = {n: kwargs.get(n) for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and (n in kwargs or p.default is p.empty)}
    try:
        check(**named)
    except TypeError:
        return
    except ValueError as e:
        raise InvalidArguments(f"{type(pipe).__name__} does not take these arguments: {e}") from None


def call_kwargs(pipe, args, defaults: dict, generator, callback) -> dict:
    """Keyword arguments for ``pipe(...)``, filtered by what its ``__call__`` accepts."""
    want = {
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "height": args.height or defaults.get("height"),
        "width": args.width or defaults.get("width"),
        "num_frames": args.frames or defaults.get("num_frames"),
        "num_inference_steps": args.steps or defaults.get("num_inference_steps"),
        "guidance_scale": args.guidance_scale if args.guidance_scale is not None else defaults.get("guidance_scale"),
        "generator": generator,
        "output_type": "np",
        "callback_on_step_end": callback,
        "callback_on_step_end_tensor_inputs": ["latents"],
    }
    if args.image:
        from diffusers.utils import load_image

        want["image"] = load_image(args.image)
    params = inspect.signature(pipe.__call__).parameters
    return {k: v for k, v in want.items() if v is not None and k in params}


def frames_of(output):
    """The first video of a pipeline output as a float array [F, H, W, C] in [0, 1]."""
    frames = output.frames if hasattr(output, "frames") else output[0]
    frames = frames[0] if getattr(frames, "ndim", 0) == 5 or isinstance(frames, list) else frames
    if isinstance(frames, torch.Tensor):
        frames = frames.float().cpu().numpy()
    return frames


def _peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"kind": "cuda_max_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}
    # ru_maxrss is KiB on Linux; a process-wide peak (it cannot be reset between runs).
    return {"kind": "cpu_max_rss", "bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


class RunRecorder:
    """Times the denoiser forwards and every routed attention call of one pipeline run.

    Needs an :func:`nvfp4_dit.apply` handle on the pipeline (its policy gives the step), so use
    ``apply(..., observe_only=True)`` for a dense baseline.  Each attention call adds a device
    sync for its timing (on CUDA), so absolute step times are a little pessimistic; the share is
    what to read.
    """

    def __init__(self, pipe, handle, device: torch.device):
        self.pipe, self.handle, self.device = pipe, handle, device
        self.forwards = defaultdict(lambda: {"forwards": 0, "dit_seconds": 0.0, "dense": False})
        self.calls: list[dict] = []
        self.latents = None
        self._hooks = []
        self._t0 = None
        self._fwd_start = None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _step(self) -> int:
        s = self.handle.steps.current_step
        return s[0] if s is not None else -1

    def _pre(self, module, args, kwargs):
        self._sync()
        self._fwd_start = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        self._sync()
        rec = self.forwards[self._step()]
        rec["forwards"] += 1
        rec["dit_seconds"] += time.perf_counter() - self._fwd_start
        rec["dense"] = self.handle.policy.step_is_dense(self.handle.steps.current_step)

    def _observe(self, info, q, k, v, out):
        qs = q.shape
        layout_hnd = info.layout == "HND"
        q_len, k_len = int(qs[2] if layout_hnd else qs[1]), int(k.shape[2] if layout_hnd else k.shape[1])
        policy = self.handle.policy
        sparse_off = None   # why an NVFP4 call of a block-sparse policy ran dense: the rule and its threshold
        if info.path == "fp4" and info.sparsity is None and policy.may_run_sparse:
            sparse_off = (policy.sparse_off_reason(info.step, q_len, k_len, info.layer)
                          or "dense on this route (ring context parallelism)")
        self.calls.append({
            "step": info.step[0] if info.step else -1,
            "layer": info.layer,
            "q_len": q_len,
            "k_len": k_len,
            "heads": int(qs[1] if layout_hnd else qs[2]),
            "head_dim": int(qs[3]),
            "batch": int(qs[0]),
            "path": info.path,
            "reason": info.reason,
            "ms": round(info.seconds * 1e3, 4),
            # A block-sparse call: its keep_mass and the share of key tiles its estimate kept.
            "keep_mass": None if info.sparsity is None else info.sparsity.keep_mass,
            "density": None if info.sparsity is None else round(routing.block_density(info, q, k, info.sparsity), 4),
            # ... and the latent grid whose 3D tiles it ran in (None: the model's token order).
            "video_grid": None if info.order is None else list(info.order.grid),
            "sparse_off": sparse_off,
        })

    def callback(self, pipe, step_index, timestep, callback_kwargs):
        if "latents" in callback_kwargs:
            self.latents = callback_kwargs["latents"]
        return callback_kwargs

    def __enter__(self):
        from nvfp4_dit.processors.apply import _denoisers

        for _, model in _denoisers(self.pipe):
            self._hooks.append(model.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._hooks.append(model.register_forward_hook(self._post, with_kwargs=True))
        routing.add_observer(self._observe)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.total_seconds = time.perf_counter() - self._t0
        routing.remove_observer(self._observe)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.peak_memory = _peak_memory(self.device)
        return False

    def summary(self) -> dict:
        att = defaultdict(float)
        paths = defaultdict(lambda: defaultdict(int))
        for c in self.calls:
            att[c["step"]] += c["ms"] / 1e3
            paths[c["step"]][c["path"]] += 1
        steps = []
        for s in sorted(self.forwards):
            r = self.forwards[s]
            a = att.get(s, 0.0)
            steps.append({"step": s, "forwards": r["forwards"], "dit_seconds": round(r["dit_seconds"], 5),
                          "attention_seconds": round(a, 5),
                          "attention_share": round(a / r["dit_seconds"], 4) if r["dit_seconds"] else None,
                          "dense_step": r["dense"], "fp4_calls": paths[s]["fp4"], "exact_calls": paths[s]["exact"]})
        seqs = {}
        for c in self.calls:
            seqs.setdefault(c["layer"], {"q_len": c["q_len"], "k_len": c["k_len"], "heads": c["heads"],
                                         "head_dim": c["head_dim"]})
        dit = sum(s["dit_seconds"] for s in steps)
        density = defaultdict(dict)   # layer -> step -> mean density of its block-sparse calls
        for c in self.calls:
            if c["density"] is not None:
                density[c["layer"]].setdefault(c["step"], []).append(c["density"])
        return {
            "total_seconds": round(self.total_seconds, 4),
            "dit_seconds": round(dit, 4),
            "attention_seconds": round(sum(att.values()), 4),
            "attention_share": round(sum(att.values()) / dit, 4) if dit else None,
            "peak_memory": self.peak_memory,
            "steps": steps,
            "sequence_lengths": seqs,
            "sparse_density": {layer: {step: round(sum(d) / len(d), 4) for step, d in sorted(per.items())}
                               for layer, per in density.items()},
            "block_sparse": block_sparse_summary(self.calls),
            "attention_calls": self.calls,
        }


def block_sparse_summary(calls: list) -> Optional[dict]:
    """The block-sparse part of a recorded run: how many NVFP4 calls ran block-sparse, their mean
    density (share of key tiles visited), and the NVFP4 calls that ran dense by the rule that kept
    them dense; None when the policy runs nothing block-sparse."""
    sparse = [c["density"] for c in calls if c["density"] is not None]
    dense = defaultdict(int)
    for c in calls:
        if c.get("sparse_off"):
            dense[c["sparse_off"]] += 1
    if not sparse and not dense:
        return None
    return {"calls": len(sparse), "mean_density": round(sum(sparse) / len(sparse), 4) if sparse else None,
            "dense_calls": dict(sorted(dense.items(), key=lambda x: -x[1]))}


def _counted(reasons: dict) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda x: -x[1]))


def describe_paths(summary: dict) -> str:
    """How many attention calls of a recorded run ran NVFP4, and why the others ran exact; with a
    block-sparse policy, how many ran block-sparse at which mean density, and why the others did not."""
    calls = summary["attention_calls"]
    fp4 = sum(c["path"] == "fp4" for c in calls)
    reasons = defaultdict(int)
    for c in calls:
        if c["path"] != "fp4":
            reasons[c["reason"]] += 1
    why = _counted(reasons)
    text = f"attention calls: {fp4} NVFP4, {len(calls) - fp4} exact" + (f" ({why})" if why else "")
    if calls and fp4 == 0:
        text += ("; no call ran NVFP4 -- see the reasons (a shorter --min-seq-len, --dense-steps 0,0 or "
                 "--cross-attention change them)")
    sparse = summary.get("block_sparse")
    if sparse is not None:
        text += f"; block-sparse: {sparse['calls']} of the NVFP4 calls"
        if sparse["calls"]:
            text += f", mean density {sparse['mean_density']:.3f}"
            if sparse["mean_density"] >= 1.0:
                text += " (the estimate kept every key tile: no tile held little enough of the attention mass)"
        if sparse["dense_calls"]:
            text += f"; dense NVFP4: {_counted(sparse['dense_calls'])}"
    return text


def min_seq_len(args, defaults: dict, ring_shards: int = 1, name: str = "min_seq_len") -> int:
    """--min-seq-len (``name`` "sparse_min_seq_len": --sparse-min-seq-len), else the pipeline's default
    (the tiny model's, divided by the ring's shard count: ring attention calls see one shard), else
    the policy's."""
    given = getattr(args, name)
    if given is not None:
        return given
    if name in defaults:
        return defaults[name] // ring_shards
    return getattr(AttentionPolicy(), name)


def policy_from_args(ap: argparse.ArgumentParser, args, backend: str, defaults: dict,
                     ring_shards: int = 1) -> AttentionPolicy:
    """The policy of --policy FILE, else of the policy arguments; a usage error if both are given."""
    if args.policy is None:
        return AttentionPolicy(**policy_kwargs(args, backend, defaults, ring_shards))
    given = [f"--{a.dest.replace('_', '-')}" for g in ap._action_groups if g.title == POLICY_GROUP
             for a in g._group_actions if a.dest != "policy" and getattr(args, a.dest) != a.default]
    if given:
        ap.error(f"--policy replaces the policy arguments; drop {', '.join(given)}")
    try:
        return AttentionPolicy.load(args.policy)
    except (OSError, ValueError) as e:
        ap.error(str(e))


def calibrate_pipeline(pipe, args, defaults: dict, policy: AttentionPolicy, budget: float) -> AttentionPolicy:
    """:func:`nvfp4_dit.calibrate` on one generation with the run's own arguments (latents only)."""
    from nvfp4_dit.processors import calibrate

    def run():
        kwargs = call_kwargs(pipe, args, defaults, torch.Generator("cpu").manual_seed(args.seed), None)
        if "output_type" in kwargs:
            kwargs["output_type"] = "latent"
        return pipe(**kwargs)

    return calibrate(pipe, run, budget=budget, policy=policy)


def policy_kwargs(args, backend: str, defaults: dict, ring_shards: int = 1) -> dict:
    """Keyword arguments for nvfp4_dit.apply from the policy arguments."""
    layers = [s.strip() for s in args.layers.split(",")] if args.layers else None
    return dict(backend=backend, dense_steps=tuple(args.dense_steps), cross_attention=args.cross_attention,
                min_seq_len=min_seq_len(args, defaults, ring_shards), layers=layers, balance_qk=args.balance_qk,
                qk_format=args.qk_format, keep_mass=args.keep_mass, sparse_off_steps=tuple(args.sparse_off_steps),
                sparse_min_seq_len=min_seq_len(args, defaults, ring_shards, "sparse_min_seq_len"))


def run_once(pipe, args, defaults: dict, mode: str, policy: AttentionPolicy,
             device: torch.device) -> tuple[object, dict, Optional[torch.Tensor]]:
    """One pipeline run with ``mode`` "nvfp4" (under ``policy``) or "sdpa" (dense, observed).

    Returns (pipeline output, recorder summary, final latents or None)."""
    if mode == "nvfp4":
        handle = apply(pipe, policy=policy)
    else:
        handle = apply(pipe, observe_only=True, cross_attention=True, min_seq_len=0)
    generator = torch.Generator("cpu").manual_seed(args.seed)
    try:
        with RunRecorder(pipe, handle, device) as rec:
            out = pipe(**call_kwargs(pipe, args, defaults, generator, rec.callback))
    finally:
        handle.restore()
    return out, rec.summary(), rec.latents


def compare_metrics(lat_a, lat_b, frames_a, frames_b) -> dict:
    """Latent cosine / rel-L2 and frame PSNR (dB, frames in [0, 1]) of run b against run a."""
    import numpy as np

    res = {}
    if lat_a is not None and lat_b is not None:
        a, b = lat_a.double().flatten().cpu(), lat_b.double().flatten().cpu()
        res["latent_cos"] = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        res["latent_rel_l2"] = float((a - b).norm() / a.norm())
        rng = float(a.max() - a.min()) or 1.0
        mse = float(((a - b) ** 2).mean())
        res["latent_psnr_db"] = float("inf") if mse == 0 else 10 * float(np.log10(rng ** 2 / mse))
    fa, fb = np.asarray(frames_a, dtype=np.float64), np.asarray(frames_b, dtype=np.float64)
    mse = float(((fa - fb) ** 2).mean())
    res["frames_psnr_db"] = float("inf") if mse == 0 else 10 * float(np.log10(1.0 / mse))
    return res
