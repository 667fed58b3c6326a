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
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, ClassVar, Generator, Iterable, Optional, Sequence

from flipguard import plugins
from flipguard.config import did_you_mean, leading_config, parse_dataclasses
from flipguard.errors import UserError
from flipguard.eval.backends.base import Backend, GenerationConfig, ModelRef, check_backend
from flipguard.eval.mitigations import system_label
from flipguard.eval.parallel import data_parallel, is_writer
from flipguard.eval.records import (
    RECORDS_FILE,
    RUN_CONTENTS,
    RUN_META_FILE,
    Record,
    RecordStore,
    RunDir,
    content_digest,
    load_run_meta,
    now_iso,
    open_run_dir,
    run_contents,
)
from flipguard.eval.runner import MODES, Parser, check_context, run_records
from flipguard.eval.threads import configure_threads
from flipguard.redact import redact_obj


@dataclasses.dataclass
class Batch:
    """Requests for one of the run's models, sent together (one stage, one turn)."""

    records: list[Record]
    model: str  # the label of one of the task's models
    gen_config: GenerationConfig | None = None
    parse: Parser | None = None  # generate mode: raw text -> (choice, reasoning)
    choices: Sequence[str] = ("1", "2")  # logprob mode: the answer labels
    desc: str = ""
    chunk_size: int = 32


# A task's plan: yields batches, receives each batch's records with their answers (stored
# earlier or just now, in the batch's order).
Plan = Generator[Batch, list[Record], None]


def _task_file(task: "Task") -> str:
    return _class_file(type(task))


def _malformed(record: Any) -> str | None:
    """What is wrong with one request of a batch (None: nothing)."""
    if not isinstance(record, Record):
        return f"a {type(record).__name__} where a Record belongs"
    messages = record.messages
    if not isinstance(messages, list) or not messages:
        return f"record {record.key or record.item_id!r}: messages must be a non-empty list, got {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"record {record.key or record.item_id!r}: messages[{i}] is not a {{'role': str, 'content': str}} dict"
    return None


def check_batch(task: "Task", batch: Any, where: str) -> Batch:
    """A batch a task handed the runner, checked: a user's task that yields None, a list, dicts or
    string messages is one line naming its file, not an AttributeError deep in the runner."""
    problem = None
    if not isinstance(batch, Batch):
        problem = f"a {type(batch).__name__} where a flipguard.eval.task.Batch belongs"
    elif not isinstance(batch.records, (list, tuple)):
        problem = f"Batch.records is a {type(batch.records).__name__}, not a list of Records"
    elif batch.model not in {m.label for m in task.models}:
        problem = f"Batch.model {batch.model!r} is none of the task's models {[m.label for m in task.models]}"
    elif isinstance(batch.chunk_size, bool) or not isinstance(batch.chunk_size, int) or batch.chunk_size < 1:
        problem = f"Batch.chunk_size {batch.chunk_size!r}; it must be an integer >= 1"
    elif (isinstance(batch.choices, (str, bytes)) or not isinstance(batch.choices, (list, tuple))
          or len(batch.choices) < 2 or not all(isinstance(c, str) and c for c in batch.choices)):
        problem = f"Batch.choices {batch.choices!r}; it must be a list of two or more answer labels (strings)"
    elif batch.gen_config is not None and not isinstance(batch.gen_config, GenerationConfig):
        problem = (f"Batch.gen_config {batch.gen_config!r} (a {type(batch.gen_config).__name__}); it must be a "
                   "flipguard.eval.backends.base.GenerationConfig or None")
    elif batch.parse is not None and not callable(batch.parse):
        problem = f"Batch.parse {batch.parse!r}, which is not a function (raw text -> (choice, reasoning))"
    else:
        problem = next((p for p in map(_malformed, batch.records) if p), None)
    if problem is None:
        modes = sorted({str(r.mode) for r in batch.records})
        if not set(modes) <= set(MODES) or len(modes) > 1:
            problem = f"records in mode(s) {modes}; a batch's records share one mode, one of {list(MODES)}"
        elif modes == ["generate"] and batch.parse is None:
            problem = ("generate-mode records with no Batch.parse; a generated reply needs a parser "
                       "(raw text -> (choice, reasoning)), e.g. Batch(records, model, gen_config, parse=my_parse)")
    if problem:
        raise UserError(f"{_task_file(task)}: task {task.name!r}: {where} gave {problem}")
    return batch


