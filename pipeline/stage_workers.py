"""Independent study stages side by side: `flipguard study --jobs N` (and the demo) on CPU.

A study's stages form a graph (each names the stages whose outputs it reads); on a CPU with
spare cores, stages with no path between them (SFT and DPO, AFR and stick-or-switch, the
baseline and the train-split runs) need not wait for each other. Each of N worker processes
(spawned, so no thread pool or tokenizer state is inherited from the parent) builds the same
study plan once and then runs the stages it is given, one at a time, with the parent's torch
threads; its output goes to a log file that the parent prints whole when the stage ends, so
two stages' lines never interleave. Only the parent writes study.json. Every stage computes
what it would alone (same inputs, same threads), so the results are the ones a one-at-a-time
study writes (bench/study_jobs.md compares them file by file).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from flipguard.errors import FlipguardError, disk_error
from flipguard.eval.task_includes import include_tasks
from flipguard.files import staging_dir
from flipguard.pipeline.grid import GridPlan
from flipguard.pipeline.study_plan import StudyPlan
from flipguard.runtime.threads import configure_threads, usable_cores
from flipguard.train.utils import model_bytes

# stages at once when --jobs is not given (a CPU study, the hf backend, a small model): two
# covers the graph's width where it matters (sft | dpo, afr | sos) without a third copy of a model
AUTO_JOBS_MAX = 2
# a model whose weights exceed this runs one stage at a time unless --jobs says otherwise:
# each worker holds its own copy
AUTO_JOBS_MODEL_BYTES = 2 * 2**30


def auto_jobs(*, threads: int, on_gpu: bool, launches: bool, backend: str, model_path: str) -> tuple[int, str]:
    """(stages at once, why) for a study whose --jobs is not given."""
    if on_gpu or launches:
        return 1, "trainers run through accelerate launch"
    if backend != "hf":
        return 1, f"the {backend} backend serves one model at a time"
    size = model_bytes(model_path)
    if size is None or size > AUTO_JOBS_MODEL_BYTES:
        return 1, "the base model is not a small local one (each worker loads its own copy)"
    jobs = min(AUTO_JOBS_MAX, usable_cores() // max(1, threads))
    if jobs < 2:
        return 1, f"{usable_cores()} core(s) for {threads} thread(s) per stage"
    return jobs, f"{usable_cores()} cores, {threads} thread(s) per stage"


# a tqdm bar's line: its description, then the percentage and the bar
PROGRESS_LINE = re.compile(r"^(?P<desc>.*?):?\s*\d+%\|")


def last_of_each_line(text: str) -> str:
    """A log as a terminal would have left it: of a progress bar (rewritten with carriage
    returns, or, written to a file, one line per update) its last state only."""
    lines: list[str] = []
    last_desc = None
    for line in text.split("\n"):
        line = line.rstrip("\r").rsplit("\r", 1)[-1]
        match = PROGRESS_LINE.match(line)
        desc = match.group("desc") if match else None
        if desc is not None and desc == last_desc and lines:
            lines[-1] = line
        else:
            lines.append(line)
        last_desc = desc
    return "\n".join(lines)


# a tqdm bar's state: percentage, counts and what follows ("40%|####  | 32/80 [00:01<00:02, 20.0req/s]"); its
# description is what precedes it on its line ("dds none/logprob: "), where that reads as one
PROGRESS_STATE = re.compile(r"(?P<pct>\d+)%\|[^|\r\n]*\|\s*(?P<n>[\d.]+[kMG]?)/(?P<total>[\d.]+[kMG]?)(?P<rest>[^\r\n]*)")
PROGRESS_DESC = re.compile(r"\s*(?:(?P<desc>\w[\w /.+=-]*?):?\s*)?")


def progress_of(log: Path, tail: int = 8192) -> str:
    """A running stage's progress as its log shows it now: the last state of a bar flipguard draws (its
    requests, 'dds none/logprob 40% 32/80') or of a trainer's steps ('40% 8/20'); '' when its log holds none
    yet. The libraries' own bars (loading weights, mapping a dataset) and text written into a bar's line
    (a warning, a loss dict) are not progress of the stage: never shown."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - tail))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    for m in reversed(list(PROGRESS_STATE.finditer(text))):
        start = max(text.rfind("\r", 0, m.start()), text.rfind("\n", 0, m.start())) + 1
        named = PROGRESS_DESC.fullmatch(text[start:m.start()])
        desc = (named["desc"] or "") if named else ""  # anything else before the bar is not its name
        if "req" in m["rest"] or not desc:  # flipguard's bars count requests; a trainer's steps have no name
            return f"{desc} {m['pct']}% {m['n']}/{m['total']}".strip()
    return ""


