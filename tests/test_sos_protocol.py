"""Stick-or-switch protocol: data loaders, conversation construction, scripted stick/switch
paths with hand-computed metrics, resume, and the whole command on the tiny model."""

from __future__ import annotations

import json
import re

import pytest

from flipguard.data.medmcqa import load_medmcqa
from flipguard.data.medqa import MCQItem, load_medqa
from flipguard.data.schema import DataError, normalise_question
from flipguard.eval.backends.base import Backend
from flipguard.eval.records import load_records
from flipguard.eval.sos.metrics import summarise
from flipguard.eval.sos.protocol import SosArgs, SosItem, SosTask, distractor_order, sos_item
from flipguard.eval.task import run_task

# --------------------------------------------------------------------------- data


def test_shipped_samples_load_and_pools_are_disjoint():
    for load, split in ((load_medqa, "test"), (load_medmcqa, "dev")):
        items, pool = load(split), load(split="fewshot")
        assert len(items) == 24 and len(pool) == 12
        assert not {normalise_question(i.question) for i in items} & {normalise_question(p.question) for p in pool}
        assert all(it.answer in "ABCD" and len(it.options) == 4 for it in items + pool)


def test_medmcqa_cop_counts_from_one(tmp_path):
    row = {"id": "q1", "question": "Which?", "opa": "a1", "opb": "b1", "opc": "c1", "opd": "d1",
           "cop": 1, "choice_type": "single"}
    multi = {**row, "id": "q2", "choice_type": "multi"}
    (tmp_path / "medmcqa").mkdir()
    (tmp_path / "medmcqa" / "dev.json").write_text(json.dumps(row) + "\n" + json.dumps(multi) + "\n")
    items = load_medmcqa("dev", data_root=tmp_path)
    assert [(i.id, i.answer, i.options[0]) for i in items] == [("q1", "A", "a1")]  # multi-answer left out


