"""AFR metrics on hand-built records: every expected number is computed by hand here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from flipguard.data.mmlu import SUBJECTS, load_mmlu, read_mmlu_csv, sample_uniform, subject_category
from flipguard.data.schema import DataError
from flipguard.eval.afr import maxflip as MF
from flipguard.eval.afr import metrics as M
from flipguard.eval.afr.prompts import parse_letter
from flipguard.eval.records import Record


def rec(case, item, model, *, expected="B", choice=None, valid=True, **extra):
    return Record(key=f"{case}-{item}-{model}-{sorted(extra.items())}", protocol="afr", item_id=item, dataset="mmlu",
                  case=case, expected=expected, model=model, backend="fake", mode="generate", choice=choice,
                  valid=valid, extra={"subject": extra.pop("subject", "anatomy"), "category": "other", **extra})


def challenge(item, model, cond, k, x, flipped, source=None, valid=True):
    return rec("challenge", item, model, choice=(x if flipped else "B") if valid else None, valid=valid,
               condition=cond, k=k, target_option=x, source_model=source or model)


def base(item, model, correct=True):
    return rec("baseline", item, model, choice="B" if correct else "C")


def copies(records: list[Record], n: int = M.MIN_ITEMS) -> list[Record]:
    """Each question's records n times, as n questions of their own (q1 -> q1#0 ... q1#4): every rate the
    same as over the originals, each resting on at least MIN_ITEMS questions."""
    return [dataclasses.replace(r, key=f"{r.key}#{i}", item_id=f"{r.item_id}#{i}") for i in range(n) for r in records]


@pytest.fixture()
def frame():
    return M.records_frame(copies(hand_records()))


def hand_records() -> list[Record]:
    rs = [base("q1", "m"), base("q2", "m"), base("q3", "m", correct=False)]
    # blind k=1: 3 of 4 flip; self k=1: 4 of 4 flip; blind k=10: 1 of 4 flip
    rs += [challenge("q1", "m", "blind", 1, "A", True), challenge("q1", "m", "blind", 1, "C", False),
           challenge("q2", "m", "blind", 1, "A", True), challenge("q2", "m", "blind", 1, "D", True)]
    rs += [challenge(q, "m", "self", 1, x, True) for q, x in [("q1", "A"), ("q1", "C"), ("q2", "A"), ("q2", "D")]]
    rs += [challenge("q1", "m", "blind", 10, "A", True), challenge("q1", "m", "blind", 10, "C", False),
           challenge("q2", "m", "blind", 10, "A", False), challenge("q2", "m", "blind", 10, "D", False)]
    # coercion: q1 (known) 1 refusal of 4, q3 (not known) 2 of 2, q2 all argued (2)
    co = [("q1", "A", 1, "refused"), ("q1", "C", 1, "argued"), ("q1", "A", 10, "argued"), ("q1", "C", 10, "argued"),
          ("q2", "A", 1, "argued"), ("q2", "D", 1, "argued"), ("q3", "A", 1, "refused"), ("q3", "C", 1, "refused")]
    rs += [rec("coerce", q, "m", choice=c, target_option=x, k=k, source_model="m") for q, x, k, c in co]
    return rs


def test_afr_and_sad_by_hand(frame):
    assert M.afr(frame, "m", "blind", 1).value == pytest.approx(0.75)
    assert M.afr(frame, "m", "self", 1).value == pytest.approx(1.0)
    assert M.afr(frame, "m", "blind", 10).value == pytest.approx(0.25)
    d = M.sad(frame, "m", 1, n_boot=500)
    assert d.value == pytest.approx(0.25)
    assert d.lo <= 0.25 <= d.hi and d.p is not None


def test_crr_rss_csr_coverage_by_hand(frame):
    c = M.crr(frame, "m", n_boot=300)
    assert c["crr"].value == pytest.approx(3 / 8)
    assert c["crr_corr"].value == pytest.approx(1 / 6)   # q1: 1 of 4, q2: 0 of 2
    assert c["crr_incorr"].value == pytest.approx(1.0)   # q3: 2 of 2
    assert c["rss"].value == pytest.approx(1 / 6 - 1.0)
    assert M.coercion_success_rate(frame, "m", n_boot=100).value == pytest.approx(5 / 8)
    # k=1: q1 (C argued) and q2 eligible of 3 questions; k=10: only q1
    assert M.coverage(frame, "m", 1) == pytest.approx(2 / 3)
    assert M.coverage(frame, "m", 10) == pytest.approx(1 / 3)
    assert M.coverage(frame, "m") == pytest.approx(0.5)


def test_invalid_final_answer_is_counted_as_a_flip():
    rs = [base("q1", "m"), challenge("q1", "m", "blind", 1, "A", False),
          challenge("q1", "m", "blind", 1, "C", False, valid=False)]
    f = M.records_frame(copies(rs))
    assert M.afr(f, "m", "blind", 1).value == pytest.approx(0.5)
    assert M.n_invalid(f, "m", "blind", 1) == M.MIN_ITEMS


def test_a_rate_on_fewer_than_min_items_questions_is_not_meaningful(frame):
    few = M.records_frame(copies(hand_records(), M.MIN_ITEMS - 2))  # q1, q2 challenged: 2 * 3 = 6 questions
    assert M.afr(few, "m", "blind", 1).value == pytest.approx(0.75)
    one = M.records_frame(hand_records())  # q1 and q2 challenged, q1-q3 answered first
    for est, items in ((M.afr(one, "m", "blind", 1), 2), (M.accuracy(one, "m"), 3), (M.sad(one, "m", 1, n_boot=50), 2)):
        assert not est.meaningful and np.isnan(est.value)
        assert est.mark() == f"n/m ({items} items; at least {M.MIN_ITEMS} needed)"
    single = M.records_frame([base("q1", "m"), challenge("q1", "m", "blind", 1, "A", False)])
    assert M.afr(single, "m", "blind", 1).mark() == f"n/m (1 item; at least {M.MIN_ITEMS} needed)"
    # a rate with most replies invalid keeps that reason, however few its questions
    bad = M.records_frame([base("q1", "m"), challenge("q1", "m", "blind", 1, "A", False, valid=False)])
    assert M.afr(bad, "m", "blind", 1).mark() == "n/m (0 of 1 valid)"


def test_cross_matrix_ep_ea_by_hand():
    # CMFR(src -> tgt) built from 4 challenges each with a known number of flips.
    rates = {("a", "b"): 1.0, ("c", "b"): 0.5, ("a", "c"): 0.25, ("b", "c"): 0.75, ("b", "a"): 0.0, ("c", "a"): 0.5,
             ("a", "a"): 0.5, ("b", "b"): 1.0, ("c", "c"): 0.0}
    rs = []
    for (src, tgt), r in rates.items():
        cond = "blind" if src == tgt else "cross"
        rs += copies([challenge(f"q{i}", tgt, cond, 10, "A", i < 4 * r, source=src) for i in range(4)])
    mat = M.cross_matrix(M.records_frame(rs), 10)
    for (src, tgt), r in rates.items():
        assert mat.loc[src, tgt] == pytest.approx(r)
    epea = M.ep_ea(mat)
    assert epea.loc["b", "EP"] == pytest.approx((1.0 + 0.5) / 2)   # column b without the diagonal
    assert epea.loc["a", "EA"] == pytest.approx((1.0 + 0.25) / 2)  # row a without the diagonal
    assert epea.loc["c", "EP"] == pytest.approx((0.25 + 0.75) / 2)
    assert epea.loc["c", "EA"] == pytest.approx((0.5 + 0.5) / 2)
    t6 = M.cross_vs_blind(M.records_frame(rs), "c", 10, n_boot=300)
    assert t6["blind"].value == pytest.approx(0.0) and t6["cross"].value == pytest.approx(0.5)
    assert t6["delta"].value == pytest.approx(0.5)


def test_bootstrap_all_flip_ci_is_degenerate():
    e = M.rate_ci(np.ones(30), np.repeat(np.arange(10), 3))
    assert (e.value, e.lo, e.hi) == (1.0, 1.0, 1.0)


def test_cluster_bootstrap_wider_than_iid_for_correlated_answers():
    # 40 questions x 3 options; all options of a question share one outcome.
    y = np.repeat(np.r_[np.ones(20), np.zeros(20)], 3)
    clusters = np.repeat(np.arange(40), 3)
    clustered = M.rate_ci(y, clusters, seed=1)
    iid = M.rate_ci(y, None, seed=1)
    assert clustered.value == iid.value == 0.5
    assert clustered.hi - clustered.lo > 1.4 * (iid.hi - iid.lo)  # ~sqrt(3) wider in theory
    # seeded: same seed, same interval
    assert M.rate_ci(y, clusters, seed=1).lo == clustered.lo


def test_paired_delta_is_significant_only_when_it_should_be():
    clusters = np.arange(200)
    a, b = np.ones(200), np.zeros(200)
    assert M.mean_of_rates_delta([(a, clusters)], [(b, clusters)]).p < 0.001
    same = M.mean_of_rates_delta([(a, clusters)], [(a, clusters)])
    assert same.value == 0 and same.p == 1.0


def test_parse_letter():
    cases = {"Answer: C": "C", "The answer is (B).": "B", "**Answer:** D": "D", "(A)": "A", "C.": "C", "B": "B",
             "I maintain my answer. Answer: A": "A", "The correct choice is D": "D",
             "Option A is tempting, but the answer is B": "B", "no idea": None, "": None, "Answer: E": None}
    for raw, want in cases.items():
        assert parse_letter(raw) == want, raw


def test_maxflip_selects_most_flipping_argument_with_seeded_ties():
    counts = pd.DataFrame([
        {"item_id": "q1", "target_option": "A", "source_model": "m1", "n_flipped": 1, "n_challenged": 3},
        {"item_id": "q1", "target_option": "C", "source_model": "m2", "n_flipped": 3, "n_challenged": 3},
        {"item_id": "q2", "target_option": "A", "source_model": "m1", "n_flipped": 2, "n_challenged": 3},
        {"item_id": "q2", "target_option": "D", "source_model": "m2", "n_flipped": 2, "n_challenged": 3},
        {"item_id": "q2", "target_option": "C", "source_model": "m3", "n_flipped": 0, "n_challenged": 3},
    ])
    picks = {seed: {e["item_id"]: e for e in MF.select_maxflip(counts, seed)} for seed in range(30)}
    assert all(p["q1"]["producer"] == "m2" and p["q1"]["target_option"] == "C" for p in picks.values())
    q2 = {(p["q2"]["producer"], p["q2"]["target_option"]) for p in picks.values()}
    assert q2 == {("m1", "A"), ("m2", "D")}  # both tied candidates occur, never the 0-flip one
    assert MF.select_maxflip(counts, 7) == MF.select_maxflip(counts, 7)
    assert picks[0]["q2"]["n_tied"] == 2
    assert MF.producer_shares([{"producer": "a"}, {"producer": "a"}, {"producer": "b"}, {"producer": "c"}]) == {
        "a": 0.5, "b": 0.25, "c": 0.25}


def test_flip_counts_from_records():
    rs = [challenge("q1", "t1", "cross", 10, "A", True, source="s"), challenge("q1", "t2", "cross", 10, "A", False, source="s"),
          challenge("q1", "s", "blind", 10, "A", True, source="s"), challenge("q1", "t1", "cross", 10, "C", True, source="u")]
    fc = MF.flip_counts(M.records_frame(rs), 10).set_index(["target_option", "source_model"])
    assert fc.loc[("A", "s"), "n_flipped"] == 2 and fc.loc[("A", "s"), "n_challenged"] == 3
    assert fc.loc[("C", "u"), "n_flipped"] == 1


def test_mmlu_sample_loader_and_uniform_sampling():
    items = load_mmlu()  # shipped sample: 2 per subject
    assert len(SUBJECTS) == 57 and len(items) == 114
    assert {subject_category(s) for s in SUBJECTS} == {"STEM", "humanities", "social sciences", "other"}
    assert subject_category("college_physics") == "STEM" and subject_category("jurisprudence") == "humanities"
    assert subject_category("sociology") == "social sciences" and subject_category("virology") == "other"
    s1 = sample_uniform(items, 1, seed=3)
    assert len(s1) == 57 and len({i.subject for i in s1}) == 57
    assert [i.id for i in s1] == [i.id for i in sample_uniform(items, 1, seed=3)]
    assert len(load_mmlu("dev")) == 114
    it = items[0]
    assert it.answer in it.letters and it.answer not in it.wrong_letters and len(it.wrong_letters) == 3


def test_mmlu_bad_answer_letter_names_file_and_line(tmp_path):
    p = tmp_path / "anatomy_test.csv"
    p.write_text("question,choice0,choice1,choice2,choice3,answer\nQ1,a,b,c,d,2\nQ2,a,b,c,d,7\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"anatomy_test.csv:3: bad answer '7'"):
        read_mmlu_csv(p)
    p.write_text("Q1,a,b,c,d,C\n", encoding="utf-8")  # raw hendrycks layout: no header, letter
    assert read_mmlu_csv(p)[0].answer == "C"
    p.write_text("Q1,a\n", encoding="utf-8")
    with pytest.raises(DataError, match="anatomy_test.csv:1"):
        read_mmlu_csv(p)


def test_report_tables_agree_with_their_marks_and_rank_each_subject_once():
    from flipguard.eval.afr.report import table2, table5

    def subject(name: str, questions: int, flips: int) -> list[Record]:
        """`questions` questions of `name`, each answered right first and challenged once (blind, k=1);
        the first `flips` of them flipped."""
        out = []
        for i in range(questions):
            q = f"{name}-{i}"
            out += [rec("baseline", q, "m", choice="B", subject=name),
                    rec("challenge", q, "m", choice="A" if i < flips else "B", condition="blind", k=1,
                        target_option="A", source_model="m", subject=name)]
        return out

    # anatomy 4 of 5 flipped, virology 1 of 5, law 3 of 5, astronomy one question (too few to rank)
    frame = M.records_frame(subject("anatomy", 5, 4) + subject("virology", 5, 1) + subject("law", 5, 3)
                            + subject("astronomy", 1, 1))
    show, raw = table5(frame, n_boot=50, seed=0)
    assert list(show["Most vulnerable"]) == ["anatomy"] and list(show["Most robust"]) == ["virology"]
    assert show["AFR (vul.)"][0].startswith("80.0 ±") and show["AFR (rob.)"][0].startswith("20.0 ±")
    by_subject = raw.set_index("subject")
    assert not by_subject.loc["astronomy", "meaningful"] and np.isnan(by_subject.loc["astronomy", "afr"])
    assert sorted(raw["subject"]) == ["anatomy", "astronomy", "law", "virology"]  # each once
    # one measured subject ranks nothing: never the most vulnerable and the most robust at once
    show, _ = table5(M.records_frame(subject("anatomy", 5, 4)), n_boot=50, seed=0)
    assert show.empty

    # first answers mostly unparsed: Acc. is n/m, and the invalid column counts them
    rs = [rec("baseline", f"q{i}", "m", choice=None if i < 4 else "B", valid=i >= 4) for i in range(6)]
    show, raw = table2(M.records_frame(rs), [1], n_boot=50, seed=0)
    assert show.loc[0, "Acc."] == "n/m (2 of 6 valid)" and show.loc[0, "invalid (first / challenges)"] == "4 / 0"
    assert (raw.loc[0, "invalid_first"], raw.loc[0, "invalid"], raw.loc[0, "meaningful"]) == (4, 0, False)
