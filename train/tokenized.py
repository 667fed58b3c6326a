"""Pair sets tokenized once, exactly as TRL tokenizes them, and handed to TRL tokenized.

flipguard reads every pair's token lengths before training (a pair over max_length is refused, not
truncated), and TRL then rendered and tokenized every conversation again, one row at a time: on
the demo's 3,803 pairs that was most of a trainer's start-up. Here each prompt and each
prompt + reply is rendered with the chat template and tokenized in one batched call (`rendered`);
the lengths come from those ids, and a trainer that declares a `tokenize` (config/trainers.py)
lays them out as the columns TRL's own preparation would write (train/sft.py: input_ids and
labels; train/dpo.py: prompt_ids, chosen_ids, rejected_ids). tests/test_train_speed.py checks
them against TRL's own preparation of the same pairs.
"""

from __future__ import annotations

from flipguard.data.pair_sets import reply_columns
from flipguard.runtime.chat_tokens import batch_chat_token_ids


def rendered(dataset, tokenizer, kind: str) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """Each prompt's token ids (chat template, generation prompt) and, per reply column of a pair set
    of `kind`, each prompt + reply's: whole columns, one batched tokenizer call each."""
    prompts = dataset["prompt"]
    prompt_ids = batch_chat_token_ids(tokenizer, prompts, True)
    return prompt_ids, {col: batch_chat_token_ids(tokenizer, [p + r for p, r in zip(prompts, dataset[col])], False)
                        for col in reply_columns(kind)}


def sequence_lengths(prompt_ids: list[list[int]], full: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    """Per pair, the prompt's tokens and each whole sequence's (prompt + reply)."""
    return {"prompt": [len(p) for p in prompt_ids], **{col: [len(ids) for ids in seqs] for col, seqs in full.items()}}


def token_columns(dataset, tokenizer, trainer) -> dict[str, list[list[int]]]:
    """The columns `trainer` (a config.Trainer with a `tokenize`) hands TRL, for its kind of pair set."""
    return trainer.tokenize(*rendered(dataset, tokenizer, trainer.pairs))


def with_token_columns(dataset, columns: dict[str, list[list[int]]], tokenizer):
    """The pair set with its token columns added (its other columns kept for the records). Its
    fingerprint is derived from the pair set's and the tokenizer's, not hashed from a million token
    ids (datasets' default: seconds of pickling on the demo's pairs)."""
    from datasets.fingerprint import Hasher

    for name, values in columns.items():
        fingerprint = Hasher.hash((dataset._fingerprint, name, getattr(tokenizer, "name_or_path", None)))
        dataset = dataset.add_column(name, values, new_fingerprint=fingerprint)
    return dataset


def has_columns(dataset, columns) -> bool:
    return all(c in dataset.column_names for c in columns)
