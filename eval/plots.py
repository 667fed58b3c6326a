"""Figures for every report: a headless pyplot and an atomic PNG write."""

from __future__ import annotations

import os
from pathlib import Path

from flipguard.errors import RecordError
from flipguard.files import check_replace, owned_replace


def pyplot():
    """matplotlib.pyplot on the Agg backend (reports run on machines with no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> None:
    """Write a PNG via a temp file + rename (no half-written figure) under the ownership rule
    (files.owned_replace: a PNG flipguard did not write is never replaced), then free it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        check_replace(path)  # before the work
        try:
            fig.savefig(tmp, dpi=dpi)
        except OSError as exc:  # a full disk: one line, the previous figure kept
            raise RecordError(f"{path}: cannot write ({exc.strerror or exc}); the previous version, if any, is "
                              "unchanged") from None
        owned_replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        pyplot().close(fig)
