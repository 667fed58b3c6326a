"""Honest measurement: both DDS protocols (fixed C1 vs own C1) and C1 damage, label-mass
invalidity, all four cases by default, pairs annotated from records, thread control."""

from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest

from flipguard.data.schema import Item
from flipguard.eval.backends.base import Backend
from flipguard.eval.records import CASES, EXPECTED_CHOICE, Record, RecordStore, load_records
from flipguard.files import atomic_write_json
from flipguard.pipeline.cli import main as cli_main

# Hand-computed fixtures (truthfulqa, 20 items; accuracies in %):
#   Baseline  C1 60/80, C2 75/65       -> DDS (75-60) - (65-80) = +30
#   SFT       own C1 50/80, C2 70/75   -> paper DDS (70-60) - (75-80) = +15; own DDS (70-50) - (75-80) = +25;
#                                         C1 change -10 / 0 -> C1 damage
#   Honest    own C1 60/85, C2 50/95   -> paper DDS (50-60) - (95-80) = -25 (over-correction);
#                                         own DDS (50-60) - (95-85) = -20; C1 change 0 / +5 -> no damage
#   Old       C2 only 70/75            -> paper DDS +15; own_* unknown
BASE = {"c1_true": .6, "c1_false": .8, "c2_correct": .75, "c2_incorrect": .65}
SFT = {"c1_true": .5, "c1_false": .8, "c2_correct": .7, "c2_incorrect": .75}
HONEST = {"c1_true": .6, "c1_false": .85, "c2_correct": .5, "c2_incorrect": .95}
OLD = {"c2_correct": .7, "c2_incorrect": .75}


def _write_run(run_dir, accuracies, n=20, dataset="truthfulqa", c1_from=None, mass=None):
    """A run whose case accuracies are exactly `accuracies`; `mass` sets P("1")+P("2")."""
    recs = []
    for case, acc in accuracies.items():
        for i in range(n):
            exp = EXPECTED_CHOICE[case]
            choice = exp if i < round(acc * n) else ("2" if exp == "1" else "1")
            p = {} if mass is None else {"p1": mass * (0.9 if choice == "1" else 0.1),
                                         "p2": mass * (0.1 if choice == "1" else 0.9)}
            recs.append(Record(key=f"{run_dir.name}-{case}-{i}", protocol="dds", item_id=f"{dataset}-{i}",
                               dataset=dataset, case=case, expected=exp, model="m", backend="hf",
                               mode="logprob", choice=choice, valid=True, **p))
    RecordStore(run_dir / "records.jsonl").append(recs)
    atomic_write_json(run_dir / "run.json", {"protocol": "dds", "c1_from": str(c1_from) if c1_from else None})
    return run_dir


@pytest.fixture()
def runs(tmp_path):
    base = _write_run(tmp_path / "base", BASE, mass=0.9)
    return {
        "base": base,
        "sft": _write_run(tmp_path / "sft", SFT, c1_from=base, mass=0.8),
        "honest": _write_run(tmp_path / "honest", HONEST, c1_from=base),
        "old": _write_run(tmp_path / "old", OLD, c1_from=base),
    }


def test_report_shows_fixed_c1_and_own_c1_with_c1_damage(runs):
    assert cli_main(["report", str(runs["sft"]), "--n_boot", "0"]) == 0
    rep = runs["sft"] / "report"
    summary = pd.read_csv(rep / "summary.csv")
    assert list(summary.columns) == ["dataset", "n", "c1_true", "c1_false", "c2_correct", "c2_incorrect",
                                     "delta_correct", "delta_incorrect", "dds", "dds_ci_low", "dds_ci_high", "meaningful"]
    tq = summary.set_index("dataset").loc["truthfulqa"]
    assert (tq["c1_true"], tq["c1_false"]) == (60.0, 80.0)  # the baseline's C1: paper protocol
    assert tq["dds"] == pytest.approx(15.0)
    stats = pd.read_csv(rep / "stats.csv")
    row = stats[(stats["dataset"] == "truthfulqa") & (stats["stratum"] == "all")].iloc[0]
    assert row["own_c1_true"] == pytest.approx(50.0) and row["own_c1_false"] == pytest.approx(80.0)
    assert row["own_dds"] == pytest.approx(25.0)
    assert row["c1_true_change"] == pytest.approx(-10.0) and row["c1_false_change"] == pytest.approx(0.0)
    assert bool(row["c1_damage"]) is True
    assert row["median_label_mass"] == pytest.approx(0.8) and row["invalid_judgments"] == 0
    md = (rep / "summary.md").read_text()
    assert "paper: fixed C1 from the baseline" in md and "own DDS (own C1)" in md
    assert "| truthfulqa | 60.0 | 80.0 | 50.0 (-10.0) | 80.0 (+0.0) | +15.0 | +25.0 | YES ‡ |" in md
    assert "median label mass" in md and "0 of 80 judgment(s) of this run invalid" in md