def check_batches(task: "Task", batches: Any, where: str) -> list[Batch]:
    if not isinstance(batches, (list, tuple)):
        raise UserError(f"{_task_file(task)}: task {task.name!r}: {where} returned a {type(batches).__name__}, "
                        "not a list of Batches")
    return [check_batch(task, b, where) for b in batches]


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
    # (eval/pipeline/cli.py names `TaskClass.main`). A task declares what differs: `args_class` (its flags,
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
                                 description=cls.args_class.__doc__ or cls.__doc__ or "")
        where = leading_config(argv) or "command line"
        configure_threads(getattr(args, "threads", None))
        out = cls.out_dir(args, where)
        report = cls.report_only(args, out)
        if report is not None:
            print(f"report: {report}")
            return 0
        task = cls.from_args(args, where)
        result = run_task(task, out, progress=getattr(args, "progress", True))
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

    # The transfer report (eval/pipeline/transfer.py) pairs each condition's units with the baseline's.
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


def settings_folder(stem: Path, command: str, args: Any, not_settings: Iterable[str] = Task.not_settings) -> Path:
    """STEM-<8 hex digits of every setting of the invocation> (its dataclass's fields, less
    `not_settings`): the folder a command writes when no --out names one, so that it holds one
    invocation's settings (the same settings again resume it; any other value goes to another
    folder, never into its records and report)."""
    settings = {k: v for k, v in dataclasses.asdict(args).items() if k not in set(not_settings)}
    return stem.with_name(f"{stem.name}-{content_digest({'task': command, 'settings': settings})[:8]}")


# ---------------------------------------------------------------- the study's hook

@dataclasses.dataclass(frozen=True)
class StudyCondition:
    """One condition of a study as a protocol measures it: a model, with or without a prompting mitigation."""

    name: str                 # its name in the comparison ("Baseline", "Be Honest", "SFT")
    model: str                # the base model's name, or a merged model's folder
    mitigation: str = "none"  # a prompting mitigation (eval.mitigations), applied to the base model


@dataclasses.dataclass
class StudyContext:
    """What `flipguard study` hands a task's `study_run`: the recipe's eval: settings that every
    protocol shares, so a task needs nothing of the study's own code."""

    name: str                 # the stage's name: the task's, "-train" added on the train split
    out: Path                 # the stage's folder (its run directory, or a folder of them)
    config: str | None        # the recipe's eval.<task>_config, resolved; None: the task's own default
    conditions: list[StudyCondition]  # in comparison order, the baseline first; the train split: the base model alone
    split: str                # "test", or "train" (eval.train_protocols: conversations for the pairs)
    backend: str              # eval.backend
    limit: int | None         # eval.limit: items per dataset / run
    device: str | None        # "cpu" where the study runs without a GPU, else None (the backend's choice)
    recipe_path: str
    backend_args: str = "{}"  # eval.backend_args as the JSON --backend_args takes (vLLM parallelism, ...)

    @property
    def train(self) -> bool:
        return self.split == "train"


@dataclasses.dataclass
class StudyRun:
    """A task's stage, as its `study_run` describes it; the study adds the base model's identity
    to `params`, orders it after the fine-tuned models and skips it while its fingerprint holds."""

    title: str
    params: dict[str, Any]    # exactly what it reads, JSON-able: a change redoes the stage
    run: Callable[[], None]
    outputs: tuple[Path, ...]  # all present = the stage finished
    # (condition, "RUN_DIR[@system]") pairs whose Task.comparison_rows go to the comparison
    comparison: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    report: Path | None = None  # listed among the study's artefacts


def _class_file(cls: type) -> str:
    module = sys.modules.get(cls.__module__)
    return str(getattr(module, "__file__", None) or cls.__module__)


# ---------------------------------------------------------------- registry

_TASKS: dict[str, type[Task]] = {}
ENTRY_POINT_GROUP = plugins.TASKS  # the built-in protocols are entry points too (pyproject.toml)


def register_task(name: str):
    """Class decorator: make a Task runnable by name (`flipguard run NAME`, the study)."""

    def deco(cls: type[Task]) -> type[Task]:
        builtin = plugins.plugins(plugins.TASKS).get(name)
        if builtin is not None and plugins.is_builtin(builtin) and cls.__module__ != builtin.value:
            raise UserError(f"task {name!r} is already registered (built in); choose another name")
        if name in _TASKS and _TASKS[name] is not cls:
            raise UserError(f"task {name!r} is already registered (by {_TASKS[name].__module__}); choose another name")
        cls.name = name
        _TASKS[name] = cls
        return cls

    return deco


