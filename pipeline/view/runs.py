"""What the page shows of one run directory: its provenance, its protocol's numbers, its report
tables and plots, and the items behind them. Protocol-specific pieces are one function per
protocol (VIEWS: DDS flips, AFR challenges, stick-or-switch conversations); any other task
(a user's own) gets its numbers through Task.comparison_rows and its records listed one by one.

Every number shown is read from what the protocol's report wrote (report/summary.csv,
flips.csv, the AFR / stick-or-switch CSVs) or from the protocol's Task hook, never recomputed.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Callable

from flipguard.errors import UserError
from flipguard.eval.afr.metrics import records_frame
from flipguard.eval.comparison_rows import comparison_long_rows
from flipguard.eval.dds.report import _resolve, report_problem, row_mark
from flipguard.eval.estimate import NOT_MEANINGFUL, Estimate
from flipguard.eval.records import REPORT_DIR, Record, load_records, load_run_meta, run_completeness
from flipguard.eval.sos.metrics import system_label
from flipguard.eval.task import Task
from flipguard.eval.task_registry import get_task
from flipguard.files import read_text

MAX_PLOT_BYTES = 3 * 1024 * 1024  # a larger PNG is named, not embedded
MAX_TABLE_ROWS = 500  # rows of a report CSV shown in full; longer ones are cut with a note
PROVENANCE_KEYS = ("protocol", "tool", "command", "git_commit", "model", "models", "backend", "mode", "template", "speakers",
                   "mitigation", "mitigations", "dataset", "datasets", "split", "data_root", "c1_from", "min_label_mass",
                   "generation", "created", "updated", "flipguard_version")


# ------------------------------------------------------------------ small shared pieces

def read_csv(path: Path) -> list[dict[str, str]]:
    """A report CSV as rows of strings (the text the report wrote); a missing file is a UserError naming it."""
    return list(csv.DictReader(io.StringIO(read_text(path, UserError, "report file"))))


def num(text: str | float | None) -> float:
    try:
        return float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def fmt(text: str | float | None, signed: bool = False, nd: int = 1) -> dict[str, Any] | str:
    """A numeric cell: shown rounded, its exact value (as the file wrote it) in data-value."""
    x = num(text)
    if math.isnan(x):
        return "–"
    return {"t": f"{x:+.{nd}f}" if signed else f"{x:.{nd}f}", "v": text, "c": "num"}


# a cell of a row whose numbers are not meaningful (its CSV's `meaningful` False: too few valid judgments, or a
# model that does not do the task): the mark, never '–' (not measured) or a 0.0
NM_CELL = {"t": NOT_MEANINGFUL, "c": "nm"}
# CSV columns that hold text (empty when there is nothing to say), not a number a not-meaningful row lacks
TEXT_COLUMNS = {"flags", "note", "kind", "system", "dataset", "stratum", "reading", "model", "condition", "cell"}


def meaningful(row: dict[str, str]) -> bool:
    """A report CSV row's `meaningful` (True where the file has no such column)."""
    return row.get("meaningful") not in ("False", "false", "0")


def ci(lo: str | float | None, hi: str | float | None) -> dict[str, str] | str:
    lo, hi = num(lo), num(hi)
    return "–" if math.isnan(lo) or math.isnan(hi) else {"t": f"[{lo:+.1f}, {hi:+.1f}]", "c": "num"}


def flags(row: dict[str, str]) -> dict[str, str]:
    """The report's marks of a CSV row: † over-correction, ‡ C1 damage (only where the file says True: a
    not-meaningful row's flags are empty, unknown, never set)."""
    return {"t": ("†" if row.get("over_correction") == "True" else "") + ("‡" if row.get("c1_damage") == "True" else ""),
            "c": "flag"}


# the flags' words, where a table has room for them (the terminal's before/after table)
FLAG_WORDS = {"†": "over-correction", "‡": "C1-damage", "§": "guarded-metric"}


def number_cell(row: dict[str, str], col: str, signed: bool = False, nd: int = 1) -> dict[str, Any] | str:
    """One number of a CSV row, as every table shows it, the page's and the terminal's: rounded (fmt); n/m
    where the row is not meaningful and the file left the number empty; '–' where it was not measured."""
    cell = fmt(row.get(col), signed, nd)
    return NM_CELL if cell == "–" and not meaningful(row) and col not in TEXT_COLUMNS else cell


