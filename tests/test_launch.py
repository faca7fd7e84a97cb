"""The launch layer's host rules that need no GPU (the launches themselves: test_attention_cuda.py,
test_quantize.py): which inputs the kernels read in place as 16-byte vectors, and the zero-padded
copy they read otherwise."""

import pytest
import torch

pytest.importorskip("cuda.bindings.driver")

from nvfp4_dit.cuda import launch  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_readable_inputs_are_read_in_place(dtype):
    x = torch.randn(2, 3, 40, 128, dtype=dtype)
    assert launch.vector_loads(x, 128) and launch.vector_readable(x, 128) is x
    nhd_view = torch.randn(2, 40, 3, 64, dtype=dtype).transpose(1, 2)   # [B, H, S, D] of NHD storage
    assert launch.vector_readable(nhd_view, 64) is nhd_view


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 3, 40, 80),                                  # head dim below Dp
    lambda: torch.randn(2, 3, 40, 256)[..., ::2],                       # strided along D
    lambda: torch.randn(2 * 3 * 40 * 128 + 1)[1:].view(2, 3, 40, 128),  # rows off 16-byte alignment
], ids=["head-dim-80", "strided-d", "unaligned"])
def test_other_inputs_become_a_zero_padded_copy(make):
    x = make()
    dp = 128
    assert not launch.vector_loads(x, dp)
    y = launch.vector_readable(x, dp)
    assert y.is_contiguous() and y.shape == (*x.shape[:3], dp) and launch.vector_loads(y, dp)
    assert torch.equal(y[..., :x.shape[3]], x) and not y[..., x.shape[3]:].any()
