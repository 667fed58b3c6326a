"""lm-evaluation-harness `--log_samples` output in: `lm_eval --log_samples --output_path DIR` writes, per
model, DIR/<model>/results_<date>.json (the run: model, tasks and their versions, n-shot, configs) and
beside it samples_<task>_<date>.jsonl (one line per document and filter: doc_id, doc, target, the
requests' arguments, the responses, each metric's value, and lm-eval's own doc_hash, prompt_hash and
target_hash). The files are found and named by lm-eval's own helpers (lm_eval.utils); a run is one
results file with its samples files.

A line becomes a record: item_id = doc_id, case = the filter, the prompt (the first request's
context), the target, the answer (multiple choice: the continuation with the highest log-likelihood;
generation: the filtered reply), every per-sample metric (those in 0-1 are compared), and the
signature lm-eval's hashes give (prompt, document, target) with the task's version and n-shot.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

from flipguard.errors import UserError
from flipguard.eval.interop.runs import ImportedRun, imported_record, unit_scale
from flipguard.files import iter_lines, read_text

TOOL = "lm-eval"
PROTOCOL = "lm-eval"


def _lm_eval_utils():
    try:
        from lm_eval import utils
    except ImportError:
        raise UserError("lm-evaluation-harness is not installed: pip install 'flipguard[interop]'") from None
    return utils


def find_runs(path: Path) -> list[tuple[Path, dict[str, Path]]]:
    """Every lm-eval run under PATH (the --output_path folder, a model's folder, or one results file):
    (its results file, task -> its samples file)."""
    utils = _lm_eval_utils()
    if not path.exists():
        raise UserError(f"{path}: no such file or folder (lm_eval's --output_path)")
    names = [p.as_posix() for p in sorted(path.rglob("*.json*") if path.is_dir() else [path]) if p.is_file()]
    results = [Path(f) for f in utils.get_results_filenames(names)]
    if not results:
        raise UserError(f"{path}: no lm-eval results file (results_<date>.json) found; point at lm_eval's --output_path")
    samples = [Path(f) for f in utils.get_sample_results_filenames(names) if f.endswith(".jsonl")]
    runs = []
    for result in results:
        date = result.stem.removeprefix("results_")
        runs.append((result, {utils.get_file_task_name(s.name): s for s in samples
                              if s.parent == result.parent and utils.get_file_datetime(s.name) == date}))
    return runs


def _answer(line: dict[str, Any], output_type: str | None) -> tuple[str | None, str | None]:
    """(the answer, the reply as text) of one sample line."""
    resps = line.get("filtered_resps")
    args = line.get("arguments") or {}
    if output_type == "multiple_choice" and isinstance(resps, list) and resps:
        try:
            scores = [float(r[0] if isinstance(r, list) else r) for r in resps]
        except (TypeError, ValueError, IndexError):
            return None, json.dumps(resps)
        best = max(range(len(scores)), key=scores.__getitem__)
        continuation = (args.get(f"gen_args_{best}") or {}).get("arg_1")
        return (continuation.strip() if isinstance(continuation, str) else str(best)), continuation
    if output_type == "generate_until":
        text = resps[0] if isinstance(resps, list) and resps else resps
        return (None, None) if text is None else (str(text), str(text))
    return None, None if resps is None else json.dumps(resps)


def _load_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(read_text(path, UserError, "lm-eval results file"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("configs"), dict):
        raise UserError(f"{path}: not an lm-eval results file (no 'configs')")
    return doc


def read_lm_eval_run(results_file: Path, samples_files: dict[str, Path], label: str | None = None) -> ImportedRun:
    """One lm-eval run (one model: a results file and its tasks' samples files) as an ImportedRun."""
    results = _load_json(results_file)
    model = str(results.get("model_name") or (results.get("config") or {}).get("model") or results_file.parent.name)
    label = label or model
    tasks = {}
    records = []
    for task, config in results["configs"].items():
        samples_file = samples_files.get(task)
        if samples_file is None:
            raise UserError(f"{results_file}: no samples for task {task} (samples_{task}_<date>.jsonl beside it): run "
                            "lm_eval with --log_samples")
        version = str((results.get("versions") or {}).get(task, config.get("metadata", {}).get("version")))
        n_shot = str((results.get("n-shot") or {}).get(task, config.get("num_fewshot")))
        tasks[task] = version
        for lineno, text in enumerate(iter_lines(samples_file), start=1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
                doc_id = line["doc_id"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UserError(f"{samples_file}:{lineno}: not an lm-eval sample line ({type(exc).__name__}: {exc})") from None
            flt = str(line.get("filter") or "none")
            raw = {m: line.get(m) for m in line.get("metrics") or []}
            scores = {(m if flt == "none" else f"{m},{flt}"): v for m, v in raw.items()}  # unit_scale checks them
            answer, reply = _answer(line, config.get("output_type"))
            prompt = ((line.get("arguments") or {}).get("gen_args_0") or {}).get("arg_0")
            records.append(imported_record(
                PROTOCOL, TOOL, label, task, doc_id, flt, unit=str(doc_id),
                signature={"task version": version, "n-shot": n_shot, "prompt": line.get("prompt_hash"),
                           "document": line.get("doc_hash"), "target": line.get("target_hash")},
                scores=scores, expected=None if line.get("target") is None else str(line["target"]),
                messages=[{"role": "user", "content": str(prompt)}] if prompt is not None else None,
                raw_output=reply, choice=answer, valid=answer is not None or reply is not None,
                time=_date(results), extra={"score_values": raw, "doc": line.get("doc"), "filter": flt,
                                            "source_file": samples_file.name, "source_line": lineno}))
    files = [results_file, *(samples_files[t] for t in tasks)]
    run = ImportedRun(PROTOCOL, TOOL, results.get("lm_eval_version"), label, model, tasks, files, records)
    run.not_compared = unit_scale(records)
    run.incomplete = missing_samples(results, records)
    return run


def missing_samples(results: dict[str, Any], records: list[Any]) -> str:
    """The documents a run evaluated (its results' n-samples, "effective": after --limit) that its samples
    files lack, in a phrase per task ("" when every one is there)."""
    found: dict[str, set[str]] = {}
    for r in records:
        found.setdefault(r.dataset, set()).add(r.item_id)
    reasons = []
    for task, count in (results.get("n-samples") or {}).items():
        planned = count.get("effective") if isinstance(count, dict) else None
        have = len(found.get(task, ()))
        if task in results["configs"] and isinstance(planned, int) and have < planned:
            reasons.append(f"task {task}: {have} of its {planned} documents in its samples file")
    return "; ".join(reasons)


def _date(results: dict[str, Any]) -> str:
    """When lm-eval ran (its results' `date`, seconds since the epoch), as run.json writes times."""
    when = results.get("date")
    if isinstance(when, (int, float)) and math.isfinite(when):
        return dt.datetime.fromtimestamp(when, dt.timezone.utc).isoformat(timespec="seconds")
    return ""


def read_lm_eval_output(path: Path, label: str | None = None) -> list[ImportedRun]:
    """Every lm-eval run under PATH; a LABEL names one run only."""
    found = find_runs(path)
    if label is not None and len(found) > 1:
        raise UserError(f"{path}: holds {len(found)} lm-eval runs ({', '.join(str(r) for r, _ in found[:3])}); a label "
                        "names one: give each results file (or model folder) its own LABEL=PATH")
    return [read_lm_eval_run(result, samples, label) for result, samples in found]
