"""Figures for every report: a headless pyplot and an atomic PNG write."""

from __future__ import annotations

import os
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (reports run on machines with no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> None:
    """Write a PNG via a temp file + rename (no half-written figure), then free it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        pyplot().close(fig)
