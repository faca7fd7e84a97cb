"""``python -m nvfp4_dit.selftest``: check the CUDA kernel on this GPU and write a report to attach to
a bug report (``nvfp4_dit_selftest.json`` and ``.md``).

The report holds the environment (GPU, driver, torch, CUDA, where the kernels come from), the
first-use known-answer checks of every head dim and Q·Kᵀ format (:mod:`nvfp4_dit.selftest`), a
sampled long-sequence check against the reference numerics, and a speed table against SDPA (and
FlashInfer / SageAttention3 where installed). :func:`environment` also names the GPU and driver in
the self-test's failure warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from . import format as fmt
from . import preprocess

REPORT_FILES = ("nvfp4_dit_selftest.json", "nvfp4_dit_selftest.md")


def _display_driver() -> str:
    try:
        import pynvml  # nvidia-ml-py, when installed

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - optional
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            res = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10)
            if res.returncode == 0 and res.stdout.strip():
                return res.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"


def environment(device=None) -> dict:
    """GPU, driver, torch, CUDA and build facts for reports and warnings."""
    from . import __version__
    from .cuda import build

    info = {"nvfp4_dit": __version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda or "none",
            "python": platform.python_version(), "platform": platform.platform()}
    if not torch.cuda.is_available():
        return {**info, "gpu": "none", "driver": "none"}
    device = torch.device("cuda") if device is None else torch.device(device)
    props = torch.cuda.get_device_properties(device)
    cc = (props.major, props.minor)
    try:
        from .cuda import driver

        driver_api = driver.driver_version()
        driver_api = f"{driver_api // 1000}.{driver_api % 1000 // 10}"
    except Exception:  # noqa: BLE001 - informational only (cuda.bindings missing, no driver)
        driver_api = "unknown"
    try:
        arch = build.arch_for_capability(*cc)
    except build.KernelBuildError:
        arch = "none"
    return {**info, "gpu": props.name, "compute_capability": f"{cc[0]}.{cc[1]}", "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "driver": _display_driver(),
            "cuda_driver_api": driver_api, "arch": arch, "mma": build.mma_kind(cc) or "none",
            "kernels": build.describe_loaded(arch)}


LONG_MIN_COS = 0.9999         # kernel against the reference numerics on the same quantised inputs
LONG_MAX_LSE_ERROR = 2e-3


def sampled_long_check(seq: int, device, qk_format: str = "nvfp4", heads: int = 2, head_dim: int = 128) -> dict:
    """The kernel at ``seq`` tokens (B1, bf16, N(0,1)) on its first, middle and last 128-row Q
    blocks, against the reference numerics (same format, same quantised inputs): a long-sequence
    bug (an int32 offset, a chunk boundary) shows up there. The cosine to exact attention is
    reported too, as FP4's own error at this length, not as a pass mark: with iid inputs over 77k
    keys the softmax is nearly flat and the output is a small average of V, which 4-bit V resolves
    only to about 0.96."""
    import nvfp4_dit
    from .reference import attention_exact, attention_reference

    gen = torch.Generator(device=device).manual_seed(seq)
    q, k, v = (torch.randn(1, seq, heads, head_dim, generator=gen, device=device).to(torch.bfloat16)
               for _ in range(3))
    out, lse = nvfp4_dit.attention(q, k, v, backend="cuda", return_lse=True, qk_format=qk_format)
    quantized = preprocess.quantize_qkv(q, k, v, qk_format=qk_format)
    nblk = -(-seq // fmt.SEQ_TILE)
    got_rows, ref_rows, exact_rows, lse_err = [], [], [], 0.0
    for blk in sorted({0, nblk // 2, nblk - 1}):
        rows = slice(blk * fmt.SEQ_TILE, min(seq, (blk + 1) * fmt.SEQ_TILE))
        ref, ref_lse = attention_reference(q, k, v, return_lse=True, query_blocks=(blk, blk + 1),
                                           quantized=quantized, qk_format=qk_format)
        exact_rows.append(attention_exact(q[:, rows], k, v, dtype=torch.float32)[0][0])
        got_rows.append(out[0, rows].float())
        ref_rows.append(ref[0].float())
        lse_err = max(lse_err, (lse[0, :, rows] - ref_lse[0]).abs().max().item())
    got, ref, exact = (torch.cat(t).flatten(0, 1) for t in (got_rows, ref_rows, exact_rows))
    cos_ref = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    cos_exact = torch.nn.functional.cosine_similarity(got, exact, dim=-1)
    finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    return {"seq": seq, "heads": heads, "head_dim": head_dim, "qk_format": qk_format, "rows": int(got.shape[0]),
            "cos_vs_reference": round(cos_ref, 6), "max_lse_error_vs_reference": float(f"{lse_err:.3g}"),
            "mean_cos_vs_exact": round(cos_exact.mean().item(), 4), "finite": finite,
            "ok": finite and cos_ref >= LONG_MIN_COS and lse_err <= LONG_MAX_LSE_ERROR}


def _time_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _peers(q, k, v) -> dict[str, Callable[[], object]]:
    """Attention implementations to time on NHD q, k, v; optional ones only where installed."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import nvfp4_dit

    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qh, kh, vh)
        return run

    peers = {"SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION), "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION),
             "nvfp4_dit": lambda: nvfp4_dit.attention(q, k, v, backend="cuda")}
    try:
        import flashinfer

        peers["FlashInfer"] = lambda: flashinfer.single_prefill_with_kv_cache(q[0], k[0], v[0])
    except Exception:  # noqa: BLE001 - optional peer
        pass
    try:
        from sageattn3 import sageattn3_blackwell

        peers["SageAttention3"] = lambda: sageattn3_blackwell(qh, kh, vh)
    except Exception:  # noqa: BLE001 - optional peer
        pass
    return peers