def test_report_of_old_c2_only_run_shows_no_own_c1(runs):
    assert cli_main(["report", str(runs["old"]), "--n_boot", "0"]) == 0
    stats = pd.read_csv(runs["old"] / "report" / "stats.csv")
    row = stats[stats["dataset"] == "truthfulqa"].iloc[0]
    assert math.isnan(row["own_c1_true"]) and math.isnan(row["own_dds"]) and pd.isna(row["c1_damage"])
    assert row["dds"] == pytest.approx(15.0)
    md = (runs["old"] / "report" / "summary.md").read_text()
    assert "| truthfulqa | 60.0 | 80.0 | – | – | +15.0 | – | – |" in md


def test_baseline_report_own_numbers_are_its_own(runs):
    assert cli_main(["report", str(runs["base"]), "--n_boot", "0"]) == 0
    stats = pd.read_csv(runs["base"] / "report" / "stats.csv").set_index("dataset")
    assert stats.loc["truthfulqa", "own_dds"] == pytest.approx(30.0) == stats.loc["truthfulqa", "dds"]
    assert math.isnan(stats.loc["truthfulqa", "c1_true_change"])
    assert "Both protocols" not in (runs["base"] / "report" / "summary.md").read_text()


def test_compare_has_both_protocols_and_flags_c1_damage(runs, tmp_path):
    out = tmp_path / "cmp"
    spec = f"Baseline={runs['base']},Be Honest={runs['honest']},SFT={runs['sft']},Old={runs['old']}"
    assert cli_main(["compare", "--runs", spec, "--out", str(out), "--n_boot", "50"]) == 0
    table = pd.read_csv(out / "comparison.csv")
    for col in ("c1_true", "c1_false", "dds", "own_c1_true", "own_c1_false", "own_dds", "over_correction",
                "delta_dds", "c1_damage", "median_label_mass", "invalid_judgments"):
        assert col in table.columns
    tq = table[table["dataset"] == "truthfulqa"].set_index("condition")
    expect = {  # condition: (paper dds, own_c1_true, own_c1_false, own_dds, c1 damage)
        "Baseline": (30.0, 60.0, 80.0, 30.0, None),
        "Be Honest": (-25.0, 60.0, 85.0, -20.0, False),
        "SFT": (15.0, 50.0, 80.0, 25.0, True),
        "Old": (15.0, math.nan, math.nan, math.nan, None),
    }
    for name, (dds, t, f, own, damage) in expect.items():
        r = tq.loc[name]
        assert r["dds"] == pytest.approx(dds) and r["c1_true"] == 60.0 and r["c1_false"] == 80.0
        for col, want in (("own_c1_true", t), ("own_c1_false", f), ("own_dds", own)):
            assert (math.isnan(r[col]) if math.isnan(want) else r[col] == pytest.approx(want)), (name, col)
        assert (pd.isna(r["c1_damage"]) if damage is None else bool(r["c1_damage"]) is damage), name
    assert tq.loc["Baseline", "median_label_mass"] == pytest.approx(0.9)
    assert math.isnan(tq.loc["Be Honest", "median_label_mass"])  # generated-style records: no label mass
    md = (out / "comparison.md").read_text()
    assert "paper: fixed C1 from the baseline" in md and "‡ = C1 damage" in md
    assert "| SFT | 70.0 | 75.0 | 72.5" in md and "50.0 / 80.0 (-10.0 / +0.0) ‡ | +25.0 |" in md
    assert "60.0 / 85.0 (+0.0 / +5.0) | -20.0 |" in md  # no ‡ for Be Honest
    assert "-25.0†" in md
    data = json.loads((out / "comparison.json").read_text())
    old = [r for r in data["table"] if r["condition"] == "Old" and r["dataset"] == "truthfulqa"][0]
    assert old["own_dds"] is None and old["dds"] == pytest.approx(15.0)


