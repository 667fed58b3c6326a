"""The one bootstrap (eval/bootstrap.py) and the one estimate type (eval/estimate.py), on
hand-built data whose answers follow from counting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flipguard.eval import bootstrap as B
from flipguard.eval.dds import metrics as M
from flipguard.eval.estimate import NAN, Estimate


def test_constant_sample_gives_a_zero_width_interval_at_its_value():
    for scheme in ({}, {"clusters": np.repeat(np.arange(5), 2)}):
        stat = B.ratio if scheme else B.mean
        lo, hi = B.interval([np.ones(10)], stat, 500, 3, **scheme)
        assert (lo, hi) == (1.0, 1.0)


def test_two_items_resample_to_the_three_possible_means():
    # items 0 and 1: a resample holds both (mean .5, p = 1/2), two 0s or two 1s (p = 1/4 each)
    dist = B.distribution([np.array([0.0, 1.0])], B.mean, 4000, 0)
    assert set(np.unique(dist)) == {0.0, 0.5, 1.0}
    assert np.mean(dist == 0.5) == pytest.approx(0.5, abs=0.04)  # sd of the share: 0.008
    assert B.percentile_ci(dist) == (0.0, 1.0)


def test_cluster_resampling_moves_a_cluster_whole():
    # cluster a = one row of 1, cluster b = three rows of 0: a resample of two clusters is
    # aa (rate 1), ab (1/4) or bb (0); item resampling of the four rows could give 1/2, 3/4
    values, clusters = np.array([1.0, 0, 0, 0]), np.array(["a", "b", "b", "b"])
    dist = B.distribution([values], B.ratio, 2000, 1, clusters=clusters)
    assert set(np.unique(dist)) == {0.0, 0.25, 1.0}
    items = B.distribution([values], B.mean, 2000, 1)
    assert {0.5, 0.75} <= set(np.unique(items))


def test_cluster_resampling_of_identical_clusters_equals_item_resampling():
    rng = np.random.default_rng(4)
    per_cluster = (rng.random(40) < 0.3).astype(float)
    rows = np.repeat(per_cluster, 3)  # each cluster: three identical rows
    clustered = B.interval([rows], B.ratio, 2000, 9, clusters=np.repeat(np.arange(40), 3))
    itemwise = B.interval([per_cluster], B.mean, 2000, 9)
    assert clustered == pytest.approx(itemwise, abs=1e-12)


def test_paired_draws_make_a_difference_of_a_sample_with_itself_zero():
    x = np.random.default_rng(2).random(50)
    dist = B.distribution([x, x], lambda a, b, axis=-1: a.mean(axis) - b.mean(axis), 500, 0)
    assert np.all(dist == 0)
    assert B.two_sided_p(dist) == 1.0
    assert B.two_sided_p(np.r_[np.ones(99), -1.0]) == pytest.approx(0.02)


def test_fewer_than_two_units_or_no_replicates_give_no_interval():
    assert all(math.isnan(v) for v in B.interval([np.ones(1)], B.mean, 100, 0))
    assert all(math.isnan(v) for v in B.interval([np.ones(6)], B.ratio, 100, 0, clusters=np.zeros(6)))
    assert all(math.isnan(v) for v in B.interval([np.arange(5.0)], B.mean, 0, 0))


def test_batched_draws_equal_one_batch(monkeypatch):
    x = np.random.default_rng(5).random(301)  # odd size: batches must keep the stream aligned
    whole = B.distribution([x], B.mean, 1000, 7)
    monkeypatch.setattr(B, "_BATCH_VALUES", 301 * 64)
    assert np.array_equal(B.distribution([x], B.mean, 1000, 7), whole)


def test_named_generators_do_not_depend_on_each_other():
    a = B.rng_for(0, "gpqa").random()
    B.rng_for(0, "bbq").random()
    assert B.rng_for(0, "gpqa").random() == a != B.rng_for(1, "gpqa").random()


def test_dds_average_rows_use_the_same_draws_as_the_dataset_rows():
    # a stratified interval over one group is that group's interval (same generator)
    X = (np.random.default_rng(3).random((60, 4)) < 0.6).astype(float)
    single = M.bootstrap_ci(X, 1000, B.rng_for(0, "stratum:x"))
    strat = M.stratified_bootstrap_ci([X], 1000, 0, names=["x"])
    for key in ("dds_ci_low", "dds_ci_high", "delta_correct_ci_low", "delta_incorrect_ci_high"):
        assert strat[key] == pytest.approx(single[key], abs=1e-9)


# --------------------------------------------------------------------------- Estimate


def test_estimate_serialises_to_each_report_shape_and_back():
    e = Estimate(0.25, 0.1, 0.4, n=40, unit="share")
    assert e.as_dict() == {"value": 0.25, "lo": 0.1, "hi": 0.4, "n": 40, "unit": "share"}
    pct = e.to("%")
    assert (pct.value, pct.lo, pct.hi, pct.unit) == (25.0, 10.0, 40.0, "%")
    assert e.to("share") is e
    # sos_summary.json stores ci_low/ci_high without a unit; DDS rows are flat columns
    stored = Estimate(-12.5, -20.0, -5.0, n=24, unit="pp").as_dict("ci_low", "ci_high", unit=False)
    assert stored == {"value": -12.5, "ci_low": -20.0, "ci_high": -5.0, "n": 24}
    assert Estimate.from_dict(stored, "pp") == Estimate(-12.5, -20.0, -5.0, n=24, unit="pp")
    assert Estimate.from_dict(e.as_dict()) == e
    dds = Estimate(30.0, 21.5, 38.0, n=20, unit="pp", se=4.25)
    assert dds.columns("dds", se=True) == {"dds": 30.0, "dds_ci_low": 21.5, "dds_ci_high": 38.0, "dds_se": 4.25}
    assert dds.columns("dds") == {"dds": 30.0, "dds_ci_low": 21.5, "dds_ci_high": 38.0}


def test_estimate_format_and_missing_values():
    assert Estimate(0.8, 0.7, 0.9).to("%").format() == "80.0 [70.0, 90.0]"
    assert Estimate(0.125).to("%").format() == "12.5"
    assert Estimate(3.0, 1.0, 5.0, unit="pp").format(signed=True) == "+3.0 [+1.0, +5.0]"
    assert NAN.format() == "–" and Estimate.from_dict(None) is NAN
    assert Estimate.from_dict({"value": float("nan"), "lo": 1, "hi": 2}).missing
    with pytest.raises(dataclasses_frozen_error()):
        Estimate(1.0).value = 2.0  # type: ignore[misc]


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_dds_report_columns_are_the_estimates():
    from flipguard.eval.dds.report import build_report
    from flipguard.eval.synthetic import synthetic_records

    recs = synthetic_records({"gpqa": 40}, seed=2)
    stats = build_report(recs, n_boot=300, seed=5).stats.set_index(["dataset", "stratum"])
    X = M.correctness(M.item_frame(recs))
    est = M.dds_estimates(X, 300, B.rng_for(5, "gpqa"))
    for name, e in est.items():
        assert e.unit == "pp" and e.n == 40
        for col, v in e.columns(name, se=True).items():
            assert stats.loc[("gpqa", "all"), col] == pytest.approx(v, abs=1e-12)
