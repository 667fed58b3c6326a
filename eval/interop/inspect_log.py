"""inspect_ai eval logs in and out, through inspect_ai's own log reader, writer and types.

In: `read_inspect_log` reads a `.eval` or `.json` log with `inspect_ai.log.read_eval_log` and makes
each sample (each epoch of it) a record: id, epoch, prompt (the input messages), target, the reply
(output.completion), every scorer's Score (its value mapped to 0-1 by inspect_ai's own
`value_to_float`: "C" 1, "I" 0, "P" 0.5, "N" 0, numbers as they are; a dict value gives one score per
key, `scorer/key`), the scorer's answer and explanation, and the sample's metadata.

Out: `inspect_log` builds an `EvalLog` (EvalSpec, EvalPlan, EvalResults, EvalSample with a Score per
sample) from a flipguard run's records of one system; eval/interop/export.py writes it with
`write_eval_log`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import unquote, urlparse

from flipguard import __version__
from flipguard.errors import UserError
from flipguard.eval.interop.runs import ImportedRun, imported_record, unit_scale
from flipguard.eval.records import Record, now_iso, request_key

TOOL = "inspect_ai"
PROTOCOL = "inspect"
SCORE_NAME = "correct"  # an exported sample's score: the judgment was right


def require_inspect() -> None:
    try:
        import inspect_ai  # noqa: F401
    except ImportError:
        raise UserError("inspect_ai is not installed: pip install 'flipguard[interop]'") from None


# ------------------------------------------------------------------ in

def _message_text(message: Any) -> str:
    return message.text if hasattr(message, "text") else str(getattr(message, "content", ""))


def prompt_messages(sample_input: str | Sequence[Any]) -> list[dict[str, str]]:
    """A sample's input as flipguard's messages (role, text)."""
    if isinstance(sample_input, str):
        return [{"role": "user", "content": sample_input}]
    return [{"role": str(m.role), "content": _message_text(m)} for m in sample_input]


def score_values(scores: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """(score -> its value mapped by inspect_ai's value_to_float, score -> the value as logged, scorer ->
    explanation); a dict value gives one score per key (`scorer/key`), a list none."""
    from inspect_ai.scorer import value_to_float

    to_float = value_to_float()
    mapped: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    explanations: dict[str, str] = {}
    for name, score in (scores or {}).items():
        raw[name] = score.value
        if score.explanation:
            explanations[name] = score.explanation
        parts = score.value.items() if isinstance(score.value, Mapping) else [(None, score.value)]
        for key, value in parts:
            label = name if key is None else f"{name}/{key}"
            if value is None or isinstance(value, (list, tuple, Mapping)):
                mapped[label] = value  # not a scalar: unit_scale names it and takes it out
            else:
                mapped[label] = float(to_float(value))
    return mapped, raw, explanations


def log_files(path: Path) -> list[Path]:
    """The logs PATH names: the file, or every log inspect_ai lists in the folder (its own list_eval_logs)."""
    require_inspect()
    from inspect_ai.log import list_eval_logs

    if path.is_dir():
        found = sorted(Path(unquote(urlparse(info.name).path)) for info in list_eval_logs(str(path)))
        if not found:
            raise UserError(f"{path}: no inspect_ai log (.eval, .json) in this folder")
        return found
    if not path.is_file():
        raise UserError(f"{path}: no such file or folder (an inspect_ai log: .eval or .json, or a folder of them)")
    return [path]


def read_inspect_logs(path: Path, label: str | None = None) -> list[ImportedRun]:
    """Every log PATH names (a log, or a folder of them); a LABEL names one log only."""
    files = log_files(path)
    if label is not None and len(files) > 1:
        raise UserError(f"{path}: holds {len(files)} inspect_ai logs ({', '.join(f.name for f in files[:3])}); a label "
                        "names one: give each log its own LABEL=LOG")
    return [read_inspect_log(f, label) for f in files]


def read_inspect_log(path: Path, label: str | None = None) -> ImportedRun:
    """One inspect_ai log (.eval or .json) as an ImportedRun; a file inspect_ai cannot read, or a log without
    samples, is one line naming it."""
    require_inspect()
    from inspect_ai.log import read_eval_log

    try:
        log = read_eval_log(str(path))
    except Exception as exc:  # inspect_ai's own reader: whatever it refuses is named, not traced
        raise UserError(f"{path}: inspect_ai cannot read it as an eval log ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    why = unfinished(log)
    if not log.samples:
        raise UserError(f"{path}: the inspect_ai run did not finish ({why}) and its log holds no samples" if why else
                        f"{path}: the log holds no samples (status {log.status}; run inspect eval with samples logged)")
    spec = log.eval
    label = label or spec.model
    version = str(spec.task_version)
    records = []
    for sample in log.samples:
        messages = prompt_messages(sample.input)
        mapped, raw, explanations = score_values(sample.scores)
        answer = next((s.answer for s in (sample.scores or {}).values() if s.answer is not None), None)
        target = sample.target
        completion = sample.output.completion if sample.output is not None else None
        extra: dict[str, Any] = {"epoch": sample.epoch, "score_values": raw, "metadata": dict(sample.metadata or {}),
                                 "source_file": path.name}
        if explanations:
            extra["explanations"] = explanations
        if not isinstance(target, str):
            extra["target"] = list(target)
        if sample.error is not None:
            extra["error"] = sample.error.message
        records.append(imported_record(
            PROTOCOL, TOOL, label, spec.task, sample.id, f"epoch {sample.epoch}",
            unit=str(sample.id) if sample.epoch == 1 else f"{sample.id}#{sample.epoch}",
            signature={"task version": version,
                       "prompt": request_key(input=[[m["role"], m["content"]] for m in messages], choices=sample.choices),
                       "target": request_key(target=target)},
            scores=mapped, expected=target if isinstance(target, str) else "; ".join(target), messages=messages,
            raw_output=completion, choice=answer if answer is not None else completion, valid=sample.error is None,
            time=sample.completed_at or now_iso(), extra=extra))
    run = ImportedRun(PROTOCOL, TOOL, (spec.packages or {}).get("inspect_ai"), label, spec.model, {spec.task: version},
                      [path], records)
    run.not_compared = unit_scale(records)
    run.incomplete = why
    return run


def unfinished(log: Any) -> str:
    """Why an inspect_ai run did not finish, in a phrase ("" when it did): its status when not
    "success" (with its error), the samples that ended in an error, the samples it planned but did
    not log."""
    samples = log.samples or []
    reasons = []
    if log.status != "success":
        error = log.error.message.strip().splitlines()[0] if log.error is not None and log.error.message else ""
        reasons.append(f"status {log.status}" + (f": {error}" if error else ""))
    failed = [s for s in samples if s.error is not None]
    if failed:
        first = (failed[0].error.message or "").strip().splitlines()
        reasons.append(f"{len(failed)} of {len(samples)} samples ended in an error (sample {failed[0].id}"
                       + (f": {first[0]}" if first else "") + ")")
    planned = log.results.total_samples if log.results is not None else None
    if log.status == "success" and planned and len(samples) < planned:
        reasons.append(f"{len(samples)} of its {planned} samples logged")
    return "; ".join(reasons)


# ------------------------------------------------------------------ out

def _message(role: str, text: str):
    from inspect_ai.model import ChatMessageAssistant, ChatMessageSystem, ChatMessageUser

    kind = {"system": ChatMessageSystem, "assistant": ChatMessageAssistant}.get(role, ChatMessageUser)
    return kind(content=text)


def _json_able(value: Any) -> Any:
    """A record's value as log metadata: JSON types only (NaN as None)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_able(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_able(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def sample_ids(records: Sequence[Record]) -> list[str]:
    """A readable id per record, unique within one log: dataset/item/case, the record's key added to
    records that share one (an AFR question's challenges, a stick-or-switch chat's turns)."""
    base = [f"{r.dataset}/{r.item_id}/{r.case}" for r in records]
    counts: dict[str, int] = {}
    for b in base:
        counts[b] = counts.get(b, 0) + 1
    return [b if counts[b] == 1 else f"{b}/{r.key[:10]}" for b, r in zip(base, records)]


