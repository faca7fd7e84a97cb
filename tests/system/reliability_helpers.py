"""Shared by the GPU reliability tests: the reference run with the CUDA quantiser's own means.

The CUDA quantiser reduces the K and Q-block means in another order than torch, so a mean
can differ by an ulp, and an element sitting on an e2m1 rounding boundary then takes the other
code.  That moves a whole row's scores by one FP4 step (LSE by ~0.05): real, allowed, and not
what a kernel test should measure.  Comparing against the reference *given the kernel's means*
(``format.quantize_qkv(q_mean=..., k_mean_override=...)``) leaves only fp32 summation order and
the output rounding, so the tolerances can be tight.
"""

from __future__ import annotations

from typing import Optional

import torch

from nvfp4_dit import format as fmt
from nvfp4_dit.reference import attention_reference


def kernel_means(q, k, v, *, layout, kv_lens=None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(q_mean [B, H, nblk, Dp], k_mean [B, Hkv, Dp]) as the cuda back-end computes them, or None
    for CPU tensors (there every back-end quantises with ``format.quantize_qkv``)."""
    if q.device.type != "cuda":
        return None
    from nvfp4_dit import quantize

    qq = quantize.quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens)
    return qq.q_mean, qq.k_mean


def matched_reference(q, k, v, *, layout, causal=False, scale=None, kv_lens=None, query_blocks=None,
                      means=None):
    """``attention_reference`` (out, lse) on the kernel's means (see the module docstring)."""
    if means is None:
        means = kernel_means(q, k, v, layout=layout, kv_lens=kv_lens)
    qm, km = means if means is not None else (None, None)
    qq = fmt.quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens, q_mean=qm, k_mean_override=km)
    return attention_reference(q, k, v, layout=layout, causal=causal, scale=scale, kv_lens=kv_lens,
                               return_lse=True, query_blocks=query_blocks, quantized=qq)
