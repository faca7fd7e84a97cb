"""The wheel carries the kernels: ``pip wheel .`` compiles every translation unit for sm_120a,
sm_121a, sm_90a and sm_80 into ``nvfp4_dit/_cubins/`` with a manifest, and that wheel, installed
into a fresh virtual environment whose PATH has no nvcc and no C++ compiler, imports and lists,
from the manifest alone (no driver, no GPU), the kernels it would load on each architecture.

In the build group (marker ``compile``: README's build-group command, .ci/run). CI sets
NVFP4_DIT_REQUIRE_NVCC=1: there a wheel that cannot be built fails instead of skipping.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from nvfp4_dit.cuda import compile as kc
from nvfp4_dit.cuda import abi

REPO = Path(__file__).resolve().parents[1]
REQUIRE = os.environ.get("NVFP4_DIT_REQUIRE_NVCC") == "1"

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-w", str(out), "-q"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        message = f"pip wheel failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
        if REQUIRE:
            pytest.fail(message)
        pytest.skip(message)
    found = sorted(out.glob("nvfp4_dit-*.whl"))
    assert len(found) == 1, found
    return found[0]


def test_wheel_holds_every_kernel_for_all_four_archs(wheel):
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
        manifest = json.loads(z.read("nvfp4_dit/_cubins/manifest.json"))
        for arch in kc.ARCHS:
            for unit in kc.units(arch):
                name = f"nvfp4_dit/_cubins/{arch}/{kc.cubin_name(unit)}"
                assert name in files, name
                entries = kc.kernel_entries(z.read(name))
                assert entries == manifest["archs"][arch]["cubins"][kc.cubin_name(unit)], name
        assert "nvfp4_dit/_csrc/common/launch.h" in files
        cubin_bytes = sum(i.file_size for i in z.infolist() if i.filename.endswith(".cubin"))
    assert manifest["format"] == kc.MANIFEST_FORMAT
    assert manifest["source_hash"] == kc.source_hash(REPO / "csrc")
    assert manifest["compiler"].startswith(("nvrtc", "nvcc"))
    if not os.environ.get("NVFP4_DIT_WHEEL_COMPILER"):
        # The build requirements' NVRTC 12.9 (not a CUDA 13 one from the venv around the isolated
        # build): the cubins load on CUDA 12.8-era drivers.
        assert manifest["compiler"] == "nvrtc12.9", manifest["compiler"]
        assert manifest["archs"]["sm_120a"]["min_driver_version"] == 12080
    assert sorted(manifest["archs"]) == sorted(kc.ARCHS)
    for arch, entry in manifest["archs"].items():
        assert entry["kind"] == kc.ARCHS[arch]
        assert entry["min_driver_version"] >= kc.FIRST_DRIVER[arch]
        names = {n for names in entry["cubins"].values() for n in names}
        assert names == abi.launcher_entries(kc.ARCHS[arch]), arch
    print(f"\nwheel {wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB ({cubin_bytes / 2**20:.1f} MiB of cubins "
          f"uncompressed), {manifest['compiler']}")
    # README states both sizes (MB = 10^6 bytes); they stay true within 10 %.
    stated = re.search(r"a (\d+(?:\.\d+)?) MB wheel,\s+(\d+(?:\.\d+)?) MB\s+of cubins unpacked", (REPO / "README.md").read_text())
    assert stated, "README states the wheel's size as 'a X MB wheel, Y MB of cubins unpacked'"
    for said, measured in ((float(stated[1]), wheel.stat().st_size / 1e6), (float(stated[2]), cubin_bytes / 1e6)):
        assert abs(measured - said) <= 0.1 * said, f"README says {said} MB, the build gives {measured:.1f} MB"


def _fresh_venv(root: Path) -> Path:
    """A new virtual environment that sees this one's packages (torch, numpy, cuda-bindings) through
    a .pth file, but not this checkout's nvfp4_dit; returns its python."""
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "outer_packages.pth").write_text("\n".join(sorted(outer)) + "\n")
    return python


def test_fresh_install_without_compilers_lists_the_prebuilt_kernels(wheel, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, text=True)
    bin_dir = python.parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = str(bin_dir)   # no nvcc, no c++, no ninja on PATH
    env["HOME"] = str(tmp_path)
    probe = (
        "import shutil, nvfp4_dit; from nvfp4_dit.cuda import build; "
        "assert shutil.which('nvcc') is None and shutil.which('c++') is None and shutil.which('g++') is None; "
        "assert 'site-packages' in nvfp4_dit.__file__, nvfp4_dit.__file__; "
        "m = build.prebuilt_manifest(); assert m is not None; "
        "assert m['source_hash'] == build._installed_source_hash(); "
        "print(build.list_prebuilt())")
    res = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    text = res.stdout
    assert "matches the installed sources" in text
    for arch in kc.ARCHS:
        assert f"{arch} ({kc.ARCHS[arch]} MMA" in text, text
    listed = subprocess.run([str(python), "-m", "nvfp4_dit.cuda.build", "--list"], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout.strip() == text.strip(), listed.stderr[-2000:]


# NVRTC 12.9's ptxas keeps a few values of this kernel in local memory (nvcc 13 does not).
_KNOWN_LOCAL_OPS = {"nvfp4_dit_attention_fwd_native_mxfp8_d128": 4}


def test_wheel_native_cubins_hold_the_expected_mma(wheel, tmp_path):
    """The SASS of the cubins the wheel ships for sm_120a / sm_121a (NVRTC's, not the nvcc build that
    scripts/check_sass.py compiles): every MMA count the warp layout implies, and no local memory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_sass", REPO / "scripts" / "check_sass.py")
    check_sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_sass)
    if check_sass.find_tool("cuobjdump") is None or check_sass.find_tool("nvdisasm") is None:
        if REQUIRE:
            pytest.fail("cuobjdump / nvdisasm missing (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
        pytest.skip("needs cuobjdump and nvdisasm")
    checked = 0
    with zipfile.ZipFile(wheel) as z:
        for arch in kc.NATIVE_ARCHS:
            for unit in kc.units(arch):
                path = tmp_path / arch / kc.cubin_name(unit)
                path.parent.mkdir(exist_ok=True)
                path.write_bytes(z.read(f"nvfp4_dit/_cubins/{arch}/{kc.cubin_name(unit)}"))
                for kernel, c in check_sass.sass_counts(check_sass.disassemble(path)).items():
                    want = check_sass.expected_mma_of(kernel)
                    if want is not None:
                        assert {k: c[k] for k in want} == want, (arch, kernel, c)
                        checked += 1
                    if kernel.startswith("nvfp4_dit_attention"):
                        assert c["local"] <= _KNOWN_LOCAL_OPS.get(kernel, 0), (arch, kernel, c["local"])
    # per arch: attention (formats x head dims x dense/block-sparse)
    assert checked == len(kc.NATIVE_ARCHS) * (2 * 2 * 2)