_INCLUDED: list[str] = []


def included_task_files() -> list[str]:
    """The files include_tasks imported in this process (a study's worker processes import them too)."""
    return list(_INCLUDED)


def include_tasks(path: str | Path) -> None:
    """Import a user's Python file so its `@register_task` classes are known."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--include {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"flipguard_user_tasks_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:  # sys.exit() at import: named, not a silent exit with its status
        del sys.modules[spec.name]
        raise UserError(f"--include {path}: the file called sys.exit({exc.code!r}) while being imported") from None
    except Exception as exc:  # a user's file: its error, named, without our traceback
        del sys.modules[spec.name]
        raise UserError(f"--include {path}: importing it failed ({type(exc).__name__}: {exc})") from None
    _INCLUDED.append(str(path.resolve()))


def split_includes(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the files of argv's `--include FILE` options, the other arguments), nothing imported."""
    files, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--include":
            if i + 1 >= len(argv):
                raise UserError("--include needs a Python file (--include my_tasks.py)")
            files.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--include="):
            files.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return files, rest


def take_includes(argv: list[str]) -> list[str]:
    """argv without its `--include FILE` options, each file imported (`include_tasks`): how
    `flipguard study` and `flipguard compare` learn a user's tasks, as `flipguard run` does."""
    files, rest = split_includes(argv)
    for path in files:
        include_tasks(path)
    return rest


def task_names() -> list[str]:
    plugins.load_plugins(plugins.TASKS)
    return sorted(_TASKS)


def get_task(name: str) -> type[Task]:
    plugins.load_plugins(plugins.TASKS)
    if name not in _TASKS:
        raise UserError(f"unknown task {name!r}; registered: {sorted(_TASKS)}{did_you_mean(name, _TASKS)}")
    return _TASKS[name]


# ---------------------------------------------------------------- models

class BackendPool:
    """Loads a model's backend only when it has work; keeps at most `max_loaded` loaded
    (the least recently used goes first). `injected` backends (tests, a caller's own
    engine) are used as given."""

    def __init__(self, models: Iterable[ModelRef], injected: dict[str, Backend] | None = None, max_loaded: int = 1):
        self.models = {m.label: m for m in models}
        self.injected = {label: check_backend(b, f"the backend given for model {label!r}")
                         for label, b in (injected or {}).items()}
        self.max_loaded = max_loaded
        self.loaded: dict[str, Backend] = {}
        # label -> what its backend actually computed with (dtype, label tokens): `computed`
        # dicts the backends fill as they work, kept after a backend is unloaded
        self.computed: dict[str, dict] = {}

    def get(self, label: str) -> Backend:
        if label in self.injected:
            return self.injected[label]
        if label in self.loaded:
            self.loaded[label] = self.loaded.pop(label)  # most recently used last
            return self.loaded[label]
        if label not in self.models:
            raise UserError(f"unknown model {label!r}; the run's models are {sorted(self.models)}")
        while len(self.loaded) >= self.max_loaded:
            self.loaded.pop(next(iter(self.loaded)))
        self.loaded[label] = self.models[label].load()
        if self.loaded[label].computed is not None:
            self.computed[label] = self.loaded[label].computed
        return self.loaded[label]


# ---------------------------------------------------------------- the runner

@dataclasses.dataclass
class RunResult:
    out_dir: Path
    calls: dict[str, int]  # requests sent by this invocation, per batch description
    others: int = 0  # records in the run directory that this invocation did not ask for (earlier ones')

    @property
    def sent(self) -> int:
        return sum(self.calls.values())


class _Answers:
    """Sends batches through the pool; answers every record from the store when it is
    there, so a task sees stored and fresh answers alike."""

    def __init__(self, store: RecordStore, pool: BackendPool, progress: bool):
        self.store, self.pool, self.progress = store, pool, progress
        self.calls: Counter = Counter()
        self.asked: set[str] = set()  # every request key of the plan, stored or sent

    def __call__(self, batch: Batch) -> list[Record]:
        self.asked.update(r.key for r in batch.records)
        pending = list({r.key: r for r in batch.records if r.key not in self.store}.values())
        if pending:  # run_records appends each answered record to the store
            n = run_records(self.store, pending, self.pool.get(batch.model), gen_config=batch.gen_config,
                            parse=batch.parse, choices=batch.choices, chunk_size=batch.chunk_size,
                            desc=batch.desc or f"{batch.model}", progress=self.progress)
            self.calls[batch.desc or batch.model] += n
        return [self.store.stored[r.key] for r in batch.records]


