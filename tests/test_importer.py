"""import-records reads answers as the DialDefer authors' analyzer does (stored "1"/"2"
as is, blank answers recovered from the reply: code/common/utils.py), survives lone
surrogates, and the report counts recoveries and honours --allow_cross_mode_c1.
Expected values below are worked out by hand from the authors' rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flipguard.eval.dds import metrics as M
from flipguard.eval.dds.importer import import_records, recover_answer
from flipguard.eval.dds.report import CROSS_MODE_NOTE, build_report, report_run
from flipguard.eval.records import EXPECTED_CHOICE, Record, RecordStore, load_records, request_key
from flipguard.files import atomic_write_json
from flipguard.pipeline.cli import main as cli_main

FIXTURES = Path(__file__).parent / "fixtures" / "dialdefer"
REPLIES = FIXTURES / "replies" / "gpqa_dpo_c2only.jsonl"
FULL = Path("/work/shared/data/dialdefer/records")


@pytest.mark.parametrize("reply, expected", [
    ('{"chosen_answer": "2", "reasoning": "The speaker is wrong."}', ("2", "The speaker is wrong.")),
    ('{"reasoning": "fine", "chosen_answer": 1}', ("1", "fine")),
    ('```json\n{"chosen_answer": "1", "reasoning": "Matches the source."}\n```', ("1", "Matches the source.")),
    ("1\nThe claim holds because of X.", ("1", "The claim holds because of X.")),
    (" 2\n\nLet us check options 1 and 2.", ("2", "Let us check options 1 and 2.")),
    ("1\nreasoning that ends with the answer 2", ("1", "reasoning that ends with the answer")),
    ("2", ("2", None)),
    ("I would say the answer is 2 here.", ("2", None)),          # first standalone 1/2
    ("Options 12 and 21 are both odd; see 3.", (None, None)),    # no standalone 1 or 2
    ("I cannot decide.", (None, None)),
    ("", (None, None)),
    (None, (None, None)),
])
def test_recover_answer_follows_the_authors_rules(reply, expected):
    assert recover_answer(reply) == expected


def _by_case(records):
    return {(r.item_id, r.case): r for r in records}


def test_import_recovers_blank_answers_and_keeps_stored_ones(tmp_path):
    res = import_records(REPLIES, tmp_path / "dpo", model="qwen-dpo")
    assert (res["records"], res["recovered"], res["invalid"]) == (10, 6, 2)
    recs = _by_case(load_records(tmp_path / "dpo"))
    got = {k: (r.choice, r.valid, r.extra.get("recovered")) for k, r in recs.items()}
    assert got == {
        ("fx-1", "c2_correct"): ("1", True, True),      # " 1\n\n..." -> leading 1
        ("fx-1", "c2_incorrect"): ("2", True, True),
        ("fx-2", "c2_correct"): ("2", True, True),      # fenced ```json
        ("fx-2", "c2_incorrect"): ("1", True, True),    # null answer, JSON number in the reply
        ("fx-3", "c2_correct"): (None, False, False),   # nothing to recover: invalid
        ("fx-3", "c2_incorrect"): ("2", True, True),    # first standalone 2 (Python-repr chat)
        ("fx-4", "c2_correct"): ("1", True, None),      # stored "1" wins over a reply saying 2
        ("fx-4", "c2_incorrect"): ("2", True, None),    # stored JSON number 2
        ("fx-5", "c2_correct"): ("1", True, True),
        ("fx-5", "c2_incorrect"): (None, False, False),  # "12"/"21" are not answers
    }
    assert recs[("fx-4", "c2_incorrect")].extra["answer_json_type"] == "int"
    # recovered reasoning fills an empty reasoning field only
    assert recs[("fx-2", "c2_correct")].reasoning == "The speaker misreads the units."
    assert recs[("fx-1", "c2_correct")].reasoning == "The value follows from Wien's law; option 2 is off."
    # C2-only: scored against a C1 baseline, recoveries counted in the report
    base = tmp_path / "base"
    RecordStore(base / "records.jsonl").append([
        Record(key=f"b/{i}/{c}", protocol="dds", item_id=f"fx-{i}", dataset="gpqa", case=c,
               expected=EXPECTED_CHOICE[c], model="qwen", backend="dialdefer", mode="imported",
               choice=EXPECTED_CHOICE[c], valid=True)
        for i in range(1, 6) for c in ("c1_true", "c1_false")])
    rep = report_run(tmp_path / "dpo", c1_from=str(base), n_boot=0)
    row = rep.stats.set_index(["dataset", "stratum"]).loc[("gpqa", "all")]
    # C2-correct right on fx-1, fx-4, fx-5 (3/5); C2-incorrect right on fx-1, fx-3, fx-4 (3/5)
    assert (row.c2_correct, row.c2_incorrect, row.dds) == (pytest.approx(60), pytest.approx(60), pytest.approx(0))
    assert (row.recovered, row.invalid_c2_correct, row.invalid_c2_incorrect) == (6, 1, 1)
    # flips (paper): fx-2 is one of each; fx-3/fx-5's invalid C2 answers are not flips
    fs = rep.flips_summary.set_index("dataset").loc["gpqa"]
    assert (fs.n_items, fs.deference, fs.skepticism, fs.flip_rate) == (5, 1, 1, pytest.approx(40.0))


def test_lone_surrogates_import_without_loss(tmp_path):
    run = tmp_path / "run"
    import_records(REPLIES, run, model="m")
    raw = (run / "records.jsonl").read_bytes()
    raw.decode("utf-8")  # valid UTF-8 on disk
    recs = _by_case(load_records(run))
    assert recs[("fx-5", "c2_correct")].raw_output == "1\nThe claim holds \ud83d despite the noise 2"
    assert recs[("fx-5", "c2_correct")].reasoning == "The claim holds \ud83d despite the noise"
    assert recs[("fx-5", "c2_incorrect")].reasoning == "Option 12 \ud83d"
    # other records keep readable UTF-8 (only the lines with a lone surrogate are escaped)
    assert import_records(REPLIES, run, model="m")["added"] == 0      # re-import adds nothing
    # a record round-trips exactly through the store
    r = recs[("fx-5", "c2_incorrect")]
    store = RecordStore(tmp_path / "copy.jsonl")
    store.append([r])
    assert load_records(tmp_path / "copy.jsonl")[0] == r
    assert request_key(text="a\ud800b") != request_key(text="ab")
    atomic_write_json(tmp_path / "x.json", {"t": "\udfff"})
    assert json.loads((tmp_path / "x.json").read_text(encoding="utf-8"))["t"] == "\udfff"


def test_non_ascii_text_stays_readable(tmp_path):
    r = Record(key="k", protocol="dds", item_id="i", dataset="gpqa", case="c1_true", expected="1",
               model="m", backend="b", mode="imported", raw_output="Poincaré ✓")
    RecordStore(tmp_path / "r.jsonl").append([r])
    assert "Poincaré ✓" in (tmp_path / "r.jsonl").read_text(encoding="utf-8")


# --------------------------------------------------------------- cross-mode C1


def _run(path: Path, mode: str, cases, **meta) -> Path:
    recs = [Record(key=f"{path.name}/{i}/{c}", protocol="dds", item_id=f"q{i}", dataset="bbq", case=c,
                   expected=EXPECTED_CHOICE[c], model="m", backend="hf", mode=mode,
                   choice=EXPECTED_CHOICE[c] if i < 3 else ("2" if EXPECTED_CHOICE[c] == "1" else "1"),
                   valid=True)
            for i in range(4) for c in cases]
    RecordStore(path / "records.jsonl").append(recs)
    atomic_write_json(path / "run.json", {"model": "m", "mode": mode, **meta})
    return path


def test_cross_mode_c1_refused_by_default_and_allowed_with_the_flag(tmp_path):
    base = _run(tmp_path / "base", "generate", ("c1_true", "c1_false", "c2_correct", "c2_incorrect"))
    sft = _run(tmp_path / "sft", "logprob", ("c2_correct", "c2_incorrect"))
    with pytest.raises(M.MetricsError, match="same decision mode"):
        report_run(sft, c1_from=str(base), n_boot=0)
    rep = report_run(sft, c1_from=str(base), n_boot=0, allow_cross_mode_c1=True)
    assert rep.meta["c1_cross_mode"] is True and rep.meta["c1_mode_note"] == CROSS_MODE_NOTE
    # the CLI flag writes the marked report
    assert cli_main(["report", str(sft), "--c1_from", str(base), "--n_boot", "0",
                     "--allow_cross_mode_c1", "true"]) == 0
    assert CROSS_MODE_NOTE in (sft / "report" / "summary.md").read_text(encoding="utf-8")
    # a run whose run.json records the permission (flipguard eval --allow_cross_mode_c1) needs no flag
    atomic_write_json(sft / "run.json", {"model": "m", "mode": "logprob", "c1_from": str(base),
                                         "allow_cross_mode_c1": True})
    assert report_run(sft, n_boot=0).meta["c1_cross_mode"] is True
    # same mode, or an imported baseline: no note
    same = _run(tmp_path / "same", "generate", ("c2_correct", "c2_incorrect"))
    assert report_run(same, c1_from=str(base), n_boot=0).meta["c1_cross_mode"] is False
    imported = _run(tmp_path / "imp", "imported", ("c1_true", "c1_false"))
    assert report_run(sft, c1_from=str(imported), n_boot=0).meta["c1_cross_mode"] is False
    assert "c1_mode_note" not in report_run(same, c1_from=str(base), n_boot=0).meta


# --------------------------------------------------------------- released records


PAPER_TABLE_26 = {  # dataset: (deference, skepticism, flip rate %), paper Table 26
    "gpt-4o-mini": {"amqa": (0, 32, 13.3), "bbq": (39, 23, 20.7), "gpqa": (9, 8, 12.7),
                    "halueval_qa": (37, 23, 20.0), "harp_mcq": (6, 12, 6.0), "plausibleqa": (21, 11, 10.7),
                    "socialiqa": (26, 5, 10.3), "aio": (85, 14, 35.4)},
    "qwen-2.5-7b-instruct": {"amqa": (13, 9, 9.2), "bbq": (101, 29, 43.3), "gpqa": (27, 5, 23.9),
                             "halueval_qa": (49, 9, 19.3), "harp_mcq": (50, 11, 20.3),
                             "plausibleqa": (52, 7, 19.7), "socialiqa": (43, 3, 15.3), "aio": (117, 22, 49.6)},
}


def _check_table_26(src: Path, model: str, tmp_path: Path) -> None:
    run = tmp_path / model
    import_records(src / model, run)
    summary = build_report(load_records(run), n_boot=0).flips_summary.set_index("dataset")
    present = {p.stem for p in (src / model).glob("*.jsonl")}
    assert present
    for ds in present:
        d, s, rate = PAPER_TABLE_26[model][ds]
        row = summary.loc[ds]
        assert (row.deference, row.skepticism) == (d, s), ds
        assert round(row.flip_rate, 1) == rate, ds


@pytest.mark.parametrize("model", sorted(PAPER_TABLE_26))
def test_flips_match_table_26_on_fixture(model, tmp_path):
    _check_table_26(FIXTURES, model, tmp_path)


@pytest.mark.skipif(not FULL.exists(), reason="no /work/shared/data")
@pytest.mark.parametrize("model", sorted(PAPER_TABLE_26))
def test_flips_match_table_26_on_released_records(model, tmp_path):
    _check_table_26(FULL, model, tmp_path)
