"""Low-rank Q smoothing (nvfp4_dit/smoothing.py): the basis, the coefficients, the key projections and
the correction formed from them, on the CPU."""

import math

import pytest
import torch

from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess, reference, smoothing

R = smoothing.Q_BASIS_RANK


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0).item()


def block_means(b, h, n, d, seed=0, rank=None):
    g = torch.Generator().manual_seed(seed)
    if rank is None:
        return torch.randn(b, h, n, d, generator=g)
    coords = torch.randn(b, h, n, rank, generator=g)
    dirs = torch.randn(b, h, rank, d, generator=g)
    return 5.0 * torch.randn(b, h, 1, d, generator=g) + coords @ dirs


def test_basis_rows_are_orthonormal_or_zero():
    basis = smoothing.smoothing_basis(block_means(2, 3, 40, 64))
    gram = basis.rows @ basis.rows.transpose(-1, -2)
    assert torch.allclose(gram, torch.eye(R).expand_as(gram), atol=1e-5)
    assert basis.center.shape == (2, 3, 64) and basis.rows.shape == (2, 3, R, 64) and basis.scale.shape == (2, 3)


def test_basis_is_deterministic_and_per_head():
    qm = block_means(1, 4, 30, 128, seed=3)
    basis = smoothing.smoothing_basis(qm)
    again = smoothing.smoothing_basis(qm.clone())
    assert all(torch.equal(x, y) for x, y in zip(vars(basis).values(), vars(again).values()))
    # A head's basis does not depend on the heads beside it (context parallelism splits heads).
    for h in range(4):
        one = smoothing.smoothing_basis(qm[:, h:h + 1])
        assert all(torch.equal(x, y[:, h:h + 1]) for x, y in zip(vars(one).values(), vars(basis).values()))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_fewer_blocks_than_the_rank_give_zero_rows(n):
    qm = block_means(1, 1, n, 64, seed=n)
    basis = smoothing.smoothing_basis(qm)
    assert torch.isfinite(basis.rows).all()
    nonzero = int((basis.rows.norm(dim=-1) > 0).sum())
    assert nonzero <= max(n - 1, 0)
    # Every block mean is reproduced: n - 1 deviations span at most n - 1 directions.
    coeff = smoothing.basis_coefficients(qm, basis)
    assert torch.allclose(smoothing.smoothed_means(basis, coeff), qm, atol=1e-4)


def test_all_zero_means_and_nan_blocks_keep_the_basis_finite():
    zero = torch.zeros(1, 2, 20, 64)
    basis = smoothing.smoothing_basis(zero)
    assert not basis.center.any() and not basis.rows.any()
    qm = block_means(1, 2, 20, 64, seed=5)
    qm[0, 0, 3] = float("nan")
    qm[0, 1, 7, 2] = float("inf")
    basis = smoothing.smoothing_basis(qm)
    assert torch.isfinite(basis.center).all() and torch.isfinite(basis.rows).all()
    # The other blocks define it: the same as without the non-finite ones.
    keep = [i for i in range(20) if i != 3]
    alone = smoothing.smoothing_basis(qm[:, :1, keep])
    assert torch.allclose(alone.center, basis.center[:, :1], atol=1e-6)


def test_huge_means_keep_the_gram_matrix_finite():
    qm = block_means(1, 1, 30, 64, seed=6) * 1e30
    basis = smoothing.smoothing_basis(qm)
    assert torch.isfinite(basis.rows).all() and (basis.rows.norm(dim=-1) > 0).all()


def test_means_in_r_directions_are_reproduced():
    qm = block_means(1, 2, 64, 128, seed=7, rank=R)
    basis = smoothing.smoothing_basis(qm)
    res = smoothing.residual_norm(qm, basis)
    assert float(res.max()) < 1e-4 * float(qm.norm(dim=-1).max())


def test_basis_reaches_the_svd_subspace_on_decaying_spectra():
    g = torch.Generator().manual_seed(8)
    n, d = 200, 128
    spectrum = 0.6 ** torch.arange(d, dtype=torch.float32)
    qm = (torch.randn(1, 1, n, d, generator=g) * spectrum) @ torch.linalg.qr(torch.randn(d, d, generator=g))[0].T
    basis = smoothing.smoothing_basis(qm)
    dev = (qm - basis.center[:, :, None]).double()[0, 0]
    _, s, vh = torch.linalg.svd(dev, full_matrices=False)
    rows = basis.rows[0, 0].double()
    kept = int((rows.norm(dim=-1) > 0).sum())
    # The floor drops the directions under 2^-7 of the leading singular value, and only those.
    assert s[kept - 1] >= 2.0 ** -8 * s[0] and s[kept] <= 2.0 ** -6 * s[0], (kept, (s / s[0])[:R])
    best = (dev - dev @ vh[:kept].T @ vh[:kept]).norm()
    ours = (dev - dev @ rows.T @ rows).norm()
    assert float(ours) <= 1.01 * float(best)


