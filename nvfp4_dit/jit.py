"""Build and load the CUDA extension (``csrc/``) on first use.

Every top-level ``csrc/*.cu`` and ``csrc/*.cpp`` translation unit goes into one shared library
that registers the ``torch.ops.nvfp4_dit_cuda`` ops, so a new kernel TU is picked up without
touching this file. The build uses ``torch.utils.cpp_extension`` with ninja and is cached per
target architecture and per hash of the sources and build settings, under
``~/.cache/nvfp4_dit`` (override with ``NVFP4_DIT_CACHE_DIR``). A file lock makes concurrent
first uses (several processes, one cache) build once.

The architecture comes from the device: compute capability 12.0 -> ``sm_120a`` and 12.1 ->
``sm_121a`` (native block-scaled FP4 MMA); 9.0 -> ``sm_90a`` and 8.x -> ``sm_80`` (the emulated
back-end, same kernel, fp16 MMA). ``NVFP4_DIT_ARCH`` overrides it.

Ahead-of-time build (optional, e.g. for a wheel cache or a machine without a GPU)::

    python -m nvfp4_dit.jit --arch sm_120a --arch sm_121a
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

OP_NAMESPACE = "nvfp4_dit_cuda"
CACHE_ENV = "NVFP4_DIT_CACHE_DIR"
ARCH_ENV = "NVFP4_DIT_ARCH"
ONLY_ENV = "NVFP4_DIT_JIT_ONLY"
NATIVE_ARCHS = ("sm_120a", "sm_121a")
EMULATED_ARCHS = ("sm_90a", "sm_80")
SUPPORTED_ARCHS = NATIVE_ARCHS + EMULATED_ARCHS

_SOURCE_SUFFIXES = (".cu", ".cpp")
_HASHED_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".hpp", ".inc")
# No fast-math anywhere: the quantize kernel's divisions must be IEEE for byte-exact output.
_CUDA_FLAGS = ("-O3", "-lineinfo")
_CXX_FLAGS = ("-O3",)

_loaded: dict[str, Path] = {}


class ExtensionBuildError(RuntimeError):
    """The CUDA extension cannot be built here (no nvcc, no ninja, unsupported device)."""


def csrc_dir() -> Path:
    """The kernel sources: ``nvfp4_dit/_csrc`` in a wheel, ``<repo>/csrc`` in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_csrc", here.parent / "csrc"):
        if (candidate / "binding.cpp").is_file():
            return candidate
    raise ExtensionBuildError(f"cannot find the CUDA sources: neither {here / '_csrc'} nor {here.parent / 'csrc'} "
                              "holds binding.cpp")


def translation_units(root: Optional[Path] = None) -> list[Path]:
    """Top-level ``*.cu`` and ``*.cpp`` files of the sources folder, sorted.

    ``NVFP4_DIT_JIT_ONLY=a.cu,b.cpp`` restricts the set (a development knob for faster builds of
    one area; the restricted library has only that area's ops).
    """
    root = csrc_dir() if root is None else root
    tus = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _SOURCE_SUFFIXES)
    only = [n.strip() for n in os.environ.get(ONLY_ENV, "").split(",") if n.strip()]
    if only:
        missing = sorted(set(only) - {p.name for p in tus})
        if missing:
            raise ExtensionBuildError(f"{ONLY_ENV} names sources that do not exist: {missing}")
        tus = [p for p in tus if p.name in only]
    return tus


def arch_for_capability(major: int, minor: int) -> str:
    """The build target for a compute capability, or ExtensionBuildError if none fits."""
    if (major, minor) == (12, 0):
        return "sm_120a"
    if (major, minor) == (12, 1):
        return "sm_121a"
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 8:
        return "sm_80"  # sm_80 machine code runs on every 8.x part
    raise ExtensionBuildError(f"no CUDA build target for compute capability {major}.{minor}; "
                              f"supported: 12.0, 12.1 (native FP4), 9.0 and 8.x (emulated)")