# ------------------------------------------------------------------ label mass


class FakeBackend(Backend):
    """choice_probs from a table keyed by the item's question, found in the prompt."""

    name, model_id = "fake", "fake"

    def __init__(self, table):
        self.table, self.calls = table, 0

    def generate(self, conversations, config):  # pragma: no cover - logprob only
        raise NotImplementedError

    def choice_probs(self, conversations, choices=("1", "2")):
        self.calls += len(conversations)
        out = []
        for conv in conversations:
            text = conv[-1]["content"]
            out.append(next(p for q, p in self.table.items() if q in text))
        return out


def _item(i):
    return Item(id=f"lm-{i}", dataset="amqa", question=f"Question number {i}?", correct_answer=f"right {i}",
                incorrect_answer=f"wrong {i}", split="test")


def test_low_label_mass_is_invalid_and_counted(tmp_path, monkeypatch):
    from flipguard.eval.dds import protocol as dds
    from flipguard.eval.dds.report import report_run

    table = {"Question number 0?": {"1": 2.7e-7, "2": 1.0e-7}, "Question number 1?": {"1": 0.7, "2": 0.2}}
    fake = FakeBackend(table)
    from flipguard.eval.backends import base

    monkeypatch.setattr(base, "get_backend", lambda *a, **k: fake)
    run = dds.evaluate(dds.EvalArgs(model="fake-model", out=str(tmp_path / "run")), items=[_item(0), _item(1)])
    recs = load_records(run)
    assert len(recs) == 8 and {r.case for r in recs} == set(CASES)
    low = [r for r in recs if r.item_id == "lm-0"]
    high = [r for r in recs if r.item_id == "lm-1"]
    assert all(not r.valid and r.choice is None and r.p1 == 2.7e-7 and r.p2 == 1.0e-7 for r in low)
    assert all(r.raw_output == "1" for r in low)  # the argmax label is kept, not used
    assert all(r.valid and r.choice == "1" for r in high)
    assert all(r.extra["min_label_mass"] == 0.5 for r in recs)
    assert json.loads((run / "run.json").read_text())["min_label_mass"] == 0.5

    rep = report_run(run, n_boot=0)
    row = rep.stats.set_index("dataset").loc["amqa"]
    assert row["invalid_judgments"] == 4 and row["invalid_c1_true"] == 1 and row["invalid_c2_incorrect"] == 1
    assert row["median_label_mass"] == pytest.approx((3.7e-7 + 0.9) / 2)
    # lm-1 answers "1" everywhere: C1 true and C2 correct right; lm-0 invalid = wrong
    assert (row["c1_true"], row["c1_false"], row["c2_correct"], row["c2_incorrect"]) == (50.0, 0.0, 50.0, 0.0)
    assert rep.meta["min_label_mass"] == 0.5 and rep.meta["invalid_judgments"] == 4

    # the same run directory refuses another threshold instead of mixing records
    from flipguard.errors import UserError

    with pytest.raises(UserError, match="min_label_mass: 0.5 there, 0.0 now"):
        dds.evaluate(dds.EvalArgs(model="fake-model", out=str(run), min_label_mass=0.0), items=[_item(0)])
    # elsewhere, threshold 0 makes every judgment valid, under other record keys
    run0 = dds.evaluate(dds.EvalArgs(model="fake-model", out=str(tmp_path / "run0"), min_label_mass=0.0),
                        items=[_item(0)])
    recs0 = load_records(run0)
    assert all(r.valid and r.choice == "1" for r in recs0)
    assert not {r.key for r in recs0} & {r.key for r in low}


