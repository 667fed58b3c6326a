"""Pair builders: strategies, balance, dedup, leakage and binary-target refusals, determinism."""

from __future__ import annotations

import collections
import json

import pandas as pd
import pytest

from flipguard.data.schema import DataError, Item
from flipguard.eval.dds.prompts import build_messages
from flipguard.pairs import builder as P


def item(i: int, split: str = "train", dataset: str = "amqa", q: str | None = None) -> Item:
    return Item(id=f"{dataset}-{i}", dataset=dataset, question=q or f"What is {i} plus {i}?",
                correct_answer=str(2 * i), incorrect_answer=str(2 * i + 1), split=split)


ITEMS = [item(i) for i in range(6)] + [item(i, dataset="gpqa") for i in range(10, 14)]


def flips_frame(flipped: dict[str, str]) -> pd.DataFrame:
    """flip_records()-shaped frame: one row per item and pair; `flipped` maps item id -> flip type."""
    rows = []
    for it in ITEMS:
        for pair in ("correct", "incorrect"):
            kind = flipped.get(it.id)
            hit = kind == "deference" and pair == "incorrect" or kind == "skepticism" and pair == "correct"
            rows.append({"item_id": it.id, "dataset": it.dataset, "pair": pair, "c1_correct": True,
                         "c2_correct": not hit, "flip": kind if hit else None})
    return pd.DataFrame(rows)


def targets(ps: P.PairSet) -> list[str]:
    return [r.target for r in ps.rows]


def test_all_strategy_is_the_papers_two_c2_variants_per_item():
    ps = P.build_pairs(ITEMS, "all", seed=1)
    assert len(ps.rows) == 2 * len(ITEMS)
    assert targets(ps).count("1") == targets(ps).count("2") == len(ITEMS)
    by_case = {(r.item_id, r.case): r for r in ps.rows}
    for it in ITEMS:
        # same bytes the logprob evaluation sends (Listing 3, one-token format)
        assert by_case[(it.id, "c2_correct")].messages == build_messages(it, "c2_correct", fmt="one_token")
        assert by_case[(it.id, "c2_correct")].target == "1"
        assert by_case[(it.id, "c2_incorrect")].target == "2"
        assert "Return exactly one of: 1 or 2." in by_case[(it.id, "c2_incorrect")].messages[-1]["content"]


def test_sft_and_dpo_formats():
    sft = P.build_sft_pairs(ITEMS[:2], "all", seed=0)
    dpo = P.build_dpo_pairs(ITEMS[:2], "all", seed=0)
    assert set(["prompt", "completion"]) <= set(sft.column_names)
    for row in sft:
        assert row["completion"] == [{"role": "assistant", "content": "1" if row["case"] == "c2_correct" else "2"}]
        assert row["prompt"][-1]["role"] == "user"
    for row in dpo:
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert {chosen, rejected} == {"1", "2"}
        assert chosen == ("1" if row["case"] == "c2_correct" else "2")


def test_flips_keeps_both_variants_of_flipped_items_only():
    flips = flips_frame({"amqa-1": "deference", "gpqa-11": "skepticism"})
    ps = P.build_pairs(ITEMS, "flips", flips, seed=3)
    assert sorted({r.item_id for r in ps.rows}) == ["amqa-1", "gpqa-11"]
    assert len(ps.rows) == 4 and targets(ps).count("1") == 2
    assert {r.item_id: r.flip for r in ps.rows} == {"amqa-1": "deference", "gpqa-11": "skepticism"}
    assert ps.counts()["flip_types"] == {"deference": 2, "skepticism": 2}


def test_flip_weighted_repeats_flipped_rows():
    flips = flips_frame({"amqa-2": "deference", "amqa-3": "deference"})
    ps = P.build_pairs(ITEMS, "flip_weighted", flips, seed=0, flip_weight=4)
    # 8 unflipped items x 2 rows + 2 flipped items x 2 rows x 4 repeats
    assert len(ps.rows) == 8 * 2 + 2 * 2 * 4
    assert sum(1 for r in ps.rows if r.item_id == "amqa-2") == 8
    assert targets(ps).count("1") == targets(ps).count("2")
    with pytest.raises(P.UserError):
        P.build_pairs(ITEMS, "flip_weighted", flips, flip_weight=0)


def test_consistency_gives_every_framing_the_same_target():
    ps = P.build_pairs(ITEMS[:2], "consistency", seed=0)
    assert len(ps.rows) == 2 * 3 * 2
    for it in ITEMS[:2]:
        rows = [r for r in ps.rows if r.item_id == it.id]
        correct = {(r.case, r.mitigation) for r in rows if r.target == "1"}
        assert correct == {("c1_true", "none"), ("c2_correct", "none"), ("c2_correct", "dehumanizing")}
        dehum = next(r for r in rows if r.mitigation == "dehumanizing")
        assert dehum.messages[0]["role"] == "system" and "AI Agent 2" in dehum.messages[-1]["content"]


