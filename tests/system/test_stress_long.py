"""Long-sequence stress on the GPU: 77k / 118.8k / 256k tokens, and tensors past 2^31.

The first production crash was a TMA assertion abort past ~70k tokens; the second a silently
wrong output. So every case here checks, on ``backend="cuda"``:

* no abort: the call returns and ``torch.cuda.synchronize()`` raises nothing, and a small call
  afterwards still works;
* sampled rows match the reference: a few 128-row Q blocks (first, last, middle, random) of a
  few heads (first and last), computed by ``attention_reference(..., query_blocks=(i, i+1))``
  on just those heads (every head is independent: its own K mean and Q block means), given the
  CUDA quantiser's own means (``reliability_helpers``: an ulp in a mean flips codes at rounding
  boundaries), compared by cos >= 0.999, output scale within 1%, and LSE;
* peak memory: ``max_memory_allocated`` during the call, above what was allocated before it,
  stays within :func:`memory_budget` (output, LSE, the packed FP4 planes, the key projections):
  an O(S^2) buffer, an fp32 copy of the inputs or an input-sized temporary fails (the first GPU
  run caught ``torch.isfinite(q)``, which allocates |q| and three bool tensors: 14.3 GiB against
  9.7 at 2^31 elements; the NaN/inf flags now come from the quantiser);
* 32-bit offsets: two tensors with more than 2^31 elements (Q/out in one test, K/V in the
  other) whose last query block / last keys sit past element 2^31, with inputs built so that
  those rows dominate the checked output: an int32 offset anywhere on the path wraps and reads
  or writes the wrong rows, which the sampled check cannot miss.

The GPU tests are marked ``cuda`` and ``slow``; ``test_sampled_check_on_cpu`` runs the
comparison code itself on CPU (reference against reference, then a halved block). Sized for an H200 (about 60 GB peak in the largest case).
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
import torch.nn.functional as F

import nvfp4_dit
from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess
from nvfp4_dit.reference import attention_reference

try:
    from reliability_helpers import kernel_means
except ImportError:  # run from the repository root as a package
    from tests.system.reliability_helpers import kernel_means


TILE = 128
GiB = 1 << 30


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_budget(q, k, v, return_lse: bool, qk_format: str = "nvfp4", layout: str = "NHD") -> int:
    """Bytes the cuda back-end may allocate on top of its inputs (bf16/fp16 inputs)."""
    out = _nbytes(q)
    lse = q.numel() // q.shape[-1] * 4 if return_lse else 0
    # e2m1 data (1/4) + ue4m3 scales (1/32); MXFP8 Q/K: e4m3 data (1/2) + ue8m0 scales (1/64)
    qk_share = 0.52 if qk_format == "mxfp8" else 0.3
    packed = qk_share * (_nbytes(q) + _nbytes(k)) + 0.3 * _nbytes(v)
    # 16 fp16 key projections per key and query head
    (b, h, _, _), sk = fmt.to_hnd(q, layout).shape, fmt.to_hnd(k, layout).shape[2]
    projections = b * h * sk * 16 * 2
    small = q.numel() // q.shape[-1] * 8 + 512 * (1 << 20)       # q . km, means, flags, workspaces, slack
    return int(out + lse + packed + projections + small)


def run_cuda_measured(q, k, v, **kwargs):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = nvfp4_dit.attention(q, k, v, backend="cuda", return_lse=True, **kwargs)
    torch.cuda.synchronize()  # a device-side fault surfaces here
    return out, lse, torch.cuda.max_memory_allocated() - base


def _poison_allocator(nbytes: int) -> None:
    """Fill cached free blocks with NaN so that an unwritten output row cannot look plausible."""
    junk = torch.full((nbytes // 4 + 1,), math.nan, device="cuda")
    del junk


def check_sampled(q, k, v, out, lse, *, layout, causal=False, kv_lens=None, blocks, heads, qk_format="nvfp4"):
    """Compare the cuda output rows of Q blocks ``blocks`` and q heads ``heads`` with the reference."""
    h, hkv = fmt.to_hnd(q, layout).shape[1], fmt.to_hnd(k, layout).shape[1]
    group = h // hkv
    kv_heads = sorted({hh // group for hh in heads})
    q_heads = [kh * group + j for kh in kv_heads for j in range(group)]
    head_dim = 2 if layout == "NHD" else 1
    sel = lambda t, idx: t.index_select(head_dim, torch.tensor(idx, device=t.device))  # noqa: E731
    qs, ks, vs = sel(q, q_heads), sel(k, kv_heads), sel(v, kv_heads)
    means = kernel_means(q, k, v, layout=layout, kv_lens=kv_lens) or {}
    overrides = {name: value[:, q_heads if name == "q_mean" else kv_heads].contiguous()
                 for name, value in means.items() if value is not None}
    del means
    qq = preprocess.quantize_qkv(qs, ks, vs, layout=layout, kv_lens=kv_lens, balance_qk=True, qk_format=qk_format,
                          **overrides)
    sq = fmt.to_hnd(q, layout).shape[2]
    out_h, lse_sel = fmt.to_hnd(sel(out, q_heads), layout), lse[:, q_heads]
    for blk in blocks:
        ref, ref_lse = attention_reference(qs, ks, vs, layout=layout, causal=causal, kv_lens=kv_lens,
                                           return_lse=True, query_blocks=(blk, blk + 1), quantized=qq)
        r0, r1 = blk * TILE, min(sq, (blk + 1) * TILE)
        got = out_h[:, :, r0:r1].double()
        want = fmt.to_hnd(ref, layout).double()
        assert torch.isfinite(got).all(), f"block {blk}: NaN/inf (rows not written?)"
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse_sel[:, :, r0:r1]), empty)
        a, r = got[~empty], want[~empty]
        if r.numel():
            cos = F.cosine_similarity(a.flatten(), r.flatten(), dim=0).item()
            alpha = ((a * r).sum() / (a * a).sum()).item()
            assert cos >= 0.999, f"block {blk}: cos {cos:.5f}"
            assert 0.99 <= alpha <= 1.01, f"block {blk}: output scaled by {1 / alpha:.4f}"
            err = (lse_sel[:, :, r0:r1][~empty].double() - ref_lse[~empty].double()).abs()
            assert err.max().item() <= 2e-3 + 1e-4 * ref_lse[~empty].abs().max().item(), f"block {blk}: LSE"
        del ref, ref_lse


def _blocks(nblk: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return sorted({0, nblk - 1, nblk // 2, r.randrange(nblk), r.randrange(nblk)})


STRESS = {
    # name: (B, S, H, Hkv, causal, kv_lens); a name ending in _mxfp8 runs qk_format="mxfp8"
    "wan_77k": (1, 77_000, 40, 40, False, None),
    "wan_77k_mxfp8": (1, 77_000, 40, 40, False, None),
    "hunyuan_118k_gqa_causal_mxfp8": (2, 118_800, 24, 8, True, [118_800, 118_037]),
    "wan_77k_causal": (1, 77_000, 40, 40, True, None),
    "hunyuan_118k_cfg_kv_lens": (2, 118_800, 24, 24, False, [118_800, 118_037]),
    "hunyuan_118k_gqa_causal": (2, 118_800, 24, 8, True, None),
    "long_256k": (1, 262_144, 8, 8, False, None),
    "long_256k_b2_gqa_causal": (2, 262_144, 8, 2, True, [262_144, 200_001]),
}


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRESS))
def test_long_sequences(cuda_device, name):
    b, s, h, hkv, causal, lens = STRESS[name]
    qk_format = "mxfp8" if name.endswith("_mxfp8") else "nvfp4"
    g = torch.Generator(device=cuda_device).manual_seed(zlib.crc32(name.encode()))
    layout = "HND" if "gqa" in name else "NHD"
    shape_q, shape_kv = ((b, s, h, 128), (b, s, hkv, 128)) if layout == "NHD" else ((b, h, s, 128), (b, hkv, s, 128))
    q = torch.randn(shape_q, device=cuda_device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(shape_kv, device=cuda_device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(shape_kv, device=cuda_device, dtype=torch.bfloat16, generator=g)
    kv_lens = None if lens is None else torch.tensor(lens, device=cuda_device, dtype=torch.int32)
    _poison_allocator(_nbytes(q) + (32 << 20))
    out, lse, peak = run_cuda_measured(q, k, v, layout=layout, causal=causal, kv_lens=kv_lens, qk_format=qk_format)
    budget = memory_budget(q, k, v, True, qk_format, layout)
    assert peak <= budget, f"peak {peak / GiB:.2f} GiB above the budget {budget / GiB:.2f} GiB"
    nblk = (s + TILE - 1) // TILE
    check_sampled(q, k, v, out, lse, layout=layout, causal=causal, kv_lens=kv_lens,
                  blocks=_blocks(nblk, s), heads=[0, h - 1], qk_format=qk_format)
    del out, lse
    # The context is healthy after the long call.
    small = torch.randn(1, 256, 2, 64, device=cuda_device, dtype=torch.bfloat16)
    assert torch.isfinite(nvfp4_dit.attention(small, small, small, backend="cuda")).all()
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Tensors past 2^31 elements
# ---------------------------------------------------------------------------------------------

BIG_S = 266_240          # 2080 blocks; 266,240 * 64 * 128 = 2.18e9 > 2^31 elements
BIG_H = 64


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_query_and_output_past_2_to_the_31(cuda_device, layout):
    """Q and out hold 2.18e9 elements; the last query block's rows start past element 2^31."""
    sk, hkv = 4096, 8
    g = torch.Generator(device=cuda_device).manual_seed(31)
    if layout == "NHD":
        q = torch.randn(1, BIG_S, BIG_H, 128, device=cuda_device, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, sk, hkv, 128, device=cuda_device, dtype=torch.bfloat16, generator=g)
    else:
        q = torch.randn(1, BIG_H, BIG_S, 128, device=cuda_device, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, hkv, sk, 128, device=cuda_device, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    assert q.numel() > 2**31
    qh = fmt.to_hnd(q, layout)
    last = BIG_S // TILE - 1
    # The last block's rows: distinct from every other block (a wrapped read of another block's
    # Q gives another answer), and in NHD every element offset of these rows is past 2^31.
    qh[:, :, last * TILE:] *= 3.0
    assert (last * TILE * BIG_H) * 128 > 2**31 or layout == "HND"
    _poison_allocator(_nbytes(q) + (64 << 20))
    out, lse, peak = run_cuda_measured(q, k, v, layout=layout)
    assert peak <= memory_budget(q, k, v, True, layout=layout), f"peak {peak / GiB:.2f} GiB"
    check_sampled(q, k, v, out, lse, layout=layout, blocks=[0, last - 1, last], heads=[0, BIG_H - 1])


@pytest.mark.cuda
@pytest.mark.slow
def test_keys_and_values_past_2_to_the_31(cuda_device):
    """K and V hold 2.18e9 elements; the last 4,000 keys (past element 2^31) carry the attention."""
    sq = 256
    g = torch.Generator(device=cuda_device).manual_seed(32)
    u = torch.randn(BIG_H, 128, device=cuda_device, generator=g)
    u = u / u.norm(dim=-1, keepdim=True)
    q = (torch.randn(1, sq, BIG_H, 128, device=cuda_device, generator=g) + 12.0 * u).to(torch.bfloat16)
    k = torch.randn(1, BIG_S, BIG_H, 128, device=cuda_device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, BIG_S, BIG_H, 128, device=cuda_device, dtype=torch.bfloat16, generator=g)
    assert k.numel() > 2**31
    hot = slice(BIG_S - 4000, BIG_S)
    assert (BIG_S - 4000) * BIG_H * 128 > 2**31
    # Their scaled scores sit 12 * 12 / sqrt(128) = 12.7 above the rest (weight e^12.7 = 3e5 each
    # against 262k others of weight ~1): they hold ~99.8% of the softmax mass, so the output is
    # their V (offset by +2), which a wrapped read of K or V would replace.
    k[:, hot] += (12.0 * u).to(torch.bfloat16)
    v[:, hot] += 2.0
    out, lse, peak = run_cuda_measured(q, k, v, layout="NHD")
    assert peak <= memory_budget(q, k, v, True), f"peak {peak / GiB:.2f} GiB"
    assert out[..., -1, :].float().mean().item() > 1.5, "the hot keys past 2^31 did not dominate"
    check_sampled(q, k, v, out, lse, layout="NHD", blocks=[0, 1], heads=[BIG_H - 2, BIG_H - 1])


def test_sampled_check_on_cpu():
    g = torch.Generator().manual_seed(0)
    for layout, causal, lens, h, hkv in [("NHD", False, None, 4, 4), ("HND", True, [700, 333], 6, 2),
                                         ("NHD", True, [700, 0], 4, 2)]:
        shq, shk = ((2, 700, h, 64), (2, 700, hkv, 64)) if layout == "NHD" else ((2, h, 700, 64), (2, hkv, 700, 64))
        q, k, v = torch.randn(shq, generator=g), torch.randn(shk, generator=g), torch.randn(shk, generator=g)
        kv_lens = None if lens is None else torch.tensor(lens, dtype=torch.int32)
        out, lse = nvfp4_dit.attention(q, k, v, layout=layout, causal=causal, kv_lens=kv_lens, backend="reference",
                                       return_lse=True)
        check_sampled(q, k, v, out, lse, layout=layout, causal=causal, kv_lens=kv_lens, blocks=_blocks(6, 5),
                      heads=[0, h - 1])
        fmt.to_hnd(out, layout)[:, -1, 5 * TILE:] *= 0.5
        with pytest.raises(AssertionError, match="block 5"):
            check_sampled(q, k, v, out, lse, layout=layout, causal=causal, kv_lens=kv_lens, blocks=[5],
                          heads=[0, h - 1])
