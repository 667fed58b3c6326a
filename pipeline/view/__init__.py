"""`flipguard view PATH`: one self-contained HTML page for a run directory (any protocol), a
comparison folder or a study folder, so the items behind a number can be looked at.

The page needs no network (style, script, data and plots are inside it) and opens from disk in
any browser. `flipguard compare` writes it as view.html beside comparison.md, `flipguard study`
as view.html in the study folder. A comparison's or a study's page opens with the answer (a chart per
protocol, a sentence per mitigation: pipeline/view/answer.py), then the tables, plots and items,
provenance and a study's stages last. Layout: pipeline/view/runs.py builds a run's data (one function
per protocol), this module a comparison's and a study's, pipeline/view/page.py the HTML.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flipguard.config import parse_dataclasses
from flipguard.errors import UserError
from flipguard.eval.comparison_rows import split_system
from flipguard.eval.records import C2_CASES, RUN_META_FILE, Record, load_records, refuse_busy, run_completeness
from flipguard.eval.task_includes import take_includes
from flipguard.files import atomic_write_text, check_replace, owns, read_json
from flipguard.organism.ground_truth import page_table
from flipguard.pipeline.fingerprints import stage_runs_problem
from flipguard.pipeline.view.answer import answer_section
from flipguard.pipeline.view.grid import GRID_STAGE, current_stage, grid_answer, grid_section, stale_inputs
from flipguard.pipeline.view.page import PAGE_HEAD, render_html
from flipguard.pipeline.view.runs import (
    NM_CELL,
    changed_samples,
    ci,
    count_cell,
    csv_table,
    flags,
    fmt,
    meaningful,
    num,
    number_cell,
    plots,
    protocol_entries,
    read_csv,
    record_panel,
    run_view,
    short,
)
from flipguard.train.utils import PROVENANCE_FILE
from flipguard.train.validation import CURVE_JSON, CURVE_PNG, check_name

VIEW_FILE = "view.html"


# ------------------------------------------------------------------ comparison

def _comparison_table(path: Path) -> dict[str, Any]:
    """comparison.csv as the before/after table, with † / ‡ flags."""
    columns = [["condition", "condition"], ["dataset", "dataset"], ["n", "n"], ["c1_true", "C1 true (baseline's)"],
               ["c1_false", "C1 false (baseline's)"], ["own_c1_true", "own C1 true"], ["own_c1_false", "own C1 false"],
               ["c2_correct", "C2 correct"], ["c2_incorrect", "C2 incorrect"], ["dds", "DDS paper"], ["dds_ci", "95% CI"],
               ["own_dds", "own DDS"], ["delta_dds", "Δ DDS"], ["invalid_judgments", "invalid"], ["flags", "flags"]]
    rows = []
    for r in read_csv(path):
        # number_cell: the terminal's table (pipeline/study.py) shows the same cells; n/m where comparison.csv
        # left a not-meaningful row's numbers empty, never '–' or 0.0
        cells = {"condition": r["condition"], "dataset": r["dataset"], "n": f"{num(r['n']):.0f}",
                 **{c: number_cell(r, c) for c in ("c1_true", "c1_false", "own_c1_true", "own_c1_false", "c2_correct",
                                                   "c2_incorrect")},
                 "dds": number_cell(r, "dds", True), "dds_ci": ci(r.get("dds_ci_low"), r.get("dds_ci_high")),
                 "own_dds": number_cell(r, "own_dds", True), "delta_dds": number_cell(r, "delta_dds", True),
                 "invalid_judgments": count_cell(r.get("invalid_judgments")), "flags": flags(r)}
        if not meaningful(r) and cells["dds_ci"] == "–":
            cells["dds_ci"] = NM_CELL
        rows.append({"key": f"{r['condition']}|{r['dataset']}", "cells": cells})
    return {"id": "comparison", "title": "Before/after: DDS (%, DDS in pp)", "columns": columns, "rows": rows,
            "note": "From comparison.csv (the terminal's before/after table shows its all-datasets rows, own C1 as C1). "
                    "DDS paper = the condition's C2 against the baseline's C1; own DDS = against its own C1. "
                    "† over-correction (DDS turned negative); ‡ C1 damage (own C1 accuracy down > 5 pp). "
                    "n/m = not meaningful (comparison.csv: meaningful False): more than half of a case's judgments "
                    "invalid, or a model that does not do the task."}


def _c2_by_item(run_dir: str) -> dict[tuple[str, str, str], Record]:
    return {(r.item_id, r.dataset, r.case): r for r in load_records(run_dir) if r.protocol == "dds" and r.case in C2_CASES}


def fixed_and_broken(runs: dict[str, str]) -> list[dict[str, Any]]:
    """Per condition, the C2 judgments it changed against the baseline's on the same item and case:
    fixed (baseline wrong, condition right) and broken (baseline right, condition wrong), as
    compare's McNemar counts (significance.csv: better / worse) count them."""
    names = list(runs)
    if len(names) < 2 or not all((Path(d) / "records.jsonl").is_file() for d in runs.values()):
        return []
    base = _c2_by_item(runs[names[0]])
    entries = []
    for name in names[1:]:
        for key, r in _c2_by_item(runs[name]).items():
            b = base.get(key)
            if b is None or b.correct == r.correct:
                continue
            kind = "fixed" if r.correct else "broken"
            entries.append({"id": f"{kind}-{name}-{r.key}", "protocol": "dds", "type": kind, "dataset": r.dataset, "case": r.case, "condition": name,
                            "item": r.item_id, "summary": f"{kind} by {name}: {r.case} {b.choice or 'invalid'} → {r.choice or 'invalid'} "
                                                          f"(expected {r.expected})", "diff": True,
                            "panels": [record_panel(f"{names[0]}: {b.case}", b), record_panel(f"{name}: {r.case}", r)]})
    return entries