def cell_text(cell: dict[str, Any] | str | None) -> str:
    """A cell's text (what the page shows in it, and the terminal prints)."""
    if cell is None:
        return "–"
    return cell if isinstance(cell, str) else str(cell["t"])


def count_cell(text: str | float | None) -> dict[str, Any] | str:
    """A count (invalid judgments): the integer, '–' where the file has none."""
    return fmt(text, nd=0)


def short(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value) if all(isinstance(v, str) for v in value) else ", ".join(map(short, value))
    if isinstance(value, dict):
        return ", ".join(f"{k}={short(v)}" for k, v in value.items())
    return "–" if value is None else str(value)


def provenance(meta: dict[str, Any], run_dir: Path) -> list[list[str]]:
    """run.json's who/what/when, known keys first, then the run's settings (scalars)."""
    rows = [["run directory", str(run_dir)]]
    rows += [[k, short(meta[k])] for k in PROVENANCE_KEYS if k in meta]
    settings = meta.get("settings") or {}
    rows += [[f"settings.{k}", short(v)] for k, v in settings.items() if k not in meta and not isinstance(v, dict)]
    for src in meta.get("sources") or []:  # an imported run: what each system came from (AFR's are model names)
        if not isinstance(src, dict):
            continue
        files = ", ".join(f"{f.get('path')} (sha256 {str(f.get('sha256'))[:12]})" for f in src.get("files") or [])
        rows.append([f"source: {src.get('label')}", f"{src.get('tool')} {src.get('tool_version') or ''}, model "
                                                    f"{src.get('model')}, {short(src.get('tasks'))}: {files}"])
    for label, c in (meta.get("computed") or {}).items():
        rows.append([f"computed ({label})", ", ".join(f"{k} {c[k]}" for k in ("backend", "dtype", "device") if c.get(k))])
    invocations = meta.get("invocations") or []
    if invocations:
        rows.append(["invocations", f"{len(invocations)} (last {invocations[-1].get('time', '?')}, "
                                    f"{invocations[-1].get('calls_total', '?')} model calls)"])
    return rows


def csv_table(path: Path, table_id: str, title: str, key: Callable[[dict[str, str]], str] | None = None,
              note: str = "") -> dict[str, Any]:
    """A report CSV shown as the report wrote it (cells are its text)."""
    rows = read_csv(path)
    columns = list(rows[0]) if rows else []
    if len(rows) > MAX_TABLE_ROWS:
        note = (note + " " if note else "") + f"First {MAX_TABLE_ROWS} of {len(rows)} rows ({path.name} has all)."
        rows = rows[:MAX_TABLE_ROWS]
    return {"id": table_id, "title": title, "note": note or str(path), "columns": [[c, c] for c in columns],
            "rows": [{"key": key(r) if key else str(i), "cells": {
                c: NM_CELL if not meaningful(r) and not v and c not in TEXT_COLUMNS else csv_cell(v)
                for c, v in r.items()}} for i, r in enumerate(rows)]}


def csv_cell(text: str | None) -> dict[str, str] | str | None:
    """A CSV value: a number with decimals shown to 4 significant digits (the file's text in data-value)."""
    x = num(text)
    if text is None or math.isnan(x) or "." not in text and "e" not in text.lower():
        return text
    return {"t": f"{x:.4g}", "v": text, "c": "num"}


def plots(folder: Path) -> list[dict[str, str]]:
    """The PNG figures a report wrote in `folder`, inlined as data: URIs."""
    out = []
    for png in sorted(folder.glob("*.png")):
        data = png.read_bytes()
        if len(data) <= MAX_PLOT_BYTES and data[:8] == b"\x89PNG\r\n\x1a\n":
            out.append({"title": png.name, "src": "data:image/png;base64," + base64.b64encode(data).decode("ascii")})
    return out


