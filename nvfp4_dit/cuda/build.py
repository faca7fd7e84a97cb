"""Find, build and load the CUDA kernels (``csrc/``) for a GPU: no torch C++ extension, no compiler
needed where the wheel carries the cubins.

Where a GPU's kernels come from, in order:

1. **Prebuilt**, in the wheel (``nvfp4_dit/_cubins/``, written by ``pip wheel .``): used when
   their manifest names the GPU's architecture, was built from the installed sources, and the
   driver is new enough to load them.
2. **The cache** (``~/.cache/nvfp4_dit``; ``NVFP4_DIT_CACHE_DIR`` overrides it): cubins built
   here earlier, keyed by architecture, source hash and compiler.
3. **Built now** into the cache with NVRTC (NVIDIA's pip package ``nvidia-cuda-nvrtc``), else
   with nvcc; a file lock makes concurrent first uses (several processes, one cache) build once.

Where none of them works, :func:`unavailable_reason` says why and what to install, and
:func:`nvfp4_dit.attention` falls back to exact attention with one warning. The cubins are
loaded and launched through the driver API (:mod:`nvfp4_dit.cuda.driver`).

Architectures (:data:`ARCHS`, :mod:`nvfp4_dit.cuda.compile`): compute capability 12.0 / 12.1 build
``sm_120a`` / ``sm_121a`` (native block-scaled FP4 MMA); 9.0 builds ``sm_90a`` and 8.x ``sm_80``
(the emulated MMA). ``NVFP4_DIT_ARCH`` overrides the device's choice.

Ahead of time, into the cache (a machine without a GPU, a shared cache)::

    python -m nvfp4_dit.cuda.build --arch sm_120a --arch sm_121a
    python -m nvfp4_dit.cuda.build --list      # what this install carries prebuilt
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from . import compile as kc
from .compile import (ARCHS, EMULATED_ARCHS, NATIVE_ARCHS, KernelBuildError, check_arch, csrc_dir,  # noqa: F401
                      gencode_flags, source_hash)

CACHE_ENV = "NVFP4_DIT_CACHE_DIR"
ARCH_ENV = "NVFP4_DIT_ARCH"
PREBUILT_DIR = Path(__file__).resolve().parents[1] / "_cubins"  # nvfp4_dit/_cubins
# Compute capabilities of each kind (csrc/common/config.h: kNativeCapabilities, kEmulated*).
NATIVE_CAPABILITIES = ((12, 0), (12, 1))
EMULATED_CAPABILITIES = ((8, 0), (9, 0))  # the inclusive range
INSTALL_HINT = ("install the nvfp4_dit wheel built for this platform (it carries the kernels), or "
                "`pip install cuda-bindings nvidia-cuda-nvrtc` (or a CUDA toolkit with nvcc) to build them here")


# ---------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------

def arch_for_capability(major: int, minor: int) -> str:
    """The build target of a compute capability; KernelBuildError if there is none."""
    if (major, minor) in NATIVE_CAPABILITIES:
        return f"sm_{major}{minor}a"
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 8:
        return "sm_80"  # sm_80 machine code runs on every 8.x part
    raise KernelBuildError(f"no CUDA build target for compute capability {major}.{minor}; supported: "
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


_capabilities: dict[int, tuple[int, int]] = {}


def device_index(device: Optional[torch.device] = None) -> int:
    """The CUDA index of ``device`` (a torch.device, int or string; None or "cuda": the current one)."""
    if isinstance(device, int):
        return device
    device = torch.device("cuda") if device is None else torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def device_capability(device: Optional[torch.device] = None) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, read once per device index: every launch
    asks, and torch's query costs microseconds of host time each time."""
    index = device_index(device)
    found = _capabilities.get(index)
    if found is None:
        found = _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return found


def device_arch(device: Optional[torch.device] = None) -> str:
    """The target of ``device`` (default: the current CUDA device), or $NVFP4_DIT_ARCH."""
    override = os.environ.get(ARCH_ENV)
    if override:
        return check_arch(override)
    if not torch.cuda.is_available():
        raise KernelBuildError("no CUDA device: pass arch= explicitly to build without one")
    return arch_for_capability(*device_capability(device))


