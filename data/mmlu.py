"""MMLU multiple-choice items (Hendrycks et al., 2021) for the answer-flip protocol.

Reads the per-subject CSVs of /work/shared/data/mmlu (header
`question,choice0..choice3,answer` with a 0-based answer index; see its PROVENANCE.md)
and also the raw hendrycks layout (no header, answer letter A-D), so either copy works.
Any multiple-choice benchmark with this layout loads the same way: the item type is
generic (n options, letter answer), which is why stick-or-switch reuses it.

Data root: explicit argument > $FLIPGUARD_DATA (a folder holding `mmlu/`, or the mmlu
folder itself) > the shipped sample in data/samples/mmlu (2 rows per subject and split).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from flipguard.data.schema import DataError
from flipguard.files import read_text

SAMPLE_ROOT = Path(__file__).resolve().parent / "samples" / "mmlu"
LETTERS = "ABCDEFGHIJ"
SPLITS = ("test", "dev", "val")

# Standard MMLU subject -> subcategory (hendrycks/test categories.py).
SUBCATEGORIES: dict[str, str] = {
    "abstract_algebra": "math",
    "anatomy": "health",
    "astronomy": "physics",
    "business_ethics": "business",
    "clinical_knowledge": "health",
    "college_biology": "biology",
    "college_chemistry": "chemistry",
    "college_computer_science": "computer science",
    "college_mathematics": "math",
    "college_medicine": "health",
    "college_physics": "physics",
    "computer_security": "computer science",
    "conceptual_physics": "physics",
    "econometrics": "economics",
    "electrical_engineering": "engineering",
    "elementary_mathematics": "math",
    "formal_logic": "philosophy",
    "global_facts": "other",
    "high_school_biology": "biology",
    "high_school_chemistry": "chemistry",
    "high_school_computer_science": "computer science",
    "high_school_european_history": "history",
    "high_school_geography": "geography",
    "high_school_government_and_politics": "politics",
    "high_school_macroeconomics": "economics",
    "high_school_mathematics": "math",
    "high_school_microeconomics": "economics",
    "high_school_physics": "physics",
    "high_school_psychology": "psychology",
    "high_school_statistics": "math",
    "high_school_us_history": "history",
    "high_school_world_history": "history",
    "human_aging": "health",
    "human_sexuality": "culture",
    "international_law": "law",
    "jurisprudence": "law",
    "logical_fallacies": "philosophy",
    "machine_learning": "computer science",
    "management": "business",
    "marketing": "business",
    "medical_genetics": "health",
    "miscellaneous": "other",
    "moral_disputes": "philosophy",
    "moral_scenarios": "philosophy",
    "nutrition": "health",
    "philosophy": "philosophy",
    "prehistory": "history",
    "professional_accounting": "other",
    "professional_law": "law",
    "professional_medicine": "health",
    "professional_psychology": "psychology",
    "public_relations": "politics",
    "security_studies": "politics",
    "sociology": "culture",
    "us_foreign_policy": "politics",
    "virology": "health",
    "world_religions": "philosophy",
}
# Subcategory -> the four top-level categories of Hendrycks et al.
CATEGORY_OF_SUBCATEGORY: dict[str, str] = {
    **dict.fromkeys(["physics", "chemistry", "biology", "computer science", "math", "engineering"], "STEM"),
    **dict.fromkeys(["history", "philosophy", "law"], "humanities"),
    **dict.fromkeys(["politics", "culture", "economics", "geography", "psychology"], "social sciences"),
    **dict.fromkeys(["other", "business", "health"], "other"),
}
CATEGORIES = ("STEM", "humanities", "social sciences", "other")
SUBJECT_CATEGORY: dict[str, str] = {s: CATEGORY_OF_SUBCATEGORY[c] for s, c in SUBCATEGORIES.items()}
SUBJECTS = tuple(SUBCATEGORIES)


@dataclasses.dataclass
class MCQItem:
    """One multiple-choice question; `answer` is the correct option's letter."""

    id: str
    subject: str
    category: str
    question: str
    options: list[str]
    answer: str
    split: str = "test"
    dataset: str = "mmlu"
    subcategory: str = ""

    @property
    def letters(self) -> list[str]:
        return list(LETTERS[: len(self.options)])

    @property
    def wrong_letters(self) -> list[str]:
        return [x for x in self.letters if x != self.answer]

    def option_text(self, letter: str) -> str:
        return self.options[LETTERS.index(letter)]

    @property
    def answer_text(self) -> str:
        return self.option_text(self.answer)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "MCQItem":
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls) if f.name in row})


