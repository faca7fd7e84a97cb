"""An independent CPU model of the native block-scaled FP4 MMA, fed the attention kernel's own
register construction.

The instruction, ``mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X
.f32.e2m1.e2m1.f32.ue4m3``, is modelled from the PTX ISA fragment tables ("Matrix Fragments for
mma.m16n8k64" and "Warp-level block scaling", Table 37) as explicit tables (lane, register,
nibble) -> (row, k) for A and B, (lane, register) -> (row, column) for C/D, and the lanes and
bytes the scale selectors read. ``ldmatrix`` and ``shfl.xor`` are modelled from their PTX
definitions too.

The kernel side is not re-derived here: a host program evaluates the index functions of
``csrc/attention/fragments.cuh`` (through which ``kernel.cuh`` builds every fragment) for every
lane, and the test builds the registers from those tables, the stored layouts of
``nvfp4_dit.format`` (the K row permutation, V^T) and a simulated shared-memory stage. The model
must then equal a dense product over natural-order tokens exactly (fp64: every product and sum
here is exact), and each deliberately wrong hardware model must give a large error.
"""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch

from nvfp4_dit import format as fmt

try:  # pytest puts tests/ on sys.path (rootdir conftest); a package import works too
    from host_program import compile_host_program
except ImportError:  # tests/ imported as a package
    from tests.host_program import compile_host_program

HEAD_DIMS = fmt.SUPPORTED_HEAD_DIMS
LANES = torch.arange(32)
G, T = LANES // 4, LANES % 4

# ---------------------------------------------------------------------------------------------
# The kernel's construction: fragments.cuh evaluated on the host
# ---------------------------------------------------------------------------------------------

HOST_PROGRAM = r"""
#include <cstdio>
#include "attention/fragments.cuh"
using namespace nvfp4_dit;

template <int D, class Q>
void dump() {
  using F = Fragments<D, Q>;
  using TR = AttentionTraits<D, Q>;
  auto out = [](const char* name, int i, int j, int k, int l, long long v) {
    std::printf("%d %s %s %d %d %d %d %lld\n", D, Q::kName, name, i, j, k, l, v);
  };
  out("const_kOffK", 0, 0, 0, 0, TR::kOffK);
  out("const_kOffV", 0, 0, 0, 0, TR::kOffV);
  out("const_kOffKSf", 0, 0, 0, 0, TR::kOffKSf);
  out("const_kStageBytes", 0, 0, 0, 0, TR::kStageBytes);
  out("const_kKChunks", 0, 0, 0, 0, TR::kKChunks);
  out("const_kTidA", 0, 0, 0, 0, F::kTidA);
  out("const_kPvSteps", 0, 0, 0, 0, F::kPvSteps);
  out("const_kPBlockPartnerXor", 0, 0, 0, 0, F::kPBlockPartnerXor);
  out("const_kSfWords", 0, 0, 0, 0, F::kSfWords);
  out("const_kSfRowBytes", 0, 0, 0, 0, F::kSfRowBytes);
  for (int kc = 0; kc < TR::kKChunks; ++kc) {
    out("sf_word", kc, 0, 0, 0, Q::sf_word(kc));
    out("byte_id", kc, 0, 0, 0, Q::byte_id(kc));
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int kc = 0; kc < TR::kKChunks; ++kc) {
      for (int reg = 0; reg < 4; ++reg) out("q_data", kc, reg, lane, 0, F::q_data(kc, reg, g, t));
      for (int grp = 0; grp < 4; ++grp) {
        for (int jj = 0; jj < 2; ++jj) out("k_ldsm", grp, kc, jj, lane, F::k_ldsm(grp, kc, jj, lane));
      }
    }
    for (int w = 0; w < F::kSfWords; ++w) {
      out("q_scale", w, lane, 0, 0, F::q_scale(w, g, t));
      for (int grp = 0; grp < 4; ++grp) out("k_scale", grp, w, lane, 0, F::k_scale(grp, w, g, t));
    }
    for (int step = 0; step < F::kPvSteps; ++step) {
      out("v_ldsm", step, lane, 0, 0, F::v_ldsm(step, lane));
      out("v_scale", step, lane, 0, 0, F::v_scale(step, g, t));
    }
  }
  for (int r = 0; r < TR::kBlockN; ++r)
    for (int ch = 0; ch < TR::kKRowBytes / 16; ++ch) out("k_smem", r, ch, 0, 0, F::k_smem(r, ch));
  for (int d = 0; d < D; ++d) {
    for (int ch = 0; ch < TR::kVRowBytes / 16; ++ch) out("v_smem", d, ch, 0, 0, F::v_smem(d, ch));
    out("v_scale_row", d, 0, 0, 0, F::v_scale_row(d));
  }
  for (int x = 0; x < 2; ++x) {
    for (int breg = 0; breg < 2; ++breg) out("ldsm_result", x, breg, 0, 0, F::ldsm_result(x, breg));
    for (int jj = 0; jj < 2; ++jj) {
      out("tid_b", jj, x, 0, 0, F::tid_b(jj, x));
      for (int grp = 0; grp < 4; ++grp) out("pair_tile", grp, jj, x, 0, F::pair_tile(grp, jj, x));
    }
  }
  for (int step = 0; step < F::kPvSteps; ++step) {
    out("pv_chunk", step, 0, 0, 0, F::pv_chunk(step));
    out("pv_pair", step, 0, 0, 0, F::pv_pair(step));
    for (int x = 0; x < 2; ++x) out("o_tile", step, x, 0, 0, F::o_tile(step, x));
  }
  for (int j = 0; j < TR::kNTilesS; ++j)
    for (int t = 0; t < 4; ++t)
      for (int e = 0; e < 2; ++e) out("score_key", j, t, e, 0, score_key(j, t, e));
  for (int j = 0; j < TR::kNTilesO; ++j)
    for (int t = 0; t < 4; ++t)
      for (int e = 0; e < 2; ++e) out("out_col", j, t, e, 0, F::out_col(j, t, e));
  for (int grp = 0; grp < 4; ++grp)
    for (int t = 0; t < 4; ++t) out("p_block", grp, t, 0, 0, F::p_block(grp, t));
  for (int kc = 0; kc < 2; ++kc)
    for (int reg = 0; reg < 4; ++reg) out("p_group", kc, reg, 0, 0, F::p_group(kc, reg));
  for (int reg = 0; reg < 4; ++reg) out("p_row", reg, 0, 0, 0, F::p_row(reg));
  // The P scale word of each lane of a quad, from tagged scale bytes: tag = 0x80 | t << 4 | q << 1 | r
  // names the lane t whose block of group 2kc + q, row half r the byte carries.
  auto tag = [](int t, int q, int r) { return uint32_t(0x80 | t << 4 | q << 1 | r); };
  auto own = [&](int t) { return F::p_scale_own(t, tag(t, 0, 0), tag(t, 0, 1), tag(t, 1, 0), tag(t, 1, 1)); };
  for (int t = 0; t < 4; ++t)
    out("p_scale_word", t, 0, 0, 0, F::p_scale_word(own(t), own(t ^ F::kPScaleShuffleXor)));
}

int main() {
  dump<64, QkFormatNvfp4>();
  dump<128, QkFormatNvfp4>();
  dump<64, QkFormatMxfp8>();
  dump<128, QkFormatMxfp8>();
}
"""


