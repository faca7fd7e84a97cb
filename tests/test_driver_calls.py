"""Every CUDA driver call of the launcher marshals its arguments: cuda.bindings converts and
type-checks them before it looks for the driver, so on a machine without one each call must get
as far as "no driver" (and with one, as far as the driver's own verdict on the dummy handles),
never a TypeError. This covers, without a GPU, the calls that the GPU suite makes: library load,
kernel lookup, shared-memory attribute, occupancy, launch with a parameter struct, device
attributes."""

import ctypes

import pytest

cu = pytest.importorskip("cuda.bindings.driver")

from nvfp4_dit.cuda import driver  # noqa: E402
from nvfp4_dit.cuda import abi  # noqa: E402

# Raised where a call's arguments are wrong, by cuda.bindings or by our code around it.
MARSHALLING_ERRORS = (TypeError, ValueError, OverflowError, AttributeError, KeyError, IndexError)


def _reaches_driver(call) -> None:
    """Run ``call``; pass if it returned or failed only for want of (or at) the driver."""
    try:
        call()
    except MARSHALLING_ERRORS as e:
        pytest.fail(f"the call's arguments did not marshal: {type(e).__name__}: {e}")
    except Exception:  # noqa: BLE001 - no driver here (cuda.pathfinder's error), or DriverError on dummy handles
        pass


def test_a_wrong_argument_is_caught_before_the_driver():
    # The premise of this module: cuda.bindings rejects a bad argument without a driver.
    with pytest.raises(TypeError):
        cu.cuLaunchKernel(cu.CUfunction(), 1, 1, 1, 256, 1, 1, 0, "not a stream", 0, 0)


def _kernel() -> driver.Kernel:
    return driver.Kernel("nvfp4_dit_dummy", cu.CUfunction(), 0)


def test_kernel_launch_with_each_parameter_struct_marshals():
    kernel = _kernel()
    stream = 0
    params = [[abi.AttentionFwdParams()], [abi.BlockListsParams()],
              [abi.QuantizeQkvParams(), ctypes.c_int64(4)],
              [ctypes.c_void_p(0)] * 6]
    for args in params:
        _reaches_driver(lambda: kernel.launch((7, 2, 3), abi.ATTENTION_THREADS, args, stream,
                                              abi.ATTENTION_SMEM_BYTES[1][1]))
        _reaches_driver(lambda: kernel.launch((7,), abi.ATTENTION_THREADS, args, 0x7F00_0000_0000))


def test_occupancy_and_shared_memory_attribute_marshal():
    kernel = _kernel()
    _reaches_driver(lambda: kernel.blocks_per_sm(abi.QUANTIZE_THREADS, abi.SMOOTHING_BASIS_SMEM_BYTES[1]))
    _reaches_driver(lambda: kernel.blocks_per_sm(abi.QUANTIZE_THREADS))


def test_library_load_and_kernel_lookup_marshal(tmp_path):
    library = driver.KernelLibrary(tmp_path, "sm_90a", {"nvfp4_dit_dummy": "dummy.cubin"}, "a test library")
    _reaches_driver(lambda: library.load_all())
    library._libraries["dummy.cubin"] = cu.CUlibrary()   # skip the load: look a kernel up in a null library
    _reaches_driver(lambda: library.kernel("nvfp4_dit_dummy", 0))
    with pytest.raises(driver.DriverError, match="no kernel nvfp4_dit_missing"):
        library.kernel("nvfp4_dit_missing", 0)


@pytest.mark.parametrize("name", ["MULTIPROCESSOR_COUNT"])
def test_device_attributes_the_launcher_reads_exist(name):
    assert hasattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    driver._device_attributes.pop((0, name), None)
    _reaches_driver(lambda: driver.device_attribute(0, name))


def test_driver_version_marshals():
    _reaches_driver(driver.driver_version)


def test_memset_marshals():
    _reaches_driver(lambda: driver.memset_d32(0, 0, 16, 0))


def test_the_ctypes_prototypes_match_cuda_h():
    # The per-call launch and memset go to the driver library through ctypes; their argument types
    # must have the widths of cuda.h's prototypes (a wrong width would pass garbage, no error).
    import re

    from nvfp4_dit.cuda import compile as kc

    home = kc.cuda_home()
    if home is None or not (home / "include" / "cuda.h").is_file():
        pytest.skip("needs a CUDA toolkit (cuda.h)")
    header = (home / "include" / "cuda.h").read_text()
    widths = {"CUfunction": 8, "CUstream": 8, "unsigned int": 4, "void **": 8, "CUdeviceptr": 8, "size_t": 8}
    for name, argtypes in driver.PROTOTYPES.items():
        proto = re.search(rf"CUresult CUDAAPI {name}\(([^;]*)\);", header).group(1)
        types = [re.sub(r"\s*\w+$", "", p.strip()).replace(" *", "*").replace("*", " *").replace("  ", " ")
                 .replace("void * *", "void **") for p in proto.split(",")]
        assert [widths[t] for t in types] == [ctypes.sizeof(t) for t in argtypes], (name, types)
