#!/usr/bin/env python3
"""Benchmark block-sparse NVFP4 attention against its own dense run, and its estimate against SDPA.

One run, at B1 H40 D128 bf16 (HND) and each ``--seq`` (default 32k, 77k, 118.8k):

* per density (default 1, 0.5, 0.25, 0.1; random block maps that keep the diagonal tile): the
  attention kernel's device time and the whole call's (``nvfp4_dit.attention`` with
  ``block_mask``; the kernels' times come from the CUDA profiler), each relative to the dense call
  of the same run, the quantiser's time, and the call's peak memory beyond its inputs and output;
* the estimate (``keep_mass=0.9``: the block map from the quantiser's statistics, listed for the
  kernels) against cuDNN SDPA on the same shape, on the iid inputs (every block keeps every tile:
  the lists' worst case) and on video-structured ones (``video_inputs.py``, a 21-frame grid: the
  selection runs on every block).

On sm_80/sm_90 the kernel is the fp16-emulated build: its density ratios stand for the kernel's
structure, its absolute times do not (the native figures need an sm_120 GPU; the sm_120 model,
``scripts/model_sm120.py``, gives the same ratios). ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import nvfp4_dit  # noqa: E402
from nvfp4_dit import format as fmt  # noqa: E402
from nvfp4_dit import sparse  # noqa: E402
from nvfp4_dit.cuda import block_lists, launch, quantize  # noqa: E402
from bench_attention import time_ms  # noqa: E402  (scripts/ is the script's own folder)
from video_inputs import grid_for, video_qkv  # noqa: E402

KERNEL_GROUPS = {"attention": "nvfp4_dit_attention_fwd", "lists": "nvfp4_dit_block_",
                 "quantise": "nvfp4_dit_"}   # the rest of our kernels: the quantiser's


def kernel_ms(fn) -> dict[str, float]:
    """Device time per kernel group of one call of ``fn`` (the CUDA profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals = dict.fromkeys(KERNEL_GROUPS, 0.0)
    totals["other"] = 0.0
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:   # device activity only: kernels, memsets, copies
            continue
        group = next((g for g, prefix in KERNEL_GROUPS.items() if e.name.startswith(prefix)), "other")
        totals[group] += e.time_range.elapsed_us() / 1e3
    return totals


def peak_extra_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    return extra / 2**20


def random_map(heads: int, nq: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    bmap = torch.rand(1, heads, nq, nq, generator=g, device="cuda") < density
    return bmap | torch.eye(nq, dtype=torch.bool, device="cuda")


def estimate_fn(q, k, keep_mass: float):
    """The estimate as a call runs it: per group of Q blocks, the map of its rows from the
    quantiser's statistics, listed for the kernels."""
    b, h, sq, d = q.shape
    stats = sparse.BlockStatistics.of(quantize.quantize_qkv(q, k, k, layout="HND"))
    grid = sparse.TileGrid(b, h, sq, sq, fmt.default_scale(d))
    spec = sparse.Sparsity(keep_mass=keep_mass)
    dk = launch.device_kernels(q.device)

    def run():
        for _ in block_lists.lists_by_group(dk, stats, spec, grid, launch.current_stream(dk.index)):
            pass
    return run


def iid_qkv(seq: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """iid normal q, k, v, [1, H, S, D] bf16 (seeded by the length)."""
    g = torch.Generator(device="cuda").manual_seed(seq)
    return tuple(torch.randn(1, heads, seq, dim, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))


def video_qk(seq: int, heads: int, dim: int) -> tuple[tuple[int, int, int], torch.Tensor, torch.Tensor]:
    """A 21-frame latent grid of about ``seq`` tokens and video-structured q, k on it, [1, H, S, D]."""
    grid = grid_for(seq)
    q, k, _ = (t.transpose(1, 2) for t in video_qkv(grid, heads, dim, device="cuda"))
    return grid, q, k


def estimate_ops(seq: int, heads: int, dim: int, video: bool, top: int = 15) -> str:
    """The estimate's device time by operator at one length, on video-structured or iid inputs
    (the CUDA profiler's table)."""
    from torch.profiler import ProfilerActivity, profile

    q, k = video_qk(seq, heads, dim)[1:] if video else iid_qkv(seq, heads, dim)[:2]
    run = estimate_fn(q, k, 0.9)
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)


def sdpa_cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def bench(seq: int, heads: int, dim: int, densities, reps: int) -> tuple[list[dict], dict]:
    q, k, v = iid_qkv(seq, heads, dim)
    nq = sparse.num_blocks(seq)
    rows, dense = [], None
    for density in densities or ():
        bmap = None if density >= 1.0 else random_map(heads, nq, density, seed=int(density * 1000))

        def call(bmap=bmap):
            return nvfp4_dit.attention(q, k, v, layout="HND", backend="cuda", block_mask=bmap)

        row = {"seq": seq, "density": density,
               "map_density": 1.0 if bmap is None else round(bmap.float().mean().item(), 4),
               "call_ms": time_ms(call, reps), **{f"{g}_ms": t for g, t in kernel_ms(call).items()},
               "peak_extra_mib": peak_extra_mib(call)}
        dense = dense or row
        for key in ("call_ms", "attention_ms"):
            row[key.replace("_ms", "_vs_dense")] = row[key] / dense[key] if dense[key] else float("nan")
        rows.append(row)
        print(f"S={seq} density {density}: call {row['call_ms']:.1f} ms, kernel {row['attention_ms']:.1f} ms",
              file=sys.stderr, flush=True)
    est = {"seq": seq, "estimate_ms": time_ms(estimate_fn(q, k, 0.9), reps), "sdpa_cudnn_ms": time_ms(sdpa_cudnn(q, k, v), reps)}
    grid, qv, kv = video_qk(seq, heads, dim)
    est["video_grid"], est["video_estimate_ms"] = list(grid), time_ms(estimate_fn(qv, kv, 0.9), reps)
    est["estimate_vs_sdpa"] = est["estimate_ms"] / est["sdpa_cudnn_ms"]
    est["video_estimate_vs_sdpa"] = est["video_estimate_ms"] / est["sdpa_cudnn_ms"]
    return rows, est


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[32_768, 77_000, 118_800])
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--estimate-only", action="store_true", help="time only the estimate (and SDPA)")
    ap.add_argument("--estimate-ops", action="store_true",
                    help="also print the estimate's device time by operator at the last --seq")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sparse.py needs a CUDA GPU", file=sys.stderr)
        return 2
    densities = [] if args.estimate_only else sorted(set(args.densities) | {1.0}, reverse=True)
    all_rows, estimates = [], []
    for seq in args.seq:
        rows, est = bench(seq, args.heads, args.dim, densities, args.reps)
        all_rows += rows
        estimates.append(est)
    name = torch.cuda.get_device_name()
    if all_rows:
        print(f"Block-sparse NVFP4 attention, {name}, B1 H{args.heads} D{args.dim} bf16, random maps keeping the "
              f"diagonal; times relative to the dense call of the same run:\n")
        print("| S | density (map) | call ms | call / dense | attention kernel ms | kernel / dense "
              "| quantiser ms | block lists ms | other ms | peak extra MiB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in all_rows:
            print(f"| {r['seq']:,} | {r['density']} ({r['map_density']:.3f}) | {r['call_ms']:.1f} | {r['call_vs_dense']:.3f} "
                  f"| {r['attention_ms']:.1f} | {r['attention_vs_dense']:.3f} | {r['quantise_ms']:.1f} "
                  f"| {r['lists_ms']:.1f} | {r['other_ms']:.1f} | {r['peak_extra_mib']:.0f} |")
    print("\nThe estimate (keep_mass=0.9: block statistics to the kernels' lists) against cuDNN SDPA, on iid and on "
          "video-structured inputs:\n")
    print("| S | SDPA cuDNN ms | iid: estimate ms | / SDPA | video grid | video: estimate ms | / SDPA |")
    print("|---|---|---|---|---|---|---|")
    for e in estimates:
        print(f"| {e['seq']:,} | {e['sdpa_cudnn_ms']:.1f} | {e['estimate_ms']:.2f} | {e['estimate_vs_sdpa']:.2%} "
              f"| {'x'.join(map(str, e['video_grid']))} | {e['video_estimate_ms']:.2f} | {e['video_estimate_vs_sdpa']:.2%} |")
    if args.estimate_ops:
        for video in (True, False):
            print(f"\nThe estimate at S={args.seq[-1]:,} ({'video-structured' if video else 'iid'} inputs) by operator:\n")
            print(estimate_ops(args.seq[-1], args.heads, args.dim, video))
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": all_rows, "estimate": estimates}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
