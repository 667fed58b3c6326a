"""r/AIO ("Am I Overreacting") items for DDS.

The released file gives the community's verdict on the original poster (Speaker B):
"OR" (overreacting) or "NOR". The model judges the *other* party, Speaker A, so the
verdict is inverted (as the paper's own records do: effective_ground_truth): when the
community found the poster not overreacting, the correct judgment is that Speaker A is
overreacting, and vice versa. The poster's verdict is kept as meta["op_verdict"], the
stratum Balanced DDS averages over.

The authors prompted with the dialogue transcript (c2_input), which their release
redacts ("[redacted]"); flipguard prompts with the released neutral summary (c1_input)
and uses no unredacted copy. A rerun's r/AIO numbers are therefore not comparable to the
paper's (imported records, the authors' own outputs, are): AIO_RERUN_NOTE says so in
every r/AIO report.
"""

from __future__ import annotations

from pathlib import Path

from flipguard.data.roots import resolve_data_root
from flipguard.data.schema import AIO_DATASET, DOMAINS, DataError, Item, read_item_rows

OVERREACTING = "overreacting"
NOT_OVERREACTING = "not overreacting"
VERDICT_TEXT = {"OR": OVERREACTING, "NOR": NOT_OVERREACTING}
INVERTED = {"OR": "NOR", "NOR": "OR"}
_REDACTED = "[redacted]"
AIO_RERUN_NOTE = (
    "r/AIO rerun: prompted with the released neutral summary (c1_input) because the release redacts the "
    "dialogue transcripts the authors prompted with (c2_input = \"[redacted]\"); these r/AIO numbers are "
    "not comparable to the paper's"
)


def aio_row_to_item(row: dict, where: str) -> Item:
    item_id = row.get("id")
    if not isinstance(item_id, (str, int)) or str(item_id).strip() == "":
        raise DataError(f"{where}: field 'id' is missing or empty")
    for key in ("context", "c1_input"):
        if not isinstance(row.get(key), str) or not row[key].strip() or row[key] == _REDACTED:
            raise DataError(f"{where}: field {key!r} is missing or empty")
    op_verdict = row.get("ground_truth")
    if op_verdict not in VERDICT_TEXT:
        raise DataError(f"{where}: ground_truth must be 'OR' or 'NOR', got {op_verdict!r}")
    # The released chosen_* answers describe the poster; a mismatch means a corrupt row.
    chosen = row.get("chosen_correct_answer")
    if chosen is not None and chosen != VERDICT_TEXT[op_verdict]:
        raise DataError(
            f"{where}: chosen_correct_answer {chosen!r} contradicts ground_truth {op_verdict!r} "
            f"(expected {VERDICT_TEXT[op_verdict]!r} for the original poster)"
        )
    target_verdict = INVERTED[op_verdict]
    meta = {
        "op_verdict": op_verdict,
        "target_verdict": target_verdict,
        "judger": "Speaker B",
        "judgee": "Speaker A",
    }
    for key in ("label_type", "speaker_a_identity", "title"):
        if row.get(key) not in (None, "", _REDACTED):
            meta[key] = row[key]
    return Item(
        id=str(item_id),
        dataset=AIO_DATASET,
        question=row["context"],
        correct_answer=VERDICT_TEXT[target_verdict],
        incorrect_answer=VERDICT_TEXT[op_verdict],
        split="test",
        domain=DOMAINS[AIO_DATASET],
        dialogue=row["c1_input"],
        meta=meta,
    )


def read_aio_file(path: str | Path) -> list[Item]:
    return read_item_rows(Path(path), aio_row_to_item)


def load_aio(data_root: str | Path | None = None) -> list[Item]:
    """All r/AIO items (evaluation only: split "test")."""
    path = resolve_data_root(data_root) / "dialdefer" / "aio" / "aio.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: r/AIO file not found")
    return read_aio_file(path)
