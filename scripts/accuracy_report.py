#!/usr/bin/env python3
"""NVFP4 attention accuracy against exact attention on synthetic DiT-like inputs.

Prints a markdown table (cosine similarity, relative L2 error, least-squares scale alpha,
mean |LSE error|) for several input families, for NVFP4 Q·Kᵀ without and with the channel
balance and for MXFP8 Q·Kᵀ (``qk_format="mxfp8"``, balance on), and saves a PNG bar chart.  The classes
named "(64 blocks)" run at least 8,192 tokens (64 Q blocks of their own means, video ones also in
3D tiles), the others ``--seq``. Runs on a CPU in a few minutes with the defaults; pass ``--device
cuda --backend cuda`` on a GPU to check the compiled kernel the same way.

    python scripts/accuracy_report.py                  # reference numerics on the CPU
    python scripts/accuracy_report.py --seq 4096 --heads 8 --png out/accuracy.png
    python scripts/accuracy_report.py --sparse         # block-sparse: keep_mass against accuracy

``--sparse`` reports block-sparse attention instead (``keep_mass`` 0.8 to 1.0, the block map
estimated in the call): cos, relative L2 and LSE error to exact fp64 attention over all keys, and
the density of the map chosen, on iid inputs (diffuse attention: the estimate must keep nearly
every tile) and on video-structured inputs (``scripts/video_inputs.py``: 3D RoPE, smooth content
plus noise, logit gain ``--sparse-gain``, on the latent grid ``--sparse-grid``, default 10 frames
of Wan's 480p 30 x 52) in raster order and in the op's 3D tiles (``video_grid=``,
:mod:`nvfp4_dit.token_order`); then, at matched cos (interpolated over ``keep_mass`` 0.8-0.99),
the tiles the 3D order keeps against raster order.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nvfp4_dit  # noqa: E402
import plotting  # noqa: E402
import video_inputs  # noqa: E402
from nvfp4_dit import format as fmt  # noqa: E402
from nvfp4_dit import sparse  # noqa: E402
from nvfp4_dit.reference import attention_exact  # noqa: E402

KEEP_MASSES = (0.8, 0.85, 0.9, 0.95, 0.99, 1.0)


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding over the token axis of [B, S, H, D] (half-split rotation)."""
    _, s, _, d = x.shape
    half = d // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def _channels(d: int, gen: torch.Generator, n: int = 4) -> torch.Tensor:
    return torch.randperm(d, generator=gen)[:n]


# Classes of many 128-token Q blocks (at least 64), whatever --seq: their block means span more
# directions than a few blocks can, so they show the limit of any smoothing that covers the block
# means with fewer degrees of freedom. The video ones on an 8 x 32 x 32 latent grid (8,192 tokens),
# in raster order and in the op's 3D tiles (video_grid=).
MANY_BLOCKS = 64
MANY_BLOCKS_GRID = (8, 32, 32)


def class_length(kind: str, seq: int) -> int:
    """The sequence length of class ``kind`` at the report's ``seq``."""
    return max(seq, MANY_BLOCKS * 128) if f"{MANY_BLOCKS} blocks" in kind else seq


def class_video_grid(kind: str):
    """The ``video_grid`` class ``kind`` runs in (its 3D tiles), or None (the caller's order)."""
    return MANY_BLOCKS_GRID if kind.endswith("3D tiles") else None


