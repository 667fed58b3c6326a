"""A protocol is a registered `Task`; one runner (`run_task`) runs every task.

The shape of lm-evaluation-harness and inspect_ai: a task knows its items, builds the
requests (pending `Record`s) and reads the model's stored answers to decide what to ask
next (a multi-turn chat, a challenge built from an earlier argument); its metrics and
report read the records. The runner owns everything that is the same for every
protocol, so a new protocol is a class, not another stack:

- the models: one spec syntax `[label=][backend:]model[|adapter]` (`ModelSpec`), one
  backend pool that loads a model only when it has work and keeps one in memory;
- the run directory: claim + writer lock (`records.open_run_dir`), the refusal of a
  directory holding another condition, one run.json (common header, the task's
  settings, the invocations with the calls each made);
- resume: requests are content-keyed; a stored answer is never asked again, and a task
  sees stored and new answers alike, so a finished run reruns with zero calls and
  without loading a model;
- the context check: every request known before any output (`first_batches`) is
  checked against each model's context before run.json or a record is written.

Tasks are registered by name (`@register_task("dds")`); `flipguard run NAME` runs any of
them, including a user's (`--include my_tasks.py`, or a `flipguard.tasks` entry point).

Above the runner, a task brings its own part of the before/after pipeline, so the study
and compare name no protocol (as an lm-evaluation-harness task brings its metrics and
aggregation, and an inspect_ai `@task` returns a declarative Task): `study_run` describes
its stage in `flipguard study` (a `StudyRun` built from the study's `StudyContext`),
`comparison_rows` its rows in comparison_protocols.csv, `comparison_title`/`_note` its
section of comparison.md, `guarded_metrics` its flags, `system_of` how the page names
its records.

The parts, one module each: batches.py (`Batch` and its checks), backend_pool.py,
task_runner.py (`run_task`), task_registry.py (`register_task`, `get_task`), task_includes.py
(`--include FILE`), study_hooks.py (`StudyContext`, `StudyRun`), task_commands.py
(`flipguard run`, `flipguard report`), comparison_rows.py (one run's comparison rows) and
parallel.py (the data-parallel split and its merge of `computed`).
"""

from __future__ import annotations

import dataclasses
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Optional, Sequence

from flipguard.config import leading_config, parse_dataclasses
from flipguard.errors import UserError
from flipguard.eval.backends.base import ModelRef
from flipguard.eval.batches import Batch, Plan, _class_file
from flipguard.eval.mitigations import system_label
from flipguard.eval.parallel import is_writer
from flipguard.eval.records import Record, RunDir, content_digest
from flipguard.eval.study_hooks import StudyCondition, StudyContext, StudyRun
from flipguard.eval.task_registry import register_task
from flipguard.eval.task_runner import RunResult, run_task
from flipguard.runtime.threads import configure_threads

# what a task's file imports from here (examples/are_you_sure_task.py, docs/extending.md): the
# class, its requests, its registration, the runner and the study's hook, each defined in the
# module of its concern
__all__ = ["Batch", "Plan", "ReportArgs", "RunResult", "StudyCondition", "StudyContext", "StudyRun", "Task",
           "register_task", "run_task", "settings_folder"]


