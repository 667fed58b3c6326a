"""What makes a study's work reusable: a stage's fingerprint, and the key of a whole plan.

A stage is skipped on a rerun when its fingerprint matches the one study.json holds: a hash
of exactly what it reads (its settings, resolved from the recipe), the model's identity and
its input stages' fingerprints, and when what it wrote is still whole: each run directory's
records as its run.json lists them, and that run.json the one the stage finished with
(stage_runs_problem). A finished study rerun with the same recipe bytes, flags, watched files,
code version and base model matches its plan key, and is reported up to date without building
its stages (the quick path of `flipguard study`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from flipguard import __version__
from flipguard.eval.records import (
    RECORDS_FILE,
    RUN_CONTENTS,
    RUN_META_FILE,
    content_digest,
    load_run_meta,
    run_completeness,
)
from flipguard.files import file_sha256, git_commit
from flipguard.runtime.resolve import resolve_model


def content_sha(obj: Any) -> str:
    """16 hex digits of the JSON of `obj` (keys sorted): the same content, the same hash (a run's
    settings digest, records.content_digest)."""
    return content_digest(obj)


def file_sha(path: str | None) -> str | None:
    """16 hex digits of a file's bytes; None when there is no such file."""
    return file_sha256(path)[:16] if path and Path(path).is_file() else None


def model_identity(name: str) -> dict[str, Any]:
    """The model a stage reads: its name and, for a local folder (embedded models
    included), the size and modification time of each top-level file."""
    path = Path(resolve_model(name))
    ident: dict[str, Any] = {"name": name}
    if path.is_dir():
        ident["path"] = str(path.resolve())
        ident["files"] = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(path.iterdir()) if p.is_file()}
    return ident


def stage_fingerprints(stages: Iterable[Any]) -> dict[str, str]:
    """name -> fingerprint of each stage (in plan order: its inputs come first), from its
    name, its params and its inputs' fingerprints."""
    fps: dict[str, str] = {}
    for s in stages:
        fps[s.name] = content_sha({"stage": s.name, "params": s.params, "inputs": {i: fps[i] for i in s.inputs}})
    return fps


def plan_key(recipe: str, flags: list[str], out: str) -> str:
    """A whole study's key: code version and commit, recipe bytes, flags, study folder."""
    return content_sha({"version": __version__, "git_commit": git_commit(), "recipe": file_sha(recipe), "argv": flags,
                        "out": str(Path(out).resolve())})


def key_flags(flags: list[str], includes: list[str]) -> list[str]:
    """The flags a study's plan key holds: the command's, and its --include files."""
    return [*flags, *(f"--include={path}" for path in includes)]


def plan_unchanged(state: dict[str, Any], recipe: str, flags: list[str], out: str) -> bool:
    """study.json `state` records a finished run of this very plan: same key, same base model,
    same watched files, every stage done and its outputs present."""
    plan = state.get("plan") or {}
    if plan.get("key") != plan_key(recipe, flags, out) or plan.get("model") != model_identity(state.get("model", "")):
        return False
    if any(file_sha(path) != sha for path, sha in (plan.get("files") or {}).items()):
        return False
    stages = state.get("stages") or {}
    order = state.get("order") or []
    if not order or any((stages.get(n) or {}).get("status") != "done" for n in order):
        return False
    if not all(Path(p).exists() for n in order for p in stages[n].get("outputs", [])):
        return False
    # a run cut short since (or another one put in its place): the full path says which, and resumes
    return not any(stage_runs_problem(stages[n], Path(out)) for n in order)


def _run_dirs(entry: dict[str, Any], out: Path) -> list[str]:
    """The run directories a stage's entry names, relative to the study folder: those it recorded
    when it finished, else (a study.json from before they were recorded) the folders of its
    outputs that hold a run.json."""
    if isinstance(entry.get("runs"), dict):
        return list(entry["runs"])
    folders = dict.fromkeys(Path(p).parent for p in entry.get("outputs") or [])
    return [os.path.relpath(f, out) for f in folders if (f / RUN_META_FILE).is_file()]


def stage_runs(entry: dict[str, Any], out: Path) -> dict[str, Any]:
    """What each run directory a finished stage wrote holds (run.json's records.RUN_CONTENTS), kept
    in study.json: a later look at the stage tells its own run from another one put there."""
    return {rel: load_run_meta(out / rel).get(RUN_CONTENTS) for rel in _run_dirs(entry, out)}


def stage_runs_problem(entry: dict[str, Any], out: Path) -> tuple[str, str] | None:
    """The first run directory of a done stage that is not as the stage left it, as (kind, one
    line): "incomplete" (its records fall short of what its run.json lists: the stage resumes it)
    or "other" (its run.json lists other records or settings than the stage wrote: another run,
    never read as this one). None when every run is whole."""
    recorded = entry.get("runs") if isinstance(entry.get("runs"), dict) else {}
    for rel in _run_dirs(entry, out):
        run_dir = out / rel
        state = run_completeness(run_dir)
        written = recorded.get(rel)
        if written is not None and state.listed != written:
            there = state.listed or {}
            what = (f"settings fingerprint {there.get('settings')} there, {written.get('settings')} when the stage "
                    "finished" if there.get("settings") != written.get("settings")
                    else f"{there.get('n')} records there, {written.get('n')} when the stage finished")
            return "other", f"{run_dir}: holds another run than the one the stage wrote ({what})"
        if not state.whole:
            return "incomplete", f"{run_dir}: {state.describe()}"
        # a run from before run.json listed its records: the size study.json recorded for its records file
        size = ((entry.get("files") or {}).get(os.path.join(rel, RECORDS_FILE)) or [None])[0]
        now = (run_dir / RECORDS_FILE).stat().st_size if (run_dir / RECORDS_FILE).is_file() else 0
        if state.listed is None and isinstance(size, int) and now < size:
            return "incomplete", f"{run_dir}: incomplete ({RECORDS_FILE} is {now:,} bytes, {size:,} when the stage finished)"
    return None

