"""`run_task`: the one runner of every task. It owns what is the same for every protocol: the
run directory's writer lock and condition check, resume by content key, the context check
before anything is written, run.json, and the data-parallel split of the hf backend.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from flipguard.errors import UserError
from flipguard.eval.backend_pool import BackendPool
from flipguard.eval.backends.base import LOCAL_WEIGHTS, Backend
from flipguard.eval.batches import Batch, Plan, _task_file, check_batch, check_batches
from flipguard.eval.parallel import data_parallel, merge_computed
from flipguard.eval.records import (
    RECORDS_FILE,
    RUN_CONTENTS,
    RUN_META_FILE,
    Record,
    RecordStore,
    RunDir,
    now_iso,
    open_run_dir,
    run_contents,
)
from flipguard.eval.runner import check_context, run_records
from flipguard.runtime.resolve import check_local_model

if TYPE_CHECKING:  # annotations only: eval/task.py imports this module
    from flipguard.eval.task import Task


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
             progress: bool = True, announce: str | None = None) -> RunResult:
    """Run (or resume) `task` into `out_dir`; returns the calls this invocation made. `announce`: a line
    printed once the run folder's checks have passed (a refusal stays one line), before anything runs."""
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
    for model in task.models:  # a model path that is not there: one line before the run folder is made
        if model.backend in LOCAL_WEIGHTS:
            check_local_model(model.model)
    with open_run_dir(out_dir, task.name) as run:  # one writer, held until the last record
        clash = task.condition_clash(run.old, task.meta())
        if clash:  # refused before any model loads
            detail = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in clash.items())
            raise UserError(f"{out_dir / RUN_META_FILE}: this run directory holds another condition ({detail}); "
                            "use another --out, or leave it out (other settings get a folder of their own); nothing "
                            "was changed")
        if announce:
            print(announce, flush=True)
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
