"""Load cubins and launch their kernels through the CUDA driver API.

A :class:`KernelLibrary` is the cubins of one build for one architecture (a folder and its
manifest). Each cubin is loaded with ``cuLibraryLoadFromFile`` on first use: a context-independent
library, so one load serves every device of that architecture. A :class:`Kernel` is one entry
point on one device (the current context's, which the callers keep current); it keeps the function
handle, its dynamic shared-memory limit and its occupancy, and launches on a stream with arguments
given as ``ctypes`` objects (the structures of :mod:`nvfp4_dit.cuda.abi` are the packed parameter
buffers). Loading and the occasional queries go through NVIDIA's ``cuda.bindings``; the launches
and the memset of every call go to the driver library directly through ``ctypes`` (a few hundred
nanoseconds of host time, where ``cuda.bindings`` converts each argument in Python). No call here
synchronises, so launches can be captured into CUDA graphs.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Sequence

_LOCK = threading.Lock()


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


def _cu():
    from cuda.bindings import driver
    return driver


def check(result, what: str):
    """The value(s) of a cuda.bindings call, or DriverError naming ``what`` and the driver's error."""
    cu = _cu()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        text = cu.cuGetErrorString(err)[1]
        raise DriverError(f"{what} failed: {name.decode() if name else err} "
                          f"({text.decode() if text else 'no description'})")
    return rest[0] if len(rest) == 1 else tuple(rest)


_libcuda = None

# The ctypes prototypes of the driver calls made on every call (cuda.h; tests/test_driver_calls.py
# checks them against the header): cuLaunchKernel(CUfunction, 3 x grid, 3 x block, shared bytes,
# CUstream, void** params, void** extra) and cuMemsetD32Async(CUdeviceptr, value, count, CUstream).
PROTOTYPES = {
    "cuLaunchKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3,
    "cuMemsetD32Async": [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p],
}


def libcuda():
    """The driver library through ctypes, with the prototypes of :data:`PROTOTYPES`."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
        for name, argtypes in PROTOTYPES.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
        _libcuda = lib
    return _libcuda


def _raise_for(code: int, what: str) -> None:
    cu = _cu()
    check((cu.CUresult(code),), what)


def memset_d32(pointer: int, value: int, count: int, stream: int) -> None:
    """Set ``count`` 32-bit words at device address ``pointer`` to ``value``, in stream order."""
    if count:
        code = libcuda().cuMemsetD32Async(pointer, value, count, stream)
        if code:
            _raise_for(code, f"cuMemsetD32Async({count} words)")


def driver_version() -> int:
    """The driver's CUDA version, 1000 * major + 10 * minor (13000 for CUDA 13.0)."""
    return int(check(_cu().cuDriverGetVersion(), "cuDriverGetVersion"))


_device_attributes: dict[tuple[int, str], int] = {}


def device_attribute(device: int, name: str) -> int:
    """``CU_DEVICE_ATTRIBUTE_<name>`` of ``device`` (cached: they do not change)."""
    key = (device, name)
    if key not in _device_attributes:
        cu = _cu()
        attribute = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        _device_attributes[key] = int(check(cu.cuDeviceGetAttribute(attribute, device), f"cuDeviceGetAttribute({name})"))
    return _device_attributes[key]


class Kernel:
    """One entry point on one device: launch it with :meth:`launch`."""

    def __init__(self, name: str, function, device: int):
        self.name = name
        self.function = function
        self.handle = int(function)   # the CUfunction pointer, for the ctypes launch
        self.device = device
        self._smem_limit = 48 * 1024  # the default dynamic shared memory a launch may ask for
        self._occupancy: dict[tuple[int, int], int] = {}

    def _allow_smem(self, smem: int) -> None:
        if smem > self._smem_limit:
            cu = _cu()
            check(cu.cuFuncSetAttribute(self.function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        smem), f"cuFuncSetAttribute({self.name}, {smem} B shared memory)")
            self._smem_limit = smem

    def blocks_per_sm(self, threads: int, smem: int = 0) -> int:
        """Resident CTAs per SM at this block size and dynamic shared memory (the occupancy)."""
        key = (threads, smem)
        if key not in self._occupancy:
            self._allow_smem(smem)
            self._occupancy[key] = int(check(_cu().cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, threads, smem),
                                             f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})"))
        return self._occupancy[key]

    def launch(self, grid: Sequence[int], threads: int, args: Sequence[ctypes._SimpleCData | ctypes.Structure],
               stream: int, smem: int = 0) -> None:
        """Launch on ``stream`` (a CUstream handle as an int, e.g. torch's ``cuda_stream``) with
        ``args`` in the kernel's parameter order, each a ctypes object of the parameter's C type."""
        if smem > self._smem_limit:
            self._allow_smem(smem)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        code = libcuda().cuLaunchKernel(self.handle, gx, gy, gz, threads, 1, 1, smem, stream, pointers, None)
        if code:
            _raise_for(code, f"launching {self.name} (grid {gx}x{gy}x{gz}, {threads} threads, {smem} B shared memory)")


class KernelLibrary:
    """The cubins of one build for one architecture: ``folder/<arch>/*.cubin`` and the manifest's
    ``entries`` (entry point -> cubin file name)."""

    def __init__(self, folder: Path, arch: str, entries: dict[str, str], description: str):
        self.folder = Path(folder)
        self.arch = arch
        self.entries = dict(entries)
        self.description = description   # where the cubins come from, for messages
        self._libraries: dict[str, object] = {}
        self._kernels: dict[tuple[str, int], Kernel] = {}

    def _library(self, cubin: str):
        if cubin not in self._libraries:
            path = self.folder / self.arch / cubin
            self._libraries[cubin] = check(_cu().cuLibraryLoadFromFile(str(path).encode(), [], [], 0, [], [], 0),
                                           f"loading {path}")
        return self._libraries[cubin]

    def kernel(self, name: str, device: int) -> Kernel:
        """Entry point ``name`` on ``device``; the current context must be that device's."""
        found = self._kernels.get((name, device))
        if found is not None:
            return found
        if name not in self.entries:
            raise DriverError(f"no kernel {name} in {self.description}")
        with _LOCK:
            cu = _cu()
            handle = check(cu.cuLibraryGetKernel(self._library(self.entries[name]), name.encode()),
                           f"cuLibraryGetKernel({name})")
            function = check(cu.cuKernelGetFunction(handle), f"cuKernelGetFunction({name})")
            found = self._kernels.setdefault((name, device), Kernel(name, function, device))
        return found

    def load_all(self) -> None:
        """Load every cubin now (a cubin the driver cannot load fails here, not mid-pipeline)."""
        for cubin in sorted(set(self.entries.values())):
            self._library(cubin)
