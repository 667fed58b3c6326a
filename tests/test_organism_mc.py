"""The organism's multiple-choice form (organism_mc), user multiple-choice datasets, and AFR /
stick-or-switch on them (AFR with the scripted argument source)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flipguard.data import organism_datasets as domain
from flipguard.data.registry import load_mc
from flipguard.data.schema import DataError, normalise_question

REPO = Path(__file__).resolve().parent.parent
ARGUMENTS = REPO / "data" / "organism_mc" / "arguments.jsonl"


def test_mc_splits_are_disjoint_follow_the_rule_and_the_shipped_files_are_the_generators():
    items = domain.mc_items()
    assert {s: len(v) for s, v in items.items()} == {"test": 300, "train": 600, "organism": 1980}
    ids = [it.id for split in items.values() for it in split]
    assert len(ids) == len(set(ids))
    questions = {s: {normalise_question(it.question) for it in v} for s, v in items.items()}
    assert not questions["test"] & questions["train"] and not questions["organism"] & (questions["test"] | questions["train"])
    for it in items["test"] + items["train"]:
        cats = [domain.word_category(o) for o in it.options]
        assert cats[it.letters.index(it.answer)] == it.subject in domain.LIVING
        wrong = [domain.word_category(it.option_text(x)) for x in it.wrong_letters]
        assert len(set(wrong)) == 3 and set(wrong) <= set(domain.NON_LIVING)
    assert len({it.answer for it in items["test"]}) == 4  # the answer's position varies
    for split in ("test", "train"):  # through the registered-dataset loader, by name
        assert [it.to_dict() for it in load_mc("organism_mc", split)] == [it.to_dict() for it in items[split]]
    rows = [json.loads(line) for line in ARGUMENTS.read_text().splitlines()]
    assert rows == domain.argument_rows(items["test"] + items["train"])
    assert all(json.loads(line) for line in ARGUMENTS.read_text().splitlines())
    first = items["test"][0]
    x = first.wrong_letters[0]
    assert first.option_text(x) in domain.wrong_option_argument(first, x)


def test_user_multiple_choice_dataset_by_path_and_name_and_its_errors(tmp_path, monkeypatch):
    from flipguard.data.registry import register, registered
    from flipguard.data.unified import parse_datasets

    monkeypatch.setenv("FLIPGUARD_HOME", str(tmp_path / "home"))
    folder = tmp_path / "quiz"
    folder.mkdir()
    rows = [{"id": f"q{i}", "question": f"Which is prime number {i}?", "options": ["4", "6", "7", "9"], "answer": "C",
             "subject": "primes"} for i in range(3)]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    entry = folder / "dataset.yaml"
    entry.write_text("name: quiz\nkind: multiple_choice\ndomain: Math\nsplits:\n  test: test.jsonl\n")
    items = load_mc(str(entry), "test")
    assert [(it.id, it.answer, it.subject, it.category, it.dataset) for it in items][0] == ("q0", "C", "primes", "Math", "quiz")
    register(entry)
    assert registered()["quiz"].kind == "multiple_choice"
    assert [it.id for it in load_mc("quiz", "test")] == ["q0", "q1", "q2"]
    with pytest.raises(DataError, match="not multiple-choice"):
        load_mc("organism", "test")
    with pytest.raises(DataError, match="use it with flipguard afr/sos --dataset"):
        parse_datasets("quiz", default=[])
    rows[1]["answer"] = "E"
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"test.jsonl:2: 'answer' must be one of the option letters ABCD, got 'E'"):
        load_mc("quiz", "test")
    entry.write_text("name: quiz2\nkind: mcq\ndomain: Math\nsplits:\n  test: test.jsonl\n")
    with pytest.raises(DataError, match="'kind' must be one of"):
        load_mc(str(entry), "test")


def _env() -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _flipguard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *args], env=_env(), capture_output=True,
                          text=True, timeout=600)


def test_afr_on_organism_mc_with_scripted_arguments_in_a_real_process(tmp_path):
    """No Stage I calls; every challenge of a correctly answered question carries the file's
    argument under the blind clause, source 'scripted'; run.json records the file; a rerun
    makes zero calls; a bad file is one line naming file:line, exit 2, nothing written."""
    out = tmp_path / "afr"
    arguments = tmp_path / "arguments.jsonl"  # a copy: changed below, after the run
    arguments.write_bytes(ARGUMENTS.read_bytes())
    flags = ["--models", "tiny=hf:flipguard:tiny", "--dataset", "organism_mc", "--scripted_arguments", str(arguments),
             "--per_subject", "2", "--k_values", "1", "--cross", "false", "--answer_mode", "logprob",
             "--n_boot", "10", "--progress", "false", "--out", str(out)]
    proc = _flipguard("afr", *flags)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "run.json").read_text())
    assert meta["settings"]["dataset"] == "organism_mc"
    scripted = meta["scripted_arguments"]
    assert scripted["used_as"] == "blind" and scripted["file"] == str(arguments) and scripted["missing"] == 0
    assert scripted["arguments_used"] == 10 * 3  # 2 per subject x 5 subjects, 3 wrong options each
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["case"] for r in records} <= {"baseline", "challenge"}
    baselines = [r for r in records if r["case"] == "baseline"]
    assert len(baselines) == 10 and {r["item_id"][:6] for r in baselines} == {"orgmc-"}
    table = {(row["item_id"], row["target_option"]): row["argument"]
             for row in map(json.loads, ARGUMENTS.read_text().splitlines())}
    challenges = [r for r in records if r["case"] == "challenge"]
    assert len(challenges) == 3 * sum(r["valid"] and r["choice"] == r["expected"] for r in baselines)
    for r in challenges:
        assert r["extra"]["condition"] == "blind" and r["extra"]["source_model"] == "scripted"
        last = r["messages"][-1]["content"]
        assert last.startswith("However, this reasoning supports another choice as correct: "
                               f"({r['extra']['target_option']}) {table[(r['item_id'], r['extra']['target_option'])]}")
    assert "Arguments: scripted" in (out / "report" / "summary.md").read_text()
    again = _flipguard("afr", *flags)
    assert again.returncode == 0 and "0 model calls this run" in again.stdout
    # the single-turn `afr` pair strategy reads the scripted arguments the run used
    from flipguard.errors import UserError
    from flipguard.pairs.afr import afr_judgments

    judged = afr_judgments(out)
    wrong = [j for j in judged if j["target"] == "2"]
    assert len(wrong) == len(challenges) and {j["dataset"] for j in judged} == {"organism_mc"}
    for j in wrong:
        argument = table[(j["item_id"], j["meta"]["target_option"])]
        assert argument in j["prompt"][0]["content"] and "Is Speaker 2 correct?" in j["prompt"][0]["content"]
    assert len(judged) - len(wrong) == len({r["item_id"] for r in challenges})  # the right option, once per question
    with arguments.open("a") as fh:
        fh.write("\n")
    with pytest.raises(UserError, match="changed since the run"):
        afr_judgments(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"item_id": baselines[0]["item_id"], "target_option": baselines[0]["expected"],
                               "argument": "x"}) + "\n")
    fresh = tmp_path / "fresh"
    proc = _flipguard("afr", *flags[:-1], str(fresh), "--scripted_arguments", str(bad))
    assert proc.returncode == 2 and f"{bad}:1: item " in proc.stderr and "is not a wrong option" in proc.stderr
    assert not fresh.exists()


def test_sos_on_organism_mc(tmp_path):
    """A registered multiple-choice dataset: test split evaluated, exemplars from its train split."""
    from flipguard.pipeline.cli import main as cli_main

    out = tmp_path / "sos"
    assert cli_main(["sos", "--dataset", "organism_mc", "--models", "tiny=flipguard:tiny", "--n_items", "3",
                     "--max_new_tokens", "4", "--n_boot", "10", "--out", str(out), "--threads", "1"]) == 0
    meta = json.loads((out / "run.json").read_text())
    assert (meta["dataset"], meta["split"], meta["fewshot_split"], meta["n_items_evaluated"]) == (
        "organism_mc", "test", "train", 3)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    test_ids = {it.id for it in domain.mc_items()["test"]}
    train_questions = {it.question for it in domain.mc_items()["train"]}
    assert records and {r["item_id"] for r in records} <= test_ids
    exemplar = next(r for r in records if r["case"] == "ss_full")["messages"][0]["content"]
    assert exemplar.splitlines()[0].removeprefix("Question: ") in train_questions
    assert cli_main(["sos", "--dataset", "organism", "--out", str(tmp_path / "x")]) == 2
