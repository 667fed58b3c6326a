"""A recipe grid's part of its study's page and terminal (`flipguard study RECIPE --grid KEY=V1,V2`): the
answer, one line per trained model with its trainer and grid values named (each the verdict its own
variant's comparison gives, pipeline/view/answer.py); the removed-vs-damaged chart the `grid` stage
drew; and the variant table, its cells made here once for variants.md, the page and the terminal
(`variant_table`), from variants.csv's text (pipeline/grid.py writes it).

A variant's comparison is shown only while it is current: its compare stage done and built from its
inputs as they are now (study.json), never one older than the stages it summarises.
"""

from __future__ import annotations

import base64
import math
from pathlib import Path
from typing import Any

from flipguard.errors import UserError
from flipguard.files import read_json
from flipguard.pipeline.view.answer import PROTOCOL_NAMES, answer_section, change, level
from flipguard.pipeline.view.runs import num, read_csv

GRID_DIR = "grid"  # under the study folder: the variants' own folders, and the table and chart
GRID_STAGE = "grid"  # the study stage that writes them
VARIANTS_CSV, VARIANTS_MD, VARIANTS_PNG = "variants.csv", "variants.md", "variants.png"
CHART_NOTE = ("One point per trained model (a trainer at the grid values that reach it; a trainer no grid key reaches "
              "is trained once, for every variant). x = damage: the largest drop (pp) of what must stay (own C1 "
              "accuracy on true and on false claims; each protocol's guarded metrics: first answers, single-shot "
              "accuracy, correct switches), 0 when none dropped. y = removal: the mean drop (pp) of the planted "
              "behaviours measured (DDS towards 0, AFR blind, incorrect switches). Models at the same point share "
              "one label ('1, 2'). A hollow point on an axis: that coordinate could not be measured (not meaningful, "
              "or not measured). Every number is the variant's comparison's (its compare folder, in variants.csv).")
TABLE_NOTE = ("A row per trained model (a trainer no grid key reaches is trained once, for every variant). Levels: "
              "before → after [95% CI of after] (%; DDS in pp; n/m: not meaningful or not measured). Targeted cells "
              "down: of the cells the pairs targeted (transfer.csv), those whose paired 95% CI lies wholly below 0. "
              "Paired Δ (transfer.csv): pp [95% CI]. removal: the mean drop (pp) of the planted behaviours (DDS "
              "towards 0); damage: the largest drop (pp) of what must stay. † over-correction, ‡ damage, § a guarded "
              "metric more than 10 pp below the baseline's (as the comparison marks them). chosen step (budget): with "
              "validation on, the step whose checkpoint the trainer kept and merged, of its max_steps budget "
              "(train/validation.py).")
EVERY_VARIANT = "(every variant)"  # a trained model no grid key reaches: one for all variants


# ------------------------------------------------------------------ the table

def _num(row: dict[str, Any], key: str, spec: str = ".1f") -> str:
    v = num(row.get(key))
    return "–" if math.isnan(v) else format(v, spec)


def _level(row: dict[str, Any], col: str, unit: str) -> str:
    """'before → after [CI of after]'; n/m for a side without a number."""
    if f"{col}.after" not in row:
        return "–"
    before = num(row[f"{col}.before"])
    spec = "+.1f" if unit == "pp" else ".1f"
    after = level(num(row[f"{col}.after"]), num(row.get(f"{col}.ci_low")), num(row.get(f"{col}.ci_high")), unit)
    return (format(before, spec) if before == before else "n/m") + " → " + after.replace("not measured", "n/m")


def _label(stem: str) -> str:
    """A level's column as a header: 'DDS (pp)', 'AFR afr_blind', 'stick-or-switch correct_switch (organism_mc)'."""
    if stem == "dds":
        return "DDS (pp)"
    protocol, _, metric = stem.partition(".")
    metric, _, dataset = metric.partition("@")
    return f"{PROTOCOL_NAMES.get(protocol, protocol)} {metric}" + (f" ({dataset})" if dataset else "")


