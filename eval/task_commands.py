"""The commands of every registered task: `flipguard run NAME` and `flipguard report RUN_DIR`,
and the command line a run records in run.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

from flipguard.config import parse_dataclasses
from flipguard.errors import UserError
from flipguard.eval.comparison_rows import headline_table
from flipguard.eval.records import RUN_META_FILE, load_run_meta, require_whole
from flipguard.eval.task import ReportArgs
from flipguard.eval.task_includes import include_tasks, take_includes
from flipguard.eval.task_registry import ENTRY_POINT_GROUP, get_task, task_names
from flipguard.redact import redact_obj


def command_line(*names: str) -> list[str] | None:
    """The command as typed (redacted) when this process runs `flipguard NAME` for one of
    `names` (a task's own command, and "run"), for run.json; None when the task runs inside
    another command (the study, an analysis)."""
    return redact_obj(["flipguard", *sys.argv[1:]]) if sys.argv[1:2] and sys.argv[1] in names else None


def report_main(argv: list[str]) -> int:
    """`flipguard [--include FILE] report RUN_DIR`: the report of a run of any registered task (run.json's
    protocol; a run without one is DDS, as records of the first format were), then the same kind of table
    for every protocol: its numbers with their CIs (comparison_rows.headline_table)."""
    argv = take_includes(argv)
    args = parse_dataclasses(argv, ReportArgs, prog="flipguard report", description=ReportArgs.__doc__,
                             positional="run_dir")
    run_dir = Path(args.run_dir)
    protocol = load_run_meta(run_dir).get("protocol") or "dds"
    if (run_dir / RUN_META_FILE).is_file():  # the completeness rule compare, export and the page read too
        require_whole(run_dir)
    for flag, value in (("--c1_from", args.c1_from), ("--allow_cross_mode_c1", args.allow_cross_mode_c1)):
        if value and protocol != "dds":
            raise UserError(f"{flag}: an option of DDS reports; {run_dir} holds a {protocol!r} run")
    path = get_task(protocol).rebuild_report(run_dir, args)
    print(f"{protocol} run {run_dir}:\n{headline_table(run_dir, protocol)}\nreport: {path}")
    return 0


def run_main(argv: list[str]) -> int:
    """`flipguard run [--include FILE ...] NAME [task options]`: any registered task."""
    includes = []
    while len(argv) >= 2 and argv[0] == "--include":
        includes.append(argv[1])
        argv = argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        for path in includes:
            include_tasks(path)
        names = [n for n in task_names() if get_task(n).runnable]
        print("usage: flipguard run [--include my_tasks.py] TASK [options]   (flipguard run TASK --help)\n\n"
              "Run a registered task (protocol) into a run directory: records.jsonl, run.json, report.\n"
              "--include imports a Python file whose @register_task classes become runnable; installed\n"
              f"packages register through the '{ENTRY_POINT_GROUP}' entry point group.\n\ntasks: {', '.join(names)}")
        raise SystemExit(0)  # as argparse's --help does for every other command
    for path in includes:
        include_tasks(path)
    name, rest = argv[0], argv[1:]
    task = get_task(name)
    if not task.runnable:
        raise UserError(f"task {name!r} is not run by flipguard: its runs are read in (flipguard import {name} --help)")
    return int(task.main(rest, prog=f"flipguard run {name}") or 0)