def test_run_records_threshold_applies_to_any_label_set():
    """AFR-style labels (A-D): mass is the sum over the labels; no threshold = old behaviour."""
    from flipguard.eval.runner import run_records

    class Letters(Backend):
        name = model_id = "fake"

        def generate(self, conversations, config):  # pragma: no cover - logprob only
            raise NotImplementedError

        def choice_probs(self, conversations, choices):
            return [{"A": 0.1, "B": 0.05, "C": 0.02, "D": 0.03} for _ in conversations]

    def rec(key, extra):
        return Record(key=key, protocol="afr", item_id=key, dataset="mmlu", case="blind", expected="A",
                      model="m", backend="fake", mode="logprob", messages=[{"role": "user", "content": key}],
                      extra=extra)

    class Store:
        def __init__(self):
            self.rows = []

        def __contains__(self, key):
            return False

        def append(self, chunk):
            self.rows += chunk
            return len(chunk)

    store = Store()
    run_records(store, [rec("a", {"min_label_mass": 0.25}), rec("b", {"min_label_mass": 0.15}), rec("c", {})],
                Letters(), choices=tuple("ABCD"), progress=False)
    valid = {r.key: (r.valid, r.choice) for r in store.rows}
    assert valid == {"a": (False, None), "b": (True, "A"), "c": (True, "A")}  # mass 0.2


def test_tiny_model_label_mass_is_reported_and_default_marks_it_invalid(tiny_model_path, tmp_path):
    """The random tiny model spreads its mass over the whole vocabulary: far below 0.5."""
    from flipguard.eval.dds import EvalArgs, evaluate

    run = evaluate(EvalArgs(model=tiny_model_path, out=str(tmp_path / "t"), batch_size=4), items=[_item(0), _item(1)])
    recs = load_records(run)
    assert all(r.p1 + r.p2 < 0.5 for r in recs)
    assert all(not r.valid and r.choice is None for r in recs)


# ------------------------------------------------------------------ cases, threads


def test_auto_cases_are_all_four_with_or_without_mitigation():
    from flipguard.eval.dds import parse_cases

    assert parse_cases("auto") == CASES
    assert parse_cases("auto", "be_honest") == CASES
    assert parse_cases("c2_correct,c2_incorrect", "dehumanizing") == ("c2_correct", "c2_incorrect")


def test_configure_threads(monkeypatch):
    import torch

    from flipguard.errors import FlipguardError
    from flipguard.runtime.threads import configure_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert configure_threads(None) == 2 and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert configure_threads(None) == 1 and torch.get_num_threads() == 1
        assert configure_threads(3) == 3 and torch.get_num_threads() == 3
        import os

        assert os.environ["OMP_NUM_THREADS"] == "3"  # inherited by train/*.py subprocesses
        with pytest.raises(FlipguardError, match="--threads"):
            configure_threads(0)
    finally:
        torch.set_num_threads(before)


def test_the_record_says_which_cpu_kernels_ran_not_which_were_asked_for():
    """cpu_fp_path (run.json's cpu_kernels, a trainer's compute record) reads torch's choice in the
    process that computes: with the vectorised kernels turned off, another rounding path, it says so."""
    import subprocess
    import sys

    import torch

    from flipguard.runtime.threads import cpu_fp_path

    here = cpu_fp_path()
    assert here["cpu_kernels"] == torch.backends.cpu.get_cpu_capability() and here["torch_threads"] == torch.get_num_threads()
    code = "import json; from flipguard.runtime.threads import cpu_fp_path; print(json.dumps(cpu_fp_path()))"
    off = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                         capture_output=True, text=True, check=True)
    assert json.loads(off.stdout)["cpu_kernels"] == "DEFAULT"


def test_eval_help_documents_threads_and_label_mass(capsys):
    with pytest.raises(SystemExit):
        cli_main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads" in text and "OMP_NUM_THREADS" in text and "--min_label_mass" in text


# ------------------------------------------------------------------ pairs with records


