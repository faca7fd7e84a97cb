#!/usr/bin/env python3
"""NVFP4 attention accuracy against exact attention on synthetic DiT-like inputs.

Prints a markdown table (cosine similarity, relative L2 error, least-squares scale alpha,
mean |LSE error|) for several input families and saves a PNG bar chart.  Runs on a CPU in well
under two minutes with the defaults; pass ``--device cuda --backend cuda`` on a GPU to check the
compiled kernel the same way.

    python scripts/accuracy_report.py                  # reference numerics on the CPU
    python scripts/accuracy_report.py --seq 4096 --heads 8 --png out/accuracy.png
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nvfp4_dit  # noqa: E402
from nvfp4_dit import format as fmt  # noqa: E402
from nvfp4_dit.reference import attention_exact  # noqa: E402


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding over the token axis of [B, S, H, D] (half-split rotation)."""
    _, s, _, d = x.shape
    half = d // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def make_inputs(kind: str, b: int, s: int, h: int, d: int, gen: torch.Generator):
    """Q, K, V [B, S, H, D] fp32 shaped like one family of DiT attention inputs."""
    q = torch.randn(b, s, h, d, generator=gen)
    k = torch.randn(b, s, h, d, generator=gen)
    v = torch.randn(b, s, h, d, generator=gen)
    if kind == "iid":
        pass
    elif kind == "block-structured Q":
        # Spatial regions of the latent share a large query offset (what per-block means absorb).
        nblk = (s + 127) // 128
        q = q + 3.0 * torch.randn(b, nblk, h, d, generator=gen).repeat_interleave(128, 1)[:, :s]
    elif kind == "K channel outliers":
        # A few channels of K carry a large common bias (what the K mean absorbs) and heavy tails.
        scale = torch.ones(d)
        scale[torch.randperm(d, generator=gen)[: d // 16]] = 8.0
        k = k * scale + 4.0 * torch.randn(1, 1, h, d, generator=gen)
    elif kind == "RoPE Q/K":
        # Sharper attention through position: correlated Q/K rotated by RoPE.
        base = torch.randn(b, s, h, d, generator=gen)
        q, k = rope(base + 0.5 * q), rope(base + 0.5 * k)
    else:
        raise ValueError(kind)
    return q, k, v


KINDS = ("iid", "block-structured Q", "K channel outliers", "RoPE Q/K")


def metrics(out: torch.Tensor, exact: torch.Tensor, lse: torch.Tensor, lse_exact: torch.Tensor):
    o, e = out.double().flatten(), exact.double().flatten()
    cos = torch.nn.functional.cosine_similarity(o, e, dim=0).item()
    rel = ((o - e).norm() / e.norm()).item()
    alpha = ((o * e).sum() / (o * o).sum()).item()
    finite = torch.isfinite(lse_exact)
    lse_err = (lse.double() - lse_exact)[finite].abs().mean().item()
    return cos, rel, alpha, lse_err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128, choices=fmt.SUPPORTED_HEAD_DIMS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backend", default="reference", choices=("reference", "cuda"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--png", default="out/accuracy_report.png", help="where to save the plot ('' for none)")
    args = ap.parse_args(argv)

    gen = torch.Generator().manual_seed(args.seed)
    dtype = torch.bfloat16 if args.backend == "cuda" else torch.float32
    rows = []
    t0 = time.time()
    for kind in KINDS:
        q, k, v = make_inputs(kind, args.batch, args.seq, args.heads, args.head_dim, gen)
        q, k, v = (t.to(args.device, dtype) for t in (q, k, v))
        out, lse = nvfp4_dit.attention(q, k, v, backend=args.backend, return_lse=True)
        exact, lse_exact = attention_exact(q, k, v)
        rows.append((kind, *metrics(out.cpu(), exact.cpu(), lse.cpu(), lse_exact.cpu())))

    print(f"NVFP4 attention ({args.backend}) vs exact fp64 attention: B={args.batch} S={args.seq} "
          f"H={args.heads} D={args.head_dim}, seed {args.seed}\n")
    print("| input | cos | rel-L2 | alpha | mean abs LSE error |")
    print("|---|---|---|---|---|")
    for kind, cos, rel, alpha, lse_err in rows:
        print(f"| {kind} | {cos:.5f} | {rel:.4f} | {alpha:.4f} | {lse_err:.4f} |")
    print(f"\n({time.time() - t0:.1f} s)")

    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(args.png)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
        names = [r[0] for r in rows]
        for ax, col, title in zip(axes, (1, 2, 4), ("cosine similarity", "relative L2 error", "mean |LSE error|")):
            ax.bar(range(len(rows)), [r[col] for r in rows], color="#4c72b0")
            ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
            ax.set_title(title, fontsize=10)
            if col == 1:
                ax.set_ylim(min(r[1] for r in rows) - 0.01, 1.0)
        fig.suptitle(f"NVFP4 ({args.backend}) vs exact, S={args.seq} H={args.heads} D={args.head_dim}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
