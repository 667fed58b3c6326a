"""`flipguard study RECIPE`: the recipe's whole before/after plan as one resumable command.

    flipguard study recipes/tiny.yaml --out runs/tiny-study            # everything
    flipguard study recipes/tiny.yaml --out runs/tiny-study --only dpo # redo one stage
    flipguard study recipes/tiny.yaml --out runs/tiny-study --from pairs

The stages and what each reads are study_plan.py's; this module runs them. A stage is
skipped when its outputs exist and its fingerprint (fingerprints.py) matches the one in
DIR/study.json: a hash of exactly what it reads, the model's identity and its input stages'
fingerprints. So a changed `dpo.beta` redoes dpo, dpo-merge, dpo-eval and compare, and
nothing else. A stage whose fingerprint changed (or that --from/--only names) has its
outputs removed first; one that was interrupted with the same fingerprint resumes (eval
stages at the record level; trainers and merge publish their folders atomically,
provenance last). The results go to wandb when report_to names it (tracking.py).

The effective recipe (the file plus command-line overrides, with this study's folders
for pairs and adapters; env values redacted) is written to DIR/recipe.yaml: it is what
the trainers and the merge read.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import yaml

from flipguard.config import (
    ARG_SECTIONS,
    PairsArguments,
    TrackingArguments,
    ValidationArguments,
    parse_recipe,
    public_recipe,
    read_recipe,
    split_recipe_argv,
    task_config_key,
    trainers,
    validate_recipe,
)
from flipguard.errors import FlipguardError, UserError, disk_error
from flipguard.eval.backends.base import LOCAL_WEIGHTS
from flipguard.eval.dds.metrics import TOTAL_AVG
from flipguard.eval.records import FOLDER_KINDS, OWNER_FILE, RUN_META_FILE, now_iso, refuse_other_kind, run_lock
from flipguard.eval.task import SMOKE_TEST_LINE, smoke_test_line
from flipguard.eval.task_includes import include_tasks, included_task_files, split_includes
from flipguard.files import (
    atomic_write_text,
    blocking_kept,
    check_replace,
    claim,
    claim_stage_files,
    clean_stale_staging,
    dumps_utf8,
    read_manifest,
    refuse_link,
    remove_owned,
    unlisted_files,
    written_files,
)
from flipguard.organism.ground_truth import GROUND_TRUTH_JSON
from flipguard.pipeline.compare import protocol_flags
from flipguard.pipeline.fingerprints import (
    file_sha,
    key_flags,
    model_identity,
    plan_key,
    plan_unchanged,
    stage_fingerprints,
    stage_runs,
    stage_runs_problem,
)
from flipguard.pipeline.grid import GRID_HELP, GRID_STAGE, GridPlan, print_grid
from flipguard.pipeline.stage_workers import (
    WORKER_TMP,
    LiveLine,
    StageWorkers,
    auto_jobs,
    last_of_each_line,
    output_to,
)
from flipguard.pipeline.study_plan import Stage, StudyPlan, check_task_config_keys, study_plan_class
from flipguard.pipeline.view import VIEW_FILE, check_page, write_view
from flipguard.pipeline.view.grid import current_stage, stale_inputs
from flipguard.pipeline.view.runs import FLAG_WORDS, cell_text, count_cell, flags, number_cell, read_csv
from flipguard.runtime.resolve import check_local_model, resolve_model
from flipguard.runtime.threads import THREADS_HELP, configure_threads, default_threads

STUDY_FILE = FOLDER_KINDS["study"]
# stages run side by side write their output here while they run (the study holds the folder's lock);
# removed when the study ends, and by the next run after a kill
STAGE_LOGS = ".stage-logs"
# each stage's output as a terminal would have left it, kept after the study (the details the terminal leaves out);
# replaced when the stage runs again
LOG_DIR = "logs"
FAILED_TAIL = 15  # lines of a failed stage's log printed with its failure
LIVE_EVERY_S = 0.5  # how often the live line is rewritten (a terminal only)
STUDY_FORMAT = "flipguard-study/1"
# a stage's status when its last run did not finish: it resumes ("running": a study killed while it ran)
UNFINISHED = ("running", "failed", "interrupted")

RECIPE_HEADER = "# the effective recipe of this study"
JOBS_HELP = ("Independent stages (a --grid's variants among them) run at once, each in its own process (default: 2 "
             "on a CPU with 2 free cores per --threads, the hf backend and a small local model, else 1); the "
             "results are the same either way")


def running_as_interrupted(stages: dict[str, Any], ended: str | None = None) -> bool:
    """Every stage entry still "running" recorded "interrupted" (`ended` set when given): no process runs it
    now. True when there was one."""
    begun = [e for e in stages.values() if isinstance(e, dict) and e.get("status") == "running"]
    for entry in begun:
        entry["status"] = "interrupted"
        if ended is not None:
            entry["ended"] = ended
    return bool(begun)


def _epoch(iso: Any) -> float | None:
    """A time study.json holds (now_iso) as seconds since the epoch; None when it holds none."""
    try:
        return datetime.datetime.fromisoformat(iso).timestamp()
    except (TypeError, ValueError):
        return None


def claim_stage_log(log: Path) -> None:
    """A stage's log, recorded in its folder's manifest as flipguard's before the worker opens it
    (so a killed run's log is removed by the next run, and a file of the user's is never)."""
    check_replace(log, log=True)
    claim(log.parent, log.name, log=True)


def written_by_flipguard(path: Path) -> bool:
    """A stage output left by an earlier flipguard command: a run directory (run.json) or a
    published folder (owner file); anything else in --out is the user's and is kept."""
    return path.is_dir() and ((path / RUN_META_FILE).is_file() or (path / OWNER_FILE).is_file())


