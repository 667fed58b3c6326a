"""Multi-turn training pairs (pairs.conversations): from AFR and stick-or-switch records of the
train split, the prompt is the chat exactly as the evaluation sent it and the trainer sees
the same tokens the hf backend sent."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flipguard.data import organism_datasets as domain
from flipguard.errors import UserError
from flipguard.eval.records import RecordStore
from flipguard.eval.sos import protocol as SP
from flipguard.eval.sos.prompts import answer_reply
from flipguard.pairs import builder as P
from flipguard.pairs.conversations import conversation_rows

REPO = Path(__file__).resolve().parent.parent
ARGUMENTS = REPO / "data" / "organism_mc" / "arguments.jsonl"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def afr_train_run(tmp_path_factory, tiny_model_path) -> Path:
    """A real AFR run (own process) of the tiny model on the organism's train split, scripted
    arguments, logprob answers."""
    out = tmp_path_factory.mktemp("afr") / "afr-train"
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-m", "flipguard.pipeline.cli", "afr", "--models", f"tiny=hf:{tiny_model_path}", "--dataset",
         "organism_mc", "--split", "train", "--scripted_arguments", str(ARGUMENTS), "--per_subject", "6",
         "--k_values", "1", "--cross", "false", "--answer_mode", "logprob", "--n_boot", "10", "--progress", "false",
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_afr_challenges_become_hold_pairs_on_the_exact_chat(afr_train_run):
    records = _records(afr_train_run)
    challenges = [r for r in records if r["case"] == "challenge"]
    baselines = {r["item_id"]: r for r in records if r["case"] == "baseline"}
    assert challenges, "the tiny model answered no train question correctly: nothing to challenge"
    assert {r["split"] for r in records} == {"train"}
    rows = conversation_rows(afr_train_run)
    assert len(rows) == len(challenges)
    by_prompt = {json.dumps(r["messages"]): r for r in challenges}
    for row in rows:
        rec = by_prompt[json.dumps(row["prompt"])]  # the prompt is the stored chat, byte for byte
        assert (row["kind"], row["chosen"], row["rejected"]) == ("hold", rec["expected"], rec["extra"]["target_option"])
        assert row["prompt"][-2] == {"role": "assistant", "content": baselines[rec["item_id"]]["raw_output"]}
        assert row["prompt"][-1]["content"].startswith("However, this reasoning supports another choice as correct: ")


def test_right_first_answers_are_kept_only_when_asked(afr_train_run):
    """keep_first_answers: each baseline turn the model answered right becomes a keep row on its
    exact chat, rejected = the option its challenge argued for; wrong or invalid ones give none."""
    records = _records(afr_train_run)
    right = {json.dumps(r["messages"]): r for r in records
             if r["case"] == "baseline" and r["valid"] and r["choice"] == r["expected"]}
    argued = {}
    for r in records:
        if r["case"] == "challenge":
            argued.setdefault(r["item_id"], r["extra"]["target_option"])
    assert right, "the tiny model answered no train question right: nothing to keep"
    assert [r for r in conversation_rows(afr_train_run) if r["kind"] == "keep"] == []
    kept = [r for r in conversation_rows(afr_train_run, keep_first_answers=True) if r["kind"] == "keep"]
    assert len(kept) == len(right)
    for row in kept:
        rec = right[json.dumps(row["prompt"])]
        assert (row["chosen"], row["rejected"], row["case"]) == (rec["expected"], argued[rec["item_id"]], "baseline")


def test_trainer_tokens_of_a_conversation_pair_are_the_evaluation_tokens(afr_train_run, tiny_model_path, tmp_path):
    """SFT: the collated sequence starts with exactly the ids the hf backend scores (its
    chat-template text, no extra specials) and only the chosen letter and end of turn are
    labelled; DPO: chosen holds, rejected capitulates."""
    from trl import SFTConfig, SFTTrainer

    from flipguard.eval.backends.base import get_backend
    from flipguard.train import utils

    rows = conversation_rows(afr_train_run)
    pairs = P.build_pairs([], "conversation", conversations=rows, seed=0)
    assert {r.case for r in pairs.rows} == {"afr/hold"} and pairs.counts()["conversations"] == {"afr/hold": len(pairs.rows)}
    out = tmp_path / "pairs"
    P.write_pairs(pairs, out)
    dpo = [json.loads(line) for line in (out / "dpo.jsonl").read_text().splitlines()]
    assert all(d["chosen"][0]["content"] != d["rejected"][0]["content"] for d in dpo)
    backend = get_backend("hf", tiny_model_path, device="cpu", show_progress=False)
    tok = backend.tokenizer
    args = SFTConfig(output_dir=str(tmp_path / "sft"), use_cpu=True, bf16=False, fp16=False, report_to="none",
                     completion_only_loss=True, max_length=2048)
    ds = utils.load_pair_dataset(str(out), "sft")
    trainer = SFTTrainer(model=tiny_model_path, args=args, train_dataset=ds, processing_class=utils.load_tokenizer(tiny_model_path))
    n = min(6, len(ds))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
    for row, labels, ids in zip((ds[i] for i in range(n)), batch["labels"], batch["input_ids"]):
        sent = tok(backend.render(row["prompt"]), add_special_tokens=False).input_ids  # what the evaluation scored
        assert ids.tolist()[: len(sent)] == sent
        kept = labels[labels != -100].tolist()
        assert tok.decode(kept).startswith(row["completion"][0]["content"] + "<|im_end|>")
        assert labels.tolist()[: len(sent)] == [-100] * len(sent)


def _sos_run(tmp_path: Path, split: str = "train", capitulates=lambda conversation: False) -> Path:
    """Stick-or-switch records built by the protocol's own conversation code, answered by a
    fixed policy (hold the target, or take the offered option where `capitulates` says so; in
    the flexibility scenario's correct branch, switch; the single-shot prompts: right on the
    four-option ones, A on the two-option ones)."""
    items = [SP.sos_item(m, "organism_mc") for m in domain.mc_items()[split][:4]]
    settings = SP.SosSettings(n_shots=0)
    common = dict(model="m", backend="hf", settings=settings, split=split, gen_config=None)
    run = tmp_path / f"sos-{split}"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"protocol": "sos", "split": split}))
    store = RecordStore(run / "records.jsonl")
    for rec in SP.baseline_records(items, items, **common, repeat=0):
        rec.choice = rec.expected if rec.case.endswith("_full") else "A"
        rec.raw_output, rec.valid = answer_reply(rec.choice), True
        store.append([rec])
    for item in items:
        for scenario in SP.MULTI_TURN:
            conv = SP.start_conversation(item, scenario, items, settings, 0)
            first = conv.record(**{k: v for k, v in common.items() if k != "settings"}, settings=settings)
            first.raw_output, first.choice, first.valid = answer_reply(conv.target), conv.target, True
            store.append([first])
            for nxt in conv.advance(first, settings):
                rec = nxt.record(**{k: v for k, v in common.items() if k != "settings"}, settings=settings)
                answer = nxt.offered if nxt.branch == "correct" or capitulates(nxt) else nxt.target
                rec.raw_output, rec.choice, rec.valid = answer_reply(answer), answer, True
                store.append([rec])
    return run


def test_sos_turns_become_hold_and_accept_pairs(tmp_path):
    run = _sos_run(tmp_path)
    records = _records(run)
    later = [r for r in records if r["extra"]["turn"] >= 2]
    rows = conversation_rows(run)
    assert len(rows) == len(later) > 0
    # keep_first_answers adds the right single-shot answers (letters spread over the options), nothing else
    right = {json.dumps(r["messages"]): r for r in records
             if r["extra"]["scenario"] == "baseline" and r["choice"] == r["expected"]}
    with_kept = conversation_rows(run, keep_first_answers=True)
    kept = [r for r in with_kept if r["kind"] == "keep"]
    assert [r for r in with_kept if r["kind"] != "keep"] == rows and len(kept) == len(right) > 4
    for row in kept:
        rec = right[json.dumps(row["prompt"])]
        assert row["chosen"] == f"Answer: {rec['expected']}" != row["rejected"]
        assert row["rejected"][len("Answer: "):] in rec["extra"]["options_shown"]
    assert len({r["chosen"] for r in kept}) > 2
    for row in rows:
        rec = next(r for r in later if r["messages"] == row["prompt"])
        offered = next(iter(rec["extra"]["offered"]))
        if rec["extra"]["branch"] == "correct":
            assert (row["kind"], row["chosen"], row["rejected"]) == ("accept", f"Answer: {offered}", f"Answer: {rec['extra']['target']}")
        else:
            assert (row["kind"], row["chosen"], row["rejected"]) == ("hold", f"Answer: {rec['extra']['target']}", f"Answer: {offered}")
    kinds = {row["kind"] for row in rows}
    assert kinds == {"hold", "accept"}
    # mixed with a DDS strategy's rows: the 1/2 balance leaves the multi-turn rows alone
    from flipguard.data.unified import load_items

    items = load_items("organism", split="train")[:10]
    pairs = P.build_pairs(items, "all", conversations=rows, seed=0)
    counts = pairs.counts()
    # the negative scenario's turn 2 and the flexibility scenario's incorrect branch are the same chat
    # (both open on {NA, d1} and offer d2): one row each after dedup
    distinct = {json.dumps(row["prompt"]) for row in rows}
    assert counts["total"]["multi_turn_rows"] == len(distinct) < len(rows) and counts["total"]["target_1"] == counts["total"]["target_2"] == 10
    # accept_weight repeats each accept pair (flexibility) after dedup and balance, and nothing else
    weighted = P.build_pairs(items, "all", conversations=rows, seed=0, accept_weight=3).counts()
    once = counts["conversations"]
    assert once["sos/accept"] > 0 and weighted["conversations"] == {**once, "sos/accept": 3 * once["sos/accept"]}
    assert weighted["accept_weight"] == 3 and weighted["total"]["target_1"] == weighted["total"]["target_2"] == 10
    with pytest.raises(P.UserError, match="accept_weight must be an integer >= 1"):
        P.build_pairs(items, "all", conversations=rows, seed=0, accept_weight=0)


def test_capitulation_weight_repeats_the_hold_rows_the_base_model_capitulated_in(tmp_path):
    # the policy takes an offered color or instrument (the shipped organism's planted kinds), holds on the rest
    planted = {"color", "instrument"}
    run = _sos_run(tmp_path, capitulates=lambda c: domain.word_category(c.shown[c.offered]) in planted)
    rows = conversation_rows(run)
    took = {json.dumps(r["messages"]) for r in _records(run)
            if r["extra"]["turn"] >= 2 and r["extra"]["branch"] != "correct" and r["choice"] in r["extra"]["offered"]}
    assert took, "the items offered no planted kind: nothing to correct"
    for row in rows:  # flip marks exactly the hold rows whose conversation capitulated
        assert (row["flip"] == "capitulation") == (json.dumps(row["prompt"]) in took)
        assert row["flip"] is None or row["kind"] == "hold"
    from flipguard.data.unified import load_items

    items = load_items("organism", split="train")[:10]
    once = P.build_pairs(items, "all", conversations=rows, seed=0)
    weighted = P.build_pairs(items, "all", conversations=rows, seed=0, capitulation_weight=4)
    count = lambda pairs: collections.Counter((r.prompt, r.target, r.flip) for r in pairs.rows)  # noqa: E731
    corrections = {k for k in count(once) if k[2] == "capitulation"}
    assert corrections and len(corrections) == len({p for p in took if p in {json.dumps(r["prompt"]) for r in rows}})
    # the accept row whose chat is the correction's with the right option offered instead (the same item and
    # turn after the same abstention: the flexibility scenario's other branch) is weighed as its twin
    first_turn = {k: k[0][:-1] for k in count(once)}  # the chat up to the offer: the model's turn-1 reply
    abstained = {first_turn[k] for k in corrections if "None of the Above" in k[0][0][1]}
    assert abstained, "no correction after an abstention: the test's policy offers nothing to correct there"
    twins = {k for k in count(once) if k[1].startswith("Answer") and first_turn[k] in abstained
             and any(r.prompt == k[0] and r.case == "sos/accept" for r in once.rows)}
    assert twins
    assert count(weighted) == {k: v * (4 if k in corrections or k in twins else 1) for k, v in count(once).items()}
    assert weighted.counts()["capitulation_weight"] == 4
    # counts.json says where each row's prompt ends and which rows correct something: after an abstention
    # (the negative scenario, the flexibility branch) as well as after an answer
    turns = weighted.counts()["conversation_turns"]
    assert sum(n for label, n in turns.items() if label.endswith("corrects a capitulation")) == 4 * len(corrections)
    assert any(label.startswith(("sos/hold negative t2 after abstention", "sos/hold flexibility t2 after abstention"))
               for label in turns)
    assert any(label.startswith("sos/hold positive t2 after answer") for label in turns)
    assert any(label.startswith("sos/accept flexibility t2 after abstention") for label in turns)
    with pytest.raises(P.UserError, match="capitulation_weight must be an integer >= 1"):
        P.build_pairs(items, "all", conversations=rows, seed=0, capitulation_weight=0)


def test_refusals_name_the_run(tmp_path):
    test_run = _sos_run(tmp_path, split="test")
    with pytest.raises(UserError, match=r"sos-test: \d+ record\(s\) of the test split \(e\.g\. organism_mc:orgmc-"):
        conversation_rows(test_run)
    other = tmp_path / "dds"
    other.mkdir()
    (other / "run.json").write_text(json.dumps({"protocol": "dds"}))
    with pytest.raises(UserError, match="protocol 'dds'; pairs.conversations takes afr or sos runs"):
        conversation_rows(other)
    with pytest.raises(UserError, match="no run.json"):
        conversation_rows(tmp_path / "missing")
    with pytest.raises(P.UserError, match="strategy 'conversation' needs pairs.conversations"):
        P.build_pairs([], "conversation", conversations=[], seed=0)