def test_key_projections_error_bound_against_fp64():
    g = torch.Generator().manual_seed(9)
    b, h, hkv, skp, dp, n = 1, 4, 2, 384, 64, 6
    qm = block_means(b, h, n, dp, seed=10)
    basis = smoothing.smoothing_basis(qm)
    coeff = smoothing.basis_coefficients(qm, basis)
    ks = torch.randn(b, hkv, skp, dp, generator=g) * torch.logspace(-3, 2, skp)[None, None, :, None]
    proj = smoothing.key_projections(ks, basis)
    assert proj.values.dtype == torch.float16 and proj.values.shape == (b, h, skp, R + 1)
    assert torch.isfinite(proj.values).all()
    score_scale = torch.ones(b, h, n)
    got = smoothing.correction_from_projections(proj, coeff, score_scale).double()
    weights = torch.cat([basis.center[:, :, None], basis.rows * basis.scale[..., None, None]], 2).double()
    keys = ks.double().repeat_interleave(h // hkv, 1)
    u = keys @ weights.transpose(-1, -2)                                      # [b, h, skp, C]
    a = torch.cat([torch.ones_like(coeff[..., :1]), coeff], -1).double()
    exact = a @ u.transpose(-1, -2)
    factor = proj.factors.double().repeat_interleave(fmt.SEQ_TILE, -1)[:, :, None, :]
    bound = (2.0 ** -11 * (a.abs() @ u.abs().transpose(-1, -2)) + (R + 1) * 2.0 ** -25 * a.abs().amax(-1, keepdim=True)
             * factor + 2.0 ** -20 * (a.abs() @ u.abs().transpose(-1, -2)))
    assert bool(((got - exact).abs() <= bound).all())


def test_key_bias_joins_the_first_column():
    g = torch.Generator().manual_seed(11)
    ks = torch.randn(1, 1, 256, 64, generator=g)
    qm = block_means(1, 1, 3, 64, seed=12)
    basis = smoothing.smoothing_basis(qm)
    coeff = smoothing.basis_coefficients(qm, basis)
    bias = torch.zeros(1, 256)
    bias[0, 5] = -math.inf
    bias[0, 9] = -3.0
    plain = smoothing.correction_from_projections(smoothing.key_projections(ks, basis), coeff, torch.ones(1, 1, 3))
    biased = smoothing.correction_from_projections(
        smoothing.key_projections(ks, basis, key_bias=bias, scale=0.5), coeff, torch.ones(1, 1, 3))
    assert torch.isneginf(biased[..., 5]).all()
    assert torch.allclose(biased[..., 9], plain[..., 9] - 6.0, atol=1e-3)
    with pytest.raises(ValueError, match="scale"):
        smoothing.key_projections(ks, basis, key_bias=bias)


def test_means_in_r_directions_quantise_as_per_block_smoothing():
    """Q whose block means lie in R directions around their mean (16 blocks): m_b reproduces each
    block mean to fp32 rounding, and the Q bytes are those of smoothing each block by m_b
    (format.py's steps written out: subtract, tensor scale per block, quantise)."""
    g = torch.Generator().manual_seed(13)
    s, h, d = 2048, 2, 64
    q = torch.randn(1, s, h, d, generator=g) + 3.0 * torch.randn(1, 16, h, d, generator=g).repeat_interleave(128, 1)
    k, v = torch.randn(1, s, h, d, generator=g), torch.randn(1, s, h, d, generator=g)
    qq = preprocess.quantize_qkv(q, k, v, balance_qk=False)
    m = smoothing.smoothed_means(qq.smoothing_basis(), qq.q_coeff)
    assert torch.allclose(m, qq.q_mean, rtol=0, atol=1e-5 * float(qq.q_mean.abs().max()))
    rows = fmt.to_hnd(q, "NHD").float() - m.repeat_interleave(fmt.SEQ_TILE, 2)
    q_scale = fmt.tensor_scale(rows.unflatten(2, (16, fmt.SEQ_TILE)).abs().amax((3, 4)))
    data, sf = fmt.quantize_qk_rows(rows / q_scale.repeat_interleave(fmt.SEQ_TILE, 2)[..., None], "nvfp4")
    assert torch.equal(q_scale, qq.q_scale) and torch.equal(sf, qq.q_sf) and torch.equal(data, qq.q_data)


def test_quantiser_smoothing_outputs():
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 700, 4, 64, generator=g) for _ in range(3))
    qq = preprocess.quantize_qkv(q, k, v)
    assert qq.q_center.shape == (1, 4, 64) and qq.q_basis.shape == (1, 4, R, 64)
    assert qq.q_coeff.shape == (1, 4, 6, R)
    basis = smoothing.smoothing_basis(qq.q_mean)
    assert all(torch.equal(x, y) for x, y in zip(vars(basis).values(), vars(qq.smoothing_basis()).values()))
    # An override replaces the basis: the zero basis smooths every block by the center alone.
    forced = preprocess.quantize_qkv(q, k, v, basis_override=smoothing.Basis(
        qq.q_center, torch.zeros_like(qq.q_basis), qq.q_basis_scale))
    assert torch.equal(forced.q_coeff, torch.zeros_like(forced.q_coeff))


def test_power_of_two_scaling_leaves_the_stored_correction_alone():
    """Q times c and K over c (powers of two): the projections' bytes and factors and the coefficients
    are unchanged, since every projection column is in q . k units."""
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(1, 600, 2, 64, generator=g) for _ in range(3))
    q = q + 2.0 * torch.randn(1, 5, 2, 64, generator=g).repeat_interleave(128, 1)[:, :600]
    base = preprocess.quantize_qkv(q, k, v)
    for c in (2.0 ** 20, 2.0 ** -12):
        scaled = preprocess.quantize_qkv(q * c, k / c, v)
        assert torch.equal(scaled.q_coeff, base.q_coeff)
        p0 = smoothing.key_projections(base.k_smoothed, base.smoothing_basis())
        p1 = smoothing.key_projections(scaled.k_smoothed, scaled.smoothing_basis())
        assert torch.equal(p0.values, p1.values) and torch.equal(p0.factors, p1.factors)
