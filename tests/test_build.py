"""The build module: architectures, the one C++ statement of them (csrc/common/config.h), cache
keys, sources, errors, the ahead-of-time command."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nvfp4_dit import build
from nvfp4_dit import format as fmt

try:
    from host_program import compile_host_program
except ImportError:  # tests/ imported as a package
    from tests.host_program import compile_host_program

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cc, arch", [((12, 0), "sm_120a"), ((12, 1), "sm_121a"), ((9, 0), "sm_90a"),
                                      ((8, 0), "sm_80"), ((8, 6), "sm_80"), ((8, 9), "sm_80")])
def test_arch_for_capability(cc, arch):
    assert build.arch_for_capability(*cc) == arch


@pytest.mark.parametrize("cc", [(7, 5), (10, 0), (11, 0), (12, 2)])
def test_unsupported_capability_is_a_clear_error(cc):
    with pytest.raises(build.ExtensionBuildError, match=f"{cc[0]}.{cc[1]}"):
        build.arch_for_capability(*cc)


def test_mma_kinds():
    assert build.is_native((12, 0)) and build.is_native((12, 1))
    assert not build.is_native((9, 0)) and not build.is_native((8, 0))
    assert build.mma_kind((9, 0)) == build.mma_kind((8, 6)) == "emulated"
    assert build.mma_kind((7, 5)) is None and build.mma_kind((10, 0)) is None
    assert all(build.ARCHS[build.arch_for_capability(*cc)] == "native" for cc in build.NATIVE_CAPABILITIES)


def test_gencode_flags_name_the_arch_specific_target():
    assert build.gencode_flags("sm_120a") == ["-gencode=arch=compute_120a,code=sm_120a"]
    assert build.gencode_flags("sm_80") == ["-gencode=arch=compute_80,code=sm_80"]
    with pytest.raises(ValueError, match="arch must be one of"):
        build.gencode_flags("sm_120")


CONFIG_PROGRAM = r"""
#include "common/config.h"
#include <cstdio>
int main() {
  for (int d : nvfp4_dit::kHeadDims) printf("head_dim %d\n", d);
  for (int d = 0; d <= 200; ++d) printf("padded %d %lld\n", d, (long long)nvfp4_dit::padded_head_dim(d));
  for (int c : nvfp4_dit::kNativeCapabilities) printf("native %d\n", c);
  printf("emulated %d %d\n", nvfp4_dit::kEmulatedMinCapability, nvfp4_dit::kEmulatedMaxCapability);
  return 0;
}
"""


def test_config_header_agrees_with_python(tmp_path):
    """csrc/common/config.h and the Python modules state the same head dims and architectures."""
    exe = compile_host_program(tmp_path, "config", CONFIG_PROGRAM)
    lines = [line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                      check=True).stdout.splitlines()]
    assert tuple(int(x[1]) for x in lines if x[0] == "head_dim") == fmt.SUPPORTED_HEAD_DIMS
    for _, d, dp in (x for x in lines if x[0] == "padded"):
        assert (fmt.padded_head_dim(int(d)) or 0) == int(dp), d
    native = [int(x[1]) for x in lines if x[0] == "native"]
    assert native == [10 * major + minor for major, minor in build.NATIVE_CAPABILITIES]
    (_, lo, hi), = (x for x in lines if x[0] == "emulated")
    assert (int(lo), int(hi)) == tuple(10 * major + minor for major, minor in build.EMULATED_CAPABILITIES)


def test_arch_env_override(monkeypatch):
    monkeypatch.setenv(build.ARCH_ENV, "sm_121a")
    assert build.device_arch() == "sm_121a"
    monkeypatch.setenv(build.ARCH_ENV, "sm_75")
    with pytest.raises(ValueError):
        build.device_arch()


def test_sources_exist_and_cover_every_translation_unit():
    root = build.csrc_dir()
    assert root == REPO / "csrc"
    assert all((root / s).is_file() for s in build.SOURCES)
    on_disk = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in (".cu", ".cpp"))
    assert sorted(build.SOURCES) == on_disk, "a translation unit is missing from build.SOURCES"


def test_source_hash_tracks_sources_and_arch(tmp_path):
    root = tmp_path / "csrc"
    shutil.copytree(build.csrc_dir(), root)
    base = build.source_hash("sm_90a", root)
    assert base == build.source_hash("sm_90a", root)
    assert base != build.source_hash("sm_120a", root)
    header = root / "quantize" / "quantize.cuh"
    header.write_text(header.read_text() + "\n// changed\n")
    assert build.source_hash("sm_90a", root) != base
    (root / "nested").mkdir()
    (root / "nested" / "extra.cuh").write_text("// a header in a subfolder counts too\n")
    assert build.source_hash("sm_90a", root) not in (base,)


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "c"))
    assert build.cache_root() == tmp_path / "c"
    monkeypatch.delenv(build.CACHE_ENV)
    assert build.cache_root() == Path.home() / ".cache" / "nvfp4_dit"


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(build, "cuda_home", lambda: None)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.ExtensionBuildError, match="nvcc .*not found"):
        build.nvcc_path()


def test_missing_nvcc_stops_the_build_before_compiling(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "cuda_home", lambda: None)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(build, "_nvcc_version_memo", None)
    monkeypatch.setattr(build, "_built", {})
    with pytest.raises(build.ExtensionBuildError, match="nvcc"):
        build.build_extension("sm_80")


@pytest.mark.slow
def test_ahead_of_time_build_and_cache_hit(tmp_path):
    """`python -m nvfp4_dit.build --arch sm_90a` builds the whole library; a second run reuses it."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    env = dict(os.environ, **{build.CACHE_ENV: str(tmp_path)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "nvfp4_dit.build", "--arch", "sm_90a"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    lib = Path(first.stdout.strip().split(": ", 1)[1])
    assert lib.is_file() and lib.parent.parent == tmp_path and (lib.parent / "complete").is_file()
    mtime = lib.stat().st_mtime
    t0 = time.perf_counter()
    second = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert second.returncode == 0, second.stderr[-4000:]
    assert second.stdout == first.stdout and lib.stat().st_mtime == mtime
    assert time.perf_counter() - t0 < 60  # no recompilation (a full build takes minutes on 2 cores)
    # The library registers the quantize ops.
    check = subprocess.run([sys.executable, "-c", f"import torch; torch.ops.load_library({str(lib)!r}); "
                            "print(torch.ops.nvfp4_dit_cuda.quantize_qkv.default._schema)"],
                           capture_output=True, text=True, env=env)
    assert check.returncode == 0 and "quantize_qkv(Tensor q" in check.stdout, check.stderr[-2000:]


@pytest.mark.cuda
def test_load_extension_on_the_device():
    ops = build.load_extension()
    assert hasattr(ops, "quantize_qkv") and hasattr(ops, "correction") and hasattr(ops, "attention_fwd")
    assert build.load_extension() is ops  # loaded once per process
    major, minor = torch.cuda.get_device_capability()
    other = "sm_80" if build.arch_for_capability(major, minor) != "sm_80" else "sm_90a"
    with pytest.raises(build.ExtensionBuildError, match="already loaded"):
        build.load_extension(other)
