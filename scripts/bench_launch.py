#!/usr/bin/env python3
"""Host overhead of one nvfp4_dit.attention call: the Python launcher (checks, parameter structs,
driver launches) against SDPA's, measured in the same run.

At a tiny shape (B1, H1, 128 tokens, D 64) the GPU work is a few microseconds, so the wall time
of many back-to-back calls (one synchronise at the end) is the host's cost per call. Also times
each driver launch alone (the correction kernel, the cheapest) and a CUDA-graph replay of the whole
call, which removes the host cost. Prints a markdown table; --json for the numbers; --profile N
adds the N functions with the most host time of the attention call (cProfile, own time; the
profiler itself slows every Python call, so read it as shares, not µs).

    python scripts/bench_launch.py [--calls 2000] [--profile 25]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the N functions with the most own host time in the attention call")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import nvfp4_dit
    from nvfp4_dit.cuda import build, quantize

    reason = build.unavailable_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    rows = {}
    rows["nvfp4_dit.attention (backend='cuda')"] = per_call_us(lambda: nvfp4_dit.attention(q, k, v, backend="cuda"), args.calls)
    rows["SDPA"] = per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh), args.calls)
    qq = quantize.quantize_qkv(q, k, v)
    out = torch.empty(1, 1, 1, 128, device="cuda")
    rows["one driver launch (correction)"] = per_call_us(lambda: quantize.correction(qq, 0, 1, out=out), args.calls)
    rows["quantize_qkv (2-3 launches)"] = per_call_us(lambda: quantize.quantize_qkv(q, k, v), args.calls)

    static = [t.clone() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            nvfp4_dit.attention(*static, backend="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nvfp4_dit.attention(*static, backend="cuda")
    rows["the same call replayed from a CUDA graph"] = per_call_us(graph.replay, args.calls)

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

    overhead = rows["nvfp4_dit.attention (backend='cuda')"] - rows["SDPA"]
    if args.json:
        print(json.dumps({"us_per_call": rows, "overhead_vs_sdpa_us": overhead,
                          "device": torch.cuda.get_device_name()}, indent=1))
        return 0
    print(f"{torch.cuda.get_device_name()}, B1 H1 S128 D64 bf16, {args.calls} calls back to back")
    print("| call | µs per call |\n|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")
    print(f"\nhost overhead of nvfp4_dit.attention over SDPA: {overhead:.1f} µs per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
