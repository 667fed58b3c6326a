"""Train/test leakage: a train item may share neither an id nor (normalised) question
text with any test item, otherwise SFT/DPO would train on the evaluation set."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from flipguard.data.schema import DataError, Item, normalise_question


def _index(items: Iterable[Item]) -> tuple[dict[str, Item], dict[str, Item]]:
    by_id: dict[str, Item] = {}
    by_text: dict[str, Item] = {}
    for item in items:
        by_id.setdefault(item.id, item)
        by_text.setdefault(normalise_question(item.question), item)
    return by_id, by_text


def find_leaks(train: Iterable[Item], test: Iterable[Item]) -> list[tuple[str, Item, Item]]:
    """(kind, train item, test item) for every train item that overlaps the test split;
    kind is "id" or "question" (an id overlap is reported once, as "id")."""
    test_by_id, test_by_text = _index(test)
    leaks = []
    for item in train:
        if item.id in test_by_id:
            leaks.append(("id", item, test_by_id[item.id]))
        else:
            twin = test_by_text.get(normalise_question(item.question))
            if twin is not None:
                leaks.append(("question", item, twin))
    return leaks


def check_no_leakage(train: Iterable[Item], test: Iterable[Item]) -> None:
    """Raise DataError if any train item shares an id or normalised question with a test item."""
    leaks = find_leaks(train, test)
    if not leaks:
        return
    counts: dict[str, int] = defaultdict(int)
    for kind, _, _ in leaks:
        counts[kind] += 1
    examples = "; ".join(
        f"{kind}: train {tr.dataset} {tr.id!r} vs test {te.dataset} {te.id!r}" for kind, tr, te in leaks[:5]
    )
    more = f" (and {len(leaks) - 5} more)" if len(leaks) > 5 else ""
    raise DataError(
        f"train/test leakage: {len(leaks)} train item(s) overlap the test split "
        f"({counts['id']} by id, {counts['question']} by question text): {examples}{more}"
    )


def exclude_test_overlap(train: list[Item], test: Iterable[Item]) -> tuple[list[Item], list[tuple[str, Item, Item]]]:
    """Train items with test overlaps removed, and what was removed. The train builder
    uses this on purpose (raw sources repeat questions); check_no_leakage stays strict."""
    leaks = find_leaks(train, test)
    dropped = {id(tr) for _, tr, _ in leaks}
    return [item for item in train if id(item) not in dropped], leaks
