"""A pair set on disk: what `flipguard pairs` (the pair builder, pairs/) writes and a trainer
reads, so that neither imports the other (docs/layout.md).

    PAIRS_DIR/sft/, sft.jsonl      prompt, completion          (a kind of pair set: SFT_DIR)
    PAIRS_DIR/dpo/, dpo.jsonl      prompt, chosen, rejected    (DPO_DIR)
    PAIRS_DIR/validation.jsonl     the validation slice's probes (`validation:` on): the judgments of the
                                   train items held back from the pairs that the trainers measure
    PAIRS_DIR/counts.json          what went in, per dataset, strategy and filter (read_counts)
    PAIRS_DIR/pairs.json           how it was built

Every row's prompt is a conversation and each reply one assistant message. A one-turn row
judges a claim: its reply is "1" or "2". A row replayed from a multi-turn run (AFR, stick-or-
switch) has the case `<protocol>/<kind>` (conversation_case) and any non-empty reply: a letter,
or "Answer: X".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flipguard.errors import UserError
from flipguard.files import read_json

SFT_DIR, DPO_DIR = "sft", "dpo"
COUNTS_FILE, META_FILE = "counts.json", "pairs.json"
VALIDATION_FILE = "validation.jsonl"
# the columns of each kind of pair set (TRL's conversational formats): the prompt, then its replies
PAIR_COLUMNS = {SFT_DIR: ("prompt", "completion"), DPO_DIR: ("prompt", "chosen", "rejected")}
JUDGMENTS = ("1", "2")  # the reply of a one-turn row


def reply_columns(kind: str) -> tuple[str, ...]:
    """The reply columns of a kind of pair set (every column after the prompt)."""
    return PAIR_COLUMNS[kind][1:]


def conversation_case(protocol: str, kind: str) -> str:
    """The case of a row replayed from a multi-turn run: `afr/hold`, `sos/accept` ..."""
    return f"{protocol}/{kind}"


def is_conversation_case(case: Any) -> bool:
    return isinstance(case, str) and "/" in case


def read_counts(pairs_dir: str | Path | None, flag: str | None = None) -> dict[str, Any] | None:
    """A pair set's counts.json (None: no pairs_dir, or none there). With `flag`, the option that
    named the folder, a folder without one is refused naming both (a typo in --pairs is not "no
    pairs"); a truncated or edited counts.json is one line naming the file, whatever the caller."""
    if not pairs_dir:
        return None
    path = Path(pairs_dir) / COUNTS_FILE
    if not path.is_file():
        if flag is None:
            return None
        what = "no such folder" if not Path(pairs_dir).exists() else f"no {COUNTS_FILE} there"
        raise UserError(f"{flag} {pairs_dir}: {what}; give the folder of a pair set (flipguard pairs --out) whose "
                        f"{COUNTS_FILE} says what the trained conditions learned from; nothing was written")
    counts = read_json(path, UserError, "pair counts file")
    if not isinstance(counts, dict):
        raise UserError(f"{path}: not a pair set's counts (a JSON {type(counts).__name__}, expected an object)")
    return counts
