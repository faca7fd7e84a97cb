"""Every kernel TU (nvfp4_dit.cuda.compile.ALL_UNITS) compiles standalone with nvcc for each target.

No GPU needed: this is the CI guard for the arch matrix (native sm_120a/sm_121a, emulated sm_90a
and sm_80). All (TU, arch) compiles start at once on a thread pool sized to the CPU count; each
parametrized test then reads its result. ptxas runs at -O1: it still assembles and checks every
instruction for the target, at about half the time of -O3 (the builds use -O3). The wheel test
(tests/test_wheel.py) builds the same units with NVRTC. In the build group (marker ``compile``).
"""

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from nvfp4_dit.cuda import build
from nvfp4_dit.cuda import compile as kc

pytestmark = pytest.mark.compile

CSRC = build.csrc_dir()
ARCHS = tuple(build.ARCHS)
TUS = kc.ALL_UNITS


def _compile(nvcc: str, tu: str, arch: str) -> subprocess.CompletedProcess:
    cmd = [nvcc, "-std=c++17", "-O3", "-Xptxas", "-O1", *build.gencode_flags(arch),
           f"-I{CSRC}", "-c", str(CSRC / tu), "-o", os.devnull]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def compile_results():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    jobs = [(tu, arch) for tu in TUS for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = {job: pool.submit(_compile, nvcc, *job) for job in jobs}
        return {job: f.result() for job, f in futures.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tu", TUS)
def test_tu_compiles(compile_results, tu, arch):
    res = compile_results[(tu, arch)]
    assert res.returncode == 0, f"nvcc {tu} for {arch} failed:\n{res.stderr[-4000:]}"
