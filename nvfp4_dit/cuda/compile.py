"""Compile the CUDA kernels (``csrc/``) into cubins: one per translation unit and architecture.

Torch-free, and importable by file path, so that the wheel build (``setup.py``) runs it without
the package's dependencies. Two compilers give the same cubins' entry points:

* NVRTC, the run-time compiler NVIDIA ships as a pip package (``nvidia-cuda-nvrtc``), through
  ``cuda.bindings.nvrtc``: no toolkit install, no host compiler. Preferred.
* nvcc from a CUDA toolkit, where NVRTC is missing or cannot build a unit.

ninja runs the units of a build in parallel (one edge per unit; an NVRTC edge runs this file as a
script). Every build writes ``manifest.json`` beside its cubins: the source hash, the compiler,
per architecture its MMA kind, the oldest driver that loads it and, per cubin, the kernel entry
points read off its ELF symbols.

Architectures (:data:`ARCHS`): compute capability 12.0 / 12.1 build ``sm_120a`` / ``sm_121a``, the
native block-scaled FP4 MMA; 9.0 builds ``sm_90a`` and 8.x ``sm_80``, the emulated MMA (the same
kernel with fp16 ``mma.sync``). ``csrc/common/config.h`` states the same table for C++.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

# Build target -> MMA kind. Native: the block-scaled FP4 mma.sync (arch-specific targets only).
ARCHS = {"sm_120a": "native", "sm_121a": "native", "sm_90a": "emulated", "sm_80": "emulated"}
NATIVE_ARCHS = tuple(a for a, kind in ARCHS.items() if kind == "native")
EMULATED_ARCHS = tuple(a for a, kind in ARCHS.items() if kind == "emulated")
# The first driver (CUDA version, 1000 * major + 10 * minor) that knows each target.
FIRST_DRIVER = {"sm_120a": 12080, "sm_121a": 12090, "sm_90a": 12000, "sm_80": 11000}

# Translation units, relative to csrc/: those every target builds, and the attention kernels of
# each MMA kind (a native unit on an emulated target would only hold traps, and the reverse).
COMMON_UNITS = (
    "attention/mma_probe.cu",
    "quantize/quantize_tiles.cu",
    "quantize/smoothing_basis.cu",
    "quantize/block_lists.cu",
)
ATTENTION_UNITS = {
    kind: tuple(f"attention/attention_fwd_{kind}{'_mxfp8' if fmt == 'mxfp8' else ''}_d{d}.cu"
                for fmt in ("nvfp4", "mxfp8") for d in (64, 128))
    for kind in ("native", "emulated")
}
ALL_UNITS = COMMON_UNITS + ATTENTION_UNITS["native"] + ATTENTION_UNITS["emulated"]

# No fast-math anywhere: the quantize kernels' divisions must be IEEE for byte-exact output.
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17")
NVRTC_FLAGS = ("-std=c++17",)
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
ENTRY_PREFIX = "nvfp4_dit_"
_HASHED_SUFFIXES = (".cu", ".cuh", ".h")


class KernelBuildError(RuntimeError):
    """The CUDA kernels cannot be built or loaded here (no compiler, unsupported device, old driver)."""


def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {tuple(ARCHS)}, got {arch!r}")
    return arch


def units(arch: str) -> tuple[str, ...]:
    """The translation units of ``arch``'s build."""
    return COMMON_UNITS + ATTENTION_UNITS[ARCHS[check_arch(arch)]]


def cubin_name(unit: str) -> str:
    return Path(unit).stem + ".cubin"


def gencode_flags(arch: str) -> list[str]:
    """nvcc flags for ``arch``: the arch-specific (``a``) targets need an explicit gencode pair."""
    number = check_arch(arch)[3:]
    return [f"-gencode=arch=compute_{number},code=sm_{number}"]


