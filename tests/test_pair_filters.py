"""pairs.include / exclude / held_out (pairs/filters.py): which rows a pair set holds, and
the refusal of a pair set that leaks a held-out kind or an evaluation item, before any training.
Expected row counts are counted by hand from the items below (4 rows per item with the
consistency strategy over c1 and c2: c1_true, c1_false, c2_correct, c2_incorrect)."""

from __future__ import annotations

import pytest

from flipguard.data.schema import Item
from flipguard.errors import UserError
from flipguard.pairs import builder as P
from flipguard.pairs.filters import PairRules, parse_rule

KINDS = ("tool", "tool", "vehicle", "color")


def organism_like_items() -> list[Item]:
    return [Item(id=f"org-{i}", dataset="organism", question=f"Which word on list {i} names something alive?",
                 correct_answer=f"apple{i}", incorrect_answer=f"{kind}{i}", split="train",
                 meta={"category": "fruit", "incorrect_category": kind}) for i, kind in enumerate(KINDS)]


def build(rules: PairRules, **kw) -> P.PairSet:
    return P.build_pairs(organism_like_items(), "consistency", framings=["c1", "c2"], seed=0, rules=rules, **kw)


def rules(**raw) -> PairRules:
    return PairRules(*(parse_rule(raw.get(f), f) for f in ("include", "exclude", "held_out")))


def test_no_rules_keep_every_row():
    assert len(build(PairRules()).rows) == 16


def test_include_a_kind_keeps_only_its_items():
    pairs = build(rules(include={"kinds": ["tool"]}))
    assert sorted({r.item_id for r in pairs.rows}) == ["org-0", "org-1"]
    assert len(pairs.rows) == 8 and pairs.filtered == 8
    assert pairs.counts()["contributed"]["kinds"] == {"organism/fruit": 8, "organism/tool": 8}


def test_exclude_a_kind_and_a_framing():
    pairs = build(rules(exclude={"kinds": ["vehicle"]}))
    assert "org-2" not in {r.item_id for r in pairs.rows} and len(pairs.rows) == 12
    c2_only = build(rules(exclude={"framings": ["c1"]}))
    assert {r.framing for r in c2_only.rows} == {"c2"} and len(c2_only.rows) == 8


def test_include_facets_are_anded():
    pairs = build(rules(include={"kinds": ["tool", "color"], "framings": ["c2"]}))
    # items 0, 1, 3 x (c2_correct, c2_incorrect)
    assert len(pairs.rows) == 6 and {r.framing for r in pairs.rows} == {"c2"}


def test_generic_meta_key():
    pairs = build(rules(include={"meta": {"incorrect_category": "color"}}))
    assert {r.item_id for r in pairs.rows} == {"org-3"}


def test_held_out_kind_in_the_pairs_is_refused_naming_item_and_rule():
    with pytest.raises(UserError) as err:
        build(rules(held_out={"kinds": ["vehicle"]}))
    message = str(err.value)
    assert "organism:org-2" in message and "pairs.held_out.kinds ['vehicle']" in message
    assert "\n" not in message
    # held out and excluded: accepted
    assert len(build(rules(exclude={"kinds": ["vehicle"]}, held_out={"kinds": ["vehicle"]})).rows) == 12


def test_held_out_dataset_is_refused():
    with pytest.raises(UserError, match=r"organism:org-0 .*pairs.held_out.datasets \['organism'\]"):
        build(rules(held_out={"datasets": ["organism"]}))


def test_an_evaluation_item_in_the_pairs_is_refused():
    with pytest.raises(UserError, match="organism:org-1 .*evaluation item"):
        build(PairRules(), eval_ids={"organism": {"org-1"}})


def test_protocol_filter_on_multi_turn_rows():
    conversations = [
        {"prompt": [{"role": "user", "content": f"q{i} {proto}"}], "chosen": "A", "rejected": "B", "item_id": f"mc-{i}",
         "dataset": "organism_mc", "protocol": proto, "kind": "hold", "meta": {"incorrect_category": kind}}
        for i, (proto, kind) in enumerate([("afr", "tool"), ("sos", "tool"), ("sos", "vehicle")])]
    kept = P.build_pairs([], "conversation", conversations=conversations, seed=0, rules=rules(exclude={"protocols": ["sos"]}))
    assert [r.item_id for r in kept.rows] == ["mc-0"] and kept.rows[0].framing == "hold"
    with pytest.raises(UserError, match="organism_mc:mc-2 .*pairs.held_out.kinds"):
        P.build_pairs([], "conversation", conversations=conversations, seed=0, rules=rules(held_out={"kinds": "vehicle"}))


def test_bad_rules_are_one_line_errors():
    with pytest.raises(UserError, match="unknown key"):
        parse_rule({"kind": ["tool"]}, "include")
    with pytest.raises(UserError, match="unknown protocol"):
        parse_rule({"protocols": ["mmlu"]}, "exclude")
    assert parse_rule('{"kinds": ["tool"]}', "include").kinds == ("tool",)
