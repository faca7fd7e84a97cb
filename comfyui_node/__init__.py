"""ComfyUI integration of nvfp4_dit (installed as ``nvfp4_dit.comfyui_node``).

``NODE_CLASS_MAPPINGS`` / ``NODE_DISPLAY_NAME_MAPPINGS`` are resolved on first access, so importing
this package (or ``nvfp4_dit``) never needs ComfyUI; only ComfyUI's loader touches them. A
``custom_nodes`` shim is one line: ``from nvfp4_dit.comfyui_node import NODE_CLASS_MAPPINGS,
NODE_DISPLAY_NAME_MAPPINGS`` (``nvfp4-dit-comfyui-install <custom_nodes dir>`` writes it).
"""

_NODE_EXPORTS = ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS")

__all__ = list(_NODE_EXPORTS)


def __getattr__(name):
    if name in _NODE_EXPORTS:
        from . import nodes

        return getattr(nodes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
