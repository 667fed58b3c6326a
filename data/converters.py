"""Raw public datasets -> `Item`s, for the train split of datasets whose converted
DialDefer file was not released (HaluEval QA, HARP MCQ, BBQ).

Each converter reproduces the id convention and the correct/incorrect choice of the
released test files (paper Appendix A.1), so a train item and the test item built from
the same raw row carry the same id and the leakage check by id is meaningful:

- HaluEval QA: id ``halueval-qa-<row index>``; correct = right_answer, incorrect = the
  hallucinated answer. The knowledge passage is kept in ``meta["context"]``.
- HARP MCQ: id ``harp_mc-<year>-<contest>-<number>``; correct = the labelled choice,
  incorrect = one of the four wrong choices. The released files drew it from a
  reshuffled upstream version we do not have, so we pick it with a per-item seeded RNG.
- BBQ: id ``bbq-<category>-<example_id>``; question = context + " " + question;
  correct = the labelled option (the UNKNOWN option in ambiguous contexts), incorrect =
  the first other option in ans0..ans2 order (the rule the released test items follow).
"""

from __future__ import annotations

import random
import zipfile
from pathlib import Path
from typing import Any, Iterable

from flipguard.data.schema import DOMAINS, DataError, Item, parse_jsonl_lines, read_jsonl
from flipguard.files import decode_utf8

HARP_SEED = 42


def _text(row: dict[str, Any], key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {key!r} is missing or empty")
    return value.strip()


def _check_unique(items: list[Item], source: Path | str) -> list[Item]:
    seen: dict[str, int] = {}
    for pos, item in enumerate(items):
        if item.id in seen:
            raise DataError(f"{source}: duplicate id {item.id!r} (rows {seen[item.id] + 1} and {pos + 1})")
        seen[item.id] = pos
    return items


def convert_halueval(path: str | Path, split: str = "train") -> list[Item]:
    """HaluEval QA (qa_data.json, JSON Lines) -> Items; ids count rows from 0."""
    path = Path(path)
    items = []
    for index, (lineno, row) in enumerate(read_jsonl(path)):
        where = f"{path}:{lineno}"
        correct = _text(row, "right_answer", where)
        incorrect = _text(row, "hallucinated_answer", where)
        if correct == incorrect:
            raise DataError(f"{where}: right_answer and hallucinated_answer are identical")
        items.append(
            Item(
                id=f"halueval-qa-{index}",
                dataset="halueval_qa",
                question=_text(row, "question", where),
                correct_answer=correct,
                incorrect_answer=incorrect,
                split=split,
                domain=DOMAINS["halueval_qa"],
                meta={"context": row.get("knowledge"), "source_row": index},
            )
        )
    return _check_unique(items, path)


def _harp_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.namelist() if m.endswith(".jsonl")]
            if len(members) != 1:
                raise DataError(f"{path}: expected exactly one .jsonl member, found {members}")

            text = decode_utf8(archive.read(members[0]), f"{path}!{members[0]}", DataError)
        return parse_jsonl_lines(text.splitlines(), f"{path}!{members[0]}")
    return read_jsonl(path)


def convert_harp(path: str | Path, split: str = "train", seed: int = HARP_SEED) -> list[Item]:
    """HARP MCQ (the upstream zip, or its extracted .jsonl) -> Items."""
    path = Path(path)
    items = []
    for lineno, row in _harp_rows(path):
        where = f"{path}:{lineno}"
        choices = row.get("choices")
        letter = row.get("answer_choice")
        if not isinstance(choices, dict) or len(choices) < 2:
            raise DataError(f"{where}: 'choices' must be an object with at least two options")
        if letter not in choices:
            raise DataError(f"{where}: answer_choice {letter!r} is not one of the choices {sorted(choices)}")
        for key in ("year", "contest", "number"):
            if row.get(key) in (None, ""):
                raise DataError(f"{where}: field {key!r} is missing or empty")
        item_id = f"harp_mc-{row['year']}-{row['contest']}-{row['number']}"
        correct = _text(choices, letter, f"{where}: choice")
        wrong = [_text(choices, k, f"{where}: choice") for k in sorted(choices) if k != letter]
        wrong = [w for w in wrong if w != correct]
        if not wrong:
            raise DataError(f"{where}: every choice equals the correct answer")
        incorrect = random.Random(f"{seed}:{item_id}").choice(wrong)
        items.append(
            Item(
                id=item_id,
                dataset="harp_mcq",
                question=_text(row, "problem", where),
                correct_answer=correct,
                incorrect_answer=incorrect,
                split=split,
                domain=DOMAINS["harp_mcq"],
                meta={
                    "year": row.get("year"),
                    "contest": row.get("contest"),
                    "number": row.get("number"),
                    "level": row.get("level"),
                    "subject": row.get("subject"),
                    "multiple_choice_only": row.get("multiple_choice_only"),
                    "answer_choice": letter,
                    "incorrect_answers": wrong,
                    "solution": row.get("solution_1"),
                    "num_solutions": row.get("num_solutions"),
                },
            )
        )
    return _check_unique(items, path)


def convert_bbq(source: str | Path | Iterable[str | Path], split: str = "train") -> list[Item]:
    """BBQ category files (a folder of <Category>.jsonl, or a list of files) -> Items."""
    if isinstance(source, (str, Path)) and Path(source).is_dir():
        files = sorted(Path(source).glob("*.jsonl"))
        if not files:
            raise DataError(f"{source}: no BBQ *.jsonl category files")
    else:
        files = [Path(source)] if isinstance(source, (str, Path)) else [Path(f) for f in source]
    items = []
    for path in files:
        for lineno, row in read_jsonl(path):
            where = f"{path}:{lineno}"
            options = [_text(row, f"ans{i}", where) for i in range(3)]
            label = row.get("label")
            if not isinstance(label, int) or not 0 <= label < len(options):
                raise DataError(f"{where}: label {label!r} is not 0, 1 or 2")
            category = _text(row, "category", where)
            if row.get("example_id") is None:
                raise DataError(f"{where}: field 'example_id' is missing")
            wrong = [o for i, o in enumerate(options) if i != label]
            items.append(
                Item(
                    id=f"bbq-{category}-{row['example_id']}",
                    dataset="bbq",
                    question=f"{_text(row, 'context', where)} {_text(row, 'question', where)}",
                    correct_answer=options[label],
                    incorrect_answer=wrong[0],
                    split=split,
                    domain=DOMAINS["bbq"],
                    meta={
                        "source_file": path.name,
                        "category": category,
                        "context_condition": row.get("context_condition"),
                        "question_polarity": row.get("question_polarity"),
                        "question_index": row.get("question_index"),
                        "incorrect_answers": wrong,
                    },
                )
            )
    return _check_unique(items, ", ".join(str(f) for f in files) if len(files) < 3 else files[0].parent)
