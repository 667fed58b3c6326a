"""`flipguard import inspect LOG...` and `flipguard import lm-eval DIR...`: runs another tool made, as
one flipguard run folder that `flipguard compare` pairs and `flipguard view` shows.

Each run (an inspect_ai log; one model's lm-eval results) becomes a system of the folder, named by
its model or by the LABEL of LABEL=PATH; its samples become records (eval/interop/runs.py). Runs of
one task must hold the same items (ids, task version, prompts, targets): a mismatch is refused in
one line naming what differs, and nothing is written. Everything is read and checked before the
first record is written; importing the same run again adds nothing.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from flipguard.config import parse_dataclasses, positionals_as
from flipguard.errors import UserError
from flipguard.eval.interop.inspect_log import read_inspect_logs
from flipguard.eval.interop.lm_eval_log import read_lm_eval_output
from flipguard.eval.interop.runs import ImportedRun, refuse_incomplete, split_label, write_imported
from flipguard.eval.records import RECORDS_FILE, run_completeness


@dataclasses.dataclass
class InspectImportArgs:
    """Read inspect_ai eval logs (.eval or .json, through inspect_ai's own read_eval_log) into one flipguard
    run folder, each log a system named by its model or by LABEL (LABEL=LOG, or LABEL=FOLDER holding one log). Every sample (each epoch)
    becomes a record: id, prompt, target, reply, each scorer's score (mapped to 0-1: C 1, I 0, P 0.5, N 0,
    numbers as they are), the scorer's answer and explanation, the sample's metadata; run.json records
    each log's file, sha256, task, model and inspect_ai version. Logs of one task must hold the same
    samples (ids, task version, prompts, targets), else nothing is imported. Then compare them:
    flipguard compare --runs 'A=RUN@LABEL_A,B=RUN@LABEL_B' (paired changes, McNemar, Holm, MDD)."""

    logs: list[str] = dataclasses.field(metadata={"help": "inspect_ai logs (or folders of them, as inspect_ai lists them), "
                                                          "each PATH or LABEL=PATH (LABEL: its system's name, for a "
                                                          "PATH holding one log; default the log's model). Also given as "
                                                          "the first arguments, without --logs."})
    out: str = dataclasses.field(metadata={"help": "The run folder to write (created; or one flipguard import wrote, "
                                                   "for more runs of the same items)."})
    allow_incomplete: bool = dataclasses.field(default=False, metadata={
        "help": "Import a run that did not finish (an inspect_ai log whose status is not success or whose samples "
                "ended in errors; lm-eval samples files lacking documents its results counted): refused without "
                "this; with it, run.json says complete: false and why, `flipguard view` marks every table, and "
                "compare refuses to compute from it."})


@dataclasses.dataclass
class LmEvalImportArgs:
    """Read lm-evaluation-harness --log_samples output (results_<date>.json and samples_<task>_<date>.jsonl,
    as `lm_eval --log_samples --output_path DIR` writes them) into one flipguard run folder, each run (one
    model's results file) a system named by its model or by LABEL (LABEL=PATH, PATH holding one run). Every
    sample line becomes a record: doc_id, prompt, target, answer (the most likely choice, or the filtered
    reply), each per-sample metric (those in 0-1 are compared; `metric,filter` past the `none` filter), the
    doc; run.json records the files with their sha256, tasks and versions, model and lm-eval version.
    Runs of one task must hold the same documents (lm-eval's doc, prompt and target hashes, task version,
    n-shot), else nothing is imported. Then: flipguard compare --runs 'A=RUN@LABEL_A,B=RUN@LABEL_B'."""

    dirs: list[str] = dataclasses.field(metadata={"help": "lm_eval --output_path folders, model folders or results files, "
                                                          "each PATH or LABEL=PATH (a PATH holding one run). Also given "
                                                          "as the first arguments, without --dirs."})
    out: str = dataclasses.field(metadata={"help": "The run folder to write (created; or one flipguard import wrote, "
                                                   "for more runs of the same items)."})
    allow_incomplete: bool = dataclasses.field(default=False, metadata={
        "help": "Import a run that did not finish (an inspect_ai log whose status is not success or whose samples "
                "ended in errors; lm-eval samples files lacking documents its results counted): refused without "
                "this; with it, run.json says complete: false and why, `flipguard view` marks every table, and "
                "compare refuses to compute from it."})


def _inspect_runs(args: InspectImportArgs) -> list[ImportedRun]:
    return [run for label, path in map(split_label, args.logs) for run in read_inspect_logs(path, label)]


def _lm_eval_runs(args: LmEvalImportArgs) -> list[ImportedRun]:
    return [run for label, path in map(split_label, args.dirs) for run in read_lm_eval_output(path, label)]


# tool -> (its arguments, the positional list field, the reader)
TOOLS = {"inspect": (InspectImportArgs, "logs", _inspect_runs), "lm-eval": (LmEvalImportArgs, "dirs", _lm_eval_runs)}


def import_runs(tool: str, argv: list[str]) -> tuple[list[ImportedRun], dict, Path]:
    args_class, positional, read = TOOLS[tool]
    args = parse_dataclasses(positionals_as(argv, positional), args_class, prog=f"flipguard import {tool}",
                             description=args_class.__doc__, positional=positional)
    runs = read(args)
    refuse_incomplete(runs, args.allow_incomplete)
    return runs, write_imported(runs, args.out), Path(args.out)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: flipguard import {inspect,lm-eval} [LABEL=]PATH ... --out RUN   (flipguard import TOOL --help)\n\n"
              "Read runs another tool made into one flipguard run folder, each run a system of it, so that "
              "`flipguard compare`\npairs them (paired change with a bootstrap CI, McNemar, Holm or Benjamini-Hochberg, "
              "the minimal detectable\ndifference) and `flipguard view` shows every sample:\n"
              "  inspect   inspect_ai eval logs (.eval, .json)\n"
              "  lm-eval   lm-evaluation-harness --log_samples output (results_*.json + samples_*.jsonl)")
        raise SystemExit(0)  # as argparse's --help does for every other command
    tool, rest = argv[0], list(argv[1:])
    if tool not in TOOLS:
        raise UserError(f"flipguard import {tool}: unknown tool; one of {', '.join(TOOLS)}")
    runs, result, out = import_runs(tool, rest)
    for run in runs:
        tasks = ", ".join(f"{t} (version {v})" for t, v in run.tasks.items())
        scores = sorted({s for r in run.records for s in r.extra.get("scores") or {}})
        print(f"{run.label}: {run.model}, {tasks}: {len(run.records)} samples from {run.files[0]}; "
              f"scores compared: {', '.join(scores) or 'none'}"
              + (f"; not compared: {', '.join(f'{k} ({why})' for k, why in run.not_compared.items())}"
                 if run.not_compared else "") + (f"; INCOMPLETE: {run.incomplete}" if run.incomplete else ""))
    print(f"imported {len(runs)} run(s) into {out / RECORDS_FILE}: {result['records']} records ({result['added']} new)")
    state = run_completeness(out)
    if not state.whole:
        print(f"{out}: {state.describe()}: run.json says complete: false; compare refuses it, view marks it")
    if len(runs) >= 2:
        spec = ",".join(f"{label}={out}@{label}" for label in result["runs"])
        print(f"compare them: flipguard compare --runs {shlex.quote(spec)} --out {shlex.quote(str(out) + '-compare')}")
    return 0
