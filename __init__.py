"""Entry point when this repository is cloned into ComfyUI's ``custom_nodes/`` folder.

ComfyUI imports the folder's ``__init__.py`` and reads ``NODE_CLASS_MAPPINGS``. The node lives in the
``nvfp4_dit.comfyui_node`` package. If nvfp4_dit is pip-installed (``pip install -e .`` of this clone,
or a wheel), that installation is used. Otherwise this checkout's folders are made importable under
the names ``pyproject.toml`` gives them, without putting the repository root on ``sys.path`` (its
``tests``/``scripts`` folders would shadow other packages).

Nothing happens at import time: the mappings are resolved on first access, so tools that merely
import this file (pytest's package discovery, linters) need neither ComfyUI nor torch.
"""

import os as _os

_ROOT = _os.path.dirname(_os.path.abspath(__file__))
# The same mapping as [tool.setuptools.package-dir] in pyproject.toml.
_PACKAGE_DIRS = {
    "nvfp4_dit": "nvfp4_dit",
    "nvfp4_dit.processors": "processors",
    "nvfp4_dit.comfyui_node": "comfyui_node",
    "nvfp4_dit._csrc": "csrc",
}
_NODE_EXPORTS = ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS")


def _checkout_finder():
    import importlib.abc
    import importlib.machinery
    import importlib.util

    class CheckoutPackageFinder(importlib.abc.MetaPathFinder):
        """Finds nvfp4_dit and its mapped subpackages in this checkout."""

        root = _ROOT

        def find_spec(self, fullname, path=None, target=None):
            folder = _PACKAGE_DIRS.get(fullname)
            if folder is None:
                return None
            folder = _os.path.join(_ROOT, folder)
            init = _os.path.join(folder, "__init__.py")
            if _os.path.isfile(init):
                return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[folder])
            if _os.path.isdir(folder):  # a data-only folder (csrc) becomes a namespace package
                spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
                spec.submodule_search_locations = [folder]
                return spec
            return None

    return CheckoutPackageFinder()


def _node_module():
    import importlib
    import importlib.util
    import sys

    try:
        installed = importlib.util.find_spec("nvfp4_dit.comfyui_node") is not None
    except ImportError:
        installed = False
    if not installed and not any(getattr(f, "root", None) == _ROOT for f in sys.meta_path):
        sys.meta_path.insert(0, _checkout_finder())
    return importlib.import_module("nvfp4_dit.comfyui_node")


def __getattr__(name):
    if name in _NODE_EXPORTS:
        return getattr(_node_module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
