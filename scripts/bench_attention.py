#!/usr/bin/env python3
"""Benchmark the NVFP4 attention kernel against SDPA (flash, cuDNN) and SageAttention if installed.

One run times, at B1 H40 D128 and S = 8k, 32k, 77k, causal and not:
  * ``nvfp4 kernel``: the attention kernel alone on inputs the CUDA quantiser prepared (native FP4
    MMA on sm_120/121, the fp16 emulation on sm_80/90);
  * ``nvfp4 e2e``: ``nvfp4_dit.cuda.attention.attention`` (quantise + kernel);
  * ``mxfp8 Q·Kᵀ e2e``: the same with ``qk_format="mxfp8"`` (8-bit Q·Kᵀ, NVFP4 P·V);
  * ``nvfp4 quantize``: the preparation of the e2e path alone (the CUDA quantiser, with the smoothing
    basis and the key projections);
  * ``sdpa flash`` / ``sdpa cudnn``: torch SDPA in bf16 with that back-end forced;
  * ``sageattn3`` / ``sageattention``: when importable.
Prints a markdown table (ms and TFLOP/s, 4*B*H*Sq*Sk*D flops, halved when causal) and writes a
PNG next to it (``--out``). On the H200 the nvfp4 numbers are the *emulated* ones and are
expected to be far below SDPA; the native numbers need an sm_120 GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nvfp4_dit.cuda import attention as attention_cuda, build, quantize  # noqa: E402
from nvfp4_dit import format as fmt  # noqa: E402


PREPROCESSING = ("nvfp4 quantize",)


def time_ms(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def flops(b, h, s, d, causal):
    return 4.0 * b * h * s * s * d / (2.0 if causal else 1.0)


def sdpa_fn(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def sage_fns(q, k, v, causal):
    fns = {}
    try:
        from sageattn3 import sageattn3_blackwell  # type: ignore

        fns["sageattn3"] = lambda: sageattn3_blackwell(q, k, v, is_causal=causal)
    except Exception:
        pass
    try:
        from sageattention import sageattn  # type: ignore

        fns["sageattention"] = lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=causal)
    except Exception:
        pass
    return fns


def write_report(rows, *, name, arch, mode, b, h, d, out):
    """Print the markdown table, write it to ``out.md`` and a bar chart to ``out.png``."""
    lines = [f"# NVFP4 attention benchmark: {name} ({arch}), nvfp4 = {mode}", "",
             f"B={b} H={h} D={d}, bf16 inputs; TFLOP/s counts 4*B*H*S^2*D (halved when causal).", "",
             "| S | causal | implementation | ms | TFLOP/s | vs sdpa flash |", "|---|---|---|---|---|---|"]
    for r in rows:
        ref = next((x["ms"] for x in rows if x["s"] == r["s"] and x["causal"] == r["causal"]
                    and x["impl"] == "sdpa flash"), None)
        pre = r["tflops"] is None
        ratio = f"{ref / r['ms']:.2f}x" if ref and not pre else "-"
        tflops = "-" if pre else f"{r['tflops']:.1f}"
        lines.append(f"| {r['s']} | {r['causal']} | {r['impl']} | {r['ms']:.3f} | {tflops} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    Path(out + ".md").write_text(table + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, causal in zip(axes, (False, True)):
            impls = sorted({r["impl"] for r in rows if r["tflops"] is not None})
            seqs = sorted({r["s"] for r in rows})
            width = 0.8 / len(impls)
            for i, impl in enumerate(impls):
                vals = [next((r["tflops"] for r in rows if r["s"] == s and r["causal"] == causal and r["impl"] == impl), 0)
                        for s in seqs]
                ax.bar([j + i * width for j in range(len(seqs))], vals, width, label=impl)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(seqs))], [f"{s // 1000}k" for s in seqs])
            ax.set_title(f"causal={causal}")
            ax.set_xlabel("sequence length")
        axes[0].set_ylabel("TFLOP/s")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{name}: nvfp4 = {mode}, B{b} H{h} D{d}")
        fig.tight_layout()
        fig.savefig(out + ".png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="8192,32768,77000")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (0: by size)")
    ap.add_argument("--out", default="bench_attention", help="output stem for .md and .png")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("bench_attention.py: needs a CUDA GPU (none is visible to torch)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    cc = torch.cuda.get_device_capability(dev)
    native = build.is_native(cc)
    reason = build.unavailable_reason(dev)
    if reason:
        print(f"bench_attention.py: {reason}", file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name(dev)
    mode = "native FP4 MMA" if native else "emulated FP4 MMA (fp16 mma.sync)"
    rows = []
    b, h, d = 1, args.heads, args.head_dim
    for s in (int(x) for x in args.seqs.split(",")):
        g = torch.Generator(device="cuda").manual_seed(s)
        q, k, v = (torch.randn(b, h, s, d, generator=g, device=dev).to(torch.bfloat16) for _ in range(3))
        qq = quantize.quantize_qkv(q, k, v, layout="HND")
        for causal in (False, True):
            f = flops(b, h, s, d, causal)
            big = f > 2e13
            reps = args.reps or (2 if (big and not native) else 5)
            out = torch.empty(b, h, s, d, dtype=torch.bfloat16, device=dev)
            scale = 1.0 / math.sqrt(d)

            def kernel_only():
                attention_cuda.run_kernel(qq, qq.key_projections, out, None, scale=scale, causal=causal,
                                          kv_lens=None)

            def preparation():
                quantize.quantize_qkv(q, k, v, layout="HND")

            results = {"nvfp4 kernel": time_ms(kernel_only, reps), "nvfp4 quantize": time_ms(preparation, reps)}
            results["nvfp4 e2e"] = time_ms(lambda: attention_cuda.attention(
                q, k, v, layout="HND", causal=causal, scale=None, kv_lens=None, return_lse=False), reps)
            results["mxfp8 Q·Kᵀ e2e"] = time_ms(lambda: attention_cuda.attention(
                q, k, v, layout="HND", causal=causal, scale=None, kv_lens=None, return_lse=False,
                qk_format="mxfp8"), reps)
            for be in ("flash", "cudnn"):
                try:
                    results[f"sdpa {be}"] = time_ms(sdpa_fn(q, k, v, causal, be), max(reps, 5))
                except Exception as exc:  # a back-end missing on this build/GPU
                    print(f"sdpa {be} unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            for nm, fn in sage_fns(q, k, v, causal).items():
                try:
                    results[nm] = time_ms(fn, max(reps, 5))
                except Exception as exc:
                    print(f"{nm} failed: {exc}")
            for nm, ms in results.items():
                # The preprocessing row is a time, not attention: no TFLOP/s, no ratio to SDPA.
                rows.append(dict(s=s, causal=causal, impl=nm, ms=ms,
                                 tflops=None if nm in PREPROCESSING else f / ms / 1e9))
            ref = results.get("sdpa flash")
            print(f"S={s} causal={causal}: " + ", ".join(
                f"{nm} {ms:.2f} ms" + ("" if nm in PREPROCESSING else
                                       f" ({f / ms / 1e9:.0f} TF/s{'' if not ref else f', x{ref / ms:.2f} vs flash'})")
                for nm, ms in results.items()), flush=True)
        del qq, delta, q, k, v, out
        torch.cuda.empty_cache()

    write_report(rows, name=name, arch=f"sm_{cc[0]}{cc[1]}", mode=mode, b=b, h=h, d=d, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
