"""A model that cannot do the task gets a report that says so in words (median label mass,
most common first tokens, the dominant label's share, what to try) and DDS shown as not
meaningful, in the run's report and in compare; a model that does the task gets none of it."""

from __future__ import annotations

import json

from test_report import make_records, make_run

from flipguard.eval.records import CASES, EXPECTED_CHOICE, Record
from flipguard.pipeline.cli import main as cli_main


def yes_sayer_records(dataset: str, n: int, mass: float = 0.02) -> list[Record]:
    """logprob judgments of a model that puts `mass` on the labels and prefers "1" under it."""
    out = []
    for i in range(n):
        for case in CASES:
            p1, p2 = mass * 0.8, mass * 0.2
            out.append(Record(key=f"m/{dataset}/{i}/{case}", protocol="dds", item_id=f"{dataset}-{i}", dataset=dataset,
                              case=case, expected=EXPECTED_CHOICE[case], model="m", backend="hf", mode="logprob",
                              choice=None, valid=mass >= 0.5, raw_output="1", p1=p1, p2=p2,
                              extra={"min_label_mass": 0.5}))
    return out


def test_a_model_that_does_not_answer_with_a_label_is_reported_in_words(tmp_path, capsys):
    computed = {"m": {"backend": "hf", "dtype": "float32", "first_tokens": {"<<": 30, "The": 10}}}
    run = make_run(tmp_path / "run", yes_sayer_records("bbq", 10), mode="logprob", computed=computed)
    assert cli_main(["report", str(run), "--n_boot", "50"]) == 0
    md = (run / "report" / "summary.md").read_text()
    assert "This model does not do the task as asked" in md
    assert "40 of 40 judgments are invalid (100%)" in md
    assert 'it answers "1" in 100% of 40 judgments' in md
    assert 'median label mass P("1")+P("2") 0.020' in md
    assert "its most common first tokens: '<<' (30), 'The' (10)" in md
    assert "--mode generate" in md and "--template ft-released" in md and "fine-tuning" in md
    rows = [line for line in md.splitlines() if line.startswith("| bbq |")]
    assert rows and "| not meaningful (0 of 40 valid) |" in rows[0] and "+0.0" not in rows[0] and "0.0" not in rows[0]
    printed = capsys.readouterr().out
    assert "This model does not do the task as asked" in printed and "n/m" in printed
    cap = json.loads((run / "report" / "summary.json").read_text())["meta"]["capability"]
    assert cap["meaningful"] is False and cap["dominant_choice"] == "1" and cap["dominant_share"] == 1.0


def test_valid_judgments_that_are_all_one_label_are_flagged_too(tmp_path):
    # every judgment valid (generate mode) but always "1": C1 and C2 agree by construction
    recs = make_records("bbq", 10, (10, 0, 10, 0))
    run = make_run(tmp_path / "run", recs)
    assert cli_main(["report", str(run), "--n_boot", "50"]) == 0
    md = (run / "report" / "summary.md").read_text()
    assert 'it answers "1" in 100% of 40 judgments' in md and "judgments are invalid" not in md


def test_a_model_that_does_the_task_gets_no_verdict(tmp_path):
    run = make_run(tmp_path / "run", make_records("bbq", 20, (12, 16, 15, 13)))
    assert cli_main(["report", str(run), "--n_boot", "50"]) == 0
    md = (run / "report" / "summary.md").read_text()
    assert "does not do the task" not in md and "not meaningful" not in md
    assert json.loads((run / "report" / "summary.json").read_text())["meta"]["capability"]["meaningful"] is True


def test_compare_says_which_condition_is_not_meaningful(tmp_path):
    good = make_run(tmp_path / "good", make_records("bbq", 20, (12, 16, 15, 13)), mode="logprob")
    bad = make_run(tmp_path / "bad", yes_sayer_records("bbq", 20), mode="logprob")
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"base={good},tuned={bad}", "--out", str(out), "--n_boot", "50"]) == 0
    md = next(out.rglob("*.md")).read_text()
    assert "**tuned**: This model does not do the task as asked" in md and "**base**:" not in md
    overview = [line for line in md.splitlines() if line.startswith("| tuned |")][0]
    assert "n/m" in overview
