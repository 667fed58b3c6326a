"""Pair sets tokenized once, exactly as TRL tokenizes them, and handed to TRL tokenized.

flipguard reads every pair's token lengths before training (a pair over max_length is refused, not
truncated), and TRL then rendered and tokenized every conversation again, one row at a time: on
the demo's 3,803 pairs that was most of a trainer's start-up. Here each prompt and each
prompt + reply is rendered with the chat template and tokenized in one batched call, and the
columns TRL's own preparation would write are computed from them: for SFT `input_ids` and `labels`
(the reply's tokens, -100 elsewhere: the loss on the answer and its end of turn only), for DPO
`prompt_ids`, `chosen_ids`, `rejected_ids` (the reply starts where the tokenized prompt and
prompt + reply part, TRL's rule). tests/test_train_speed.py checks them against TRL's own
preparation of the same pairs.
"""

from __future__ import annotations

from typing import Any

from flipguard.runtime.chat_tokens import batch_chat_token_ids

# the columns TRL's preparation of each pair kind writes (a dataset holding them is not prepared again)
TOKEN_COLUMNS = {"sft": ("input_ids", "labels"), "dpo": ("prompt_ids", "chosen_ids", "rejected_ids")}


def token_columns(dataset, tokenizer, kind: str) -> dict[str, list[list[int]]]:
    """TRL's token columns of a conversational pair set of `kind` ("sft": prompt/completion,
    "dpo": prompt/chosen/rejected)."""
    from trl.data_utils import common_prefix_length  # TRL's own rule for where a reply starts

    prompts = dataset["prompt"]
    prompt_ids = batch_chat_token_ids(tokenizer, prompts, True)
    replies = ("completion",) if kind == "sft" else ("chosen", "rejected")
    full = {col: batch_chat_token_ids(tokenizer, [p + r for p, r in zip(prompts, dataset[col])], False) for col in replies}
    if kind == "sft":
        ids, labels = [], []
        for p, f in zip(prompt_ids, full["completion"]):
            n = common_prefix_length(p, f)
            ids.append(f)
            labels.append([-100] * n + f[n:])
        return {"input_ids": ids, "labels": labels}
    out: dict[str, list[list[int]]] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for p, c, r in zip(prompt_ids, full["chosen"], full["rejected"]):
        n = min(common_prefix_length(p, c), common_prefix_length(p, r))
        out["prompt_ids"].append(p[:n])
        out["chosen_ids"].append(c[n:])
        out["rejected_ids"].append(r[n:])
    return out


def with_token_columns(dataset, columns: dict[str, list[list[int]]], tokenizer):
    """The pair set with its token columns added (its other columns kept for the records). Its
    fingerprint is derived from the pair set's and the tokenizer's, not hashed from a million token
    ids (datasets' default: seconds of pickling on the demo's pairs)."""
    from datasets.fingerprint import Hasher

    for name, values in columns.items():
        fingerprint = Hasher.hash((dataset._fingerprint, name, getattr(tokenizer, "name_or_path", None)))
        dataset = dataset.add_column(name, values, new_fingerprint=fingerprint)
    return dataset


def sequence_lengths(columns: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    """Per pair, the prompt's tokens and each whole sequence's (prompt + reply)."""
    if "input_ids" in columns:
        return {"prompt": [sum(1 for x in lab if x == -100) for lab in columns["labels"]],
                "completion": [len(ids) for ids in columns["input_ids"]]}
    prompts = [len(p) for p in columns["prompt_ids"]]
    return {"prompt": prompts,
            "chosen": [n + len(c) for n, c in zip(prompts, columns["chosen_ids"])],
            "rejected": [n + len(r) for n, r in zip(prompts, columns["rejected_ids"])]}


def is_tokenized(dataset, kind: str) -> bool:
    return all(c in dataset.column_names for c in TOKEN_COLUMNS[kind])


def dpo_trainer_class():
    """TRL's DPOTrainer taking a pair set tokenized here as prepared (TRL's own preparation
    tokenizes every row again; any other dataset goes through it as before)."""
    from trl import DPOTrainer

    class TokenizedDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name: str) -> Any:
            if not getattr(self, "_is_vision_dataset", False) and is_tokenized(dataset, "dpo"):
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    TokenizedDPOTrainer.__name__ = TokenizedDPOTrainer.__qualname__ = "DPOTrainer"
    return TokenizedDPOTrainer
