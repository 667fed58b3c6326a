"""Figures for every report: a headless pyplot, an atomic PNG write, and for the page (pipeline/view)
bars with 95% CIs as PNG bytes."""

from __future__ import annotations

import io
import os
import textwrap
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

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


def png_bytes(fig, dpi: int = 110) -> bytes:
    """A figure as PNG bytes (for a page that embeds it, pipeline/view), then freed."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        pyplot().close(fig)
    return buf.getvalue()


def estimate_bars(groups: Sequence[str], series: Mapping[str, Sequence[tuple[float, float, float, str]]], title: str,
                  ylabel: str, highlight_first: bool = True):
    """Bars with 95% CI whiskers: one group per x label (a system), one bar per series in it (a dataset),
    each (value, ci_low, ci_high, note). A NaN value draws no bar but its note ("n/m", "not measured") at
    the axis; a NaN interval draws no whisker and 'no CI' under the value. Labels are text, never math."""
    plt = pyplot()
    names = list(series)
    x = np.arange(len(groups))
    width = 0.8 / max(len(names), 1)
    width_in = 2.6 + 0.75 * len(groups) * max(1, len(names) * 0.6)
    fig, ax = plt.subplots(figsize=(width_in, 3.4))
    finite = [v for points in series.values() for p in points for v in p[:3] if v == v]
    span = (max(finite) - min(min(finite), 0)) if finite else 1.0
    for k, name in enumerate(names):
        offsets = x - 0.4 + width * (k + 0.5)
        for i, (value, lo, hi, note) in enumerate(series[name]):
            if value != value:  # NaN: said, not drawn as a zero
                ax.text(offsets[i], 0, note or "–", ha="center", va="bottom", fontsize=9, color="#b3261e",
                        fontweight="bold", parse_math=False)
                continue
            color = ("#7f7f7f" if i == 0 else "#2166ac") if highlight_first and len(names) == 1 else f"C{k}"
            has_ci = lo == lo and hi == hi
            yerr = [[max(value - lo, 0)], [max(hi - value, 0)]] if has_ci else None
            ax.bar(offsets[i], value, width * 0.9, yerr=yerr, capsize=4, color=color,
                   label=name if i == 0 and len(names) > 1 else None)
            top = max(value, hi) if has_ci else value
            text = f"{value:+.1f}" if ylabel == "pp" else f"{value:.1f}"
            ax.text(offsets[i], top + 0.02 * (span or 1.0), text + ("" if has_ci else " (no CI)") + (f" {note}" if note else ""),
                    ha="center", va="bottom", fontsize=8, parse_math=False)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    if not finite:  # nothing drawn but notes: an axis around 0, not matplotlib's ±0.06
        ax.set_ylim(-10, 10)
    ax.set_xticks(x, list(groups), rotation=20, ha="right")
    for label in ax.get_xticklabels():
        label.set_parse_math(False)
    ax.set_ylabel(ylabel)
    ax.set_title(textwrap.fill(title, int(width_in * 10)), fontsize=10, parse_math=False)  # ~10 characters an inch
    ax.margins(y=0.15)
    if len(names) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
