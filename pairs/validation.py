"""The validation slice: train items held back from the pairs, by item, and the judgments that
measure them while the trainers train (`validation:`, train/validation.py measures).

A seeded share of each train dataset's items (`validation.share`, at most `validation.max_items`)
is held back: none of their rows goes into the pair set, and every judgment of them that a
protocol's rule reads goes into `PAIRS_DIR/validation.jsonl` as a probe, from the base model's
own train-split runs (the records the pairs are built from), so the prompt is the one the
evaluation sent and the base model's answer is known without measuring it again:

    dds  c1_true, c1_false (guards: own C1), c2_correct, c2_incorrect (the deference)     the pairs.records run
    afr  first (guard: the first answer), challenge (target: the flip)                   an AFR run of pairs.conversations
    sos  single_shot (guard), correct_switch (guard: the right option taken after an
         abstention), incorrect_switch (target: a wrong one taken)                       a stick-or-switch run

A multi-turn probe is the conversation up to the push-back as the base model had it (its own
turn-1 reply): the same chats the multi-turn pairs are made of. The test split is never read.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from flipguard.data.organism_datasets import option_kind
from flipguard.data.pair_sets import VALIDATION_FILE
from flipguard.errors import FlipguardError, UserError
from flipguard.eval.afr.protocol import load_sample
from flipguard.eval.records import CASES, Record, load_records
from flipguard.files import atomic_write_text
from flipguard.pairs.conversations import _option_text, _run_meta

PROBE_KEYS = ("protocol", "dataset", "item_id", "case", "measures", "messages", "mode", "choices", "expected",
              "offered", "kind", "min_label_mass", "max_new_tokens", "base_choice", "base_valid")


@dataclasses.dataclass(frozen=True)
class HoldBack:
    """Which items of each dataset the slice takes (seeded), and the settings that chose them."""

    items: Mapping[str, frozenset[str]]
    share: float
    max_items: int | None
    seed: int

    def holds(self, dataset: str, item_id: str) -> bool:
        return item_id in self.items.get(dataset, ())

    def as_dict(self) -> dict[str, Any]:
        return {"share": self.share, "max_items": self.max_items, "seed": self.seed,
                "items": {d: sorted(ids) for d, ids in sorted(self.items.items())}}


def choose(ids_by_dataset: Mapping[str, Iterable[str]], share: float, max_items: int | None, seed: int) -> HoldBack:
    """A seeded `share` of each dataset's item ids (at least one, at most `max_items`): the same ids
    and seed give the same items whatever their order."""
    held = {}
    for dataset, ids in sorted(ids_by_dataset.items()):
        pool = sorted(set(ids))
        if not pool:
            continue
        k = max(1, round(share * len(pool)))
        if max_items:
            k = min(k, int(max_items))
        if k >= len(pool):
            raise UserError(f"validation.share {share}: holds back all {len(pool)} train item(s) of {dataset}, leaving "
                            "none to train on; lower validation.share or validation.max_items")
        held[dataset] = frozenset(random.Random(f"validation:{seed}:{dataset}").sample(pool, k))
    return HoldBack(held, share, max_items, seed)


def _probe(record: Record, measures: str, choices: Sequence[str] | None, *, offered: str | None = None,
           kind: str | None = None, max_new_tokens: int | None = None) -> dict[str, Any]:
    return {"protocol": record.protocol, "dataset": record.dataset, "item_id": record.item_id, "case": record.case,
            "measures": measures, "messages": record.messages, "mode": record.mode,
            "choices": list(choices) if choices else None, "expected": record.expected, "offered": offered, "kind": kind,
            "min_label_mass": (record.extra or {}).get("min_label_mass"), "max_new_tokens": max_new_tokens,
            "base_choice": record.choice, "base_valid": bool(record.valid)}


def _choices(record: Record) -> list[str] | None:
    """The labels a logprob record was scored over (its probabilities' keys; a DDS judgment's 1 and 2)."""
    if record.mode != "logprob":
        return None
    if record.p1 is not None:
        return ["1", "2"]
    probs = (record.extra or {}).get("probs")
    return list(probs) if isinstance(probs, dict) and probs else None


def dds_probes(records: Iterable[Record], held: HoldBack) -> list[dict[str, Any]]:
    """The four cases (no mitigation) of every held DDS item, from the base model's train-split run's records."""
    probes = []
    for r in records:
        if r.split == "train" and r.case in CASES and (r.mitigation or "none") == "none" and held.holds(r.dataset, r.item_id):
            probes.append(_probe(r, r.case, _choices(r) or ["1", "2"]))
    return probes


def conversation_probes(run_dir: str | Path, held: HoldBack) -> list[dict[str, Any]]:
    """The first answers and push-back turns of every held item of one AFR or stick-or-switch train-split run."""
    run_dir = Path(run_dir)
    meta = _run_meta(run_dir)
    protocol = meta.get("protocol") or meta.get("task")
    # a generate-mode run's reply budget: stick-or-switch's generation settings, AFR's answer_max_new_tokens
    max_new = ((meta.get("generation") or {}).get("max_new_tokens")
               or (meta.get("settings") or {}).get("answer_max_new_tokens"))
    try:
        items = load_sample(run_dir) if protocol == "afr" else {}
    except FlipguardError:
        items = {}
    probes = []
    for r in load_records(run_dir):
        if r.protocol != protocol or r.split != "train" or not held.holds(r.dataset, r.item_id):
            continue
        extra = r.extra or {}
        gen = max_new if r.mode == "generate" else None
        if protocol == "afr" and r.case == "baseline":
            probes.append(_probe(r, "first", _choices(r), max_new_tokens=gen))
        elif protocol == "afr" and r.case == "challenge" and extra.get("target_option"):
            x = extra["target_option"]
            probes.append(_probe(r, "challenge", _choices(r), offered=x, max_new_tokens=gen,
                                 kind=option_kind(r.dataset, _option_text(r, x, items) or "")))
        elif protocol == "sos" and extra.get("scenario") == "baseline" and r.case == "ss_full":
            probes.append(_probe(r, "single_shot", _choices(r) or sorted(extra.get("options_shown") or ()),
                                 max_new_tokens=gen))
        elif protocol == "sos" and extra.get("scenario") == "flexibility" and int(extra.get("turn") or 1) == 2 and extra.get("offered"):
            offered = next(iter(extra["offered"]))
            measures = "correct_switch" if offered == r.expected else "incorrect_switch"
            probes.append(_probe(r, measures, _choices(r) or sorted(extra.get("options_shown") or ()), offered=offered,
                                 max_new_tokens=gen, kind=option_kind(r.dataset, _option_text(r, offered, items) or "")))
    return probes


def summary(probes: Sequence[Mapping[str, Any]], held: HoldBack, rows_held_back: int) -> dict[str, Any]:
    """counts.json's `validation`: the items held back, the pair rows they took out, the probes per protocol."""
    per = collections.Counter(f"{p['protocol']}/{p['measures']}" for p in probes)
    return {**held.as_dict(), "items_held_back": {d: len(ids) for d, ids in sorted(held.items.items())},
            "rows_held_back": rows_held_back, "probes": dict(sorted(per.items())), "file": VALIDATION_FILE}


def write_probes(probes: Sequence[Mapping[str, Any]], folder: Path) -> None:
    atomic_write_text(folder / VALIDATION_FILE, "".join(json.dumps({k: p.get(k) for k in PROBE_KEYS}, ensure_ascii=False)
                                                       + "\n" for p in probes))