@dataclasses.dataclass
class StudyArguments:
    """Run a recipe's whole before/after plan (recipe `eval:` section): baseline and prompting
    mitigations, flip records -> pairs -> each trainer -> merge -> re-measure, the other protocols the recipe
    names (eval.protocols: registered tasks; --include my_tasks.py FILE adds a user's), comparison report
    with plots; finished stages are skipped on a rerun (DIR/study.json).
    Stages: baseline, baseline-<extra mode>, <mitigation>..., base-train, <task>-train..., pairs, then per
    trainer section (sft, dpo, ...) <trainer>, <trainer>-merge, <trainer>-eval, then one per task of
    eval.protocols, compare, wandb (those the recipe asks for). Flags override the
    recipe's values: --model, --datasets, --limit, --mitigations, --backend, --backend_args and
    --batch_size its eval: keys of those names, --eval_plan_<key>, --pairs_<key> and --tracking_<key>
    the rest of its eval:, pairs: and tracking: sections (pairs records and dir are the study's own).
    --grid KEY=V1,V2 runs a variant of the training stages per value (every combination of several
    --grid), the baseline and what else no key reaches once, and sets them side by side (OUT/grid/).
    RECIPE is a file, or a shipped recipe's name (flipguard recipes)."""

    out: str | None = dataclasses.field(default=None, metadata={"help": "Study folder (default runs/<recipe name>-study)."})
    from_stage: str | None = dataclasses.field(
        default=None, metadata={"aliases": ["--from"], "help": "Redo this stage and every stage after it."}
    )
    only: str | None = dataclasses.field(default=None, metadata={"help": "Redo just this stage (its inputs must be done)."})
    model: str | None = dataclasses.field(default=None, metadata={"help": "Override the recipe's model_name_or_path."})
    threads: int | None = dataclasses.field(default=None, metadata={"help": THREADS_HELP})
    jobs: int | None = dataclasses.field(default=None, metadata={"help": JOBS_HELP})
    grid: list[str] = dataclasses.field(default_factory=list, metadata={"help": GRID_HELP, "metavar": "KEY=V1,V2"})