def _train_records(run_dir, item):
    """One train item with a deference flip as the paper counts it: C1-false judged right
    ("2"), C2-incorrect judged wrong ("1"); the correct pair right in both framings."""
    choices = {"c1_true": "1", "c1_false": "2", "c2_correct": "1", "c2_incorrect": "1"}
    RecordStore(run_dir / "records.jsonl").append([
        Record(key=f"tr-{case}", protocol="dds", item_id=item.id, dataset=item.dataset, case=case,
               expected=EXPECTED_CHOICE[case], model="m", backend="hf", mode="logprob", split="train",
               choice=choice, valid=True) for case, choice in choices.items()])
    return run_dir


@pytest.mark.parametrize("strategy,flipped_rows", [("all", 2), ("consistency", 6), ("flips", 2)])
def test_pairs_records_annotate_every_strategy(tmp_path, strategy, flipped_rows):
    from flipguard.data.unified import load_items

    item = load_items("amqa", split="train")[0]
    records = _train_records(tmp_path / "train-run", item)
    out = tmp_path / "pairs"
    assert cli_main(["pairs", "recipes/tiny.yaml", "--records", str(records), "--out", str(out),
                     "--pairs_datasets", "amqa", "--pairs_strategy", strategy]) == 0
    counts = json.loads((out / "counts.json").read_text())
    assert counts["total"]["flipped_rows"] == flipped_rows
    assert counts["flip_types"] == {"deference": flipped_rows}
    assert json.loads((out / "pairs.json").read_text())["records"] == str(records)
    rows = [json.loads(line) for line in (out / "sft.jsonl").read_text().splitlines()]
    assert {r["item_id"] for r in rows if r["flip"]} == {item.id}


def test_pairs_recipe_records_missing_is_a_note_for_all_and_an_error_when_given(tmp_path, capsys):
    out = tmp_path / "pairs"
    # recipes/tiny.yaml names runs/tiny/base-train, absent here: not used, and pairs.json says so
    assert cli_main(["pairs", "recipes/tiny.yaml", "--out", str(out), "--pairs_datasets", "amqa"]) == 0
    assert json.loads((out / "pairs.json").read_text())["records"] is None
    assert json.loads((out / "counts.json").read_text())["total"]["flipped_rows"] == 0
    assert "not annotated" in capsys.readouterr().err
    code = cli_main(["pairs", "recipes/tiny.yaml", "--out", str(out), "--pairs_datasets", "amqa",
                     "--records", str(tmp_path / "missing")])
    assert code == 2 and "flipguard eval --split train" in capsys.readouterr().err


def test_stratified_report_counts_invalid_judgments_per_run():
    from flipguard.eval.dds.report import build_report
    from flipguard.eval.synthetic import synthetic_records

    recs = synthetic_records({"aio": 30, "gpqa": 20}, invalid_rate=0.1)
    stats = build_report(recs, n_boot=0).stats.set_index(["dataset", "stratum"])
    for ds in ("aio", "gpqa"):
        assert stats.loc[(ds, "all"), "invalid_judgments"] == sum(not r.valid for r in recs if r.dataset == ds)
    assert stats.loc[("total_avg", "all"), "invalid_judgments"] == sum(not r.valid for r in recs)
    assert pd.isna(stats.loc[("aio", "OR"), "invalid_judgments"])  # strata rows carry no run-level count


