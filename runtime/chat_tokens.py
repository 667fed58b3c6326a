"""Conversations as the model sees them: token ids under its chat template, no extra special
tokens. The pair builder counts prompt lengths with them and the trainers tokenize their pair sets
with them, so both count the same tokens."""

from __future__ import annotations


def chat_token_ids(tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of messages as the trainers see them (chat template, no extra specials)."""
    return batch_chat_token_ids(tokenizer, [messages], add_generation_prompt)[0]


def batch_chat_token_ids(tokenizer, conversations, add_generation_prompt: bool = True) -> list[list[int]]:
    """chat_token_ids of many conversations, tokenized in one batched call (the demo's 3,803 SFT
    pairs: 6.1 s against 8.0 s one call per conversation, at load)."""
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=add_generation_prompt)
             for m in conversations]
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
