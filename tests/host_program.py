"""Compile a small C++ host program against csrc/ with nvcc (tests that check device headers on
the host). Skips the calling test where nvcc is missing."""

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def compile_host_program(directory: Path, name: str, source: str) -> Path:
    """Write ``source`` to ``directory/name.cu``, compile it (C++17, -O2, csrc/ on the include
    path) and return the executable's path."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = directory / f"{name}.cu"
    src.write_text(source)
    exe = directory / name
    subprocess.run([nvcc, "-std=c++17", "-O2", f"-I{CSRC}", str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    return exe