def comparison_view(folder: Path) -> dict[str, Any]:
    """A comparison folder: the answer (pipeline/view/answer.py: a chart per protocol, a sentence
    per mitigation), the before/after table with flags, the protocols' table, plots, the items each
    condition fixed or broke, and provenance last."""
    data = read_json(folder / "comparison.json", UserError, "comparison") if (folder / "comparison.json").is_file() else {}
    # a comparison of other protocols' runs alone (imported runs) has no DDS table
    tables = [_comparison_table(folder / "comparison.csv")] if data.get("runs") or not data else []
    known = page_table(folder)  # a model with known ground truth (organism.json): planted / measured / after, first
    if known is not None:
        tables.insert(0, known)
    if (folder / "comparison_protocols.csv").is_file():
        tables.append(csv_table(folder / "comparison_protocols.csv", "protocols", "Before/after: other protocols",
                                key=lambda r: "|".join(r[k] for k in ("condition", "protocol", "system", "dataset", "metric")),
                                note="comparison_protocols.csv: values in % (pp for differences) with 95% CIs."))
    if (folder / "transfer.csv").is_file():
        tables.append(csv_table(folder / "transfer.csv", "transfer", "Transfer and side effects: change vs baseline per cell",
                                key=lambda r: f"{r['condition']}|{r['cell']}",
                                note="transfer.csv (transfer.md: the same as a table per protocol with a summary per "
                                     "condition). role: trained-on / held-out / cross-protocol / untargeted; change in pp "
                                     "with a paired 95% CI (items resampled); mcnemar_p: exact McNemar of the 0/1 "
                                     "judgments; † over-correction, ‡ damage. test: the p corrected across the cells "
                                     "(McNemar where every unit is 0/1, else the bootstrap's), p_adjusted (Holm or "
                                     "Benjamini-Hochberg: transfer.md), mdd: the minimal detectable difference (pp) at "
                                     "the cell's n, verdict: changed / no change / too few items to tell."))
    if (folder / "significance.csv").is_file():
        tables.append(csv_table(folder / "significance.csv", "significance", "McNemar: C2 judgments against the baseline's",
                                key=lambda r: f"{r['condition']}|{r['dataset']}"))
    runs = data.get("runs") or {}
    protocol_runs = data.get("protocol_runs") or []
    entries = fixed_and_broken(runs) + changed_samples(protocol_runs) + protocol_entries(protocol_runs)
    # the tables were computed from whole runs (compare refuses any other); the items below are read now
    broken = [f"{d}: {st.describe()}" for d in dict.fromkeys([*runs.values(), *(split_system(spec)[0] for _, spec in
                                                                                protocol_runs)])
              if (Path(d) / RUN_META_FILE).is_file() and not (st := run_completeness(d)).whole]
    return {"title": f"flipguard comparison: {', '.join(data.get('conditions') or runs)}", "subtitle": str(folder),
            "answer": answer_section(folder, list(data.get("conditions") or runs), runs),
            "provenance": [["comparison folder", str(folder)], *[[f"run: {n}", d] for n, d in runs.items()],
                           *[["not whole now", b] for b in broken]],
            "tables": tables, "plots": plots(folder), "entries": entries,
            "entries_title": "Items fixed and broken by each condition" + (
                f" — read from runs not whole now: {'; '.join(broken)}" if broken else ""),
            "entries_note": "DDS: C2 judgments whose correctness differs from the baseline's on the same item and case "
                            "(click a row for both prompts and replies); imported runs: samples whose score differs from "
                            "the baseline's (better / worse); then the other protocols' challenges, conversations and "
                            "samples, condition = the system they measured.",
            "filters": [["protocol", "protocol"], ["type", "type"], ["dataset", "dataset"], ["case", "case"],
                        ["condition", "condition"]]}


