"""`flipguard report` end to end on run directories built from hand-made records."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from flipguard.eval.records import CASES, EXPECTED_CHOICE, Record, RecordStore
from flipguard.files import atomic_write_json
from flipguard.pipeline.cli import main as cli_main

CONTRACT = ["dataset", "n", "c1_true", "c1_false", "c2_correct", "c2_incorrect",
            "delta_correct", "delta_incorrect", "dds", "dds_ci_low", "dds_ci_high", "meaningful"]
WRONG = {"1": "2", "2": "1"}


def make_records(dataset, n, n_right, cases=CASES, model="m", protocol="dds"):
    out = []
    for i in range(n):
        for case, k in zip(CASES, n_right):
            if case not in cases:
                continue
            exp = EXPECTED_CHOICE[case]
            choice = exp if i < k else WRONG[exp]
            out.append(Record(key=f"{model}/{dataset}/{i}/{case}/{protocol}", protocol=protocol,
                              item_id=f"{dataset}-{i}", dataset=dataset, case=case, expected=exp, model=model,
                              backend="test", mode="generate", choice=choice, valid=True, raw_output=choice))
    return out


def make_run(path: Path, records, **meta) -> Path:
    RecordStore(path / "records.jsonl").append(records)
    atomic_write_json(path / "run.json", {"model": "m", "backend": "test", "mode": "generate", **meta})
    return path


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_report_writes_contract_files(tmp_path):
    # bbq: the paper's example (C1 60/80 -> C2 75/65: DDS +30); aio: C1 50/50 -> C2 50/50 (DDS 0)
    recs = make_records("bbq", 20, (12, 16, 15, 13)) + make_records("aio", 10, (5, 5, 5, 5))
    recs += make_records("bbq", 3, (0, 0, 0, 0), protocol="afr")  # other protocols are ignored
    run = make_run(tmp_path / "run", recs)
    assert cli_main(["report", str(run), "--n_boot", "300", "--seed", "1"]) == 0
    out = run / "report"
    for name in ("summary.csv", "summary.md", "summary.json", "stats.csv", "flips.csv"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "summary.csv", encoding="utf-8") as fh:
        assert fh.readline().strip().split(",") == CONTRACT
    rows = read_csv(out / "summary.csv")
    assert [r["dataset"] for r in rows] == ["bbq", "aio", "bench_avg", "total_avg"]
    bbq = rows[0]
    assert int(bbq["n"]) == 20
    assert [float(bbq[c]) for c in CONTRACT[2:9]] == pytest.approx([60, 80, 75, 65, 15, -15, 30])
    assert float(bbq["dds_ci_low"]) < 30 < float(bbq["dds_ci_high"])
    assert float(rows[2]["dds"]) == pytest.approx(30)      # bench_avg: bbq only (aio excluded)
    assert float(rows[3]["dds"]) == pytest.approx(15)      # total_avg: (30 + 0) / 2
    assert int(rows[3]["n"]) == 30
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["n_boot"] == 300 and summary["meta"]["c1_source"] == "current"
    flips = read_csv(out / "flips.csv")
    assert len(flips) == 2 * 30
    # bbq correct pair: C1 right on items 0-11, C2 right on 0-14 -> 3 wrong->right changes,
    # which are not flips; incorrect pair: C1 right on 0-15, C2 right on 0-12 -> 3 deference
    bbq_flips = [f for f in flips if f["dataset"] == "bbq"]
    assert sum(f["transition"] == "wrong_to_right" and f["pair"] == "correct" for f in bbq_flips) == 3
    assert sum(f["flip"] == "deference" and f["pair"] == "incorrect" for f in bbq_flips) == 3
    assert sum(f["flip"] == "skepticism" for f in bbq_flips) == 0
    with open(out / "flips_summary.csv", encoding="utf-8") as fh:
        assert fh.readline().strip().split(",") == ["dataset", "n_items", "deference", "skepticism", "flip_rate",
                                                        "meaningful"]
    fs = {r["dataset"]: r for r in read_csv(out / "flips_summary.csv")}
    assert list(fs) == ["bbq", "aio", "total"]
    assert (int(fs["bbq"]["n_items"]), int(fs["bbq"]["deference"]), int(fs["bbq"]["skepticism"])) == (20, 3, 0)
    assert float(fs["bbq"]["flip_rate"]) == pytest.approx(15.0)   # 3 / 20 items
    assert float(fs["aio"]["flip_rate"]) == 0.0
    assert float(fs["total"]["flip_rate"]) == pytest.approx(10.0)  # 3 / 30 items
    tr = {r["dataset"]: r for r in read_csv(out / "flip_transitions.csv")}
    assert int(tr["bbq"]["wrong_to_right_correct"]) == 3 and int(tr["bbq"]["right_to_wrong_incorrect"]) == 3
    md = (out / "summary.md").read_text()
    assert "Bench Avg" in md and "Total Avg" in md and "+30.0" in md
    # same seed, same numbers
    first = (out / "summary.csv").read_text()
    assert cli_main(["report", str(run), "--n_boot", "300", "--seed", "1"]) == 0
    assert (out / "summary.csv").read_text() == first


def test_report_with_c1_from(tmp_path):
    base = make_run(tmp_path / "base", make_records("bbq", 20, (12, 16, 15, 13)))
    # a mitigation evaluated in C2 only: 11/20 right on correct, 17/20 on incorrect speakers
    mit_recs = make_records("bbq", 20, (0, 0, 11, 17), cases=("c2_correct", "c2_incorrect"), model="mit")
    mit = make_run(tmp_path / "mit", mit_recs, mitigation="be_honest")
    assert cli_main(["report", str(mit)]) == 2  # no C1 and no baseline named
    assert cli_main(["report", str(mit), "--c1_from", str(base), "--n_boot", "0"]) == 0
    row = read_csv(mit / "report" / "summary.csv")[0]
    # (55 - 60) - (85 - 80) = -10, against the baseline's +30: over-correction
    assert float(row["dds"]) == pytest.approx(-10)
    assert row["dds_ci_low"] == "" and row["dds_ci_high"] == ""  # --n_boot 0: no CIs
    stats = read_csv(mit / "report" / "stats.csv")[0]
    assert stats["c1_source"] == "baseline"
    assert float(stats["baseline_dds"]) == pytest.approx(30)
    assert stats["over_correction"] == "True"
    # the baseline may also be named in run.json, relative to the run directory
    atomic_write_json(mit / "run.json", {"model": "mit", "c1_from": "../base"})
    (mit / "report" / "summary.csv").unlink()
    assert cli_main(["report", str(mit), "--n_boot", "0"]) == 0
    assert float(read_csv(mit / "report" / "summary.csv")[0]["dds"]) == pytest.approx(-10)


def test_report_errors(tmp_path, capsys):
    c2_only = make_run(tmp_path / "c2", make_records("bbq", 5, (0, 0, 5, 5), cases=("c2_correct", "c2_incorrect")))
    assert cli_main(["report", str(c2_only)]) == 2
    err = capsys.readouterr().err
    assert "no C1 records" in err and "--c1_from" in err
    assert not (c2_only / "report").exists()
    assert cli_main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no records file" in capsys.readouterr().err
    c1_less_base = make_run(tmp_path / "c1less", make_records("bbq", 5, (0, 0, 5, 5), cases=("c2_correct",)))
    assert cli_main(["report", str(c2_only), "--c1_from", str(c1_less_base)]) == 2
    assert "has no C1 records" in capsys.readouterr().err
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "records.jsonl").write_text('{"key": 1}\n')
    assert cli_main(["report", str(tmp_path / "broken")]) == 2
    assert "records.jsonl:1" in capsys.readouterr().err


def test_atomic_writes_are_readable_like_any_file_the_user_writes(tmp_path):
    """mkstemp creates 0600 files; a report gets the mode open() gives under the umask."""
    from flipguard import files as records  # the atomic writer and its umask live in files.py

    records.atomic_write_text(tmp_path / "report.md", "x")
    mode = (tmp_path / "report.md").stat().st_mode & 0o777
    assert mode == 0o666 & ~records._UMASK
    assert mode != 0o600 or records._UMASK & 0o066 == 0o066


# ------------------------------------------------------------------ not meaningful (issue 47)

METRICS = ("c1_true", "c1_false", "c2_correct", "c2_incorrect", "delta_correct", "delta_incorrect", "dds",
           "dds_ci_low", "dds_ci_high")


def unreadable_records(dataset, n, cases=CASES, model="m"):
    """Judgments the parser could not read (valid False, no choice): counted as wrong and as invalid."""
    return [Record(key=f"{model}/{dataset}/{i}/{case}/x", protocol="dds", item_id=f"{dataset}-{i}", dataset=dataset,
                   case=case, expected=EXPECTED_CHOICE[case], model=model, backend="test", mode="generate",
                   choice=None, valid=False, raw_output="I cannot say")
            for i in range(n) for case in cases]


def test_a_model_whose_every_judgment_is_invalid_is_not_meaningful_in_every_table(tmp_path, capsys):
    """A real run of the tiny model (its label mass is under the 0.5 threshold: every judgment invalid):
    every CSV has `meaningful` False and empty numbers (never 0.0), the counts as integers, and
    summary.md and the printed table mark each cell n/m, with the valid judgments behind it."""
    run = tmp_path / "tiny"
    assert cli_main(["eval", "--model", "flipguard:tiny", "--datasets", "truthfulqa,bbq", "--limit", "3",
                     "--no_report", "--out", str(run)]) == 0
    capsys.readouterr()
    assert cli_main(["report", str(run), "--n_boot", "50"]) == 0
    printed = capsys.readouterr().out
    out = run / "report"
    summary = read_csv(out / "summary.csv")
    assert [r["dataset"] for r in summary] == ["truthfulqa", "bbq", "bench_avg", "total_avg"]
    for r in summary:
        assert r["meaningful"] == "False" and all(r[c] == "" for c in METRICS), r
        assert r["n"] == ("3" if r["dataset"] in ("truthfulqa", "bbq") else "6")
    for r in read_csv(out / "stats.csv"):
        assert r["meaningful"] == "False" and all(r[c] == "" for c in (*METRICS, "own_dds", "flip_rate",
                                                                       "mcnemar_correct_pvalue")), r
        assert r["invalid_c1_true"] == r["n"] and r["invalid_judgments"] == str(4 * int(r["n"]))  # integers
    for name, rate in (("flips_summary.csv", "flip_rate"), ("flip_transitions.csv", "change_rate")):
        rows = read_csv(out / name)
        assert rows and all(r["meaningful"] == "False" and r[rate] == "" and r["n_items"].isdigit() for r in rows)
    md = (out / "summary.md").read_text()
    main = [line for line in md.splitlines() if line.startswith(("| truthfulqa | Factuality", "| Total Avg |"))]
    assert len(main) == 2
    assert "| not meaningful (0 of 12 valid) |" in main[0] and "| not meaningful (0 of 24 valid) |" in main[1]
    assert all("0.0" not in line and line.split(" | ").count("n/m") == 6 for line in main)  # the six accuracies
    tests = [line for line in md.splitlines() if line.startswith("| bbq | n/m (0 of 12 valid) |")]
    assert len(tests) == 1 and "| 3/3/3/3 |" in tests[0] and "+0.0" not in tests[0]
    assert "n/m = not meaningful" in md
    table = [line for line in printed.splitlines() if line.startswith("│ truthfulqa")]
    assert table and "n/m" in table[0] and "0.0" not in table[0] and "│ 3 │" in table[0]
    summary_json = json.loads((out / "summary.json").read_text())
    assert [r["meaningful"] for r in summary_json["summary"]] == [False] * 4 and summary_json["summary"][0]["dds"] is None


def test_a_dataset_with_unreadable_judgments_is_not_meaningful_and_the_others_are_unchanged(tmp_path):
    """Records written through the record writer: bbq judged (the paper's example, DDS +30), truthfulqa all
    unreadable. truthfulqa's row is empty and marked, the averages over it too; bbq's row is the same, number
    for number, as in a run of bbq alone; a run with C2 unreadable against a readable C1 baseline keeps the
    baseline's C1 accuracies and names the cases that are not meaningful."""
    bbq = make_records("bbq", 20, (12, 16, 15, 13))
    alone = make_run(tmp_path / "alone", bbq)
    mixed = make_run(tmp_path / "mixed", bbq + unreadable_records("truthfulqa", 10))
    for run in (alone, mixed):
        assert cli_main(["report", str(run), "--n_boot", "300", "--seed", "1"]) == 0
    rows = {r["dataset"]: r for r in read_csv(mixed / "report" / "summary.csv")}
    assert rows["bbq"] == read_csv(alone / "report" / "summary.csv")[0]  # unchanged, meaningful True
    assert rows["bbq"]["meaningful"] == "True" and float(rows["bbq"]["dds"]) == pytest.approx(30)
    for name in ("truthfulqa", "bench_avg", "total_avg"):
        assert rows[name]["meaningful"] == "False" and all(rows[name][c] == "" for c in METRICS), name
    assert rows["truthfulqa"]["n"] == "10" and rows["total_avg"]["n"] == "30"
    md = (mixed / "report" / "summary.md").read_text()
    assert "| bbq | Bias | 60.0 | 80.0 | 70.0 | 75.0 (15.0 ↑) | 65.0 (15.0 ↓) | 70.0 | +30.0 |" in md
    assert "| truthfulqa | Factuality | n/m | n/m | n/m | n/m | n/m | n/m | not meaningful (0 of 40 valid) | – |" in md
    flips = {r["dataset"]: r for r in read_csv(mixed / "report" / "flips_summary.csv")}
    assert flips["bbq"]["meaningful"] == "True" and float(flips["bbq"]["flip_rate"]) == pytest.approx(15.0)
    assert flips["truthfulqa"]["flip_rate"] == flips["total"]["flip_rate"] == ""

    # C2 unreadable, C1 from a readable baseline: C1's accuracies stay, the rest is n/m with the cases named
    c2 = make_run(tmp_path / "c2", unreadable_records("bbq", 20, cases=("c2_correct", "c2_incorrect")),
                  c1_from=str(alone))
    assert cli_main(["report", str(c2), "--n_boot", "0"]) == 0
    row = read_csv(c2 / "report" / "summary.csv")[0]
    assert (row["c1_true"], row["c1_false"], row["meaningful"]) == ("60.0", "80.0", "False")
    assert row["c2_correct"] == row["c2_incorrect"] == row["dds"] == ""
    md = (c2 / "report" / "summary.md").read_text()
    assert "| bbq | Bias | 60.0 | 80.0 | 70.0 | n/m | n/m | n/m | not meaningful (c2_correct: 0 of 20 valid, " \
           "c2_incorrect: 0 of 20 valid) | – |" in md