def test_c1_true_weight_repeats_the_true_statements_only():
    """pairs.c1_true_weight: each C1-true row (a true statement judged as a statement) k times, after balance."""
    once = P.build_pairs(ITEMS[:4], "consistency", seed=0)
    weighted = P.build_pairs(ITEMS[:4], "consistency", seed=0, c1_true_weight=3)
    count = lambda ps: collections.Counter((r.item_id, r.case, r.mitigation, r.target) for r in ps.rows)  # noqa: E731
    c1_true = {k for k in count(once) if k[1] == "c1_true"}
    assert len(c1_true) == 4 and all(k[3] == "1" for k in c1_true)  # one per item, each "correct"
    assert count(weighted) == {k: v * (3 if k in c1_true else 1) for k, v in count(once).items()}
    assert len(weighted.rows) == len(once.rows) + 2 * 4
    assert weighted.counts()["c1_true_weight"] == 3 and once.counts()["c1_true_weight"] == 1
    with pytest.raises(P.UserError, match="c1_true_weight must be an integer >= 1"):
        P.build_pairs(ITEMS[:4], "consistency", seed=0, c1_true_weight=0)


def test_balance_downsamples_majority_and_can_be_turned_off():
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "target": "2" if i < 7 else "1",
             "item_id": f"m{i}", "dataset": "mmlu"} for i in range(10)]
    balanced = P.build_pairs([], "afr", afr_rows=rows, seed=0)
    assert targets(balanced).count("1") == targets(balanced).count("2") == 3
    assert balanced.dropped_for_balance == 4
    raw = P.build_pairs([], "afr", afr_rows=rows, seed=0, balance=False)
    assert targets(raw).count("2") == 7


def test_duplicates_and_conflicting_prompts_are_dropped():
    twin = item(0, q=ITEMS[0].question)  # same content, another id: identical prompts
    twin = Item(**{**twin.to_dict(), "id": "amqa-twin"})
    swapped = Item(id="amqa-swap", dataset="amqa", question=ITEMS[1].question,
                   correct_answer=ITEMS[1].incorrect_answer, incorrect_answer=ITEMS[1].correct_answer, split="train")
    ps = P.build_pairs(ITEMS + [twin, swapped], "all", seed=0)
    assert ps.duplicates == 2
    assert ps.conflicts == 2  # both prompts of item 1 now appear with both targets
    assert not any(r.item_id in ("amqa-1", "amqa-swap") for r in ps.rows)
    assert len({(r.prompt, r.target) for r in ps.rows}) == len(ps.rows)


def test_same_seed_same_rows_other_seed_other_order():
    a = P.build_pairs(ITEMS, "all", seed=7)
    b = P.build_pairs(ITEMS, "all", seed=7)
    c = P.build_pairs(ITEMS, "all", seed=8)
    assert a.rows == b.rows
    assert a.rows != c.rows and sorted(a.rows, key=repr) == sorted(c.rows, key=repr)


def test_test_split_items_are_refused():
    with pytest.raises(DataError, match="not from the train split"):
        P.build_pairs(ITEMS + [item(99, split="test")], "all")
    test_twin = Item(id="amqa-test-7", dataset="amqa", question="what is 3 PLUS 3", correct_answer="6",
                     incorrect_answer="7", split="test")
    with pytest.raises(DataError, match="leakage"):
        P.build_pairs(ITEMS, "all", test_items=[test_twin])


def test_non_binary_completion_is_refused():
    rows = [{"prompt": [{"role": "user", "content": "q"}], "target": "yes", "item_id": "m1", "dataset": "mmlu"}]
    with pytest.raises(P.UserError, match="not exactly '1' or '2'"):
        P.build_pairs([], "afr", afr_rows=rows)


def test_missing_train_records_print_the_eval_command(tmp_path):
    with pytest.raises(P.UserError, match="flipguard eval --split train --datasets bench --mode logprob"):
        P.flips_from_records(str(tmp_path / "nope"), ITEMS)
    with pytest.raises(P.UserError, match="flipguard eval --split train"):
        P.build_pairs(ITEMS, "flips", None)