def csrc_dir() -> Path:
    """The CUDA sources: ``nvfp4_dit/_csrc`` in a wheel, ``<repo>/csrc`` in a checkout."""
    package = Path(__file__).resolve().parents[1]  # nvfp4_dit/
    for candidate in (package / "_csrc", package.parent / "csrc"):
        if (candidate / "common" / "config.h").is_file():
            return candidate
    raise KernelBuildError(f"cannot find the CUDA sources: neither {package / '_csrc'} nor {package.parent / 'csrc'} "
                           "holds common/config.h")


def source_hash(root: Optional[Path] = None) -> str:
    """Hash of every source file under ``root`` and of the compile flags: the cubins' identity."""
    root = csrc_dir() if root is None else root
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in _HASHED_SUFFIXES:
            h.update(p.relative_to(root).as_posix().encode())
            h.update(b"\0")
            h.update(p.read_bytes().replace(b"\r\n", b"\n"))
            h.update(b"\0")
    h.update("\n".join([*NVCC_FLAGS, *NVRTC_FLAGS, str(MANIFEST_FORMAT)]).encode())
    return h.hexdigest()


def min_driver_version(arch: str, compiler_version: tuple[int, int]) -> int:
    """The oldest driver (CUDA version as cuDriverGetVersion gives it) that loads ``arch``'s cubins
    from a compiler of ``compiler_version``: one that knows the target and the compiler's major
    release (cubins of a newer minor release load on older drivers of the same major)."""
    return max(FIRST_DRIVER[check_arch(arch)], 1000 * compiler_version[0])


def driver_version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


# ---------------------------------------------------------------------------------------------
# Cubin entry points (ELF section names)
# ---------------------------------------------------------------------------------------------

def kernel_entries(cubin: bytes) -> list[str]:
    """The kernel entry points of a cubin (its ``.text.<name>`` sections), ours only, sorted."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    endian = "<" if cubin[5] == 1 else ">"
    shoff, = struct.unpack_from(endian + "Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from(endian + "HHH", cubin, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from(endian + "IIQQQQ", cubin, shoff + i * shentsize)
        return name, offset, size

    _, str_off, str_size = section(shstrndx)
    strings = cubin[str_off:str_off + str_size]
    names = []
    for i in range(shnum):
        name_off = section(i)[0]
        name = strings[name_off:strings.index(b"\0", name_off)].decode()
        if name.startswith(".text." + ENTRY_PREFIX):
            names.append(name[len(".text."):])
    return sorted(names)


# ---------------------------------------------------------------------------------------------
# Compilers
# ---------------------------------------------------------------------------------------------

# NVRTC and the CUDA headers of each CUDA major as NVIDIA's pip packages lay them out
# (nvidia-cuda-nvrtc-cu12 / nvidia-cuda-runtime-cu12; the CUDA 13 packages share nvidia/cu13).
NVRTC_LIBRARIES = {12: ("nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cuda_nvrtc/bin/nvrtc64_120_0.dll"),
                   13: ("nvidia/cu13/lib/libnvrtc.so.13",)}
CUDA_INCLUDE_DIRS = {12: "nvidia/cuda_runtime/include", 13: "nvidia/cu13/include"}
_nvrtc_preloaded = False


def _bindings_major() -> Optional[int]:
    try:
        import cuda.bindings
        return int(str(cuda.bindings.__version__).split(".")[0])
    except (ImportError, ValueError, AttributeError):
        return None


def on_sys_path(candidates: Sequence[str], paths: Optional[Sequence[str]] = None) -> Optional[Path]:
    """The first of ``candidates`` (paths relative to a sys.path entry) that exists, in sys.path order."""
    for entry in sys.path if paths is None else paths:
        for rel in candidates:
            path = Path(entry or ".") / rel
            if path.exists():
                return path
    return None


def _nvrtc_module():
    global _nvrtc_preloaded
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise KernelBuildError(f"NVRTC is not available: cuda.bindings does not import ({e}); "
                               "pip install cuda-bindings nvidia-cuda-nvrtc") from e
    if not _nvrtc_preloaded:
        # cuda.pathfinder also searches the interpreter's own site-packages, so inside an isolated
        # build environment (CUDA 12 requirements) it can find the CUDA 13 NVRTC of the venv around
        # it, and the wheel's cubins would then need a CUDA 13 driver. Loading the NVRTC of
        # cuda.bindings' own major from sys.path first makes pathfinder take that one.
        _nvrtc_preloaded = True
        library = on_sys_path(NVRTC_LIBRARIES.get(_bindings_major(), ()))
        if library is not None:
            # Its builtins library first, from the same folder (pathfinder would load it too).
            builtins = sorted(p for p in library.parent.glob("*nvrtc-builtins*") if ".alt." not in p.name)
            try:
                for path in (*builtins, library):
                    ctypes.CDLL(str(path), mode=getattr(ctypes, "RTLD_GLOBAL", 0))
            except OSError:
                pass  # pathfinder's own search still runs
    return nvrtc


def _nvrtc_check(nvrtc, result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelBuildError(f"NVRTC {what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor); KernelBuildError where NVRTC cannot be loaded."""
    nvrtc = _nvrtc_module()
    try:
        result = nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001 - cuda.pathfinder raises its own errors for a missing library
        raise KernelBuildError(f"NVRTC cannot be loaded: {e} (pip install nvidia-cuda-nvrtc)") from e
    major, minor = _nvrtc_check(nvrtc, result, "version")
    return int(major), int(minor)


