"""The wheel carries the compiled kernels: ``pip wheel .`` (or ``python -m build``) compiles every
translation unit of csrc/ for each architecture (nvfp4_dit/cuda/compile.py: NVRTC from the build
requirements, in parallel through ninja) into ``nvfp4_dit/_cubins/`` with a manifest. An editable
install skips it: a checkout builds its kernels on first use.

``NVFP4_DIT_WHEEL_COMPILER=nvcc`` builds the wheel's cubins with nvcc from a CUDA toolkit instead.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _compile_module():
    # By path: importing the package would import torch, which a build environment does not have.
    spec = importlib.util.spec_from_file_location("nvfp4_dit_compile", ROOT / "nvfp4_dit" / "cuda" / "compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCubins(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        kc = _compile_module()
        choice = os.environ.get("NVFP4_DIT_WHEEL_COMPILER", "").strip()
        compiler = kc.find_compiler((choice,) if choice else ("nvrtc", "nvcc"))
        out = Path(self.build_lib) / "nvfp4_dit" / "_cubins"
        manifest = kc.build_cubins(tuple(kc.ARCHS), out, compiler, root=ROOT / "csrc")
        count = sum(len(a["cubins"]) for a in manifest["archs"].values())
        print(f"nvfp4_dit: {count} cubins for {', '.join(manifest['archs'])} ({compiler.tag}) in {out}")


setup(cmdclass={"build_py": BuildPyWithCubins})
