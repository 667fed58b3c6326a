"""MedQA (USMLE, 4 options) as multiple-choice items for the stick-or-switch evaluation.

Only the test file of MedQA is in the shared data, so the few-shot exemplars cannot come
from an upstream dev split. Instead a fixed *exemplar pool* is held out of it: the
`POOL_SIZE` valid items whose normalised question has the smallest SHA-256 (a rule that
does not depend on file order), shipped as `data/samples/medqa/fewshot_pool.jsonl`. The
"test" split is the file minus every pool question, so exemplars are always disjoint from
the evaluated items. The same rule builds the MedMCQA pool (data/medmcqa.py).

Data root: explicit argument > $FLIPGUARD_DATA > the shipped samples; a root has the
layout of the shared data folder (`medqa/phrases_no_exclude_test.jsonl`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import unicodedata
from pathlib import Path
from typing import Any, Callable, Iterable

from flipguard.data.mmlu import MCQItem  # one item shape with the MMLU loader
from flipguard.data.roots import resolve_data_root
from flipguard.data.schema import DataError, normalise_question, read_jsonl
from flipguard.files import atomic_write_text, shipped_sample

log = logging.getLogger("flipguard.data")

DATASET = "medqa"
TEST_FILE = "phrases_no_exclude_test.jsonl"
POOL_FILE = "fewshot_pool.jsonl"
POOL_SIZE = 12
SPLITS = ("test", "fewshot")
LETTERS = "ABCDEFGHIJ"



def make_item(**fields: Any) -> MCQItem:
    """An MCQItem from the fields its class has (the shared class may grow fields)."""
    names = {f.name for f in dataclasses.fields(MCQItem)}
    return MCQItem(**{k: v for k, v in fields.items() if k in names})


def samples_root() -> Path:
    return Path(__file__).resolve().parent / "samples"


def resolve_root(data_root: str | Path | None) -> Path:
    """Explicit argument > $FLIPGUARD_DATA > the shipped samples."""
    return resolve_data_root(data_root)


def question_hash(question: str) -> str:
    return hashlib.sha256(normalise_question(question).encode("utf-8")).hexdigest()


def option_key(text: str) -> str:
    """Option text for duplicate checks: NFKC, case-folded, whitespace collapsed, no
    trailing full stop (symbols kept: "↓ ↑ ↓" and "↓ ↓ ↓" differ)."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split()).rstrip(".").strip()


def distinct_distractors(options: list[str], answer_index: int) -> list[str]:
    """Wrong options with duplicates (after whitespace/case folding) removed, in option order."""
    answer_norm = option_key(options[answer_index])
    seen: set[str] = set()
    out: list[str] = []
    for i, text in enumerate(options):
        norm = option_key(text)
        if i == answer_index or norm == answer_norm or norm in seen:
            continue
        seen.add(norm)
        out.append(text)
    return out


def check_item(item: MCQItem, where: str) -> None:
    """An item stick-or-switch can use: an answer key among its options and at least two
    distinct distractors (one to start the conversation, one to offer)."""
    if not isinstance(item.question, str) or not item.question.strip():
        raise DataError(f"{where}: item {item.id}: question is missing or empty")
    if not item.answer or item.answer not in LETTERS[: len(item.options)]:
        raise DataError(f"{where}: item {item.id}: missing or invalid answer key {item.answer!r}")
    for letter, text in zip(LETTERS, item.options):
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: item {item.id}: option {letter} is missing or empty")
    index = LETTERS.index(item.answer)
    answer_norm = option_key(item.options[index])
    if any(option_key(t) == answer_norm for i, t in enumerate(item.options) if i != index):
        raise DataError(f"{where}: item {item.id}: the answer text also appears as another option")
    if len(distinct_distractors(item.options, index)) < 2:
        raise DataError(f"{where}: item {item.id}: fewer than two distinct distractors")


