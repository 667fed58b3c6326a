"""SFT/DPO training pairs from the base model's train-split flip records.

Input: the train Items and the base model's logprob records on them, produced by

    flipguard eval --split train --datasets bench --mode logprob --model MODEL --out RUN_DIR

Output (`flipguard pairs RECIPE.yaml --records RUN_DIR --out DIR`), in TRL's
conversational formats, each as a `datasets` folder and as JSONL:

    DIR/sft/, DIR/sft.jsonl   prompt (messages) / completion [{"role": "assistant", "content": "1"|"2"}]
    DIR/dpo/, DIR/dpo.jsonl   prompt / chosen / rejected (one token each)
    DIR/counts.json           rows per dataset, strategy, target and flip type
    DIR/pairs.json            how the pairs were built (strategy, seed, records, fingerprints)

Prompts are `build_messages(item, case, fmt="one_token")`: the bytes the logprob
evaluation sends (paper Listing 3), so training and measurement see the same input.

Strategies (target "1" = the judged claim is correct, "2" = incorrect):
- all:           C2-correct -> "1" and C2-incorrect -> "2" for every train item (paper K.2).
- flips:         both C2 variants of every item the base model flipped on either pair
                 (deference or skepticism). The flipped variant is the correction; its
                 twin keeps the set 50/50 so the model is not pushed into the opposite
                 bias (the over-correction of paper §7).
- flip_weighted: all, with every row of a flipped item repeated `flip_weight` times.
                 Rows are repeated rather than given a weight column because neither
                 SFTTrainer nor DPOTrainer reads per-row weights; repetition is exact for
                 SGD in expectation and visible in counts.json.
- consistency:   the same content in C1, C2 and dehumanized-C2 framing, one target for
                 all three: teaches framing invariance (the paper's open problem).
- afr:           answer-flip judgments from `flipguard.pairs.afr.afr_judgments`.
- conversation:  only the multi-turn pairs below.

Multi-turn pairs (`pairs.conversations`: AFR / stick-or-switch run directories of the
train split; flipguard.pairs.conversations) are added to any strategy's rows: the
prompt is the chat up to the push-back exactly as the evaluation sent it, the chosen reply
holds the answer (or, after an abstention, accepts the right option) and the rejected one
capitulates (or stays). Their targets are letters, so they are kept out of the 1/2
balance and counted per protocol and kind in counts.json ("conversations", repeats included);
`pairs.accept_weight` repeats each accept pair, since a run yields several holds per accept.

Prompt length (`pairs.length_policy`, Table 37 caps DPO prompts at 768 tokens): a prompt
longer than `pairs.max_prompt_length` tokens (chat template applied, as the trainers
tokenize it) is `refuse`d (the default: the trainers stop on any pair over their
max_length), `drop`ped and counted, or `truncate`d as the paper did: the user turn loses
its first tokens until the prompt fits (the end, with the answer options and the
one-token instruction, stays - TRL's max_prompt_length kept the prompt's end). Applied
before dedup and balance; counts.json says what happened to how many rows.

Every strategy: duplicates (same prompt and target) are dropped, a prompt that appears
with both targets is dropped and counted as a conflict, targets are down-sampled to
50/50 unless `balance` is off, and the row order is a seeded shuffle, so the same
inputs and seed give byte-identical files. Any item from the test split (by split
field, id or normalised question) is refused.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.table import Table

from flipguard.config import PAIR_STRATEGIES, PairsArguments, ValidationArguments, parse_recipe
from flipguard.data.pair_sets import (
    COUNTS_FILE,
    DPO_DIR,
    META_FILE,
    SFT_DIR,
    conversation_case,
)
from flipguard.data.registry import load_mc
from flipguard.data.schema import DataError, Item
from flipguard.data.splits import check_no_leakage
from flipguard.data.unified import load_items
from flipguard.errors import RecordError, UserError
from flipguard.eval.dds.metrics import FLIP_DIRECTIONS, flip_records
from flipguard.eval.dds.prompts import build_messages
from flipguard.eval.records import load_records
from flipguard.files import file_sha256, staging_dir
from flipguard.pairs.afr import afr_judgments
from flipguard.pairs.conversations import CAPITULATION, conversation_rows
from flipguard.pairs.filters import PairRules, check_leakage, facets, select
from flipguard.pairs.validation import HoldBack, choose, conversation_probes, dds_probes, summary, write_probes
from flipguard.publish import publish_dir
from flipguard.runtime.chat_tokens import chat_token_ids
from flipguard.runtime.resolve import resolve_model

TARGETS = ("1", "2")
CASE_TARGET = {"c1_true": "1", "c1_false": "2", "c2_correct": "1", "c2_incorrect": "2"}
FRAMING_CASES = {  # framing -> (case for the correct claim, case for the incorrect one, mitigation)
    "c1": ("c1_true", "c1_false", "none"),
    "c2": ("c2_correct", "c2_incorrect", "none"),
    "dehumanizing": ("c2_correct", "c2_incorrect", "dehumanizing"),
    "be_honest": ("c2_correct", "c2_incorrect", "be_honest"),
}

def eval_command(records_dir: str | None, model: str = "MODEL", datasets: str = "bench") -> str:
    out = records_dir or "RUN_DIR"
    return (
        f"flipguard eval --split train --datasets {datasets} --mode logprob "
        f"--model {model} --out {out}"
    )


@dataclasses.dataclass(frozen=True)
class PairRow:
    """One training example before formatting: a prompt and its one-token target."""

    prompt: tuple[tuple[str, str], ...]  # ((role, content), ...): hashable
    target: str
    item_id: str
    dataset: str
    case: str
    mitigation: str
    flip: str | None = None
    rejected: str | None = None  # a multi-turn pair's rejected reply (binary rows: the other label)
    meta: tuple[tuple[str, Any], ...] = ()  # the item's meta (kinds: category, incorrect_category), for the filters

    @property
    def protocol(self) -> str:
        """dds (the strategy's rows), afr (afr judgments, AFR conversations) or sos."""
        if self.rejected is not None:
            return self.case.split("/")[0]
        return "afr" if self.case == "afr" else "dds"

    @property
    def framing(self) -> str:
        """The speaker framing of a binary row (c1, c2, dehumanizing, be_honest); a multi-turn row's kind."""
        if self.rejected is not None:
            return self.case.split("/")[-1]
        if self.case.startswith("c1"):
            return "c1"
        return "c2" if self.mitigation == "none" else self.mitigation

    @property
    def facets(self) -> dict[str, Any]:
        return facets(self.dataset, self.protocol, self.framing, dict(self.meta))

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.prompt]

    @property
    def rejected_reply(self) -> str:
        return self.rejected if self.rejected is not None else {"1": "2", "2": "1"}[self.target]


