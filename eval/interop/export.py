"""`flipguard export --format inspect RUN`: a flipguard run as inspect_ai eval logs, one per system of the
run (a DDS run holds one; an AFR run one per model), so that `inspect view` and inspect_ai's
`read_eval_log` open it: every record a sample (prompt, reply, target, a `correct` score with the
choice as its answer, the record's fields and extra as metadata), the model, the run's settings as
the task's metadata, and the protocol's own numbers with their CIs (DDS, AFR rates, ...) in the
results beside the accuracy. Built from inspect_ai's log types (eval/interop/inspect_log.py) and
written by its writer into a temp file that is renamed into place (the ownership rule, files.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from pathlib import Path

from flipguard.config import parse_dataclasses, positionals_as
from flipguard.errors import FlipguardError, UserError
from flipguard.eval.comparison_rows import comparison_long_rows
from flipguard.eval.interop.inspect_log import inspect_log, require_inspect, write_log
from flipguard.eval.records import (
    RUN_META_FILE,
    StaleReport,
    load_records,
    load_run_meta,
    refuse_busy,
    run_completeness,
)
from flipguard.eval.task_registry import get_task
from flipguard.files import check_outputs, check_own_folder, owned_replace, refuse_link

FORMATS = ("inspect",)
EXPORT_DIR = "inspect"  # the default --out: RUN/inspect


def log_name(protocol: str, system: str) -> str:
    """The file of one system's log: <protocol>_<system>.eval, the system's name made a file name."""
    return f"{protocol}_{re.sub(r'[^A-Za-z0-9._-]+', '-', system).strip('-') or 'model'}.eval"


def export_inspect(run_dir: str | Path, out: str | Path) -> list[tuple[Path, int, str]]:
    """Write one inspect_ai log per system of the run (Task.system_of) into `out`, every record in one of
    them; returns (path, samples, note) per log. A run that is not whole (records.run_completeness: its
    last invocation stopped, or its records.jsonl falls short of what run.json lists) is written with
    status "started" and without its protocol's numbers.
    Checked before any work: a run folder (run.json), not being written, of a run flipguard made (an
    imported run came from its tool: its own log is the original), and `out` holds nothing of anyone
    else's where a log goes."""
    require_inspect()
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / RUN_META_FILE).is_file():
        raise UserError(f"{run_dir}: not a run folder (no {RUN_META_FILE})")
    refuse_busy(run_dir, "exported")
    meta = load_run_meta(run_dir)
    task = get_task(meta.get("protocol") or "")
    if not task.runnable:
        sources = ", ".join(f for s in meta.get("sources") or [] for f in [s.get("files", [{}])[0].get("path", "?")])
        raise UserError(f"{run_dir}: an imported {task.name} run; its original logs are {sources}")
    records = load_records(run_dir)
    state = run_completeness(run_dir)  # a run that did not finish (or was cut short) is exported as "started"
    systems: dict[str, list] = {}
    for r in records:
        systems.setdefault(task.system_of(r), []).append(r)
    names: dict[str, str] = {}
    for system in systems:  # each system named once: two whose names read alike as a file get a number
        name, n = log_name(task.name, system), 1
        while name in names.values():
            n += 1
            name = f"{log_name(task.name, system)[:-len('.eval')]}-{n}.eval"
        names[system] = name
    check_own_folder(out)
    check_outputs(out, names.values())
    written = []
    for system, recs in systems.items():
        if not state.whole:  # no number is computed from an incomplete run: its samples go out, marked
            headline, note = [], f"status started: {state.describe()}; without the {task.name} numbers"
        else:
            try:
                headline, note = comparison_long_rows(system, f"{run_dir}@{system}"), ""
            except StaleReport:  # a report older than its records: never exported as the run's numbers
                raise
            except FlipguardError as exc:  # a DDS run without its report: the samples and accuracy still go out
                headline, note = [], f"without the {task.name} numbers ({exc})"
        log = inspect_log(recs, protocol=task.name, system=system, meta=meta, headline=headline,
                          location=str(run_dir.resolve()), complete=state.whole)
        path = out / names[system]
        out.mkdir(parents=True, exist_ok=True)
        refuse_link(out)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".eval", dir=out)
        os.close(fd)
        try:
            write_log(log, Path(tmp))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        owned_replace(Path(tmp), path)
        written.append((path, len(recs), note))
    return written


@dataclasses.dataclass
class ExportArgs:
    """Write a flipguard run (DDS, AFR, stick-or-switch, or a task of your own) as inspect_ai eval logs,
    one per system of the run (<protocol>_<system>.eval), that `inspect view` and inspect_ai's
    read_eval_log open: every record a sample with its prompt, reply, target and a `correct` score
    (C/I, the choice as its answer), the record's fields as metadata, the model, the run's settings as
    the task's metadata, and the protocol's numbers with their 95% CIs in the results. Needs inspect_ai
    (pip install 'flipguard[interop]')."""

    run: str = dataclasses.field(metadata={"help": "The run folder to export (run.json and records.jsonl)."})
    format: str = dataclasses.field(default="inspect", metadata={"help": "The log format: inspect (inspect_ai's .eval).",
                                                                 "choices": list(FORMATS)})
    out: str | None = dataclasses.field(default=None, metadata={"help": f"The folder the logs go to (default "
                                                                        f"RUN/{EXPORT_DIR})."})


def main(argv: list[str]) -> int:
    args = parse_dataclasses(positionals_as(argv, "run"), ExportArgs, prog="flipguard export",
                             description=ExportArgs.__doc__, positional="run")
    out = Path(args.out) if args.out else Path(args.run) / EXPORT_DIR
    for path, n, note in export_inspect(args.run, out):
        print(f"wrote {path} ({n} samples{'; ' + note if note else ''}): inspect view --log-dir {path.parent}")
    return 0