def _p(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


def record_panel(title: str, r: Record | None) -> dict[str, Any]:
    """One judgment: the messages sent, the raw reply and what was parsed from it."""
    if r is None:
        return {"title": title, "facts": [["record", "not found (its run directory moved?)"]], "messages": []}
    facts = [["case", r.case], ["expected", r.expected or "–"], ["choice", r.choice if r.valid else "invalid" + (f" ({r.choice})" if r.choice else "")]]
    if r.p1 is not None or r.p2 is not None:
        facts += [['P("1")', _p(r.p1)], ['P("2")', _p(r.p2)]]
    probs = (r.extra or {}).get("probs")
    if isinstance(probs, dict) and probs:
        facts.append(["P(labels)", ", ".join(f"{k} {_p(v)}" for k, v in probs.items())])
    if r.label_mass is not None:
        facts.append(["label mass", _p(r.label_mass)])
    if r.reasoning and r.reasoning != r.raw_output:
        facts.append(["reasoning", r.reasoning])
    facts += [["model", r.model], ["mode", r.mode], ["mitigation", r.mitigation]]
    return {"title": title, "facts": facts, "messages": [[m.get("role", "?"), str(m.get("content", ""))] for m in r.messages or []],
            "reply": r.raw_output}


def invalid_entries(records: list[Record], condition: str = "") -> list[dict[str, Any]]:
    """Every invalid judgment, with its label mass and raw reply."""
    out = []
    for r in records:
        if r.valid:
            continue
        mass = r.label_mass
        why = f"label mass {mass:.4g}" if mass is not None else "reply not parsed"
        out.append({"id": f"invalid-{r.key}", "type": "invalid", "dataset": r.dataset, "case": r.case, "condition": condition,
                    "item": r.item_id, "summary": f"invalid {r.case}: {why}", "panels": [record_panel(r.case, r)]})
    return out


# ------------------------------------------------------------------ DDS

NM_NOTE = ("n/m = not meaningful: more than half of a case's judgments invalid (the DDS cell says how many were "
           "valid), or a model that does not do the task; the report's CSVs leave its numbers empty.")


def _dds_tables(run_dir: Path) -> list[dict[str, Any]]:
    report = run_dir / "report"
    summary = report / "summary.csv"
    if not summary.is_file():
        raise UserError(f"{summary}: not found; write the run's report first (flipguard report {run_dir})")
    stats: dict[str, dict[str, str]] = {}
    for r in read_csv(report / "stats.csv") if (report / "stats.csv").is_file() else []:
        if r.get("stratum") in (None, "", "all"):  # a dataset's own row (r/AIO also has OR/NOR strata)
            stats.setdefault(r["dataset"], r)
    columns = [["dataset", "dataset"], ["n", "n"], ["c1_true", "C1 true"], ["c1_false", "C1 false"],
               ["c2_correct", "C2 correct"], ["c2_incorrect", "C2 incorrect"], ["delta_correct", "Δ correct"],
               ["delta_incorrect", "Δ incorrect"], ["dds", "DDS"], ["dds_ci", "95% CI"], ["own_dds", "own DDS"],
               ["invalid_judgments", "invalid"], ["median_label_mass", "median label mass"], ["flags", "flags"]]
    rows = []
    for r in read_csv(summary):
        s = stats.get(r["dataset"]) or {}
        cells = {"dataset": r["dataset"], "n": r["n"], **{c: fmt(r[c]) for c in ("c1_true", "c1_false", "c2_correct", "c2_incorrect")},
                 "delta_correct": fmt(r["delta_correct"], True), "delta_incorrect": fmt(r["delta_incorrect"], True),
                 "dds": fmt(r["dds"], True), "dds_ci": ci(r["dds_ci_low"], r["dds_ci_high"]),
                 "own_dds": fmt(s.get("own_dds"), True), "invalid_judgments": s.get("invalid_judgments", "–"),
                 "median_label_mass": fmt(s.get("median_label_mass"), nd=3), "flags": flags(s)}
        if not meaningful(r):  # the numbers the report left empty: marked, with the counts behind the mark
            cells.update({c: NM_CELL for c in ("c1_true", "c1_false", "c2_correct", "c2_incorrect", "delta_correct",
                                               "delta_incorrect", "own_dds") if cells[c] == "–"},
                         dds={"t": row_mark(s) if s else NOT_MEANINGFUL, "c": "nm"}, dds_ci=NM_CELL)
        rows.append({"key": r["dataset"], "cells": cells})
    meta = (json.loads(read_text(report / "summary.json", UserError, "report file")) if (report / "summary.json").is_file()
            else {}).get("meta") or {}
    notes = [meta[k] for k in ("capability_note", "c1_mode_note", "c1_differs_note", "aio_note") if meta.get(k)]
    tables = [{"id": "headline", "title": "DDS per dataset (%, DDS in pp)",
               "note": "\n".join(["From report/summary.csv (and stats.csv for own DDS, invalid judgments and label mass). "
                                   "DDS = Δ correct − Δ incorrect; † DDS turned negative against the baseline's "
                                   "(over-correction); ‡ own C1 accuracy down > 5 pp (C1 damage).", *notes,
                                   *([NM_NOTE] if any(c["cells"]["dds"] is not None and isinstance(c["cells"]["dds"], dict)
                                                      and c["cells"]["dds"].get("c") == "nm" for c in rows) else [])]),
               "columns": columns, "rows": rows}]
    if (report / "flips_summary.csv").is_file():
        tables.append(csv_table(report / "flips_summary.csv", "flips-summary", "Flips per dataset (paper Tables 25/26)",
                                key=lambda r: r["dataset"],
                                note="report/flips_summary.csv: deference = C1-false right → C2-incorrect wrong; "
                                     "skepticism = C1-true right → C2-correct wrong; flip_rate in % of items."))
    return tables


def _dds_baseline_records(run_dir: Path, meta: dict[str, Any]) -> list[Record]:
    """The C1 baseline's records (run.json c1_from, found as the report finds it); none when it moved."""
    if not meta.get("c1_from"):
        return []
    base = _resolve(str(meta["c1_from"]), run_dir)
    return load_records(base) if (base / "records.jsonl").is_file() else []


def dds_view(run_dir: Path, meta: dict[str, Any], records: list[Record]) -> dict[str, Any]:
    """DDS: summary.csv with CIs and flags, and every item whose judgment changed C1 → C2 (report/flips.csv),
    both prompts and replies side by side."""
    tables = _dds_tables(run_dir)
    by_key = {r.key: r for r in _dds_baseline_records(run_dir, meta)}
    by_key.update((r.key, r) for r in records)
    condition = meta.get("mitigation") or ""
    entries = []
    flips_csv = run_dir / "report" / "flips.csv"
    for row in read_csv(flips_csv) if flips_csv.is_file() else []:
        if not row.get("transition"):
            continue
        kind = row["flip"] or row["transition"]
        c1, c2 = by_key.get(row["c1_key"]), by_key.get(row["c2_key"])
        summary = (f"{kind}: {row['c1_case']} {row['c1_choice'] or '–'} ({'right' if row['c1_correct'] == 'True' else 'wrong'}) → "
                   f"{row['c2_case']} {row['c2_choice'] or '–'} ({'right' if row['c2_correct'] == 'True' else 'wrong'})")
        entries.append({"id": f"flip-{row['c2_key']}", "type": kind, "dataset": row["dataset"], "case": row["c2_case"],
                        "condition": condition, "item": row["item_id"], "summary": summary, "diff": True,
                        "panels": [record_panel(f"C1: {row['c1_case']}", c1), record_panel(f"C2: {row['c2_case']}", c2)]})
    rank = {"deference": 0, "skepticism": 1}
    entries.sort(key=lambda e: rank.get(e["type"], 2))  # the paper's flips first, then other changes
    entries += invalid_entries(records, condition)
    return {"tables": tables, "plots": plots(run_dir / "report"), "entries": entries,
            "entries_title": "Flips and invalid judgments",
            "entries_note": "Flips as report/flips.csv lists them (deference, skepticism; wrong_to_right changes too), "
                            "then every invalid judgment. Click a row: both prompts and replies side by side, "
                            "the text that differs highlighted."}


# ------------------------------------------------------------------ AFR

def afr_view(run_dir: Path, meta: dict[str, Any], records: list[Record]) -> dict[str, Any]:
    """AFR: every challenge transcript (the first answer, the argument, the answer after it)."""
    frame = records_frame(records).set_index("key")
    first = {(r.item_id, r.model): r for r in records if r.case == "baseline"}
    entries = []
    for r in records:
        if r.case != "challenge":
            continue
        e = r.extra or {}
        flipped = frame.loc[r.key, "flipped"] if r.key in frame.index else None
        kind = "invalid" if not r.valid else ("flipped" if flipped else "held")
        base = first.get((r.item_id, r.model))
        summary = (f"{kind}: first answer {base.choice if base else '?'} (correct {r.expected}), argued for "
                   f"{e.get('target_option', '?')} by {e.get('source_model', '?')} (k={e.get('k')}) → {r.choice or 'invalid'}")
        entries.append({"id": f"challenge-{r.key}", "type": kind, "dataset": r.dataset, "case": e.get("condition") or r.case,
                        "condition": r.model, "item": r.item_id, "summary": summary,
                        "panels": [record_panel("challenge transcript", r)]})
    entries += [e for e in invalid_entries([r for r in records if r.case != "challenge"])]
    return {"entries": entries, "entries_title": "Challenges",
            "entries_note": "Each challenge: the question, the model's first answer, the argument for a wrong option "
                            "and the answer after it (flipped = no longer correct). Case = blind / self / cross."}


# ------------------------------------------------------------------ stick-or-switch

def sos_view(run_dir: Path, meta: dict[str, Any], records: list[Record]) -> dict[str, Any]:
    """Stick-or-switch: each conversation turn by turn (the last turn's messages hold the whole chat)."""
    chats: dict[tuple, list[Record]] = {}
    for r in records:
        e = r.extra or {}
        # a chat's turns share the case's scenario part ("positive/t1", "positive/t2"); each baseline is its own
        key = (r.item_id, r.model, r.mitigation, r.case.split("/")[0], e.get("repeat"), e.get("branch"))
        chats.setdefault(key, []).append(r)
    entries = []
    for (item, model, mitigation, scenario, repeat, branch), turns in chats.items():
        turns.sort(key=lambda r: (r.extra or {}).get("turn") or 0)
        last = turns[-1]
        steps = "; ".join(f"turn {(t.extra or {}).get('turn', '?')}: {t.choice if t.valid else 'invalid'}" for t in turns)
        target = (last.extra or {}).get("target") or last.expected
        kind = "invalid" if not last.valid else ("held" if last.choice == target else "switched")
        panel = record_panel(f"{scenario}: last turn ({len(turns)} judged)", last)
        panel["facts"] = [["turns", steps], ["target", str(target)], ["offered", short((last.extra or {}).get("offered"))],
                          *panel["facts"]]
        entries.append({"id": f"chat-{last.key}", "type": kind, "dataset": last.dataset, "case": scenario,
                        "condition": system_label(model, mitigation), "item": item,  # as the sos report names it
                        "summary": f"{scenario}{' (' + branch + ')' if branch else ''}{' repeat ' + str(repeat) if repeat else ''}: "
                                   f"{steps}", "panels": [panel]})
    return {"entries": entries, "entries_title": "Conversations",
            "entries_note": "One row per conversation (scenario, model, mitigation): the turns' answers; click for the "
                            "whole chat turn by turn and the last reply."}


def generic_view(run_dir: Path, meta: dict[str, Any], records: list[Record]) -> dict[str, Any]:
    """Any other task: every record, one row each, named by its system (Task.system_of: the name its
    comparison rows use, so a comparison's RUN_DIR@system finds them)."""
    try:
        system_of = get_task(meta.get("protocol") or "").system_of
    except UserError:  # a user's task this process does not know (not --include'd): the default naming
        system_of = Task.system_of
    entries = [{"id": f"record-{r.key}", "type": "valid" if r.valid else "invalid", "dataset": r.dataset, "case": r.case,
                "condition": system_of(r), "item": r.item_id, "summary": f"{r.case}: {r.choice if r.valid else 'invalid'}",
                "panels": [record_panel(r.case, r)]} for r in records]
    return {"entries": entries, "entries_title": "Records"}


def _scores_text(r: Record) -> str:
    return ", ".join(f"{k} {'–' if v is None else f'{v:g}'}" for k, v in ((r.extra or {}).get("scores") or {}).items())


def sample_panel(title: str, r: Record) -> dict[str, Any]:
    """An imported sample: the record's panel with its scores (0-1, and as the tool kept them), the scorers'
    explanations and the sample's metadata."""
    panel = record_panel(title, r)
    e = r.extra or {}
    facts = [["scores", _scores_text(r) or "–"], ["as logged", short(e.get("score_values"))]]
    facts += [[f"explanation ({k})", str(v)] for k, v in (e.get("explanations") or {}).items()]
    facts += [["metadata", short(e.get("metadata") or e.get("doc"))], ["error", e["error"]] if e.get("error") else None]
    panel["facts"] = [f for f in facts if f] + panel["facts"]
    return panel


def imported_view(run_dir: Path, meta: dict[str, Any], records: list[Record]) -> dict[str, Any]:
    """Runs another tool made (flipguard import): every sample with its scores, named by its system."""
    entries = []
    for r in records:
        values = [v for v in ((r.extra or {}).get("scores") or {}).values() if v is not None]
        kind = ("error" if not r.valid else "unscored" if not values else "all 1" if min(values) == 1
                else "all 0" if max(values) == 0 else "mixed")
        entries.append({"id": f"sample-{r.key}", "type": kind, "dataset": r.dataset, "case": r.case,
                        "condition": r.model, "item": r.item_id,
                        "summary": f"sample {r.item_id} ({r.case}): {_scores_text(r) or 'no score'}; answer {r.choice!r}",
                        "panels": [sample_panel(r.case, r)]})
    return {"entries": entries, "entries_title": "Samples",
            "entries_note": "Every sample of every system (condition = the system): its scores mapped to 0-1, click for "
                            "the prompt, the reply, the scores as the tool logged them and the sample's metadata."}


def changed_samples(runs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """For a comparison of imported runs ('condition', 'RUN_DIR@system'): each sample whose score differs from
    the baseline's (the first condition of its protocol) on the same sample, both sides side by side."""
    by_condition: dict[str, tuple[str, dict[tuple[str, str], Record]]] = {}
    for name, spec in runs:
        run_dir, _, system = spec.partition("@")
        if not (Path(run_dir) / "run.json").is_file():
            continue
        protocol = load_run_meta(run_dir).get("protocol") or ""
        if VIEWS.get(protocol) is not imported_view:
            continue
        by_condition[name] = (protocol, {(r.dataset, str((r.extra or {}).get("unit", r.item_id))): r
                                         for r in load_records(run_dir) if not system or r.model == system})
    entries = []
    baselines: dict[str, str] = {}
    for name, (protocol, samples) in by_condition.items():
        base_name = baselines.setdefault(protocol, name)
        if base_name == name:
            continue
        base = by_condition[base_name][1]
        for key, r in samples.items():
            b = base.get(key)
            if b is None:
                continue
            now, before = (r.extra or {}).get("scores") or {}, (b.extra or {}).get("scores") or {}
            moved = {k: (before.get(k), v) for k, v in now.items() if k in before and before[k] != v}
            if not moved:
                continue
            up = sum((v or 0) - (u or 0) for u, v in moved.values())
            kind = "better" if up > 0 else "worse" if up < 0 else "changed"
            entries.append({"id": f"{kind}-{name}-{r.key}", "protocol": protocol, "type": kind, "dataset": r.dataset,
                            "case": r.case, "condition": name, "item": r.item_id, "diff": True,
                            "summary": f"{kind} in {name}: sample {r.item_id} " + ", ".join(
                                f"{k} {'–' if u is None else f'{u:g}'} → {'–' if v is None else f'{v:g}'}"
                                for k, (u, v) in moved.items()),
                            "panels": [sample_panel(f"{base_name}: {b.case}", b), sample_panel(f"{name}: {r.case}", r)]})
    return entries


VIEWS: dict[str, Callable[[Path, dict[str, Any], list[Record]], dict[str, Any]]] = {
    "dds": dds_view, "afr": afr_view, "sos": sos_view, "inspect": imported_view, "lm-eval": imported_view}


def protocol_entries(runs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The items of the other protocols' runs of a comparison ('condition', 'RUN_DIR[@system]'): their
    challenges or conversations, named by condition (@system keeps that system's only)."""
    out, loaded = [], {}
    for name, spec in runs:
        run_dir, _, system = spec.partition("@")
        if run_dir not in loaded:
            path = Path(run_dir)
            if not (path / "run.json").is_file():
                loaded[run_dir] = []
                continue
            meta = load_run_meta(path)
            protocol = meta.get("protocol") or "?"
            loaded[run_dir] = [{**e, "protocol": protocol} for e in
                               VIEWS.get(protocol, generic_view)(path, meta, load_records(path))["entries"]]
        out += [{**e, "id": f"{name}-{e['id']}", "condition": name} for e in loaded[run_dir]
                if not system or e["condition"] == system]
    return out


def task_table(protocol: str, run_dir: Path) -> dict[str, Any] | None:
    """The protocol's headline numbers with CIs: the rows compare takes from its Task (comparison_rows);
    None for a task this process does not know (a user's, not --include'd) or one without such rows."""
    try:
        task = get_task(protocol)
        long_rows = comparison_long_rows("run", str(run_dir))
    except UserError:
        return None
    def value(r: dict[str, Any]) -> dict[str, Any]:
        est = Estimate(r["value"], r["ci_low"], r["ci_high"], int(r["n"]), r["unit"], n_valid=r.get("n_valid"),
                       n_judged=r.get("n_judged"), meaningful=r.get("meaningful", True))
        if not est.meaningful:
            return {"t": est.format(), "c": "nm"}  # n/m (0 of 12 valid)
        return {"t": est.format(signed=r["unit"] == "pp"), "v": r["value"], "c": "num"}

    rows = [{"key": f"{r['system']}|{r['dataset']}|{r['metric']}", "cells": {
        "system": r["system"], "dataset": r["dataset"] or "–", "metric": r["metric"], "n": str(r["n"]),
        "value": value(r)}} for r in long_rows]
    if not rows:
        return None
    return {"id": "headline", "title": task.comparison_title or f"{protocol} numbers", "note": task.comparison_note,
            "columns": [["system", "system"], ["dataset", "dataset"], ["metric", "metric"], ["value", "value [95% CI]"], ["n", "n"]],
            "rows": rows}


def run_view(run_dir: Path) -> dict[str, Any]:
    """The page data of one run directory of any protocol."""
    meta = load_run_meta(run_dir)
    protocol = meta.get("protocol") or "?"
    records = load_records(run_dir)
    view = VIEWS.get(protocol, generic_view)(run_dir, meta, records)
    tables = view.pop("tables", None)
    # what the run's report wrote: RUN/report/, else (a run written before every protocol reported there) its root
    report = run_dir / REPORT_DIR if any((run_dir / REPORT_DIR).glob("*")) else run_dir
    if tables is None:  # AFR, stick-or-switch, a user's task: the Task's numbers, then every CSV its report wrote
        head = task_table(protocol, run_dir)
        tables = ([head] if head else []) + [csv_table(p, f"csv-{p.stem}", p.name) for p in sorted(report.glob("*.csv"))]
    view.setdefault("plots", plots(report))
    model = meta.get("model") or ", ".join(map(short, meta.get("targets") or meta.get("models") or [])) or "?"
    state = run_completeness(run_dir)
    if not state.whole:  # the page still shows what is there, every table marked: no unmarked number
        tables = [{**t, "title": f"{t['title']} — {state.describe()}"} for t in tables]
        if view.get("entries_title"):
            view["entries_title"] += f" — {state.describe()}"
    elif protocol == "dds" and (stale := report_problem(run_dir)):  # its report's tables describe other records
        tables = [{**t, "title": f"{t['title']} — {stale}"} for t in tables]
    return {"title": f"flipguard {protocol} run: {model}",
            "subtitle": f"{run_dir} · {len(records)} records" + ("" if state.whole else f" · {state.describe()}"),
            "provenance": provenance(meta, run_dir), "tables": tables,
            "filters": [["type", "type"], ["dataset", "dataset"], ["case", "case"], ["condition", "condition"]], **view}