@pytest.fixture(scope="module")
def all_tables(tmp_path_factory):
    """{(head_dim, qk_format): {name: int64 tensor indexed as the host program's loops, or int}}."""
    exe = compile_host_program(tmp_path_factory.mktemp("fragments"), "fragments", HOST_PROGRAM)
    rows = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    raw: dict[tuple, dict[str, dict[tuple, int]]] = {}
    for line in filter(None, rows):
        d, qk_format, name, *idx, value = line.split()
        raw.setdefault((int(d), qk_format), {}).setdefault(name, {})[tuple(map(int, idx))] = int(value)
    tables = {}
    for d, named in raw.items():
        tables[d] = {}
        for name, entries in named.items():
            if name.startswith("const_"):
                tables[d][name[6:]] = entries[(0, 0, 0, 0)]
                continue
            shape = [max(k[i] for k in entries) + 1 for i in range(4)]
            out = torch.full(shape, -1, dtype=torch.int64)
            for k, v in entries.items():
                out[k] = v
            while out.dim() > 1 and out.shape[-1] == 1:
                out = out.squeeze(-1)
            tables[d][name] = out
    return tables


@pytest.fixture(scope="module")
def kernel_tables(all_tables):
    """The NVFP4 Q·Kᵀ kernel's tables by head dim."""
    return {d: tab for (d, qk_format), tab in all_tables.items() if qk_format == "nvfp4"}


@pytest.fixture(scope="module")
def mx_tables(all_tables):
    """The MXFP8 Q·Kᵀ kernel's tables by head dim."""
    return {d: tab for (d, qk_format), tab in all_tables.items() if qk_format == "mxfp8"}


# ---------------------------------------------------------------------------------------------
# The hardware: PTX tables for m16n8k64 e2m1 with 4X ue4m3 scales, ldmatrix, shfl
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MmaModel:
    """One model of the instruction. ``a``: [32 lanes, 4 regs, 8 nibbles, (row, k)];
    ``b``: [32, 2, 8, (col, k)]; ``cd``: [32, 4, (row, col)]; ``sfa_lanes(tid_a)``: [16] the lane
    whose scale word row m takes; ``sfb_lanes(tid_b)``: [8] the same per column; ``scale_byte``:
    [64] which byte of that word scales k."""

    name: str
    a: torch.Tensor
    b: torch.Tensor
    cd: torch.Tensor
    sfa_lanes: callable
    sfb_lanes: callable
    scale_byte: torch.Tensor