def cuda_runtime_include_dir() -> Path:
    """The folder of cuda_fp16.h and cuda_bf16.h that NVRTC compiles against: NVIDIA's pip package
    (nvidia-cuda-runtime) or the toolkit, as cuda.pathfinder finds them."""
    # The headers of cuda.bindings' CUDA major on sys.path first (see _nvrtc_module), then pathfinder's.
    major_dir = CUDA_INCLUDE_DIRS.get(_bindings_major())
    matching = on_sys_path((major_dir,)) if major_dir else None
    try:
        from cuda import pathfinder
        found = pathfinder.find_nvidia_header_directory("cudart")
    except Exception:  # noqa: BLE001 - an old or missing cuda.pathfinder: try the toolkit
        found = None
    candidates = [matching, found, *(os.environ.get(v) and os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH")),
                  "/usr/local/cuda/include"]
    for c in candidates:
        if c and (Path(c) / "cuda_fp16.h").is_file():
            return Path(c)
    raise KernelBuildError("NVRTC needs the CUDA headers (cuda_fp16.h): pip install nvidia-cuda-runtime "
                           "(or set CUDA_HOME to a CUDA toolkit)")


def nvrtc_compile(source: Path, arch: str, out: Path, include_dirs: Sequence[Path]) -> None:
    """Compile one translation unit with NVRTC into a cubin at ``out``."""
    nvrtc = _nvrtc_module()
    text = source.read_bytes()
    prog = _nvrtc_check(nvrtc, nvrtc.nvrtcCreateProgram(text, str(source).encode(), 0, [], []), "create")
    options = [f"--gpu-architecture={check_arch(arch)}", *NVRTC_FLAGS, *(f"-I{d}" for d in include_dirs)]
    try:
        result = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelBuildError(f"NVRTC failed to compile {source.name} for {arch}:\n"
                                   f"{log.decode(errors='replace').strip()}")
        size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(cubin)
    tmp.replace(out)


def cuda_home() -> Optional[Path]:
    """The CUDA toolkit root: the first of $CUDA_HOME, $CUDA_PATH, /usr/local/cuda and nvcc's folder
    that has bin/nvcc, or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    which = shutil.which("nvcc")
    if which:
        candidates.append(str(Path(which).resolve().parents[1]))
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").is_file():
            return Path(c)
    return None


def nvcc_path() -> str:
    """Path of nvcc, from the CUDA toolkit root or PATH; KernelBuildError if missing."""
    home = cuda_home()
    candidates = [home / "bin" / "nvcc"] if home else []
    which = shutil.which("nvcc")
    if which:
        candidates.append(Path(which))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise KernelBuildError("nvcc (the CUDA compiler) was not found: install a CUDA toolkit and set CUDA_HOME "
                           "(or put nvcc on PATH)")


def nvcc_version(nvcc: str) -> tuple[int, int]:
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise KernelBuildError(f"{nvcc} --version failed: {e}") from e
    m = re.search(r"release (\d+)\.(\d+)", text)
    if not m:
        raise KernelBuildError(f"cannot read nvcc's version from: {text.strip()}")
    return int(m.group(1)), int(m.group(2))


def nvcc_command(nvcc: str, source: Path, arch: str, out: Path, root: Path) -> list[str]:
    return [nvcc, *NVCC_FLAGS, f"-I{root}", *gencode_flags(arch), str(source), "-o", str(out)]


class Compiler:
    """One of the two compilers, found and versioned: ``name`` "nvrtc" or "nvcc"."""

    def __init__(self, name: str):
        if name == "nvrtc":
            self.version = nvrtc_version()
            self.include_dirs = [cuda_runtime_include_dir()]
            self.path = None
        elif name == "nvcc":
            self.path = nvcc_path()
            self.version = nvcc_version(self.path)
            self.include_dirs = []
        else:
            raise ValueError(f"compiler must be 'nvrtc' or 'nvcc', got {name!r}")
        self.name = name

    @property
    def tag(self) -> str:
        return f"{self.name}{self.version[0]}.{self.version[1]}"

    def command(self, source: Path, arch: str, out: Path, root: Path) -> list[str]:
        """The command line that compiles ``source`` to ``out`` (an NVRTC one runs this file)."""
        if self.name == "nvcc":
            return nvcc_command(self.path, source, arch, out, root)
        return [sys.executable, str(Path(__file__).resolve()), "nvrtc-unit", "--arch", arch, "--source", str(source),
                "--out", str(out), *(f"--include={d}" for d in [root, *self.include_dirs])]


def find_compiler(preference: Sequence[str] = ("nvrtc", "nvcc")) -> Compiler:
    """The first compiler of ``preference`` that works here; KernelBuildError saying what to install."""
    reasons = []
    for name in preference:
        try:
            return Compiler(name)
        except KernelBuildError as e:
            reasons.append(f"{name}: {e}")
    raise KernelBuildError("no CUDA compiler to build the kernels: " + "; ".join(reasons))


# ---------------------------------------------------------------------------------------------
# Builds
# ---------------------------------------------------------------------------------------------

def ninja_path() -> str:
    try:
        import ninja  # the PyPI package ships the binary
        candidate = Path(ninja.BIN_DIR) / ("ninja.exe" if os.name == "nt" else "ninja")
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    which = shutil.which("ninja")
    if which is None:
        raise KernelBuildError("ninja is not installed (pip install ninja): it runs the compiles in parallel")
    return which


def _ninja_path(path: Path) -> str:
    """A path on a ninja build line: $, : and spaces escaped."""
    return str(path).replace("$", "$$").replace(":", "$:").replace(" ", "$ ")


def _ninja_command(args: Sequence[str]) -> str:
    """A command line as ninja runs it (through the shell on POSIX, CreateProcess on Windows)."""
    import shlex
    line = subprocess.list2cmdline(list(args)) if os.name == "nt" else shlex.join(args)
    return line.replace("$", "$$")


def build_cubins(archs: Sequence[str], out_root: Path, compiler: Compiler, *, root: Optional[Path] = None,
                 jobs: Optional[int] = None, verbose: bool = False) -> dict:
    """Compile every unit of each arch into ``out_root/<arch>/`` (ninja, in parallel) and write
    ``out_root/manifest.json``; returns the manifest. A folder that already holds the build of the
    same sources, flags, compiler and archs (its manifest says so, its cubins are there) is reused
    as it is: a rebuild of the wheel in the same tree (``build/``) compiles nothing."""
    root = (csrc_dir() if root is None else Path(root)).resolve()
    out_root = Path(out_root).resolve()   # ninja runs in it
    previous = read_manifest(out_root)
    if previous is not None and _is_build_of(previous, out_root, archs, compiler, root):
        return previous
    out_root.mkdir(parents=True, exist_ok=True)
    lines = ["rule compile", "  command = $cmd", "  description = $desc", ""]
    for arch in archs:
        (out_root / arch).mkdir(exist_ok=True)
        for unit in units(arch):
            out = out_root / arch / cubin_name(unit)
            cmd = _ninja_command(compiler.command(root / unit, arch, out, root))
            lines += [f"build {_ninja_path(out)}: compile {_ninja_path(root / unit)}",
                      f"  cmd = {cmd}", f"  desc = {compiler.name} {arch} {unit}", ""]
    (out_root / "build.ninja").write_text("\n".join(lines))
    cmd = [ninja_path(), "-C", str(out_root)] + ([f"-j{jobs}"] if jobs else [])
    res = subprocess.run(cmd, capture_output=not verbose, text=True)
    if res.returncode != 0:
        raise KernelBuildError(f"the kernel build failed ({compiler.tag}):\n{(res.stdout or '')[-6000:]}"
                               f"{(res.stderr or '')[-2000:]}")
    manifest = {"format": MANIFEST_FORMAT, "source_hash": source_hash(root), "compiler": compiler.tag, "archs": {}}
    for arch in archs:
        cubins = {cubin_name(u): kernel_entries((out_root / arch / cubin_name(u)).read_bytes()) for u in units(arch)}
        manifest["archs"][arch] = {"kind": ARCHS[arch], "min_driver_version": min_driver_version(arch, compiler.version),
                                   "cubins": cubins}
    (out_root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    for name in (".ninja_log", ".ninja_deps", "build.ninja"):
        (out_root / name).unlink(missing_ok=True)
    return manifest


def _is_build_of(manifest: dict, folder: Path, archs: Sequence[str], compiler: Compiler, root: Path) -> bool:
    """Whether ``folder`` (with ``manifest``) holds every cubin of ``archs`` built by ``compiler`` from
    the sources under ``root`` (their hash covers every header and the flags)."""
    if (manifest.get("source_hash") != source_hash(root) or manifest.get("compiler") != compiler.tag
            or sorted(manifest.get("archs", {})) != sorted(archs)):
        return False
    return all(sorted(manifest["archs"][arch]["cubins"]) == sorted(cubin_name(u) for u in units(arch))
               and all((folder / arch / cubin_name(u)).is_file() for u in units(arch)) for arch in archs)


def read_manifest(folder: Path) -> Optional[dict]:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    return manifest if manifest.get("format") == MANIFEST_FORMAT else None


def _main(argv: Optional[Sequence[str]] = None) -> int:
    """``python compile.py nvrtc-unit ...``: one unit with NVRTC, what a build's ninja edge runs
    (``python -m nvfp4_dit.cuda.build`` is the user-facing command)."""
    parser = argparse.ArgumentParser(description="Compile one nvfp4_dit unit with NVRTC (a ninja edge).")
    sub = parser.add_subparsers(dest="command", required=True)
    unit = sub.add_parser("nvrtc-unit")
    unit.add_argument("--arch", required=True, choices=tuple(ARCHS))
    unit.add_argument("--source", required=True, type=Path)
    unit.add_argument("--out", required=True, type=Path)
    unit.add_argument("--include", action="append", default=[], type=Path)
    args = parser.parse_args(argv)
    try:
        nvrtc_compile(args.source, args.arch, args.out, args.include)
    except KernelBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
