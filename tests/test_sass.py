"""Native-build check without a GPU (CI): the sm_120a/sm_121a cubins carry the block-scaled FP4
MMA as often as the warp layout implies, with the expected scale selectors, no spills and no
local memory. See
scripts/check_sass.py (needs nvcc and PyPI nvidia-cuda-cuobjdump + nvidia-cuda-nvdisasm)."""

import importlib.util
from pathlib import Path

import pytest

from nvfp4_dit.cuda import abi

_SPEC = importlib.util.spec_from_file_location(
    "check_sass", Path(__file__).resolve().parent.parent / "scripts" / "check_sass.py")
check_sass = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(check_sass)


def test_expected_mma_count_follows_the_warp_layout():
    # 512 m16n8k64 per 128x128 CTA tile at D=128 over 8 warps.
    assert check_sass.expected_mma_per_warp(128) * 8 == 512
    assert check_sass.expected_mma_per_warp(64) * 8 == 256
    assert check_sass.expected_mma_in_sass(128) == 96 and check_sass.expected_mma_in_sass(64) == 48
    # MXFP8 Q·Kᵀ: m16n8k32 (half the k of a k64 MMA), all in the loop; P·V as for NVFP4.
    assert check_sass.expected_mx_mma_in_sass(128) == (64, 64) and check_sass.expected_mx_mma_in_sass(64) == (32, 32)


@pytest.mark.compile
@pytest.mark.skipif(check_sass.find_tool("nvcc") is None, reason="needs nvcc")
def test_native_sass_has_fp4_mma_and_no_spills():
    rows, failures = check_sass.check()
    # archs x Q·Kᵀ formats x head dims x (dense / block-sparse); each writes the LSE on request
    assert len(rows) == 2 * 2 * 2 * 2
    assert sum(r["sparse"] for r in rows) == len(rows) // 2
    assert {r["qk_format"] for r in rows if r["qmma"]} == {"mxfp8"}
    assert not failures, "\n".join(failures)


@pytest.mark.compile
@pytest.mark.skipif(check_sass.find_tool("nvcc") is None, reason="needs nvcc")
def test_native_preparation_kernels_do_not_spill():
    """The quantiser's, the smoothing basis and the block-list kernels for sm_120a/sm_121a: no
    spills."""
    rows, failures = check_sass.check_preparation()
    lists = {r["kernel"] for r in rows if r["kernel"].startswith("nvfp4_dit_block_")}
    assert lists == set(abi.BLOCK_LISTS_ENTRIES)
    # and the quantiser's: per head dim the balance and key statistics and the smoothing basis (any
    # dtype), and per input dtype and head dim the Q block means, the K/Q tiles of each Q·Kᵀ format
    # and the V^T tiles
    assert len(rows) == 2 * (2 * 3 + 3 * 2 * 4) + 2 * len(lists)
    assert not failures, "\n".join(failures)


_OMMA_LINE = "        /*{:04x}*/                   {} R4, R8, R12, R4, R16, R17, {} ;  /* 0x0 */"


def _sass(*lines):
    body = "\n".join(_OMMA_LINE.format(16 * i, *line.split("|")) if "|" in line else
                     f"        /*{16 * i:04x}*/                   {line} ;  /* 0x0 */" for i, line in enumerate(lines))
    return "\t\tFunction : kernel\n" + body


def test_selector_operands_follow_uniform_register_writes():
    omma = check_sass.OMMA
    counts = check_sass.sass_counts(_sass(
        f"{omma}|URZ", "UMOV UR5, 0x20", f"{omma}|UR5", "UMOV UR5, 0x40", f"{omma}|UR5",
        "LDCU UR5, c[0x0][0x10]", f"{omma}|UR5", f"{omma}|UR9"))["kernel"]
    assert counts["omma"] == 5
    assert counts["selectors"] == [0, 0x20, 0x40, None, None]


def test_byte_id_check_of_the_8bit_mma():
    encoding = {16 * b + 4 * i: (0, b, i) for b in range(4) for i in range(4)}
    good = [16 * b + 4 * i for b in range(4) for i in range(4)] * 2
    assert check_sass.selector_failures("k", good, encoding, 32, byte_ids=4) == []
    stuck = [16 * b for b in range(4) for _ in range(4)] * 2                        # byte-id stuck at 0
    assert check_sass.selector_failures("k", stuck, encoding, 32, byte_ids=4)
    half = [16 * b + 4 * i for b in range(4) for i in range(2)] * 2                 # D=64: byte-ids 0, 1
    assert check_sass.selector_failures("k", half, encoding, 16, byte_ids=2) == []


def test_selector_check_flags_wrong_or_unknown_selectors():
    encoding = {0x0: (0, 0), 0x20: (0, 1), 0x40: (0, 2), 0x60: (0, 3), 0x4: (1, 0)}
    good = [0x0, 0x20, 0x40, 0x60] * 2
    assert check_sass.selector_failures("k", good, encoding, 8) == []
    assert check_sass.selector_failures("k", [0x4] + good[1:], encoding, 8)        # thread-id-a 1
    assert check_sass.selector_failures("k", [0x0] * 8, encoding, 8)                # thread-id-b stuck at 0
    assert check_sass.selector_failures("k", [None] + good[1:], encoding, 8)        # not a constant
    assert check_sass.selector_failures("k", [0x80] + good[1:], encoding, 8)        # not in the encoding


@pytest.mark.skipif(check_sass.find_tool("nvcc") is None, reason="needs nvcc")
def test_selector_encoding_is_read_off_the_probe_kernels(tmp_path):
    encoding = check_sass.selector_encoding("120a", tmp_path)
    assert sorted(encoding.values()) == [(a, b) for a in range(2) for b in range(4)]
    assert encoding[0] == (0, 0)


@pytest.mark.skipif(check_sass.find_tool("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("mma", ["MmaEmulated", "MmaNative"])
def test_illegal_scale_selector_does_not_compile(tmp_path, mma):
    # thread-id-a = 2 is undefined for scale_vec::4X; both back-ends must refuse it at compile time.
    import subprocess

    src = tmp_path / "bad_selector.cu"
    src.write_text(
        '#include "attention/mma_emulated.cuh"\n#include "attention/mma_native.cuh"\n'
        "__global__ void k(float* d) { float acc[4] = {}; const uint32_t a[4] = {}, b[2] = {};\n"
        f"  nvfp4_dit::{mma}::mma<2, 0>(acc, a, b, 0u, 0u); d[0] = acc[0]; }}\n")
    res = subprocess.run([check_sass.find_tool("nvcc"), "-c", "-std=c++17", f"-I{check_sass.CSRC}", str(src),
                          "-o", str(tmp_path / "bad.o"), "-gencode=arch=compute_90a,code=sm_90a"],
                         capture_output=True, text=True)
    assert res.returncode != 0
    assert "thread-id-a must be 0 or 1" in res.stderr + res.stdout
