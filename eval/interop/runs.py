"""What every importer shares: a run another tool made as flipguard records (`ImportedRun`), its
scores on flipguard's 0-1 scale, the check that the runs of one task hold the same items, and the
one writer of an imported run folder (`write_imported`: the run lock, records.jsonl, run.json).

A record per sample (per epoch; per lm-eval filter): item_id = the tool's sample id, dataset = its
task, model = the run's label (the system), expected = the target, choice = the answer, raw_output =
the reply, messages = the prompt; in `extra` the scores (mapped to 0-1, and as the tool kept them),
the sample's metadata, `unit` (what pairs it across runs: the id, and the epoch past the first) and
`signature` (task version, prompt and target hashes: what must match for two runs to be paired).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping

from flipguard.errors import UserError
from flipguard.eval import paired as P
from flipguard.eval.interop.protocol import IMPORTED_MODE
from flipguard.eval.records import INCOMPLETE, RECORDS_FILE, Record, RecordStore, now_iso, open_run_dir, request_key
from flipguard.files import check_own_folder, file_sha256


@dataclasses.dataclass
class ImportedRun:
    """One run of one model another tool made (an inspect_ai log; an lm-eval results file with its
    samples), as records, and where it came from (run.json's `sources`)."""

    protocol: str  # the flipguard task its records belong to: "inspect" or "lm-eval"
    tool: str  # "inspect_ai", "lm-eval"
    tool_version: str | None
    label: str  # the system's name in the run folder: given (LABEL=PATH), else the model's
    model: str  # the model as the tool names it
    tasks: dict[str, str]  # task -> its version, as the tool records it
    files: list[Path]  # the files read
    records: list[Record]
    not_compared: dict[str, str] = dataclasses.field(default_factory=dict)  # score -> why it has no 0-1 value
    incomplete: str = ""  # why the tool's run did not finish ("status error (...)"); "" when it did

    def source(self) -> dict[str, Any]:
        """run.json's entry for this run: tool, version, model, tasks, each file with its sha256, and
        `incomplete` (why the run did not finish) for a run imported with --allow_incomplete."""
        return {"label": self.label, "tool": self.tool, "tool_version": self.tool_version, "model": self.model,
                "tasks": self.tasks, "files": [{"path": str(f.resolve()), "sha256": file_sha256(f)} for f in self.files],
                "samples": len(self.records), "not_compared": self.not_compared,
                **({"incomplete": self.incomplete} if self.incomplete else {}), "imported_at": now_iso()}


def refuse_incomplete(runs: Iterable[ImportedRun], allowed: bool) -> None:
    """A run that did not finish is never imported as complete: refused in one line naming its file and
    why (its status, its samples' errors, the samples it lacks), unless the import allows it
    (--allow_incomplete: run.json then says `complete: false` and why, and every reader marks it)."""
    for run in runs:
        if run.incomplete and not allowed:
            raise UserError(f"{run.files[0]}: the {run.tool} run did not finish ({run.incomplete}); nothing was "
                            "imported (--allow_incomplete imports it marked incomplete)")


def split_label(arg: str) -> tuple[str | None, Path]:
    """'LABEL=PATH' -> (LABEL, PATH); a bare PATH (or one that exists with '=' in its name) -> (None, PATH)."""
    label, sep, path = arg.partition("=")
    if not sep or Path(arg).exists():
        return None, Path(arg)
    if not label.strip() or not path.strip():
        raise UserError(f"{arg!r}: expected LABEL=PATH or PATH")
    if "," in label or "@" in label:
        raise UserError(f"{arg!r}: a label names a system in `flipguard compare --runs 'NAME=RUN@LABEL'`: no ',' or '@'")
    return label.strip(), Path(path.strip())


def imported_record(protocol: str, tool: str, label: str, task: str, sample_id: Any, case: str, *, unit: str,
                    signature: Mapping[str, str], scores: Mapping[str, Any], **fields: Any) -> Record:
    """A sample as a record, keyed by (protocol, label, task, sample, case): importing it again adds nothing."""
    extra = {"unit": unit, "signature": dict(signature), "scores": dict(scores), **fields.pop("extra", {})}
    key = request_key(protocol=protocol, model=label, dataset=task, item_id=str(sample_id), case=case)
    return Record(key=key, protocol=protocol, item_id=str(sample_id), dataset=task, case=case, model=label,
                  backend=tool, mode=IMPORTED_MODE, extra=extra, **fields)


def unit_scale(records: Iterable[Record]) -> dict[str, str]:
    """Keep the scores every record of a run has on flipguard's 0-1 scale (a mean and a paired change in
    pp mean nothing for a score of 0-10); the others are taken out of extra["scores"] (their values stay
    in extra["score_values"]). Returns score -> why it was taken out."""
    records = list(records)
    reasons: dict[str, str] = {}
    for r in records:
        for name, value in (r.extra.get("scores") or {}).items():
            if _unscored(value) or name in reasons:
                continue
            if not isinstance(value, (int, float)):  # a bool is 0 or 1
                reasons[name] = f"not a number ({type(value).__name__})"
            elif not 0.0 <= value <= 1.0:
                reasons[name] = f"values outside 0-1 (e.g. {value:g})"
    for r in records:
        scores = r.extra.get("scores") or {}
        r.extra["scores"] = {k: (None if _unscored(v) else float(v)) for k, v in scores.items() if k not in reasons}
    return reasons


def _unscored(value: Any) -> bool:
    """No score for this sample (an error, a scorer that gave none): left out of its pairs, not a zero."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def signatures(records: Iterable[Record]) -> dict[tuple[str, str], dict[str, dict[str, str]]]:
    """(task, label) -> {unit: signature}."""
    out: dict[tuple[str, str], dict[str, dict[str, str]]] = defaultdict(dict)
    for r in records:
        out[(r.dataset, r.model)][str(r.extra.get("unit", r.item_id))] = r.extra.get("signature") or {}
    return out


def check_same_items(records: Iterable[Record], where: Mapping[str, str] | None = None) -> None:
    """Every label's samples of a task must be the first label's: the same ids with the same task version,
    prompts and targets; else one line naming the task, both labels (and their files) and what differs."""
    by_task: dict[str, list[tuple[str, dict[str, dict[str, str]]]]] = defaultdict(list)
    for (task, label), items in signatures(records).items():
        by_task[task].append((label, items))
    where = where or {}
    for task, runs in by_task.items():
        (first, first_items), *others = runs
        for label, items in others:
            problem = P.item_mismatch(first_items, items, names=(first, label))
            if problem:
                files = " and ".join(f"{n} ({where[n]})" for n in (first, label) if n in where) or f"{first} and {label}"
                raise UserError(f"task {task}: {files} are not runs of the same items, so they cannot be paired: {problem}; "
                                "nothing was imported")


def _content(r: Record) -> dict[str, Any]:
    """What a sample says, not when or from which file it was read."""
    e = r.extra or {}
    return {"messages": r.messages, "raw_output": r.raw_output, "choice": r.choice, "expected": r.expected,
            "valid": r.valid, "scores": e.get("scores"), "score_values": e.get("score_values"), "signature": e.get("signature")}


def write_imported(runs: list[ImportedRun], out: str | Path) -> dict[str, Any]:
    """Every run's records into the run folder `out` (created, or one of the same protocol that flipguard
    wrote), after every check, so a refused import leaves `out` as it was: one run per label and task;
    the runs of a task (these and those `out` holds) on the same items; a sample `out` already holds
    under the same label with other content refused. Returns {"added": n, "records": n, "runs": [labels]}."""
    out = Path(out)
    protocol = runs[0].protocol
    seen: dict[tuple[str, str], Path] = {}
    for run in runs:
        for task in run.tasks:
            other = seen.setdefault((run.label, task), run.files[0])
            if other != run.files[0]:
                raise UserError(f"{other} and {run.files[0]} are both task {task} under the label {run.label!r}: name "
                                "them apart (LABEL=PATH); nothing was imported")
    records = [r for run in runs for r in run.records]
    where = {run.label: run.files[0].name for run in runs}
    check_same_items(records, where)  # before the lock: a clear refusal, nothing created
    check_own_folder(out)
    with open_run_dir(out, protocol) as run_dir:
        store = RecordStore(out / RECORDS_FILE)
        stored = list(store.stored.values())
        check_same_items([*stored, *records], where)
        for r in records:
            old = store.stored.get(r.key)
            if old is not None and _content(old) != _content(r):
                raise UserError(f"{out}: already holds {r.model!r}'s sample {r.item_id} of task {r.dataset} ({r.case}) "
                                "with other content: import this run under another label (LABEL=PATH) or into another "
                                "--out; nothing was imported")
        added = store.append(records)
        meta = dict(run_dir.old)
        labels = list(dict.fromkeys([*(meta.get("models") or []), *(run.label for run in runs)]))
        tasks = sorted({*(meta.get("datasets") or []), *(t for run in runs for t in run.tasks)})
        again = {(run.label, str(run.files[0].resolve())) for run in runs}  # a run imported again: its entry replaced
        sources = [s for s in meta.get("sources") or [] if (s.get("label"), (s.get("files") or [{}])[0].get("path")) not in again]
        sources += [run.source() for run in runs]
        unfinished = {s["label"]: s["incomplete"] for s in sources if s.get("incomplete")}
        meta.pop(INCOMPLETE, None)
        meta.update(tool=runs[0].tool, mode=IMPORTED_MODE, models=labels, datasets=tasks, sources=sources,
                    updated=now_iso(), complete=not unfinished, **({INCOMPLETE: unfinished} if unfinished else {}))
        run_dir.write_meta(meta)
    return {"added": added, "records": len(records), "runs": [run.label for run in runs]}
