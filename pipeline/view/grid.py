"""A recipe grid's section of its study's page (`flipguard study RECIPE --grid KEY=V1,V2`): the
removed-vs-damaged chart and the variant table that the study's `grid` stage wrote (pipeline/grid.py),
shown as they are: the chart's PNG embedded, the table's CSV cells as the file holds them.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from flipguard.pipeline.view.runs import csv_table

GRID_DIR = "grid"  # under the study folder: the variants' own folders, and the table and chart
GRID_STAGE = "grid"  # the study stage that writes them
VARIANTS_CSV, VARIANTS_MD, VARIANTS_PNG = "variants.csv", "variants.md", "variants.png"
CHART_NOTE = ("One point per trained model (a trainer at the grid values that reach it; a trainer no grid key reaches "
              "is trained once, for every variant). x = damage: the largest drop (pp) of what must stay (own C1 "
              "accuracy on true and on false claims; each protocol's guarded metrics: first answers, single-shot "
              "accuracy, correct switches), 0 when none dropped. y = removal: the mean drop (pp) of the planted "
              "behaviours measured (DDS towards 0, AFR blind, incorrect switches). A hollow point on an axis: that "
              "coordinate could not be measured (not meaningful, or not measured). Every number is the variant's "
              "comparison's (its compare folder, in the table).")

GRID_ANSWER = ("A recipe grid: each variant has its own comparison and page ({folder}/VARIANT/compare/view.html); "
               "the section below sets the trained models side by side.")


def grid_section(study: Path) -> dict[str, Any] | None:
    """{title, note, chart: {title, src}, table} of a study folder whose grid stage wrote its table, else None."""
    folder = study / GRID_DIR
    table, chart = folder / VARIANTS_CSV, folder / VARIANTS_PNG
    if not table.is_file():
        return None
    section: dict[str, Any] = {
        "title": "The variants: what each removed and what it damaged", "note": CHART_NOTE,
        "table": csv_table(table, "grid", "Variants", key=lambda r: f"{r['variant']}|{r['trainer']}",
                           note=f"{table} (the same as a table to read: {folder / VARIANTS_MD}). Levels before "
                                "and after with the after's 95% CI (comparison.csv, comparison_protocols.csv); "
                                "*.change: the paired change of a cell the trainer was not aimed at, with its 95% "
                                "CI (transfer.csv); *.cells_down: the targeted cells whose paired CI lies wholly "
                                "below 0. Flags as the comparison marks them: † over-correction, ‡ damage, § a "
                                "guarded metric more than 10 pp below the baseline's.")}
    if chart.is_file():
        section["chart"] = {"title": f"Removed vs damaged, per trained model ({chart})",
                            "src": "data:image/png;base64," + base64.b64encode(chart.read_bytes()).decode("ascii")}
    return section