def device_arch(device: Optional[torch.device] = None) -> str:
    """The target to build for ``device`` (default: the current CUDA device)."""
    override = os.environ.get(ARCH_ENV)
    if override:
        return _check_arch(override)
    if not torch.cuda.is_available():
        raise ExtensionBuildError("no CUDA device: pass arch= explicitly to build without one")
    major, minor = torch.cuda.get_device_capability(device)
    return arch_for_capability(major, minor)


def is_native_arch(arch: str) -> bool:
    return _check_arch(arch) in NATIVE_ARCHS


def _check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    return arch


def gencode_flags(arch: str) -> list[str]:
    """nvcc flags for ``arch``: the arch-specific (``a``) targets need an explicit gencode pair."""
    number = _check_arch(arch)[3:]
    return [f"-gencode=arch=compute_{number},code=sm_{number}"]


def cuda_home() -> Optional[Path]:
    """The CUDA toolkit root: the first of $CUDA_HOME, $CUDA_PATH, torch's guess, /usr/local/cuda
    that has both bin/nvcc and include/cuda_runtime_api.h (torch guesses from nvcc's location,
    which is wrong when nvcc on PATH is a wrapper script), or None."""
    from torch.utils import cpp_extension

    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME,
                  "/usr/local/cuda"]
    which = shutil.which("nvcc")
    if which:
        candidates.append(str(Path(which).resolve().parents[1]))
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").is_file() and (Path(c) / "include" / "cuda_runtime_api.h").is_file():
            return Path(c)
    return None


def nvcc_path() -> str:
    """Path of nvcc, from the CUDA toolkit root or PATH; ExtensionBuildError if missing."""
    home = cuda_home()
    candidates = [home / "bin" / "nvcc"] if home else []
    which = shutil.which("nvcc")
    if which:
        candidates.append(Path(which))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise ExtensionBuildError(
        "nvcc (the CUDA compiler) was not found: the nvfp4_dit CUDA kernels are compiled on first use. "
        "Install the CUDA toolkit matching torch.version.cuda="
        f"{torch.version.cuda} and set CUDA_HOME (or put nvcc on PATH), or use backend='sdpa'.")


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "nvfp4_dit"


def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ExtensionBuildError(f"{nvcc} --version failed: {e}") from e