def variant_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(headers, a row of cell texts per trained model) of variants.csv's rows (text or numbers): what it
    removed (levels before → after), then what it damaged; variants.md, the page and the terminal show these."""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    levels = list(dict.fromkeys(c[: -len(".after")] for c in cols if c.endswith(".after")))
    # model_row writes a protocol's headline (what it removed) before its guarded metrics
    headline: dict[str, str] = {}
    for stem in levels:
        headline.setdefault(stem.partition(".")[0], stem.partition("@")[0])
    removed = [s for s in levels if s.partition("@")[0] in headline.values()]
    kept = [s for s in levels if s not in removed]
    paired = list(dict.fromkeys(c[: -len(".change")] for c in cols if c.endswith(".change")))
    down = list(dict.fromkeys(c[: -len(".cells_down")] for c in cols if c.endswith(".cells_down")))
    head = ["variant", "trainer", "removal (pp)", "damage (pp)", *(f"removed: {_label(s)}" for s in removed),
            *(f"{PROTOCOL_NAMES.get(p, p)}: targeted cells down" for p in down), "kept: own C1 true / false (Δ)",
            *(f"kept: {_label(s)}" for s in kept), *(f"kept, paired Δ: {c}" for c in paired), "invalid (DDS)",
            "train loss", "chosen step (budget)", "flags"]
    body = []
    for r in rows:
        c1 = (f"{_num(r, 'own_c1_true')} / {_num(r, 'own_c1_false')} ({_num(r, 'c1_true_change', '+.1f')} / "
              f"{_num(r, 'c1_false_change', '+.1f')})") if "own_c1_true" in r else "–"
        flags = r.get("flags")
        body.append([str(r["variant"]), str(r["trainer"]), _num(r, "removal"), _num(r, "damage"),
                     *(_level(r, s, "pp" if s == "dds" else "%") for s in removed),
                     *(f"{_num(r, f'{p}.cells_down', '.0f')} of {_num(r, f'{p}.cells', '.0f')}" for p in down), c1,
                     *(_level(r, s, "%") for s in kept),
                     *(change(num(r[f"{c}.change"]), num(r.get(f"{c}.ci_low")), num(r.get(f"{c}.ci_high")))
                       if num(r.get(f"{c}.change")) == num(r.get(f"{c}.change")) else "–" for c in paired),
                     f"{_num(r, 'invalid_before', '.0f')} → {_num(r, 'invalid_after', '.0f')}",
                     _num(r, "train_loss", ".4f"),
                     f"{_num(r, 'chosen_step', '.0f')} ({_num(r, 'budget', '.0f')})"
                     if num(r.get("chosen_step")) == num(r.get("chosen_step")) else "– (no validation)",
                     flags if isinstance(flags, str) else ""])
    return head, body


def render_markdown(rows: list[dict[str, Any]], keys: list[str]) -> str:
    """variants.md: the variant table (variant_table) with its legend."""
    head, body = variant_table(rows)
    lines = [f"# Recipe grid: {', '.join(keys)}", "", TABLE_NOTE, "", "| " + " | ".join(head) + " |",
             "|---" * len(head) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    lines += ["", "Each row's numbers are its variant's comparison's (the compare column of variants.csv)."]
    return "\n".join(lines) + "\n"


def grid_table(path: Path) -> dict[str, Any]:
    """The page's variant table: variants.md's columns, its cells (the CSV's numbers one click away in the file)."""
    head, body = variant_table(read_csv(path))
    columns = [[f"c{i}", h] for i, h in enumerate(head)]
    return {"id": "grid", "title": "Variants", "columns": columns,
            "note": f"{TABLE_NOTE} The same table: {path.with_suffix('.md')}; every number with its CI bounds and the "
                    f"comparison it comes from: {path}.",
            "rows": [{"key": f"{cells[0]}|{cells[1]}", "cells": {f"c{i}": ({"t": c, "c": "flag"} if h == "flags" else c)
                                                                for i, (h, c) in enumerate(zip(head, cells))}}
                     for cells in body]}


# ------------------------------------------------------------------ the answer

def stale_inputs(stages: dict[str, Any], name: str) -> list[str]:
    """The input stages of a study stage that were redone (or are not done) since it was built, or that
    are themselves older than one of theirs (study.json): a trainer redone alone (`--only dpo`) makes
    the comparison stale through the merge and eval stages built from its earlier adapter."""
    entry = stages.get(name) or {}
    built_from = entry.get("built_from") or {}
    return [i for i in entry.get("inputs") or [] if (stages.get(i) or {}).get("status") != "done"
            or built_from.get(i) != (stages.get(i) or {}).get("build") or stale_inputs(stages, i)]


def current_stage(stages: dict[str, Any], name: str) -> bool:
    """Whether a study stage is done and built from its inputs as they are now (study.json): a comparison
    older than a stage it summarises (an input redone since) is not."""
    return (stages.get(name) or {}).get("status") == "done" and not stale_inputs(stages, name)


def variant_verdicts(study: Path, stages: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(the answer's verdicts, notes) of a grid: the prompting mitigations once (the first variant's comparison:
    every variant measures the same runs), then one line per trained model, named with its trainer and values,
    from its own variant's comparison; a comparison that is not current is said, not shown."""
    table = study / GRID_DIR / VARIANTS_CSV
    if not table.is_file():
        return [], [f"The grid's table ({table}) has not been written yet: its grid stage has not run."]
    rows = read_csv(table)
    trained = {r["trainer"] for r in rows}
    verdicts: list[dict[str, Any]] = []
    notes: list[str] = []
    prompting_done = False
    for row in rows:
        compare = Path(row["compare"])
        try:
            rel = compare.parent.relative_to(study)
        except ValueError:
            rel = None
        stage = f"{rel.parts[1]}:compare" if rel is not None and rel.parts[:1] == (GRID_DIR,) else "compare"
        named = row["trainer"] + ("" if row["variant"] == EVERY_VARIANT else f" ({row['variant']})")
        if not current_stage(stages, stage):
            notes.append(f"{named}: its comparison ({compare}) is older than the stages it summarises, or not "
                         f"written (stage {stage}: {(stages.get(stage) or {}).get('status', 'not run')}); rerun the "
                         "study to measure it.")
            continue
        data = read_json(compare / "comparison.json", UserError, "comparison")
        answer = answer_section(compare, list(data.get("conditions") or []), data.get("runs") or {}, charts=False)
        for v in answer["verdicts"]:
            if v["condition"] == row["trainer"] or (not prompting_done and v["condition"] not in trained):
                label = named if v["condition"] == row["trainer"] else v["condition"]
                verdicts.append({**v, "condition": label, "text": f"{label}: {v['target']}; {v['damage']}."})
        prompting_done = True
    return verdicts, notes


def grid_answer(study: Path, stages: dict[str, Any]) -> dict[str, Any]:
    """The study page's answer for a grid: a line per prompting mitigation, then per trained model."""
    verdicts, notes = variant_verdicts(study, stages)
    return {"title": "The answer, per variant", "charts": [], "verdicts": verdicts,
            "notes": [f"A recipe grid: each trained model against the one baseline, from its own variant's comparison "
                      f"({study / GRID_DIR}/VARIANT/compare, each with its page); the trained models side by side "
                      "below.", *notes],
            "note": "Each line: what the mitigation did to what it targets (before → after, 95% CI of after) and to "
                    "what it was not aimed at, as its variant's comparison page says (details one click away)."}


def grid_section(study: Path) -> dict[str, Any] | None:
    """{title, note, chart: {title, src}, table} of a study folder whose grid stage wrote its table, else None."""
    folder = study / GRID_DIR
    table, chart = folder / VARIANTS_CSV, folder / VARIANTS_PNG
    if not table.is_file():
        return None
    section: dict[str, Any] = {"title": "The variants: what each removed and what it damaged", "note": CHART_NOTE,
                               "table": grid_table(table)}
    if chart.is_file():
        section["chart"] = {"title": f"Removed vs damaged, per trained model ({chart})",
                            "src": "data:image/png;base64," + base64.b64encode(chart.read_bytes()).decode("ascii")}
    return section
