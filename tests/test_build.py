"""The build modules (nvfp4_dit.cuda.compile, nvfp4_dit.cuda.build): architectures, the one C++ statement of
them (csrc/common/config.h), translation units, source hashes, entry points, errors, the cache
and the ahead-of-time command."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nvfp4_dit.cuda import build
from nvfp4_dit.cuda import compile as kc
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
    with pytest.raises(build.KernelBuildError, match=f"{cc[0]}.{cc[1]}"):
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


def test_units_cover_every_translation_unit():
    root = build.csrc_dir()
    assert root == REPO / "csrc"
    on_disk = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in (".cu", ".cpp"))
    assert sorted(kc.ALL_UNITS) == on_disk, "a translation unit is missing from nvfp4_dit.cuda.compile"
    for arch, kind in kc.ARCHS.items():
        assert set(kc.units(arch)) == set(kc.COMMON_UNITS) | set(kc.ATTENTION_UNITS[kind])
        assert all(f"_{kind}" in u for u in kc.ATTENTION_UNITS[kind])
    assert len({kc.cubin_name(u) for u in kc.ALL_UNITS}) == len(kc.ALL_UNITS)  # one folder per arch holds them


def test_source_hash_tracks_sources(tmp_path):
    root = tmp_path / "csrc"
    shutil.copytree(build.csrc_dir(), root)
    base = kc.source_hash(root)
    assert base == kc.source_hash(root) == kc.source_hash(build.csrc_dir())
    header = root / "quantize" / "params.h"
    header.write_text(header.read_text() + "\n// changed\n")
    changed = kc.source_hash(root)
    assert changed != base
    (root / "nested").mkdir()
    (root / "nested" / "extra.cuh").write_text("// a header in a subfolder counts too\n")
    assert kc.source_hash(root) not in (base, changed)
    (root / "NOTES.md").write_text("documentation is not a source\n")
    (root / "nested" / "extra.cuh").unlink()
    assert kc.source_hash(root) == changed


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "c"))
    assert build.cache_root() == tmp_path / "c"
    monkeypatch.delenv(build.CACHE_ENV)
    assert build.cache_root() == Path.home() / ".cache" / "nvfp4_dit"


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kc, "cuda_home", lambda: None)
    monkeypatch.setattr(kc.shutil, "which", lambda name: None)
    with pytest.raises(kc.KernelBuildError, match="nvcc .*not found"):
        kc.nvcc_path()


def test_no_compiler_is_a_clear_error_naming_what_to_install(monkeypatch):
    monkeypatch.setattr(kc, "cuda_home", lambda: None)
    monkeypatch.setattr(kc.shutil, "which", lambda name: None)
    monkeypatch.setattr(kc, "nvrtc_version", lambda: (_ for _ in ()).throw(kc.KernelBuildError("NVRTC cannot be loaded")))
    with pytest.raises(kc.KernelBuildError, match="no CUDA compiler.*nvrtc: NVRTC cannot be loaded.*nvcc: nvcc"):
        kc.find_compiler()


def test_nvrtc_of_the_bindings_major_comes_from_sys_path_first(tmp_path):
    # cuda.pathfinder would also search the interpreter's site-packages; compile.py looks along
    # sys.path first, in its order, for the NVRTC and headers of cuda.bindings' CUDA major.
    first, second = tmp_path / "build_env", tmp_path / "outer_venv"
    (second / "nvidia/cu13/lib").mkdir(parents=True)
    (second / "nvidia/cu13/lib/libnvrtc.so.13").write_bytes(b"")
    assert kc.on_sys_path(kc.NVRTC_LIBRARIES[12], [str(first), str(second)]) is None
    (first / "nvidia/cuda_nvrtc/lib").mkdir(parents=True)
    (first / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12").write_bytes(b"")
    (second / "nvidia/cuda_nvrtc/lib").mkdir(parents=True)
    (second / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12").write_bytes(b"")
    assert kc.on_sys_path(kc.NVRTC_LIBRARIES[12], [str(first), str(second)]) == first / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
    assert kc.on_sys_path(kc.NVRTC_LIBRARIES[13], [str(first), str(second)]) == second / "nvidia/cu13/lib/libnvrtc.so.13"
    assert set(kc.CUDA_INCLUDE_DIRS) == set(kc.NVRTC_LIBRARIES)


def test_min_driver_version():
    assert kc.min_driver_version("sm_120a", (12, 9)) == 12080
    assert kc.min_driver_version("sm_121a", (12, 9)) == 12090
    assert kc.min_driver_version("sm_90a", (12, 9)) == 12000
    assert kc.min_driver_version("sm_90a", (13, 0)) == kc.min_driver_version("sm_120a", (13, 1)) == 13000
    assert kc.driver_version_text(12080) == "12.8"


def test_kernel_entries_read_the_cubin_sections(tmp_path):
    """kernel_entries lists a cubin's entry points (ELF .text.<name> sections) of ours only."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void nvfp4_dit_b(int* x) { x[0] = 1; }\n'
                   'extern "C" __global__ void nvfp4_dit_a(int* x) { x[1] = 2; }\n'
                   '__global__ void other(int* x) { x[2] = 3; }\n')
    out = tmp_path / "k.cubin"
    subprocess.run([nvcc, "-cubin", "-arch=sm_90a", str(src), "-o", str(out)], check=True, capture_output=True)
    assert kc.kernel_entries(out.read_bytes()) == ["nvfp4_dit_a", "nvfp4_dit_b"]
    with pytest.raises(ValueError, match="ELF"):
        kc.kernel_entries(b"not a cubin")


