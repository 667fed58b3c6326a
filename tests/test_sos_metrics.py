"""Stick-or-switch arithmetic on hand-built transcripts (records written by hand, no model)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from flipguard.eval.bootstrap import interval as bootstrap_ci
from flipguard.eval.records import Record, RecordStore
from flipguard.eval.sos.metrics import (
    conversation_frame,
    flexibility_rates,
    summarise,
    survival_curve,
    survival_row,
)
from flipguard.eval.sos.prompts import parse_answer
from flipguard.files import atomic_write_json

_n = iter(range(10**6))


def rec(item, scenario, turn, choice, *, target="A", offered=None, n_turns=3, case=None, expected=None,
        repeat=0, branch=None, model="m", mitigation="none"):
    """One hand-written reply; choice None = unreadable."""
    return Record(
        key=f"k{next(_n)}", protocol="sos", item_id=item, dataset="medqa",
        case=case or f"{scenario}/t{turn}" + (f"_{branch}" if branch else ""),
        expected=expected or target, model=model, backend="hand", mode="generate", mitigation=mitigation,
        choice=choice, valid=choice is not None, raw_output=f"Answer: {choice}" if choice else "??",
        extra={"scenario": scenario, "turn": turn, "repeat": repeat, "n_turns": n_turns, "target": target,
               "branch": branch, "offered": {offered: "text"} if offered else None,
               "options_shown": {}},
    )


def conv(item, scenario, choices, n_turns=3, target="A", repeat=0, model="m"):
    """A conviction conversation: turn-1 choice, then one reply per offered letter C, D, ..."""
    out = []
    for t, choice in enumerate(choices, start=1):
        offered = "ABCDEFGHIJ"[t] if t > 1 else None
        out.append(rec(item, scenario, t, choice, target=target, offered=offered, n_turns=n_turns, repeat=repeat, model=model))
    return out


def base(item, case, correct, repeat=0, model="m", mitigation="none"):
    return rec(item, "baseline", 1, "A" if correct else "B", case=case, expected="A", repeat=repeat,
               model=model, mitigation=mitigation)


def test_survival_row_is_the_running_product():
    assert survival_row([1, 1, 0], 3, 3) == [1, 1, 0]
    assert survival_row([0], 3, 3) == [0, 0, 0]
    assert survival_row([1, 1], 2, 4) == [1, 1, 1, 1]  # two distractors only: carried forward
    assert survival_row([1, 0], 2, 4) == [1, 0, 0, 0]


def test_survival_and_end_reasons_from_transcripts():
    records = (
        conv("i1", "positive", ["A", "A", "A"])  # holds to the end
        + conv("i2", "positive", ["A", "C"])  # switches to the offered C at t2
        + conv("i3", "positive", ["A", "A", "B"])  # goes back to the turn-1 distractor B at t3
        + conv("i4", "positive", [None])  # unreadable at t1
    )
    frame = conversation_frame(records)
    ends = dict(zip(frame["item_id"], frame["end"]))
    assert ends == {"i1": "exhausted", "i2": "switch", "i3": "revert", "i4": "invalid"}
    # S(1) = 3/4, S(2) = 2/4, S(3) = 1/4
    assert survival_curve(frame).tolist() == pytest.approx([0.75, 0.5, 0.25])


def test_incomplete_conversations_are_counted_not_scored():
    records = conv("i1", "positive", ["A", "A", "A"]) + conv("i2", "positive", ["A", "A"])  # t3 missing
    res = summarise(records, n_boot=50)["m"]
    assert res["positive_incomplete"] == 1 and res["positive_n"] == 1
    assert res["positive_survival"] == pytest.approx([100.0, 100.0, 100.0])


def test_conversation_tax_and_abstention_penalty_with_repeats():
    records = []
    # item x: SS right in both repeats; MT survives in repeat 0 only  -> 0.5 - 1 = -0.5
    # item y: SS right in repeat 0 only; MT survives in both         -> 1 - 0.5 = +0.5
    # item z: SS wrong twice, MT fails twice                          -> 0
    for r in (0, 1):
        records += [base("x", "ss_full", True, r), base("y", "ss_full", r == 0, r), base("z", "ss_full", False, r)]
        records += conv("x", "positive", ["A", "A", "A"] if r == 0 else ["A", "C"], repeat=r)
        records += conv("y", "positive", ["A", "A", "A"], repeat=r)
        records += conv("z", "positive", ["B"], repeat=r)
        # abstention: SS abstains on x and y; MT keeps NA only on x, in both repeats
        records += [base("x", "abstain_full", True, r), base("y", "abstain_full", True, r),
                    base("z", "abstain_full", False, r)]
        records += conv("x", "negative", ["B", "B", "B"], target="B", repeat=r)
        records += conv("y", "negative", ["B", "B", "A"], target="B", repeat=r)
        records += conv("z", "negative", ["B", "C"], target="B", repeat=r)
    res = summarise(records, seed=1, n_boot=500)["m"]
    assert res["ss_full"]["value"] == pytest.approx(50.0)  # (1 + 0.5 + 0) / 3
    assert res["positive_mt"]["value"] == pytest.approx(50.0)  # (0.5 + 1 + 0) / 3
    assert res["conversation_tax"]["value"] == pytest.approx(0.0) and res["conversation_tax"]["n"] == 3
    assert res["abstain_full"]["value"] == pytest.approx(200 / 3)
    assert res["negative_mt"]["value"] == pytest.approx(100 / 3)
    assert res["abstention_penalty"]["value"] == pytest.approx(-100 / 3)  # (0 - 1 - 0) / 3 items
    assert res["negative_ends"] == {"exhausted": 2, "revert": 2, "switch": 2}
    tax = res["conversation_tax"]
    assert tax["ci_low"] < 0 < tax["ci_high"]
    # the penalty is -1 on one item and 0 on two: every resample lies in [-100, 0]
    pen = res["abstention_penalty"]
    assert -100 <= pen["ci_low"] <= pen["value"] <= pen["ci_high"] <= 0


def test_flexibility_rates_conditioned_on_abstention():
    flex = pd.DataFrame({
        "item_id": ["a", "b", "c", "d"],
        "abstained": [1, 1, 1, 0],
        "correct_switch": [1.0, 1.0, 0.0, np.nan],
        "incorrect_switch": [1.0, 0.0, 0.0, np.nan],
    })
    res = flexibility_rates(flex, seed=0, n_boot=300)
    assert res["correct_switch"]["value"] == pytest.approx(200 / 3) and res["correct_switch"]["n"] == 3
    assert res["incorrect_switch"]["value"] == pytest.approx(100 / 3)
    assert res["switch_gap"]["value"] == pytest.approx(100 / 3)
    assert res["abstained_t1"]["value"] == pytest.approx(75.0)


def test_flexibility_from_records_counts_only_the_offered_option_as_switch():
    records = [
        rec("a", "flexibility", 1, "B", target="B", n_turns=2),
        rec("a", "flexibility", 2, "C", target="B", offered="C", n_turns=2, branch="correct", expected="C"),
        rec("a", "flexibility", 2, "A", target="B", offered="C", n_turns=2, branch="incorrect"),  # back to d1: no switch
        rec("b", "flexibility", 1, "A", target="B", n_turns=2),  # took the distractor: not eligible
    ]
    fx = summarise(records, n_boot=50)["m"]["flexibility"]
    assert fx["correct_switch"]["value"] == 100.0 and fx["incorrect_switch"]["value"] == 0.0
    assert fx["correct_switch"]["n"] == 1


def test_systems_are_split_by_model_and_mitigation():
    records = [base("x", "ss_full", True), base("x", "ss_full", False, mitigation="be_honest"),
               base("x", "ss_full", False, model="other")]
    res = summarise(records, n_boot=50)
    assert {k: v["ss_full"]["value"] for k, v in res.items()} == {"m": 100.0, "m +be_honest": 0.0, "other": 0.0}


def test_bootstrap_ci_brackets_the_mean_and_is_seeded():
    x = np.array([0, 1, 1, 0, 1, 1, 1, 0, 1, 1], dtype=float)
    lo, hi = bootstrap_ci([x], lambda a, axis=-1: a.mean(axis=axis), seed=5, n_boot=2000)
    assert lo < 0.7 < hi and 0.3 <= lo and hi <= 1.0
    assert (lo, hi) == bootstrap_ci([x], lambda a, axis=-1: a.mean(axis=axis), seed=5, n_boot=2000)
    assert bootstrap_ci([np.ones(4)], lambda a, axis=-1: a.mean(axis=axis), seed=0) == (1.0, 1.0)
    assert all(math.isnan(v) for v in bootstrap_ci([np.ones(1)], lambda a, axis=-1: a.mean(axis=axis), seed=0))


@pytest.mark.parametrize("raw, letters, expected", [
    ("Answer: C", "ABC", "C"),
    ("answer: b", "AB", "B"),
    ("**Answer:** (B)", "AB", "B"),
    ("The answer is A.", "AB", "A"),
    ("I'd stick. Answer: A\nOn reflection, Answer: C", "ABC", "C"),
    ("B", "AB", "B"),
    ("(A) because ...", "AB", "A"),
    ("Answer: D", "ABC", None),  # not shown in this chat
    ("A good question; I cannot say.", "AB", None),
    ("I would answer a different question", "AB", None),
    ("", "AB", None),
])
def test_parse_answer(raw, letters, expected):
    assert parse_answer(raw, letters) == expected


def test_report_files_from_hand_records(tmp_path):
    from flipguard.eval.sos.report import sos_summary, write_report

    records = [base("x", "ss_full", True), base("y", "ss_full", False)]
    records += conv("x", "positive", ["A", "C"]) + conv("y", "positive", ["A", "A", "A"])
    store = RecordStore(tmp_path / "records.jsonl")
    store.append(records)
    atomic_write_json(tmp_path / "run.json", {"protocol": "sos", "dataset": "medqa", "seed": 0, "n_boot": 100})
    md = write_report(tmp_path).read_text()
    assert "| m | 50.0 | 50.0 (+0.0) |" in md
    assert "| m | positive | 100.0 | 50.0 | 50.0 |" in md
    a1 = pd.read_csv(tmp_path / "report" / "sos_table_a1_conversation_tax.csv")
    assert a1.loc[0, "delta_pp"] == pytest.approx(0.0)
    s = sos_summary(tmp_path)
    assert s.numbers["m"].conversation_tax.value == pytest.approx(0.0)
    assert s.numbers["m"].abstention_penalty is None  # negative scenario not run


def test_abstention_penalty_both_readings_hand_computed():
    """Four items. Single-shot accuracy (all options) 1,1,0,1; single-shot abstention (NA
    replacing the answer) 1,0,0,1; negative conversations held to the end 1,1,0,0.
    Ours: mean(MT - SS abstention) = (0 + 1 + 0 - 1) / 4 = 0.0 pp.
    Paper (Table A.2: SS = Table A.1's single-shot accuracy): (0 + 0 + 0 - 1) / 4 = -25.0 pp."""
    from flipguard.eval.sos.report import markdown, tables

    records = []
    for item, acc, abst in (("i1", 1, 1), ("i2", 1, 0), ("i3", 0, 0), ("i4", 1, 1)):
        records += [base(item, "ss_full", acc), base(item, "abstain_full", abst)]
    records += conv("i1", "negative", ["A", "A", "A"]) + conv("i2", "negative", ["A", "A", "A"])
    records += conv("i3", "negative", ["A", "C"]) + conv("i4", "negative", ["B"])
    res = summarise(records, seed=0, n_boot=200)["m"]
    assert res["negative_mt"]["value"] == pytest.approx(50.0)
    assert res["abstention_penalty"]["value"] == pytest.approx(0.0)
    assert res["abstention_penalty_paper"]["value"] == pytest.approx(-25.0)
    paper = tables({"m": res}, "paper")["table_a2_abstention_penalty"].iloc[0]
    assert (paper["reading"], paper["ss"], paper["delta_pp"], paper["other_delta_pp"]) == ("paper", 75.0, -25.0, 0.0)
    ours = tables({"m": res}, "ours")["table_a2_abstention_penalty"].iloc[0]
    assert (ours["ss"], ours["delta_pp"], ours["other_delta_pp"]) == (50.0, 0.0, -25.0)
    md = markdown({"m": res}, {"abstention_reference": "paper", "sampling": "model_default"})
    assert "paper reading" in md and "| Δ ours |" in md and "default sampling settings (paper §4.2" in md