class Study(StudyPlan):
    """The plan run in its folder: study.json's record of every stage (status, fingerprint,
    files written) decides what is skipped, resumed or redone."""

    def __init__(self, recipe_path: str | os.PathLike, raw: dict[str, Any], out: str | os.PathLike,
                 *, print_fn: Callable[[str], None] = print, **plan_kwargs):
        self.t0 = time.time()
        self.live = LiveLine()  # on a terminal: the running stages and their progress, rewritten in place

        def print_line(text: str) -> None:
            self.live.clear()
            print_fn(text)

        super().__init__(recipe_path, raw, out, print_fn=print_line, **plan_kwargs)
        self.state = self._load_state()
        self.statuses: list[tuple[str, str, float]] = []

    def _load_state(self) -> dict[str, Any]:
        path = self.out / STUDY_FILE
        if not path.is_file():
            return {"format": STUDY_FORMAT, "stages": {}}
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: unreadable study state ({exc}); remove it to start the study afresh") from None
        if not isinstance(state, dict) or state.get("format") != STUDY_FORMAT:
            raise UserError(f"{path}: not a {STUDY_FORMAT} file")
        # read under the study's lock: no process runs it now (the study that did was killed)
        running_as_interrupted(state.get("stages") or {})
        return state

    def _save_state(self) -> None:
        self.state.update(recipe=self.recipe_path, out=str(self.out), model=self.model, updated=now_iso(),
                          order=[s.name for s in self.stages])
        atomic_write_text(self.out / STUDY_FILE, dumps_utf8(self.state, indent=2) + "\n")

    def check_folders(self, stages: list[Stage] | None = None) -> None:
        """Before any stage (and again as each stage starts): every folder a stage would clear
        either does not exist or is recorded in study.json as this study's own. Anything else
        (the user's files, an earlier `flipguard eval` run, another study's stage) is refused,
        never removed."""
        entries = self.state["stages"]
        for stage in self.stages if stages is None else stages:
            if stage.name in entries:
                continue
            for path in stage.clear:
                if path.exists():
                    what = "an earlier flipguard run" if written_by_flipguard(path) else "not flipguard's"
                    raise UserError(
                        f"stage {stage.name}: {path} exists and was not written by this study ({what}; "
                        f"{self.out / STUDY_FILE} does not record it); nothing was changed: move it away or "
                        "use another --out")

    def built_from_current(self, stage: Stage) -> bool:
        """Built from its inputs as they are now: an input redone since (e.g. `--only sft`)
        makes this stage stale even though every fingerprint still matches."""
        entries = self.state["stages"]
        built_from = (entries.get(stage.name) or {}).get("built_from") or {}
        return all(built_from.get(i) == (entries.get(i) or {}).get("build") for i in stage.inputs)

    def log_of(self, name: str) -> Path:
        """Where a stage's output is kept once it ends (OUT/logs/STAGE.log)."""
        return self.out / LOG_DIR / f"{name}.log"

    def run(self, from_stage: str | None = None, only: str | None = None, jobs: int = 1,
            plan_args: dict[str, Any] | None = None) -> list[tuple[str, str, float]]:
        """Every stage that is not up to date, in order; with `jobs` > 1 (and `plan_args`, what a
        worker rebuilds this plan from) up to `jobs` stages whose inputs are done at once
        (stage_workers.py)."""
        names = [s.name for s in self.stages]
        for flag, value in (("--from", from_stage), ("--only", only)):
            if value is not None and value not in names:
                raise UserError(f"{flag} {value}: no such stage in this study (stages: {', '.join(names)})")
        if from_stage and only:
            raise UserError("--from and --only: give one of them")
        self.check_folders()
        # before any work: the study's own files replace nothing of the user's (files.check_replace)
        for path in (*(path for path, _ in self.effective_recipes()), self.out / STUDY_FILE):
            check_replace(path)
        check_page(self.out / VIEW_FILE)
        self._check_stage_logs()
        self._fps = stage_fingerprints(self.stages)
        self._start = names.index(from_stage) if from_stage else None
        self._only = only
        self._began: dict[str, float] = {}
        self.check_redos()
        self.out.mkdir(parents=True, exist_ok=True)

        for path, raw in self.effective_recipes():
            atomic_write_text(path, f"{RECIPE_HEADER} (from {self.recipe_path}); written by flipguard study\n"
                              + yaml.safe_dump(public_recipe(raw), sort_keys=False))
        if jobs > 1 and not only:
            self._run_side_by_side(jobs, plan_args or {})
        else:
            self._run_in_process()
        self._mark_stale()
        self._save_state()
        return self.statuses

    def _decide(self, i: int, stage: Stage) -> str:
        """What happens to stage i now that its inputs are settled: "skipped"/"not run" (recorded
        here), or how it runs ("run", "redo", "resume"). Up to date means done with these settings
        and its outputs there and whole: a run it wrote that lost records since is resumed, one that
        run.json says is another run than the stage wrote is refused (stage_runs_problem)."""
        entries, fps = self.state["stages"], self._fps
        entry = entries.get(stage.name) or {}
        done = (entry.get("status") == "done" and entry.get("fingerprint") == fps[stage.name]
                and all(p.exists() for p in stage.outputs) and self.built_from_current(stage))
        forced = stage.name == self._only or (self._start is not None and i >= self._start)
        problem = stage_runs_problem(entry, self.out) if done and not forced else None
        current = done and problem is None
        if self._only and stage.name != self._only:
            self.statuses.append((stage.name, "skipped" if current else "not run", 0.0))
            return "skipped" if current else "not run"
        if current and not forced:
            self.statuses.append((stage.name, "skipped", 0.0))
            self.print(f"--- {stage.name}: skipped (up to date)")
            return "skipped"
        if problem is not None and problem[0] == "other":
            raise UserError(f"stage {stage.name}: {problem[1]}; nothing was changed: move it away, or redo the stage "
                            f"(--only {stage.name})")
        missing = [n for n in stage.inputs if (entries.get(n) or {}).get("status") != "done"
                   or entries[n].get("fingerprint") != fps[n]]
        if missing:
            raise UserError(f"stage {stage.name}: its input stage(s) {', '.join(missing)} are not done with the "
                             "current settings; run the study without --only first")
        for name in stage.inputs:  # done, but what it wrote is no longer whole (a records file cut short)
            broken = stage_runs_problem(entries[name], self.out)
            if broken is not None:
                then = "run the study without --only first (it resumes that stage)" if broken[0] == "incomplete" \
                    else f"move it away, or redo that stage (--only {name})"
                raise UserError(f"stage {stage.name}: its input stage {name} is not as it finished: {broken[1]}; {then}")
        if problem is not None:
            self.print(f"--- {stage.name}: {problem[1]}: resuming it")
        resume = (problem is not None or entry.get("status") in UNFINISHED) \
            and entry.get("fingerprint") == fps[stage.name] and not forced
        return "resume" if resume else ("redo" if entry else "run")

    def _begin(self, i: int, stage: Stage, status: str, where: str = "") -> None:
        """Announce the stage, clear what a redo replaces, record it as running."""
        entries = self.state["stages"]
        entry = entries.get(stage.name) or {}
        self.state.pop("plan", None)  # the quick-rerun key holds only after a full run (main's record_plan)
        # where the study stands, and how long this stage took when it last ran (its ETA on a redo)
        last = f", {entry['seconds']:.0f}s last time" if entry.get("seconds") else ""
        if not self.live.on:  # on a terminal the live line says what runs; elsewhere a line per start
            self.print(f"=== [{time.time() - self.t0:5.0f}s] {stage.name} ({status}, stage {i + 1}/{len(self.stages)}"
                       f"{last}): {stage.title}{where}")
        if stage.name not in entries:
            self.check_folders([stage])  # again at the moment it runs: a folder that appeared since is refused
        foreign = list(entry.get("foreign") or [])
        if entry.get("status") in UNFINISHED and _epoch(entry.get("started")) is not None:
            # what the run that stopped wrote (from its start to its end, where study.json knows it) is the stage's:
            # a resume writes over it, a redo removes it (a killed trainer's checkpoints would be resumed from). A
            # stage resumed because its run was cut short since it finished claims nothing: a file there is yours
            until = _epoch(entry.get("ended"))
            self.claim_written(stage, foreign, since=_epoch(entry["started"]),
                               until=None if until is None else until + 1.0, changed=False)
        if status != "resume":
            foreign = self.clear(stage, entry)
        else:  # what no manifest lists is the user's (notes put there since): the resumed run never claims it
            foreign = sorted({*foreign, *(str(p) for path in stage.clear for p in unlisted_files(path))})
        self._began[stage.name] = time.time()
        # what it wrote when it last finished: the room it needs when a disk fills (room_needed)
        sizes = [v[0] for v in (entry.get("files") or {}).values() if isinstance(v, list) and v and isinstance(v[0], int)]
        last_bytes = sum(sizes) if sizes else entry.get("last_bytes")
        entries[stage.name] = {"status": "running", "fingerprint": self._fps[stage.name], "inputs": list(stage.inputs),
                               "foreign": foreign, **({"last_bytes": last_bytes} if last_bytes else {}),
                               "built_from": {i: entries[i].get("build") for i in stage.inputs},
                               "params": json.loads(json.dumps(stage.params, default=str)),
                               "outputs": [str(p) for p in stage.outputs], "started": now_iso()}
        self._save_state()

    def _finish(self, stage: Stage, status: str, seconds: float) -> None:
        """The stage ran: its outputs are there, study.json records it done with the files it wrote."""
        entries = self.state["stages"]
        missing_out = [str(p) for p in stage.outputs if not p.exists()]
        if missing_out:
            raise UserError(f"stage {stage.name}: finished without writing {', '.join(missing_out)}")
        if stage.recorded is not None:
            self.state.update(stage.recorded())
        foreign = entries[stage.name]["foreign"]
        self.claim_written(stage, foreign, since=self._began.get(stage.name, self.t0), changed=True)
        entries[stage.name].update(status="done", seconds=round(seconds, 2), finished=now_iso(), last_action=status,
                                   build=uuid.uuid4().hex[:12], runs=stage_runs(entries[stage.name], self.out),
                                   files={os.path.relpath(k, self.out): v for p in stage.clear
                                          for k, v in written_files(p, foreign).items()})
        self._save_state()
        self.statuses.append((stage.name, status, seconds))
        self.print(f"--- {stage.name}: {status} in {seconds:.1f}s")

    def _keep_log(self, name: str, live: Path) -> str:
        """A stage's live log, as a terminal would have left it, kept in OUT/logs/STAGE.log; returns its text."""
        text = last_of_each_line(live.read_text(encoding="utf-8", errors="replace")) if live.is_file() else ""
        atomic_write_text(self.log_of(name), text)
        return text

    def _print_failure(self, name: str, seconds: float, text: str) -> None:
        """A failed stage: its time, and the end of its log (the error is there), the whole log named."""
        tail = [line for line in text.rstrip().splitlines() if line.strip()][-FAILED_TAIL:]
        self.print(f"--- {name}: failed after {seconds:.1f}s; the end of its log ({self.log_of(name)}):"
                   + "".join(f"\n    {line}" for line in tail))

    def _run_in_process(self) -> None:
        """The stages one at a time in this process (--jobs 1, --only), each one's output into its log while
        the live line shows its progress (a thread: the stage holds this one)."""
        logs = self._stage_logs()
        try:
            for i, stage in enumerate(self.stages):
                status = self._decide(i, stage)
                if status in ("skipped", "not run"):
                    continue
                log = logs / f"{stage.name}.log"
                claim_stage_log(log)
                self._begin(i, stage, status)
                t = time.time()
                done = threading.Event()
                ticker = threading.Thread(target=self._tick, args=({stage.name: (t, log)}, done), daemon=True)
                ticker.start()
                try:
                    with output_to(log):
                        stage.run()
                except BaseException as exc:
                    done.set()
                    ticker.join()
                    with contextlib.suppress(FlipguardError, OSError):
                        text = self._keep_log(stage.name, log)
                        if not isinstance(exc, KeyboardInterrupt):
                            self._print_failure(stage.name, time.time() - t, text)
                    raise self._failed(stage, exc) from None
                done.set()
                ticker.join()
                self._keep_log(stage.name, log)
                self._finish(stage, status, time.time() - t)
        finally:
            self.live.clear()
            with contextlib.suppress(FlipguardError, OSError):  # a failure that got here is the one to show
                self._remove_stage_logs(logs)

    def _tick(self, running: dict[str, tuple[float, Path]], done: threading.Event) -> None:
        while not done.wait(LIVE_EVERY_S):
            self.live.show(running)

    def _run_side_by_side(self, jobs: int, plan_args: dict[str, Any]) -> None:
        """The stages as a graph: each starts once every stage it reads is settled, up to `jobs`
        at once in worker processes (stage_workers.py). The first failure starts nothing more;
        the stages already running finish and are recorded, then the failure is raised."""
        order = {s.name: i for i, s in enumerate(self.stages)}
        # longest first: of the stages ready, the one with the most work after it (critical path)
        after = self._work_after()
        pending = sorted(self.stages, key=lambda s: -after[s.name])
        running: dict[str, tuple[Stage, str, float, Path]] = {}
        failure: BaseException | None = None
        logs = self._stage_logs()
        workers = StageWorkers(jobs, plan_args, tmp_in=logs)
        try:
            while (pending and failure is None) or running:
                while failure is None and workers.idle:
                    unsettled = {s.name for s in pending} | set(running)
                    ready = next((s for s in pending if not unsettled & set(s.inputs)
                                  # the wandb stage reads the whole folder: it waits for every other stage
                                  and not (s.name == "wandb" and len(unsettled) > 1)), None)
                    if ready is None:
                        break
                    pending.remove(ready)
                    status = self._decide(order[ready.name], ready)
                    if status in ("skipped", "not run"):
                        continue
                    log = logs / f"{ready.name}.log"
                    claim_stage_log(log)
                    self._begin(order[ready.name], ready, status,
                                f" [beside {', '.join(running)}]" if running else "")
                    workers.submit(ready.name, str(log))
                    running[ready.name] = (ready, status, time.time(), log)
                if not running:
                    break
                ended = workers.wait(LIVE_EVERY_S if self.live.on else None)
                if ended is None:  # nothing ended yet: the live line again
                    self.live.show({n: (t0, lg) for n, (_, _, t0, lg) in running.items()})
                    continue
                name, error = ended
                stage, status, t, log = running.pop(name)
                try:
                    text = self._keep_log(name, log)
                except (FlipguardError, OSError) as exc:  # its log could not be kept (a full disk): the stage's
                    text = ""                              # own failure, if any, is the one to show
                    error = error or (exc if isinstance(exc, FlipguardError) else disk_error(exc) or exc)
                if error is not None:
                    self._print_failure(name, time.time() - t, text)
                    error = self._failed(stage, error)
                    if failure is None:
                        failure = error if isinstance(error, FlipguardError) else RuntimeError(f"stage {name}: {error}")
                    continue
                try:
                    self._finish(stage, status, time.time() - t)
                except FlipguardError as exc:
                    failure = failure or exc
        except BaseException as exc:
            self.live.clear()
            workers.close(terminate=True)
            for stage, _, _, _ in running.values():  # stopped with the study: recorded so, never left "running"
                self._failed(stage, exc, stopped=True)
            # a stage begun (study.json says "running") but not yet handed to a worker when the interrupt came
            if running_as_interrupted(self.state.get("stages") or {}, ended=now_iso()):
                with contextlib.suppress(OSError):
                    self._save_state()
            with contextlib.suppress(FlipguardError, OSError):  # the failure that got here is the one to show
                self._remove_stage_logs(logs)
            raise
        self.live.clear()
        workers.close()
        self._remove_stage_logs(logs)
        self.statuses.sort(key=lambda s: order[s[0]])
        if failure is not None:
            self._mark_stale()
            self._save_state()
            raise failure

    def _check_stage_logs(self) -> None:
        """Before any work: OUT/.stage-logs is absent or a folder (not a file, not a link), and no
        stage's log would replace a file there that flipguard did not write as that log."""
        logs = self.out / STAGE_LOGS
        for folder in (logs, self.out / LOG_DIR):
            refuse_link(folder)
            if os.path.lexists(folder) and not folder.is_dir():
                raise UserError(f"{folder}: is a file, where `flipguard study` keeps its stages' logs; nothing was "
                                "changed: move it away")
        for stage in self.stages:
            check_replace(logs / f"{stage.name}.log", log=True)
            check_replace(self.log_of(stage.name))

    def _stage_logs(self) -> Path:
        """OUT/.stage-logs, emptied of a killed run's logs and workers' temp folders: only what its
        manifest and staging markers prove flipguard's (the study holds OUT's lock: no other study
        writes there)."""
        logs = self.out / STAGE_LOGS
        self._check_stage_logs()
        self._remove_stage_logs(logs)
        logs.mkdir(exist_ok=True)
        return logs

    def _remove_stage_logs(self, logs: Path) -> None:
        """The stages' logs (recorded in the folder's manifest as each was started) and the dead
        workers' temp folders (clean_stale_staging), then the folder if nothing else is in it: a
        file flipguard did not write there stays, whatever its name."""
        if logs.is_symlink() or not logs.is_dir():
            return
        clean_stale_staging(logs / WORKER_TMP)
        remove_owned(logs)
        # a folder of the user's files only keeps no manifest of ours (it lists nothing now)
        doc = read_manifest(logs) if logs.is_dir() else None
        if doc is not None and not doc["files"]:
            (logs / OWNER_FILE).unlink(missing_ok=True)

    def _work_after(self) -> dict[str, float]:
        """Per stage, seconds on the longest chain from it to the study's end: each stage's time when
        it last ran (study.json), else a trainer (a grid variant's too: 'dpo.beta=0.5:dpo') as 10
        evaluations (the demo's SFT and DPO: 48 and 78 s, its evaluations 2-30 s)."""
        entries, after = self.state["stages"], {}
        for stage in reversed(self.stages):  # the plan lists a stage after those it reads
            trainer = stage.name.rpartition(":")[2] in trainers()  # a grid variant's too: 'dpo.beta=0.5:dpo'
            own = (entries.get(stage.name) or {}).get("seconds") or (10.0 if trainer else 1.0)
            after[stage.name] = own + max((after[s.name] for s in self.stages if stage.name in s.inputs), default=0.0)
        return after

    def _mark_stale(self) -> None:
        entries = self.state["stages"]
        for stage in self.stages:  # a done stage whose inputs were redone since (--only) says so: stale
            entry = entries.get(stage.name) or {}
            if entry.get("status") == "done" and (entry.get("fingerprint") != self._fps[stage.name]
                                                  or not self.built_from_current(stage)):
                entry["status"] = "stale"

    def check_redos(self) -> None:
        """Before any stage: a stage this run will redo (--from, --only, changed settings, stale)
        must not meet a file of flipguard's that the user changed since (blocking_kept), which the
        redo would have to write over: refused now, before anything is removed."""
        entries = self.state["stages"]
        for i, stage in enumerate(self.stages):
            entry = entries.get(stage.name)
            forced = stage.name == self._only or (self._start is not None and i >= self._start)
            if entry is None or (self._only and not forced):
                continue
            if forced or entry.get("fingerprint") != self._fps[stage.name] or entry.get("status") == "stale":
                self.refuse_blocked(stage)

    def refuse_blocked(self, stage: Stage) -> None:
        blocked = [found for path in stage.clear for found in blocking_kept(path)]
        if blocked:
            (path, why), more = blocked[0], f" (and {len(blocked) - 1} more)" if len(blocked) > 1 else ""
            raise UserError(f"stage {stage.name}: {path}: {why}{more}; the redo would replace it, so nothing was "
                            "changed: move it away and rerun")

    def claim_written(self, stage: Stage, foreign: list[str], since: float, changed: bool,
                      until: float | None = None) -> None:
        """What the libraries the stage drove wrote in its own folders since it began (a trainer's card
        and checkpoints, a harness's outputs, a write cut short), recorded as flipguard's: the stage that
        caused them owns them, so a redo removes them and a resume writes over them."""
        for path in stage.clear:
            claim_stage_files(path, since=since - 1.0, until=until, keep=foreign, changed=changed)

    def _failed(self, stage: Stage, exc: BaseException, stopped: bool = False) -> BaseException:
        """A stage that raised, or was `stopped` with the study (Ctrl-C, another stage's failure): recorded
        "failed" or "interrupted" in study.json, with what its libraries wrote claimed, so a rerun resumes
        it; returns the error to show (a full disk: one line with the room the stage needs)."""
        entry = self.state["stages"].get(stage.name) or {}
        interrupted = stopped or isinstance(exc, KeyboardInterrupt)
        full = None if interrupted else disk_error(exc, f"stage {stage.name}: ", where=stage.clear[0] if stage.clear
                                                   else self.out, needed=self.room_needed(stage))
        shown = full or exc
        with contextlib.suppress(FlipguardError, OSError):  # a full disk may refuse these too: the next run does them
            self.claim_written(stage, list(entry.get("foreign") or []), since=self._began.get(stage.name, self.t0),
                               changed=True)
        entry.update(status="interrupted" if interrupted else "failed", ended=now_iso())
        if not interrupted:
            entry["error"] = str(shown).splitlines()[0] if str(shown) else type(shown).__name__
        with contextlib.suppress(FlipguardError, OSError):
            self._save_state()
        return shown

    def room_needed(self, stage: Stage) -> tuple[int, str]:
        """About how many bytes the stage writes, and why that many: what it wrote when it last finished
        (study.json), else its own estimate (Stage.room: a merged model, an adapter), else at least what it had
        written when the disk stopped it."""
        last = (self.state["stages"].get(stage.name) or {}).get("last_bytes")
        if isinstance(last, int) and last > 0:
            return last, "what the stage wrote when it last ran"
        with contextlib.suppress(FlipguardError, OSError):
            estimate = stage.room() if stage.room is not None else None
            if estimate:
                return estimate
        written = sum(size for path in stage.clear for size, _ in written_files(path).values())
        return written, "at least what the stage had written when the disk stopped it"

    def clear(self, stage: Stage, entry: dict[str, Any]) -> list[str]:
        """Before a stage is redone: remove what it wrote (what its folders' manifests prove by hash),
        keep the rest (the user's files) and say so in one line; returns what was kept. A file of
        flipguard's the user changed since, which the redo would write over, refuses the redo before
        anything is removed (refuse_blocked)."""
        self.refuse_blocked(stage)
        kept = []
        for path in stage.clear:
            kept += remove_owned(path)
        if kept:
            shown = ", ".join(str(p) for p in kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
            self.print(f"--- {stage.name}: kept {len(kept)} file(s) flipguard did not write or you changed: {shown}")
        return [str(p) for p in kept]

    def summary(self) -> None:
        print_outcome(f"{time.time() - self.t0:.0f}s in all", self.statuses, self.out, self.print)


class GridStudy(Study, GridPlan):
    """A recipe grid's study (`--grid`: pipeline/grid.py), run as any study is."""


def print_outcome(header: str, statuses: list[tuple[str, str, float]], out: Path,
                  print_fn: Callable[[str], None] = print) -> None:
    """The stage table, then the before/after table of this study's comparison, or a grid's answer per
    variant and table (a recipe grid): read from the files the page reads, never a comparison older than
    the stages it summarises (study.json) or another study's in the same folder."""
    counts = Counter(status for _, status, _ in statuses)
    print_fn(f"\nStages: {len(statuses)} ({', '.join(f'{n} {status}' for status, n in counts.items())}; {header}); "
             f"each stage's output: {out / LOG_DIR}/STAGE.log, the stages' state: {out / STUDY_FILE}")
    names = {name for name, _, _ in statuses}
    state = json.loads((out / STUDY_FILE).read_text(encoding="utf-8")) if (out / STUDY_FILE).is_file() else {}
    stages = state.get("stages") or {}
    comparison = out / "compare" / "comparison.csv"
    if "compare" in names and comparison.is_file():
        if not current_stage(stages, "compare"):
            print_fn(f"\n{comparison.parent} is older than the stages it summarises (redone since: "
                     f"{', '.join(stale_inputs(stages, 'compare')) or 'its inputs'}): rerun the study to update it.")
        else:
            print_before_after(comparison, print_fn)
    if GRID_STAGE in names:  # a grid's answer and table (not an earlier grid's, in a plain study)
        print_grid(out, stages, print_fn)


def print_before_after(comparison_csv: Path, print_fn: Callable[[str], None] = print) -> None:
    """The short before/after table a newcomer reads first (all datasets, macro average): comparison.csv's
    cells as the page shows them (pipeline/view/runs.number_cell: n/m where the file says not meaningful,
    no flag where it sets none), then the other protocols' and the verdicts against a planted profile."""
    rows = [r for r in read_csv(comparison_csv) if r["dataset"] == TOTAL_AVG]
    columns = (("C1 true", "own_c1_true", False, 8), ("C1 false", "own_c1_false", False, 9),
               ("C2 corr", "c2_correct", False, 8), ("C2 incorr", "c2_incorrect", False, 10),
               ("DDS paper", "dds", True, 10), ("own DDS", "own_dds", True, 9))
    widths = [max(least, *(len(cell_text(number_cell(r, col, signed))) + 1 for r in rows))
              for _, col, signed, least in columns]
    lines = ["\nBefore/after (all datasets, %; DDS in pp; paper = C2 vs the baseline's C1, own = the model's own C1):",
             f"{'condition':<14}" + "".join(f"{head:>{w}}" for (head, *_), w in zip(columns, widths))
             + f"{'invalid':>8}  flags"]
    for r in rows:
        marks = flags(r)["t"]
        cells = "".join(f"{cell_text(number_cell(r, col, signed)):>{w}}" for (_, col, signed, _), w in zip(columns, widths))
        lines.append(f"{r['condition']:<14}{cells}{cell_text(count_cell(r.get('invalid_judgments'))):>8}  "
                     + " ".join(f"{m}{FLAG_WORDS[m]}" for m in marks))
    print_fn("\n".join(line.rstrip() for line in lines))
    protocols = comparison_csv.with_name("comparison_protocols.csv")
    if protocols.is_file():
        print_protocols_table(protocols, print_fn)
    truth = comparison_csv.with_name(GROUND_TRUTH_JSON)
    if truth.is_file():
        conditions = json.loads(truth.read_text(encoding="utf-8"))["conditions"]
        width = max(len(name) for name in conditions) + 2
        print_fn("\nAgainst the planted profile (organism.json; the rule and every check: compare/comparison.md):\n"
                 + "\n".join(f"{name + ':':<{width}}{c['verdict']}" for name, c in conditions.items()))


def print_protocols_table(protocols_csv: Path, print_fn: Callable[[str], None] = print) -> None:
    """The multi-turn half of the before/after table: a row per condition, a column per metric
    of each protocol (comparison_protocols.csv; % and pp; cells as the page shows them), with the
    guarded-metric flags."""
    flags_of = protocol_flags(pd.read_csv(protocols_csv))
    rows = read_csv(protocols_csv)
    for protocol in dict.fromkeys(r["protocol"] for r in rows):
        mine = [r for r in rows if r["protocol"] == protocol]
        metrics = list(dict.fromkeys(r["metric"] for r in mine))
        cells = {(r["condition"], r["system"], r["metric"]): cell_text(number_cell(r, "value")) for r in mine}
        width = max(len(m) for m in [*metrics, *cells.values()]) + 1
        lines = [f"\n{protocol} before/after (%; differences in pp; 95% CIs in compare/comparison_protocols.csv):",
                 f"{'condition':<14}" + "".join(f"{m:>{width}}" for m in metrics) + "  flags"]
        for condition, system in dict.fromkeys((r["condition"], r["system"]) for r in mine):
            line = "".join(f"{cells.get((condition, system, m), '–'):>{width}}" for m in metrics)
            lines.append(f"{condition:<14}{line}  {flags_of.get((condition, protocol, system), '')}".rstrip())
        print_fn("\n".join(lines))


def effective_recipe(recipe_path: str, parsed: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The recipe file with the command line's section values applied."""
    raw = read_recipe(recipe_path)
    for section, values in parsed.items():
        raw[section] = values
    if model:
        raw["model_name_or_path"] = model
    return raw


def study_jobs(study: Study, jobs: int | None) -> int:
    """--jobs, or where it is not given the stages at once this study can take on this machine
    (stage_workers.auto_jobs), said in one line when more than one."""
    if jobs is not None:
        if jobs < 1:
            raise UserError(f"--jobs must be a positive integer, got {jobs}")
        return jobs
    try:
        model_path = resolve_model(study.model)
    except FlipguardError:
        model_path = study.model
    launches = bool(study.trainers) and study.accelerate_processes() > 1
    jobs, why = auto_jobs(threads=default_threads(), on_gpu=study.on_gpu(), launches=launches,
                          backend=study.plan.eval_plan_backend, model_path=model_path)
    if jobs > 1:
        study.print(f"=== up to {jobs} independent stages at once ({why}; --jobs 1: one at a time)")
    return jobs


def run_study(recipe_path: str, out: str | os.PathLike, raw: dict[str, Any] | None = None, *,
              from_stage: str | None = None, only: str | None = None, print_fn: Callable[[str], None] = print,
              on_finish: Callable[[Study], None] | None = None, jobs: int | None = 1,
              grid: list[str] = ()) -> Study:
    """Run (or resume) the study a recipe describes; `raw` overrides the file's contents;
    `on_finish` runs while the study still holds its folder; `jobs` stages at once (None: as
    many as this machine and study allow, study_jobs); `grid`: the --grid options (a recipe grid)."""
    raw = read_recipe(recipe_path) if raw is None else raw
    validate_recipe(raw, recipe_path)
    if (raw.get("eval") or {}).get("backend", "hf") in LOCAL_WEIGHTS and raw.get("model_name_or_path"):
        # a path that is not there: one line naming where it was given, no study folder made
        given = read_recipe(recipe_path).get("model_name_or_path") == raw["model_name_or_path"]
        check_local_model(raw["model_name_or_path"], f"{recipe_path}: model_name_or_path" if given else "--model")
    refuse_other_kind(out, "study")  # a run's or a comparison's folder holds no study
    # one writer per study folder, held from before study.json is read until the last stage
    # (trainers and merges included): a second study is refused at once, naming the holder
    with run_lock(out):
        study = GridStudy(recipe_path, raw, out, print_fn=print_fn, grid=list(grid)) if grid else \
            Study(recipe_path, raw, out, print_fn=print_fn)
        jobs = 1 if only else study_jobs(study, jobs)
        if smoke_test_line([raw.get("model_name_or_path")]):  # the random-init model: said before any number is
            print_fn(SMOKE_TEST_LINE)  # (and after the recipe and the grid were read: a refusal stays one line)
        plan_args = {"recipe_path": recipe_path, "raw": raw, "out": str(out), "threads": default_threads(),
                     "includes": included_task_files(), "grid": list(grid)}
        study.run(from_stage=from_stage, only=only, jobs=jobs, plan_args=plan_args)

        # every stage's status and the comparison with the items behind it, one HTML page
        study.artefacts.append(("page of it all (open in a browser)", write_view(study.out)))
        study.summary()
        if on_finish is not None:
            on_finish(study)
    return study


def _quick_args(argv: list[str]) -> tuple[str | None, list[str], str | None, bool]:
    """(recipe, other flags, --out, whether --from/--only was given), read without TRL:
    enough to tell whether a finished study is being rerun unchanged."""
    try:
        recipe, rest = split_recipe_argv(argv)
    except FlipguardError:
        return None, argv, None, True
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--out")
    parser.add_argument("--from", "--from_stage", dest="from_stage")
    parser.add_argument("--only")
    known, _ = parser.parse_known_args(rest)
    out = known.out or (str(Path("runs") / f"{Path(recipe).stem}-study") if recipe else None)
    return recipe, rest, out, bool(known.from_stage or known.only)


def rerun_unchanged(argv: list[str], includes: list[str] = ()) -> bool:
    """A rerun of a finished study with the same recipe bytes, flags, watched files (the tasks'
    run configs, --include files), code version and base model: every stage is up to date, so say so without
    importing TRL (whose import is most of a rerun's time). Anything else: the full path."""
    if "-h" in argv or "--help" in argv:
        return False
    recipe, rest, out, partial = _quick_args(argv)
    if not recipe or partial or not out or not (Path(out) / STUDY_FILE).is_file():
        return False

    with run_lock(out):
        return _print_if_unchanged(recipe, key_flags(rest, list(includes)), out)


def _print_if_unchanged(recipe: str, flags: list[str], out: str) -> bool:
    try:
        state = json.loads((Path(out) / STUDY_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    if not plan_unchanged(state, recipe, flags, out):
        return False
    order = state["order"]
    if smoke_test_line([state.get("model")]):
        print(SMOKE_TEST_LINE)
    for name in order:
        print(f"--- {name}: skipped (up to date)")
    print_outcome(f"recipe, flags and inputs unchanged since {state['plan'].get('at')}",
                  [(name, "skipped", 0.0) for name in order], Path(out))
    print_artefacts([(what, Path(path)) for what, path in state.get("artefacts", [])])
    return True


def print_artefacts(artefacts: list[tuple[str, Path]]) -> None:
    """The files worth opening, one line per kind: several of a kind ('DDS report: baseline', 'DDS report:
    sft-eval') on one line, their paths as one pattern (OUT/dds/{baseline,sft-eval}/report/summary.md)."""
    groups: dict[str, list[tuple[str, Path]]] = {}
    for what, path in artefacts:
        kind, sep, _ = what.partition(": ")
        groups.setdefault(kind if sep else what, []).append((what, Path(path)))
    print("\nArtefacts:")
    for kind, entries in groups.items():
        if len(entries) == 1:
            print(f"  {entries[0][0]:<34} {entries[0][1]}")
            continue
        print(f"  {f'{kind} ({len(entries)})':<34} {path_pattern([str(p) for _, p in entries])}")


def path_pattern(paths: list[str]) -> str:
    """Paths as one brace pattern a shell expands back to them: their common start and end, the parts between
    in braces ('runs/dds/{baseline,sft-eval}/report/summary.md')."""
    start = os.path.commonprefix(paths)
    start = start[: start.rfind("/") + 1] if "/" in start else ""
    end = os.path.commonprefix([p[len(start):][::-1] for p in paths])[::-1]
    end = end[end.find("/"):] if "/" in end else ""
    middles = [p[len(start): len(p) - len(end)] for p in paths]
    return f"{start}{{{','.join(middles)}}}{end}"


def main(argv: list[str]) -> int:
    includes, argv = split_includes(argv)  # a user's tasks (--include my_tasks.py), named in eval.protocols
    if rerun_unchanged(argv, includes):
        return 0
    for path in includes:
        include_tasks(path)

    plan_class = study_plan_class()
    (args, plan, pairs, tracking, validation), recipe_path, recipe = parse_recipe(
        argv, (StudyArguments, plan_class, PairsArguments, TrackingArguments, ValidationArguments), prog="flipguard study",
        description=StudyArguments.__doc__)
    if recipe_path is None:
        raise UserError("give a recipe: a file or a shipped recipe's name (flipguard study tiny --out DIR; flipguard recipes lists them)")
    check_task_config_keys(recipe, recipe_path, plan_class)  # the parser drops a key it has no flag for
    configure_threads(args.threads)
    parsed = {}
    sections = [("eval", plan), ("pairs", pairs), ("tracking", tracking)]
    if "validation" in (recipe or {}) or any(a.startswith("--validation_") for a in argv):
        sections.append(("validation", validation))  # a recipe without the section keeps none
    for section, obj in sections:
        prefix = ARG_SECTIONS[section]
        parsed[section] = {k[len(prefix):]: v for k, v in dataclasses.asdict(obj).items()}
    raw = effective_recipe(recipe_path, parsed, args.model)
    out = args.out or str(Path("runs") / f"{Path(recipe_path).stem}-study")
    def record_plan(study: Study) -> None:
        if args.from_stage or args.only:
            return
        # every stage ran or was up to date: a plain rerun may take the quick path
        _, rest, _, _ = _quick_args(argv)

        configs = [study.task_config(task_config_key(t)) for t in (*study.plan.eval_plan_protocols,
                                                                   *study.plan.eval_plan_train_protocols)]
        configs += [study.task_config(task_config_key(t, "train")) for t in study.plan.eval_plan_train_protocols]
        watched = [recipe_path, *dict.fromkeys(c for c in configs if c), *includes]
        study.state["plan"] = {"key": plan_key(recipe_path, key_flags(rest, includes), out),
                               "model": model_identity(study.model),
                               "files": {c: file_sha(c) for c in watched}, "at": now_iso()}
        study.state["artefacts"] = [[what, str(path)] for what, path in study.artefacts]
        study._save_state()

    study = run_study(recipe_path, out, raw, from_stage=args.from_stage, only=args.only, on_finish=record_plan,
                      jobs=args.jobs, grid=args.grid)
    print_artefacts(study.artefacts)
    return 0