# the same batch (the same request keys) handed back this many times in a row, every answer
# already given: a plan that never advances (it would loop forever)
STUCK_REPEATS = 100


def _next_batch(task: Task, plan: Plan, answered: list[Record] | None) -> Batch | None:
    if not inspect.isgenerator(plan):
        raise UserError(f"{_task_file(task)}: task {task.name!r}: solve() returned a {type(plan).__name__}, not a "
                        "generator; write it with `yield batch` (nothing was run)")
    try:
        batch = next(plan) if answered is None else plan.send(answered)
    except StopIteration:
        return None
    return check_batch(task, batch, "solve()")


def run_task(task: Task, out_dir: str | Path, *, backends: dict[str, Backend] | None = None,
             progress: bool = True) -> RunResult:
    """Run (or resume) `task` into `out_dir`; returns the calls this invocation made."""
    out_dir = Path(out_dir)
    dp = data_parallel()
    if dp is not None:
        others = sorted({m.backend for m in task.models if m.backend != "hf"})
        if others:
            raise UserError(f"{out_dir}: data-parallel launch (WORLD_SIZE {dp.num_processes}) splits requests for the hf "
                            f"backend only, not {', '.join(others)}: run one process and let the engine parallelise "
                            "(vllm: --backend_args '{\"data_parallel_size\": N}'; openai: a pool of servers)")
    if dp is not None and not dp.is_main_process:
        # another data-parallel rank: rank 0 holds the lock and writes; this one answers its
        # slice of every batch and follows the same plan on a mirror of the records
        dp.wait_for_everyone()  # rank 0 has opened the run directory and prepared records.jsonl
        store = RecordStore(out_dir / RECORDS_FILE, mirror=True)
        return _run_plan(task, None, store, BackendPool(task.models, backends), False, dp)
    with open_run_dir(out_dir, task.name) as run:  # one writer, held until the last record
        clash = task.condition_clash(run.old, task.meta())
        if clash:  # refused before any model loads
            detail = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in clash.items())
            raise UserError(f"{out_dir / RUN_META_FILE}: this run directory holds another condition ({detail}); "
                            "use another --out")
        store = RecordStore(out_dir / RECORDS_FILE)
        if dp is not None:
            dp.wait_for_everyone()
        return _run_plan(task, run, store, BackendPool(task.models, backends), progress, dp)


def _run_plan(task: Task, run: RunDir | None, store: RecordStore, pool: BackendPool, progress: bool,
              dp) -> RunResult:
    """run_task's work once the records are open; `run` is None on a data-parallel rank other
    than the writer (it prints nothing and writes nothing)."""
    out_dir = store.path.parent
    first = check_batches(task, task.first_batches(), "first_batches()")
    known = [r for b in first for r in b.records]
    pending_of: dict[str, list[tuple[Batch, list[Record]]]] = {}
    for b in first:
        pending = [r for r in b.records if r.key not in store]
        if pending:
            pending_of.setdefault(b.model, []).append((b, pending))
    n_pending = len({r.key for batches in pending_of.values() for _, recs in batches for r in recs})
    n_known = len({r.key for r in known})
    if run is not None:
        ranks = f" over {dp.num_processes} data-parallel processes" if dp is not None else ""
        print(f"{out_dir}: {n_known} {task.unit}, {n_known - n_pending} already recorded, {n_pending} to run{ranks}")
    # an item longer than a model's context: refused (item, token count, limit) before
    # run.json or any record is written; the first model to run is the one left loaded
    order = [m.label for m in task.models if m.label in pending_of]
    for label in reversed(order):
        for b, pending in pending_of[label]:
            check_context(pool.get(label), pending, b.gen_config)
    # the plan's first batch is checked before the task's files and run.json are written
    plan = task.solve()
    batch = _next_batch(task, plan, None)
    if run is not None:
        task.prepare(run)
        # complete: False until this invocation's last record (no reader computes a number from it till then)
        run.write_meta(task.merge_meta(run.old, {**task.meta(), "updated": now_iso(), "complete": False}))
    answers = _Answers(store, pool, progress)
    last, repeats = None, 0
    while batch is not None:
        keys = tuple(r.key for r in batch.records)
        repeats = repeats + 1 if keys == last else 0
        if repeats >= STUCK_REPEATS:
            raise UserError(f"{_task_file(task)}: task {task.name!r}: solve() yielded the same batch "
                            f"{STUCK_REPEATS + 1} times in a row with every answer already given; it never advances: "
                            "yield the next step's requests, or return when done (the records so far are kept)")
        last = keys
        batch = _next_batch(task, plan, answers(batch))
    calls = dict(answers.calls)
    others = len(set(store.stored) - answers.asked)
    computed = pool.computed if dp is None else merge_computed(dp, pool.computed)
    if run is None:
        return RunResult(out_dir, calls, others)
    history = list(run.old.get("invocations") or []) + [
        {"time": now_iso(), "calls": calls, "calls_total": sum(calls.values()),
         **({"processes": dp.num_processes} if dp is not None else {})}]
    extra = task.finish(run, list(store.stored.values()))
    if computed:  # per model: the dtype it ran in, the label tokens counted (latest invocation wins)
        extra["computed"] = {**(run.old.get("computed") or {}), **computed}
    # what the finished run holds: a reader checks records.jsonl against it (records.require_whole)
    contents = run_contents(store.stored, {k: run.old.get(k) for k in task.condition_keys})
    run.write_meta({**run.old, **extra, "invocations": history, "updated": now_iso(), "complete": True,
                    RUN_CONTENTS: contents})
    return RunResult(out_dir, calls, others)


