"""DDS metrics on hand-made records, checked against hand-computed values."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from scipy.stats import binomtest

from flipguard.eval.dds import metrics as M
from flipguard.eval.dds.report import build_report
from flipguard.eval.records import CASES, EXPECTED_CHOICE, Record
from flipguard.eval.synthetic import synthetic_records

WRONG = {"1": "2", "2": "1"}


def rec(dataset, item_id, case, right=True, valid=True, extra=None):
    exp = EXPECTED_CHOICE[case]
    choice = (exp if right else WRONG[exp]) if valid else None
    return Record(key=f"{dataset}/{item_id}/{case}", protocol="dds", item_id=item_id, dataset=dataset,
                  case=case, expected=exp, model="m", backend="test", mode="generate",
                  choice=choice, valid=valid, raw_output=choice or "garbage", extra=extra or {})


def dataset_records(dataset, n, n_right, prefix="i", extra=None):
    """n items; case k is right on the first n_right[k] items."""
    out = []
    for i in range(n):
        for case, k in zip(CASES, n_right):
            out.append(rec(dataset, f"{prefix}{i:03d}", case, right=i < k, extra=extra))
    return out


# The paper's worked example (§3.3): C1 60/80 -> C2 75/65, 20 items.
PAPER = dataset_records("bbq", 20, (12, 16, 15, 13))


def test_paper_example_dds():
    r = build_report(PAPER, n_boot=0).summary.set_index("dataset").loc["bbq"]
    assert (r.c1_true, r.c1_false, r.c2_correct, r.c2_incorrect) == pytest.approx((60, 80, 75, 65))
    assert r.delta_correct == pytest.approx(15)
    assert r.delta_incorrect == pytest.approx(-15)
    assert r.dds == pytest.approx(30)
    pm = M.point_metrics(M.correctness(M.item_frame(PAPER)))
    assert pm["c1_avg"] == pytest.approx(70) and pm["c2_avg"] == pytest.approx(70)
    assert M.paper_dds(60, 80, 75, 65) == pytest.approx(30)


def test_bootstrap_ci_contains_estimate_shrinks_and_is_seeded():
    X = M.correctness(M.item_frame(PAPER))
    ci = M.bootstrap_ci(X, 2000, 0)
    assert ci["dds_ci_low"] < 30 < ci["dds_ci_high"]
    assert ci["delta_correct_ci_low"] < 15 < ci["delta_correct_ci_high"]
    assert ci["delta_incorrect_ci_low"] < -15 < ci["delta_incorrect_ci_high"]
    big = np.repeat(X, 10, axis=0)  # same proportions, 10x the items
    ci_big = M.bootstrap_ci(big, 2000, 0)
    assert ci_big["dds_ci_high"] - ci_big["dds_ci_low"] < 0.5 * (ci["dds_ci_high"] - ci["dds_ci_low"])
    assert M.bootstrap_ci(X, 2000, 7) == M.bootstrap_ci(X, 2000, 7)
    assert M.bootstrap_ci(X, 2000, 7) != M.bootstrap_ci(X, 2000, 8)
    a = build_report(PAPER, n_boot=500, seed=3).stats
    b = build_report(list(reversed(PAPER)), n_boot=500, seed=3).stats
    assert a.equals(b)  # record order does not matter either


def test_bootstrap_width_matches_normal_approximation():
    # 400 items, independent cases with p=.5: sd of DDS = 100*sqrt(4*.25/400) = 5 pp
    rng = np.random.default_rng(1)
    X = (rng.random((400, 4)) < 0.5).astype(float)
    ci = M.bootstrap_ci(X, 2000, 0)
    width = ci["dds_ci_high"] - ci["dds_ci_low"]
    assert width == pytest.approx(2 * 1.96 * 5, rel=0.15)


def test_mcnemar_exact_on_hand_table():
    # correct pair: 2 items C1 right -> C2 wrong, 9 items C1 wrong -> C2 right, 5 both right, 4 both wrong
    recs = []
    plan = [(True, False)] * 2 + [(False, True)] * 9 + [(True, True)] * 5 + [(False, False)] * 4
    for i, (c1, c2) in enumerate(plan):
        iid = f"q{i}"
        recs += [rec("gpqa", iid, "c1_true", c1), rec("gpqa", iid, "c2_correct", c2),
                 rec("gpqa", iid, "c1_false", True), rec("gpqa", iid, "c2_incorrect", True)]
    row = build_report(recs, n_boot=0).stats.set_index("dataset").loc["gpqa"]
    assert row.mcnemar_correct_c1_right_c2_wrong == 2
    assert row.mcnemar_correct_c1_wrong_c2_right == 9
    assert row.mcnemar_correct_pvalue == pytest.approx(binomtest(2, 11, 0.5).pvalue)
    assert row.mcnemar_incorrect_pvalue == 1.0  # no discordant pairs
    # effect size: C2 accuracy 14/20 vs C1 7/20
    assert row.mcnemar_correct_cohens_h == pytest.approx(2 * math.asin(math.sqrt(0.7)) - 2 * math.asin(math.sqrt(0.35)))


def test_balanced_dds_two_strata():
    # OR stratum, 10 items: C1 2/8 -> C2 7/3 of 10:  ΔC=+50, ΔI=-50, DDS=+100
    # NOR stratum, 30 items: C1 15/15 -> C2 18/12 of 30: ΔC=+10, ΔI=-10, DDS=+20
    recs = dataset_records("aio", 10, (2, 8, 7, 3), prefix="or", extra={"stratum": "OR"})
    recs += dataset_records("aio", 30, (15, 15, 18, 12), prefix="nor", extra={"stratum": "NOR"})
    rep = build_report(recs, n_boot=300)
    b = rep.balanced["aio"]
    assert b["strata"]["OR"]["dds"] == pytest.approx(100)
    assert b["strata"]["NOR"]["dds"] == pytest.approx(20)
    assert b["balanced_dds"] == pytest.approx(60)
    # overall pools items: C1 17/23 -> C2 25/15 of 40: (62.5-42.5) - (37.5-57.5) = 40
    assert rep.summary.set_index("dataset").loc["aio", "dds"] == pytest.approx(40)
    st = rep.stats.set_index(["dataset", "stratum"])
    assert st.loc[("aio", "balanced"), "dds"] == pytest.approx(60)
    assert st.loc[("aio", "balanced"), "dds_ci_low"] <= 60 <= st.loc[("aio", "balanced"), "dds_ci_high"]
    # an explicit mapping overrides records' extra
    swap = {f"or{i:03d}": "X" for i in range(10)}
    assert "X" in build_report(recs, strata=swap, n_boot=0).balanced["aio"]["strata"]


def test_flip_directions_follow_the_paper():
    """Paper Tables 25-28 / taxonomy/extract_flips.py: only C1 judged right -> C2 judged
    wrong is a flip; an invalid answer is neither right nor wrong."""
    recs = []
    # a: C1-true wrong -> C2-correct right: a change, but no flip
    recs += [rec("bbq", "a", "c1_true", False), rec("bbq", "a", "c2_correct", True)]
    recs += [rec("bbq", "a", "c1_false", True), rec("bbq", "a", "c2_incorrect", True)]
    # b: C1-true right -> C2-correct wrong: skepticism
    recs += [rec("bbq", "b", "c1_true", True), rec("bbq", "b", "c2_correct", False)]
    recs += [rec("bbq", "b", "c1_false", False), rec("bbq", "b", "c2_incorrect", False)]
    # c: C1-false right -> C2-incorrect wrong: deference
    recs += [rec("bbq", "c", "c1_true", True), rec("bbq", "c", "c2_correct", True)]
    recs += [rec("bbq", "c", "c1_false", True), rec("bbq", "c", "c2_incorrect", False)]
    # d: C1-true right -> C2-correct invalid: no flip; C1-false wrong -> C2-incorrect right: no flip
    recs += [rec("bbq", "d", "c1_true", True), rec("bbq", "d", "c2_correct", valid=False)]
    recs += [rec("bbq", "d", "c1_false", False), rec("bbq", "d", "c2_incorrect", True)]
    # e: C1-false invalid -> C2-incorrect wrong: no flip (C1 was not judged right)
    recs += [rec("bbq", "e", "c1_true", True), rec("bbq", "e", "c2_correct", True)]
    recs += [rec("bbq", "e", "c1_false", valid=False), rec("bbq", "e", "c2_incorrect", False)]
    # f (another dataset): both flips on one item
    recs += [rec("amqa", "f", "c1_true", True), rec("amqa", "f", "c2_correct", False)]
    recs += [rec("amqa", "f", "c1_false", True), rec("amqa", "f", "c2_incorrect", False)]
    flips = M.flip_records(recs)
    assert tuple(flips.columns) == M.FLIP_COLUMNS
    got = {(r.item_id, r.pair): (r.flip, r.transition) for r in flips.itertuples()}
    assert got == {
        ("a", "correct"): (None, "wrong_to_right"), ("a", "incorrect"): (None, None),
        ("b", "correct"): ("skepticism", "right_to_wrong"), ("b", "incorrect"): (None, None),
        ("c", "correct"): (None, None), ("c", "incorrect"): ("deference", "right_to_wrong"),
        ("d", "correct"): (None, None), ("d", "incorrect"): (None, "wrong_to_right"),
        ("e", "correct"): (None, None), ("e", "incorrect"): (None, None),
        ("f", "correct"): ("skepticism", "right_to_wrong"), ("f", "incorrect"): ("deference", "right_to_wrong"),
    }
    row = flips[(flips.item_id == "a") & (flips.pair == "correct")].iloc[0]
    assert (row.c1_key, row.c2_key) == ("bbq/a/c1_true", "bbq/a/c2_correct")
    summary = M.flip_summary(flips)
    assert tuple(summary.columns) == ("dataset", "n_items", "deference", "skepticism", "flip_rate")
    assert summary.to_dict("records") == [
        {"dataset": "bbq", "n_items": 5, "deference": 1, "skepticism": 1, "flip_rate": pytest.approx(40.0)},
        {"dataset": "amqa", "n_items": 1, "deference": 1, "skepticism": 1, "flip_rate": pytest.approx(200.0)},
        {"dataset": "total", "n_items": 6, "deference": 2, "skepticism": 2, "flip_rate": pytest.approx(400 / 6)},
    ]
    tr = M.flip_transitions(flips).set_index("dataset").loc["bbq"]
    assert (tr.right_to_wrong_correct, tr.wrong_to_right_correct) == (1, 1)
    assert (tr.right_to_wrong_incorrect, tr.wrong_to_right_incorrect) == (1, 1)
    assert (tr.changes, tr.n_pairs) == (4, 10)


def test_paper_flip_counts_gpt4o_mini_bbq_shape():
    """Table 26 arithmetic: 39 deference + 23 skepticism over 300 items = 20.7%, while
    wrong->right changes (here 9 + 0) do not count."""
    recs = []
    for i in range(300):
        iid = f"q{i:03d}"
        c1f_right, c2i_right = True, not (i < 39)           # 39 deference flips
        c1t_right, c2c_right = not (39 <= i < 48), not (100 <= i < 123)  # 9 wrong->right, 23 skepticism
        recs += [rec("bbq", iid, "c1_true", c1t_right), rec("bbq", iid, "c2_correct", c2c_right),
                 rec("bbq", iid, "c1_false", c1f_right), rec("bbq", iid, "c2_incorrect", c2i_right)]
    row = M.flip_summary(M.flip_records(recs)).set_index("dataset").loc["bbq"]
    assert (row.n_items, row.deference, row.skepticism) == (300, 39, 23)
    assert round(row.flip_rate, 1) == 20.7


def test_invalid_outputs_are_counted_and_wrong():
    recs = dataset_records("bbq", 10, (10, 10, 10, 10))
    for r in recs:
        if r.case == "c2_incorrect" and r.item_id in ("i000", "i001", "i002"):
            r.valid, r.choice = False, None
    row = build_report(recs, n_boot=0).stats.set_index("dataset").loc["bbq"]
    assert row.invalid_c2_incorrect == 3 and row.invalid_c1_true == 0
    assert row.c2_incorrect == pytest.approx(70)
    # an invalid output whose stray choice equals the expected answer is still wrong
    bad = rec("bbq", "x", "c1_true")
    bad.valid = False
    assert not bad.correct


def test_over_correction_flag():
    assert M.over_correction(30.0, -5.0)
    assert not M.over_correction(30.0, 0.0)
    assert not M.over_correction(30.0, 10.0)
    assert not M.over_correction(-5.0, -20.0)
    assert not M.over_correction(float("nan"), -1.0)
    rep = build_report(PAPER, n_boot=0, baseline_dds={"bbq": -3.0})
    assert rep.stats.set_index("dataset").loc["bbq", "over_correction"] is False or \
        not rep.stats.set_index("dataset").loc["bbq", "over_correction"]
    # a mitigation that flips +30 to -10: C2 correct/incorrect 55/85 against C1 60/80
    mitig = [r for r in dataset_records("bbq", 20, (12, 16, 11, 17)) if r.case.startswith("c2")]
    c1 = [r for r in PAPER if r.case.startswith("c1")]
    rep = build_report(mitig, c1_records=c1, n_boot=0, baseline_dds={"bbq": 30.0})
    row = rep.stats.set_index("dataset").loc["bbq"]
    assert row.dds == pytest.approx(-10) and bool(row.over_correction) and row.c1_source == "baseline"


def test_avg_rows_are_macro_averages():
    recs = dataset_records("bbq", 20, (12, 16, 15, 13))          # DDS +30
    recs += dataset_records("gpqa", 40, (20, 20, 20, 20))         # DDS 0
    recs += dataset_records("aio", 10, (0, 10, 10, 0))            # DDS +200
    s = build_report(recs, n_boot=400).summary
    assert list(s["dataset"]) == ["bbq", "gpqa", "aio", "bench_avg", "total_avg"]
    s = s.set_index("dataset")
    assert s.loc["bench_avg", "dds"] == pytest.approx(15)        # (30 + 0) / 2, not pooled (10)
    assert s.loc["total_avg", "dds"] == pytest.approx(230 / 3)
    assert s.loc["bench_avg", "c1_true"] == pytest.approx((60 + 50) / 2)
    assert s.loc["total_avg", "c2_correct"] == pytest.approx((75 + 50 + 100) / 3)
    assert s.loc["bench_avg", "n"] == 60 and s.loc["total_avg", "n"] == 70
    assert s.loc["bench_avg", "dds_ci_low"] < 15 < s.loc["bench_avg", "dds_ci_high"]
    assert tuple(s.reset_index().columns) == M.SUMMARY_COLUMNS


def test_c2_only_run_needs_c1_baseline():
    c2 = [r for r in PAPER if r.case.startswith("c2")]
    with pytest.raises(M.MetricsError, match="--c1_from"):
        build_report(c2)
    rep = build_report(c2, c1_records=[r for r in PAPER if r.case.startswith("c1")], n_boot=0)
    assert rep.summary.set_index("dataset").loc["bbq", "dds"] == pytest.approx(30)


def test_duplicate_records_rejected():
    with pytest.raises(M.MetricsError, match="two records"):
        build_report(PAPER + [rec("bbq", "i000", "c1_true")], n_boot=0)


def test_incomplete_items_left_out():
    recs = PAPER + [rec("bbq", "extra", "c1_true")]
    rep = build_report(recs, n_boot=0)
    assert rep.meta["incomplete_items"] == 1
    assert rep.summary.set_index("dataset").loc["bbq", "n"] == 20


def test_full_report_is_fast():
    recs = synthetic_records()  # 3,244 items x 4 cases, paper sizes
    build_report(recs, n_boot=50)  # warm imports
    # CPU time, not wall time: other jobs sharing the 2 cores must not fail this test
    t = time.process_time()
    rep = build_report(recs, n_boot=2000, seed=0)
    assert time.process_time() - t < 2.0
    assert rep.meta["n_items"] == 3244
