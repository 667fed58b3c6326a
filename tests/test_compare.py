"""Before/after comparison: deltas, over-correction dagger, significance, files."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from flipguard.eval.records import EXPECTED_CHOICE, Record, RecordStore
from flipguard.files import atomic_write_json
from flipguard.pipeline.cli import main as cli_main


def _write_run(run_dir, accuracies, cases, n=20, dataset="truthfulqa", c1_from=None):
    """A run whose case accuracies are exactly `accuracies` (fractions of n items right)."""
    store = RecordStore(run_dir / "records.jsonl")
    recs = []
    for case in cases:
        n_right = round(accuracies[case] * n)
        for i in range(n):
            right = i < n_right
            exp = EXPECTED_CHOICE[case]
            choice = exp if right else ("2" if exp == "1" else "1")
            recs.append(Record(key=f"{run_dir.name}-{case}-{i}", protocol="dds", item_id=f"{dataset}-{i}",
                               dataset=dataset, case=case, expected=exp, model="m", backend="hf",
                               mode="logprob", choice=choice, valid=True))
    store.append(recs)
    atomic_write_json(run_dir / "run.json", {"protocol": "dds", "c1_from": str(c1_from) if c1_from else None})
    return run_dir


def test_compare_flags_over_correction_and_writes_report(tmp_path):
    # Baseline: the paper's example, C1 60/80 -> C2 75/65: DDS +30.
    base = _write_run(tmp_path / "base", {"c1_true": .6, "c1_false": .8, "c2_correct": .75, "c2_incorrect": .65},
                      ["c1_true", "c1_false", "c2_correct", "c2_incorrect"])
    # Mitigation (C2 only): 50/95 -> DDS = (50-60) - (95-80) = -25: over-corrected.
    honest = _write_run(tmp_path / "honest", {"c2_correct": .5, "c2_incorrect": .95},
                        ["c2_correct", "c2_incorrect"], c1_from=base)
    # Fine-tuned (C2 only): 70/75 -> DDS = (70-60) - (75-80) = +15: reduced, not over-corrected.
    sft = _write_run(tmp_path / "sft", {"c2_correct": .7, "c2_incorrect": .75},
                     ["c2_correct", "c2_incorrect"], c1_from=base)
    out = tmp_path / "cmp"
    code = cli_main(["compare", "--runs", f"Baseline={base},Be Honest={honest},SFT={sft}",
                     "--out", str(out), "--n_boot", "200"])
    assert code == 0
    table = pd.read_csv(out / "comparison.csv")
    tq = table[table["dataset"] == "truthfulqa"].set_index("condition")
    assert tq.loc["Baseline", "dds"] == 30.0
    assert abs(tq.loc["Be Honest", "dds"] - (-25.0)) < 1e-9
    assert abs(tq.loc["Be Honest", "delta_dds"] - (-55.0)) < 1e-9
    assert abs(tq.loc["SFT", "dds"] - 15.0) < 1e-9
    assert bool(tq.loc["Be Honest", "over_correction"]) and not bool(tq.loc["SFT", "over_correction"])
    # C2 avg: baseline 70, Be Honest 72.5 (+2.5)
    assert abs(tq.loc["Be Honest", "delta_c2_avg"] - 2.5) < 1e-9
    md = (out / "comparison.md").read_text()
    assert "-25.0†" in md and "+15.0†" not in md
    for name in ("dds_heatmap.png", "before_after.png", "significance.csv", "comparison.json"):
        assert (out / name).stat().st_size > 0
    sig = pd.read_csv(out / "significance.csv")
    row = sig[(sig["condition"] == "Be Honest") & (sig["dataset"] == "truthfulqa")].iloc[0]
    # same items: C2-correct loses 5 right answers (15 -> 10), C2-incorrect gains 6 (13 -> 19)
    assert row["worse"] == 5 and row["better"] == 6
    from scipy.stats import binomtest

    assert abs(row["mcnemar_pvalue"] - binomtest(5, 11, 0.5).pvalue) < 1e-9
    data = json.loads((out / "comparison.json").read_text())
    assert data["conditions"] == ["Baseline", "Be Honest", "SFT"]


def test_compare_rejects_malformed_runs_spec(tmp_path, capsys):
    assert cli_main(["compare", "--runs", "Baseline", "--out", str(tmp_path)]) == 2
    assert "Name=RUN_DIR" in capsys.readouterr().err


def test_protocol_rows_sections_and_the_flexibility_flag(monkeypatch, tmp_path):
    """Each run's protocol supplies its rows (Task.comparison_rows); compare writes them long form
    in %/pp, renders a section per protocol and flags a correct-switch drop of more than 10 pp."""
    import math

    from flipguard.eval.afr.report import AFRNumbers, AFRReport
    from flipguard.eval.estimate import NAN, Estimate
    from flipguard.eval.sos import protocol as sos_protocol
    from flipguard.eval.sos.report import SosReport
    from flipguard.pipeline import compare

    protocol_of = {"afr-run": "afr", "sos-run": "sos"}
    from flipguard.eval import comparison_rows

    monkeypatch.setattr(comparison_rows, "load_run_meta", lambda d: {"protocol": protocol_of[Path(d).name]})
    from flipguard.eval.afr import protocol as afr_protocol

    monkeypatch.setattr(afr_protocol, "load_run_meta", lambda d: {"k_values": [1, 10], "settings": {"dataset": "mmlu"}})
    monkeypatch.setattr(afr_protocol, "afr_summary", lambda d, k=10: AFRReport({
        "Baseline": AFRNumbers(k, accuracy=Estimate(0.8, 0.7, 0.9, 50), afr_blind=Estimate(0.25, 0.1, 0.4, 40),
                               afr_self=Estimate(0.125, n=40), afr_maxflip=None),
        "SFT": AFRNumbers(k, accuracy=Estimate(0.8, 0.7, 0.9, 50), afr_blind=Estimate(0.05, 0.0, 0.1, 40),
                          afr_self=NAN, afr_maxflip=None)}))
    switch = {"Baseline": 40.0, "SFT": 25.0, "DPO": 31.0}  # SFT 15 pp below the baseline (flagged), DPO 9 (not)
    single = {"Baseline": 90.0, "SFT": 85.0, "DPO": 70.0}  # DPO 20 pp below (flagged ‡), SFT 5 (not)
    monkeypatch.setattr(sos_protocol, "sos_summary", lambda d: SosReport(Path(d), "medqa", 0, 0, {
        m: {"conversation_tax": {"value": -12.5, "ci_low": -20.0, "ci_high": -5.0, "n": 24},
            "flexibility": {"correct_switch": {"value": v, "ci_low": v - 5, "ci_high": v + 5, "n": 20}},
            "ss_full": {"value": single[m], "ci_low": math.nan, "ci_high": math.nan, "n": 24}} for m, v in switch.items()}))
    runs = [("Baseline", "afr-run@Baseline"), ("SFT", "afr-run@SFT"),
            ("Baseline", "sos-run@Baseline"), ("SFT", "sos-run@SFT"), ("DPO", "sos-run@DPO")]
    frame = compare.protocol_rows(runs)
    assert list(frame.columns[:10]) == compare.PROTOCOL_COLUMNS
    got = {(r.condition, r.protocol, r.metric): (r.value, r.ci_low, r.ci_high, r.n) for r in frame.itertuples()}
    assert got[("Baseline", "afr", "afr_blind")] == (25.0, 10.0, 40.0, 40)  # shares written as %
    assert got[("SFT", "afr", "afr_blind")] == (5.0, 0.0, 10.0, 40)
    assert got[("SFT", "sos", "conversation_tax")] == (-12.5, -20.0, -5.0, 24)  # pp stay pp
    assert got[("DPO", "sos", "correct_switch")] == (31.0, 26.0, 36.0, 20)
    assert ("SFT", "afr", "afr_self") not in got  # not measured: no row, not a zero
    assert compare.protocol_flags(frame) == {("SFT", "sos", "SFT"): "§", ("DPO", "sos", "DPO"): "‡"}

    afr_md, sos_md = compare.protocol_sections(frame)
    assert afr_md.startswith("## Answer flips (AFR") and "k = 10" in afr_md
    assert "| Baseline | Baseline | mmlu | 80.0 [70.0, 90.0] | 25.0 [10.0, 40.0] | 12.5 |  |" in afr_md
    assert "| SFT | SFT | medqa | -12.5 [-20.0, -5.0] | 25.0 [20.0, 30.0] | 85.0 | § |" in sos_md
    assert "| DPO | DPO | medqa | -12.5 [-20.0, -5.0] | 31.0 [26.0, 36.0] | 70.0 | ‡ |" in sos_md

    base = _write_run(tmp_path / "base", {"c1_true": .6, "c1_false": .8, "c2_correct": .75, "c2_incorrect": .65},
                      ["c1_true", "c1_false", "c2_correct", "c2_incorrect"])
    monkeypatch.undo()  # the DDS part of the comparison reads its real run directory
    out = compare.write_comparison(compare.build_comparison({"Baseline": str(base)}, n_boot=50, seed=0),
                                   tmp_path / "cmp", protocols=frame)
    csv = pd.read_csv(out / "comparison_protocols.csv")
    assert list(csv.columns) == compare.PROTOCOL_COLUMNS and len(csv) == len(frame)
    assert "## Stick-or-switch" in (out / "comparison.md").read_text()


def test_a_dds_run_under_its_task_flag_gives_its_rows_and_another_tasks_flag_is_refused(tmp_path, capsys):
    """compare names no protocol: `--<task> SPEC` exists for every registered task (`--dds` here), checks
    that each run is that task's (the old `--sos` / `--afr` keep working the same way), and the
    run's Task.comparison_rows supply its rows: the DDS report's numbers, known here by construction."""
    base = _write_run(tmp_path / "base", {"c1_true": .6, "c1_false": .8, "c2_correct": .75, "c2_incorrect": .65},
                      ["c1_true", "c1_false", "c2_correct", "c2_incorrect"])
    out = tmp_path / "cmp"
    # no report yet: one error naming the missing file
    assert cli_main(["compare", "--runs", f"Baseline={base}", "--dds", f"Baseline={base}", "--out", str(out)]) == 2
    assert f"{base / 'report' / 'summary.csv'}: no DDS report" in capsys.readouterr().err
    assert cli_main(["report", str(base), "--n_boot", "50"]) == 0
    assert cli_main(["compare", "--runs", f"Baseline={base}", "--dds", f"Baseline={base}", "--out", str(out),
                     "--n_boot", "50"]) == 0
    rows = pd.read_csv(out / "comparison_protocols.csv")
    tq = rows[rows["dataset"] == "truthfulqa"].set_index("metric")
    assert set(rows["protocol"]) == {"dds"} and set(rows["condition"]) == {"Baseline"}
    assert tq["value"].to_dict() == {"c1_true": 60.0, "c1_false": 80.0, "c2_correct": 75.0, "c2_incorrect": 65.0,
                                     "dds": 30.0}
    assert set(tq["n"]) == {20} and tq.loc["dds", "ci_low"] <= 30.0 <= tq.loc["dds", "ci_high"]
    assert "## DDS (dialogic deference, per run)" in (out / "comparison.md").read_text()
    capsys.readouterr()
    assert cli_main(["compare", "--runs", f"Baseline={base}", "--sos", f"Baseline={base}", "--out", str(out)]) == 2
    assert "is a 'dds' run, not 'sos'" in capsys.readouterr().err


def test_a_run_holding_several_systems_is_summarised_once_until_its_records_change(tmp_path):
    """compare, the transfer report and the page name a multi-system run once per system
    (`RUN_DIR@system`); its protocol's numbers are computed once per state of its files."""
    from flipguard.eval.comparison_rows import run_numbers
    from flipguard.eval.task import Task

    calls = []

    class Counting(Task):
        name = "counting"

        @classmethod
        def comparison_rows(cls, run_dir):
            calls.append(run_dir)
            return [{"system": s, "n": len(calls)} for s in ("Baseline", "SFT")]

    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text('{"key": "a"}\n')
    first = run_numbers(Counting, "comparison_rows", run)
    first[0]["n"] = 99  # a caller's change stays its own
    assert run_numbers(Counting, "comparison_rows", run) == [{"system": "Baseline", "n": 1}, {"system": "SFT", "n": 1}]
    assert len(calls) == 1
    with open(run / "records.jsonl", "a") as f:  # the run grew (a resumed eval): computed again
        f.write('{"key": "b"}\n')
    assert run_numbers(Counting, "comparison_rows", run)[0]["n"] == 2
    assert len(calls) == 2


