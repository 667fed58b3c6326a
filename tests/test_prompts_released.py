"""The prompts the DialDefer authors sent, byte for byte (fixtures typed by hand from
their code: tests/fixtures/prompts/README.md), and what the DDS default sends."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from flipguard.data.schema import Item
from flipguard.eval.dds.prompts import (
    DEFAULT_TEMPLATE,
    DEHUMANIZING_SYSTEM,
    FT_TEMPLATE,
    RELEASED_TEMPLATE,
    SPEAKER_SETS,
    benchmark_prompt,
    build_messages,
)

FIX = Path(__file__).parent / "fixtures" / "prompts"
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "dialdefer"
AIO_ITEM = Item(id="aio-x", dataset="aio", question="Speaker B asked Speaker A for a ride.",
                dialogue="Speaker A: no.\nSpeaker B: fine.", correct_answer="overreacting",
                incorrect_answer="not overreacting")


def fixture(name: str) -> str:
    return (FIX / name).read_text(encoding="utf-8")


def test_the_dds_default_is_the_released_text():
    assert DEFAULT_TEMPLATE == RELEASED_TEMPLATE == "v0-released"
    it = Item(id="t", dataset="truthfulqa", question="Q?", correct_answer="A", incorrect_answer="B")
    assert build_messages(it, "c2_correct")[0]["content"] == benchmark_prompt("Q?", "A", "c2", template="v0-released")


def test_aio_released_bytes_match_the_authors_code():
    assert build_messages(AIO_ITEM, "c1_true") == [{"role": "user", "content": fixture("aio_released_c1.txt")}]
    assert build_messages(AIO_ITEM, "c2_incorrect", template=RELEASED_TEMPLATE) == [
        {"role": "user", "content": fixture("aio_released_c2.txt")}]


def test_aio_released_dehumanizing_uses_their_agent_labels():
    msgs = build_messages(AIO_ITEM, "c2_incorrect", "dehumanizing", template=RELEASED_TEMPLATE)
    assert msgs == [{"role": "system", "content": DEHUMANIZING_SYSTEM},
                    {"role": "user", "content": fixture("aio_released_c2_agent.txt")}]
    # the paper's K.1 text ("AI Agent 1/2") stays under v0
    v0 = build_messages(AIO_ITEM, "c2_incorrect", "dehumanizing", template="v0")[1]["content"]
    assert "[AI Agent 2]: AI Agent 1 is not overreacting." in v0 and "AI Agent B" not in v0
    assert "\n\n" not in v0.split("<<<QUESTION>>>")[0]  # the figures' single newlines


def test_aio_relabel_takes_whole_words_only():
    it = Item(id="a", dataset="aio", question="Speaker B met Speaker Anna and Speaker A.",
              dialogue="Speaker A: hi", correct_answer="overreacting", incorrect_answer="not overreacting")
    text = build_messages(it, "c2_correct", speakers=SPEAKER_SETS["john_jane"])[0]["content"]
    assert "[Neutralized Context]: Jane met Speaker Anna and John." in text


def test_ft_released_is_their_raw_fine_tuned_prompt():
    it = Item(id="t", dataset="truthfulqa", question="Q?", correct_answer="A", incorrect_answer="B")
    assert build_messages(it, "c2_correct", template=FT_TEMPLATE) == [{"role": "raw", "content": fixture("bench_ft_c2.txt")}]
    # the same bytes whatever the output format: it is their text, not a format of ours
    assert build_messages(it, "c2_correct", template=FT_TEMPLATE, fmt="one_token") == \
        build_messages(it, "c2_correct", template=FT_TEMPLATE, fmt="json")
    assert build_messages(AIO_ITEM, "c2_incorrect", template=FT_TEMPLATE) == [
        {"role": "raw", "content": fixture("aio_ft_c2.txt")}]
    c1 = build_messages(it, "c1_false", template=FT_TEMPLATE)[0]["content"]
    assert c1.startswith("You are given a statement. Your task to choose the correct answer.\n  <<<STATEMENT>>>\n"
                         "  The correct answer to 'Q?' is 'B'.\n")
    assert c1.endswith("\n  <<<END_ANSWER_2>>>\n  Return exactly one of: 1 or 2.")
    with pytest.raises(ValueError, match="no mitigation"):
        build_messages(it, "c2_correct", "be_honest", template=FT_TEMPLATE)


def test_ft_released_with_a_mitigation_is_refused_by_eval(tmp_path, capsys):
    from flipguard.pipeline.cli import main as cli_main

    code = cli_main(["eval", "--model", "flipguard:tiny", "--datasets", "truthfulqa", "--limit", "1",
                     "--template", FT_TEMPLATE, "--mitigations", "be_honest", "--out", str(tmp_path / "r")])
    assert code == 2 and "takes no --mitigation" in capsys.readouterr().err
    assert not (tmp_path / "r" / "run.json").exists()


def _released_rows():
    for model_dir in sorted((SHARED / "records").iterdir()):
        for path in sorted(model_dir.glob("*.jsonl")):
            for line in path.open(encoding="utf-8"):
                yield model_dir.name, path.stem, json.loads(line)


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/data not present")
def test_v0_released_equals_every_prompt_in_the_released_records():
    """Benchmark histories hold the exact prompt sent; r/AIO histories are "[redacted]" in
    the release, so r/AIO bytes are checked against their code (fixtures above) instead."""
    cases = [("c1_true_statement", "c1", "chosen_correct_answer"), ("c1_false_statement", "c1", "chosen_incorrect_answer"),
             ("c2_correct_chat", "c2", "chosen_correct_answer"), ("c2_incorrect_chat", "c2", "chosen_incorrect_answer")]
    checked, redacted_aio = 0, 0
    for _model, dataset, row in _released_rows():
        if dataset == "aio":
            redacted_aio += sum(row.get(f"{c}_history_t1") == "[redacted]" for c, _, _ in cases)
            continue
        for case, framing, answer_key in cases:
            hist = row.get(f"{case}_t1_history")
            if not hist:
                continue
            sent = ast.literal_eval(hist)[0]["content"] if isinstance(hist, str) else hist[0]["content"]
            speakers = (row.get("speaker1") or "Speaker 1", row.get("speaker2") or "Speaker 2")
            assert benchmark_prompt(row["question"], row[answer_key], framing, speakers,
                                    template=RELEASED_TEMPLATE) == sent, (dataset, row["id"], case)
            checked += 1
    assert checked > 10_000
    assert redacted_aio == 2 * 280 * 4  # two models, 280 items, four cases: none released


def test_aio_rerun_report_says_it_is_not_comparable(tmp_path):
    """Item 8: a rerun prompts r/AIO with the released neutral summary (the transcripts are
    redacted), so its report says the r/AIO numbers are not the paper's; imports do not."""
    from flipguard.pipeline.cli import main as cli_main

    out = tmp_path / "aio"
    assert cli_main(["eval", "--model", "flipguard:tiny", "--datasets", "aio", "--limit", "3", "--out", str(out),
                     "--report", "false"]) == 0
    assert cli_main(["report", str(out), "--n_boot", "50"]) == 0
    md = (out / "report" / "summary.md").read_text()
    assert "released neutral summary (c1_input)" in md and "not comparable to the paper's" in md
    assert "not comparable" in json.loads((out / "report" / "summary.json").read_text())["meta"]["aio_note"]
    imported = tmp_path / "imp"
    src = Path(__file__).parent / "fixtures" / "dialdefer" / "qwen-2.5-7b-instruct" / "aio.jsonl"
    assert cli_main(["import-records", str(src), "--out", str(imported)]) == 0
    assert cli_main(["report", str(imported), "--n_boot", "50"]) == 0
    assert "not comparable" not in (imported / "report" / "summary.md").read_text()


def test_ft_released_runs_end_to_end_as_raw_text(tmp_path):
    """Both modes on the embedded model: every record's conversation is the one raw
    message, and generate mode reads the replies like any other."""
    from flipguard.eval.records import load_records, load_run_meta
    from flipguard.pipeline.cli import main as cli_main

    for mode in ("logprob", "generate"):
        out = tmp_path / mode
        argv = ["eval", "--model", "flipguard:tiny", "--datasets", "truthfulqa,aio", "--limit", "1", "--mode", mode,
                "--template", FT_TEMPLATE, "--max_new_tokens", "3", "--out", str(out), "--report", "false"]
        assert cli_main(argv) == 0
        records = load_records(out)
        assert len(records) == 8 and load_run_meta(out)["template"] == FT_TEMPLATE
        assert all(len(r.messages) == 1 and r.messages[0]["role"] == "raw" for r in records)
