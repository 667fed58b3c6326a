"""MedMCQA dev split as multiple-choice items for the stick-or-switch evaluation.

The test split's labels are unpublished, so the dev file is what is evaluated (as in the
paper). Only `choice_type == "single"` items are used: a multi-answer item has no single
answer to defend. `cop` counts from 1 (1 = opa) in the original release.

Few-shot exemplars come from a pool held out of the dev file by the rule in data/medqa.py
(the `POOL_SIZE` valid single-choice items with the smallest normalised-question hash),
shipped as `data/samples/medmcqa/fewshot_pool.jsonl`; split "dev" is the file minus every
pool question, so exemplars never coincide with evaluated items.
"""

from __future__ import annotations

import json
from pathlib import Path

from flipguard.data.medqa import (
    LETTERS,
    POOL_SIZE,
    MCQItem,
    load_pool,
    make_item,
    normalise_question,
    question_hash,
    resolve_root,
    samples_root,
    validated,
)
from flipguard.data.schema import DataError, read_jsonl
from flipguard.files import atomic_write_text, shipped_sample

DATASET = "medmcqa"
DEV_FILES = ("dev.json", "dev.jsonl")  # upstream name; the shipped sample uses .jsonl
SPLITS = ("dev", "fewshot")
OPTION_KEYS = ("opa", "opb", "opc", "opd")


def _convert(row: dict, where: str, split: str = "dev") -> MCQItem:
    item_id = row.get("id")
    if not isinstance(item_id, str) or not item_id.strip():
        raise DataError(f"{where}: field 'id' is missing or empty")
    missing = [k for k in ("question", *OPTION_KEYS) if not isinstance(row.get(k), str) or not row[k].strip()]
    if missing:
        raise DataError(f"{where}: item {item_id}: field(s) {missing} missing or empty")
    cop = row.get("cop")
    if isinstance(cop, bool) or not isinstance(cop, int) or not 1 <= cop <= len(OPTION_KEYS):
        raise DataError(f"{where}: item {item_id}: missing or invalid answer key cop={cop!r} (expected 1-4)")
    return make_item(
        dataset=DATASET,
        split=split,
        id=item_id,
        subject=str(row.get("subject_name") or ""),
        category=str(row.get("topic_name") or ""),
        question=row["question"],
        options=[row[k] for k in OPTION_KEYS],
        answer=LETTERS[cop - 1],
    )


def _single_choice_rows(path: Path):
    for n, row in read_jsonl(path):
        if row.get("choice_type", "single") == "single":
            yield f"{path}:{n}", row


def dev_file(root: Path) -> Path:
    for name in DEV_FILES:
        if (root / DATASET / name).exists():
            return root / DATASET / name
    raise DataError(f"{root / DATASET}: no MedMCQA dev file ({' or '.join(DEV_FILES)})")


def load_medmcqa(split: str = "dev", data_root: str | Path | None = None, skip_invalid: bool = False) -> list[MCQItem]:
    """Single-choice MedMCQA items. split "dev": the evaluated items (dev file minus the
    exemplar pool); "fewshot": the exemplar pool."""
    if split not in SPLITS:
        raise DataError(f"medmcqa: unknown split {split!r}; expected one of {SPLITS}")
    root = resolve_root(data_root)
    pool = load_pool(DATASET, lambda row, where: _convert(row, where, "fewshot"), root)
    if split == "fewshot":
        return pool
    held_out = {normalise_question(it.question) for it in pool}
    items = validated(_single_choice_rows(dev_file(root)), _convert, skip_invalid)
    return [it for it in items if normalise_question(it.question) not in held_out]


def write_samples(full_root: str | Path, n_dev: int = 24) -> None:
    """Regenerate data/samples/medmcqa: the pool and the next `n_dev` valid single-choice
    items by question hash, as verbatim upstream lines."""
    path = dev_file(Path(full_root))
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    valid = validated(_single_choice_rows(path), _convert, skip_invalid=True)
    valid_ids = {it.id for it in valid}
    usable = [ln for ln in lines if json.loads(ln)["id"] in valid_ids]
    ranked = sorted(usable, key=lambda ln: question_hash(json.loads(ln)["question"]))
    pool, dev = set(ranked[:POOL_SIZE]), set(ranked[POOL_SIZE : POOL_SIZE + n_dev])
    out = samples_root() / DATASET
    atomic_write_text(out / "fewshot_pool.jsonl", "".join(ln + "\n" for ln in lines if ln in pool), adopt=shipped_sample)
    atomic_write_text(out / "dev.jsonl", "".join(ln + "\n" for ln in lines if ln in dev), adopt=shipped_sample)


if __name__ == "__main__":  # python -m flipguard.data.medmcqa /work/shared/data
    import sys

    write_samples(sys.argv[1])
