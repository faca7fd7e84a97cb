"""Shared by the GPU reliability tests: the reference run with the CUDA quantiser's own means.

The CUDA quantiser reduces the K and Q-block means in another order than torch, so a mean
can differ by an ulp, and an element sitting on an e2m1 rounding boundary then takes the other
code.  That moves a whole row's scores by one FP4 step (LSE by ~0.05): real, allowed, and not
what a kernel test should measure.  Comparing against the reference *given the kernel's means*
(``preprocess.quantize_qkv(q_mean=..., k_mean_override=...)``) leaves only fp32 summation order and
the output rounding, so the tolerances can be tight.
"""

from __future__ import annotations

from typing import Optional

import torch

from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess
from nvfp4_dit.reference import attention_reference


def kernel_means(q, k, v, *, layout, kv_lens=None, balance_qk=True) -> Optional[dict]:
    """The means and the balance the cuda back-end computes, as ``preprocess.quantize_qkv`` overrides,
    or None for CPU tensors (there every back-end quantises with ``preprocess.quantize_qkv``)."""
    if q.device.type != "cuda":
        return None
    from nvfp4_dit.cuda import quantize

    qq = quantize.quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens, balance_qk=balance_qk)
    return dict(q_mean=qq.q_mean, k_mean_override=qq.k_mean, v_mean_override=qq.v_mean, balance_override=qq.balance)


def matched_reference(q, k, v, *, layout, causal=False, scale=None, kv_lens=None, query_blocks=None,
                      means=None, balance_qk=True, key_bias=None):
    """``attention_reference`` (out, lse) on the kernel's means (see the module docstring);
    ``key_bias`` [B, Sk] or [B, H or 1, Sk] a per-key mask as the planner reduces it."""
    if means is None:
        means = kernel_means(q, k, v, layout=layout, kv_lens=kv_lens, balance_qk=balance_qk)
    qq = preprocess.quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens, balance_qk=balance_qk, **(means or {}))
    return attention_reference(q, k, v, layout=layout, causal=causal, scale=scale, kv_lens=kv_lens,
                               key_bias=key_bias, return_lse=True, query_blocks=query_blocks, quantized=qq)