class LiveLine:
    """One line of the terminal rewritten in place while stages run: each running stage, its time and its
    progress bar's state (read from its log). Only on a terminal (a file or a pipe gets the stages' start
    lines instead); `clear()` before any other line is printed."""

    def __init__(self, stream=None):
        stream = stream if stream is not None else sys.stdout
        try:
            # the terminal itself (a duplicate of its descriptor): a stage run in this process has fd 1 in its log
            self.fd = os.dup(stream.fileno()) if stream.isatty() else None
        except (AttributeError, ValueError, OSError):
            self.fd = None
        self.on = self.fd is not None
        self.shown = False

    def show(self, running: dict[str, tuple[float, Path]]) -> None:
        """`running`: stage -> (its start time, its live log)."""
        if not self.on or not running:
            return
        now = time.time()
        parts = []
        for name, (t0, log) in running.items():
            state = progress_of(log)
            parts.append(f"{name} {now - t0:.0f}s" + (f" ({state})" if state else ""))
        width = shutil.get_terminal_size((100, 24)).columns - 1
        text = ("  running: " + "; ".join(parts))[:width]
        self._write("\r" + text + "\x1b[K")
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self._write("\r\x1b[K")
            self.shown = False

    def _write(self, text: str) -> None:
        try:
            os.write(self.fd, text.encode("utf-8", "replace"))
        except OSError:
            self.on = False

    def __del__(self):
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)


@contextlib.contextmanager
def output_to(log_path: str | os.PathLike):
    """The block's output, the process's own (fd 1 and 2: a library's prints, a launched trainer's) and
    Python's (sys.stdout/sys.stderr, whatever they were replaced by), into the stage's log file."""
    _flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "wb", buffering=0) as log, open(log.fileno(), "w", encoding="utf-8", errors="replace",
                                                         buffering=1, closefd=False) as text:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        finally:
            _flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


# ------------------------------------------------------------------ worker side

_STAGES: dict[str, Any] = {}


def _die_with_parent(parent_pid: int) -> None:
    """Linux: this worker is killed when the study process dies, even by SIGKILL, so no stage
    goes on writing into a folder that a rerun clears."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pipe's EOF ends an idle worker
        return
    if os.getppid() != parent_pid:  # the parent died before the call
        os._exit(1)


class _Stopped(BaseException):
    """The study asked this worker to stop (SIGTERM: Ctrl-C of the study, or its failure)."""


def _stop(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the unwinding is not interrupted again
    raise _Stopped()


def _worker_main(conn, plan_args: dict[str, Any]) -> None:
    """Build the plan once; then run each stage named on `conn`, its output into its log file;
    answer None, or the exception (pickled when it can be, else its text). Ctrl-C is the study's to
    handle (it reaches the whole process group): a worker is started ignoring SIGINT and stops on the
    study's SIGTERM by unwinding and exiting normally, so what its libraries hold (multiprocessing's
    semaphores among them) is released, not reported leaked."""
    signal.signal(signal.SIGTERM, _stop)
    try:
        _serve(conn, plan_args)
    except _Stopped:
        return


def _serve(conn, plan_args: dict[str, Any]) -> None:
    _die_with_parent(plan_args["parent_pid"])
    try:
        configure_threads(plan_args["threads"])
        for path in plan_args["includes"]:
            include_tasks(path)
        if plan_args.get("grid"):  # a recipe grid: every variant's stages (pipeline/grid.py)
            plan = GridPlan(plan_args["recipe_path"], plan_args["raw"], plan_args["out"], grid=plan_args["grid"])
        else:
            plan = StudyPlan(plan_args["recipe_path"], plan_args["raw"], plan_args["out"])
        _STAGES.update((s.name, s) for s in plan.stages)
        setup_error = None
    except _Stopped:
        raise
    except BaseException as exc:  # answered for the first stage asked for
        setup_error = exc
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        name, log_path = task
        conn.send(_run_one(name, log_path, setup_error))


def _portable(exc: BaseException) -> BaseException:
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _flush() -> None:
    """Flush the stage's output into its log; a full disk loses the rest of the log, not the answer."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass


def _run_one(name: str, log_path: str, setup_error: BaseException | None):
    try:
        with output_to(log_path):
            try:
                if setup_error is not None:
                    raise setup_error
                _STAGES[name].run()
                return None
            except _Stopped:
                raise
            except BaseException as exc:
                # a full disk (the stage's files or its log) is one line for the study to print, not a dead worker
                exc = disk_error(exc, f"stage {name}: ") or exc
                if not isinstance(exc, FlipguardError):  # a bug or a crash: its traceback belongs in the log
                    try:
                        traceback.print_exc()
                    except OSError:
                        pass
                return _portable(exc)
    except OSError as exc:  # the log itself could not be opened or written
        return _portable(disk_error(exc, f"stage {name}: ") or exc)


