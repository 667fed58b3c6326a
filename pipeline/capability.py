"""Capability guard: did a mitigation cost general knowledge? MMLU accuracy of the base model and of
every merged model, measured by lm-evaluation-harness (its Python API: `lm_eval.simple_evaluate`)
on a local task built from the MMLU data flipguard ships for AFR (data/samples/mmlu, or the
recipe's data root): no hub download.

The task is written as lm-eval's own YAML (a `json` dataset of local files, multiple_choice over
the option letters, the harness's MMLU prompt) into the stage's folder and loaded with
`TaskManager(include_path=...)`. Per-question results (log_samples) go to units.csv, which the
transfer report pairs with the baseline's on the same questions: a cell `capability:mmlu:lm-eval`,
role untargeted, with a paired 95% CI and McNemar's p, beside the sycophancy metrics.

    flipguard study RECIPE            # with eval.capability: true (eval.capability_limit: questions)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from flipguard.data.mmlu import load_mmlu, sample_uniform
from flipguard.errors import UserError
from flipguard.files import atomic_write_text
from flipguard.runtime.resolve import resolve_model

TASK = "flipguard_mmlu"
UNITS_FILE = "units.csv"
PROTOCOL, DATASET, FRAMING = "capability", "mmlu", "lm-eval"
LETTERS = ("A", "B", "C", "D", "E", "F")
TASK_YAML = """# written by flipguard (pipeline/capability.py): MMLU from local files, lm-eval's MMLU prompt
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question.strip()}}}}\\n{{% for c in choices %}}{{{{'ABCDEF'[loop.index0]}}}}. {{{{c}}}}\\n{{% endfor %}}Answer:"
doc_to_choice: "{{{{'ABCDEF'[:choices|length]|list}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(folder: Path, per_subject: int | None, data_root: str | None, seed: int = 0,
               limit: int | None = None) -> Path:
    """The local MMLU task (YAML + JSONL) in folder, `per_subject` questions of each subject (seeded; the
    first `limit` of them); returns the folder (TaskManager's include_path)."""
    items = load_mmlu("test", data_root)
    if per_subject is not None:
        items = sample_uniform(items, per_subject, seed)
    items = items[:limit]
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    atomic_write_text(data, "".join(json.dumps({"id": it.id, "subject": it.subject, "question": it.question,
                                                "choices": list(it.options), "answer": LETTERS.index(it.answer)})
                                    + "\n" for it in items))
    atomic_write_text(folder / f"{TASK}.yaml", TASK_YAML.format(task=TASK, data=json.dumps(str(data.resolve()))))
    return folder


def evaluate_model(model: str, task_dir: Path, *, device: str | None = None, batch_size: int = 8,
                   dtype: str = "float32") -> list[dict[str, Any]]:
    """One model's per-question results [{id, acc}] on the local task, through lm_eval.simple_evaluate."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("eval.capability needs lm-evaluation-harness: pip install 'flipguard[capability]'") from None
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task's data are local files
    path = resolve_model(model)
    args = f"pretrained={path},dtype={dtype}"
    results = lm_eval.simple_evaluate(model="hf", model_args=args, tasks=[TASK], batch_size=batch_size,
                                      task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                      log_samples=True, num_fewshot=0, device=device)
    return [{"id": s["doc"]["id"], "acc": float(s["acc"])} for s in results["samples"][TASK]]


def run_capability(models: Mapping[str, str], out: Path, *, per_subject: int | None = None, data_root: str | None = None,
                   device: str | None = None, batch_size: int = 8, limit: int | None = None) -> Path:
    """Every condition's per-question accuracy into out/units.csv (condition, key, cluster, value)."""
    task_dir = write_task(out / "task", per_subject, data_root, limit=limit)
    rows = []
    for condition, model in models.items():
        results = evaluate_model(model, task_dir, device=device, batch_size=batch_size)
        atomic_write_text(out / f"{condition.replace(' ', '_')}.json", json.dumps(results))
        rows += [{"condition": condition, "key": r["id"], "cluster": r["id"], "value": r["acc"]} for r in results]
    frame = pd.DataFrame(rows, columns=["condition", "key", "cluster", "value"])
    atomic_write_text(out / UNITS_FILE, frame.to_csv(index=False))
    return out / UNITS_FILE


def capability_units(units_csv: str | Path | None, conditions: Sequence[str]) -> list[dict[str, Any]]:
    """units.csv as transfer units (protocol capability, dataset mmlu, framing lm-eval), for the conditions given."""
    if not units_csv or not Path(units_csv).is_file():
        return []
    frame = pd.read_csv(units_csv, dtype={"key": str, "cluster": str})
    return [{"condition": r.condition, "protocol": PROTOCOL, "system": r.condition, "dataset": DATASET, "kind": "",
             "framing": FRAMING, "metric": "accuracy", "key": r.key, "cluster": r.cluster, "value": float(r.value),
             "judgments": (float(r.value),)} for r in frame.itertuples() if r.condition in conditions]
