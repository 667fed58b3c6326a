"""Figures for every report: a headless pyplot, an atomic PNG write, and for the page (pipeline/view)
bars with 95% CIs as PNG bytes."""

from __future__ import annotations

import io
import json
import math
import os
import textwrap
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from flipguard.errors import RecordError
from flipguard.eval.estimate import NOT_MEANINGFUL
from flipguard.files import check_replace, owned_replace


def pyplot():
    """matplotlib.pyplot on the Agg backend (reports run on machines with no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Figures are made to be read where they are shown: a page shows a PNG at its own pixel size (shrunk
# only to fit a narrow window), so every text is at least MIN_FONT points at the DPI it is saved with,
# and a figure is at most MAX_WIDTH_IN inches wide (a window of ~800 px keeps it above 70% of its size).
PAGE_DPI = 100
MIN_FONT = 10  # points: tick labels, bar values, cell numbers
TITLE_FONT = 11
MAX_WIDTH_IN = 9.5
# the PNG text chunk that lists every text drawn in a figure: where it is (pixels of the saved image,
# origin top left), its size in pixels, its colour and, for a number printed on a coloured cell, the
# cell's colour ("on"), and each axes' frame ("axes"): what a test reads to check that nothing is cut,
# everything is legible and no label sits on a frame
TEXTS_KEY = "flipguard:texts"
ON_PREFIX = "on:"  # a text's gid, "on:#rrggbb": the colour of the cell it is printed on


def _hex(color) -> str:
    from matplotlib.colors import to_hex

    return to_hex(color, keep_alpha=False)


def _write_png(fig, target, dpi: int) -> None:
    """Save `fig` as PNG (a path or a binary file object) cropped to everything drawn (nothing cut,
    whatever its labels' length), with TEXTS_KEY: every visible text's box in the saved image."""
    from matplotlib.text import Text

    fig.set_dpi(dpi)
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    from matplotlib.transforms import Bbox

    tight = fig.get_tightbbox(renderer).padded(0.08)  # inches, made a whole number of pixels
    width_px, height_px = math.ceil(tight.width * dpi), math.ceil(tight.height * dpi)
    bbox = Bbox.from_bounds(tight.x0, tight.y0, width_px / dpi, height_px / dpi)
    off_view = set()  # tick labels of ticks outside their axis's limits: made, never drawn
    for ax in fig.axes:
        for axis, limits in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(limits)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 * (hi - lo) <= tick.get_loc() <= hi + 1e-9 * (hi - lo):
                    off_view |= {id(tick.label1), id(tick.label2)}
    texts = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip() or t.figure is not fig or id(t) in off_view:
            continue
        box = t.get_window_extent(renderer)  # display pixels at `dpi`, origin bottom left
        x0, x1 = box.x0 - bbox.x0 * dpi, box.x1 - bbox.x0 * dpi
        y0, y1 = height_px - (box.y1 - bbox.y0 * dpi), height_px - (box.y0 - bbox.y0 * dpi)
        gid = t.get_gid() or ""
        texts.append({"text": t.get_text(), "box": [round(v, 1) for v in (x0, y0, x1, y1)],
                      "size_px": round(t.get_fontsize() * dpi / 72, 2), "rotation": round(t.get_rotation(), 1),
                      "color": _hex(t.get_color()),
                      **({"on": gid[len(ON_PREFIX):]} if gid.startswith(ON_PREFIX) else {"gid": gid} if gid else {})})
    # each axes' frame in the saved image (same coordinates): what a text must not sit on
    frames = [[round(v, 1) for v in (b.x0 - bbox.x0 * dpi, height_px - (b.y1 - bbox.y0 * dpi),
                                     b.x1 - bbox.x0 * dpi, height_px - (b.y0 - bbox.y0 * dpi))]
              for b in (ax.get_window_extent(renderer) for ax in fig.axes)]
    meta = {TEXTS_KEY: json.dumps({"width": width_px, "height": height_px, "texts": texts, "axes": frames})}
    fig.savefig(target, format="png", dpi=dpi, bbox_inches=bbox, metadata=meta)


def save_figure(fig, path: str | os.PathLike, dpi: int = PAGE_DPI) -> None:
    """Write a PNG via a temp file + rename (no half-written figure) under the ownership rule
    (files.owned_replace: a PNG flipguard did not write is never replaced), then free it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        check_replace(path)  # before the work
        try:
            _write_png(fig, tmp, dpi)
        except OSError as exc:  # a full disk: one line, the previous figure kept
            raise RecordError(f"{path}: cannot write ({exc.strerror or exc}); the previous version, if any, is "
                              "unchanged") from None
        owned_replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        pyplot().close(fig)


def png_bytes(fig, dpi: int = PAGE_DPI) -> bytes:
    """A figure as PNG bytes (for a page that embeds it, pipeline/view), then freed."""
    buf = io.BytesIO()
    try:
        _write_png(fig, buf, dpi)
    finally:
        pyplot().close(fig)
    return buf.getvalue()


def cell_text(ax, x: float, y: float, text: str, rgba, fontsize: float = MIN_FONT, **kw) -> None:
    """A number printed on a coloured cell (a heatmap's): white on a dark cell, black on a light one, by
    WCAG relative luminance (switching at 0.179, where both reach a contrast of 4.58: every cell's number
    reads at >= 4.5:1), the cell's colour kept as the text's gid for the page's test."""
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3])
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    color = "white" if luminance < 0.179 else "black"
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, color=color, gid=ON_PREFIX + _hex(rgba),
            parse_math=False, **kw)