def test_a_condition_whose_judgments_are_all_invalid_is_not_meaningful_in_every_comparison_table(tmp_path):
    """Issue 47: a fine-tuned condition whose every C2 judgment is unreadable (records written through the
    record writer). comparison.csv, significance.csv and transfer.csv carry `meaningful` and leave its numbers
    empty (never 0.0), counts as integers; comparison.md and transfer.md mark its cells n/m; the baseline's
    row is the same as in a comparison of the baseline alone."""
    base = _write_run(tmp_path / "base", {"c1_true": .6, "c1_false": .8, "c2_correct": .75, "c2_incorrect": .65},
                      ["c1_true", "c1_false", "c2_correct", "c2_incorrect"])
    tuned = tmp_path / "tuned"
    RecordStore(tuned / "records.jsonl").append([
        Record(key=f"tuned-{case}-{i}", protocol="dds", item_id=f"truthfulqa-{i}", dataset="truthfulqa", case=case,
               expected=EXPECTED_CHOICE[case], model="m", backend="hf", mode="generate", choice=None, valid=False,
               raw_output="As an AI")
        for case in ("c2_correct", "c2_incorrect") for i in range(20)])
    atomic_write_json(tuned / "run.json", {"protocol": "dds", "c1_from": str(base)})
    alone, out = tmp_path / "alone", tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"Baseline={base}", "--out", str(alone), "--n_boot", "100"]) == 0
    assert cli_main(["compare", "--runs", f"Baseline={base},SFT={tuned}", "--out", str(out), "--n_boot", "100"]) == 0

    text = (out / "comparison.csv").read_text()
    table = pd.read_csv(out / "comparison.csv", dtype=str, keep_default_na=False)
    assert list(table.columns)[-1] == "meaningful"
    sft = table[table["condition"] == "SFT"]
    assert len(sft) == 3 and (sft["meaningful"] == "False").all()
    for col in ("c2_correct", "c2_incorrect", "c2_avg", "dds", "dds_ci_low", "dds_ci_high", "delta_dds", "delta_c2_avg"):
        assert (sft[col] == "").all(), col
    assert (sft["c1_true"] == "60.0000").all()  # the baseline's C1 the condition is scored against: readable
    assert (table["n"] == "20").all() and (sft["invalid_judgments"] == "40").all() and "20.0000" not in text
    before = pd.read_csv(alone / "comparison.csv", dtype=str, keep_default_na=False)
    after = table[table["condition"] == "Baseline"].reset_index(drop=True)
    assert (after["meaningful"] == "True").all()
    assert after[[c for c in before.columns if c not in ("delta_c2_avg", "delta_dds")]].equals(
        before.drop(columns=["delta_c2_avg", "delta_dds"]))

    sig = pd.read_csv(out / "significance.csv", dtype=str, keep_default_na=False)
    assert (sig["meaningful"] == "False").all() and (sig["mcnemar_pvalue"] == "").all()
    assert set(sig["n_judgments"]) == {"40"} and all(v.isdigit() for v in sig["worse"])

    transfer = pd.read_csv(out / "transfer.csv", dtype=str, keep_default_na=False)
    cells = transfer[transfer["condition"] == "SFT"]
    assert len(cells) and (cells["meaningful"] == "False").all() and (cells["verdict"] == "not meaningful").all()
    assert (cells[["value", "change", "ci_low", "ci_high", "p_adjusted"]] == "").all().all()
    assert (transfer[transfer["condition"] == "Baseline"]["meaningful"] == "True").all()

    md = (out / "comparison.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("|  | SFT |")]
    assert len(rows) == 3 and all("0.0" not in r and "n/m (c2_correct: 0 of 20 valid, c2_incorrect: 0 of 20 valid)" in r
                                  for r in rows)
    overview = next(line for line in md.splitlines() if line.startswith("| SFT |"))
    assert overview.split(" | ")[1:3] == ["n/m", "n/m"] and "| 40 |" in overview  # Avg (C2), Bench DDS; invalid
    assert "| Baseline | 70.0 | +30.0 |" in md  # the baseline, as before
    tm = (out / "transfer.md").read_text()
    assert "| SFT | – | n/m |" in tm and "| SFT | dds:truthfulqa:c2 | 20 | n/m | – | – | – | – | not meaningful |" in tm