def validated(
    rows: Iterable[tuple[str, Any]],
    convert: Callable[[Any, str], MCQItem],
    skip_invalid: bool,
) -> list[MCQItem]:
    """Convert and check rows; a bad row raises, or with skip_invalid is left out *with a
    warning naming it* (never silently)."""
    items: list[MCQItem] = []
    for where, row in rows:
        try:
            item = convert(row, where)
            check_item(item, where)
        except DataError as exc:
            if not skip_invalid:
                raise DataError(f"{exc} (pass skip_invalid / --skip_invalid_items to leave such items out)") from None
            log.warning("skipping invalid item: %s", exc)
            continue
        items.append(item)
    return items


def _convert_medqa(row: dict, where: str, split: str = "test") -> MCQItem:
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: question is missing or empty")
    item_id = f"medqa-{question_hash(question)[:12]}"
    options = row.get("options")
    if not isinstance(options, dict) or not options:
        raise DataError(f"{where}: item {item_id}: field 'options' is missing")
    letters = sorted(options)
    if "".join(letters) != LETTERS[: len(letters)]:
        raise DataError(f"{where}: item {item_id}: option letters {letters} are not A.. in order")
    answer = row.get("answer_idx")
    if not isinstance(answer, str) or answer not in options:
        raise DataError(f"{where}: item {item_id}: missing or invalid answer key {answer!r}")
    if isinstance(row.get("answer"), str) and row["answer"].strip() != str(options[answer]).strip():
        raise DataError(f"{where}: item {item_id}: 'answer' text does not match option {answer}")
    return make_item(
        id=item_id,
        subject=str(row.get("meta_info") or ""),
        category="medical",
        question=question,
        options=[options[k] for k in letters],
        answer=answer,
        dataset=DATASET,
        split=split,
    )


def _pool_questions(pool: list[MCQItem]) -> set[str]:
    return {normalise_question(it.question) for it in pool}


def load_pool(dataset: str, convert, data_root: Path) -> list[MCQItem]:
    """The exemplar pool: the data root's own pool file if it has one, else the shipped one."""
    path = data_root / dataset / POOL_FILE
    if not path.exists():
        path = samples_root() / dataset / POOL_FILE
    return validated(((f"{path}:{n}", row) for n, row in read_jsonl(path)), convert, skip_invalid=False)


def load_medqa(split: str = "test", data_root: str | Path | None = None, skip_invalid: bool = False) -> list[MCQItem]:
    """MedQA-USMLE 4-option items. split "test": the evaluated items (test file minus the
    exemplar pool); "fewshot": the exemplar pool."""
    if split not in SPLITS:
        raise DataError(f"medqa: unknown split {split!r}; expected one of {SPLITS}")
    root = resolve_root(data_root)
    pool = load_pool(DATASET, lambda row, where: _convert_medqa(row, where, "fewshot"), root)
    if split == "fewshot":
        return pool
    path = root / DATASET / TEST_FILE
    if not path.exists():
        raise DataError(f"{path}: MedQA test file not found under data root {root}")
    held_out = _pool_questions(pool)
    rows = ((f"{path}:{n}", row) for n, row in read_jsonl(path))
    items = validated(rows, _convert_medqa, skip_invalid)
    return [it for it in items if normalise_question(it.question) not in held_out]


def write_samples(full_root: str | Path, n_test: int = 24) -> None:
    """Regenerate data/samples/medqa from the full file: the pool and the next `n_test`
    items by question hash, as verbatim upstream lines."""
    path = Path(full_root) / DATASET / TEST_FILE
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    ranked = sorted(lines, key=lambda ln: question_hash(json.loads(ln)["question"]))
    out = samples_root() / DATASET
    pool, test = set(ranked[:POOL_SIZE]), set(ranked[POOL_SIZE : POOL_SIZE + n_test])
    atomic_write_text(out / POOL_FILE, "".join(ln + "\n" for ln in lines if ln in pool), adopt=shipped_sample)
    atomic_write_text(out / TEST_FILE, "".join(ln + "\n" for ln in lines if ln in test), adopt=shipped_sample)


if __name__ == "__main__":  # python -m flipguard.data.medqa /work/shared/data
    import sys

    write_samples(sys.argv[1])