# ------------------------------------------------------------------ study

def training_curves(folder: Path, stages: dict[str, Any]) -> tuple[dict[str, Any] | None, list[dict[str, str]]]:
    """With validation on (train/validation.py): a row per trainer (its budget, the step it kept and why,
    what the slice measured there) and its curve (removal and guards against steps, the chosen step
    marked), read from each trainer stage's run folder."""
    rows, curves = [], []
    for name, entry in stages.items():
        adapter = next((Path(o).parent for o in (entry or {}).get("outputs") or () if Path(o).name == PROVENANCE_FILE), None)
        if adapter is None or not (adapter / CURVE_JSON).is_file():
            continue
        info = read_json(adapter / CURVE_JSON, UserError, "validation curve")
        chosen = info.get("chosen") or {}
        missed = [f"{check_name(c)} {c['measured']}" for c in chosen.get("checks") or () if not c["passed"]]
        rows.append({"key": name, "cells": {
            "trainer": name, "budget": fmt(info.get("budget")), "chosen": fmt(chosen.get("step")),
            "last": fmt(info.get("last_step")), "met": "yes" if chosen.get("met") else "no",
            "why": chosen.get("why", "–"), "missed": "; ".join(missed) or "–",
            "rule": (info.get("settings") or {}).get("rule", "–")}})
        curves += [{**p, "title": f"{name}: validation curve ({adapter / CURVE_PNG})"} for p in plots(adapter)
                   if p["title"] == CURVE_PNG]
    if not rows:
        return None, []
    table = {"id": "validation", "title": "Training: the checkpoint each trainer kept (validation slice)",
             "note": "validation: on (train/validation.py): each trainer measured a slice of the train split held back "
                     "from the pairs every validation.every steps and kept the first checkpoint where the rule held "
                     "(at validation.confirm measurements in a row; else the one validation.keep names); the merge "
                     "took it. Its curve is among the plots.",
             "columns": [[c, c] for c in ("trainer", "budget", "chosen", "last", "met", "why", "missed", "rule")],
             "rows": rows}
    return table, curves


def study_view(folder: Path) -> dict[str, Any]:
    """A study folder: its comparison's page (the answer first), then provenance and every stage with
    its status and time last."""
    state = read_json(folder / "study.json", UserError, "study state")
    stages = state.get("stages") or {}
    for entry in stages.values():  # the page reads a study no process holds (refuse_busy): a stage still
        if isinstance(entry, dict) and entry.get("status") == "running":  # "running" was stopped with it (killed)
            entry["status"] = "interrupted"
    order = state.get("order") or list(stages)
    # a done stage whose run was cut short (or replaced) since: marked, as the study would resume (or refuse) it
    problems = {n: p for n in order if (stages.get(n) or {}).get("status") == "done"
                and (p := stage_runs_problem(stages[n], folder))}
    rows = [{"key": n, "cells": {"stage": n, "status": {"incomplete": "incomplete", "other": "another run"}[problems[n][0]]
                                 if n in problems else (stages.get(n) or {}).get("status", "not run"),
                                 "action": (stages.get(n) or {}).get("last_action", "–"),
                                 "seconds": fmt((stages.get(n) or {}).get("seconds")),
                                 "finished": (stages.get(n) or {}).get("finished", "–")}} for n in order]
    stage_table = {"id": "stages", "title": "Stages", "note": "\n".join([str(folder / "study.json"),
                                                                         *(p[1] for p in problems.values())]),
                   "columns": [[c, c] for c in ("stage", "status", "action", "seconds", "finished")], "rows": rows}
    compare = (stages.get("compare") or {}).get("status", "not run")
    view: dict[str, Any] = {"entries": None, "plots": [], "tables": [], "answer": {
        "title": "The answer", "charts": [], "verdicts": [],
        "notes": [f"No answer yet: the study's comparison ({folder / 'compare'}) has not been written (compare stage: "
                  f"{compare}). The stages' state is at the end of this page."]}}
    written = (folder / "compare" / "comparison.csv").is_file() or (folder / "compare" / "comparison.json").is_file()
    if "compare" in order and written:  # this study's comparison (a grid's are its variants'), never another run's
        view = comparison_view(folder / "compare")
        if not current_stage(stages, "compare"):  # older than a stage it summarises: said first, before its numbers
            redone = stale_inputs(stages, "compare")
            view["answer"] = {**view["answer"], "notes": [
                f"This comparison ({folder / 'compare'}) is older than the stages it summarises (compare stage: "
                f"{compare}{'; redone since: ' + ', '.join(redone) if redone else ''}): rerun the study to bring it "
                "up to date.", *view["answer"].get("notes", [])]}
    trained, curves = training_curves(folder, stages)
    if trained is not None:
        view = {**view, "tables": [*view.get("tables", []), trained], "plots": [*curves, *view.get("plots", [])]}
    # a recipe grid: an answer line per trained model and its variants side by side (pipeline/view/grid.py)
    if GRID_STAGE in order:
        view = {**view, "answer": grid_answer(folder, stages), "grid": grid_section(folder)}
        if view["grid"] is None:
            del view["grid"]
    # what the answer does not cover yet: stages not done, or done stages whose runs changed since
    unfinished = [f"{n} ({problems[n][1] if n in problems else (stages.get(n) or {}).get('status', 'not run')})"
                  for n in order if n in problems or (stages.get(n) or {}).get("status") != "done"]
    answer = dict(view["answer"])
    if unfinished:
        answer["notes"] = [f"Study not finished: {'; '.join(unfinished)}. The answer is what {folder / 'compare'} holds "
                           "now.", *answer.get("notes", [])]
    return {**view, "title": f"flipguard study: {state.get('model', '?')}", "subtitle": str(folder), "answer": answer,
            "provenance": [["study folder", str(folder)], ["recipe", short(state.get("recipe"))], ["model", short(state.get("model"))],
                           ["updated", short(state.get("updated"))]] + (view.get("provenance") or [])[1:],
            "tail_tables": [stage_table]}