def test_cli_writes_datasets_jsonl_and_counts(tmp_path, capsys):
    from datasets import load_from_disk

    from flipguard.pipeline.cli import main as cli

    out = tmp_path / "pairs"
    assert cli(["pairs", "recipes/tiny.yaml", "--out", str(out), "--pairs_datasets", "amqa,gpqa"]) == 0
    counts = json.loads((out / "counts.json").read_text())
    assert set(counts["per_dataset"]) == {"amqa", "gpqa"}
    total = counts["total"]
    assert total["target_1"] == total["target_2"] == total["items"]
    sft = load_from_disk(str(out / "sft"))
    dpo = load_from_disk(str(out / "dpo"))
    assert len(sft) == len(dpo) == total["rows"]
    lines = (out / "sft.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["completion"] == sft[0]["completion"]
    assert "pairs written to" in capsys.readouterr().out
    # a second run with the same seed writes the same bytes
    first = (out / "dpo.jsonl").read_bytes()
    assert cli(["pairs", "recipes/tiny.yaml", "--out", str(out), "--pairs_datasets", "amqa,gpqa"]) == 0
    assert (out / "dpo.jsonl").read_bytes() == first


def test_cli_flips_without_records_is_one_clear_error(tmp_path, capsys):
    from flipguard.pipeline.cli import main as cli

    code = cli(["pairs", "recipes/tiny.yaml", "--out", str(tmp_path / "p"), "--pairs_strategy", "flips",
                "--records", str(tmp_path / "missing")])
    assert code == 2
    assert "flipguard eval --split train" in capsys.readouterr().err


# ---------------------------------------------------------------- prompt length policy (Table 37: 768 tokens)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def digit_row(n_digits: int, name: str) -> P.PairRow:
    content = ("0123456789" * 10)[:n_digits]
    return P.PairRow(prompt=(("user", content),), target="1", item_id=name, dataset="amqa", case="c2_correct",
                     mitigation="none")


def test_prompt_tokens_are_hand_countable(tiny_tokenizer):
    """The embedded tokenizer's Qwen2 pre-tokenizer splits digits one by one, so a user turn
    of n digits is n tokens plus the ChatML frame: <|im_start|> user \\n ... <|im_end|> \\n
    <|im_start|> assistant \\n = 8 tokens."""
    ids = P.chat_token_ids(tiny_tokenizer, digit_row(30, "x").messages)
    assert tiny_tokenizer.convert_ids_to_tokens(ids) == (
        ["<|im_start|>", "user", "Ċ"] + list("0123456789" * 3) + ["<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"])


def test_length_policies_on_hand_counted_prompts(tiny_tokenizer):
    rows = [digit_row(10, "a"), digit_row(30, "b"), digit_row(25, "c")]  # 18, 38 and 33 tokens
    limit = 8 + 20
    same, info = P.apply_length_policy(rows, P.LengthPolicy("refuse", limit))
    assert same == rows and info["policy"] == "refuse"

    kept, info = P.apply_length_policy(rows, P.LengthPolicy("drop", limit, tiny_tokenizer, "tiny"))
    assert [r.item_id for r in kept] == ["a"]
    assert (info["over_limit"], info["dropped"], info["longest_prompt_tokens_before"]) == (2, 2, 38)
    assert info["over_limit_per_dataset"] == {"amqa": 2}

    cut, info = P.apply_length_policy(rows, P.LengthPolicy("truncate", limit, tiny_tokenizer, "tiny"))
    # the first 10 (b) and 5 (c) digits go; the end of the prompt stays
    assert [r.prompt[0][1] for r in cut] == ["0123456789", "0123456789" * 2, "56789" + "0123456789" + "01234"]
    assert [len(P.chat_token_ids(tiny_tokenizer, r.messages)) for r in cut] == [18, 28, 28]
    assert (info["over_limit"], info["truncated"], info["dropped_untruncatable"]) == (2, 2, 0)

    # a limit below the frame itself cannot be met by cutting the user turn: dropped, counted
    cut, info = P.apply_length_policy(rows, P.LengthPolicy("truncate", 7, tiny_tokenizer, "tiny"))
    assert cut == [] and (info["over_limit"], info["truncated"], info["dropped_untruncatable"]) == (3, 0, 3)


def test_length_policy_needs_a_limit_and_a_tokenizer(tiny_tokenizer):
    with pytest.raises(P.UserError, match="needs pairs.max_prompt_length"):
        P.LengthPolicy("truncate", None, tiny_tokenizer)
    with pytest.raises(P.UserError, match="needs a tokenizer"):
        P.LengthPolicy("drop", 10)
    with pytest.raises(P.UserError, match="must be one of"):
        P.LengthPolicy("shorten", 10, tiny_tokenizer)


def test_cli_truncate_policy_is_counted_and_every_prompt_fits(tmp_path, tiny_model_path, tiny_tokenizer):
    from flipguard.pipeline.cli import main as cli
    from flipguard.train.utils import check_pair_lengths

    out = tmp_path / "pairs"
    args = ["pairs", "recipes/tiny.yaml", "--out", str(out), "--pairs_datasets", "amqa,gpqa",
            "--pairs_length_policy", "truncate", "--pairs_max_prompt_length", "120", "--pairs_tokenizer", tiny_model_path]
    assert cli(args) == 0
    length = json.loads((out / "counts.json").read_text())["prompt_length"]
    assert length["policy"] == "truncate" and length["max_prompt_length"] == 120
    assert length["over_limit"] > 0 and length["truncated"] == length["over_limit"]
    rows = [json.loads(line) for line in (out / "dpo.jsonl").read_text().splitlines()]
    assert max(len(P.chat_token_ids(tiny_tokenizer, r["prompt"])) for r in rows) <= 120
    assert all(r["prompt"][-1]["content"].endswith("Return exactly one of: 1 or 2. No extra text.") for r in rows)
    from datasets import load_from_disk

    # the trainers' own check now passes at max_length = 120 + the 3-token completion
    check_pair_lengths(load_from_disk(str(out / "dpo")), tiny_tokenizer, 123, "dpo")