def make_inputs(kind: str, b: int, s: int, h: int, d: int, gen: torch.Generator):
    """Q, K, V [B, S, H, D] fp32 shaped like one family of DiT attention inputs, or built to show
    one lever of the numerics (per-head magnitude, channel outliers, a V mean, sharp logits, many
    blocks' means: S from :func:`class_length`)."""
    s = class_length(kind, s)
    if kind.startswith("video + channel bias"):
        # video_inputs' 3D-RoPE'd content with a per-head channel bias before RoPE (x2 its RMS)
        if b != 1:
            raise ValueError(f"{kind!r} is one video (batch 1), got batch {b}")
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        return video_inputs.video_qkv(MANY_BLOCKS_GRID, h, d, channel_bias=2.0, seed=seed, dtype=torch.float32)
    q = torch.randn(b, s, h, d, generator=gen)
    k = torch.randn(b, s, h, d, generator=gen)
    v = torch.randn(b, s, h, d, generator=gen)
    if kind == "iid":
        pass
    elif kind == "block-structured Q":
        # Spatial regions of the latent share a large query offset (what per-block means absorb).
        nblk = (s + 127) // 128
        q = q + 3.0 * torch.randn(b, nblk, h, d, generator=gen).repeat_interleave(128, 1)[:, :s]
    elif kind == f"random block means x2 ({MANY_BLOCKS} blocks)":
        # Every Q block its own random offset, twice the rows' spread: full-rank block means.
        nblk = (s + 127) // 128
        q = q + 2.0 * torch.randn(b, nblk, h, d, generator=gen).repeat_interleave(128, 1)[:, :s]
    elif kind == "K channel outliers + bias":
        # A few channels of K carry a large common bias (what the K mean absorbs) and heavy tails.
        scale = torch.ones(d)
        scale[torch.randperm(d, generator=gen)[: d // 16]] = 8.0
        k = k * scale + 4.0 * torch.randn(1, 1, h, d, generator=gen)
    elif kind == "RoPE Q/K":
        # Sharper attention through position: correlated Q/K rotated by RoPE.
        base = torch.randn(b, s, h, d, generator=gen)
        q, k = rope(base + 0.5 * q), rope(base + 0.5 * k)
    elif kind.startswith("V absmax "):  # the whole head scaled: V's absmax lands at the value
        v = v * (float(kind.split()[-1]) / v.abs().amax())
    elif kind.startswith("Q absmax "):  # Q by c, K by 1/c: the same logits
        c = float(kind.split()[-1]) / q.abs().amax()
        q, k = q * c, k / c
    elif kind.startswith("K outliers x"):  # 4 channels of K larger, Q untouched: sharper logits
        k[..., _channels(d, gen)] *= float(kind.split("x")[-1])
    elif kind.startswith("K up, Q down x"):  # the same logits, energy in different channels
        f, ch = float(kind.split("x")[-1]), _channels(d, gen)
        k[..., ch] *= f
        q[..., ch] /= f
    elif kind.startswith("Q up, K down x"):
        f, ch = float(kind.split("x")[-1]), _channels(d, gen)
        q[..., ch] *= f
        k[..., ch] /= f
    elif kind == "V large mean":
        v = v + 20.0 * torch.randn(1, 1, h, d, generator=gen)
    elif kind.startswith("sharp logits x"):  # Q and K scaled: logits of growing spread
        f = float(kind.split("x")[-1])
        q, k = q * f, k * f
    else:
        raise ValueError(kind)
    return q, k, v


KINDS = ("iid", "block-structured Q", "K channel outliers + bias", "RoPE Q/K",
         "V absmax 1e-4", "V absmax 1e-2", "V absmax 1e2", "V absmax 1e4",
         "Q absmax 1e-4", "Q absmax 1e-2", "Q absmax 1e2", "Q absmax 1e4",
         "K outliers x8", "K outliers x30", "K up, Q down x30", "K up, Q down x100", "Q up, K down x30",
         "Q up, K down x100", "V large mean", "sharp logits x1", "sharp logits x2", "sharp logits x3",
         "sharp logits x10", f"random block means x2 ({MANY_BLOCKS} blocks)",
         f"video + channel bias ({MANY_BLOCKS} blocks)", f"video + channel bias ({MANY_BLOCKS} blocks) in 3D tiles")

# (label, qk_format, balance_qk) of the columns.
CONFIGS = (("", "nvfp4", False), ("balance_qk", "nvfp4", True), ("mxfp8", "mxfp8", True))


def metrics(out: torch.Tensor, exact: torch.Tensor, lse: torch.Tensor, lse_exact: torch.Tensor):
    o, e = out.double().flatten(), exact.double().flatten()
    cos = torch.nn.functional.cosine_similarity(o, e, dim=0).item()
    rel = ((o - e).norm() / e.norm()).item()
    alpha = ((o * e).sum() / (o * o).sum()).item()
    finite = torch.isfinite(lse_exact)
    lse_err = (lse.double() - lse_exact)[finite].abs().mean().item()
    return cos, rel, alpha, lse_err


def sparse_report(args) -> list[dict]:
    """The ``--sparse`` table: per input family and keep_mass, accuracy against exact attention over
    every key and the density of the estimated map."""
    dtype = torch.bfloat16 if args.backend == "cuda" else torch.float32
    grid = tuple(int(n) for n in args.sparse_grid.lower().split("x"))
    s, h, d = math.prod(grid), args.heads, args.head_dim
    g = torch.Generator().manual_seed(args.seed)
    video = video_inputs.video_qkv(grid, h, d, gain=args.sparse_gain, seed=args.seed, dtype=torch.float32)
    name = f"video {grid[0]}x{grid[1]}x{grid[2]}"
    # (inputs, the op's video_grid): the video again in 3D tiles, each Q block a compact box.
    families = {"iid": (tuple(torch.randn(1, s, h, d, generator=g) for _ in range(3)), None),
                name: (video, None), f"{name}, 3D tiles": (video, grid)}
    rows = []
    print(f"Block-sparse NVFP4 attention ({args.backend}, {str(dtype).replace('torch.', '')} inputs) vs exact fp64 "
          f"attention over all keys: S={s} H={h} D={d}, seed {args.seed}; the map estimated in each call\n")
    print("| input | keep_mass | density | cos | rel-L2 | mean abs LSE error |")
    print("|---|---|---|---|---|---|")
    for family, ((q, k, v), video_grid) in families.items():
        q, k, v = (t.to(args.device, dtype) for t in (q, k, v))
        exact, lse_exact = attention_exact(q, k, v)
        for keep_mass in KEEP_MASSES:
            bmap = sparse.estimate_block_mask(q, k, keep_mass, backend=args.backend, video_grid=video_grid)
            out, lse = nvfp4_dit.attention(q, k, v, backend=args.backend, return_lse=True, keep_mass=keep_mass,
                                           video_grid=video_grid)
            cos, rel, _, lse_err = metrics(out.cpu(), exact.cpu(), lse.cpu(), lse_exact.cpu())
            density = bmap.float().mean().item()
            rows.append({"input": family, "keep_mass": keep_mass, "density": density, "cos": cos, "rel_l2": rel,
                         "lse_err": lse_err})
            print(f"| {family} | {keep_mass} | {density:.3f} | {cos:.5f} | {rel:.4f} | {lse_err:.4f} |", flush=True)
    print(matched_accuracy([r for r in rows if r["input"] == name], [r for r in rows if r["input"] == f"{name}, 3D tiles"]))
    return rows


def density_at(rows: list[dict], cos: float):
    """The density reaching ``cos``, interpolated linearly between the ``keep_mass`` < 1 rows (None
    outside their range)."""
    pts = sorted((r["cos"], r["density"]) for r in rows if r["keep_mass"] < 1.0)
    for (c0, d0), (c1, d1) in zip(pts, pts[1:]):
        if c0 <= cos <= c1:
            return d0 if c1 == c0 else d0 + (d1 - d0) * (cos - c0) / (c1 - c0)
    return None


def matched_accuracy(raster: list[dict], tiles: list[dict]) -> str:
    """At each raster row's cos, the density 3D tiles need for the same cos (interpolated)."""
    lines = ["\nAt matched accuracy (3D-tile density interpolated at each raster cos):\n",
             "| raster keep_mass | cos | raster density | 3D-tile density | 3D / raster |", "|---|---|---|---|---|"]
    for r in raster:
        if r["keep_mass"] >= 1.0:
            continue
        d3 = density_at(tiles, r["cos"])
        ratio = "-" if d3 is None else f"{d3 / r['density']:.2f}"
        lines.append(f"| {r['keep_mass']} | {r['cos']:.5f} | {r['density']:.3f} | "
                     f"{'-' if d3 is None else f'{d3:.3f}'} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128, choices=fmt.SUPPORTED_HEAD_DIMS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backend", default="reference", choices=("reference", "cuda"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=None, help="comma-separated input classes (default: all)")
    ap.add_argument("--without-many-blocks", action="store_true",
                    help=f"leave out the classes of {MANY_BLOCKS} Q blocks ({MANY_BLOCKS * 128:,} tokens each)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    ap.add_argument("--png", default="out/accuracy_report.png", help="where to save the plot ('' for none)")
    ap.add_argument("--sparse", action="store_true", help="report block-sparse attention (keep_mass) instead")
    ap.add_argument("--sparse-grid", default="10x30x52",
                    help="the video's latent grid TxHxW for --sparse (default 10x30x52: 15,600 tokens)")
    ap.add_argument("--sparse-gain", type=float, default=1.2,
                    help="logit gain of the video inputs for --sparse (default 1.2; 2.0: sharper heads)")
    args = ap.parse_args(argv)
    if args.sparse:
        t0 = time.time()
        rows = sparse_report(args)
        print(f"\n({time.time() - t0:.1f} s)")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"backend": args.backend, "grid": args.sparse_grid, "heads": args.heads,
                                                   "head_dim": args.head_dim, "sparse": rows}, indent=1))
        return 0
    if args.png:
        plotting.require("--png")

    dtype = torch.bfloat16 if args.backend == "cuda" else torch.float32
    kinds = args.kinds.split(",") if args.kinds else KINDS
    if args.without_many_blocks:
        kinds = [k for k in kinds if f"{MANY_BLOCKS} blocks" not in k]
    rows = []
    t0 = time.time()
    for i, kind in enumerate(kinds):
        gen = torch.Generator().manual_seed(args.seed * 1000 + i)  # each class its own draw
        q, k, v = make_inputs(kind, args.batch, args.seq, args.heads, args.head_dim, gen)
        q, k, v = (t.to(args.device, dtype) for t in (q, k, v))
        exact, lse_exact = attention_exact(q, k, v)
        row = [kind]
        for _, qk_format, balance in CONFIGS:
            out, lse = nvfp4_dit.attention(q, k, v, backend=args.backend, return_lse=True, balance_qk=balance,
                                           qk_format=qk_format, video_grid=class_video_grid(kind))
            row.append(metrics(out.cpu(), exact.cpu(), lse.cpu(), lse_exact.cpu()))
        rows.append(row)

    print(f"NVFP4 attention ({args.backend}, {str(dtype).replace('torch.', '')} inputs) vs exact fp64 attention: "
          f"B={args.batch} S={args.seq} H={args.heads} D={args.head_dim}, seed {args.seed}; the classes of "
          f"{MANY_BLOCKS} blocks: S={class_length(f'{MANY_BLOCKS} blocks', args.seq)}\n")
    print("| input | cos | rel-L2 | alpha | mean abs LSE error | cos, balance_qk | rel-L2, balance_qk "
          "| mean abs LSE error, balance_qk | cos, mxfp8 | rel-L2, mxfp8 | mean abs LSE error, mxfp8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, (cos, rel, alpha, lse_err), (cos_b, rel_b, _, lse_b), (cos_m, rel_m, _, lse_m) in rows:
        print(f"| {kind} | {cos:.5f} | {rel:.4f} | {alpha:.4f} | {lse_err:.4f} | {cos_b:.5f} | {rel_b:.4f} "
              f"| {lse_b:.4f} | {cos_m:.5f} | {rel_m:.4f} | {lse_m:.4f} |")
    print(f"\n({time.time() - t0:.1f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"backend": args.backend, "seq": args.seq, "heads": args.heads, "head_dim": args.head_dim,
             "rows": [{"input": r[0], **{f"{name}{'_' + label if label else ''}": value
                                         for (label, _, _), m in zip(CONFIGS, r[1:])
                                         for name, value in zip(("cos", "rel_l2", "alpha", "lse_err"), m)}}
                      for r in rows]}, indent=1))

    if args.png:
        plt = plotting.pyplot()

        path = Path(args.png)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, axes = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
        names = [r[0] for r in rows]
        x = torch.arange(len(rows)).tolist()
        series = (("NVFP4, balance_qk off", "#4c72b0"), ("NVFP4, balance_qk on", "#dd8452"), ("MXFP8 Q·Kᵀ", "#55a868"))
        for ax, col, title in zip(axes, (0, 3), ("cosine similarity to exact", "mean |LSE error|")):
            for j, (label, color) in enumerate(series):
                ax.bar([i + 0.27 * j for i in x], [r[1 + j][col] for r in rows], 0.27, label=label, color=color)
            ax.set_title(title, fontsize=10)
            if col == 0:
                ax.set_ylim(max(0.0, min(min(m[0] for m in r[1:]) for r in rows) - 0.01), 1.0)
                ax.axhline(0.975, ls="--", c="gray", lw=0.8)
                ax.legend(fontsize=8)
        axes[1].set_xticks([i + 0.27 for i in x], names, rotation=35, ha="right", fontsize=8)
        fig.suptitle(f"NVFP4 ({args.backend}) vs exact, S={args.seq} H={args.heads} D={args.head_dim}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