# ------------------------------------------------------------------ entry points

def build_view(path: str | Path) -> dict[str, Any]:
    """The page data for PATH: a run directory (run.json), a comparison folder or a study folder."""
    path = Path(path)
    if (path / "study.json").is_file():
        return study_view(path)
    if (path / "comparison.csv").is_file() or (path / "comparison.json").is_file():
        return comparison_view(path)
    if (path / RUN_META_FILE).is_file():
        return run_view(path)
    raise UserError(f"{path}: not a run directory (no {RUN_META_FILE}), comparison folder (no comparison.json) "
                    "or study folder (no study.json)")


def earlier_page(path: Path) -> bool:
    """A page an earlier flipguard recorded in its folder's manifest by name only (before a
    file's kind was recorded), recognised by the head render_html writes: it may be replaced
    by a page. A file the manifest does not list is never adopted (a page the user saved)."""
    if not owns(path.parent, path.name):
        return False
    with open(path, "rb") as fh:
        return fh.read(len(PAGE_HEAD)) == PAGE_HEAD


def check_page(out: str | Path) -> None:
    """The page's path, before any work: new, or a page flipguard wrote (of its kind: never a
    run.json, a study.json, a report table or a model's file that happens to be there)."""
    check_replace(out, kind=VIEW_FILE, adopt=earlier_page)


def write_view(path: str | Path, out: str | Path | None = None, compress: bool | None = None) -> Path:
    """Write the page for PATH (default PATH/view.html) atomically, as a page (the manifest
    records its kind: only a page replaces it, and it replaces only a page); returns where."""
    out = Path(out) if out else Path(path) / VIEW_FILE
    atomic_write_text(out, render_html(build_view(path), compress=compress), kind=VIEW_FILE, adopt=earlier_page)
    return out


@dataclasses.dataclass
class ViewArgs:
    """One self-contained HTML page (no network) for a run directory, comparison folder or study folder."""

    path: str = dataclasses.field(metadata={"help": "A run directory (any protocol), a comparison folder or a study folder."})
    out: str | None = dataclasses.field(default=None, metadata={"help": "Where to write the page (default PATH/view.html)."})
    compress: str = dataclasses.field(default="auto", metadata={
        "help": "Embed the data gzipped: auto (when over 256 kB), always or never.", "choices": ["auto", "always", "never"]})


def main(argv: list[str]) -> int:
    argv = take_includes(argv)  # a user's task (--include my_tasks.py): its numbers and naming, as compare shows them
    args = parse_dataclasses(argv, ViewArgs, prog="flipguard view", description=ViewArgs.__doc__,
                             positional="path")
    # before any work: the folder is not being written, the page replaces nothing but an earlier page
    refuse_busy(args.path, "viewed")
    check_page(Path(args.out) if args.out else Path(args.path) / VIEW_FILE)
    out = write_view(args.path, args.out, compress={"auto": None, "always": True, "never": False}[args.compress])
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} kB): open it in a browser (file://{out.resolve()})")
    if (Path(args.path) / RUN_META_FILE).is_file() and not (state := run_completeness(args.path)).whole:
        print(f"{args.path}: {state.describe()}: every table of the page is marked so")
    return 0
