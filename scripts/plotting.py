"""matplotlib for the scripts that draw figures: an optional dependency (the ``dev`` extra), so a
missing one is a one-line message naming the package, not a traceback."""

from __future__ import annotations

import sys


def pyplot():
    """``matplotlib.pyplot`` on the Agg back-end; SystemExit with one line when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{sys.argv[0]}: drawing a figure needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require(flag: str) -> None:
    """Fail at once, before any work, when ``flag`` asks for a figure and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(f"{sys.argv[0]}: {flag} needs matplotlib (pip install matplotlib)") from None
