"""Build and load the CUDA core (``csrc/``): the architecture table, the sources, the cache.

Every kernel and both torch bindings (:data:`SOURCES`) go into one shared library that registers
the ``torch.ops.nvfp4_dit_cuda`` ops. It is compiled on first use with ``torch.utils.cpp_extension``
(ninja + nvcc) for the GPU's architecture, and cached per architecture and per hash of the sources
and build settings under ``~/.cache/nvfp4_dit`` (``NVFP4_DIT_CACHE_DIR`` overrides it); a file lock
makes concurrent first uses (several processes, one cache) build once.

Architectures (:data:`ARCHS`): compute capability 12.0 / 12.1 build ``sm_120a`` / ``sm_121a``, the
native block-scaled FP4 MMA; 9.0 builds ``sm_90a`` and 8.x ``sm_80``, the emulated MMA (the same
kernel with fp16 ``mma.sync``). ``NVFP4_DIT_ARCH`` overrides the device's choice.
``csrc/common/config.h`` states the same table for C++ (tests/test_build.py checks both agree).

Ahead-of-time build (a wheel cache, a machine without a GPU)::

    python -m nvfp4_dit.build --arch sm_120a --arch sm_121a
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

OP_NAMESPACE = "nvfp4_dit_cuda"
CACHE_ENV = "NVFP4_DIT_CACHE_DIR"
ARCH_ENV = "NVFP4_DIT_ARCH"

# Build target -> MMA kind. Native: the block-scaled FP4 mma.sync (arch-specific targets only).
ARCHS = {"sm_120a": "native", "sm_121a": "native", "sm_90a": "emulated", "sm_80": "emulated"}
NATIVE_ARCHS = tuple(a for a, kind in ARCHS.items() if kind == "native")
EMULATED_ARCHS = tuple(a for a, kind in ARCHS.items() if kind == "emulated")
# Compute capabilities of each kind (csrc/common/config.h: kNativeCapabilities, kEmulated*).
NATIVE_CAPABILITIES = ((12, 0), (12, 1))
EMULATED_CAPABILITIES = ((8, 0), (9, 0))  # the inclusive range

# The translation units, relative to csrc/: the kernels (each compiles standalone with nvcc,
# torch-free) and the two torch bindings.
KERNEL_SOURCES = (
    "attention/attention_fwd_dispatch.cu",
    "attention/attention_fwd_native_d64.cu",
    "attention/attention_fwd_native_d128.cu",
    "attention/attention_fwd_native_mxfp8_d64.cu",
    "attention/attention_fwd_native_mxfp8_d128.cu",
    "attention/attention_fwd_emulated_d64.cu",
    "attention/attention_fwd_emulated_d128.cu",
    "attention/attention_fwd_emulated_mxfp8_d64.cu",
    "attention/attention_fwd_emulated_mxfp8_d128.cu",
    "quantize/quantize_tiles.cu",
    "quantize/quantize_stream.cu",
    "quantize/correction.cu",
)
BINDING_SOURCES = ("attention_binding.cpp", "quantize_binding.cpp")
SOURCES = KERNEL_SOURCES + BINDING_SOURCES

_HASHED_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".hpp", ".inc")
# No fast-math anywhere: the quantize kernels' divisions must be IEEE for byte-exact output.
CUDA_FLAGS = ("-O3", "-lineinfo")
_CXX_FLAGS = ("-O3",)


class ExtensionBuildError(RuntimeError):
    """The CUDA core cannot be built or loaded here (no nvcc, no ninja, unsupported device)."""


# ---------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------

def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {tuple(ARCHS)}, got {arch!r}")
    return arch


def arch_for_capability(major: int, minor: int) -> str:
    """The build target of a compute capability; ExtensionBuildError if there is none."""
    if (major, minor) in NATIVE_CAPABILITIES:
        return f"sm_{major}{minor}a"
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 8:
        return "sm_80"  # sm_80 machine code runs on every 8.x part
    raise ExtensionBuildError(f"no CUDA build target for compute capability {major}.{minor}; supported: "
                              f"12.0, 12.1 (native FP4 MMA), 9.0 and 8.x (emulated MMA)")


def mma_kind(capability: tuple[int, int]) -> Optional[str]:
    """"native", "emulated" or None (no kernel) for a compute capability."""
    cc = tuple(capability)
    if cc in NATIVE_CAPABILITIES:
        return "native"
    if EMULATED_CAPABILITIES[0] <= cc <= EMULATED_CAPABILITIES[1]:
        return "emulated"
    return None


def is_native(capability: tuple[int, int]) -> bool:
    return mma_kind(capability) == "native"


def device_arch(device: Optional[torch.device] = None) -> str:
    """The target to build for ``device`` (default: the current CUDA device), or $NVFP4_DIT_ARCH."""
    override = os.environ.get(ARCH_ENV)
    if override:
        return check_arch(override)
    if not torch.cuda.is_available():
        raise ExtensionBuildError("no CUDA device: pass arch= explicitly to build without one")
    return arch_for_capability(*torch.cuda.get_device_capability(device))


def gencode_flags(arch: str) -> list[str]:
    """nvcc flags for ``arch``: the arch-specific (``a``) targets need an explicit gencode pair."""
    number = check_arch(arch)[3:]
    return [f"-gencode=arch=compute_{number},code=sm_{number}"]


# ---------------------------------------------------------------------------------------------
# Sources and toolchain
# ---------------------------------------------------------------------------------------------

def csrc_dir() -> Path:
    """The CUDA sources: ``nvfp4_dit/_csrc`` in a wheel, ``<repo>/csrc`` in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_csrc", here.parent / "csrc"):
        if (candidate / "common" / "config.h").is_file():
            return candidate
    raise ExtensionBuildError(f"cannot find the CUDA sources: neither {here / '_csrc'} nor {here.parent / 'csrc'} "
                              "holds common/config.h")