def _fragment_k(t, reg_half, i, interleave="ptx"):
    # PTX: a lane owns the contiguous k range 8t..8t+7 of each 32-wide half.
    if interleave == "ptx":
        return 32 * reg_half + 8 * t + i
    return 32 * reg_half + 4 * i + t   # a wrong model: k interleaved across the quad


def ptx_model(variant: str = "ptx") -> MmaModel:
    """The PTX ISA's tables; ``variant`` names a deliberately wrong hardware model."""
    interleave = "interleaved" if variant == "k_interleaved" else "ptx"
    a = torch.empty(32, 4, 8, 2, dtype=torch.int64)
    b = torch.empty(32, 2, 8, 2, dtype=torch.int64)
    cd = torch.empty(32, 4, 2, dtype=torch.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):
            # a0: (g, 8t+i), a1: (g+8, 8t+i), a2: (g, 32+8t+i), a3: (g+8, 32+8t+i)
            for reg in range(4):
                a[lane, reg, i] = torch.tensor([g + 8 * (reg & 1), _fragment_k(t, reg >> 1, i, interleave)])
            # b0: (k = 8t+i, col g), b1: (k = 32+8t+i, col g)
            for reg in range(2):
                b[lane, reg, i] = torch.tensor([g, _fragment_k(t, reg, i, interleave)])
        rows = (g + 8, g) if variant == "cd_rows_swapped" else (g, g + 8)
        # c0, c1: row g, cols 2t, 2t+1; c2, c3: row g+8
        for reg in range(4):
            cd[lane, reg] = torch.tensor([rows[reg >> 1], 2 * t + (reg & 1)])

    def sfa_lanes(tid_a):
        # Table 37, 4X: lane 4g + 2*tid_a gives row g, lane 4g + 2*tid_a + 1 row g+8.
        even, odd = 4 * torch.arange(8) + 2 * tid_a, 4 * torch.arange(8) + 2 * tid_a + 1
        if variant == "sfa_pair_swapped":
            even, odd = odd, even
        return torch.cat([even, odd])

    def sfb_lanes(tid_b):
        # lane 4g + tid_b gives column g.
        return 4 * torch.arange(8) + (0 if variant == "tid_b_ignored" else tid_b)

    scale_byte = torch.arange(64) // 16   # byte j scales k in [16j, 16j + 16)
    if variant == "scale_bytes_reversed":
        scale_byte = 3 - scale_byte
    return MmaModel(variant, a, b, cd, sfa_lanes, sfb_lanes, scale_byte)


WRONG_MODELS = ("sfa_pair_swapped", "tid_b_ignored", "scale_bytes_reversed", "k_interleaved", "cd_rows_swapped")


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """[..., R] 32-bit words -> [..., R, 8] e2m1 codes, element i in bits [4i+3:4i]."""
    return (words[..., None] >> (4 * torch.arange(8))) & 0xF


def _scale_values(words: torch.Tensor) -> torch.Tensor:
    """[N] scale words -> [N, 4] ue4m3 values (byte j = bits [8j+7:8j])."""
    return fmt.e4m3_decode(((words[:, None] >> (8 * torch.arange(4))) & 0xFF).to(torch.uint8)).double()


def mma(model: MmaModel, a, b, sfa, sfb, c, tid_a: int, tid_b: int) -> torch.Tensor:
    """d [32, 4] = (A * SF_A)(B * SF_B) + C as ``model`` reads the registers (fp64, exact here).
    a [32, 4], b [32, 2], sfa/sfb [32] int64 words; c [32, 4] float64."""
    av = fmt.e2m1_decode(_nibbles(a).to(torch.uint8)).double()
    bv = fmt.e2m1_decode(_nibbles(b).to(torch.uint8)).double()
    dense_a = torch.full((16, 64), float("nan"), dtype=torch.float64)
    dense_b = torch.full((8, 64), float("nan"), dtype=torch.float64)
    dense_a[model.a[..., 0], model.a[..., 1]] = av
    dense_b[model.b[..., 0], model.b[..., 1]] = bv
    assert not dense_a.isnan().any() and not dense_b.isnan().any(), "a fragment table must cover the tile"
    scale_a = _scale_values(sfa[model.sfa_lanes(tid_a)])[:, model.scale_byte]   # [16, 64]
    scale_b = _scale_values(sfb[model.sfb_lanes(tid_b)])[:, model.scale_byte]   # [8, 64]
    dense_c = torch.empty(16, 8, dtype=torch.float64)
    dense_c[model.cd[..., 0], model.cd[..., 1]] = c
    dense_d = (dense_a * scale_a) @ (dense_b * scale_b).T + dense_c
    return dense_d[model.cd[..., 0], model.cd[..., 1]]


