"""A tiny random-init chat model that is built locally, so everything runs offline.

It has the Qwen2 architecture (the same q/k/v/o/gate/up/down projections the QLoRA
recipes target) with head_dim 32 (vLLM's CPU attention refuses 16), a byte-level BPE
tokenizer trained here on the prompt templates, the shipped sample and the organism's
domain, in which "1", "2" and the option letters are single tokens, and a ChatML chat
template. The tokenizer uses Qwen2's own pre-tokenizer, so `tokenizers` and
transformers' Qwen2Tokenizer encode every text identically (real servers agree with the
hf backend). Its judgments are noise; it exists to exercise the real loading,
evaluation and training code paths end to end on a CPU. The planted-bias organism
(flipguard.organism) is the same architecture and tokenizer, trained.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from flipguard.config import parse_dataclasses
from flipguard.data import organism_datasets
from flipguard.data.roots import SAMPLES_ROOT
from flipguard.data.schema import Item
from flipguard.eval.dds import prompts
from flipguard.eval.records import CASES
from flipguard.eval.task import DEFAULT_MODEL, RANDOM_INIT_MODELS
from flipguard.files import (
    flipguard_home,
    staging_dir,
)
from flipguard.publish import publish_dir
from flipguard.runtime.threads import THREADS_HELP, configure_threads

TINY_MODEL_VERSION = "v2"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SINGLE_TOKEN_ANSWERS = ["1", "2"] + [chr(c) for c in range(ord("A"), ord("K"))]
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2.5): digits one by one.
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TOKENIZER_VOCAB_SIZE = 4096


@dataclasses.dataclass
class TinyModelArgs:
    """Create the tiny local chat model (cached: a second call returns at once)."""

    path: str | None = dataclasses.field(
        default=None, metadata={"help": "Where to create it (default: $FLIPGUARD_HOME/tiny-chat-v1 or ~/.cache/flipguard/tiny-chat-v1)."}
    )
    vocab_size: int = dataclasses.field(default=4096, metadata={"help": "BPE vocabulary size."})
    hidden_size: int = dataclasses.field(default=64, metadata={"help": "Model width (head_dim is 32: width / 32 heads)."})
    num_hidden_layers: int = dataclasses.field(default=2, metadata={"help": "Transformer layers."})
    seed: int = dataclasses.field(default=0, metadata={"help": "Seed for tokenizer corpus order and weight init."})
    force: bool = dataclasses.field(default=False, metadata={"help": "Rebuild even if it exists."})
    threads: int | None = dataclasses.field(default=None, metadata={"help": THREADS_HELP})


def default_tiny_model_path() -> Path:
    return flipguard_home() / f"tiny-chat-{TINY_MODEL_VERSION}"


def _corpus() -> list[str]:
    """Template text, every string in the shipped sample and the organism's domain."""
    texts = [prompts.JSON_TAIL, prompts.ONE_TOKEN_TAIL, prompts.BE_HONEST_SYSTEM, prompts.DEHUMANIZING_SYSTEM]
    for t in prompts.TEMPLATES.values():
        texts += [str(v) for v in dataclasses.asdict(t).values() if v]
    for path in sorted(SAMPLES_ROOT.rglob("*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                texts += [v for v in row.values() if isinstance(v, str)]
    return texts + organism_datasets.tokenizer_corpus() + _rendered_prompts()


# The prompt pools the embedded tokenizer is trained on (and the organism on top of it),
# pinned so that templates or label sets added to eval/dds/prompts.py later do not change
# either build under the same cache name.
EMBEDDED_TEMPLATES = ("v0", "v1", "v2", "v3", "v0-released")
EMBEDDED_LABEL_SETS = ("speaker", "ab", "qa", "john_jane", "jane_john", "john_soroush", "soroush_john",
                       "user_llm", "llm_user", "gpt4o_llama", "llama_gpt4o", "ai_agent")


def _rendered_prompts() -> list[str]:
    """Every prompt shape the evaluation sends (cases x templates x mitigations x labels x
    formats, chat template applied) for a few items: weighted like real traffic, so the
    fixed prompt text becomes a few long tokens and sequences stay short."""
    items = organism_datasets.claim_items()["organism"][:2] + [
        Item(id="x", dataset="x", question="What is the capital of France?", correct_answer="Paris", incorrect_answer="Lyon")
    ]
    out = []
    for item in items:
        for case in CASES:
            for template in EMBEDDED_TEMPLATES:
                for mitigation in prompts.MITIGATIONS:
                    for speakers in (prompts.SPEAKER_SETS[name] for name in EMBEDDED_LABEL_SETS):
                        for fmt in prompts.OUTPUT_FORMATS:
                            msgs = prompts.build_messages(item, case, mitigation, speakers, template, fmt)
                            out.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
                                       + "<|im_start|>assistant\n")
    return out


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """The embedded byte-level BPE tokenizer (deterministic for a given corpus)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    for ans in SINGLE_TOKEN_ANSWERS:
        ids = fast.encode(ans, add_special_tokens=False)
        assert len(ids) == 1, f"answer {ans!r} is not a single token: {ids}"
    return fast


def new_model(tokenizer, hidden_size: int = 64, num_hidden_layers: int = 2, intermediate_size: int | None = None):
    """A random-init Qwen2 chat model with head_dim 32 for this tokenizer."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % 32:
        raise ValueError(f"hidden_size must be a multiple of 32 (head_dim 32), got {hidden_size}")
    heads = hidden_size // 32
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 4,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=32,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    return model


def ensure_tiny_model(path: str | os.PathLike | None = None, **overrides) -> str:
    """Create the model once (atomically: built in a temp folder, then renamed)."""
    args = TinyModelArgs(path=str(path) if path else None, **overrides)
    target = Path(args.path) if args.path else default_tiny_model_path()
    if (target / "config.json").exists() and not args.force:
        return str(target)
    import torch
    from transformers.utils import logging as hf_logging

    with staging_dir(target) as tmp:
        tokenizer = build_tokenizer(args.vocab_size)
        torch.manual_seed(args.seed)
        model = new_model(tokenizer, args.hidden_size, args.num_hidden_layers)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a first use builds it inside any command: no save bar in its output
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(
            "# flipguard tiny-chat\n\nRandom-init Qwen2-architecture model with a locally trained "
            "byte-level BPE tokenizer and a ChatML template. Built by `flipguard tiny-model`; "
            "for tests and the offline demo only: its answers are noise.\n",
            encoding="utf-8",
        )

        publish_dir(tmp, target, writer="flipguard tiny-model", last=["config.json"])
    return str(target)


# the names every protocol's default answers to (eval/task.py: a run of it says first that its numbers are noise)
TINY_MODEL_ALIAS = DEFAULT_MODEL
TINY_MODEL_ALIASES = RANDOM_INIT_MODELS


def main(argv: list[str]) -> int:
    args = parse_dataclasses(argv, TinyModelArgs, prog="flipguard tiny-model", description=TinyModelArgs.__doc__)
    settings = dataclasses.asdict(args)
    configure_threads(settings.pop("threads"))
    path = ensure_tiny_model(**settings)
    print(path)
    return 0