class Task:
    """One protocol. Subclasses set `name` and implement `first_batches`, `solve`, `meta`
    and `write_report`; `__init__` validates the settings (bad input is refused before a
    run directory is touched) and sets `self.models`."""

    name: ClassVar[str]
    # run.json keys a run directory holds exactly one value of; a rerun with another is refused
    condition_keys: ClassVar[tuple[str, ...]] = ()
    # run.json list keys that grow across invocations (models, mitigations added to a run)
    accumulate_keys: ClassVar[tuple[str, ...]] = ()
    # what the first requests are, for the progress line ("judgments", "first-turn requests")
    unit: ClassVar[str] = "requests"
    # False: the task's runs are made elsewhere and read in (`flipguard import`): compared and viewed,
    # never run (`flipguard run` neither lists nor runs it)
    runnable: ClassVar[bool] = True

    # the dataclass of the task's command-line flags / YAML keys (`flipguard run NAME --help`)
    args_class: ClassVar[type]

    models: list[ModelRef]

    # ------------------------------------------------------------ the command
    # One command for every task: `flipguard run NAME` and the built-ins' own `flipguard eval|afr|sos`
    # (pipeline/cli.py names `TaskClass.main`). A task declares what differs: `args_class` (its flags,
    # a YAML config first), `default_out`, `from_args`, and where it has them `report_only` and `after_run`.

    # args_class fields that change neither what a run asks nor what its report says: left out of
    # the settings' fingerprint that names a default run directory
    not_settings: ClassVar[tuple[str, ...]] = ("out", "threads", "progress", "report", "report_only")

    @classmethod
    def from_args(cls, args: Any, where: str = "command line") -> "Task":
        """The task of parsed flags; `where` names their source in errors (the config file, or the command line)."""
        return cls(args)

    @classmethod
    def default_out(cls, args: Any) -> Path:
        """The readable part of the default run directory (out_dir adds the settings' fingerprint)."""
        return Path("runs") / cls.name

    @classmethod
    def out_dir(cls, args: Any, where: str) -> Path:
        """The run directory: --out, else `default_out` named for the settings (settings_folder)."""
        if getattr(args, "out", None):
            return Path(args.out)
        return settings_folder(cls.default_out(args), cls.name, args, cls.not_settings)

    @classmethod
    def report_only(cls, args: Any, out: Path) -> Path | None:
        """When the flags ask for the report alone (no model): write it and return its path; else None."""
        return None

    def after_run(self, result: "RunResult") -> None:
        """A line of the task's own once the run is done (before the report); nothing by default."""

    @classmethod
    def rebuild_report(cls, run_dir: Path, args: "ReportArgs") -> Path:
        """`flipguard report RUN_DIR`: the run's report rebuilt from its records into RUN_DIR/report/, no
        model (args.n_boot, args.seed: None = the run's own); returns its main file."""
        raise UserError(f"{run_dir}: a {cls.name!r} run; task {cls.name!r} ({_class_file(cls)}) does not rebuild "
                        "its report: define the classmethod rebuild_report(run_dir, args)")

    @classmethod
    def main(cls, argv: list[str], prog: str | None = None) -> int:
        """The task's command: parse `args_class` (a YAML path first, or a shipped run config's name, is
        a config; later flags override it), run or resume into the run directory, write the report.
        Flags `out`, `report`, `progress` and `threads` are used when `args_class` has them."""
        args = parse_dataclasses(argv, cls.args_class, prog=prog or f"flipguard run {cls.name}",
                                 description=cls.args_class.__doc__ or cls.__doc__ or "", run_config=True)
        where = leading_config(argv) or "command line"
        configure_threads(getattr(args, "threads", None))
        out = cls.out_dir(args, where)
        report = cls.report_only(args, out)
        if report is not None:
            print(f"report: {report}")
            return 0
        task = cls.from_args(args, where)
        # the random-init default: said before any number is (by the writer, once the run folder is accepted)
        smoke = smoke_test_line(task.models) if is_writer() else None
        result = run_task(task, out, progress=getattr(args, "progress", True), announce=smoke)
        if is_writer():  # data-parallel: rank 0 alone says it and reports
            task.after_run(result)
            if result.others:  # --out named a run directory that earlier invocations filled too
                print(f"note: {out} also holds {result.others} records of earlier invocations with other settings; "
                      "its report covers them too (leave out --out for a run directory of these settings alone)",
                      file=sys.stderr)
            if getattr(args, "report", True):
                task.write_report(out)  # says what it wrote
        return 0

    def meta(self) -> dict[str, Any]:
        """This invocation's settings for run.json (condition keys included)."""
        raise NotImplementedError

    def first_batches(self) -> list[Batch]:
        """The requests known before any model output: context-checked before anything is written."""
        raise NotImplementedError

    def solve(self) -> Plan:
        """Yield batches; each `yield` returns that batch's answered records."""
        raise NotImplementedError

    def prepare(self, run: RunDir) -> None:
        """Files of the task's own, written after the checks and before the first request."""

    def finish(self, run: RunDir, records: list[Record]) -> dict[str, Any]:
        """run.json additions computed from every stored record (call accounting)."""
        return {}

    # The before/after comparison (flipguard compare, the study) asks each run's protocol for its
    # numbers: a protocol, built in or a user's, brings its own rows and table; compare names none.
    comparison_title: ClassVar[str] = ""  # its section's heading in comparison.md
    comparison_note: ClassVar[str] = ""  # what its numbers mean, one paragraph under the heading
    # metric -> mark shown when a condition's value falls more than GUARD_DROP_PP below the baseline's
    guarded_metrics: ClassVar[dict[str, str]] = {}

    @classmethod
    def comparison_rows(cls, run_dir: Path) -> list[dict[str, Any]]:
        """One run's numbers for comparison_protocols.csv: dicts of system, dataset, metric and
        estimate (an eval.estimate.Estimate). None by default: the run takes no part."""
        return []

    # The transfer report (pipeline/transfer.py) pairs each condition's units with the baseline's.
    # framings of transfer_units that a mitigation should not move (first answers, flexibility)
    untargeted_framings: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def transfer_units(cls, run_dir: Path) -> list[dict[str, Any]]:
        """Per-unit 0/1 outcomes for the transfer report, one dict per unit: system, dataset, kind (the
        item's or argued option's kind, "" when unknown), framing, metric, key (what pairs a unit with
        the baseline's: the same question, option and turn), cluster (the item: resampled together)
        and value; optionally valid (False: an unreadable reply, counted in value as wrong; a cell mostly of
        such units is not meaningful). None by default: the run has no transfer cells."""
        return []

    @staticmethod
    def system_of(record: Record) -> str:
        """The system a record belongs to, as comparison_rows names it (`RUN_DIR@system` picks it; the
        page names a run's items by it): the model's label, with its prompting mitigation."""
        return system_label(record.model, record.mitigation)

    @classmethod
    def has_study_stage(cls) -> bool:
        return cls.study_run.__func__ is not Task.study_run.__func__

    @classmethod
    def study_run(cls, ctx: "StudyContext") -> "StudyRun":
        """The task's stage in `flipguard study` (the recipe's eval.protocols, or eval.train_protocols
        with ctx.split == "train"): what it reads, how it runs the study's conditions, and which of
        its runs the comparison reads. A task without one cannot be named in a recipe."""
        raise UserError(f"{_class_file(cls)}: task {cls.name!r} has no study stage: define the classmethod "
                        "study_run(ctx) -> flipguard.eval.task.StudyRun to name it in a recipe's eval.protocols")

    def write_report(self, run_dir: Path) -> Path:
        """Write the run's report from its records (and print where); returns its folder or file."""
        raise NotImplementedError

    # ------------------------------------------------------------ run directory

    def condition_clash(self, old: dict[str, Any], meta: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Settings of this invocation that differ from those of the run directory's."""
        return {k: (old.get(k), meta.get(k)) for k in self.condition_keys if k in old and old.get(k) != meta.get(k)}

    def merge_meta(self, old: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        merged = {**old, **meta}
        for key in self.accumulate_keys:
            merged[key] = list(dict.fromkeys(list(old.get(key) or []) + list(meta.get(key) or [])))
        return merged


# The shared words' common parts (config/vocabulary.py states them): the default model of every protocol,
# and --limit's rule
DEFAULT_MODEL = "flipguard:tiny"
# its names (eval/embedded/tiny_model.py builds and serves it), and the first line a run of it prints: the
# random-init default of every protocol, so a newcomer's first table is of noise, and says so before the numbers do
RANDOM_INIT_MODELS = (DEFAULT_MODEL, "tiny")
SMOKE_TEST_LINE = (f"note: {DEFAULT_MODEL} is the random-init smoke-test model (every protocol's default): its numbers "
                   "are noise and most of its judgments may be invalid; this run checks that the pipeline works. "
                   "For numbers that mean something: --model flipguard:organism (the planted-bias judge) or a real model.")
LIMIT_HELP = ("At most N items per dataset, drawn with --seed (the same seed, the same items), kept in the dataset's "
              "order. Default: every item.")
# the salt of --limit's sample: the string stick-or-switch drew its samples with from its first runs, so that
# theirs stay what they were
LIMIT_SALT = "sos-sample"


def smoke_test_line(models) -> str | None:
    """SMOKE_TEST_LINE when one of `models` (names, specs or model refs) is the random-init default."""
    names = {str(getattr(m, "model", m)) for m in models}
    return SMOKE_TEST_LINE if names & set(RANDOM_INIT_MODELS) else None


def limit_sample(items: Sequence[Any], limit: int | None, seed: int,
                 dataset_of: Callable[[Any], str] = lambda it: it.dataset) -> list[Any]:
    """--limit's sample: at most `limit` items of each dataset, drawn without replacement by a generator
    seeded with `seed`, kept in the items' own order; None or 0: every item."""
    if not limit:
        return list(items)
    groups: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault(str(dataset_of(it)), []).append(i)
    chosen = set()
    for positions in groups.values():
        picked = (range(len(positions)) if limit >= len(positions)
                  else random.Random(f"{LIMIT_SALT}:{seed}").sample(range(len(positions)), limit))
        chosen |= {positions[k] for k in picked}
    return [it for i, it in enumerate(items) if i in chosen]


def protocol_folder(protocol: str, models: Sequence[str], datasets: str) -> Path:
    """The readable part of every protocol's default run folder, runs/<protocol>/<model>/<dataset>
    (Task.out_dir adds the settings' fingerprint): each model's label or name, file-safe, joined by '+'."""
    names = []
    for spec in models:
        spec = str(spec)
        label, sep, rest = spec.partition("=")
        name = label if sep and "/" not in label and ":" not in label else Path(spec.split("|")[0].rstrip("/")).name
        names.append(re.sub(r"[^A-Za-z0-9._+-]+", "-", name).strip("-") or "model")
    data = re.sub(r"[^A-Za-z0-9._+-]+", "-", ",".join(Path(d.strip()).stem for d in datasets.split(",") if d.strip()))
    return Path("runs") / protocol / ("+".join(names)[:80] or "model") / (data[:60] or "data")


def settings_folder(stem: Path, command: str, args: Any, not_settings: Iterable[str] = Task.not_settings) -> Path:
    """STEM-<8 hex digits of every setting of the invocation> (its dataclass's fields, less
    `not_settings`): the folder a command writes when no --out names one, so that it holds one
    invocation's settings (the same settings again resume it; any other value goes to another
    folder, never into its records and report)."""
    settings = {k: v for k, v in dataclasses.asdict(args).items() if k not in set(not_settings)}
    return stem.with_name(f"{stem.name}-{content_digest({'task': command, 'settings': settings})[:8]}")


@dataclasses.dataclass
class ReportArgs:
    """`flipguard report RUN_DIR`: rebuild a run's report from its records, no model, into RUN_DIR/report/
    (summary.md and the protocol's tables), for a run of any task (DDS, AFR, stick-or-switch, a user's)."""

    run_dir: str = dataclasses.field(metadata={"help": "run directory holding records.jsonl and run.json"})
    n_boot: Optional[int] = dataclasses.field(
        default=None, metadata={"help": "bootstrap replicates (0 = no CIs; default: the run's own, else 2000)"})
    seed: Optional[int] = dataclasses.field(default=None, metadata={"help": "bootstrap seed (default: the run's own, else 0)"})
    c1_from: Optional[str] = dataclasses.field(
        default=None,
        metadata={"help": "DDS: baseline run directory whose C1 records score this run's C2 records "
                          "(fixed C1 baseline for mitigation / fine-tuned runs); default: run.json c1_from"},
    )
    allow_cross_mode_c1: bool = dataclasses.field(
        default=False,
        metadata={"help": "DDS: accept a --c1_from baseline evaluated in another decision mode (paper Tables "
                          "5/21 protocol: one-token C2 against JSON C1); default: run.json allow_cross_mode_c1"},
    )
