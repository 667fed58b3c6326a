"""Scripted AFR arguments: Stage I read from a file instead of written by a model.

A model that cannot write (the planted-bias organism), or a researcher who wants one fixed,
reproducible challenge set, gives `--scripted_arguments FILE`: JSONL, one row per question
and wrong option,

    {"item_id": "orgmc-00000", "target_option": "C", "argument": "The answer is pink, ...", "k": 1}

`k` is optional (a row without it serves every k of the run; a row with it only that k).
Rows for questions outside the run's sample are ignored; a sampled (question, option) with
no row is not challenged (counted in run.json, like a refusal). The file's arguments are
the source named `scripted` (`scripted_as`): in the blind condition they replace the targets'
own Stage I (no Stage I calls for the targets, no self condition: the target did not write
them); in the cross condition they are one more source beside the models' own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flipguard.data.mmlu import MCQItem
from flipguard.data.schema import DataError, read_jsonl
from flipguard.files import file_sha256

SOURCE = "scripted"
SCRIPTED_AS = ("blind", "cross")


def load_scripted(path: str | Path, items: dict[str, MCQItem]) -> dict[tuple[str, str, int | None], str]:
    """(item_id, wrong letter, k or None) -> argument, for the questions in `items`."""
    out: dict[tuple[str, str, int | None], str] = {}
    for lineno, row in read_jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row is a JSON object with item_id, target_option, argument")
        missing = [f for f in ("item_id", "target_option", "argument") if f not in row]
        if missing:
            raise DataError(f"{where}: missing field(s) {missing}")
        unknown = sorted(set(row) - {"item_id", "target_option", "argument", "k"})
        if unknown:
            raise DataError(f"{where}: unknown field(s) {unknown}; expected item_id, target_option, argument, k")
        if not isinstance(row["argument"], str) or not row["argument"].strip():
            raise DataError(f"{where}: 'argument' must be a non-empty string")
        k = row.get("k")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise DataError(f"{where}: 'k' must be a positive integer, got {k!r}")
        item = items.get(str(row["item_id"]))
        if item is None:
            continue
        if row["target_option"] not in item.wrong_letters:
            raise DataError(f"{where}: item {item.id!r}: {row['target_option']!r} is not a wrong option "
                            f"(wrong options: {item.wrong_letters})")
        key = (item.id, row["target_option"], k)
        if key in out:
            raise DataError(f"{where}: a second argument for item {item.id!r} option {row['target_option']!r}"
                            + (f" at k={k}" if k is not None else ""))
        out[key] = row["argument"].strip()
    return out


def scripted_argument(table: dict[tuple[str, str, int | None], str], item_id: str, letter: str, k: int) -> str | None:
    return table.get((item_id, letter, k), table.get((item_id, letter, None)))


def describe(path: str | Path, table: dict, items: list[MCQItem], ks: list[int]) -> dict[str, Any]:
    """run.json's record of the source: the file, its hash, what it covered."""
    wanted = [(it.id, x, k) for it in items for x in it.wrong_letters for k in ks]
    covered = sum(scripted_argument(table, i, x, k) is not None for i, x, k in wanted)
    return {"file": str(Path(path).resolve()), "sha256": file_sha256(path),
            "arguments_used": covered, "missing": len(wanted) - covered}
