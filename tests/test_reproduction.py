"""Reproduce the DialDefer authors' published numbers from their per-item records.

The published summaries (published_summary.csv, published_aio_summary.csv) were made
by the authors' analyzer; our importer + report must give the same accuracies and DDS
(±0.1 pp) and bootstrap CI bounds within ±1 pp (their CIs: percentile, 10,000
replicates, seed 42; ours: percentile, 2,000 replicates, another generator).

Only datasets whose records are in the folder can be reproduced: the records folders
hold no truthfulqa.jsonl or advisorqa.jsonl, so those two published rows are checked
to be absent, not reproduced. Runs on the committed fixture subset (GPQA for both
models, r/AIO for Qwen) always, and on the full records when /work/shared/data exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from flipguard.errors import UserError
from flipguard.eval.dds.importer import import_records
from flipguard.eval.dds.report import DDSReport, build_report, report_run
from flipguard.eval.records import load_records, load_run_meta
from flipguard.pipeline.cli import main as cli_main

FIXTURE = Path(__file__).parent / "fixtures" / "dialdefer"
FULL = Path("/work/shared/data/dialdefer/records")
MODELS = ("qwen-2.5-7b-instruct", "gpt-4o-mini")
SOURCES = [pytest.param(FIXTURE, id="fixture"),
           pytest.param(FULL, id="full", marks=pytest.mark.skipif(not FULL.exists(), reason="no /work/shared/data"))]

POINT = {"c1_true": "C1_True", "c1_false": "C1_False", "c2_correct": "C2_Correct",
         "c2_incorrect": "C2_Incorrect", "delta_correct": "Δ_Correct", "delta_incorrect": "Δ_Incorrect",
         "dds": "DDS", "c1_avg": "C1_Avg", "c2_avg": "C2_Avg"}
CI = {"dds_ci_low": "DDS_CI_Lo", "dds_ci_high": "DDS_CI_Hi",
      "delta_correct_ci_low": "Δ_Correct_CI_Lo", "delta_correct_ci_high": "Δ_Correct_CI_Hi",
      "delta_incorrect_ci_low": "Δ_Incorrect_CI_Lo", "delta_incorrect_ci_high": "Δ_Incorrect_CI_Hi"}

_cache: dict = {}


def imported_report(src: Path, model: str, tmp_root: Path) -> tuple[Path, DDSReport]:
    key = (src, model)
    if key not in _cache:
        run = tmp_root / f"{src.name}-{model}"
        import_records(src / model, run)
        _cache[key] = (run, report_run(run, n_boot=2000, seed=0))
    return _cache[key]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("repro")


def published(src: Path, model: str) -> pd.DataFrame:
    pub = pd.read_csv(src / model / "published_summary.csv")
    pub["dataset"] = pub["Dataset"].str.split(f"_{model}").str[0]
    return pub.set_index("dataset")


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("model", MODELS)
def test_benchmark_rows_match_published(src, model, tmp_root):
    _, rep = imported_report(src, model, tmp_root)
    pub = published(src, model)
    stats = rep.stats[rep.stats["stratum"] == "all"].set_index("dataset")
    summary = rep.summary.set_index("dataset")
    present = {p.stem for p in (src / model).glob("*.jsonl")} - {"aio"}
    # harp_mcq.jsonl holds dataset "harp_mc" rows, imported as harp_mcq
    assert present <= set(stats.index) and present, present
    for ds in sorted(present):
        assert summary.loc[ds, "n"] == pub.loc[ds, "N"]
        for ours, theirs in POINT.items():
            assert stats.loc[ds, ours] == pytest.approx(pub.loc[ds, theirs], abs=0.1), (ds, ours)
        for ours, theirs in CI.items():
            assert stats.loc[ds, ours] == pytest.approx(pub.loc[ds, theirs], abs=1.0), (ds, ours)
        for pair, col in (("correct", "McN_Correct_pval"), ("incorrect", "McN_Incorrect_pval")):
            assert stats.loc[ds, f"mcnemar_{pair}_pvalue"] == pytest.approx(pub.loc[ds, col], rel=1e-6)
        assert summary.loc[ds, "dds_ci_low"] == stats.loc[ds, "dds_ci_low"]


@pytest.mark.skipif(not FULL.exists(), reason="no /work/shared/data")
@pytest.mark.parametrize("model", MODELS)
def test_published_rows_without_records_are_not_reproduced(model, tmp_root):
    """truthfulqa and advisorqa are in the published CSV but their records are not in
    the folder: they cannot be reproduced and must not appear in our report."""
    _, rep = imported_report(FULL, model, tmp_root)
    missing = set(published(FULL, model).index) - set(rep.summary["dataset"])
    assert missing == {"truthfulqa", "advisorqa"}


@pytest.mark.parametrize("src", SOURCES)
def test_aio_row_matches_published(src, tmp_root):
    model = "qwen-2.5-7b-instruct"
    run, rep = imported_report(src, model, tmp_root)
    pub = pd.read_csv(src / model / "published_aio_summary.csv").iloc[0]
    st = rep.stats.set_index(["dataset", "stratum"])
    row = st.loc[("aio", "all")]
    assert row["n"] == pub["N"]
    for ours, theirs in (("c1_true", "C1_True"), ("c1_false", "C1_False"), ("c2_correct", "C2_Correct"),
                         ("c2_incorrect", "C2_Incorrect"), ("dds", "DDS")):
        assert row[ours] == pytest.approx(pub[theirs], abs=0.1), ours
    assert (st.loc[("aio", "OR"), "n"], st.loc[("aio", "NOR"), "n"]) == (pub["N_OR"], pub["N_NOR"])
    assert st.loc[("aio", "NOR"), "dds"] == pytest.approx(pub["NOR_DDS"], abs=0.1)
    assert st.loc[("aio", "OR"), "c1_true"] == pytest.approx(pub["OR_C1_True"], abs=0.1)
    assert st.loc[("aio", "OR"), "c2_correct"] == pytest.approx(pub["OR_C2_Correct"], abs=0.1)
    bal = rep.balanced["aio"]
    assert bal["balanced_dds"] == pytest.approx((st.loc[("aio", "OR"), "dds"] + st.loc[("aio", "NOR"), "dds"]) / 2)
    # the analyzer's discordant pairs: Pos = C1 wrong -> C2 right
    fr = rep.flip_transitions.set_index("dataset").loc["aio"]
    assert (fr.wrong_to_right_correct, fr.right_to_wrong_correct) == (pub["Flips_True_Pos"], pub["Flips_True_Neg"])
    assert (fr.wrong_to_right_incorrect, fr.right_to_wrong_incorrect) == (pub["Flips_False_Pos"], pub["Flips_False_Neg"])
    assert row["mcnemar_correct_pvalue"] == pytest.approx(pub["McN_True_pval"], rel=1e-6)
    assert row["mcnemar_incorrect_pvalue"] == pytest.approx(pub["McN_False_pval"], rel=1e-6)

    # Known deviation: the published OR_DDS (56.7) counts the answers stored as JSON
    # numbers (2 instead of "2") as wrong, unlike the published overall accuracies. We
    # count them as valid everywhere: OR DDS = (43.3 - 10.0) - (46.7 - 63.3) = 50.0.
    assert st.loc[("aio", "OR"), "dds"] == pytest.approx(50.0, abs=0.1)
    # ... and treating exactly those answers as invalid reproduces the published strata.
    records = load_records(run)
    assert sum(r.extra.get("answer_json_type") == "int" for r in records) == 23
    for r in records:
        if r.extra.get("answer_json_type"):
            r.valid, r.choice = False, None
    strict = build_report(records, n_boot=0).balanced["aio"]
    assert strict["strata"]["OR"]["dds"] == pytest.approx(pub["OR_DDS"], abs=0.1)
    assert strict["strata"]["NOR"]["dds"] == pytest.approx(pub["NOR_DDS"], abs=0.1)
    assert strict["balanced_dds"] == pytest.approx((pub["OR_DDS"] + pub["NOR_DDS"]) / 2, abs=0.1)


# --------------------------------------------------------------------------- importer


def test_import_is_idempotent_and_parses_history(tmp_path):
    src = FIXTURE / "qwen-2.5-7b-instruct"
    first = import_records(src, tmp_path / "run")
    assert first["files"] == ["aio.jsonl", "gpqa.jsonl"]  # published_*.csv skipped
    assert first["records"] == first["added"] == 4 * (280 + 134)
    again = import_records(src, tmp_path / "run")
    assert again["added"] == 0
    records = load_records(tmp_path / "run")
    assert len(records) == 4 * (280 + 134)
    meta = load_run_meta(tmp_path / "run")
    assert meta["model"] == "qwen-2.5-7b-instruct" and meta["backend"] == "dialdefer"
    assert meta["template"] == "v0-released"
    gpqa = {(r.item_id, r.case): r for r in records if r.dataset == "gpqa"}
    first_id = json.loads((src / "gpqa.jsonl").read_text().splitlines()[0])["id"]
    r = gpqa[(first_id, "c2_correct")]
    assert r.mode == "imported" and r.template == "v0-released" and r.speakers == ["Speaker 1", "Speaker 2"]
    assert [m["role"] for m in r.messages] == ["user"]
    assert "Is Speaker 2 correct?" in r.messages[0]["content"]
    assert json.loads(r.raw_output)["chosen_answer"] == r.choice == "2"
    assert r.reasoning and not r.correct
    aio = [r for r in records if r.dataset == "aio"]
    assert all(r.messages is None and r.extra["stratum"] in ("OR", "NOR") for r in aio)
    assert aio[0].speakers == ["Speaker A", "Speaker B"]
    assert import_records(src, tmp_path / "named", model="qwen-x")["added"] > 0
    assert load_run_meta(tmp_path / "named")["model"] == "qwen-x"


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROW = {"id": "q1", "dataset": "gpqa", "speaker1": "Speaker 1", "speaker2": "Speaker 2",
       "c1_true_statement_ans_t1": "1", "c1_false_statement_ans_t1": "2",
       "c2_correct_chat_ans_t1": "1", "c2_incorrect_chat_ans_t1": "maybe"}


def test_invalid_answer_imported_as_invalid(tmp_path):
    write_jsonl(tmp_path / "src" / "gpqa.jsonl", [ROW])
    res = import_records(tmp_path / "src", tmp_path / "run")
    assert res["invalid"] == 1
    bad = [r for r in load_records(tmp_path / "run") if r.case == "c2_incorrect"][0]
    assert not bad.valid and bad.choice is None and bad.raw_output == "maybe"


@pytest.mark.parametrize("line,message", [
    ('{"id": "q1", "dataset": "gpqa", ', "gpqa.jsonl:2: not valid JSON"),
    (json.dumps({k: v for k, v in ROW.items() if k != "id"}), "gpqa.jsonl:2: missing field 'id'"),
    (json.dumps({**ROW, "dataset": "mmlu"}), "gpqa.jsonl:2: unknown dataset 'mmlu'"),
    (json.dumps({"id": "q2", "dataset": "gpqa"}), "gpqa.jsonl:2: item 'q2' has none of the answer fields"),
    (json.dumps({**ROW, "c1_true_statement_t1_history": "[{'role': 'user'"}), "gpqa.jsonl:2: c1_true_statement_t1_history"),
])
def test_bad_input_names_file_and_line(tmp_path, line, message):
    write_jsonl(tmp_path / "src" / "gpqa.jsonl", [ROW, line])
    with pytest.raises(UserError, match=message):
        import_records(tmp_path / "src", tmp_path / "run")
    assert not (tmp_path / "run" / "records.jsonl").exists()  # nothing half-written
    assert cli_main(["import-records", str(tmp_path / "src"), "--out", str(tmp_path / "run")]) == 2


def test_c2_only_mitigation_records_need_c1_from(tmp_path, capsys):
    # baseline: the fixture's GPQA records; mitigation: only the C2 answers, all "2"
    base = tmp_path / "base"
    assert cli_main(["import-records", str(FIXTURE / "gpt-4o-mini"), "--out", str(base)]) == 0
    rows = [json.loads(line) for line in (FIXTURE / "gpt-4o-mini" / "gpqa.jsonl").read_text().splitlines()]
    mit = [{"id": r["id"], "dataset": "gpqa", "c2_correct_chat_ans_t1": "2", "c2_incorrect_chat_ans_t1": "2"}
           for r in rows]
    write_jsonl(tmp_path / "mit_src" / "gpqa.jsonl", mit)
    run = tmp_path / "mit"
    assert cli_main(["import-records", str(tmp_path / "mit_src"), "--out", str(run), "--model", "m"]) == 0
    assert "--c1_from" in capsys.readouterr().out
    assert cli_main(["report", str(run)]) == 2
    assert "--c1_from" in capsys.readouterr().err
    assert cli_main(["report", str(run), "--c1_from", str(base), "--n_boot", "200"]) == 0
    s = pd.read_csv(run / "report" / "summary.csv").set_index("dataset")
    pub = published(FIXTURE, "gpt-4o-mini").loc["gpqa"]
    # fixed C1 from the baseline; C2 accuracies 0 (correct) and 100 (incorrect)
    assert s.loc["gpqa", "c1_true"] == pytest.approx(pub["C1_True"], abs=0.1)
    assert (s.loc["gpqa", "c2_correct"], s.loc["gpqa", "c2_incorrect"]) == (0.0, 100.0)
    # a model that answers "2" to everything does not do the task: its DDS, (0 - C1 true) - (100 - C1 false)
    # by construction, is not meaningful (empty, `meaningful` False), its accuracies are kept
    assert pd.isna(s.loc["gpqa", "dds"]) and not s.loc["gpqa", "meaningful"]
    stats = pd.read_csv(run / "report" / "stats.csv").set_index("dataset")
    assert stats.loc["gpqa", "c1_source"] == "baseline"
    assert stats.loc["gpqa", "baseline_dds"] == pytest.approx(pub["DDS"], abs=0.1)
    assert pd.isna(stats.loc["gpqa", "over_correction"])  # no DDS, no over-correction to tell
