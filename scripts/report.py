#!/usr/bin/env python3
"""One markdown page with the project's accuracy and speed figures.

Runs, in order, and writes ``<out>/report.md`` with tables and PNG plots next to it:

1. the op accuracy report (``accuracy_report.py``: NVFP4 vs exact on DiT-like inputs);
2. NVFP4 inside tiny random models of every diffusers video family (model output vs the dense
   model, head dims 64 and 128);
3. an end-to-end tiny text-to-video generation, dense vs NVFP4 from the same seed
   (``generate_video.py --attention compare``): per-step DiT time, attention share, latent
   cosine and PSNR;
4. the calibrated per-layer policy against the uniform one;
5. block-sparse NVFP4 (``--keep-mass 0.9``): density per layer and step, the modelled sm_120 time
   at that density (``model_sm120.py``'s recorded baseline), latent cosine to exact;
6. a per-layer / per-step replay of captured attention calls (``capture_attention.py`` +
   ``replay_attention.py``);
7. the kernel benchmark (``bench_attention.py``) when a CUDA GPU is present.

On a CPU the FP4 numbers are the reference numerics (``backend="reference"``); on a GPU the
compiled kernel (``--backend cuda``).

    python scripts/report.py                       # CPU, a few minutes
    python scripts/report.py --device cuda --out docs/report
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import accuracy_report  # noqa: E402
import capture_attention  # noqa: E402
import generate_video  # noqa: E402
import replay_attention  # noqa: E402
from nvfp4_dit import format as fmt  # noqa: E402
from nvfp4_dit.calibration import format_table  # noqa: E402
from nvfp4_dit.policy import AttentionPolicy  # noqa: E402
import plotting  # noqa: E402


def _plt():
    return plotting.pyplot()


def section_accuracy(out: Path, device: str, backend: str, quick: bool) -> list[str]:
    png = out / "accuracy.png"
    argv = ["--png", str(png), "--device", device, "--backend", backend]
    if quick:   # short sequences, and without the classes of many Q blocks (8,192 tokens each)
        argv += ["--seq", "1024", "--heads", "2", "--without-many-blocks"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        accuracy_report.main(argv)
    table = [ln for ln in buf.getvalue().splitlines() if ln.startswith("|") or ln.startswith("NVFP4")]
    return ["## 1. Op accuracy on DiT-like inputs", "", *table, "", f"![accuracy]({png.name})", ""]


def section_families(out: Path, device: str, backend: str) -> list[str]:
    from nvfp4_dit.processors import apply
    from nvfp4_dit.processors.tiny_models.diffusers_families import FAMILIES, build

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for hd in fmt.SUPPORTED_HEAD_DIMS:
        for fam in FAMILIES:
            case = build(fam, head_dim=hd, dtype=dtype).to(device)
            dense = case.run()
            with apply(case.model, backend=backend, cross_attention=True, min_seq_len=0) as h:
                fp4 = case.run()
                n_proc = len(h.processors)
            o, d = fp4[0].double(), dense[0].double()
            rel = ((o - d).norm() / d.norm()).item()
            cos = torch.nn.functional.cosine_similarity(o.flatten(), d.flatten(), dim=0).item()
            rows.append((fam, hd, n_proc, cos, rel))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    names = sorted({r[0] for r in rows}, key=FAMILIES.index)
    for i, hd in enumerate(fmt.SUPPORTED_HEAD_DIMS):
        vals = [next((r[4] for r in rows if r[0] == n and r[1] == hd), 0) for n in names]
        ax.bar([j + 0.4 * i for j in range(len(names))], vals, 0.4, label=f"head dim {hd}")
    ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("rel-L2 of model output vs dense")
    ax.legend(fontsize=8)
    ax.set_title(f"NVFP4 ({backend}) in tiny random video DiTs, all attention FP4", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "families.png", dpi=110)
    plt.close(fig)
    lines = ["## 2. NVFP4 inside every diffusers video family (tiny random models)", "",
             f"Every attention call (self, joint and cross) routed to NVFP4 (`{backend}`), one forward, "
             f"{str(dtype).replace('torch.', '')}; output compared with the unmodified model.", "",
             "| family | head dim | NVFP4 processors | cos | rel-L2 |", "|---|---|---|---|---|"]
    lines += [f"| {f} | {hd} | {n} | {c:.6f} | {r:.4f} |" for f, hd, n, c, r in rows]
    return lines + ["", "![families](families.png)", ""]


def section_generation(out: Path, device: str, backend: str, quick: bool) -> list[str]:
    js = out / "tiny_generation.json"
    argv = ["--attention", "compare", "--out", str(out / "tiny_generation.mp4"), "--json", str(js),
            "--device", device, "--backend", backend, "--dense-steps", "1,1", "--no-video"]
    if quick:
        argv += ["--steps", "4"]
    with contextlib.redirect_stdout(io.StringIO()):
        generate_video.main(argv)
    rep = json.loads(js.read_text())
    runs = rep["runs"]
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for mode, color in (("sdpa", "#999999"), ("nvfp4", "#4c72b0")):
        steps = runs[mode]["steps"]
        axes[0].plot([s["step"] for s in steps], [s["dit_seconds"] for s in steps], "o-", color=color, label=mode)
        axes[1].plot([s["step"] for s in steps], [100 * (s["attention_share"] or 0) for s in steps], "o-",
                     color=color, label=mode)
    axes[0].set_title("DiT seconds per step", fontsize=10)
    axes[1].set_title("attention share of the step (%)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("denoising step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tiny_generation.png", dpi=110)
    plt.close(fig)
    c = rep["compare"]
    lines = ["## 3. End-to-end tiny text-to-video: dense vs NVFP4 from the same seed", "",
             f"`python scripts/generate_video.py --attention compare` ({rep['model']}, {rep['device']}, "
             f"FP4 back-end `{rep['backend']}`, dense steps {rep['dense_steps']}, cross-attention dense).", "",
             f"Latent cosine {c.get('latent_cos', float('nan')):.6f}, latent rel-L2 {c.get('latent_rel_l2', float('nan')):.5f}, "
             f"latent PSNR {c.get('latent_psnr_db', float('nan')):.1f} dB, frame PSNR {c['frames_psnr_db']:.1f} dB.", "",
             "| run | step | DiT s | attention s | share | FP4 calls | exact calls |", "|---|---|---|---|---|---|---|"]
    for mode in ("sdpa", "nvfp4"):
        for s in runs[mode]["steps"]:
            lines.append(f"| {mode} | {s['step']} | {s['dit_seconds']:.3f} | {s['attention_seconds']:.3f} | "
                         f"{100 * (s['attention_share'] or 0):.1f}% | {s['fp4_calls']} | {s['exact_calls']} |")
    seq = runs["nvfp4"]["sequence_lengths"]
    lines += ["", "Sequence lengths: " + ", ".join(f"`{k}` {v['q_len']}x{v['k_len']}" for k, v in seq.items()),
              "", "![tiny generation](tiny_generation.png)", ""]
    return lines


def section_calibration(out: Path, device: str, backend: str, quick: bool) -> list[str]:
    common = ["--attention", "compare", "--device", device, "--backend", backend, "--dense-steps", "1,1",
              "--no-video"] + (["--steps", "4"] if quick else [])
    reports = {}
    for run, extra in (("uniform", []), ("calibrated", ["--calibrate"])):
        js = out / f"tiny_{run}.json"
        with contextlib.redirect_stdout(io.StringIO()):
            generate_video.main([*common, *extra, "--out", str(out / f"tiny_{run}.mp4"), "--json", str(js)])
        reports[run] = json.loads(js.read_text())
    lines = ["## 4. Calibrated per-layer policy against the uniform default (tiny model)", "",
             "`generate_video.py --attention compare` with the default policy and with `--calibrate` "
             f"(budget {reports['calibrated']['policy']['budget']}), same seed, FP4 back-end `{backend}`; "
             "each compared with the dense run.", "",
             "| policy | latent cos | latent rel-L2 | attention share | FP4 calls | exact calls |", "|---|---|---|---|---|---|"]
    for run, rep in reports.items():
        r, c = rep["runs"]["nvfp4"], rep["compare"]
        fp4 = sum(s["fp4_calls"] for s in r["steps"])
        exact = sum(s["exact_calls"] for s in r["steps"])
        lines.append(f"| {run} | {c['latent_cos']:.6f} | {c['latent_rel_l2']:.5f} | "
                     f"{100 * (r['attention_share'] or 0):.1f}% | {fp4} | {exact} |")
    policy = AttentionPolicy.from_dict(reports["calibrated"]["policy"])
    return lines + ["", "Per-layer table of the calibrated policy:", "", format_table(policy), ""]


def section_sparse(out: Path, device: str, backend: str, quick: bool) -> list[str]:
    """Block-sparse NVFP4 (keep_mass 0.9) against the dense run: density per layer and step, the
    modelled sm_120 attention time at that density, latent cos to exact."""
    import model_sm120

    js = out / "tiny_sparse.json"
    argv = ["--attention", "compare", "--device", device, "--backend", backend, "--dense-steps", "1,1", "--no-video",
            "--keep-mass", "0.9", "--sparse-off-steps", "1,0", "--sparse-min-seq-len", "0",
            "--out", str(out / "tiny_sparse.mp4"), "--json", str(js)] + (["--steps", "4"] if quick else [])
    with contextlib.redirect_stdout(io.StringIO()):
        generate_video.main(argv)
    rep = json.loads(js.read_text())
    run, c = rep["runs"]["nvfp4"], rep["compare"]
    # The recorded model of the native kernel (scripts/model_sm120_baseline.json): dense and
    # block-sparse clocks per tile, non-causal NVFP4.
    baseline = {(r["head_dim"], r["causal"], r["qk_format"]): r for r in json.loads(model_sm120.BASELINE.read_text())}
    lines = ["## 5. Block-sparse NVFP4 (tiny model)", "",
             "`generate_video.py --attention compare --keep-mass 0.9 --sparse-off-steps 1,0 --sparse-min-seq-len 0`"
             f" (FP4 back-end `{backend}`): the share of key tiles each layer's estimate kept per step, the "
             "modelled sm_120 attention time at that density against dense (`scripts/model_sm120.py`, its "
             "recorded baseline) and the latent against the exact run. The tiny model has 3 key tiles per call, "
             "so its densities say little about a real model's.", "",
             f"Latent cosine to exact {c.get('latent_cos', float('nan')):.6f}, rel-L2 "
             f"{c.get('latent_rel_l2', float('nan')):.5f}.", "",
             "| layer | step | density | modelled sm_120 time vs dense |", "|---|---|---|---|"]
    seqs = run["sequence_lengths"]
    for layer, per_step in run["sparse_density"].items():
        shape = seqs[layer]
        row = baseline.get((shape["head_dim"], False, "nvfp4"))
        for step, density in per_step.items():
            modelled = "-" if row is None else f"{model_sm120.time_vs_dense(row, density, shape['k_len']):.3f}"
            lines.append(f"| {layer} | {step} | {density:.3f} | {modelled} |")
    return lines + [""]


def section_replay(out: Path, device: str, backend: str, quick: bool) -> list[str]:
    cap = out / "capture.safetensors"
    n_steps = 2 if quick else 4
    with contextlib.redirect_stdout(io.StringIO()):
        capture_attention.main(["--steps", str(n_steps), "--max-calls", str(8 * n_steps),
                                "--out", str(cap), "--device", device])
    calls, _ = capture_attention.load_capture(cap)
    backends = ["sdpa", "reference"] + (["cuda"] if device == "cuda" else [])
    rows = replay_attention.replay(calls, backends, torch.device(device))
    replay_attention.plot(rows, backends, out / "replay.png")
    cap.unlink()  # tens of MB of tensors; the report keeps the numbers
    agg = {}
    for r in rows:
        agg.setdefault((r["layer"], r["backend"]), []).append(r)
    lines = ["## 6. Per-layer replay of captured attention calls", "",
             f"`capture_attention.py` on a dense tiny run ({n_steps} steps, both CFG branches), then "
             "`replay_attention.py` against float64 exact attention.  alpha = <out, exact>/<out, out>.", "",
             "| layer | back-end | calls | cos (mean) | rel-L2 (mean / max) | alpha (mean) | mean abs LSE err |",
             "|---|---|---|---|---|---|---|"]
    for (layer, b), rs in agg.items():
        n = len(rs)
        lines.append(f"| {layer} | {b} | {n} | {sum(r['cos'] for r in rs) / n:.5f} | "
                     f"{sum(r['rel_l2'] for r in rs) / n:.4f} / {max(r['rel_l2'] for r in rs):.4f} | "
                     f"{sum(r['alpha'] for r in rs) / n:.4f} | {sum(r['lse_err'] for r in rs) / n:.4f} |")
    exact = all(r["live_bit_exact"] for r in rows)
    lines += ["", f"Live outputs reproduced bit-exactly by the replay: {'yes' if exact else 'NO'}.", "",
              "![replay](replay.png)", ""]
    return lines


def section_bench(out: Path, device: str, seqs: str) -> list[str]:
    head = ["## 7. Kernel benchmark", ""]
    if device != "cuda":
        return head + ["Needs a CUDA GPU: `python scripts/report.py --device cuda`.", ""]
    stem = out / "bench"
    cmd = [sys.executable, str(HERE / "bench_attention.py"), "--out", str(stem), "--seqs", seqs]
    res = subprocess.run(cmd, capture_output=True, text=True)
    md = Path(str(stem) + ".md")
    if res.returncode != 0 or not md.exists():
        return head + ["Benchmark failed:", "", "```", (res.stdout + res.stderr)[-2000:], "```", ""]
    body = md.read_text().splitlines()
    return head + [ln if not ln.startswith("# ") else "**" + ln[2:] + "**" for ln in body] + ["", "![bench](bench.png)", ""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/report", help="folder for report.md and its PNGs (default out/report)")
    ap.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    ap.add_argument("--quick", action="store_true", help="smaller inputs and fewer steps (CI)")
    ap.add_argument("--bench-seqs", default=None, help="sequence lengths for the benchmark (default 8192,32768; "
                    "--quick: 8192)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: "
                    "accuracy,families,generation,calibration,sparse,replay,bench")
    args = ap.parse_args(argv)

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    backend = "cuda" if device == "cuda" else "reference"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none"
    lines = ["# nvfp4_dit: accuracy and speed", "",
             f"Generated by `python scripts/report.py{' --quick' if args.quick else ''}` on {device} (GPU: {gpu}), "
             f"torch {torch.__version__}; FP4 numbers from `backend=\"{backend}\"`.", ""]
    sections = [
        ("accuracy", lambda: section_accuracy(out, device, backend, args.quick)),
        ("families", lambda: section_families(out, device, backend)),
        ("generation", lambda: section_generation(out, device, backend, args.quick)),
        ("calibration", lambda: section_calibration(out, device, backend, args.quick)),
        ("sparse", lambda: section_sparse(out, device, backend, args.quick)),
        ("replay", lambda: section_replay(out, device, backend, args.quick)),
        ("bench", lambda: section_bench(out, device, args.bench_seqs or ("8192" if args.quick else "8192,32768"))),
    ]
    for name, fn in sections:
        if name in skip:
            continue
        print(f"[report] {name} ...", flush=True)
        lines += fn()
    lines.append(f"_({time.perf_counter() - t0:.0f} s)_")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
