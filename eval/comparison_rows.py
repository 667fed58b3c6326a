"""One run's numbers for the comparison, the transfer report and the page: each protocol
supplies its own (`Task.comparison_rows`, `Task.transfer_units`); these read them once per run
and state of its files and shape comparison_protocols.csv's long rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from flipguard.errors import UserError
from flipguard.eval.estimate import Estimate
from flipguard.eval.records import RECORDS_FILE, RUN_META_FILE, load_run_meta
from flipguard.eval.task import Task
from flipguard.eval.task_registry import get_task

# meaningful False: too few valid judgments (eval/estimate.py); value and CI are empty then
PROTOCOL_COLUMNS = ["condition", "protocol", "system", "dataset", "metric", "value", "ci_low", "ci_high", "n",
                    "meaningful"]


def named_runs(values: str | Sequence[str], what: str = "--runs") -> list[tuple[str | None, str]]:
    """`[Name=]RUN_DIR` entries (compare's --runs, cross-model's) -> (NAME or None, RUN_DIR), in order.
    An entry of several Name=RUN_DIR separated by commas (the `--runs "A=x,B=y"` form of before) is
    split; a NAME holds no '/' (so a folder with '=' in its path is a RUN_DIR)."""
    out: list[tuple[str | None, str]] = []
    for value in [values] if isinstance(values, str) else values:
        parts = [p.strip() for p in str(value).split(",") if p.strip()]
        for entry in parts if len(parts) > 1 and all("=" in p for p in parts) else [str(value).strip()]:
            head, sep, tail = entry.partition("=")
            name, run = (head.strip(), tail.strip()) if sep and "/" not in head else ("", entry)
            if sep and "/" not in head and (not name or not run):
                raise UserError(f"{what}: expected [Name=]RUN_DIR, got {entry!r}")
            if not run:
                raise UserError(f"{what}: an empty entry; expected [Name=]RUN_DIR")
            out.append((name or None, run))
    return out


def split_system(spec: str) -> tuple[str, str | None]:
    """'RUN_DIR@System name' -> (RUN_DIR, 'System name'): one run may hold several systems."""
    run_dir, sep, system = spec.partition("@")
    return run_dir, (system.strip() or None) if sep else None


_RUN_NUMBERS: dict[tuple, list[dict[str, Any]]] = {}


def run_numbers(task: type[Task], hook: str, run_dir: Path) -> list[dict[str, Any]]:
    """`task.<hook>(run_dir)` (comparison_rows or transfer_units), computed once per run and state of
    its files: a run that holds several systems is named once per system (`RUN_DIR@system`) by the
    comparison, the transfer report and the page, and each would otherwise read and bootstrap the
    whole run again. A copy of each row: callers may change theirs."""
    stamp = tuple((st.st_size, st.st_mtime_ns) if (st := _stat(run_dir / f)) else None
                  for f in (RECORDS_FILE, RUN_META_FILE))
    if stamp[0] is None:  # no records (yet): nothing worth keeping
        return getattr(task, hook)(run_dir)
    key = (task.name, hook, str(run_dir.resolve()), stamp)
    if key not in _RUN_NUMBERS:
        if len(_RUN_NUMBERS) >= 64:  # a long-lived process (a notebook, the tests) reading many runs
            _RUN_NUMBERS.clear()
        _RUN_NUMBERS[key] = getattr(task, hook)(run_dir)
    return [dict(row) for row in _RUN_NUMBERS[key]]


def _stat(path: Path):
    try:
        return path.stat()
    except OSError:
        return None


def comparison_long_rows(condition: str, spec: str, protocol: str | None = None) -> list[dict[str, Any]]:
    """One run's rows of comparison_protocols.csv (PROTOCOL_COLUMNS + unit, n_valid, n_judged), values in % (pp for
    differences): its protocol (run.json) supplies them through Task.comparison_rows; `RUN_DIR@system`
    keeps one system of a run that holds several; `protocol`: the run's, where its run.json names none (a DDS run
    of the first format). The comparison and the viewer both read these."""
    run_dir, only = split_system(spec)
    task = get_task(protocol or load_run_meta(run_dir).get("protocol") or "")
    rows = []
    for row in run_numbers(task, "comparison_rows", Path(run_dir)):
        if only and row["system"] != only:
            continue
        est = row["estimate"]
        if est.missing:  # not measured (no item of that kind): no row, never a zero
            continue
        est = est.to("pp" if est.unit == "pp" else "%")
        rows.append({"condition": condition, "protocol": task.name, "system": row["system"],
                     "dataset": row["dataset"], "metric": row["metric"], "value": est.value,
                     "ci_low": est.lo, "ci_high": est.hi, "n": est.n, "meaningful": est.meaningful,
                     "unit": est.unit, "n_valid": est.n_valid, "n_judged": est.n_judged})
    return rows


def headline_table(run_dir: str | Path, protocol: str | None = None) -> str:
    """A run's numbers as text, the same kind of table for every protocol (what `flipguard report RUN` prints):
    a row per system, dataset and metric of its Task.comparison_rows, the value with its 95% CI (n/m where too
    few valid judgments are behind it) and n."""
    rows = comparison_long_rows("run", str(run_dir), protocol)
    if not rows:
        return "(no numbers: the run's protocol gives none)"
    cells = [("system", "dataset", "metric", "unit", "value [95% CI]", "n")]
    for r in rows:
        est = Estimate(r["value"], r["ci_low"], r["ci_high"], int(r["n"]), r["unit"], n_valid=r.get("n_valid"),
                       n_judged=r.get("n_judged"), meaningful=r.get("meaningful", True))
        cells.append((str(r["system"]), str(r["dataset"] or "–"), str(r["metric"]), str(r["unit"]),
                      est.format(signed=r["unit"] == "pp"), str(r["n"])))
    widths = [max(len(c[i]) for c in cells) for i in range(6)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) if i < 4 else c[i].rjust(widths[i]) for i in range(6)).rstrip()
                     for c in cells)
