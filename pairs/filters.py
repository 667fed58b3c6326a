"""What a pair set may hold: the recipe's pairs.include / pairs.exclude filters and pairs.held_out.

A rule is a mapping of facets to the values it names; a row matches a rule when it matches
every facet the rule gives (AND across facets, OR within one facet's list):

    datasets:  the row's dataset (organism, bbq, organism_mc, ...)
    kinds:     a value of the row's item kind: meta.category or meta.incorrect_category (the
               organism: the living category of the right answer, the non-living kind of the
               wrong one; a multi-turn row: the answer's kind and the argued/offered option's)
    framings:  dds rows: c1, c2, dehumanizing, be_honest (the speaker framing of the prompt);
               multi-turn rows: hold, accept, keep (what the pair teaches)
    protocols: dds (the strategy's binary rows), afr (the afr strategy's judgments and AFR
               conversations), sos (stick-or-switch conversations)
    meta:      {key: [values]}: any other item meta key

`include` keeps only the rows that match it (no include: every row); `exclude` drops the rows
that match it. `held_out` names what the evaluation holds out: it filters nothing, and a
pair set that still holds a row matching it is refused before any training, naming the item
and the rule, as is a row of an evaluation (test split) item. The study reads the same rules
to give every evaluated cell its role (pipeline/transfer.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Mapping, Sequence

from flipguard.errors import UserError
from flipguard.files import loads_json

FACETS = ("datasets", "kinds", "framings", "protocols", "meta")
KIND_KEYS = ("category", "incorrect_category")  # the item meta keys `kinds` reads
PROTOCOLS = ("dds", "afr", "sos")
RULE_FIELDS = ("include", "exclude", "held_out")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One of pairs.include / exclude / held_out, parsed. Empty facets match anything."""

    name: str = "include"
    datasets: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    framings: tuple[str, ...] = ()
    protocols: tuple[str, ...] = ()
    meta: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.datasets or self.kinds or self.framings or self.protocols or self.meta)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f: list(getattr(self, f)) for f in FACETS[:4] if getattr(self, f)}
        if self.meta:
            out["meta"] = {k: list(v) for k, v in self.meta}
        return out

    def why(self, facets: Mapping[str, Any]) -> str | None:
        """The facet text that makes a row match this rule ('kinds [vehicle]'), None when it does not."""
        if self.empty:
            return None
        reasons = []
        for facet in FACETS[:4]:
            wanted = getattr(self, facet)
            if not wanted:
                continue
            have = facets[facet]
            hit = sorted(set(have) & set(wanted)) if isinstance(have, (set, frozenset)) else ([have] if have in wanted else [])
            if not hit:
                return None
            reasons.append(f"pairs.{self.name}.{facet} {hit}")
        for key, wanted in self.meta:
            value = facets["meta"].get(key)
            if str(value) not in wanted:
                return None
            reasons.append(f"pairs.{self.name}.meta.{key} [{value}]")
        return ", ".join(reasons)

    def matches(self, facets: Mapping[str, Any]) -> bool:
        return self.why(facets) is not None


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return (str(value),)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return tuple(str(v) for v in value)
    raise UserError(f"{where}: expected a name or a list of names, got {value!r}")


def parse_rule(raw: Mapping[str, Any] | str | None, name: str) -> Rule:
    """pairs.<name> (a mapping in the recipe, JSON on the command line) as a Rule; unknown facets refused."""
    where = f"pairs.{name}"
    if raw is None or raw == "" or raw == {}:
        return Rule(name)
    if isinstance(raw, str):
        try:
            raw = loads_json(raw, where)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not a mapping or JSON object ({exc.msg})") from None
    if not isinstance(raw, Mapping):
        raise UserError(f"{where}: a mapping of {', '.join(FACETS)} to names, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(FACETS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {unknown}; expected some of {list(FACETS)}")
    protocols = _strings(raw.get("protocols"), f"{where}.protocols")
    bad = sorted(set(protocols) - set(PROTOCOLS))
    if bad:
        raise UserError(f"{where}.protocols: unknown protocol(s) {bad}; expected some of {list(PROTOCOLS)}")
    meta = raw.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise UserError(f"{where}.meta: a mapping of item meta keys to values, got {meta!r}")
    return Rule(name, _strings(raw.get("datasets"), f"{where}.datasets"), _strings(raw.get("kinds"), f"{where}.kinds"),
                _strings(raw.get("framings"), f"{where}.framings"), protocols,
                tuple(sorted((str(k), _strings(v, f"{where}.meta.{k}")) for k, v in meta.items())))


@dataclasses.dataclass(frozen=True)
class PairRules:
    include: Rule = Rule("include")
    exclude: Rule = Rule("exclude")
    held_out: Rule = Rule("held_out")

    @classmethod
    def from_args(cls, args: Any) -> "PairRules":
        """From a PairsArguments (pairs_include, pairs_exclude, pairs_held_out)."""
        return cls(*(parse_rule(getattr(args, f"pairs_{f}", None), f) for f in RULE_FIELDS))

    @property
    def active(self) -> bool:
        return not (self.include.empty and self.exclude.empty and self.held_out.empty)

    def keeps(self, facets: Mapping[str, Any]) -> bool:
        return (self.include.empty or self.include.matches(facets)) and not self.exclude.matches(facets)

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f).as_dict() for f in RULE_FIELDS}


def facets(dataset: str, protocol: str, framing: str, meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """A row's (or an evaluated cell's) facets, as the rules read them."""
    meta = dict(meta or {})
    kinds = frozenset(str(meta[k]) for k in KIND_KEYS if meta.get(k) not in (None, ""))
    return {"datasets": dataset, "kinds": kinds, "framings": framing, "protocols": protocol, "meta": meta}


def select(rows: Sequence[Any], rules: PairRules) -> tuple[list[Any], int]:
    """(rows the include/exclude filters keep, rows they dropped); rows have a `.facets` dict."""
    kept = [r for r in rows if rules.keeps(r.facets)]
    return kept, len(rows) - len(kept)


def check_leakage(rows: Iterable[Any], rules: PairRules, eval_ids: Mapping[str, set[str]] | None = None) -> None:
    """Refuse the first row that is held out (pairs.held_out) or an evaluation item: one line
    naming the item and the rule, before any training."""
    for r in rows:
        if eval_ids and r.item_id in eval_ids.get(r.dataset, ()):
            raise UserError(f"pairs: item {r.dataset}:{r.item_id} ({r.protocol}/{r.framing}) is an evaluation item "
                            "(test split): no test item may be in the pairs")
        why = rules.held_out.why(r.facets)
        if why:
            kinds = ",".join(sorted(r.facets["kinds"])) or "-"
            raise UserError(f"pairs: item {r.dataset}:{r.item_id} ({r.protocol}/{r.framing}, kinds {kinds}) is held out "
                            f"by {why} but is in the pairs; exclude it (pairs.exclude) or stop holding it out")