# ---------------------------------------------------------------------------------------------
# Where the cubins come from
# ---------------------------------------------------------------------------------------------

def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "nvfp4_dit"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: concurrent first builds each write whole files atomically
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@functools.lru_cache(maxsize=None)
def _installed_source_hash() -> str:
    return source_hash(csrc_dir())


def prebuilt_manifest() -> Optional[dict]:
    """The manifest of the cubins this install carries (None in a source checkout)."""
    return kc.read_manifest(PREBUILT_DIR)


def _library(folder: Path, arch: str, manifest: dict, description: str):
    from .driver import KernelLibrary

    entries = {name: cubin for cubin, names in manifest["archs"][arch]["cubins"].items() for name in names}
    return KernelLibrary(folder, arch, entries, description)


def _driver_too_old(arch: str, needed: int, what: str) -> Optional[str]:
    from .driver import driver_version

    have = driver_version()
    if have >= needed:
        return None
    return (f"{what} need a driver for CUDA {kc.driver_version_text(needed)} or newer; this NVIDIA driver supports "
            f"CUDA {kc.driver_version_text(have)}: update the driver")


def prebuilt_library(arch: str):
    """The wheel's cubins for ``arch`` as a KernelLibrary; KernelBuildError saying why not."""
    manifest = prebuilt_manifest()
    if manifest is None:
        raise KernelBuildError("this install carries no prebuilt kernels (a source checkout)")
    if arch not in manifest["archs"]:
        raise KernelBuildError(f"the prebuilt kernels cover {sorted(manifest['archs'])}, not {arch}")
    if manifest["source_hash"] != _installed_source_hash():
        raise KernelBuildError("the prebuilt kernels were built from other sources than the installed ones")
    what = f"the prebuilt {arch} kernels ({manifest['compiler']})"
    too_old = _driver_too_old(arch, manifest["archs"][arch]["min_driver_version"], what)
    if too_old:
        raise KernelBuildError(too_old)
    return _library(PREBUILT_DIR, arch, manifest, what)


def cache_folder(arch: str, compiler: kc.Compiler) -> Path:
    return cache_root() / f"{check_arch(arch)}-{_installed_source_hash()[:20]}-{compiler.tag}"


def build_cubins(arch: str, compiler: kc.Compiler, *, verbose: bool = False) -> Path:
    """The cache folder of ``arch``'s cubins from ``compiler``, built now unless already there."""
    folder = cache_folder(arch, compiler)
    done = folder / "complete"
    with _file_lock(folder.parent / f"{folder.name}.lock"):
        if not (done.is_file() and kc.read_manifest(folder)):
            kc.build_cubins([arch], folder, compiler, root=csrc_dir(), verbose=verbose)
            done.write_text("ok\n")
    return folder


def cached_library(arch: str, *, verbose: bool = False):
    """``arch``'s cubins from the cache, built now with NVRTC or else nvcc where missing;
    KernelBuildError saying what to install when no compiler can build loadable ones."""
    reasons = []
    for name in ("nvrtc", "nvcc"):
        try:
            compiler = kc.Compiler(name)
            what = f"cubins from {compiler.tag}"
            too_old = _driver_too_old(arch, kc.min_driver_version(arch, compiler.version), what)
            if too_old:
                raise KernelBuildError(too_old)
            folder = build_cubins(arch, compiler, verbose=verbose)
            return _library(folder, arch, kc.read_manifest(folder), f"the {arch} kernels built here ({compiler.tag}, "
                                                                     f"{folder})")
        except KernelBuildError as e:
            reasons.append(f"{name}: {e}")
    raise KernelBuildError("; ".join(reasons))


_libraries: dict[str, object] = {}
_load_lock = threading.Lock()
_load_failures: dict[tuple[int, int], Optional[str]] = {}


