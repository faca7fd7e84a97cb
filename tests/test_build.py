"""The JIT build: architecture choice, cache keys, sources, errors, the ahead-of-time command."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nvfp4_dit import jit

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cc, arch", [((12, 0), "sm_120a"), ((12, 1), "sm_121a"), ((9, 0), "sm_90a"),
                                      ((8, 0), "sm_80"), ((8, 6), "sm_80"), ((8, 9), "sm_80")])
def test_arch_for_capability(cc, arch):
    assert jit.arch_for_capability(*cc) == arch


@pytest.mark.parametrize("cc", [(7, 5), (10, 0), (11, 0), (12, 2)])
def test_unsupported_capability_is_a_clear_error(cc):
    with pytest.raises(jit.ExtensionBuildError, match=f"{cc[0]}.{cc[1]}"):
        jit.arch_for_capability(*cc)


def test_native_archs():
    assert jit.is_native_arch("sm_120a") and jit.is_native_arch("sm_121a")
    assert not jit.is_native_arch("sm_90a") and not jit.is_native_arch("sm_80")


def test_gencode_flags_name_the_arch_specific_target():
    assert jit.gencode_flags("sm_120a") == ["-gencode=arch=compute_120a,code=sm_120a"]
    assert jit.gencode_flags("sm_80") == ["-gencode=arch=compute_80,code=sm_80"]
    with pytest.raises(ValueError, match="arch must be one of"):
        jit.gencode_flags("sm_120")


def test_arch_env_override(monkeypatch):
    monkeypatch.setenv(jit.ARCH_ENV, "sm_121a")
    assert jit.device_arch() == "sm_121a"
    monkeypatch.setenv(jit.ARCH_ENV, "sm_75")
    with pytest.raises(ValueError):
        jit.device_arch()


def test_sources_are_every_top_level_tu():
    root = jit.csrc_dir()
    assert root == REPO / "csrc"
    names = [p.name for p in jit.translation_units(root)]
    expected = sorted(p.name for p in root.iterdir() if p.suffix in (".cu", ".cpp"))
    assert names == expected
    assert "binding.cpp" in names and "quantize.cu" in names and "quantize_correction.cu" in names


def test_source_hash_tracks_sources_and_arch(tmp_path):
    root = tmp_path / "csrc"
    shutil.copytree(jit.csrc_dir(), root)
    base = jit.source_hash("sm_90a", root)
    assert base == jit.source_hash("sm_90a", root)
    assert base != jit.source_hash("sm_120a", root)
    header = root / "quantize.cuh"
    header.write_text(header.read_text() + "\n// changed\n")
    assert jit.source_hash("sm_90a", root) != base
    (root / "nested").mkdir()
    (root / "nested" / "extra.cuh").write_text("// a header in a subfolder counts too\n")
    assert jit.source_hash("sm_90a", root) not in (base,)


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(jit.CACHE_ENV, str(tmp_path / "c"))
    assert jit.cache_root() == tmp_path / "c"
    monkeypatch.delenv(jit.CACHE_ENV)
    assert jit.cache_root() == Path.home() / ".cache" / "nvfp4_dit"


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(jit, "cuda_home", lambda: None)
    monkeypatch.setattr(jit.shutil, "which", lambda name: None)
    with pytest.raises(jit.ExtensionBuildError, match="nvcc .*not found"):
        jit.nvcc_path()


def test_missing_nvcc_stops_the_build_before_compiling(monkeypatch, tmp_path):
    monkeypatch.setenv(jit.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(jit, "cuda_home", lambda: None)
    monkeypatch.setattr(jit.shutil, "which", lambda name: None)
    monkeypatch.setattr(jit, "_nvcc_version_memo", None)
    monkeypatch.setattr(jit, "_loaded", {})
    with pytest.raises(jit.ExtensionBuildError, match="nvcc"):
        jit.build_extension("sm_80")


@pytest.mark.slow
def test_ahead_of_time_build_and_cache_hit(tmp_path):
    """`python -m nvfp4_dit.jit --arch sm_90a` builds the whole library; a second run reuses it."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    env = dict(os.environ, **{jit.CACHE_ENV: str(tmp_path)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "nvfp4_dit.jit", "--arch", "sm_90a"]
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
    ops = jit.load_extension()
    assert hasattr(ops, "quantize_qkv") and hasattr(ops, "qk_correction")
    assert jit.load_extension() is ops  # loaded once per process
    major, minor = torch.cuda.get_device_capability()
    other = "sm_80" if jit.arch_for_capability(major, minor) != "sm_80" else "sm_90a"
    with pytest.raises(jit.ExtensionBuildError, match="already loaded"):
        jit.load_extension(other)