def cuda_home() -> Optional[Path]:
    """The CUDA toolkit root: the first of $CUDA_HOME, $CUDA_PATH, torch's guess, /usr/local/cuda
    and nvcc's folder that has both bin/nvcc and include/cuda_runtime_api.h (torch guesses from
    nvcc's location, which is wrong when nvcc on PATH is a wrapper script), or None."""
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
        f"Install the CUDA toolkit matching torch.version.cuda={torch.version.cuda} and set CUDA_HOME (or put "
        "nvcc on PATH), or use backend='sdpa'.")


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
    settings = [arch, *SOURCES, *gencode_flags(arch), *CUDA_FLAGS, *_CXX_FLAGS, torch.__version__,
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
    return f"{OP_NAMESPACE}_{check_arch(arch)}"


# ---------------------------------------------------------------------------------------------
# Build and load
# ---------------------------------------------------------------------------------------------

_built: dict[str, Path] = {}
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


def build_extension(arch: Optional[str] = None, *, verbose: bool = False) -> Path:
    """Build (or find in the cache) the library for ``arch``, load it, and return its path."""
    arch = device_arch() if arch is None else check_arch(arch)
    if arch in _built:
        return _built[arch]
    root = csrc_dir()
    build_dir = cache_root() / f"{arch}-{source_hash(arch, root, _cached_nvcc_version())[:20]}"
    lib = build_dir / f"{library_name(arch)}.so"
    done = build_dir / "complete"
    with _file_lock(cache_root() / f"{build_dir.name}.lock"):
        if lib.is_file() and done.is_file():
            torch.ops.load_library(str(lib))
        else:
            _compile(arch, root, build_dir, verbose)  # torch's builder loads what it built
            if not lib.is_file():
                raise ExtensionBuildError(f"the build finished but {lib} is missing")
            done.write_text("ok\n")
    _built[arch] = lib
    return lib


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
        raise ExtensionBuildError("ninja is not installed (pip install ninja): it drives the CUDA build")
    build_dir.mkdir(parents=True, exist_ok=True)
    cflags = list(_CXX_FLAGS)
    if not (home / "include" / "cusparse.h").is_file():
        # A minimal toolkit without the math-library headers that ATen/cuda/CUDAContext.h pulls
        # in: use those of the nvidia-* wheels torch depends on, searched after everything else.
        cflags += [f"-idirafter{d}" for d in _wheel_cuda_include_dirs()]
    # An explicit gencode keeps torch from adding flags for whatever GPU happens to be visible.
    cpp_extension.load(
        name=library_name(arch),
        sources=[str(root / s) for s in SOURCES],
        extra_cflags=cflags,
        extra_cuda_cflags=[*CUDA_FLAGS, *gencode_flags(arch)],
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
    arch = device_arch() if arch is None else check_arch(arch)
    others = [a for a in _built if a != arch]
    if others:
        raise ExtensionBuildError(f"the {others[0]} build is already loaded in this process; cannot also load {arch}")
    build_extension(arch, verbose=verbose)
    return getattr(torch.ops, OP_NAMESPACE)


_load_lock = threading.Lock()
_load_failures: dict[tuple[int, int], Optional[str]] = {}


def unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """Build and load the CUDA core for ``device`` once per process: None when it is usable,
    else why not (a sentence; the failure is kept, so a broken build is tried once)."""
    capability = torch.cuda.get_device_capability(device)
    with _load_lock:
        if capability not in _load_failures:
            try:
                if mma_kind(capability) is None:
                    raise ExtensionBuildError(f"no kernel for sm_{capability[0]}{capability[1]} "
                                              "(native: sm_120/121, emulated: sm_80..sm_90)")
                load_extension(arch_for_capability(*capability))
                _load_failures[capability] = None
            except Exception as exc:  # noqa: BLE001 - any build failure is a reason to fall back
                _load_failures[capability] = (f"the CUDA kernels failed to build for "
                                              f"sm_{capability[0]}{capability[1]}: {exc}")
        return _load_failures[capability]


def _build_in_subprocess(arch: str, verbose: bool) -> Path:
    code = f"from nvfp4_dit import build; print(build.build_extension({arch!r}, verbose={verbose!r}))"
    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=not verbose, text=True, env=env)
    if res.returncode != 0:
        raise ExtensionBuildError(f"building {arch} failed:\n{res.stderr if not verbose else ''}")
    return Path(res.stdout.strip().splitlines()[-1]) if res.stdout else Path()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvfp4_dit.build",
                                     description="Build the nvfp4_dit CUDA kernels ahead of time.")
    parser.add_argument("--arch", action="append", choices=tuple(ARCHS),
                        help="target (repeatable); default: the current device's")
    parser.add_argument("--verbose", action="store_true", help="show the compiler output")
    args = parser.parse_args(argv)
    try:
        archs = args.arch or [device_arch()]
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