def load_library(arch: Optional[str] = None):
    """The KernelLibrary of ``arch`` (default: the current device's): prebuilt, cached or built
    now, every cubin loaded by the driver; KernelBuildError with every reason and what to install."""
    arch = device_arch() if arch is None else check_arch(arch)
    if arch in _libraries:
        return _libraries[arch]
    reasons = []
    for source in (prebuilt_library, cached_library):
        try:
            library = source(arch)
            library.load_all()
            _libraries[arch] = library
            return library
        except RuntimeError as e:  # KernelBuildError, or DriverError: a cubin the driver does not load
            reasons.append(str(e))
    raise KernelBuildError(f"no usable {arch} kernels: " + " | ".join(reasons) + f". To fix: {INSTALL_HINT}")


def unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """Find or build, then load, the kernels for ``device`` once per process: None when they are
    usable, else why not (a sentence; the failure is kept, so a broken setup is tried once)."""
    capability = device_capability(device)
    with _load_lock:
        if capability not in _load_failures:
            try:
                if mma_kind(capability) is None:
                    raise KernelBuildError(f"no kernel for sm_{capability[0]}{capability[1]} "
                                           "(native: sm_120/121, emulated: sm_80..sm_90)")
                with torch.cuda.device(device):
                    load_library(arch_for_capability(*capability))
                _load_failures[capability] = None
            except Exception as exc:  # noqa: BLE001 - any failure is a reason to fall back
                _load_failures[capability] = f"the CUDA kernels are not available for sm_{capability[0]}" \
                                             f"{capability[1]}: {exc}"
        return _load_failures[capability]


def library_for(device: torch.device):
    """The KernelLibrary of ``device``, loaded now if it is not yet (KernelBuildError if it cannot be)."""
    arch = arch_for_capability(*device_capability(device))
    library = _libraries.get(arch)
    if library is None:
        with _load_lock, torch.cuda.device(device):
            library = load_library(arch)
    return library


def describe_loaded(arch: str) -> str:
    library = _libraries.get(arch)
    return library.description if library is not None else "not loaded"


# ---------------------------------------------------------------------------------------------
# python -m nvfp4_dit.cuda.build
# ---------------------------------------------------------------------------------------------

def list_prebuilt() -> str:
    """What this install carries: per architecture the cubins, their kernels and the oldest driver."""
    manifest = prebuilt_manifest()
    if manifest is None:
        return f"no prebuilt kernels in this install ({PREBUILT_DIR} has no manifest): they are built on first use"
    match = "matches" if manifest["source_hash"] == _installed_source_hash() else "does NOT match"
    lines = [f"prebuilt kernels: {PREBUILT_DIR} ({manifest['compiler']}; source hash {manifest['source_hash'][:12]} "
             f"{match} the installed sources)"]
    for arch, entry in sorted(manifest["archs"].items()):
        n = sum(len(k) for k in entry["cubins"].values())
        lines.append(f"{arch} ({entry['kind']} MMA, driver >= CUDA {kc.driver_version_text(entry['min_driver_version'])}): "
                     f"{len(entry['cubins'])} cubins, {n} kernels")
        for cubin, names in sorted(entry["cubins"].items()):
            lines.append(f"  {cubin}: {len(names)} kernels ({names[0]}{', ...' if len(names) > 1 else ''})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvfp4_dit.cuda.build",
                                     description="Build the nvfp4_dit CUDA kernels into the cache ahead of time, "
                                                 "or list the prebuilt ones.")
    parser.add_argument("--arch", action="append", choices=tuple(ARCHS),
                        help="target (repeatable); default: the current device's")
    parser.add_argument("--compiler", choices=("nvrtc", "nvcc"), help="default: NVRTC, else nvcc")
    parser.add_argument("--list", action="store_true", help="list the prebuilt kernels of this install and exit")
    parser.add_argument("--verbose", action="store_true", help="show the compiler output")
    args = parser.parse_args(argv)
    if args.list:
        print(list_prebuilt())
        return 0
    try:
        compiler = kc.find_compiler((args.compiler,) if args.compiler else ("nvrtc", "nvcc"))
        for arch in args.arch or [device_arch()]:
            print(f"{arch}: {build_cubins(arch, compiler, verbose=args.verbose)}")
    except KernelBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