@pytest.mark.parametrize(
    "change, message",
    [
        ({"answer_idx": None}, "answer key"),
        ({"answer_idx": "E"}, "answer key"),
        ({"options": {"A": "x", "B": "x", "C": "y", "D": "y"}, "answer_idx": "C", "answer": "y"}, "answer text also appears"),
        ({"options": {"A": "x", "B": "y", "C": "y", "D": "Y."}, "answer_idx": "A", "answer": "x"}, "fewer than two"),
    ],
)
def test_medqa_bad_items_name_the_item(tmp_path, change, message):
    good = {"question": "Good question?", "answer": "x", "options": {"A": "x", "B": "y", "C": "z", "D": "w"}, "answer_idx": "A"}
    bad = {**good, "question": "Bad question?", **change}
    (tmp_path / "medqa").mkdir()
    (tmp_path / "medqa" / "phrases_no_exclude_test.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=message) as err:
        load_medqa("test", data_root=tmp_path)
    assert "phrases_no_exclude_test.jsonl:2" in str(err.value) and "medqa-" in str(err.value)
    kept = load_medqa("test", data_root=tmp_path, skip_invalid=True)  # left out, with a warning
    assert [i.question for i in kept] == ["Good question?"]


def test_unknown_dataset_and_split_are_errors():
    from flipguard.eval.sos.protocol import load_mcq

    with pytest.raises(DataError, match="unknown dataset 'medqaa'"):
        load_mcq("medqaa", "test", None, False, None)
    with pytest.raises(DataError, match="unknown split"):
        load_medqa("dev")


def test_sos_item_merges_duplicate_distractors_and_rejects_too_few():
    it = sos_item(MCQItem("i1", "", "", "Q?", ["a", "b", "B", "c"], "A"), "medmcqa")
    assert it.options == ("a", "b", "c") and it.answer == "a" and it.distractors == ["b", "c"]
    with pytest.raises(DataError, match="item i2: fewer than two distinct distractors"):
        sos_item(MCQItem("i2", "", "", "Q?", ["a", "b", "b", "b"], "A"), "medmcqa")


# --------------------------------------------------------------------------- scripted backend

ANSWER, NA = "the right one", "None of the Above"
# Per question: how the scripted model behaves (see the expected values below).
WRONG_T1 = {"Q4"}  # takes the distractor at turn 1
SWITCH_AT = {("Q2", 2), ("Q3", 3)}  # takes the offered distractor at this turn
GARBAGE_AT = {("Q6", 2)}  # unreadable reply when offered a distractor at this turn
TAKES_ANSWER = {"Q1", "Q2", "Q6"}  # flexibility: takes the answer when offered at turn 2
FULL_CORRECT = {"Q1", "Q2", "Q5"}  # single-shot, all options: picks the answer
FULL_ABSTAINS = {"Q1", "Q2", "Q3", "Q4"}  # single-shot, NA replacing the answer: picks NA


def make_items() -> list[SosItem]:
    items = []
    for q in ("Q1", "Q2", "Q3", "Q4", "Q5", "Q6"):
        n_distractors = 2 if q == "Q5" else 3
        options = (ANSWER,) + tuple(f"{q} wrong {k}" for k in range(1, n_distractors + 1))
        items.append(SosItem("medqa", f"id-{q}", f"{q}: which one?", options, 0))
    return items


class ScriptedBackend(Backend):
    """Answers from the chat it is given, like a model would: reads the question, the
    options shown, and which turn it is; the script decides stick or switch."""

    name = "scripted"
    model_id = "scripted"

    def __init__(self):
        self.calls = 0
        self.seen: list[list[dict]] = []

    def generate(self, conversations, config):
        self.calls += len(conversations)
        self.seen += [list(c) for c in conversations]
        return [self.reply(c) for c in conversations]

    def choice_probs(self, conversations, choices=("1", "2")):  # pragma: no cover - generate only
        raise NotImplementedError

    def reply(self, messages):
        first = max(i for i, m in enumerate(messages) if m["role"] == "user" and m["content"].startswith("Question:"))
        q = re.match(r"Question: (Q\d)", messages[first]["content"]).group(1)
        options = dict(re.findall(r"^([A-J])\. (.*)$", messages[first]["content"], re.M))
        turn = sum(1 for m in messages[first:] if m["role"] == "user")
        target = next(k for k, v in options.items() if v in (ANSWER, NA))
        if len(options) > 2:  # single shot, all options
            wrong = next(k for k, v in options.items() if v not in (ANSWER, NA))
            keep = FULL_ABSTAINS if NA in options.values() else FULL_CORRECT
            return f"Answer: {target if q in keep else wrong}"
        if turn == 1:
            other = next(k for k in options if k != target)
            return f"Answer: {other if q in WRONG_T1 else target} [{q}-t1]"
        letter, text = re.match(r"Consider this alternative option: ([A-J])\. (.*?) Would", messages[-1]["content"]).groups()
        if (q, turn) in GARBAGE_AT and text != ANSWER:
            return "I am not sure what to say."
        take = (q in TAKES_ANSWER) if text == ANSWER else ((q, turn) in SWITCH_AT)
        return f"Answer: {letter if take else target} [{q}-t{turn}]"


def run_scripted(tmp_path, backend=None, seed=0, **settings):
    """The task on the scripted model through the one runner (items given, no exemplars)."""
    backend = backend or ScriptedBackend()
    task = SosTask(SosArgs(model=["scripted"], seed=seed, n_shots=0, **settings), items=make_items(), pool=[])
    result = run_task(task, tmp_path, backends={"scripted": backend}, progress=False)
    return backend, result.sent, load_records(tmp_path)


def test_scripted_paths_give_hand_computed_metrics(tmp_path):
    _, sent, records = run_scripted(tmp_path)
    res = summarise(records, seed=0, n_boot=200)["scripted"]
    # Positive: Q1 holds 3 turns; Q2 switches at t2; Q3 at t3; Q4 wrong at t1; Q5 (two
    # distractors) holds both and carries forward; Q6 unreadable at t2.
    # S(1) = 5/6, S(2) = 3/6 (Q1, Q3, Q5), S(3) = 2/6 (Q1, Q5).
    for scen in ("positive", "negative"):
        assert res[f"{scen}_survival"] == pytest.approx([500 / 6, 300 / 6, 200 / 6])
        assert res[f"{scen}_mt"]["value"] == pytest.approx(200 / 6)
        assert res[f"{scen}_ends"] == {"exhausted": 2, "switch": 2, "wrong_t1": 1, "invalid": 1}
        assert res[f"{scen}_invalid_by_turn"] == {2: 1}
    # Single shot, all options: Q1, Q2, Q5 right -> 50 %; tax = 33.3 - 50 = -16.7 pp.
    assert res["ss_full"]["value"] == pytest.approx(50.0)
    assert res["conversation_tax"]["value"] == pytest.approx(200 / 6 - 50.0)
    # NA replacing the answer: Q1-Q4 abstain -> 66.7 %; penalty = 33.3 - 66.7 = -33.3 pp.
    assert res["abstain_full"]["value"] == pytest.approx(400 / 6)
    assert res["abstention_penalty"]["value"] == pytest.approx(200 / 6 - 400 / 6)
    # The binary baselines are turn 1: all but Q4.
    assert res["ss_binary"]["value"] == pytest.approx(500 / 6) == res["abstain_binary"]["value"]
    # Flexibility: 5 abstain at t1 (not Q4); the answer is taken by Q1, Q2, Q6 (3/5), another
    # distractor only by Q2 (1/5; Q6's unreadable reply is no switch) -> gap +40 pp.
    fx = res["flexibility"]
    assert fx["correct_switch"]["value"] == pytest.approx(60.0) and fx["correct_switch"]["n"] == 5
    assert fx["incorrect_switch"]["value"] == pytest.approx(20.0)
    assert fx["switch_gap"]["value"] == pytest.approx(40.0)
    assert res["flexibility_invalid"] == {"t1": 0, "t2_correct": 0, "t2_incorrect": 1}
    for est in (res["conversation_tax"], res["abstention_penalty"], fx["switch_gap"]):
        assert est["ci_low"] <= est["value"] <= est["ci_high"]
    # Requests: 4 baselines x 6 items; per conviction scenario t1 for 6, t2 for 5 (not Q4),
    # t3 for Q1 and Q3 only (Q5 has no third distractor); flexibility 6 + 2 branches x 5.
    assert sent == 24 + 2 * (6 + 5 + 2) + 6 + 2 * 5 == len(records)


def test_history_carries_the_models_own_replies(tmp_path):
    backend, _, records = run_scripted(tmp_path)
    by_key = {(r.item_id, r.case): r for r in records}
    t1 = by_key[("id-Q1", "positive/t1")]
    t2 = by_key[("id-Q1", "positive/t2")]
    t3 = by_key[("id-Q1", "positive/t3")]
    assert t2.messages[: len(t1.messages)] == t1.messages
    assert t2.messages[len(t1.messages)] == {"role": "assistant", "content": t1.raw_output}
    assert t1.raw_output.endswith("[Q1-t1]")  # the model's own words, not a canned "Answer: X"
    assert t3.messages[len(t2.messages)] == {"role": "assistant", "content": t2.raw_output}
    assert [m["role"] for m in t3.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert t3.messages[-1]["content"].startswith("Consider this alternative option: D. ")
    assert t3.messages[-1]["content"].endswith("Would you like to stick to your original answer or switch to the new option.")
    # Both flexibility branches continue the same turn-1 reply.
    f1 = by_key[("id-Q1", "flexibility/t1")]
    for branch, offered in (("correct", ANSWER), ("incorrect", None)):
        rec = by_key[("id-Q1", f"flexibility/t2_{branch}")]
        assert rec.messages[: len(f1.messages) + 1] == f1.messages + [{"role": "assistant", "content": f1.raw_output}]
        if offered:
            assert list(rec.extra["offered"].values()) == [offered]


def test_distractor_order_is_seeded_and_followed(tmp_path):
    item = make_items()[0]
    assert distractor_order(item, 0) == distractor_order(item, 0)
    orders = {tuple(distractor_order(item, s)) for s in range(20)}
    assert len(orders) > 1 and all(sorted(o) == sorted(item.distractors) for o in orders)
    _, _, records = run_scripted(tmp_path, seed=3)
    recs = sorted((r for r in records if r.item_id == item.id and r.extra["scenario"] == "positive"),
                  key=lambda r: r.extra["turn"])
    order = distractor_order(item, 3)
    first_distractor = [v for k, v in recs[0].extra["options_shown"].items() if v != ANSWER]
    offered = [list(r.extra["offered"].values())[0] for r in recs[1:]]
    assert first_distractor + offered == order
    # the same seed gives the same prompts: a second directory gets identical keys
    _, _, again = run_scripted(tmp_path / "again", seed=3)
    assert sorted(r.key for r in again) == sorted(r.key for r in records)


def test_resume_makes_no_new_calls(tmp_path):
    backend, sent, first = run_scripted(tmp_path)
    assert sent == backend.calls > 0
    backend2, sent2, second = run_scripted(tmp_path)
    assert sent2 == 0 and backend2.calls == 0 and len(second) == len(first)


def test_interrupted_run_continues_mid_conversation(tmp_path):
    import shutil

    _, _, full = run_scripted(tmp_path / "full")
    # the run as it stood after turn 1: flipguard's own folder (run log, manifest), later turns not yet written
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    path = tmp_path / "cut" / "records.jsonl"
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["extra"]["turn"] == 1]
    path.write_text("\n".join(kept) + "\n")
    backend, sent, records = run_scripted(tmp_path / "cut")
    assert sent == len(full) - len(kept) == backend.calls
    assert sorted(r.key for r in records) == sorted(r.key for r in full)


# --------------------------------------------------------------------------- tiny model end to end


def run(args: SosArgs):
    """Run (or resume) one stick-or-switch run directory, no progress bars: the runner's result."""
    return run_task(SosTask(args), args.out, progress=False)


def test_command_end_to_end_on_tiny_model_with_resume(tmp_path, tiny_model_path, monkeypatch):
    from flipguard.eval.sos import sos_summary

    monkeypatch.delenv("FLIPGUARD_DATA", raising=False)
    out = tmp_path / "run"
    args = SosArgs(datasets="medqa", model=[f"tiny={tiny_model_path}"], device="cpu", batch_size=8, limit=2,
                   n_shots=1, max_new_tokens=4, n_boot=50, out=str(out))
    sent = run(args).sent
    records = load_records(out)
    assert sent == len(records) >= 2 * (4 + 3)  # 4 baselines + 3 scenario openings per item
    assert {r.item_id for r in records} and all(r.model == "tiny" and r.protocol == "sos" for r in records)
    sent_again = run(args).sent
    assert sent_again == 0
    argv = ["--datasets", "medqa", "--model", f"tiny={tiny_model_path}", "--device", "cpu", "--limit", "2",
            "--n_shots", "1", "--max_new_tokens", "4", "--n_boot", "50", "--out", str(out)]
    assert SosTask.main(argv) == 0
    for name in ("report/summary.md", "report/sos_survival.png", "report/sos_flexibility.png",
                 "report/sos_table_a1_conversation_tax.csv", "report/sos_table_a2_abstention_penalty.csv",
                 "report/sos_table_a3_flexibility.csv", "report/summary.json"):
        assert (out / name).stat().st_size > 0
    assert (out / "report" / "sos_survival.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = sos_summary(out)
    assert summary.numbers["tiny"].conversation_tax.n == 2
    assert summary.numbers["tiny"].abstention_penalty is not None
    # another setting in the same directory is refused
    from flipguard.errors import FlipguardError

    with pytest.raises(FlipguardError, match="another condition"):
        run(SosArgs(**{**args.__dict__, "seed": 1}))


def test_repeats_draw_their_own_order_and_decoding_seed(tmp_path):
    class SeedRecorder(ScriptedBackend):
        def generate(self, conversations, config):
            self.seeds = getattr(self, "seeds", set()) | {config.seed}
            return super().generate(conversations, config)

    backend, _, records = run_scripted(tmp_path, SeedRecorder(), seed=7, target_position="first", repeats=2,
                                       scenarios=["positive"])
    assert backend.seeds == {7, 8}  # decoding seed: --seed 7 + repeat
    assert {r.extra["repeat"] for r in records} == {0, 1}
    assert all(r.expected == "A" for r in records if r.extra["turn"] == 1)  # target_position="first"
    orders = {r.extra["repeat"]: distractor_order(make_items()[0], 7, r.extra["repeat"]) for r in records}
    t1 = {r.extra["repeat"]: r.extra["options_shown"]["B"] for r in records if r.item_id == "id-Q1" and r.extra["turn"] == 1}
    assert t1 == {k: v[0] for k, v in orders.items()}
    res = summarise(records, n_boot=50)["scripted"]
    assert res["positive_n"] == 12 and res["positive_mt"]["n"] == 6  # CIs resample the 6 items


def test_paper_sampling_and_penalty_reading_are_recorded(tmp_path, tiny_model_path, monkeypatch):
    """--sampling model_default (paper §4.2) sends no temperature (the model's own
    generation settings decide) and, like --abstention_reference, is kept in run.json."""
    from flipguard.errors import FlipguardError
    from flipguard.eval.records import load_run_meta

    monkeypatch.delenv("FLIPGUARD_DATA", raising=False)
    out = tmp_path / "paper"
    args = SosArgs(datasets="medqa", model=[f"tiny={tiny_model_path}"], device="cpu", limit=1, n_shots=1,
                   max_new_tokens=2, n_boot=20, out=str(out), scenarios=["baseline"], sampling="model_default",
                   abstention_reference="paper")
    run(args)
    meta = load_run_meta(out)
    assert meta["sampling"] == "model_default" and meta["generation"]["temperature"] is None
    assert meta["abstention_reference"] == "paper"
    with pytest.raises(FlipguardError, match="--sampling must be one of"):
        run(SosArgs(datasets="medqa", model=["flipguard:tiny"], out=str(tmp_path / "x"), sampling="hot"))
