"""The figures are made to be read (eval/plots.py): every text inside the saved image, at least MIN_FONT
points, tick labels that do not run into each other, numbers on coloured cells in a colour that contrasts
with the cell, n/m drawn where a bar is not meaningful, at any number of bars or cells. Read from the PNG
itself: the text chunk eval/plots.py writes (each text's box in the image) and the image's pixels."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from flipguard.eval.plots import MIN_FONT, PAGE_DPI, TEXTS_KEY, estimate_bars, png_bytes


def texts_of(png: bytes) -> tuple[dict, np.ndarray]:
    """(the figure's text chunk, its pixels as an RGB array)."""
    image = Image.open(io.BytesIO(png))
    meta = json.loads(image.info[TEXTS_KEY])
    assert (meta["width"], meta["height"]) == image.size
    return meta, np.asarray(image.convert("RGB"))


def luminance(hex_color: str) -> float:
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two colours (1 to 21; 4.5 is the least for body text)."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def overlaps(a: list[float], b: list[float], slack: float = 1.0) -> bool:
    return a[0] + slack < b[2] and b[0] + slack < a[2] and a[1] + slack < b[3] and b[1] + slack < a[3]


def check_legible(png: bytes, tick_labels: list[str] = ()) -> dict:
    """Every text inside the image and at least MIN_FONT points; the named tick labels apart from each other;
    every number on a coloured cell in a colour of WCAG contrast >= 4.5 with the cell, drawn there."""
    meta, pixels = texts_of(png)
    height, width = pixels.shape[:2]
    for t in meta["texts"]:
        x0, y0, x1, y1 = t["box"]
        assert 0 <= x0 and x1 <= width and 0 <= y0 and y1 <= height, (t, width, height)  # nothing cut
        assert t["size_px"] >= (MIN_FONT - 1) * PAGE_DPI / 72 - 1e-6, t  # one point less: crowded bar values, legends
        if "on" in t:
            assert contrast(t["color"], t["on"]) >= 4.5, t
            box = pixels[math.ceil(y0):int(y1), math.ceil(x0):int(x1)].reshape(-1, 3)
            cell = np.array([int(t["on"][i:i + 2], 16) for i in (1, 3, 5)])
            # the text is there: some of its box's pixels are far from the cell's colour
            assert (np.abs(box.astype(int) - cell).sum(axis=1) > 120).any(), t
    ticks = [t for t in meta["texts"] if t["text"].replace("\n", " ") in tick_labels]
    for i, a in enumerate(ticks):
        for b in ticks[i + 1:]:
            if a["rotation"] % 180 == 0 or a["rotation"] != b["rotation"]:
                assert not overlaps(a["box"], b["box"]), (a, b)
            else:  # two labels slanted alike: apart by more than a label's height, across their slant
                across = abs(a["box"][2] - b["box"][2]) * abs(math.sin(math.radians(a["rotation"])))
                lines = max(a["text"].count("\n"), b["text"].count("\n")) + 1
                assert across >= a["size_px"] * 1.15 * lines, (a, b)
    return meta


@pytest.mark.parametrize("n", [1, 2, 5, 12, 30])
@pytest.mark.parametrize("datasets", [1, 3])
def test_bars_are_legible_and_uncut_at_any_number_of_bars(n, datasets):
    groups = [f"condition {i} with a long name" if i % 3 == 0 else f"c{i}" for i in range(n)]
    rng = np.random.default_rng(n)
    series = {}
    for d in range(datasets):
        points = []
        for i in range(n):
            v = float(rng.uniform(-60, 90))
            points.append((math.nan, math.nan, math.nan, "n/m") if i == 1 else (v, v - 5, v + 5, ""))
        series[f"dataset {d}"] = points
    title = "AFR blind on a dataset with a long name: before/after with 95% CIs, per condition and system"
    meta = check_legible(png_bytes(estimate_bars(groups, series, title, "%")), [g for g in groups])
    shown = [t["text"] for t in meta["texts"]]
    assert shown.count("n/m") == (datasets if n > 1 else 0)  # a not-meaningful bar is marked, not drawn as 0
    assert meta["width"] <= 9.6 * PAGE_DPI  # a narrow window shows it at >= 70% of its size


def _comparison(conditions: list[str], datasets: list[str]) -> dict:
    rows = []
    for k, c in enumerate(conditions):
        for j, d in enumerate(datasets):
            dds = math.nan if (k, j) == (1, 0) else 44.0 - 20 * k + j
            rows.append({"condition": c, "dataset": d, "dds": dds, "meaningful": (k, j) != (1, 0),
                         "dds_ci_low": dds - 3, "dds_ci_high": dds + 3, "c2_avg": 80.0, "c2_avg_ci_low": 78.0,
                         "c2_avg_ci_high": 82.0})
    return {"table": pd.DataFrame(rows), "conditions": conditions}


@pytest.mark.parametrize("n_conditions, n_datasets", [(2, 1), (5, 12)])
def test_heatmap_numbers_contrast_with_their_cells(tmp_path, n_conditions, n_datasets):
    from flipguard.pipeline.compare import plot_before_after, plot_heatmap

    names = ["Baseline", "Be Honest", "Dehumanizing", "SFT", "DPO"][:n_conditions]
    datasets = [f"dataset_{i}" for i in range(n_datasets - 1)] + ["total_avg"]
    cmp = _comparison(names, datasets)
    plot_heatmap(cmp, tmp_path / "heatmap.png")
    meta = check_legible((tmp_path / "heatmap.png").read_bytes(), names)
    on_cells = [t for t in meta["texts"] if "on" in t]
    assert len(on_cells) == n_conditions * n_datasets - 1  # every measured cell numbered
    dark = [t for t in on_cells if luminance(t["on"]) < 0.18]
    assert dark and all(t["color"] == "#ffffff" for t in dark)  # +44 on dark red: white, not black
    assert [t["text"] for t in meta["texts"]].count("n/m") == 1
    plot_before_after(cmp, tmp_path / "before_after.png")
    meta = check_legible((tmp_path / "before_after.png").read_bytes(), names)
    # the bars are total_avg's: n/m for Be Honest where its one not-meaningful cell is total_avg's
    assert [t["text"] for t in meta["texts"]].count("n/m") == (1 if datasets[0] == "total_avg" else 0)
