"""scripts/model_sm120.py: the static sm_120 cost model of the native kernel (no GPU needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import model_sm120  # noqa: E402

check_sass = model_sm120.check_sass

needs_toolchain = pytest.mark.skipif(
    check_sass.find_tool("nvcc") is None or check_sass.find_tool("nvdisasm") is None,
    reason="needs nvcc and nvdisasm (PyPI nvidia-cuda-nvdisasm)")


def test_pipes_and_wavefronts():
    pipe = model_sm120.pipe_of
    assert pipe("OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X") == "tensor"
    assert pipe("MUFU.EX2") == "mufu" and pipe("I2F.U32") == "mufu"
    assert pipe("FFMA") == "fma" and pipe("HMUL2") == "fma"
    assert pipe("FMNMX") == "alu" and pipe("IMAD.WIDE.U32") == "alu" and pipe("F2FP.SATFINITE.E2M1.F32.PACK_AB") == "alu"
    assert pipe("LDSM.16.M88.4") == "smem" and pipe("SHFL.BFLY") == "smem"
    assert pipe("UIADD3") == "issue" and pipe("BRA.U") == "issue"
    assert model_sm120.smem_wavefronts("LDSM.16.M88.4") == 4 and model_sm120.smem_wavefronts("LDSM.16.M88.2") == 2
    assert model_sm120.smem_wavefronts("LDS.128") == 1 and model_sm120.smem_wavefronts("LDGSTS.E.BYPASS.128") == 0


SYNTHETIC = """
.text._Z6kernel:
\t//## File "/x/kernel.cuh", line 10
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0020*/                   OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X R20, R36, R56, R20, R211, R76, URZ ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
\t//## File "/x/mask.cuh", line 20
        /*0040*/                   FSEL R3, R3, -INF, P1 ;
.L_x_1:
\t//## File "/x/kernel.cuh", line 30
        /*0050*/                   MUFU.EX2 R4, R4 ;
        /*0060*/              @!P2 BRA `(.L_x_2) ;
        /*0070*/                   FMUL R5, R5, R6 ;
.L_x_2:
        /*0080*/                   OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X R20, R36, R56, R20, R211, R76, URZ ;
        /*0090*/                   BRA.U UP0, `(.L_x_0) ;
        /*00a0*/                   EXIT ;
