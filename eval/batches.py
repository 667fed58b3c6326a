"""The requests a task hands the runner (`Batch`), checked as they arrive: a user's task that
yields None, a list, dicts or string messages is one line naming its file, not an error deep
in the runner.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Generator, Sequence

from flipguard.errors import UserError
from flipguard.eval.backends.base import GenerationConfig
from flipguard.eval.records import Record
from flipguard.eval.runner import MODES, Parser

if TYPE_CHECKING:  # annotations only: eval/task.py imports this module
    from flipguard.eval.task import Task


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


def _class_file(cls: type) -> str:
    module = sys.modules.get(cls.__module__)
    return str(getattr(module, "__file__", None) or cls.__module__)