def mark_not_meaningful(ax, x: float, y: float, text: str = NOT_MEANINGFUL, **kw) -> None:
    """Where a number is not meaningful (or not measured), its mark in red, never a bar or a colour of 0."""
    ax.text(x, y, text, **{"ha": "center", "va": "center", **kw}, fontsize=MIN_FONT, color="#b3261e",
            fontweight="bold", parse_math=False)


def finish_heatmap(fig, ax, image, label: str, title: str) -> None:
    """A heatmap's colour bar (labelled, its ticks as legible as the cells) and title, laid out."""
    bar = fig.colorbar(image, ax=ax)
    bar.set_label(label, fontsize=MIN_FONT)
    bar.ax.tick_params(labelsize=MIN_FONT)
    ax.set_title(title, fontsize=TITLE_FONT)
    fig.tight_layout()


def wrap(text: str, width: int) -> str:
    """A label broken into lines of at most `width` characters (a long condition or cell name)."""
    return textwrap.fill(str(text), max(width, 8), break_long_words=True, break_on_hyphens=False)


CROWDED_BARS = 10  # more bars than this in one chart: laid out sideways, a row per bar, labels read across


def crowded(groups: Sequence[str], series: Mapping[str, Sequence]) -> bool:
    return len(groups) * max(len(series), 1) > CROWDED_BARS