class _CopyingCompiler:
    """A stand-in compiler for build_cubins: each 'compile' copies one real cubin to the output and
    appends a line to a log, so a test can count what was compiled."""

    name, version, tag = "copy", (13, 0), "copy13.0"

    def __init__(self, cubin: Path, log: Path):
        self.cubin, self.log = cubin, log

    def command(self, source, arch, out, root):
        script = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2]); open(sys.argv[3], 'a').write('x\\n')"
        return [sys.executable, "-c", script, str(self.cubin), str(out), str(self.log)]


def test_a_rebuild_of_unchanged_sources_compiles_nothing(tmp_path):
    """build_cubins reuses an output folder that holds the same sources' build (the wheel's build/
    on a rerun), and compiles again once a header changes."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void nvfp4_dit_k(int* x) { x[0] = 1; }\n')
    cubin = tmp_path / "k.cubin"
    subprocess.run([nvcc, "-cubin", "-arch=sm_90a", str(src), "-o", str(cubin)], check=True, capture_output=True)
    root = tmp_path / "csrc"
    shutil.copytree(kc.csrc_dir(), root)
    log, out = tmp_path / "compiled.log", tmp_path / "cubins"
    compiler = _CopyingCompiler(cubin, log)

    def compiled() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    first = kc.build_cubins(["sm_90a"], out, compiler, root=root)
    assert compiled() == len(kc.units("sm_90a")) and first["compiler"] == "copy13.0"
    assert kc.build_cubins(["sm_90a"], out, compiler, root=root) == first and compiled() == len(kc.units("sm_90a"))
    (root / "common" / "config.h").write_text((root / "common" / "config.h").read_text() + "\n// changed\n")
    assert kc.build_cubins(["sm_90a"], out, compiler, root=root)["source_hash"] != first["source_hash"]
    assert compiled() == 2 * len(kc.units("sm_90a"))


def test_ninja_lines_escape_paths_and_commands():
    assert kc._ninja_path(Path("/a b/c:d$e")) == "/a$ b/c$:d$$e"
    assert kc._ninja_command(["x", "a b", "$y"]) == "x 'a b' '$$y'"


def test_without_prebuilt_kernels_and_without_a_compiler_the_reason_says_what_to_install(monkeypatch, tmp_path):
    """No cubins in this install, none cached and no compiler: the KernelBuildError names each
    source's reason and what to install (the fallback warning repeats it)."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "PREBUILT_DIR", tmp_path / "none")
    monkeypatch.setattr(build, "_libraries", {})
    monkeypatch.setattr(kc, "cuda_home", lambda: None)
    monkeypatch.setattr(kc.shutil, "which", lambda name: None)
    monkeypatch.setattr(kc, "nvrtc_version", lambda: (_ for _ in ()).throw(kc.KernelBuildError("NVRTC cannot be loaded")))
    with pytest.raises(kc.KernelBuildError) as e:
        build.load_library("sm_90a")
    text = str(e.value)
    assert "no prebuilt kernels" in text and "NVRTC cannot be loaded" in text and "nvcc" in text
    assert "pip install" in text


@pytest.mark.slow
def test_ahead_of_time_build_and_cache_hit(tmp_path):
    """`python -m nvfp4_dit.cuda.build --arch sm_90a` builds every unit's cubin and a manifest naming each
    kernel the launcher uses; a second run reuses them."""
    from nvfp4_dit.cuda import abi

    try:
        kc.find_compiler()
    except kc.KernelBuildError as e:
        pytest.skip(str(e))
    env = dict(os.environ, **{build.CACHE_ENV: str(tmp_path)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "nvfp4_dit.cuda.build", "--arch", "sm_90a"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    folder = Path(first.stdout.strip().split(": ", 1)[1])
    assert folder.parent == tmp_path and (folder / "complete").is_file()
    manifest = kc.read_manifest(folder)
    cubins = manifest["archs"]["sm_90a"]["cubins"]
    assert sorted(cubins) == sorted(kc.cubin_name(u) for u in kc.units("sm_90a"))
    names = {n for entries in cubins.values() for n in entries}
    assert names == abi.launcher_entries("emulated")
    mtime = (folder / "complete").stat().st_mtime
    t0 = time.perf_counter()
    second = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert second.returncode == 0, second.stderr[-4000:]
    assert second.stdout == first.stdout and (folder / "complete").stat().st_mtime == mtime
    assert time.perf_counter() - t0 < 30  # no recompilation (a build takes a minute or more on 2 cores)


@pytest.mark.cuda
def test_load_library_on_the_device():
    assert build.unavailable_reason() is None
    library = build.load_library()
    assert build.load_library() is library  # loaded once per process
    major, minor = torch.cuda.get_device_capability()
    name = f"nvfp4_dit_attention_fwd_{build.mma_kind((major, minor))}_nvfp4_d128"
    kernel = library.kernel(name, torch.cuda.current_device())
    assert kernel.name == name and library.kernel(name, torch.cuda.current_device()) is kernel
    assert kernel.blocks_per_sm(256, 75776) >= 1