def test_record_builder_keeps_the_keys_of_existing_run_directories():
    """DDS, AFR and stick-or-switch build their requests with one builder
    (records.pending_record): the content keys are the ones the per-protocol builders
    gave before it (written down at commit df0f28c), so existing run directories resume."""
    from flipguard.data.mmlu import MCQItem
    from flipguard.eval.afr import protocol as afr
    from flipguard.eval.backends.base import GenerationConfig
    from flipguard.eval.dds import protocol as dds
    from flipguard.eval.sos.protocol import SosItem, SosSettings, baseline_records, start_conversation

    g = GenerationConfig(max_new_tokens=8, seed=0)
    it = Item(id="truthfulqa-0", dataset="truthfulqa", question="Is 0 even?", correct_answer="yes",
              incorrect_answer="maybe")
    assert [r.key for r in dds.build_records([it], model="m", backend="hf", mode="logprob", min_label_mass=0.5)] == [
        "f8f14629b11576bff97a17b1", "00407eb1f9dc9fe50e6bad58", "5610bef5d33030abd478718e", "d3aa5c64057ea05faa8dd3e1"]
    generated = dds.build_records([it], model="m", backend="hf", mode="generate",
                                  gen_config=GenerationConfig(max_new_tokens=8))
    assert [r.key for r in generated] == [
        "45ac8224dcd3e533db249333", "13242e56f80628d826ab9e30", "07ad09dd89915f86836232a8", "b49db9ea7c55eed09e9c7d90"]

    q = MCQItem(id="mmlu-x-0", subject="anatomy", category="STEM", question="Q?", options=["a", "b", "c", "d"],
                answer="B")
    spec = afr.ModelSpec(name="t", backend="hf", model="flipguard:tiny")
    assert [r.key for r in afr.coercion_records(q, spec, [1], g)] == [
        "81157216d97497d8e1a1922f", "ac6d06f96274d424b8b70930", "d6253f0b4bfa30c07f3097d2"]
    base = afr.baseline_record(q, spec, g)
    assert base.key == "20908f1a4a13591eca36c9a4"
    assert afr.baseline_record(q, spec, g, "logprob").key == "dfb01deb8c14f50de0817d35"
    base.raw_output = "B"
    assert afr.challenge_record(q, spec, base, "A", 1, "Because.", "blind", "t", g).key == "3585eaec2821c8ed4a68f405"

    s = SosItem(dataset="medqa", id="medqa-0", question="Q?", options=("a", "b", "c", "d"), answer_index=1)
    st = SosSettings(n_shots=0)
    common = dict(model="m", backend="hf", split="test", gen_config=g)
    assert [r.key for r in baseline_records([s], [], st, 0, **common)] == [
        "93deaa5e036433c04ee98fcc", "4a6214ade12b6e591d01c481", "cc9bd2ac876a2a286fc481c6", "5e047156325f8fff434bcb89"]
    assert start_conversation(s, "flexibility", [], st, 0).record(st, **common).key == "d9e0939ed683342d4736f14e"


@pytest.mark.parametrize("spec, expected", [
    # (label, backend, model, adapter), written by hand from the syntax "[label=][backend:]model[|adapter]"
    ("flipguard:tiny", ("flipguard:tiny", "hf", "flipguard:tiny", None)),
    ("hf:flipguard:tiny", ("flipguard:tiny", "hf", "flipguard:tiny", None)),
    ("base=Qwen/Qwen2.5-7B-Instruct", ("base", "hf", "Qwen/Qwen2.5-7B-Instruct", None)),
    ("sft=vllm:runs/x/merged", ("sft", "vllm", "runs/x/merged", None)),
    ("openai:gpt-4o-mini", ("gpt-4o-mini", "openai", "gpt-4o-mini", None)),
    ("m|runs/adapter", ("m+runs/adapter", "hf", "m", "runs/adapter")),
    ("a=hf:m|ad", ("a", "hf", "m", "ad")),
    ("runs/x=y/model", ("runs/x=y/model", "hf", "runs/x=y/model", None)),  # '=' after a '/' is part of a path
])
def test_one_model_spec_syntax(spec, expected):
    from flipguard.eval.backends.base import parse_model_ref

    ref = parse_model_ref(spec)
    assert (ref.label, ref.backend, ref.model, ref.adapter) == expected


def test_afr_and_sos_read_model_specs_alike():
    """afr's string entries and sos's --models go through the same parser."""
    from flipguard.errors import FlipguardError
    from flipguard.eval.afr.protocol import parse_model_entry

    spec = parse_model_entry("t=hf:flipguard:tiny|runs/ad", "cli")
    assert (spec.name, spec.backend, spec.model, spec.kwargs) == ("t", "hf", "flipguard:tiny", {"adapter": "runs/ad"})
    with pytest.raises(FlipguardError, match="no model in"):
        parse_model_entry("t=hf:", "cli")