def draw_estimate_bars(ax, groups: Sequence[str], series: Mapping[str, Sequence[tuple[float, float, float, str]]],
                       unit: str, highlight_first: bool = True, legend: bool = True) -> None:
    """Bars with 95% CI whiskers on `ax`: one group per label (a system), one bar per series in it (a
    dataset), each (value, ci_low, ci_high, note). A NaN value draws no bar but its note ("n/m", "not
    measured") at the axis; a NaN interval draws no whisker and 'no CI' beside the value. More than
    CROWDED_BARS bars are drawn sideways (a row each, the labels across), so none run into another.
    Labels are text, never math."""
    names = list(series)
    side = crowded(groups, series)
    pos = np.arange(len(groups))
    width = 0.8 / max(len(names), 1)
    finite = [v for points in series.values() for p in points for v in p[:3] if v == v]
    span = (max(finite) - min(min(finite), 0)) if finite else 1.0
    for k, name in enumerate(names):
        offsets = pos - 0.4 + width * (k + 0.5)
        for i, (value, lo, hi, note) in enumerate(series[name]):
            at = (0, offsets[i]) if side else (offsets[i], 0)
            if value != value:  # NaN: said, not drawn as a zero
                mark_not_meaningful(ax, *at, note or "–", ha="left" if side else "center", va="center" if side else "bottom")
                continue
            color = ("#7f7f7f" if i == 0 else "#2166ac") if highlight_first and len(names) == 1 else f"C{k}"
            has_ci = lo == lo and hi == hi
            err = [[max(value - lo, 0)], [max(hi - value, 0)]] if has_ci else None
            label = name if i == 0 and len(names) > 1 else None
            text = (f"{value:+.1f}" if unit == "pp" else f"{value:.1f}") + ("" if has_ci else " (no CI)") + (
                f" {note}" if note else "")
            end = (max(value, hi) if has_ci else value) + 0.02 * (span or 1.0)
            if side:
                ax.barh(offsets[i], value, width * 0.9, xerr=err, capsize=3, color=color, label=label)
                ax.text(end, offsets[i], text, ha="left", va="center", fontsize=MIN_FONT, parse_math=False)
            else:
                ax.bar(offsets[i], value, width * 0.9, yerr=err, capsize=4, color=color, label=label)
                ax.text(offsets[i], end, text.replace(" (no CI)", "\n(no CI)"), ha="center", va="bottom",
                        fontsize=MIN_FONT, parse_math=False)
    # slanted labels stay one line (a second line would run into the next label); across, long ones wrap
    labels = [wrap(g, 28) if side else str(g) for g in groups]
    if side:
        ax.axvline(0, color="black", lw=0.8)
        ax.set_ylim(len(groups) - 0.4, -0.6)  # the first group on top
        if not finite:
            ax.set_xlim(-10, 10)
        ax.set_yticks(pos, labels, fontsize=MIN_FONT)
        ax.tick_params(axis="x", labelsize=MIN_FONT)
        ax.set_xlabel(unit, fontsize=MIN_FONT)
        ax.margins(x=0.2)
    else:
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlim(-0.6, len(groups) - 0.4)
        if not finite:  # nothing drawn but notes: an axis around 0, not matplotlib's ±0.06
            ax.set_ylim(-10, 10)
        ax.set_xticks(pos, labels, rotation=30, ha="right", rotation_mode="anchor", fontsize=MIN_FONT)
        ax.tick_params(axis="y", labelsize=MIN_FONT)
        ax.set_ylabel(unit, fontsize=MIN_FONT)
        ax.margins(y=0.18)
    for text in [*ax.get_xticklabels(), *ax.get_yticklabels()]:
        text.set_parse_math(False)
    if len(names) > 1 and legend:  # beside the bars, never over them
        ax.legend(fontsize=MIN_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def estimate_bars(groups: Sequence[str], series: Mapping[str, Sequence[tuple[float, float, float, str]]], title: str,
                  unit: str, highlight_first: bool = True):
    """draw_estimate_bars in a figure of its own, sized for its bars (at most MAX_WIDTH_IN inches wide;
    sideways, as tall as its rows), the title wrapped to that width."""
    plt = pyplot()
    bars = len(groups) * max(len(series), 1)
    if crowded(groups, series):
        width_in = 7.0
        fig, ax = plt.subplots(figsize=(width_in, 1.4 + 0.3 * bars + 0.15 * len(groups)))
    else:
        width_in = min(MAX_WIDTH_IN, 2.4 + 0.6 * bars)
        fig, ax = plt.subplots(figsize=(width_in, 3.4))
    draw_estimate_bars(ax, groups, series, unit, highlight_first)
    ax.set_title(wrap(title, int(width_in * 72 / (TITLE_FONT * 0.6))), fontsize=TITLE_FONT, parse_math=False)
    fig.tight_layout()
    return fig
