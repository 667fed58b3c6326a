"""Paired statistics beyond one cell's CI (eval/paired.py, and the columns pipeline/transfer.py adds
with them): the same-items check, Holm and Benjamini-Hochberg, the minimal detectable difference and the
verdict. Every expected number is worked out by hand here (scipy's binomial test stands for McNemar's
exact test: the same binomial of the discordant pairs)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binomtest

from flipguard.errors import UserError
from flipguard.eval import paired as P
from flipguard.pipeline import transfer as T

Z = 1.959964 + 0.841621  # z(0.975) + z(0.80), from a normal table


def test_the_exact_test_needs_six_discordant_pairs():
    assert binomtest(0, 5, 0.5).pvalue > 0.05 > binomtest(0, 6, 0.5).pvalue
    assert P.MIN_DISCORDANT == 6


def test_item_mismatch_names_what_differs():
    same = {"1": {"task version": "1", "prompt": "a"}, "2": {"task version": "1", "prompt": "b"}}
    assert P.item_mismatch(same, dict(same)) is None
    other = {"1": {"task version": "2", "prompt": "a"}, "2": {"task version": "2", "prompt": "B"},
             "3": {"task version": "2", "prompt": "c"}}
    line = P.item_mismatch(same, other, names=("A", "B"))
    assert line == ("task version 1 in A, 2 in B; 1 item of 2 with another prompt (ids 2); 1 item only in B (ids 3)")
    assert "\n" not in line


def test_holm_and_benjamini_hochberg_by_hand():
    p = [0.01, 0.04, 0.03, math.nan, 0.5]
    # Holm over the 4 tested: sorted 0.01, 0.03, 0.04, 0.5 times 4, 3, 2, 1 = 0.04, 0.09, 0.08, 0.5; running max
    assert P.adjust(p, "holm") == pytest.approx([0.04, 0.09, 0.09, math.nan, 0.5], nan_ok=True)
    # BH: p * 4 / rank = 0.04, 0.06 (0.03), 0.0533 (0.04), 0.5; running min from the largest
    assert P.adjust(p, "bh") == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, math.nan, 0.5], nan_ok=True)
    assert np.isnan(P.adjust([math.nan], "holm")).all()


def test_minimal_detectable_difference():
    # never below 6 of n units changed (8 units: 75 pp), whatever the standard error; no change seen: that floor
    assert P.minimal_detectable_difference(0.0, 8) == pytest.approx(75.0)
    assert P.minimal_detectable_difference(20.0, 8) == pytest.approx(75.0)
    assert P.minimal_detectable_difference(30.0, 8) == pytest.approx(30.0 * Z, rel=1e-5)
    assert P.minimal_detectable_difference(2.0, 1000) == pytest.approx(2.0 * Z, rel=1e-5)  # floor 0.6 pp
    assert math.isnan(P.minimal_detectable_difference(math.nan, 8))


def test_verdicts():
    assert P.verdict(0.01, 50.0, 10.0) == "changed"
    assert P.verdict(0.5, 4.0, 10.0) == "no change"
    assert P.verdict(0.5, 40.0, 10.0) == "too few items to tell"
    assert P.verdict(math.nan, 4.0, 10.0) == ""


def _units(condition: str, cell: str, values: list[float]) -> list[dict]:
    return [{"condition": condition, "protocol": "x", "system": condition, "dataset": cell, "kind": "",
             "framing": "score", "metric": "score", "key": str(i), "cluster": str(i), "value": v, "judgments": (v,)}
            for i, v in enumerate(values)]


def test_transfer_rows_tell_no_change_from_too_few_items():
    # "balanced": 400 items, 20 fixed and 20 broken; "better": 40 of 400 fixed; "small": 10 items, 1 fixed
    before = {"balanced": [1.0] * 20 + [0.0] * 20 + [1.0] * 360, "better": [0.0] * 40 + [1.0] * 360,
              "small": [0.0] + [1.0] * 9}
    after = {"balanced": [0.0] * 20 + [1.0] * 20 + [1.0] * 360, "better": [1.0] * 400, "small": [1.0] * 10}
    rows = [u for cell in before for u in _units("before", cell, before[cell]) + _units("after", cell, after[cell])]
    table = T.transfer_table(pd.DataFrame(rows), {}, T.Roles(None), n_boot=2000, seed=0)
    got = table[table["condition"] == "after"].set_index("dataset")
    p = {"balanced": binomtest(20, 40, 0.5).pvalue, "better": binomtest(0, 40, 0.5).pvalue,
         "small": binomtest(0, 1, 0.5).pvalue}
    assert got["mcnemar_p"].to_dict() == pytest.approx(p)
    assert set(got["test"]) == {"mcnemar"}
    # Holm over the three: the smallest times 3, the others (p = 1) stay 1
    assert got.loc["better", "p_adjusted"] == pytest.approx(3 * p["better"])
    assert got.loc["balanced", "p_adjusted"] == got.loc["small", "p_adjusted"] == 1.0
    # balanced: per-item change d in {-1, 0, +1}, mean 0, variance 40/400; SE = sqrt(0.1 / 400) = 1.581 pp
    assert got.loc["balanced", "mdd"] == pytest.approx(Z * 100 * math.sqrt(0.1 / 400), rel=0.06)
    assert got.loc["small", "mdd"] == pytest.approx(60.0)  # 6 of 10 items, the exact test's floor
    assert got["verdict"].to_dict() == {"balanced": "no change", "better": "changed", "small": "too few items to tell"}
    assert (table[table["condition"] == "before"]["verdict"] == "").all()  # the baseline is not tested against itself


def test_units_of_two_judgments_are_tested_by_the_bootstrap():
    # a DDS unit (two C2 judgments per item) is not one 0/1 outcome, even where its values happen to be 0 or 1
    rows = [{"condition": c, "protocol": "dds", "system": c, "dataset": "d", "kind": "", "framing": "c2", "metric": "dds",
             "key": str(i), "cluster": str(i), "value": 1.0 if c == "A" else 0.0, "judgments": (1.0, 0.0)}
            for c in ("A", "B") for i in range(10)]
    row = T.transfer_table(pd.DataFrame(rows), {}, T.Roles(None), n_boot=200).iloc[-1]
    assert (row["condition"], row["test"], row["change"]) == ("B", "bootstrap", -100.0)
    assert row["p_adjusted"] == row["p_boot"] == 0.0  # every replicate at -100: none crosses 0
    assert row["mdd"] == pytest.approx(60.0) and row["verdict"] == "changed"


def test_units_of_other_items_are_refused_not_paired():
    def units(condition, prompts):
        return [{"condition": condition, "protocol": "inspect", "system": condition, "dataset": "t", "kind": "",
                 "framing": "match", "metric": "match", "key": k, "cluster": k, "value": 1.0, "judgments": (1.0,),
                 "match": {"task version": "1", "prompt": h}} for k, h in prompts.items()]

    frame = pd.DataFrame(units("A", {"1": "a", "2": "b"}) + units("B", {"1": "a", "2": "changed"}))
    with pytest.raises(UserError, match=r"inspect:t:match: B is not paired with A \(not the same items\): "
                                          r"1 item of 2 with another prompt \(ids 2\)"):
        T.transfer_table(frame, {}, T.Roles(None), n_boot=10)