def source_hash(arch: str, root: Optional[Path] = None, nvcc_version: str = "") -> str:
    """Hash of every source file under ``root`` plus everything else that changes the binary."""
    root = csrc_dir() if root is None else root
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in _HASHED_SUFFIXES:
            h.update(p.relative_to(root).as_posix().encode())
            h.update(b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
    settings = [arch, os.environ.get(ONLY_ENV, ""), *gencode_flags(arch), *_CUDA_FLAGS, *_CXX_FLAGS, torch.__version__,
                str(torch.version.cuda), nvcc_version, sys.version.split()[0]]
    h.update("\n".join(settings).encode())
    return h.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own build lock still serialises the compile
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def library_name(arch: str) -> str:
    return f"{OP_NAMESPACE}_{_check_arch(arch)}"


def build_extension(arch: Optional[str] = None, *, verbose: bool = False) -> Path:
    """Build (or find in the cache) the extension for ``arch`` and return the library path.

    The library is also loaded into this process (torch's builder always loads what it built);
    use :func:`load_extension` to get the ops.
    """
    arch = device_arch() if arch is None else _check_arch(arch)
    if arch in _loaded:
        return _loaded[arch]
    root = csrc_dir()
    build_dir = cache_root() / f"{arch}-{source_hash(arch, root, _cached_nvcc_version())[:20]}"
    lib = build_dir / f"{library_name(arch)}.so"
    done = build_dir / "complete"
    with _file_lock(cache_root() / f"{build_dir.name}.lock"):
        if lib.is_file() and done.is_file():
            torch.ops.load_library(str(lib))
        else:
            _compile(arch, root, build_dir, verbose)
            if not lib.is_file():
                raise ExtensionBuildError(f"the build finished but {lib} is missing")
            done.write_text("ok\n")
    _loaded[arch] = lib
    return lib


_nvcc_version_memo: Optional[str] = None


def _cached_nvcc_version() -> str:
    # nvcc's version is part of the cache key; a missing nvcc does not stop loading a cached build.
    global _nvcc_version_memo
    if _nvcc_version_memo is None:
        try:
            _nvcc_version_memo = _nvcc_version(nvcc_path())
        except ExtensionBuildError:
            _nvcc_version_memo = "no-nvcc"
    return _nvcc_version_memo


def _compile(arch: str, root: Path, build_dir: Path, verbose: bool) -> None:
    from torch.utils import cpp_extension

    nvcc_path()  # clear error first
    home = cuda_home()
    if home is None:
        raise ExtensionBuildError("found nvcc but no CUDA toolkit headers (include/cuda_runtime_api.h); "
                                  "set CUDA_HOME to the toolkit root")
    # torch reads its module-level CUDA_HOME for include and library paths.
    cpp_extension.CUDA_HOME = str(home)
    if not cpp_extension.is_ninja_available():
        raise ExtensionBuildError("ninja is not installed (pip install ninja): it drives the CUDA extension build")
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(p) for p in translation_units(root)]
    cflags = list(_CXX_FLAGS)
    if not (home / "include" / "cusparse.h").is_file():
        # A minimal toolkit without the math-library headers that ATen/cuda/CUDAContext.h pulls
        # in: use those of the nvidia-* wheels torch depends on, searched after everything else.
        cflags += [f"-idirafter{d}" for d in _wheel_cuda_include_dirs()]
    # An explicit gencode keeps torch from adding flags for whatever GPU happens to be visible.
    cpp_extension.load(
        name=library_name(arch),
        sources=sources,
        extra_cflags=cflags,
        extra_cuda_cflags=[*_CUDA_FLAGS, *gencode_flags(arch)],
        extra_include_paths=[str(root)],
        build_directory=str(build_dir),
        verbose=verbose,
        with_cuda=True,
        is_python_module=False,
    )


def _wheel_cuda_include_dirs() -> list[str]:
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    dirs = []
    for base in (spec.submodule_search_locations or []) if spec else []:
        for inc in sorted(Path(base).glob("*/include")):
            if (inc / "cusparse.h").is_file():
                dirs.append(str(inc))
    return dirs


def load_extension(arch: Optional[str] = None, *, verbose: bool = False):
    """Build if needed, load once per process, and return ``torch.ops.nvfp4_dit_cuda``.

    One process holds one build: asking for a second architecture after the first is loaded is
    an error (their ops would clash).
    """
    arch = device_arch() if arch is None else _check_arch(arch)
    others = [a for a in _loaded if a != arch]
    if others:
        raise ExtensionBuildError(f"the {others[0]} build is already loaded in this process; "
                                  f"cannot also load {arch}")
    build_extension(arch, verbose=verbose)
    return getattr(torch.ops, OP_NAMESPACE)


def _build_in_subprocess(arch: str, verbose: bool) -> Path:
    code = ("import sys; from nvfp4_dit import jit; "
            f"print(jit.build_extension({arch!r}, verbose={verbose!r}))")
    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=not verbose, text=True, env=env)
    if res.returncode != 0:
        raise ExtensionBuildError(f"building {arch} failed:\n{res.stderr if not verbose else ''}")
    return Path(res.stdout.strip().splitlines()[-1]) if res.stdout else Path()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvfp4_dit.jit",
                                     description="Build the nvfp4_dit CUDA extension ahead of time.")
    parser.add_argument("--arch", action="append", choices=SUPPORTED_ARCHS,
                        help="target (repeatable); default: the current device's")
    parser.add_argument("--verbose", action="store_true", help="show the compiler output")
    args = parser.parse_args(argv)
    archs = args.arch or [device_arch()]
    try:
        for arch in archs:
            # One build per process: each library registers the same op names.
            path = build_extension(arch, verbose=args.verbose) if len(archs) == 1 else \
                _build_in_subprocess(arch, args.verbose)
            print(f"{arch}: {path}")
    except ExtensionBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