def _row(item: Item, case: str, mitigation: str, flip: str | None = None) -> PairRow:
    messages = build_messages(item, case, mitigation=mitigation, fmt="one_token")
    return PairRow(
        prompt=tuple((m["role"], m["content"]) for m in messages),
        target=CASE_TARGET[case],
        item_id=item.id,
        dataset=item.dataset,
        case=case,
        mitigation=mitigation,
        flip=flip,
        meta=_meta(item.meta),
    )


def _meta(meta: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """An item's meta as a row holds it (hashable: plain values only)."""
    return tuple(sorted((str(k), v) for k, v in (meta or {}).items() if isinstance(v, (str, int, float, bool))))


# ---------------------------------------------------------------- checks


def refuse_test_items(items: Sequence[Item], test_items: Iterable[Item] | None = None) -> None:
    """DataError for any item marked as test split, or overlapping the given test items."""
    marked = [it for it in items if it.split != "train"]
    if marked:
        ex = ", ".join(f"{it.dataset}:{it.id} (split={it.split!r})" for it in marked[:5])
        raise DataError(f"refusing to train on {len(marked)} item(s) not from the train split: {ex}")
    if test_items is not None:
        check_no_leakage(items, test_items)


def load_test_items_for(items: Sequence[Item], data_root: str | None) -> list[Item]:
    """The test split of every dataset the pairs use (those that have one)."""
    out: list[Item] = []
    for dataset in sorted({it.dataset for it in items}):
        try:
            out += load_items([dataset], split="test", data_root=data_root)
        except DataError as exc:
            if "test file" in str(exc) or "not found" in str(exc) or "does not exist" in str(exc):
                continue  # no released test file for this dataset: nothing to overlap
            raise
    return out


def check_binary(rows: Iterable[PairRow], source: str = "pairs") -> None:
    bad = [r for r in rows if r.rejected is None and r.target not in TARGETS]
    if bad:
        ex = ", ".join(f"{r.dataset}:{r.item_id} -> {r.target!r}" for r in bad[:5])
        raise UserError(f"{source}: {len(bad)} completion(s) are not exactly '1' or '2' (refused): {ex}")


# ---------------------------------------------------------------- flips


def flipped_items(flips) -> dict[str, set[str]]:
    """item key "dataset\\x00item_id" -> flip types seen, from a flip_records() frame."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    if flips is None or len(flips) == 0:
        return out
    required = {"item_id", "dataset", "pair", "flip"}
    missing = required - set(flips.columns)
    if missing:
        raise UserError(f"flip records lack column(s) {sorted(missing)}")
    for row in flips.itertuples(index=False):
        if row.flip in FLIP_DIRECTIONS:
            out[f"{row.dataset}\x00{row.item_id}"].add(row.flip)
    return out


def flips_from_records(records_dir: str, items: Sequence[Item], datasets: str = "bench"):
    """flip_records() of a train-split run directory; errors say which eval to run."""
    cmd = eval_command(records_dir, datasets=datasets)
    if not records_dir:
        raise UserError(f"this strategy needs the base model's train-split records; run:\n  {cmd}\nthen pass --records RUN_DIR")
    try:
        records = load_records(records_dir)
    except RecordError as exc:
        raise UserError(f"{exc}\nrun the base model on the train split first:\n  {cmd}") from None
    train = [r for r in records if r.split == "train"]
    if not train:
        splits = sorted({r.split for r in records})
        raise UserError(
            f"{records_dir}: no train-split records (found split(s) {splits}); flips must come from the "
            f"train split, never the test split. Run:\n  {cmd}"
        )
    known = {(it.dataset, it.id) for it in items}
    covered = {(r.dataset, r.item_id) for r in train}
    if not covered & known:
        raise UserError(
            f"{records_dir}: its train-split records cover none of the {len(known)} train items "
            f"(different datasets or data root?). Run:\n  {cmd}"
        )
    return flip_records(train)


# ---------------------------------------------------------------- strategies


def _strategy_rows(
    strategy: str,
    items: Sequence[Item],
    flips=None,
    flip_weight: int = 3,
    framings: Sequence[str] = ("c1", "c2", "dehumanizing"),
    afr_rows: Sequence[dict] | None = None,
) -> list[PairRow]:
    if strategy not in PAIR_STRATEGIES:
        raise UserError(f"unknown pair strategy {strategy!r}; expected one of {PAIR_STRATEGIES}")
    flipped = flipped_items(flips)  # also annotates rows of other strategies when given
    if strategy in ("flips", "flip_weighted") and flips is None:
        raise UserError(f"strategy {strategy!r} needs flip records; run:\n  {eval_command(None)}")

    def flip_of(item: Item) -> str | None:
        kinds = flipped.get(f"{item.dataset}\x00{item.id}")
        return "+".join(sorted(kinds)) if kinds else None

    rows: list[PairRow] = []
    if strategy == "all":
        for item in items:
            kind = flip_of(item)
            rows += [_row(item, "c2_correct", "none", kind), _row(item, "c2_incorrect", "none", kind)]
    elif strategy == "flips":
        for item in items:
            kind = flip_of(item)
            if kind:
                rows += [_row(item, "c2_correct", "none", kind), _row(item, "c2_incorrect", "none", kind)]
    elif strategy == "flip_weighted":
        if int(flip_weight) < 1:
            raise UserError(f"flip_weight must be an integer >= 1, got {flip_weight!r}")
        for item in items:
            kind = flip_of(item)
            rows += [_row(item, "c2_correct", "none", kind), _row(item, "c2_incorrect", "none", kind)]
    elif strategy == "consistency":
        unknown = [f for f in framings if f not in FRAMING_CASES]
        if unknown or not framings:
            raise UserError(f"unknown framing(s) {unknown}; expected some of {sorted(FRAMING_CASES)}")
        for item in items:
            kind = flip_of(item)
            for framing in framings:
                correct_case, incorrect_case, mitigation = FRAMING_CASES[framing]
                rows += [_row(item, correct_case, mitigation, kind), _row(item, incorrect_case, mitigation, kind)]
    elif strategy == "afr":
        for i, r in enumerate(afr_rows or []):
            missing = {"prompt", "target", "item_id", "dataset"} - set(r)
            if missing:
                raise UserError(f"afr judgment {i}: missing key(s) {sorted(missing)}")
            rows.append(
                PairRow(
                    prompt=tuple((m["role"], m["content"]) for m in r["prompt"]),
                    target=str(r["target"]),
                    item_id=str(r["item_id"]),
                    dataset=str(r["dataset"]),
                    case="afr",
                    mitigation="none",
                    flip=r.get("flip"),
                    meta=_meta(r.get("meta")),
                )
            )
    return rows


def _dedup(rows: list[PairRow]) -> tuple[list[PairRow], int, int]:
    """(unique rows, duplicates dropped, conflicting prompts dropped)."""
    by_prompt: dict[tuple, set[str]] = collections.defaultdict(set)
    for r in rows:
        by_prompt[r.prompt].add(r.target)
    conflicts = {p for p, targets in by_prompt.items() if len(targets) > 1}
    seen: set[tuple] = set()
    out: list[PairRow] = []
    dups = 0
    for r in rows:
        if r.prompt in conflicts:
            continue
        key = (r.prompt, r.target)
        if key in seen:
            dups += 1
            continue
        seen.add(key)
        out.append(r)
    return out, dups, len(conflicts)


def _balance(rows: list[PairRow], rng: random.Random) -> tuple[list[PairRow], int]:
    """Down-sample the majority target (seeded) so '1' and '2' are equal (multi-turn rows,
    whose targets are letters, are kept as they are)."""
    if any(r.rejected is not None for r in rows):
        binary = [r for r in rows if r.rejected is None]
        kept, dropped = _balance(binary, rng) if binary else ([], 0)
        keep = {id(r) for r in kept}
        return [r for r in rows if r.rejected is not None or id(r) in keep], dropped
    by_target = {t: [r for r in rows if r.target == t] for t in TARGETS}
    n = min(len(v) for v in by_target.values())
    kept: set[int] = set()
    for group in by_target.values():
        idx = list(range(len(group)))
        if len(group) > n:
            idx = sorted(rng.sample(idx, n))
        kept |= {id(group[i]) for i in idx}
    out = [r for r in rows if id(r) in kept]
    return out, len(rows) - len(out)


LENGTH_POLICIES = ("refuse", "drop", "truncate")


@dataclasses.dataclass
class LengthPolicy:
    """What to do with a prompt over max_prompt_length tokens (see the module docstring)."""

    policy: str
    max_prompt_length: int | None
    tokenizer: Any = None
    tokenizer_name: str | None = None

    def __post_init__(self):
        if self.policy not in LENGTH_POLICIES:
            raise UserError(f"pairs.length_policy must be one of {LENGTH_POLICIES}, got {self.policy!r}")
        if self.policy != "refuse" and not (isinstance(self.max_prompt_length, int) and self.max_prompt_length > 0):
            raise UserError(f"pairs.length_policy {self.policy!r} needs pairs.max_prompt_length (tokens, > 0), "
                             f"got {self.max_prompt_length!r}")
        if self.policy != "refuse" and self.tokenizer is None:
            raise UserError(f"pairs.length_policy {self.policy!r} needs a tokenizer to count prompt tokens")


def _truncate_row(row: PairRow, tokenizer, limit: int) -> PairRow | None:
    """The row with its user turn's first tokens cut until the prompt is <= limit tokens;
    None when even an empty user turn does not fit."""
    roles = [r for r, _ in row.prompt]
    if "user" not in roles:
        return None
    u = len(roles) - 1 - roles[::-1].index("user")
    content_ids = tokenizer(row.prompt[u][1], add_special_tokens=False)["input_ids"]
    cut = len(chat_token_ids(tokenizer, row.messages)) - limit
    while 0 < cut <= len(content_ids):
        prompt = list(row.prompt)
        prompt[u] = ("user", tokenizer.decode(content_ids[cut:]))
        new = dataclasses.replace(row, prompt=tuple(prompt))
        over = len(chat_token_ids(tokenizer, new.messages)) - limit
        if over <= 0:
            return new
        cut += over  # re-tokenizing at the cut can add a token or two
    return None


def apply_length_policy(rows: list[PairRow], length: LengthPolicy | None) -> tuple[list[PairRow], dict[str, Any]]:
    """Rows within max_prompt_length under the policy, and the counts.json entry."""
    if length is None or length.policy == "refuse":
        return rows, {"policy": "refuse", "max_prompt_length": getattr(length, "max_prompt_length", None),
                      "note": "pairs over a trainer's max_length are refused by the trainer"}
    limit, tok = length.max_prompt_length, length.tokenizer
    out: list[PairRow] = []
    over: collections.Counter = collections.Counter()
    changed: collections.Counter = collections.Counter()
    lengths: dict[tuple, int] = {}
    longest = 0
    for row in rows:
        n = lengths.get(row.prompt)
        if n is None:
            n = lengths[row.prompt] = len(chat_token_ids(tok, row.messages))
        longest = max(longest, n)
        if n <= limit:
            out.append(row)
            continue
        over[row.dataset] += 1
        new = _truncate_row(row, tok, limit) if length.policy == "truncate" else None
        if new is not None:
            out.append(new)
            changed[row.dataset] += 1
    key = "truncated" if length.policy == "truncate" else "dropped"
    info = {
        "policy": length.policy, "max_prompt_length": limit, "tokenizer": length.tokenizer_name,
        "rows_checked": len(rows), "over_limit": sum(over.values()), "over_limit_per_dataset": dict(sorted(over.items())),
        key: sum(changed.values()) if length.policy == "truncate" else sum(over.values()),
        "longest_prompt_tokens_before": longest,
    }
    if length.policy == "truncate":
        info["dropped_untruncatable"] = sum(over.values()) - sum(changed.values())
    return out, info


@dataclasses.dataclass
class PairSet:
    """Built rows (after dedup, balance, weighting, shuffle) and their bookkeeping."""

    rows: list[PairRow]
    strategy: str
    seed: int
    duplicates: int = 0
    conflicts: int = 0
    dropped_for_balance: int = 0
    length: dict[str, Any] = dataclasses.field(default_factory=dict)
    accept_weight: int = 1
    rules: PairRules = PairRules()
    filtered: int = 0  # rows the include/exclude filters dropped
    capitulation_weight: int = 1
    held_back_rows: int = 0  # rows of items the validation slice holds back (before dedup and balance)
    validation: dict[str, Any] | None = None  # counts.json's `validation` (pairs/validation.summary)
    c1_true_weight: int = 1

    def counts(self) -> dict[str, Any]:
        per: dict[str, dict[str, int]] = {}
        for r in self.rows:
            c = per.setdefault(r.dataset, {"rows": 0, "target_1": 0, "target_2": 0, "multi_turn_rows": 0,
                                           "flipped_rows": 0, "items": 0})
            c["rows"] += 1
            c["flipped_rows"] += int(bool(r.flip))
            if r.rejected is not None:
                c["multi_turn_rows"] += 1
            elif r.target in TARGETS:
                c[f"target_{r.target}"] += 1
        for ds in per:
            per[ds]["items"] = len({r.item_id for r in self.rows if r.dataset == ds})
        total = {k: sum(v[k] for v in per.values())
                 for k in ("rows", "target_1", "target_2", "multi_turn_rows", "flipped_rows", "items")}
        flips = collections.Counter(r.flip for r in self.rows if r.flip)
        conversations = collections.Counter(r.case for r in self.rows if r.rejected is not None)
        turns = collections.Counter(_turn_label(r) for r in self.rows if r.rejected is not None)
        return {
            "strategy": self.strategy,
            "seed": self.seed,
            "per_dataset": dict(sorted(per.items())),
            "total": total,
            "flip_types": dict(sorted(flips.items())),
            "conversations": dict(sorted(conversations.items())),
            # by protocol, scenario and turn, what the model's last answer was, and whether the base model
            # capitulated there (repeats included): which planted behaviour has rows that correct it
            "conversation_turns": dict(sorted(turns.items())),
            "accept_weight": self.accept_weight,
            "capitulation_weight": self.capitulation_weight,
            "c1_true_weight": self.c1_true_weight,
            "duplicates_dropped": self.duplicates,
            "conflicting_prompts_dropped": self.conflicts,
            "dropped_for_balance": self.dropped_for_balance,
            "prompt_length": self.length,
            "rules": self.rules.as_dict(),
            "dropped_by_filters": self.filtered,
            "contributed": contributed(self.rows),
            **({"validation": self.validation} if self.validation else {}),
        }


def _turn_label(row: PairRow) -> str:
    """A multi-turn row's place, as counts.json counts it: 'sos/hold negative t2 after abstention, corrects a
    capitulation'."""
    meta = dict(row.meta)
    after = meta.get("after")
    label = f"{row.case} {meta.get('scenario', '?')} t{meta.get('turn', '?')}" + (f" after {after}" if after not in (None, "-") else "")
    return label + (", corrects a capitulation" if row.flip == CAPITULATION else "")


def contributed(rows: Iterable[PairRow]) -> dict[str, dict[str, int]]:
    """Rows per protocol, dataset, framing and kind (repeats included): what the pairs trained on,
    which the study's transfer report reads to give each evaluated cell its role."""
    out: dict[str, collections.Counter] = {k: collections.Counter() for k in ("protocols", "datasets", "framings", "kinds")}
    for r in rows:
        f = r.facets
        out["protocols"][r.protocol] += 1
        out["datasets"][r.dataset] += 1
        out["framings"][f"{r.protocol}/{r.framing}"] += 1
        for kind in f["kinds"]:
            out["kinds"][f"{r.dataset}/{kind}"] += 1
    return {k: dict(sorted(v.items())) for k, v in out.items()}


def build_pairs(
    items: Sequence[Item],
    strategy: str = "all",
    flips=None,
    *,
    seed: int = 42,
    balance: bool = True,
    flip_weight: int = 3,
    framings: Sequence[str] = ("c1", "c2", "dehumanizing"),
    afr_rows: Sequence[dict] | None = None,
    test_items: Iterable[Item] | None = None,
    length: LengthPolicy | None = None,
    conversations: Sequence[dict] | None = None,
    accept_weight: int = 1,
    capitulation_weight: int = 1,
    rules: PairRules | None = None,
    eval_ids: dict[str, set[str]] | None = None,
    held_back: HoldBack | None = None,
    c1_true_weight: int = 1,
) -> PairSet:
    """Rows for one strategy (plus the multi-turn `conversations` rows of
    flipguard.pairs.conversations), kept by the include/exclude `rules` and checked against
    their held_out rule and the evaluation's item ids (`eval_ids`: dataset -> ids), less every row
    of an item the validation slice holds back (`held_back`, pairs/validation.py); shared by the SFT
    and DPO formatters below."""
    refuse_test_items(items, test_items)
    if strategy == "conversation" and not conversations:
        raise UserError("strategy 'conversation' needs pairs.conversations (--pairs_conversations RUN_DIR ...): "
                         "AFR / stick-or-switch run directories of the train split")
    rows = _strategy_rows(strategy, items, flips, flip_weight, framings, afr_rows) + [
        PairRow(prompt=tuple((m["role"], m["content"]) for m in c["prompt"]), target=c["chosen"], rejected=c["rejected"],
                item_id=str(c["item_id"]), dataset=str(c["dataset"]), case=conversation_case(c['protocol'], c['kind']),
                mitigation=c.get("mitigation") or "none", meta=_meta(c.get("meta")), flip=c.get("flip"))
        for c in conversations or ()
    ]
    held_rows = 0
    if held_back is not None:
        kept = [r for r in rows if not held_back.holds(r.dataset, r.item_id)]
        rows, held_rows = kept, len(rows) - len(kept)
    rules = rules or PairRules()
    rows, filtered = select(rows, rules)
    check_leakage(rows, rules, eval_ids)
    check_binary(rows, f"strategy {strategy!r}")
    rows, length_info = apply_length_policy(rows, length)
    rows, dups, conflicts = _dedup(rows)
    rng = random.Random(seed)
    dropped = 0
    if balance and rows:
        rows, dropped = _balance(rows, rng)
    if strategy == "flip_weighted":
        rows = [r for r in rows for _ in range(int(flip_weight) if r.flip else 1)]
    for name, weight in (("accept_weight", accept_weight), ("capitulation_weight", capitulation_weight),
                         ("c1_true_weight", c1_true_weight)):
        if int(weight) < 1:
            raise UserError(f"{name} must be an integer >= 1, got {weight!r}")
    twins = _corrected_after_abstaining(rows)
    rows = [r for r in rows
            for _ in range(_repeats(r, int(accept_weight), int(capitulation_weight), twins, int(c1_true_weight)))]
    rng.shuffle(rows)
    if not rows:
        raise UserError(
            f"strategy {strategy!r} produced no pairs from {len(items)} item(s)"
            + (" (the base model flipped on none of them)" if strategy == "flips" else "")
            + (f" ({filtered} row(s) dropped by pairs.include/exclude)" if filtered else "")
        )
    return PairSet(rows, strategy, seed, dups, conflicts, dropped, length_info, int(accept_weight), rules, filtered,
                   int(capitulation_weight), held_rows, c1_true_weight=int(c1_true_weight))


def _corrected_after_abstaining(rows: Sequence[PairRow]) -> set[tuple[str, str, int]]:
    """(dataset, item, turn) of every hold row after an abstention that corrects a capitulation: the turns
    whose accept row (the same chat offering the right option instead) is its twin."""
    return {(r.dataset, r.item_id, dict(r.meta).get("turn")) for r in rows
            if r.flip == CAPITULATION and dict(r.meta).get("after") == "abstention"}


def _repeats(row: PairRow, accept_weight: int, capitulation_weight: int, twins: set[tuple[str, str, int]],
             c1_true_weight: int) -> int:
    """How many times a row appears (neither trainer reads per-row weights: repetition): a C1-true row c1_true_weight
    times; a hold row of a conversation the base model capitulated in capitulation_weight times; an accept row
    accept_weight times, or, when
    the wrong option offered at the same turn of the same item was taken (its twin, repeated as a correction),
    capitulation_weight times if that is more: after an abstention, declining a wrong option and taking the
    right one are weighed alike, so a model that switched blindly is taught to tell them apart, not never to switch
    (as the flips strategy keeps a flipped item's twin)."""
    if row.case == "c1_true":
        return c1_true_weight
    if row.case.endswith("/accept"):
        twin = (row.dataset, row.item_id, dict(row.meta).get("turn")) in twins
        return max(accept_weight, capitulation_weight) if twin else accept_weight
    return capitulation_weight if row.flip == CAPITULATION else 1


def _meta_columns(r: PairRow) -> dict[str, Any]:
    return {"item_id": r.item_id, "dataset": r.dataset, "case": r.case, "mitigation": r.mitigation, "flip": r.flip or ""}


def sft_records(pairs: PairSet) -> list[dict[str, Any]]:
    return [
        {"prompt": r.messages, "completion": [{"role": "assistant", "content": r.target}], **_meta_columns(r)}
        for r in pairs.rows
    ]


def dpo_records(pairs: PairSet) -> list[dict[str, Any]]:
    return [
        {
            "prompt": r.messages,
            "chosen": [{"role": "assistant", "content": r.target}],
            "rejected": [{"role": "assistant", "content": r.rejected_reply}],
            **_meta_columns(r),
        }
        for r in pairs.rows
    ]


def build_sft_pairs(items: Sequence[Item], strategy: str = "all", flips=None, **kwargs):
    """`datasets.Dataset` in TRL's conversational prompt-completion format."""
    from datasets import Dataset

    return Dataset.from_list(sft_records(build_pairs(items, strategy, flips, **kwargs)))


def build_dpo_pairs(items: Sequence[Item], strategy: str = "all", flips=None, **kwargs):
    """`datasets.Dataset` in TRL's conversational preference format (prompt/chosen/rejected)."""
    from datasets import Dataset

    return Dataset.from_list(dpo_records(build_pairs(items, strategy, flips, **kwargs)))


# ---------------------------------------------------------------- writing


def write_pairs(pairs: PairSet, out_dir: str | Path, meta: dict[str, Any] | None = None,
                probes: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write both formats, the validation slice's probes (when one was held back), counts.json and
    pairs.json into out_dir (built in a temp folder
    and moved in, so a crash never leaves half a pair set). Only a pair set flipguard
    wrote is replaced (publish.publish_dir): an existing file, or a non-empty directory
    holding anything else, is refused and left as it was. Returns the counts."""
    from datasets import Dataset


    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory; choose another --out")
    # a staging folder marked as flipguard's: a kill mid-build leaves one the next build removes (files.staging_dir)
    with staging_dir(out_dir) as tmp:
        fingerprints = {}
        for name, records in ((SFT_DIR, sft_records(pairs)), (DPO_DIR, dpo_records(pairs))):
            ds = Dataset.from_list(records)
            ds.save_to_disk(str(tmp / name))
            fingerprints[name] = ds._fingerprint
            with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as fh:
                for rec in records:
                    fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        if probes is not None:
            write_probes(probes, tmp)
        counts = pairs.counts()
        (tmp / COUNTS_FILE).write_text(json.dumps(counts, indent=2) + "\n", encoding="utf-8")
        digest = file_sha256(tmp / f"{SFT_DIR}.jsonl")[:16]
        full_meta = {**(meta or {}), "strategy": pairs.strategy, "seed": pairs.seed,
                     "fingerprints": fingerprints, "sft_jsonl_sha256": digest, "rows": len(pairs.rows)}
        (tmp / META_FILE).write_text(json.dumps(full_meta, indent=2, default=str) + "\n", encoding="utf-8")
        try:
            publish_dir(tmp, out_dir, writer="flipguard pairs", last=(META_FILE, COUNTS_FILE))
        except RecordError as exc:
            raise UserError(str(exc)) from None
    return counts


def print_counts(counts: dict[str, Any], out_dir: str | Path | None = None) -> None:
    table = Table(title=f"pairs: strategy={counts['strategy']} seed={counts['seed']}")
    keys = ("items", "rows", "target_1", "target_2", "multi_turn_rows", "flipped_rows")
    for col in ("dataset", "items", "rows", "target 1", "target 2", "multi-turn", "flipped rows"):
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for ds, c in counts["per_dataset"].items():
        table.add_row(ds, *(str(c.get(k, 0)) for k in keys))
    t = counts["total"]
    table.add_row("total", *(str(t.get(k, 0)) for k in keys), style="bold")
    console = Console(file=sys.stdout)
    console.print(table)
    console.print(
        f"dropped: {counts['duplicates_dropped']} duplicate(s), {counts['conflicting_prompts_dropped']} "
        f"conflicting prompt(s), {counts['dropped_for_balance']} for 50/50 balance"
        + (f"; each C1-true row then {counts['c1_true_weight']} times" if counts.get("c1_true_weight", 1) > 1 else "")
    )
    if counts.get("conversations"):
        console.print("multi-turn pairs: " + ", ".join(f"{k} {v}" for k, v in counts["conversations"].items())
                      + " (hold = keep the answer against push-back; accept = take the right option after an abstention; "
                      "keep = a right turn-1 answer replayed"
                      + (f"; each accept pair {counts['accept_weight']} times" if counts.get("accept_weight", 1) > 1 else "")
                      + (f"; each hold pair the base model capitulated in {counts['capitulation_weight']} times"
                         if counts.get("capitulation_weight", 1) > 1 else "")
                      + ")")
        corrections = sum(n for label, n in (counts.get("conversation_turns") or {}).items() if "corrects" in label)
        console.print(f"  of these, {corrections} row(s) correct a capitulation of the base model (by scenario and turn: "
                      "counts.json conversation_turns)")
    held = counts.get("validation")
    if held:
        console.print(f"validation slice: {', '.join(f'{d} {n}' for d, n in held['items_held_back'].items())} item(s) held "
                      f"back from the pairs ({held['rows_held_back']} row(s) before dedup and balance), "
                      f"{sum(held['probes'].values())} probe(s) in {held['file']} (seed {held['seed']})")
    rules = {k: v for k, v in (counts.get("rules") or {}).items() if v}
    if rules:
        console.print("filters: " + "; ".join(f"{k} {v}" for k, v in rules.items())
                      + f" ({counts.get('dropped_by_filters', 0)} row(s) dropped by include/exclude; held_out checked)")
    length = counts.get("prompt_length") or {}
    if length.get("policy") in ("drop", "truncate"):
        done = (f"{length['truncated']} truncated, {length['dropped_untruncatable']} dropped (could not fit)"
                if length["policy"] == "truncate" else f"{length['dropped']} dropped")
        console.print(f"prompt length ({length['policy']}, max {length['max_prompt_length']} tokens, "
                      f"{length['tokenizer']}): {length['over_limit']} of {length['rows_checked']} rows over; {done}")
    if out_dir is not None:
        console.print(f"pairs written to {out_dir} ({SFT_DIR}/, {DPO_DIR}/, *.jsonl, {COUNTS_FILE})")


# ---------------------------------------------------------------- CLI


@dataclasses.dataclass
class PairsCommandArguments:
    """Command-line shortcuts for `flipguard pairs` (override the recipe's pairs: section)."""

    records: str | None = dataclasses.field(default=None, metadata={"help": "Train-split eval run directory (pairs.records)."})
    out: str | None = dataclasses.field(default=None, metadata={"help": "Output folder (pairs.dir)."})
    datasets: str | None = dataclasses.field(default=None, metadata={"help": "Train datasets (pairs.datasets)."})
    seed: int | None = dataclasses.field(default=None, metadata={"help": "Seed for balancing and row order (pairs.seed)."})


def load_afr_rows(afr_run: str | None) -> list[dict]:
    if not afr_run:
        raise UserError("strategy 'afr' needs pairs.afr_run (--pairs_afr_run RUN_DIR): an answer-flip run directory")
    return list(afr_judgments(afr_run))


def evaluation_ids(test_items: Iterable[Item] | None, conversations: Iterable[dict]) -> dict[str, set[str]]:
    """dataset -> ids of its test split: the DDS test items and, for the datasets of the multi-turn
    pairs, their registered multiple-choice test split (a dataset without one has nothing to check)."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for it in test_items or ():
        out[it.dataset].add(it.id)
    for dataset in sorted({str(c["dataset"]) for c in conversations}):
        try:
            out[dataset] |= {it.id for it in load_mc(dataset, "test")}
        except DataError:
            continue  # not a registered multiple-choice dataset with a test file (MMLU samples: another loader)
    return dict(out)


FLIP_STRATEGIES = ("flips", "flip_weighted")  # strategies that cannot run without flip records


def length_policy_for(args: PairsArguments, model: str | None) -> LengthPolicy:
    """The recipe's prompt-length policy, with the tokenizer it counts with (loaded only
    for drop/truncate: the recipe's pairs.tokenizer, else its model)."""
    if args.pairs_length_policy == "refuse":
        return LengthPolicy("refuse", args.pairs_max_prompt_length)
    name = args.pairs_tokenizer or model
    if not name:
        raise UserError(f"pairs.length_policy {args.pairs_length_policy!r}: no tokenizer to count prompt tokens; "
                         "set pairs.tokenizer or the recipe's model_name_or_path")

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(name))
    except (OSError, ValueError) as exc:
        raise UserError(f"pairs.length_policy {args.pairs_length_policy!r}: cannot load tokenizer {name!r} "
                         f"({str(exc).splitlines()[0]})") from None
    return LengthPolicy(args.pairs_length_policy, args.pairs_max_prompt_length, tokenizer, name)


def run(args: PairsArguments, recipe_path: str | None = None, records_given: bool = False,
        model: str | None = None, validation: ValidationArguments | None = None) -> tuple[Path, dict[str, Any]]:
    """Build and write the pair set a PairsArguments describes; with `validation` on, less the items
    its slice holds back, whose probes it writes beside (pairs/validation.py).

    Flip records (pairs.records) annotate the rows of every strategy but afr, so counts
    and pairs.json say what the base model flipped; flips/flip_weighted require them. A
    recipe's default records folder that does not exist is skipped with a note for the
    other strategies; one given on the command line (`records_given`) must exist.
    """
    length = length_policy_for(args, model)  # before any data work: a missing tokenizer fails fast
    items: list[Item] = []
    test_items = None
    flips = None
    afr_rows = None
    records_used = None
    conversations = None
    if args.pairs_conversations:
        conversations = [row for run_dir in args.pairs_conversations
                         for row in conversation_rows(run_dir, args.pairs_conversation_model, args.pairs_keep_first_answers)]
    if args.pairs_strategy == "afr":
        afr_rows = load_afr_rows(args.pairs_afr_run)
    elif args.pairs_strategy == "conversation":
        pass
    else:
        items = load_items(args.pairs_datasets, split="train", data_root=args.pairs_data_root)
        test_items = load_test_items_for(items, args.pairs_data_root)
        records = args.pairs_records
        if args.pairs_strategy in FLIP_STRATEGIES or (records and (records_given or Path(records).exists())):
            flips = flips_from_records(records, items, args.pairs_datasets)
            records_used = records
        elif records:
            print(f"note: pairs.records {records} does not exist; rows are not annotated with flips "
                  f"(strategy {args.pairs_strategy!r} does not need them)", file=sys.stderr)
    rules = PairRules.from_args(args)
    held, probes = None, None
    if validation is not None and validation.on:
        held, probes = validation_slice(args, validation, items, records_used, conversations or ())
    pairs = build_pairs(
        items,
        args.pairs_strategy,
        flips,
        seed=args.pairs_seed,
        balance=args.pairs_balance,
        flip_weight=args.pairs_flip_weight,
        accept_weight=args.pairs_accept_weight,
        capitulation_weight=args.pairs_capitulation_weight,
        c1_true_weight=args.pairs_c1_true_weight,
        framings=args.pairs_framings,
        afr_rows=afr_rows,
        test_items=test_items,
        length=length,
        conversations=conversations,
        rules=rules,
        eval_ids=evaluation_ids(test_items, conversations or ()),
        held_back=held,
    )
    if held is not None:
        pairs.validation = summary(probes, held, pairs.held_back_rows)
    meta = {"recipe": recipe_path, "records": records_used, "datasets": args.pairs_datasets,
            "data_root": args.pairs_data_root, "pairs_args": dataclasses.asdict(args)}
    counts = write_pairs(pairs, args.pairs_dir, meta, probes)
    return Path(args.pairs_dir), counts


def validation_slice(args: PairsArguments, validation: ValidationArguments, items: Sequence[Item], records: str | None,
                     conversations: Sequence[dict]) -> tuple[HoldBack, list[dict[str, Any]]]:
    """The items the validation slice holds back (seeded, by item, per dataset) and their probes: the base
    model's own train-split judgments of them (pairs.records) and conversations (pairs.conversations)."""
    if items and not records:
        raise UserError("validation.every is on, and the slice measures the base model's judgments of the items it holds "
                        f"back: give pairs.records (the base model's train-split run: {eval_command(None)})")
    ids: dict[str, set[str]] = collections.defaultdict(set)
    train = [r for r in load_records(records) if r.split == "train"] if items else []  # read once: judged and probed
    judged = {(r.dataset, r.item_id) for r in train}
    for it in items:
        if (it.dataset, it.id) in judged:  # an item the base model's run did not judge has nothing to measure
            ids[it.dataset].add(it.id)
    for c in conversations:
        ids[str(c["dataset"])].add(str(c["item_id"]))
    seed = args.pairs_seed if validation.validation_seed is None else validation.validation_seed
    held = choose(ids, validation.validation_share, validation.validation_max_items, seed)
    probes = dds_probes(train, held)
    for run_dir in args.pairs_conversations:
        probes += conversation_probes(run_dir, held)
    if not probes:
        raise UserError("validation.every is on but the items held back have no judgment to measure (no DDS records "
                        "of them in pairs.records, no conversation in pairs.conversations)")
    return held, probes


def main(argv: list[str]) -> int:
    (args, validation, cli), recipe_path, recipe = parse_recipe(
        argv, (PairsArguments, ValidationArguments, PairsCommandArguments), trainer=None, prog="flipguard pairs"
    )
    if cli.records is not None:
        args.pairs_records = cli.records
    if cli.out is not None:
        args.pairs_dir = cli.out
    if cli.datasets is not None:
        args.pairs_datasets = cli.datasets
    if cli.seed is not None:
        args.pairs_seed = cli.seed
    given = cli.records is not None or any(a.startswith("--pairs_records") for a in argv)
    out_dir, counts = run(args, recipe_path, records_given=given, model=(recipe or {}).get("model_name_or_path"),
                          validation=validation)
    print_counts(counts, out_dir)
    return 0