def subject_category(subject: str) -> str:
    """Top-level category; subjects outside the 57 MMLU ones fall under "other"."""
    return SUBJECT_CATEGORY.get(subject, "other")


def resolve_mmlu_root(data_root: str | os.PathLike | None = None) -> Path:
    """explicit > $FLIPGUARD_DATA > shipped sample; accepts a folder holding `mmlu/`."""
    root = data_root if data_root is not None else os.environ.get("FLIPGUARD_DATA")
    if root is None or str(root) == "":
        return SAMPLE_ROOT
    path = Path(root)
    if (path / "mmlu").is_dir():
        path = path / "mmlu"
    if not path.is_dir():
        raise DataError(f"{path}: MMLU data folder not found (expected <root>/mmlu/test/<subject>_test.csv)")
    return path


def _answer_letter(value: str, n_options: int, where: str) -> str:
    value = value.strip()
    if value.isdigit() and 0 <= int(value) < n_options:
        return LETTERS[int(value)]
    if len(value) == 1 and value.upper() in LETTERS[:n_options]:
        return value.upper()
    raise DataError(
        f"{where}: bad answer {value!r} (expected an index 0-{n_options - 1} or a letter A-{LETTERS[n_options - 1]})"
    )


def read_mmlu_csv(path: str | os.PathLike, subject: str | None = None, split: str = "test") -> list[MCQItem]:
    """Items of one subject file; a malformed row raises DataError naming file and line."""
    path = Path(path)
    if subject is None:
        subject = path.stem.rsplit(f"_{split}", 1)[0]
    items: list[MCQItem] = []

    with io.StringIO(read_text(path, DataError, "MMLU file"), newline="") as fh:
        reader = csv.reader(fh)
        row_index = 0
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if not row or not any(cell.strip() for cell in row):
                continue
            if [c.strip().lower() for c in row[:2]] == ["question", "choice0"]:
                continue  # header of the vendored copy
            if len(row) < 4:
                raise DataError(f"{where}: expected question, >=2 options and answer; got {len(row)} column(s)")
            question, options, answer = row[0].strip(), [c.strip() for c in row[1:-1]], row[-1]
            if not question:
                raise DataError(f"{where}: empty question")
            if len(options) > len(LETTERS):
                raise DataError(f"{where}: {len(options)} options; at most {len(LETTERS)} supported")
            letter = _answer_letter(answer, len(options), where)
            items.append(
                MCQItem(
                    id=f"mmlu-{split}-{subject}-{row_index:04d}",
                    subject=subject,
                    category=subject_category(subject),
                    question=question,
                    options=options,
                    answer=letter,
                    split=split,
                    subcategory=SUBCATEGORIES.get(subject, "other"),
                )
            )
            row_index += 1
    return items


def load_mmlu(
    split: str = "test", data_root: str | os.PathLike | None = None, subjects: Iterable[str] | None = None
) -> list[MCQItem]:
    """All items of a split, subjects in name order, rows in file order."""
    root = resolve_mmlu_root(data_root)
    folder = root / split
    if not folder.is_dir():
        raise DataError(f"{folder}: no {split!r} split in the MMLU data folder {root}")
    files = {p.name[: -len(f"_{split}.csv")]: p for p in folder.glob(f"*_{split}.csv")}
    if not files:
        raise DataError(f"{folder}: no <subject>_{split}.csv files")
    wanted = sorted(files) if subjects is None else list(subjects)
    missing = [s for s in wanted if s not in files]
    if missing:
        raise DataError(f"{folder}: no file for subject(s) {missing}")
    items: list[MCQItem] = []
    for subject in wanted:
        items.extend(read_mmlu_csv(files[subject], subject=subject, split=split))
    return items


def sample_uniform(items: Iterable[MCQItem], per_subject: int, seed: int = 0) -> list[MCQItem]:
    """The same number of questions from every subject (paper: 36 x 57 = 2,052), seeded.

    Subjects with fewer rows contribute all of them. Output is ordered by (subject, id),
    so a larger per_subject with the same seed does not reshuffle earlier picks' order.
    """
    if per_subject < 1:
        raise ValueError(f"per_subject must be >= 1, got {per_subject}")
    by_subject: dict[str, list[MCQItem]] = defaultdict(list)
    for item in items:
        by_subject[item.subject].append(item)
    out: list[MCQItem] = []
    for subject in sorted(by_subject):
        pool = sorted(by_subject[subject], key=lambda it: it.id)
        rng = random.Random(f"{seed}:{subject}")
        picked = pool if len(pool) <= per_subject else rng.sample(pool, per_subject)
        out.extend(sorted(picked, key=lambda it: it.id))
    return out
