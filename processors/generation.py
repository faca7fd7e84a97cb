"""Running a diffusers video pipeline with NVFP4 attention: what the video tools share.

Used by ``scripts/generate_video.py``, ``capture_attention.py`` and ``report.py``:

* the generation arguments every tool takes (model, prompt, size, steps, seed, dtype, offload,
  and the NVFP4 policy: back-end, dense steps, cross-attention, min_seq_len, layers);
* loading a pipeline: a hub id or local path through ``DiffusionPipeline.from_pretrained``, or,
  with no ``--model``, the built-in tiny random video DiT (``processors/tiny_models``);
* :class:`RunRecorder`: per-step DiT time, attention time and share, sequence lengths per
  attention call, peak memory -- from forward hooks on the denoisers and a router observer.
"""

from __future__ import annotations

import argparse
import inspect
import re
import resource
import time
from collections import defaultdict
from typing import Optional

import torch

from nvfp4_dit.format import QK_FORMATS
from nvfp4_dit.policy import DEFAULT_MIN_SEQ_LEN, AttentionPolicy
from nvfp4_dit.processors import apply, routing

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# The built-in tiny model's video sequence is 320 tokens: below the policy's default threshold,
# which is sized for real models. Its runs use this one so that their FP4 path runs.
TINY_MIN_SEQ_LEN = 256


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its error messages
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def parse_pair(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST,LAST (two ints), got {text!r}") from None
    if a < 0 or b < 0:
        raise argparse.ArgumentTypeError(f"steps must be >= 0, got {text!r}")
    return a, b


def keep_mass_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


keep_mass_arg.__name__ = "float"   # argparse names the type in its error messages

PAIR_OPTIONS = ("--dense-steps", "--sparse-off-steps")


def join_pair_values(argv: list) -> list:
    """``--dense-steps -1,1`` as ``--dense-steps=-1,1``: argparse reads a value that starts with "-"
    and is no plain number as an option, and would say "expected one argument" instead of what is
    wrong with the value."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in PAIR_OPTIONS and i + 1 < len(argv) and re.fullmatch(r"-?\d+,-?\d+", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def add_generation_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model and sampling")
    g.add_argument("--model", default=None,
                   help="diffusers pipeline: hub id or local folder (Wan 2.1/2.2, Cosmos Predict2/2.5, HunyuanVideo, "
                        "LTX-Video, CogVideoX, Mochi). Default: the built-in tiny random video DiT (CPU, seconds)")
    g.add_argument("--tiny-config", default=None, help="config JSON of the tiny model (default: the shipped one)")
    g.add_argument("--prompt", default="a red fox running through fresh snow, cinematic")
    g.add_argument("--negative-prompt", default=None)
    g.add_argument("--image", default=None, help="conditioning image (path or URL) for image-to-video pipelines")
    g.add_argument("--height", type=positive_int, default=None, help="default: the pipeline's (tiny: 128)")
    g.add_argument("--width", type=positive_int, default=None)
    g.add_argument("--frames", type=positive_int, default=None, help="number of frames (tiny: 17)")
    g.add_argument("--steps", type=positive_int, default=None, help="denoising steps (tiny: 8)")
    g.add_argument("--guidance-scale", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    g.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    g.add_argument("--cpu-offload", choices=("none", "model", "sequential"), default="none",
                   help="enable_model_cpu_offload / enable_sequential_cpu_offload (CUDA only)")
    a = ap.add_argument_group("NVFP4 attention policy")
    a.add_argument("--backend", choices=("auto", "cuda", "reference", "sdpa"), default=None,
                   help="nvfp4_dit.attention back-end for FP4 calls. Default: auto on CUDA (the kernel where the "
                        "native FP4 MMA exists), reference (FP4 numerics in PyTorch) on CPU")
    first, last = AttentionPolicy().dense_steps
    a.add_argument("--dense-steps", type=parse_pair, default=(first, last), metavar="FIRST,LAST",
                   help=f"first/last denoising steps that run dense attention (default {first},{last})")
    a.add_argument("--cross-attention", action="store_true", help="FP4 for cross-attention too (default: dense)")
    a.add_argument("--min-seq-len", type=non_negative_int, default=None,
                   help=f"calls with fewer query or key tokens stay dense (default {DEFAULT_MIN_SEQ_LEN}; the "
                        f"built-in tiny model, whose sequences are 320 tokens: {TINY_MIN_SEQ_LEN})")
    a.add_argument("--layers", default=None, help="comma-separated allow-list of module patterns, e.g. 'blocks.*.attn1'")
    a.add_argument("--balance-qk", action=argparse.BooleanOptionalAction, default=AttentionPolicy().balance_qk,
                   help="balance Q and K per channel before FP4 quantisation (default: on)")
    a.add_argument("--qk-format", choices=QK_FORMATS, default=AttentionPolicy().qk_format,
                   help="Q·Kᵀ format: nvfp4 (default) or mxfp8 (8-bit Q·Kᵀ for sharp attention; P·V stays NVFP4)")
    default = AttentionPolicy()
    a.add_argument("--keep-mass", type=keep_mass_arg, default=None, metavar="MASS",
                   help="block-sparse NVFP4: each call keeps, per 128-query block, the key tiles holding this "
                        "share of the estimated attention mass, e.g. 0.9 (default: dense)")
    a.add_argument("--sparse-off-steps", type=parse_pair, default=default.sparse_off_steps, metavar="FIRST,LAST",
                   help="first/last denoising steps that stay dense NVFP4 with --keep-mass "
                        f"(default {default.sparse_off_steps[0]},{default.sparse_off_steps[1]})")
    a.add_argument("--sparse-min-seq-len", type=non_negative_int, default=default.sparse_min_seq_len,
                   help=f"calls with fewer query or key tokens stay dense NVFP4 with --keep-mass "
                        f"(default {default.sparse_min_seq_len})")
    a.add_argument("--policy", default=None, metavar="FILE",
                   help="a saved policy JSON (e.g. from --calibrate) instead of the policy arguments above")


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
        self.calls.append({
            "step": info.step[0] if info.step else -1,
            "layer": info.layer,
            "q_len": int(qs[2] if layout_hnd else qs[1]),
            "k_len": int(k.shape[2] if layout_hnd else k.shape[1]),
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
            "attention_calls": self.calls,
        }


def describe_paths(summary: dict) -> str:
    """How many attention calls of a recorded run ran NVFP4, and why the others ran exact."""
    calls = summary["attention_calls"]
    fp4 = sum(c["path"] == "fp4" for c in calls)
    reasons = defaultdict(int)
    for c in calls:
        if c["path"] != "fp4":
            reasons[c["reason"]] += 1
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda x: -x[1]))
    text = f"attention calls: {fp4} NVFP4, {len(calls) - fp4} exact" + (f" ({why})" if why else "")
    if calls and fp4 == 0:
        text += ("; no call ran NVFP4 -- see the reasons (a shorter --min-seq-len, --dense-steps 0,0 or "
                 "--cross-attention change them)")
    return text


def min_seq_len(args, defaults: dict, ring_shards: int = 1) -> int:
    """--min-seq-len, else the pipeline's default (the tiny model's, divided by the ring's shard
    count: ring attention calls see one shard), else the policy's."""
    if args.min_seq_len is not None:
        return args.min_seq_len
    if "min_seq_len" in defaults:
        return defaults["min_seq_len"] // ring_shards
    return DEFAULT_MIN_SEQ_LEN


def policy_from_args(ap: argparse.ArgumentParser, args, backend: str, defaults: dict,
                     ring_shards: int = 1) -> AttentionPolicy:
    """The policy of --policy FILE, else of the policy arguments; a usage error if both are given."""
    if args.policy is None:
        return AttentionPolicy(**policy_kwargs(args, backend, defaults, ring_shards))
    given = [f"--{a.dest.replace('_', '-')}" for g in ap._action_groups if g.title == "NVFP4 attention policy"
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
                sparse_min_seq_len=args.sparse_min_seq_len)


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