def word_at(buf: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Little-endian 32-bit words of a uint8 buffer at byte ``offsets`` (any shape)."""
    b = buf.long()
    return b[offsets] | (b[offsets + 1] << 8) | (b[offsets + 2] << 16) | (b[offsets + 3] << 24)


def ldmatrix_x4(smem: torch.Tensor, row_addr: torch.Tensor) -> torch.Tensor:
    """``ldmatrix.sync.aligned.m8n8.x4.b16``: lane L gives the address of row L%8 of matrix L/8;
    register i of lane L is the 4 bytes at 4*(L%4) of row L/4 of matrix i. -> [32, 4]."""
    rows = row_addr.view(4, 8)[:, G]                       # [matrix, lane]: the row this lane reads
    return word_at(smem, rows + 4 * T).T


# ---------------------------------------------------------------------------------------------
# Data with every product and sum exact in fp64
# ---------------------------------------------------------------------------------------------

def _codes(gen, *shape):
    return torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)


def _scales(gen, *shape):
    # ue4m3 from subnormal 2^-9 up to 2^4: products of two scales and two e2m1 values span
    # 2^-20..2^13, so a sum of 128 of them stays exact in fp64.
    return torch.randint(0x01, 0x58, shape, generator=gen, dtype=torch.uint8)


def _dequant(codes, scales):
    return fmt.e2m1_decode(codes).double() * fmt.e4m3_decode(scales).double().repeat_interleave(16, -1)


def _check_tables_cover(tab):
    # Every stored K row chunk / V^T row chunk has its own 16-byte place in the stage.
    for name in ("k_smem", "v_smem"):
        offs = tab[name].flatten()
        assert offs.unique().numel() == offs.numel(), f"{name}: two chunks share an address"
        assert (offs % 16 == 0).all()


def _accumulators_from_delta(delta, keys):
    """[32 lanes, 16 n8 tiles, 4] score accumulators holding the correction of their keys (the
    kernel's C operand: rows g and g+8 of a lane share a key)."""
    acc = torch.empty(32, 16, 4, dtype=torch.float64)
    for j in range(16):
        for e in range(2):
            acc[:, j, e] = acc[:, j, 2 + e] = delta[keys[j, T, e]]
    return acc


def _scores_in_key_order(acc, keys):
    """The accumulators as [16 rows, 128 keys] in natural key order (score_key)."""
    got = torch.full((16, 128), float("nan"), dtype=torch.float64)
    for j in range(16):
        for r in range(2):
            for e in range(2):
                got[G + 8 * r, keys[j, T, e]] = acc[:, j, 2 * r + e]
    assert not got.isnan().any(), "score_key must cover the tile"
    return got


def run_qk(tab, model, gen, d):
    """The kernel's Q·K^T of one warp (16 rows) over one 128-key tile, on ``model``.
    Returns (scores from the model [16, 128] in natural key order, dense reference)."""
    q_codes, q_sf = _codes(gen, 16, d), _scales(gen, 16, d // 16)
    k_codes, k_sf = _codes(gen, 128, d), _scales(gen, 128, d // 16)
    delta = torch.randint(-64, 64, (128,), generator=gen).double() / 16
    dense = _dequant(q_codes, q_sf) @ _dequant(k_codes, k_sf).T + delta

    # What the quantiser writes (format.py): Q rows as they are, K rows permuted inside 32-key groups.
    q_bytes, q_sf_bytes = fmt.pack_nibbles(q_codes).flatten(), q_sf.flatten()
    k_stored = fmt.pack_nibbles(fmt.permute_k_rows(k_codes, dim=0))
    k_sf_stored = fmt.permute_k_rows(k_sf, dim=0)
    # One pipeline stage as load_stage fills it: K chunks through the swizzle, scale rows in order.
    smem = torch.zeros(tab["kStageBytes"], dtype=torch.uint8)
    for r in range(128):
        for ch in range(d // 32):
            smem[tab["k_smem"][r, ch]:tab["k_smem"][r, ch] + 16] = k_stored[r, 16 * ch:16 * ch + 16]
    smem[tab["kOffKSf"]:tab["kOffKSf"] + k_sf_stored.numel()] = k_sf_stored.flatten()

    qa = word_at(q_bytes, tab["q_data"].permute(2, 0, 1))          # [lane, kc, reg]
    qsf = word_at(q_sf_bytes, tab["q_scale"].T)                     # [lane, kc]
    keys = tab["score_key"]                                         # [j, t, e]
    acc = _accumulators_from_delta(delta, keys)
    for grp in range(4):
        for kc in range(tab["kKChunks"]):
            sfb = word_at(smem, tab["k_scale"][grp, kc])
            for jj in range(2):
                r = ldmatrix_x4(smem, tab["k_ldsm"][grp, kc, jj])
                for x in range(2):
                    b = r[:, tab["ldsm_result"][x]]
                    j = tab["pair_tile"][grp, jj, x]
                    acc[:, j] = mma(model, qa[:, kc], b, qsf[:, kc], sfb, acc[:, j], tab["kTidA"],
                                    int(tab["tid_b"][jj, x]))
    return _scores_in_key_order(acc, keys), dense


def run_pv(tab, model, gen, d):
    """The kernel's P·V of one warp over one 128-key tile: P as the softmax packs it from the
    score registers, V^T as stored. Returns (model [16, D], dense reference)."""
    p_codes = torch.randint(0, 8, (16, 128), generator=gen, dtype=torch.uint8)   # P >= 0
    p_sf = _scales(gen, 16, 8)
    v_codes, v_sf_t = _codes(gen, 128, d), _scales(gen, d, 8)
    dense = _dequant(p_codes, p_sf) @ _dequant(v_codes.T, v_sf_t).T

    keys, block = tab["score_key"], tab["p_block"]
    # The lane's 8 values of group grp are score elements (j = 4grp + i/2, e = i%2), the kernel's
    # pv[2a + e]; they and its xor-partner's 8 make up block p_block(grp, t).
    own = torch.stack([keys[4 * torch.arange(4)[:, None] + torch.arange(8) // 2, t, torch.arange(8) % 2]
                       for t in range(4)])                                    # [t, grp, 8]
    for t in range(4):
        both = torch.cat([own[t], own[t ^ tab["kPBlockPartnerXor"]]], 1)      # [grp, 16]
        assert torch.equal(both.sort(1).values // 16, block[:, t, None].expand(4, 16)), "P block"
    preg = torch.zeros(32, 4, 2, dtype=torch.int64)
    for r in range(2):
        codes = p_codes[(G + 8 * r)[:, None, None], own[T]].long()          # [lane, grp, 8]
        preg[:, :, r] = (codes << (4 * torch.arange(8))).sum(-1)
    psf = torch.stack([p_sf[(G + 8 * r)[:, None], block[:, T].T] for r in range(2)], -1).long()  # [lane, grp, r]

    pa = torch.stack([preg[:, tab["p_group"][kc], tab["p_row"]] for kc in range(2)], 1)        # [lane, kc, reg]
    sfp = torch.zeros(32, 2, dtype=torch.int64)
    for kc in range(2):
        for byte in range(4):
            tag = (tab["p_scale_word"][T] >> (8 * byte)) & 0xFF
            assert (tag & 0x80).all()
            src_t, q, r = (tag >> 4) & 3, (tag >> 1) & 1, tag & 1
            src_lane = 4 * G + src_t
            sfp[:, kc] |= psf[src_lane, 2 * kc + q, r] << (8 * byte)

    vt_bytes = fmt.pack_nibbles(v_codes.T.contiguous())                        # [D, 64]
    smem = torch.zeros(tab["kStageBytes"], dtype=torch.uint8)
    for dd in range(d):
        for ch in range(4):
            smem[tab["v_smem"][dd, ch]:tab["v_smem"][dd, ch] + 16] = vt_bytes[dd, 16 * ch:16 * ch + 16]
        smem[tab["v_scale_row"][dd]:tab["v_scale_row"][dd] + 8] = v_sf_t[dd]
    o = torch.zeros(32, d // 8, 4, dtype=torch.float64)
    for step in range(tab["kPvSteps"]):
        kc, jj = int(tab["pv_chunk"][step]), int(tab["pv_pair"][step])
        r = ldmatrix_x4(smem, tab["v_ldsm"][step])
        sfb = word_at(smem, tab["v_scale"][step])
        for x in range(2):
            j = tab["o_tile"][step, x]
            o[:, j] = mma(model, pa[:, kc], r[:, tab["ldsm_result"][x]], sfp[:, kc], sfb, o[:, j], tab["kTidA"],
                          int(tab["tid_b"][jj, x]))
    got = torch.full((16, d), float("nan"), dtype=torch.float64)
    cols = tab["out_col"]
    for j in range(d // 8):
        for r in range(2):
            for e in range(2):
                got[G + 8 * r, cols[j, T, e]] = o[:, j, 2 * r + e]
    assert not got.isnan().any(), "out_col must cover the output"
    return got, dense


# ---------------------------------------------------------------------------------------------
# The 8-bit Q·Kᵀ: m16n8k32 kind::mxf8f6f4 e4m3 x e4m3, ue8m0 scale_vec::1X
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Mma8Model:
    """``a``: [32 lanes, 4 regs, 4 bytes, (row, k)]; ``b``: [32, 2, 4, (col, k)]; C/D and the scale
    lanes as for the FP4 model; ``uses_byte_id``: whether the byte-id selector picks the byte."""

    name: str
    a: torch.Tensor
    b: torch.Tensor
    cd: torch.Tensor
    sfa_lanes: callable
    sfb_lanes: callable
    uses_byte_id: bool = True


def ptx_model8(variant: str = "ptx") -> Mma8Model:
    """PTX "Matrix Fragments for mma.m16n8k32" (8-bit types) and Table 37 (1X: one ue8m0 per row or
    column for the whole k32, byte byte-id of the selected lane's register)."""
    fp4 = ptx_model(variant if variant in ("cd_rows_swapped", "sfa_pair_swapped", "tid_b_ignored") else "ptx")
    a = torch.empty(32, 4, 4, 2, dtype=torch.int64)
    b = torch.empty(32, 2, 4, 2, dtype=torch.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            k = 4 * t + i
            for reg in range(4):   # a0: (g, k), a1: (g+8, k), a2: (g, 16+k), a3: (g+8, 16+k)
                a[lane, reg, i] = torch.tensor([g + 8 * (reg & 1), 16 * (reg >> 1) + k])
            for reg in range(2):   # b0: (k, col g), b1: (16+k, col g)
                b[lane, reg, i] = torch.tensor([g, 16 * reg + k])
    return Mma8Model(variant, a, b, fp4.cd, fp4.sfa_lanes, fp4.sfb_lanes, variant != "byte_id_ignored")


# A k order inside the chunk is no failure mode here: one scale covers the whole k32, so any
# relabelling of k that A and B share gives the same dot product.
WRONG_MODELS_8BIT = ("byte_id_ignored", "sfa_pair_swapped", "tid_b_ignored", "cd_rows_swapped")


def mma8(model: Mma8Model, a, b, sfa, sfb, c, tid_a: int, tid_b: int, byte_id: int) -> torch.Tensor:
    """d [32, 4] = (A * SF_A)(B * SF_B) + C of the 8-bit block-scaled MMA as ``model`` reads it."""
    def e4m3(words):
        return fmt.e4m3_decode(((words[..., None] >> (8 * torch.arange(4))) & 0xFF).to(torch.uint8)).double()

    dense_a = torch.full((16, 32), float("nan"), dtype=torch.float64)
    dense_b = torch.full((8, 32), float("nan"), dtype=torch.float64)
    dense_a[model.a[..., 0], model.a[..., 1]] = e4m3(a)
    dense_b[model.b[..., 0], model.b[..., 1]] = e4m3(b)
    assert not dense_a.isnan().any() and not dense_b.isnan().any(), "a fragment table must cover the tile"
    byte = byte_id if model.uses_byte_id else 0
    scale_a = fmt.ue8m0_decode((sfa[model.sfa_lanes(tid_a)] >> (8 * byte)) & 0xFF).double()   # [16]
    scale_b = fmt.ue8m0_decode((sfb[model.sfb_lanes(tid_b)] >> (8 * byte)) & 0xFF).double()   # [8]
    dense_c = torch.empty(16, 8, dtype=torch.float64)
    dense_c[model.cd[..., 0], model.cd[..., 1]] = c
    dense_d = (dense_a * scale_a[:, None]) @ (dense_b * scale_b[:, None]).T + dense_c
    return dense_d[model.cd[..., 0], model.cd[..., 1]]


def _e4m3_codes(gen, *shape):
    # e4m3 bytes from subnormals to 2^4, never NaN: products and sums of 128 stay exact in fp64.
    codes = torch.randint(0, 0x58, shape, generator=gen, dtype=torch.uint8)
    return codes | (torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7)


def _dequant_mx(codes, scales):
    return fmt.e4m3_decode(codes).double() * fmt.ue8m0_decode(scales).double().repeat_interleave(32, -1)


def run_qk_mx(tab, model, gen, d):
    """The kernel's MXFP8 Q·K^T of one warp over one 128-key tile on the 8-bit ``model``."""
    q_codes, q_sf = _e4m3_codes(gen, 16, d), torch.randint(120, 134, (16, d // 32), generator=gen).to(torch.uint8)
    k_codes, k_sf = _e4m3_codes(gen, 128, d), torch.randint(120, 134, (128, d // 32), generator=gen).to(torch.uint8)
    delta = torch.randint(-64, 64, (128,), generator=gen).double() / 16
    dense = _dequant_mx(q_codes, q_sf) @ _dequant_mx(k_codes, k_sf).T + delta

    # The stored layouts of format.py (mxfp8: one byte per element, d/32 scale bytes per row), and
    # 4 bytes of slack: a scale word of the last row reads past a 2-byte row (D=64), as the kernel's
    # 2-byte load does not; the byte-id never selects them.
    q_bytes = torch.cat([q_codes.flatten(), torch.zeros(4, dtype=torch.uint8)])
    q_sf_bytes = torch.cat([q_sf.flatten(), torch.zeros(4, dtype=torch.uint8)])
    k_stored, k_sf_stored = fmt.permute_k_rows(k_codes, dim=0), fmt.permute_k_rows(k_sf, dim=0)
    smem = torch.zeros(tab["kStageBytes"] + 4, dtype=torch.uint8)
    for r in range(128):
        for ch in range(d // 16):
            smem[tab["k_smem"][r, ch]:tab["k_smem"][r, ch] + 16] = k_stored[r, 16 * ch:16 * ch + 16]
    smem[tab["kOffKSf"]:tab["kOffKSf"] + k_sf_stored.numel()] = k_sf_stored.flatten()

    qa = word_at(q_bytes, tab["q_data"].permute(2, 0, 1))                      # [lane, kc, reg]
    qsf = word_at(q_sf_bytes, tab["q_scale"].reshape(tab["kSfWords"], 32).T)   # [lane, w]
    keys = tab["score_key"]
    acc = _accumulators_from_delta(delta, keys)
    k_scale = tab["k_scale"].reshape(4, tab["kSfWords"], 32)
    for grp in range(4):
        for kc in range(tab["kKChunks"]):
            w, byte_id = int(tab["sf_word"][kc]), int(tab["byte_id"][kc])
            sfb = word_at(smem, k_scale[grp, w])
            for jj in range(2):
                r = ldmatrix_x4(smem, tab["k_ldsm"][grp, kc, jj])
                for x in range(2):
                    j = tab["pair_tile"][grp, jj, x]
                    acc[:, j] = mma8(model, qa[:, kc], r[:, tab["ldsm_result"][x]], qsf[:, w], sfb, acc[:, j],
                                     tab["kTidA"], int(tab["tid_b"][jj, x]), byte_id)
    return _scores_in_key_order(acc, keys), dense


def _rel_err(got, want):
    return ((got - want).norm() / want.norm()).item()


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

def test_ptx_tables_are_bijections():
    m = ptx_model()
    a = m.a[..., 0] * 64 + m.a[..., 1]
    b = m.b[..., 0] * 64 + m.b[..., 1]
    cd = m.cd[..., 0] * 8 + m.cd[..., 1]
    assert torch.equal(a.flatten().sort().values, torch.arange(16 * 64))
    assert torch.equal(b.flatten().sort().values, torch.arange(8 * 64))
    assert torch.equal(cd.flatten().sort().values, torch.arange(16 * 8))
    # Spot entries read off the PTX table: lane 5 (g 1, t 1) register a2 nibble 3 is A[1][43].
    assert m.a[5, 2, 3].tolist() == [1, 43] and m.a[30, 1, 7].tolist() == [15, 23]
    assert m.b[13, 1, 0].tolist() == [3, 40] and m.cd[6, 3].tolist() == [9, 5]
    for tid_a in (0, 1):
        assert m.sfa_lanes(tid_a)[[0, 8, 7, 15]].tolist() == [2 * tid_a, 2 * tid_a + 1, 28 + 2 * tid_a, 29 + 2 * tid_a]


@pytest.mark.parametrize("tid_a", [0, 1])
@pytest.mark.parametrize("tid_b", [0, 1, 2, 3])
def test_model_matches_dense_product_for_every_selector(tid_a, tid_b):
    """Registers laid out straight from the PTX tables (not through the kernel)."""
    gen = torch.Generator().manual_seed(10 * tid_a + tid_b)
    m = ptx_model()
    a_codes, b_codes = _codes(gen, 16, 64), _codes(gen, 8, 64)
    sfa, sfb = _scales(gen, 16, 4).long(), _scales(gen, 8, 4).long()
    a = (a_codes.long()[m.a[..., 0], m.a[..., 1]] << (4 * torch.arange(8))).sum(-1)
    b = (b_codes.long()[m.b[..., 0], m.b[..., 1]] << (4 * torch.arange(8))).sum(-1)
    sfa_reg = torch.randint(0, 2**32, (32,), generator=gen)   # unread lanes hold garbage
    sfb_reg = torch.randint(0, 2**32, (32,), generator=gen)
    sfa_reg[m.sfa_lanes(tid_a)] = (sfa << (8 * torch.arange(4))).sum(-1)
    sfb_reg[m.sfb_lanes(tid_b)] = (sfb << (8 * torch.arange(4))).sum(-1)
    c = torch.randint(-8, 8, (32, 4), generator=gen).double()
    d = mma(m, a, b, sfa_reg, sfb_reg, c, tid_a, tid_b)
    dense = (_dequant(a_codes, sfa.to(torch.uint8)) @ _dequant(b_codes, sfb.to(torch.uint8)).T)
    dense_c = torch.empty(16, 8, dtype=torch.float64)
    dense_c[m.cd[..., 0], m.cd[..., 1]] = c
    assert torch.equal(d, (dense + dense_c)[m.cd[..., 0], m.cd[..., 1]])


def test_kernel_key_order_and_delta_loads(kernel_tables):
    for d, tab in kernel_tables.items():
        _check_tables_cover(tab)
        keys = tab["score_key"]
        # Each key of a tile is one score element; a lane owns the keys 8t..8t+7 of each 32-key group.
        assert torch.equal(keys.flatten().sort().values, torch.arange(128))
        for t in range(4):
            owned = keys[:, t].flatten() % 32
            assert set(owned.tolist()) == set(range(8 * t, 8 * t + 8))
        # The kernel loads delta for group q as one 16-byte load of 8 fp16 values at score_key(4q, t, 0)
        # (a multiple of 8): the 8 keys must be score_key(4q, t, 0) + 2a + e.
        for q in range(4):
            assert torch.all(keys[4 * q, :, 0] % 8 == 0)
            for a in range(4):
                for e in range(2):
                    assert torch.equal(keys[4 * q + a, :, e], keys[4 * q, :, 0] + 2 * a + e)
        # The K permutation of format.py is what score_key assumes.
        perm = torch.tensor(fmt.K_ROW_PERM)
        for j in range(16):
            for t in range(4):
                for e in range(2):
                    stored_row = 8 * j + 2 * t + e
                    assert keys[j, t, e] == 32 * (stored_row // 32) + perm[stored_row % 32]


# product -> (the kernel's construction, its Q·Kᵀ format, the hardware model)
PRODUCTS = {"qk-nvfp4": (run_qk, "nvfp4", ptx_model), "pv-nvfp4": (run_pv, "nvfp4", ptx_model),
            "qk-mxfp8": (run_qk_mx, "mxfp8", ptx_model8)}


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("product", list(PRODUCTS))
def test_kernel_products_on_the_ptx_model_are_exact(all_tables, d, product):
    run, qk_format, model = PRODUCTS[product]
    gen = torch.Generator().manual_seed(d + 100 * list(PRODUCTS).index(product))
    for _ in range(2):
        got, dense = run(all_tables[(d, qk_format)], model(), gen, d)
        assert torch.equal(got, dense)


@pytest.mark.parametrize("variant", WRONG_MODELS)
@pytest.mark.parametrize("product", ["qk", "pv"])
def test_wrong_hardware_models_fail(kernel_tables, variant, product):
    """The construction is only right for the PTX model: each wrong model is far off."""
    d = 128
    gen = torch.Generator().manual_seed(7)
    run = run_qk if product == "qk" else run_pv
    got, dense = run(kernel_tables[d], ptx_model(variant), gen, d)
    assert _rel_err(got, dense) > 0.1, (variant, product, _rel_err(got, dense))


def test_8bit_ptx_tables_are_bijections():
    m = ptx_model8()
    a = m.a[..., 0] * 32 + m.a[..., 1]
    b = m.b[..., 0] * 32 + m.b[..., 1]
    assert torch.equal(a.flatten().sort().values, torch.arange(16 * 32))
    assert torch.equal(b.flatten().sort().values, torch.arange(8 * 32))
    # Spot entries: lane 5 (g 1, t 1) register a2 byte 3 is A[1][16 + 7]; lane 30 b1 byte 0 is B[16 + 8][7].
    assert m.a[5, 2, 3].tolist() == [1, 23] and m.b[30, 1, 0].tolist() == [7, 24]


def test_mx_tables_share_the_fp4_data_addresses(kernel_tables, mx_tables):
    """A 32-byte chunk of a row is one MMA in both formats: the same data addressing functions."""
    for d in HEAD_DIMS:
        fp4, mx = kernel_tables[d], mx_tables[d]
        assert mx["kKChunks"] == 2 * fp4["kKChunks"] and mx["kSfRowBytes"] == d // 32
        assert torch.equal(mx["byte_id"], torch.arange(d // 32) % 4) and torch.equal(mx["sf_word"], torch.arange(d // 32) // 4)
        _check_tables_cover(mx)


@pytest.mark.parametrize("variant", WRONG_MODELS_8BIT)
def test_wrong_8bit_hardware_models_fail(mx_tables, variant):
    gen = torch.Generator().manual_seed(9)
    got, dense = run_qk_mx(mx_tables[128], ptx_model8(variant), gen, 128)
    assert _rel_err(got, dense) > 0.1, (variant, _rel_err(got, dense))
