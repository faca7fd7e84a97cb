"""csrc/common/format.cuh agrees with nvfp4_dit/format.py bit for bit (software paths, on the host).

The header's software conversions are __host__ __device__; the sm_80/sm_90 kernels run the same
code on the device.  nvcc compiles a tiny host program that converts a dense set of floats,
and the bytes must equal format.py's.  Skipped where nvcc is missing.
"""

import subprocess

import numpy as np
import pytest
import torch

from nvfp4_dit import format as fmt

try:
    from host_program import compile_host_program
except ImportError:  # tests/ imported as a package
    from tests.host_program import compile_host_program

PROGRAM = r"""
#include "common/format.cuh"
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
  FILE* f = fopen(argv[1], "rb");
  std::vector<float> x;
  float v;
  while (fread(&v, sizeof(float), 1, f) == 1) x.push_back(v);
  fclose(f);
  FILE* o = fopen(argv[2], "wb");
  for (float a : x) {
    unsigned char e2 = (unsigned char)nvfp4_dit::float_to_e2m1_sw(a);
    unsigned char e4 = (unsigned char)nvfp4_dit::float_to_e4m3_sw(a);
    float d4 = nvfp4_dit::e4m3_to_float(e4);
    float d2 = nvfp4_dit::e2m1_to_float(e2);
    uint32_t sb;
    float sv = nvfp4_dit::block_scale_value(fabsf(a), &sb);
    float q = nvfp4_dit::scale_for_e2m1(a, sv);
    unsigned char qb = (unsigned char)nvfp4_dit::float_to_e2m1_sw(q);
    unsigned char sbb = (unsigned char)sb;
    fwrite(&e2, 1, 1, o); fwrite(&e4, 1, 1, o); fwrite(&d4, 4, 1, o); fwrite(&d2, 4, 1, o);
    fwrite(&sbb, 1, 1, o); fwrite(&qb, 1, 1, o);
  }
  fclose(o);
  return 0;
}
"""


@pytest.fixture(scope="module")
def host_program(tmp_path_factory):
    return compile_host_program(tmp_path_factory.mktemp("fmt"), "fmt_host", PROGRAM)


def _inputs():
    g = torch.Generator().manual_seed(7)
    e2m1_ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    e4m3_grid = fmt.e4m3_decode(torch.arange(256, dtype=torch.uint8)).nan_to_num(0.0)
    mids = (e4m3_grid[1:127] + e4m3_grid[2:128]) / 2  # every e4m3 rounding tie
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448.0, 464.0,
                             1e-12, 2.0 ** -9, 2.0 ** -10, 6.0 * 2.0 ** -10, 2688.0, 3000.0])
    spread = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-14, 12, (20000,), generator=g).float())
    x = torch.cat([e2m1_ties, -e2m1_ties, mids, -mids, e4m3_grid, specials, spread,
                   torch.nextafter(e2m1_ties, torch.zeros(1)), torch.nextafter(e2m1_ties, torch.full((1,), 9.0))])
    return x.float()


def test_header_matches_format_module(host_program, tmp_path):
    x = _inputs()
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    x.numpy().tofile(inp)
    subprocess.run([str(host_program), str(inp), str(out)], check=True)
    rec = np.dtype([("e2", "u1"), ("e4", "u1"), ("d4", "<f4"), ("d2", "<f4"), ("sb", "u1"), ("qb", "u1")])
    got = np.fromfile(out, dtype=rec)
    assert len(got) == len(x)
    e2 = fmt.e2m1_encode(x).numpy()
    e4 = fmt.e4m3_encode(x).numpy()
    np.testing.assert_array_equal(got["e2"], e2)
    np.testing.assert_array_equal(got["e4"], e4)
    np.testing.assert_array_equal(got["d4"], fmt.e4m3_decode(torch.from_numpy(e4)).numpy())
    np.testing.assert_array_equal(got["d2"], fmt.e2m1_decode(torch.from_numpy(e2)).numpy())
    # One-element "blocks": scale = e4m3(|x| / 6), data = e2m1(x / scale), as quantize_blocks does.
    sb = fmt.e4m3_encode(x.abs() / 6.0)
    s = fmt.e4m3_decode(sb)
    qb = fmt.e2m1_encode(torch.where(s == 0, 0.0, x / torch.where(s == 0, 1.0, s)))
    np.testing.assert_array_equal(got["sb"], sb.numpy())
    np.testing.assert_array_equal(got["qb"], qb.numpy())