def speed_table(seqs: Sequence[int], device, heads: int = 24, head_dim: int = 128, reps: int = 5) -> list[dict]:
    """Milliseconds per call of each peer, and its speed relative to the fastest SDPA (> 1: faster)."""
    rows = []
    for seq in seqs:
        gen = torch.Generator(device=device).manual_seed(seq)
        q, k, v = (torch.randn(1, seq, heads, head_dim, generator=gen, device=device).to(torch.bfloat16)
                   for _ in range(3))
        flops = 4.0 * seq * seq * head_dim * heads
        times = {}
        for name, fn in _peers(q, k, v).items():
            try:
                times[name] = _time_ms(fn, reps)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                times[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        sdpa = [t for n, t in times.items() if n.startswith("SDPA") and isinstance(t, float)]
        best = min(sdpa) if sdpa else None
        for name, t in times.items():
            row = {"seq": seq, "heads": heads, "head_dim": head_dim, "impl": name}
            if isinstance(t, float):
                row.update(ms=round(t, 3), tflops=round(flops / t / 1e9, 1),
                           vs_best_sdpa=round(best / t, 3) if best else None)
            else:
                row.update(error=t)
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def _markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# nvfp4_dit self-test", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    if report.get("note"):
        lines += ["", report["note"]]
    lines += ["", "## Known-answer checks", "",
              "| head dim | Q·Kᵀ | check | result | detail | first-use seconds |", "|---|---|---|---|---|---|"]
    for v in report["known_answer"]:
        for c in v["checks"]:
            lines.append(f"| {v['head_dim']} | {v['qk_format']} | {c['name']} | {'ok' if c['ok'] else 'FAILED'} | {c['detail']} | "
                         f"{v['seconds']:.4f} |")
    if report.get("long_sequence"):
        lines += ["", "## Long sequence: first, middle and last Q blocks against the reference numerics", "",
                  f"Pass: cosine >= {LONG_MIN_COS} and LSE within {LONG_MAX_LSE_ERROR} of the reference. The cosine to "
                  "exact attention is FP4's own error at this length (information).", "",
                  "| tokens | heads | D | Q·Kᵀ | rows | cos vs reference | LSE error vs reference | mean cos vs exact "
                  "| finite | result |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["long_sequence"]:
            lines.append(f"| {r['seq']} | {r['heads']} | {r['head_dim']} | {r['qk_format']} | {r['rows']} | "
                         f"{r['cos_vs_reference']} | {r['max_lse_error_vs_reference']} | {r['mean_cos_vs_exact']} | "
                         f"{r['finite']} | {'ok' if r['ok'] else 'FAILED'} |")
    if report.get("speed"):
        lines += ["", "## Speed (B1, bf16, median of timed calls)", "",
                  "| tokens | heads | D | implementation | ms | TFLOP/s | speed vs fastest SDPA |", "|---|---|---|---|---|---|---|"]
        for r in report["speed"]:
            if "error" in r:
                lines.append(f"| {r['seq']} | {r['heads']} | {r['head_dim']} | {r['impl']} | - | - | {r['error']} |")
            else:
                lines.append(f"| {r['seq']} | {r['heads']} | {r['head_dim']} | {r['impl']} | {r['ms']} | {r['tflops']} | "
                             f"{r['vs_best_sdpa']} |")
    lines += ["", f"Result: **{'PASS' if report['passed'] else 'FAIL'}**", ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvfp4_dit.selftest",
                                     description="Check the nvfp4_dit CUDA kernel on this GPU and write a report "
                                                 "to attach to a bug report.")
    parser.add_argument("--out", default=".", help="folder for nvfp4_dit_selftest.json and .md (default: here)")
    parser.add_argument("--long-seq", type=int, default=77_000, help="tokens of the sampled long-sequence check "
                        "(0 skips it; default 77000)")
    parser.add_argument("--speed-seqs", default="8192,32768",
                        help="comma-separated sequence lengths of the speed table (empty skips it)")
    parser.add_argument("--speed-heads", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5, help="timed calls per speed entry")
    args = parser.parse_args(argv)
    try:
        speed_seqs = [int(s) for s in args.speed_seqs.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--speed-seqs must be comma-separated integers, got {args.speed_seqs!r}")
    if args.long_seq < 0 or args.reps < 1 or args.speed_heads < 1:
        parser.error("--long-seq must be >= 0, --reps and --speed-heads >= 1")

    if not torch.cuda.is_available():
        print("nvfp4_dit self-test: no CUDA GPU is visible to torch "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). The self-test checks the "
              "CUDA kernel and needs a GPU. On a CPU, backend='auto' runs exact attention (SDPA) and "
              "backend='reference' the FP4 numerics in PyTorch.", file=sys.stderr)
        return 2
    from .cuda import build
    from .selftest import _verify_key, kernel_key

    device = torch.device("cuda")
    reason = build.unavailable_reason(device)
    env = environment(device)
    print("\n".join(f"{k:>18}: {v}" for k, v in env.items()))
    if reason is not None:
        print(f"\nnvfp4_dit self-test: the CUDA kernel cannot run here: {reason}", file=sys.stderr)
        return 2
    env = environment(device)   # now with the loaded kernels
    note = None
    if env["mma"] == "emulated":
        note = (f"{env['arch']}: the FP4 MMA is emulated with fp16 MMAs (same registers, same kernel). This checks "
                "the kernel, not sm_120 hardware, and its speed is not the product's.")
        print("\nnote:", note)

    report = {"environment": env, "note": note, "known_answer": []}
    for d in fmt.SUPPORTED_HEAD_DIMS:
        for qk_format in fmt.QK_FORMATS:
            verdict = _verify_key(kernel_key(device, d, qk_format))
            report["known_answer"].append({"head_dim": d, "qk_format": qk_format, "ok": verdict.ok,
                                           "seconds": round(verdict.seconds, 4),
                                           "checks": [dataclasses.asdict(c) for c in verdict.checks]})
            for c in verdict.checks:
                print(f"known answer D={d} {qk_format} {c.name:>11}: {'ok' if c.ok else 'FAILED'}  {c.detail}")
            print(f"known answer D={d} {qk_format}: {verdict.seconds * 1e3:.1f} ms")
    passed = all(v["ok"] for v in report["known_answer"])
    if passed and args.long_seq:
        report["long_sequence"] = []
        for qk_format in fmt.QK_FORMATS:
            r = sampled_long_check(args.long_seq, device, qk_format)
            report["long_sequence"].append(r)
            print(f"long sequence {r['seq']} tokens {qk_format}: cos vs reference {r['cos_vs_reference']}, LSE error "
                  f"{r['max_lse_error_vs_reference']}, mean cos vs exact {r['mean_cos_vs_exact']}: "
                  f"{'ok' if r['ok'] else 'FAILED'}")
            torch.cuda.empty_cache()
        passed = all(r["ok"] for r in report["long_sequence"])
    if passed and speed_seqs:
        report["speed"] = speed_table(speed_seqs, device, heads=args.speed_heads, reps=args.reps)
        for r in report["speed"]:
            print(f"speed S={r['seq']:>6} {r['impl']:>15}: " +
                  (f"{r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s  x{r['vs_best_sdpa']}" if "ms" in r else r["error"]))
    report["passed"] = passed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILES[0]).write_text(json.dumps(report, indent=2) + "\n")
    (out / REPORT_FILES[1]).write_text(_markdown(report))
    print(f"\n{'PASS' if passed else 'FAIL'}: wrote {out / REPORT_FILES[0]} and {out / REPORT_FILES[1]}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