# ------------------------------------------------------------------ parent side

# the staging folders of the workers' temp folders are named after this, in the study's log folder
WORKER_TMP = "worker-tmp"


@contextlib.contextmanager
def _environ(**values: str):
    """os.environ with `values` set for the block (what a spawned process inherits), then as it was."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class StageWorkers:
    """Up to `jobs` spawned workers, each running one stage at a time, started as stages need them
    (a rerun with little to redo starts few); `wait()` returns a finished stage.

    Each worker's temp folder ($TMPDIR: what the libraries it imports make there, wandb's
    media folders among them, which a killed process never removes) is a staging folder under
    `tmp_in` (files.staging_dir, locked by this process): removed when the worker ends, however
    it ends, and by the next study's clean_stale_staging when this process was killed too."""

    def __init__(self, jobs: int, plan_args: dict[str, Any], tmp_in: str | os.PathLike):
        self.jobs = jobs
        self.plan_args = {**plan_args, "parent_pid": os.getpid()}
        self.ctx = multiprocessing.get_context("spawn")
        self.workers: list[dict[str, Any]] = []
        self.tmp_final = Path(tmp_in) / WORKER_TMP

    @property
    def idle(self) -> int:
        return self.jobs - len(self.workers) + sum(w["stage"] is None for w in self.workers)

    def submit(self, name: str, log_path: str) -> None:
        worker = next((w for w in self.workers if w["stage"] is None), None)
        if worker is None:
            parent, child = self.ctx.Pipe()
            proc = self.ctx.Process(target=_worker_main, args=(child, self.plan_args), daemon=True)
            tmp = contextlib.ExitStack()
            folder = tmp.enter_context(staging_dir(self.tmp_final))
            tempfile.gettempdir()  # this process's own temp folder, settled before $TMPDIR changes for the start
            # started with SIGINT ignored (inherited through exec, and kept by Python): Ctrl-C reaches the whole
            # process group, and a worker still importing must not die of it with a traceback; the study stops it
            interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                with _environ(TMPDIR=str(folder)):  # a spawned process reads $TMPDIR before any code of ours runs
                    proc.start()
            except BaseException:
                tmp.close()
                raise
            finally:
                signal.signal(signal.SIGINT, interrupt)
            child.close()
            worker = {"proc": proc, "conn": parent, "stage": None, "tmp": tmp}
            self.workers.append(worker)
        worker["conn"].send((name, log_path))
        worker["stage"] = name

    def wait(self, timeout: float | None = None) -> tuple[str, BaseException | None] | None:
        """Block until a stage ends: (its name, None or the exception it raised); None when `timeout`
        seconds pass first. A worker that died (killed, out of memory) ends its stage with an error saying so."""
        busy = [w for w in self.workers if w["stage"] is not None]
        ready = wait([w["conn"] for w in busy] + [w["proc"].sentinel for w in busy], timeout)
        if not ready:
            return None
        for w in busy:
            if w["conn"] in ready:
                try:
                    return w["stage"], self._done(w, w["conn"].recv())
                except EOFError:
                    return w["stage"], self._died(w)
        for w in busy:
            if w["proc"].sentinel in ready:
                return w["stage"], self._died(w)
        raise AssertionError("wait() returned nothing ready")

    @staticmethod
    def _done(worker, result):
        worker["stage"] = None
        return result

    def _died(self, worker) -> FlipguardError:
        """The worker is gone (a later stage would start a new one); the error names its stage and how it ended."""
        worker["proc"].join(timeout=5)
        code = worker["proc"].exitcode
        self.workers.remove(worker)
        worker["tmp"].close()
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return FlipguardError(f"stage {worker['stage']}: its worker process (pid {worker['proc'].pid}) died during "
                              f"the stage ({how}); rerun the same command to resume")

    def close(self, *, terminate: bool = False) -> None:
        for w in self.workers:
            if terminate and w["proc"].is_alive():
                w["proc"].terminate()
            else:
                try:
                    w["conn"].send(None)
                except (BrokenPipeError, OSError):
                    pass
        for w in self.workers:
            w["proc"].join(timeout=30)
            if w["proc"].is_alive():
                w["proc"].kill()
                w["proc"].join()
            w["tmp"].close()
