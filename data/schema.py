"""The one item schema every DDS loader produces.

A Unified Benchmark item and an r/AIO item both reduce to: a piece of content, a
claim that is correct and a claim that is incorrect. Prompts, pairs and metrics only
ever see this shape, so a new dataset needs a loader and nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from pathlib import Path
from typing import Any, Iterable

from flipguard.errors import FlipguardError
from flipguard.files import iter_lines, loads_json

# Unified Benchmark order as in the paper's Table 1 (nine datasets), then TruthfulQA.
BENCHMARK_DATASETS = (
    "truthfulqa",
    "halueval_qa",
    "plausibleqa",
    "bbq",
    "socialiqa",
    "amqa",
    "harp_mcq",
    "gpqa",
    "advisorqa",
)
AIO_DATASET = "aio"
ALL_DATASETS = BENCHMARK_DATASETS + (AIO_DATASET,)

# Human-readable domain per dataset (paper Table 20 "Domain" column).
DOMAINS = {
    "aio": "Real-world",
    "advisorqa": "Advice",
    "halueval_qa": "Hallucination",
    "bbq": "Bias",
    "plausibleqa": "Plausibility",
    "truthfulqa": "Factuality",
    "socialiqa": "Social",
    "amqa": "Medical",
    "harp_mcq": "Math",
    "gpqa": "Science",
}

# Datasets used only for evaluation (never in a train split).
EVAL_ONLY_DATASETS = ("truthfulqa", "aio")


class DataError(FlipguardError, ValueError):
    """Bad input data; the message names the file and the line or item."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One evaluation item: the same content with a correct and an incorrect claim.

    For the Unified Benchmark `question` is the question and the answers are answer
    strings. For r/AIO `question` is the neutralised context, `dialogue` the
    conversation prose, and the answers are the judgments about Speaker A
    ("overreacting" / "not overreacting"), already inverted from the community's
    verdict on the original poster (Speaker B).
    """

    id: str
    dataset: str
    question: str
    correct_answer: str
    incorrect_answer: str
    split: str = "test"
    domain: str = ""
    dialogue: str | None = None  # r/AIO only
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "Item":
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row})


def normalise_question(text: str) -> str:
    """Question text reduced for leakage checks: NFKC, case-folded, punctuation and
    whitespace collapsed, so trivially reformatted duplicates still collide."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = re.sub(r"[^\w]+", " ", text)
    return " ".join(text.split())


def check_no_lone_surrogate(row: dict[str, Any], where: str) -> None:
    """A dataset row holding a lone surrogate (a \\uD800-\\uDFFF escape alone): no text a tokenizer
    can read, so one line naming file:line here, not a tokenizer traceback mid-run. (Records
    imported from released outputs keep theirs: they are hashed, never tokenized.)"""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: holds a lone surrogate ({exc.object[exc.start:exc.end]!a}), which is not text a "
                        "tokenizer can read; fix or drop the row") from None


def parse_jsonl_lines(lines: Iterable[str], source) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs; a malformed line raises DataError naming source and line."""
    rows: list[tuple[int, dict[str, Any]]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = loads_json(line, f"{source}:{lineno}", DataError)
        except json.JSONDecodeError as exc:
            raise DataError(f"{source}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{source}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append((lineno, row))
    if not rows:
        raise DataError(f"{source}: file is empty")
    return rows


def read_jsonl(path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs of a JSONL file; see parse_jsonl_lines. Bytes that are
    not UTF-8 raise DataError naming file:line, as does a missing or unreadable file."""
    if not Path(path).is_file():
        raise DataError(f"{path}: file not found")
    return parse_jsonl_lines(iter_lines(path, DataError), path)


def read_item_rows(path: Path, to_item) -> list[Item]:
    """Items from a JSONL file via to_item(row, where); ids must be unique in the file."""
    items: list[Item] = []
    first_line: dict[str, int] = {}
    for lineno, row in read_jsonl(path):
        check_no_lone_surrogate(row, f"{path}:{lineno}")
        item = to_item(row, f"{path}:{lineno}")
        if item.id in first_line:
            raise DataError(f"{path}:{lineno}: duplicate id {item.id!r} (first on line {first_line[item.id]})")
        first_line[item.id] = lineno
        items.append(item)
    return items


def require_text(row: dict[str, Any], key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {key!r} is missing or empty")
    return value


def item_from_row(row: dict[str, Any], dataset: str, split: str, where: str) -> Item:
    """A row in Item format (id, question, correct_answer, incorrect_answer; dataset and split
    given by the file that holds it), checked field by field: a bad row names file:line."""
    for key in ("id", "question", "correct_answer", "incorrect_answer"):
        require_text(row, key, where)
    if row.get("dataset", dataset) != dataset:  # the name comes from the entry file; a row need not repeat it
        raise DataError(f"{where}: row says dataset {row.get('dataset')!r} but the file holds {dataset!r}")
    if row.get("split", split) != split:
        raise DataError(f"{where}: row is split {row.get('split')!r}, expected {split!r}")
    if row["correct_answer"].strip() == row["incorrect_answer"].strip():
        raise DataError(f"{where}: correct_answer and incorrect_answer are identical")
    if not isinstance(row.get("meta", {}), dict):
        raise DataError(f"{where}: field 'meta' must be an object")
    try:
        return Item.from_dict({**row, "dataset": dataset, "split": split})
    except (TypeError, KeyError) as exc:
        raise DataError(f"{where}: not an Item row ({exc})") from None