def merge_computed(dp, computed: dict[str, dict]) -> dict[str, dict]:
    """Every rank's `computed` (one per model label) as one: the first tokens each rank counted
    on its slice are summed, so run.json says what a single process would have; so are the
    prompt tokens prefix sharing saw and computed (each rank shares within its own slice, so
    the computed count is the ranks' together, not a single process's)."""
    from accelerate.utils import gather_object

    merged: dict[str, dict] = {}
    for per_rank in gather_object([computed]):
        for label, info in per_rank.items():
            into = merged.setdefault(label, {**info, "first_tokens": {},
                                             **({"prefix_tokens": {}} if "prefix_tokens" in info else {})})
            for tok, k in (info.get("first_tokens") or {}).items():
                into["first_tokens"][tok] = into["first_tokens"].get(tok, 0) + k
            for key, k in (info.get("prefix_tokens") or {}).items():
                into["prefix_tokens"][key] = into["prefix_tokens"].get(key, 0) + k
    for info in merged.values():
        if not info["first_tokens"]:
            del info["first_tokens"]
    return merged


def command_line(*names: str) -> list[str] | None:
    """The command as typed (redacted) when this process runs `flipguard NAME` for one of
    `names` (a task's own command, and "run"), for run.json; None when the task runs inside
    another command (the study, an analysis)."""
    return redact_obj(["flipguard", *sys.argv[1:]]) if sys.argv[1:2] and sys.argv[1] in names else None


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


def report_main(argv: list[str]) -> int:
    """`flipguard [--include FILE] report RUN_DIR`: the report of a run of any registered task (run.json's
    protocol; a run without one is DDS, as records of the first format were)."""
    argv = take_includes(argv)
    args = parse_dataclasses(argv, ReportArgs, prog="flipguard report", description=ReportArgs.__doc__,
                             positional="run_dir")
    run_dir = Path(args.run_dir)
    protocol = load_run_meta(run_dir).get("protocol") or "dds"
    for flag, value in (("--c1_from", args.c1_from), ("--allow_cross_mode_c1", args.allow_cross_mode_c1)):
        if value and protocol != "dds":
            raise UserError(f"{flag}: an option of DDS reports; {run_dir} holds a {protocol!r} run")
    print(f"report: {get_task(protocol).rebuild_report(run_dir, args)}")
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


# ---------------------------------------------------------------- comparison rows

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


def comparison_long_rows(condition: str, spec: str) -> list[dict[str, Any]]:
    """One run's rows of comparison_protocols.csv (PROTOCOL_COLUMNS + unit, n_valid, n_judged), values in % (pp for
    differences): its protocol (run.json) supplies them through Task.comparison_rows; `RUN_DIR@system`
    keeps one system of a run that holds several. The comparison and the viewer both read these."""
    run_dir, only = split_system(spec)
    task = get_task(load_run_meta(run_dir).get("protocol") or "")
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