def inspect_log(records: Sequence[Record], *, protocol: str, system: str, meta: Mapping[str, Any],
                headline: Sequence[Mapping[str, Any]] = (), location: str = "", complete: bool = True):
    """An inspect_ai EvalLog of one system's records of a flipguard run: a sample per record (its messages,
    the reply, the target, a `correct` score: C when the judgment was right, I otherwise, with the choice
    as the answer), the run's settings as task metadata, and the protocol's own numbers (`headline`:
    comparison_long_rows) beside the accuracy in the results; status "started" for a run not `complete`."""
    require_inspect()
    from inspect_ai.log import (
        EvalConfig,
        EvalDataset,
        EvalLog,
        EvalMetric,
        EvalPlan,
        EvalPlanStep,
        EvalResults,
        EvalSample,
        EvalScore,
        EvalSpec,
        EvalStats,
    )
    from inspect_ai.model import ModelOutput
    from inspect_ai.scorer import CORRECT, INCORRECT, Score

    samples = []
    for sample_id, r in zip(sample_ids(records), records):
        prompt = [_message(m.get("role", "user"), str(m.get("content", ""))) for m in r.messages or []]
        reply = r.raw_output or ""
        samples.append(EvalSample(
            id=sample_id, epoch=1, input=prompt or "", target=r.expected or "",
            messages=[*prompt, _message("assistant", reply)] if reply else prompt,
            output=ModelOutput.from_content(model=system, content=reply),
            scores={SCORE_NAME: Score(value=CORRECT if r.correct else INCORRECT, answer=r.choice,
                                      explanation=r.reasoning, metadata=_json_able({"valid": r.valid, "p1": r.p1, "p2": r.p2}))},
            metadata=_json_able({"dataset": r.dataset, "item_id": r.item_id, "case": r.case, "split": r.split,
                                 "mode": r.mode, "mitigation": r.mitigation, "record_key": r.key, **(r.extra or {})})))
    n = len(samples)
    accuracy = sum(r.correct for r in records) / n if n else math.nan
    scores = [EvalScore(name=SCORE_NAME, scorer="flipguard", scored_samples=n, unscored_samples=0,
                        metrics={"accuracy": EvalMetric(name="accuracy", value=accuracy)})]
    if headline:
        scores.append(EvalScore(name=protocol, scorer=f"flipguard/{protocol}", metrics={
            f"{row['dataset']}/{row['metric']}" if row["dataset"] else row["metric"]: EvalMetric(
                name=f"{row['dataset']}/{row['metric']}" if row["dataset"] else row["metric"], value=float(row["value"]),
                metadata=_json_able({"ci_low": row["ci_low"], "ci_high": row["ci_high"], "n": row["n"], "unit": row["unit"],
                                     # not meaningful (too few valid judgments): no value, and why
                                     **({} if row.get("meaningful", True) else
                                        {"meaningful": False, "n_valid": row.get("n_valid")})}))
            for row in headline}))
    datasets = sorted({r.dataset for r in records})
    created = str(meta.get("created") or now_iso())
    ident = request_key(run=location, system=system, created=created)
    spec = EvalSpec(eval_id=ident[:22], run_id=ident[:22], task_id=request_key(protocol=protocol, datasets=datasets)[:22],
                    created=created, task=f"flipguard/{protocol}", task_version=0,
                    dataset=EvalDataset(name=", ".join(datasets), samples=n, sample_ids=[s.id for s in samples]),
                    model=system, config=EvalConfig(epochs=1), packages={"flipguard": __version__},
                    metadata=_json_able({"flipguard_run": location, **{k: v for k, v in meta.items() if k != "invocations"}}))
    plan = EvalPlan(name="flipguard", steps=[EvalPlanStep(solver=f"flipguard {protocol}", params=_json_able(
        {k: meta.get(k) for k in ("mode", "mitigation", "template", "backend", "split") if meta.get(k) is not None}))])
    return EvalLog(status="success" if complete else "started", eval=spec, plan=plan,
                   results=EvalResults(total_samples=n, completed_samples=n, scores=scores),
                   stats=EvalStats(started_at=created, completed_at=str(meta.get("updated") or created)), samples=samples)


def write_log(log: Any, path: Path) -> None:
    """inspect_ai's writer, into `path` (a temp file beside the final one: the caller renames it)."""
    from inspect_ai.log import write_eval_log

    try:
        write_eval_log(log, str(path), format="eval")
    except OSError as exc:
        raise UserError(f"{path}: cannot write the inspect_ai log ({exc.strerror or exc})") from None
