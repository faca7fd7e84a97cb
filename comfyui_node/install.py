"""``nvfp4-dit-comfyui-install <custom_nodes dir>``: register a pip-installed nvfp4_dit with ComfyUI.

ComfyUI discovers nodes only in its ``custom_nodes`` folders, never among installed packages, so a pip
user needs a one-line module there that re-exports the node mappings. This writes that module. The
Python that runs ComfyUI must be the one nvfp4_dit is installed in.
"""

from __future__ import annotations

import argparse
import os
import sys

SHIM_FILE_NAME = "nvfp4_dit_attention.py"
SHIM_SOURCE = (
    "from nvfp4_dit.comfyui_node import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS"
    "  # written by nvfp4-dit-comfyui-install\n"
)


def install_shim(custom_nodes_dir: str, force: bool = False) -> str:
    """Write the shim into ``custom_nodes_dir``; returns its path. Idempotent; never overwrites a
    different file unless ``force``."""
    if not os.path.isdir(custom_nodes_dir):
        raise ValueError(f"custom_nodes_dir {custom_nodes_dir!r} is not a directory")
    path = os.path.join(custom_nodes_dir, SHIM_FILE_NAME)
    if os.path.lexists(path) and not force:
        with open(path, encoding="utf-8", errors="replace") as existing:
            if existing.read() == SHIM_SOURCE:
                return path
        raise FileExistsError(f"{path} exists with other content; pass --force to replace it")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(SHIM_SOURCE)
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="nvfp4-dit-comfyui-install",
        description="Write a one-line module into ComfyUI's custom_nodes folder that loads the nvfp4_dit node.",
    )
    parser.add_argument("custom_nodes_dir", help="ComfyUI's custom_nodes folder, e.g. ~/ComfyUI/custom_nodes")
    parser.add_argument("--force", action="store_true", help=f"replace an existing {SHIM_FILE_NAME}")
    args = parser.parse_args(argv)
    try:
        path = install_shim(args.custom_nodes_dir, force=args.force)
    except (ValueError, FileExistsError) as error:
        print(f"nvfp4-dit-comfyui-install: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    print(f"ComfyUI must run with this Python ({sys.executable}) to find nvfp4_dit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
