"""The Python mirror of the kernels' launch interface (nvfp4_dit/cuda/abi.py) agrees with the one
C++ definition: every field's offset and every struct's size from csrc/attention/params.h and
csrc/quantize/params.h, and every constant of csrc/common/launch.h, compiled with the host C++
compiler; the workspace sizes on many sizes."""

import ctypes
import itertools
import os
import shutil
import subprocess

import pytest
import torch

from nvfp4_dit import format as fmt
from nvfp4_dit.cuda import build
from nvfp4_dit.cuda import abi

try:
    from host_program import compile_host_program
except ImportError:  # tests/ imported as a package
    from tests.host_program import compile_host_program

CSRC = build.csrc_dir()
# Fail rather than skip where CI promises the compilers (.ci/run sets it).
REQUIRE = os.environ.get("NVFP4_DIT_REQUIRE_NVCC") == "1"


def _host_compiler() -> str:
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    if REQUIRE:
        pytest.fail("no host C++ compiler, and NVFP4_DIT_REQUIRE_NVCC=1")
    pytest.skip("no host C++ compiler")


def _layout_program() -> str:
    lines = ['#include <cstddef>', '#include <cstdio>', '#include "attention/params.h"', '#include "quantize/params.h"',
             '#include "common/launch.h"', "using namespace nvfp4_dit;", "int main() {"]
    for name, struct in abi.STRUCTS.items():
        lines.append(f'  std::printf("size {name} %zu\\n", sizeof({name}));')
        for field, _ in struct._fields_:
            lines.append(f'  std::printf("offset {name}.{field} %zu\\n", offsetof({name}, {field}));')
    constants = {
        "ATTENTION_THREADS": "launch::kAttentionThreads", "PROBE_THREADS": "launch::kProbeThreads",
        "QUANTIZE_THREADS": "launch::kQuantizeThreads",
        "BLOCK_LISTS_THREADS": "launch::kBlockListsThreads", "BLOCK_LISTS_MAX_TILES": "launch::kBlockListsMaxTiles",
        "BLOCK_LIST_ROWS_PER_CTA": "launch::kBlockListRowsPerCta", "BLOCK_MAP_WARP_MAX_TILES": "launch::kBlockMapWarpMaxTiles",
        "TILE_ROWS": "kTileRows", "STATISTICS_TILES": "kStatisticsTiles", "STAT_TENSORS": "kStatTensors",
        "STAT_VECTORS": "kStatVectors",
    }
    for py, cpp in constants.items():
        lines.append(f'  std::printf("const {py} %lld\\n", (long long)({cpp}));')
    for i, j in itertools.product(range(2), range(2)):
        lines.append(f'  std::printf("const ATTENTION_SMEM_BYTES.{i}.{j} %d\\n", launch::kAttentionSmemBytes[{i}][{j}]);')
    for i in range(2):
        for py, cpp in (("SMOOTHING_BASIS_SMEM_BYTES", "kSmoothingBasisSmemBytes"),):
            lines.append(f'  std::printf("const {py}.{i} %d\\n", launch::{cpp}[{i}]);')
    for name, value in (("bf16", "kBFloat16"), ("fp16", "kFloat16"), ("fp32", "kFloat32")):
        lines.append(f'  std::printf("dtype {name} %d\\n", int(InputDtype::{value}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    cxx = _host_compiler()
    tmp = tmp_path_factory.mktemp("abi")
    src = tmp / "layout.cpp"
    src.write_text(_layout_program())
    exe = tmp / "layout"
    subprocess.run([cxx, "-std=c++17", f"-I{CSRC}", str(src), "-o", str(exe)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}


@pytest.mark.parametrize("name", sorted(abi.STRUCTS))
def test_struct_layout_matches_the_header(layout, name):
    struct = abi.STRUCTS[name]
    assert ctypes.sizeof(struct) == layout[("size", name)], f"sizeof({name})"
    for field, _ in struct._fields_:
        assert getattr(struct, field).offset == layout[("offset", f"{name}.{field}")], f"{name}.{field}"


def test_every_header_field_is_mirrored():
    """A field added to a C++ struct and not to the mirror changes its size; the sizes match above,
    and here no two mirrored fields overlap and none is missing at the end."""
    for name, struct in abi.STRUCTS.items():
        end = 0
        for field, ctype in struct._fields_:
            offset = getattr(struct, field).offset
            assert offset >= end, f"{name}.{field} overlaps the field before it"
            end = offset + ctypes.sizeof(ctype)
        assert ctypes.sizeof(struct) - end < 8, f"{name} has unmirrored bytes at its end"


def test_constants_match_the_header(layout):
    for (kind, key), value in layout.items():
        if kind != "const":
            continue
        name, *index = key.split(".")
        mirrored = getattr(abi, name)
        for i in index:
            mirrored = mirrored[int(i)]
        assert mirrored == value, key


def test_input_dtype_codes_match_the_header(layout):
    for name, code in abi.INPUT_DTYPES.items():
        assert layout[("dtype", name)] == code


WORKSPACE_PROGRAM = r"""
#include <cstdio>
#include "quantize/params.h"
using namespace nvfp4_dit;
int main() {
  long long b, hkv, sk, dp;
  while (std::scanf("%lld %lld %lld %lld", &b, &hkv, &sk, &dp) == 4)
    std::printf("%lld %lld %lld %lld\n", (long long)quantize_qkv_workspace_floats(b, hkv, dp),
                (long long)quantize_qkv_workspace_counters(b, hkv),
                (long long)quantize_qkv_workspace_records(b, hkv, (sk + 127) / 128 * 128),
                (long long)statistics_stride(sk));
  return 0;
}
"""


def test_workspace_sizes_match_the_header(tmp_path):
    exe = compile_host_program(tmp_path, "workspace", WORKSPACE_PROGRAM)
    cases = [(b, hkv, sk, dp) for b in (1, 2, 3) for hkv in (1, 2, 8, 40)
             for sk in (0, 1, 77, 1024, 1025, 2048, 2049, 4096, 118_800) for dp in (64, 128)]
    text = "\n".join(" ".join(map(str, c)) for c in cases) + "\n"
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == len(cases)
    for (b, hkv, sk, dp), line in zip(cases, out):
        floats, counters, records, stride = map(int, line.split())
        assert abi.workspace_floats(b, hkv, dp) == floats, (b, hkv, sk, dp)
        assert abi.workspace_counters(b, hkv) == counters
        assert abi.workspace_records(b, hkv, (sk + 127) // 128 * 128) == records
        assert abi.statistics_stride(sk) == stride, sk
        # the reference's rule (format.statistics_row_mask) reads the tiles this stride gives
        rows = fmt.statistics_row_mask(torch.tensor([sk]), sk)[0].nonzero().flatten()
        assert (rows // 128).unique().tolist() == list(range(0, -(-sk // 128), stride)), sk


def test_entry_names_follow_the_header():
    """The names the launcher asks for are those csrc/common/launch.h documents (the cubin test in
    tests/test_build.py checks that the cubins hold exactly these)."""
    text = (CSRC / "common" / "launch.h").read_text()
    for fragment in ("nvfp4_dit_attention_fwd_{native,emulated}_{nvfp4,mxfp8}_d{64,128}[_sparse]",
                     "nvfp4_dit_mma_probe_nvfp4_{native,emulated}_", "nvfp4_dit_balance_statistics_d<DP>",
                     "nvfp4_dit_key_stats_d<DP>", "nvfp4_dit_quantize_tiles_<dtype>_d<DP>_{nvfp4,mxfp8}",
                     "nvfp4_dit_quantize_v_tiles_<dtype>_d<DP>", "nvfp4_dit_q_means_<dtype>_d<DP>",
                     "nvfp4_dit_smoothing_basis_d<DP>",
                     *abi.BLOCK_LISTS_ENTRIES):
        assert fragment in text, fragment
    assert abi.attention_entry("native", "mxfp8", 128, sparse=True) == "nvfp4_dit_attention_fwd_native_mxfp8_d128_sparse"
    assert abi.quantize_tiles_entry("fp32", 64, "nvfp4") == "nvfp4_dit_quantize_tiles_fp32_d64_nvfp4"
    assert abi.quantize_v_tiles_entry("bf16", 128) == "nvfp4_dit_quantize_v_tiles_bf16_d128"
    assert abi.key_stats_entry(128) == "nvfp4_dit_key_stats_d128"
    assert abi.q_means_entry("bf16", 128) == "nvfp4_dit_q_means_bf16_d128"
    assert abi.smoothing_basis_entry(64) == "nvfp4_dit_smoothing_basis_d64"