"""


def test_loop_and_cold_regions_from_line_info():
    fn = model_sm120.parse_nvdisasm(SYNTHETIC)["_Z6kernel"]
    first, last = model_sm120.tile_loop(fn, 2)
    assert (fn.code[first].addr, fn.code[last].addr) == (0x10, 0x90)
    cold = model_sm120.cold_regions(fn, first, last, rescale_lines={30})
    assert [fn.code[i].opcode for i in cold["mask"]] == ["FSEL"]
    assert [fn.code[i].opcode for i in cold["rescale"]] == ["FMUL"]
    with pytest.raises(RuntimeError, match="no loop"):
        model_sm120.tile_loop(fn, 3)
    row = model_sm120.model_kernel(fn, 64, causal=False, rescale_lines={30}, stage_bytes=1280, mma_per_tile=(1, 1))
    assert row["instructions"] == 7 and row["tensor"] == 2 and row["cold_skipped"] == {"mask": 1, "rescale": 1}
    # Phase A: BAR + OMMA (tensor 2 warps x 16) with the stage fill; phase B: 3 BRA, MUFU, OMMA.
    a, b = row["phase_clocks"]
    assert a == {"issue": 4, "tensor": 32, "mufu": 0, "fma+alu": 0, "smem": 10}
    assert b == {"issue": 10, "tensor": 32, "mufu": 16, "fma+alu": 0, "smem": 0}
    assert row["clocks_per_tile"] == 64 and row["tensor_share"] == 1.0
    causal = model_sm120.model_kernel(fn, 64, causal=True, rescale_lines={30}, stage_bytes=1280, mma_per_tile=(1, 1))
    assert causal["instructions"] == 9 and causal["fma"] == 1 and causal["alu"] == 1


def test_rescale_lines_are_found_in_the_kernel_source():
    lines = model_sm120.rescale_source_lines((check_sass.CSRC / "attention" / "kernel.cuh").read_text())
    assert len(lines) == 4


@pytest.mark.compile
@needs_toolchain
def test_model_of_the_native_build_against_the_recorded_baseline():
    rows = model_sm120.model()
    baseline = json.loads(model_sm120.BASELINE.read_text())
    assert model_sm120.check_baseline(rows, baseline) == []
    assert {(r["qk_format"], r["head_dim"], r["causal"]) for r in rows} == {
        (f, d, c) for f in ("nvfp4", "mxfp8") for d in (64, 128) for c in (False, True)}
    for r in rows:
        qk, pv = model_sm120.mma_counts(r["head_dim"], r["qk_format"])
        assert r["tensor"] == qk + pv and r["tensor_clocks_per_tile"] == 2 * 16 * (qk + pv)
        assert r["tensor_clocks_per_tile"] <= r["overlapped_clocks"] <= r["clocks_per_tile"]
    out = model_sm120.gpu_rows(rows)
    assert {"gpu", "head_dim", "causal", "qk_format", "clocks_per_tile", "tensor_clocks_per_tile", "tflops"} <= set(out[0])
    # A slower kernel (a baseline 3 % lower) fails the check.
    tighter = [dict(b, clocks_per_tile=int(b["clocks_per_tile"] / 1.03)) for b in baseline]
    assert len(model_sm120.check_baseline(rows, tighter)) == len(rows)


def test_preparation_model_counts_bytes():
    r = model_sm120.preparation(32_768, 1000.0)
    elems = 32_768 * 40 * 128
    # Q, K, V read once plus their 16 statistics tiles per head, codes and scales written, the
    # fix-up reading and rewriting K's and V's scale bytes, the means, q . km, the block statistics
    quantiser = (3 * 2 * elems + 3 * 16 * 128 * 40 * 128 * 2 + 3 * elems / 2 + 3 * elems / 16 + 2 * 2 * elems / 16
                 + 257 * 40 * 128 * 4 + 32_768 * 40 * 4 + 256 * 40 * 128 * 4 + 256 * 40 * 4)
    # and the low-rank smoothing: Q read once more for its block means (written, read by the basis),
    # the coefficients and smoothed means (written, read back), 16 fp16 key projections per key and
    # query head with a factor per 128 keys
    smoothing = 2 * elems + 2 * 256 * 40 * 128 * 4 + 256 * 40 * (15 + 2 * 128) * 4 + 32_768 * 40 * (32 + 4 / 128)
    assert r["quantize_gb"] == pytest.approx((quantiser + smoothing) / 1e9)
    assert r["quantize_ms"] == pytest.approx((quantiser + smoothing) / model_sm120.MEMORY_BANDWIDTH * 1e3)
    assert r["attention_ms"] == pytest.approx(4 * 32_768 ** 2 * 128 * 40 / 1e15 * 1e3)
    assert r["share"] == pytest.approx(r["quantize_ms"] / r["attention_ms"])
    assert r["estimate_ms"] == 0.0
    # At density 0.25 the estimate adds its scores and lists, and the share is against the sparse
    # attention time.
    q = model_sm120.preparation(32_768, 1000.0, density=0.25, attention_vs_dense=0.26)
    assert q["quantize_ms"] == r["quantize_ms"]
    nq = 256
    lists = 2 * nq * nq * 40 * 4 + 3 * nq * 40 * 8 * 4 * 2 + 0.25 * nq * nq * 40 * 4
    assert q["estimate_ms"] == pytest.approx(lists / model_sm120.MEMORY_BANDWIDTH * 1e3)
    assert q["attention_ms"] == pytest.approx(0.26 * r["attention_ms"])
    assert q["share"] == pytest.approx((q["quantize_ms"] + q["estimate_ms"]) / q["attention_ms"])


def test_preparation_rows_cover_the_lengths_and_densities():
    base = {"qk_format": "nvfp4", "head_dim": 128, "causal": False, "clocks_per_tile": 1000,
            "sparse_clocks_per_tile": 1001, **{f"tflops {g}": 1000.0 for g in model_sm120.GPUS}}
    rows = model_sm120.preparation_rows([base])
    assert {(r["gpu"], r["seq"], r["density"]) for r in rows} == {
        (g, s, d) for g in model_sm120.GPUS for s in (32_768, 77_000, 118_800) for d in (1.0, 0.25)}
    for r in rows:
        if r["density"] < 1:
            dense = next(x for x in rows if (x["gpu"], x["seq"], x["density"]) == (r["gpu"], r["seq"], 1.0))
            assert r["share"] > dense["share"] and r["estimate_ms"] > 0
