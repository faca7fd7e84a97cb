#!/usr/bin/env python3
"""Replay captured attention calls through every back-end and compare them with exact attention.

Reads a file written by ``capture_attention.py`` and, for every call, runs q/k/v (with the
call's mask, causal flag, scale and GQA setting) through nvfp4_dit's router with each back-end,
and compares with exact attention computed in float64: cosine similarity, relative L2 error,
least-squares scale alpha (<out, exact> / <out, out>; 1 = no magnitude bias) and the mean
|LSE error|.  It also replays each call with the back-end and path it ran live and checks that
the output reproduces the captured one bit for bit.

    python scripts/replay_attention.py out/capture.safetensors
    python scripts/replay_attention.py out/capture.safetensors --backends sdpa,reference,cuda --device cuda \\
        --png out/replay.png --json out/replay.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accuracy_report import metrics  # noqa: E402
from capture_attention import load_capture  # noqa: E402
import plotting  # noqa: E402
from nvfp4_dit import AttentionPolicy, BACKENDS  # noqa: E402
from nvfp4_dit.processors import routing  # noqa: E402


def live_exact(call, q, k, v, mask):
    """The exact computation the model's own code ran for this call (diffusers' native backend
    for the dispatcher's NHD layout, a direct SDPA call for HND)."""
    kw = dict(attn_mask=mask, dropout_p=0.0, is_causal=call["is_causal"], scale=call["scale"],
              enable_gqa=call["enable_gqa"])
    if call["layout"] == "NHD":
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, **kw).permute(0, 2, 1, 3)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def exact64(call, q, k, v, mask, chunk: int = 1024):
    """Exact attention in float64: (out in the call's layout, lse [B, H, Sq])."""
    hnd = (lambda t: t.permute(0, 2, 1, 3)) if call["layout"] == "NHD" else (lambda t: t)
    qh, kh, vh = (hnd(t).double().cpu() for t in (q, k, v))
    h, hkv = qh.shape[1], kh.shape[1]
    if h != hkv:
        kh, vh = kh.repeat_interleave(h // hkv, 1), vh.repeat_interleave(h // hkv, 1)
    scale = call["scale"] if call["scale"] is not None else 1.0 / math.sqrt(qh.shape[-1])
    sq, sk = qh.shape[2], kh.shape[2]
    m = None if mask is None else mask.cpu()
    outs, lses = [], []
    for r0 in range(0, sq, chunk):
        s = qh[:, :, r0:r0 + chunk] @ kh.transpose(-1, -2) * scale
        if m is not None:
            mm = m if m.dim() < 2 or m.shape[-2] == 1 else m[..., r0:r0 + chunk, :]
            s = s.masked_fill(~mm, -math.inf) if mm.dtype == torch.bool else s + mm.double()
        if call["is_causal"]:
            rows = torch.arange(r0, min(r0 + chunk, sq))[:, None]
            s = s.masked_fill(torch.arange(sk)[None, :] > rows, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(p @ vh)
        lses.append(lse)
    out = torch.cat(outs, 2)
    return (out.permute(0, 2, 1, 3) if call["layout"] == "NHD" else out), torch.cat(lses, 2)


def run_backend(call, q, k, v, mask, backend, *, return_lse, observe_only=False):
    policy = AttentionPolicy(backend=backend, min_seq_len=0)
    return routing.routed_attention(
        q, k, v, layout=call["layout"], attn_mask=mask, is_causal=call["is_causal"], scale=call["scale"],
        enable_gqa=call["enable_gqa"], return_lse=return_lse, policy=policy,
        observe=routing.OBSERVE_ONLY if observe_only else None, exact=lambda: live_exact(call, q, k, v, mask))


def replay(calls, backends, device, progress: bool = False) -> list[dict]:
    from tqdm.auto import tqdm

    rows = []
    for call in tqdm(calls, desc="replay", unit="call", disable=not progress):
        q, k, v = (call[n].to(device) for n in ("q", "k", "v"))
        mask = call["mask"].to(device) if call.get("mask") is not None else None
        live = run_backend(call, q, k, v, mask, call["backend"], return_lse=False,
                           observe_only=call["path"] != "fp4")
        bit_exact = torch.equal(live.cpu(), call["out"])
        ex, ex_lse = exact64(call, q, k, v, mask)
        for b in backends:
            out, lse = run_backend(call, q, k, v, mask, b, return_lse=True)
            cos, rel, alpha, lse_err = metrics(out.cpu(), ex, lse.cpu(), ex_lse)
            rows.append({"index": call["index"], "layer": call["layer"], "step": call["step"], "backend": b,
                         "q_len": q.shape[2 if call["layout"] == "HND" else 1],
                         "k_len": k.shape[2 if call["layout"] == "HND" else 1],
                         "cos": cos, "rel_l2": rel, "alpha": alpha, "lse_err": lse_err,
                         "live_path": call["path"], "live_backend": call["backend"], "live_bit_exact": bit_exact})
    return rows


def plot(rows, backends, path: Path) -> None:
    plt = plotting.pyplot()

    layers = sorted({r["layer"] for r in rows})
    steps = sorted({r["step"] for r in rows if r["step"] is not None})
    fig, axes = plt.subplots(1, len(backends), figsize=(4.2 * len(backends), 0.35 * len(layers) + 2.2), squeeze=False)
    for ax, b in zip(axes[0], backends):
        grid = torch.full((len(layers), max(len(steps), 1)), float("nan"))
        acc = defaultdict(list)
        for r in rows:
            if r["backend"] == b:
                acc[(layers.index(r["layer"]), steps.index(r["step"]) if r["step"] in steps else 0)].append(r["rel_l2"])
        for (i, j), vals in acc.items():
            grid[i, j] = sum(vals) / len(vals)
        im = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis")
        ax.set_title(f"{b}: rel-L2 vs exact", fontsize=9)
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        ax.set_xticks(range(len(steps)), steps, fontsize=7)
        ax.set_xlabel("step")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def live_label(row) -> str:
    return row["live_path"] + ("/" + row["live_backend"] if row["live_path"] == "fp4" else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture", help="a .safetensors file from capture_attention.py")
    ap.add_argument("--backends", default=None,
                    help="comma-separated back-ends (default: sdpa,reference, plus cuda when a GPU is present)")
    ap.add_argument("--device", default="auto", help="where to run the replay (auto: cuda if available)")
    ap.add_argument("--png", default=None, help="heatmap of rel-L2 per layer and step, one panel per back-end")
    ap.add_argument("--json", default=None, help="write every row as JSON")
    args = ap.parse_args(argv)
    if args.png:
        plotting.require("--png")

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    backends = args.backends.split(",") if args.backends else (
        ["sdpa", "reference"] + (["cuda"] if device.type == "cuda" else []))
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"unknown back-end {b!r}; choose from {BACKENDS}")
    calls, meta = load_capture(args.capture)
    print(f"{len(calls)} calls from {meta.get('model')} ({meta.get('attention')} run), replayed on {device}")
    rows = replay(calls, backends, device, progress=True)
    print("\n| call | layer | step | q x k | back-end | cos | rel-L2 | alpha | mean abs LSE err | live path | live bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['index']} | {r['layer']} | {r['step']} | {r['q_len']}x{r['k_len']} | {r['backend']} | {r['cos']:.5f} "
              f"| {r['rel_l2']:.4f} | {r['alpha']:.4f} | {r['lse_err']:.4f} | {live_label(r)} "
              f"| {'yes' if r['live_bit_exact'] else 'NO'} |")
    by = defaultdict(list)
    for r in rows:
        by[r["backend"]].append(r)
    print("\nper back-end (mean over calls): " + "; ".join(
        f"{b}: cos {sum(r['cos'] for r in rs) / len(rs):.5f}, rel-L2 {sum(r['rel_l2'] for r in rs) / len(rs):.4f}"
        for b, rs in by.items()))
    exact_live = all(r["live_bit_exact"] for r in rows)
    print(f"live outputs reproduced bit-exactly: {'all' if exact_live else 'NOT all'}")
    if args.png:
        plot(rows, backends, Path(args.png))
        print(f"plot: {args.png}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if exact_live else 2


if __name__ == "__main__":
    sys.exit(main())