SCALES_PROGRAM = r"""
#include "common/format.cuh"
#include <cstdio>
#include <vector>
// Reads float quadruples (amax_q, amax_k, top_q, top_k); writes tensor_scale(amax_q),
// channel_balance(amax_q, amax_k, top_q, top_k), the ue8m0 scale of a block with amax |amax_q|
// as a float, and amax_k in MXFP8 under that scale (e4m3 of amax_k / scale, as a float).
int main(int argc, char** argv) {
  FILE* f = fopen(argv[1], "rb");
  FILE* o = fopen(argv[2], "wb");
  float x[4];
  while (fread(x, sizeof(float), 4, f) == 4) {
    const float t = nvfp4_dit::tensor_scale(x[0]);
    const float s = nvfp4_dit::channel_balance(x[0], x[1], x[2], x[3]);
    const float mx = nvfp4_dit::ue8m0_to_float(nvfp4_dit::ue8m0_scale_byte(fabsf(x[0])));
    const float code = float(nvfp4_dit::float_to_e4m3_sw(x[1] / mx));
    fwrite(&t, 4, 1, o);
    fwrite(&s, 4, 1, o);
    fwrite(&mx, 4, 1, o);
    fwrite(&code, 4, 1, o);
  }
  fclose(f);
  fclose(o);
  return 0;
}
"""


def test_tensor_scale_and_balance_match_format_module(tmp_path):
    exe = compile_host_program(tmp_path, "scales", SCALES_PROGRAM)
    g = torch.Generator().manual_seed(3)
    n = 200_000
    mags = lambda: torch.exp2(torch.randint(-140, 128, (n,), generator=g).float()) * torch.rand(n, generator=g)  # noqa: E731
    x = torch.stack([mags(), mags(), mags(), mags()], 1)
    # Exact boundaries: 2688 * 2^e and its neighbours, ratios on powers of two, zeros and specials.
    edges = torch.tensor([2688.0, 1344.0, 2688.0 * 2.0 ** -130, 0.0, float("inf"), float("nan"), 3e38, 1e-45,
                          448.0, 448.0 * 2.0 ** -20, 224.0, 448.0 * 2.0 ** 100])
    x[: len(edges), 0] = edges
    x[len(edges): 2 * len(edges), 0] = torch.nextafter(edges.abs(), torch.full_like(edges, float("inf")))
    x[100:200, 1] = x[100:200, 0] * torch.exp2(torch.randint(-40, 40, (100,), generator=g).float())
    x[200:300, 2:] = x[200:300, :2].flip(1)
    x = torch.where(torch.rand(x.shape, generator=g) < 0.01, 0.0, x)
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    x.numpy().tofile(inp)
    subprocess.run([str(exe), str(inp), str(out)], check=True)
    got = torch.from_numpy(np.fromfile(out, dtype=np.float32).reshape(-1, 4))
    want_t = fmt.tensor_scale(x[:, 0])
    # MXFP8: a 32-element block holding amax_q and zeros, then amax_k under that block's scale.
    block = torch.zeros(n, fmt.MX_BLOCK)
    block[:, 0] = x[:, 0]
    mx_sf = fmt.ue8m0_block_scales(block)[:, 0]
    assert torch.equal(got[:, 2], fmt.ue8m0_decode(mx_sf)), (got[:, 2] != fmt.ue8m0_decode(mx_sf)).nonzero()[:5]
    block[:, 1] = x[:, 1].clamp(max=x[:, 0].abs())   # amax_k no larger than the block's amax
    codes, sf = fmt.quantize_mx_blocks(block)
    in_block = x[:, 1] <= x[:, 0].abs()
    assert torch.equal(sf[:, 0], mx_sf)
    assert torch.equal(got[in_block, 3], codes[in_block, 1].float())
    # channel_balance over the last dim with its maxima: one channel per "head" row, top given.
    aq, ak, top_q, top_k = (x[:, i].double() for i in range(4))
    num, den = ak * top_q, aq * top_k
    ok = torch.isfinite(num) & torch.isfinite(den) & (num > 0) & (den > 0)
    mn, en = torch.frexp(torch.where(ok, num, 1.0))
    md, ed = torch.frexp(torch.where(ok, den, 1.0))
    e = torch.div((en - ed).int() - (mn < md).int() + 1, 2, rounding_mode="floor").clamp(-64, 64)
    want_s = torch.where(ok, torch.ldexp(torch.ones(n), e), 1.0)
    assert torch.equal(got[:, 0], want_t), (got[:, 0] != want_t).nonzero()[:5]
    assert torch.equal(got[:, 1], want_s), (got[:, 1] != want_s).nonzero()[:5]
    # The same rule through format.channel_balance, whose head maxima come from its inputs.
    heads = x[:1000].view(100, 10, 4)
    s = fmt.channel_balance(heads[..., 0], heads[..., 1])
    top_q = heads[..., 0].double().amax(-1, keepdim=True).expand(100, 10)
    top_k = heads[..., 1].double().amax(-1, keepdim=True).expand(100, 10)
    num, den = heads[..., 1].double() * top_q, heads[..., 0].double() * top_k
    log_ratio = (num / den).log2()
    inside = torch.isfinite(log_ratio) & (log_ratio.abs() < 2 * 64)  # not clamped
    assert inside.sum() > 300
    assert torch.all((log_ratio - 2 * s.double().log2())[inside].abs() <= 1.0)
