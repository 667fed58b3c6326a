"""transformers in-process backend (CPU or GPU), batched with left padding.

Single-token answers are scored from one forward pass, as lm-eval-harness does: the
logits at the last prompt position give P("1") and P("2") together; a token prefix that
several prompts of a call share is computed once and its keys/values reused (prefix.py;
`prefix_sharing=False` turns it off). An un-merged
LoRA adapter can be evaluated directly (transformers + peft), also on a quantized base
(`quantization_config`, e.g. the 4-bit base an adapter was trained on).
"""

from __future__ import annotations

from typing import Sequence

from tqdm.auto import tqdm

from flipguard.eval.backends import prefix
from flipguard.eval.backends.base import (
    Backend,
    BackendError,
    Conversation,
    GenerationConfig,
    backend_label_ids,
    check_chat_template,
    context_limit,
    raw_prompt,
    register_backend,
)
from flipguard.eval.parallel import data_parallel
from flipguard.runtime.adapters import FOREIGN_ADAPTER_ARGS, load_peft_adapter
from flipguard.runtime.threads import cpu_kernels


def _progress(total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="req", leave=False, disable=total < 2)


def default_device() -> str:
    """cuda (this rank's GPU under data-parallel `accelerate launch`), else cpu."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"

    dp = data_parallel()
    return "cuda" if dp is None else f"cuda:{dp.local_process_index}"


@register_backend("hf")
class HFBackend(Backend):
    name = "hf"

    def __init__(
        self,
        model: str,
        device: str | None = None,
        batch_size: int = 8,
        dtype: str = "auto",
        adapter: str | None = None,
        trust_remote_code: bool = False,
        show_progress: bool = True,
        quantization_config=None,
        foreign_adapter: bool = False,
        prefix_sharing: bool = True,
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_id = model if adapter is None else f"{model}+{adapter}"
        self.batch_size = max(1, int(batch_size))
        self.show_progress = show_progress
        self.device = device or default_device()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
            torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
            # straight onto the GPU, not read into CPU memory first and then copied (a 7B: 15 GB twice)
            on_gpu = quantization_config is None and str(self.device).startswith("cuda")
            self.model = AutoModelForCausalLM.from_pretrained(
                model, dtype=torch_dtype, trust_remote_code=trust_remote_code, quantization_config=quantization_config,
                **({"device_map": {"": self.device}} if on_gpu else {})
            )
        except (OSError, ValueError) as exc:
            raise BackendError(
                f"could not load model {model!r} with transformers: {' '.join(str(exc).split())} "
                "Pass a local folder, or a hub id that is cached or reachable "
                "(`flipguard tiny-model` builds an offline test model)."
            ) from None
        if adapter:
            self.model = load_peft_adapter(self.model, adapter, foreign_ok=foreign_adapter,
                                           foreign_flag=FOREIGN_ADAPTER_ARGS)
        if quantization_config is None:  # bitsandbytes places quantized weights itself
            self.model.to(self.device)
        self._ready(prefix_sharing)

    @classmethod
    def from_model(cls, model, tokenizer, model_id: str, device: str = "cpu", batch_size: int = 8,
                   show_progress: bool = False, prefix_sharing: bool = True) -> "HFBackend":
        """A backend on a model already in memory, where it is (a build measuring the weights it is
        training at its held-out checks: nothing loaded, saved or copied). The tokenizer is set up as
        the backend needs it (left padding, a pad token)."""
        self = cls.__new__(cls)
        self.model_id, self.model, self.tokenizer = model_id, model, tokenizer
        self.batch_size, self.show_progress, self.device = max(1, int(batch_size)), show_progress, device
        self._ready(prefix_sharing)
        return self

    def _ready(self, prefix_sharing: bool) -> None:
        """What every backend sets up once its model and tokenizer are loaded."""
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.eval()
        # the most tokens one prompt (+ reply) may have; checked before any forward pass
        self.max_context, self.max_context_source = context_limit(getattr(self.model, "config", None), self.tokenizer)
        self._lengths: dict[str, int] = {}
        # what this backend actually computes with, for run.json (the runner reads it)
        self.computed: dict = {"backend": self.name, "dtype": str(self.model.dtype).removeprefix("torch."),
                               "device": str(self.device)}
        if str(self.device) == "cpu":  # the kernels that rounded (bench/demo_fp_path.md)
            self.computed["cpu_kernels"] = cpu_kernels()
        # logprob mode: each shared token prefix of a call computed once (prefix.py); run.json
        # says whether it was on, and why not where the model's cache cannot be shared
        refusal = prefix.sharing_refusal(self.model) if prefix_sharing else None
        self.prefix_sharing = bool(prefix_sharing) and refusal is None
        self.computed["prefix_sharing"] = self.prefix_sharing
        if refusal:
            self.computed["prefix_sharing_off"] = refusal

    def render(self, conversation: Conversation) -> str:
        """The exact text the model sees, chat template applied, ready for the reply. A raw
        prompt gets only what `tokenizer(text)` would add (a BOS token, for some models)."""
        text = raw_prompt(conversation)
        if text is not None:
            special = self.tokenizer("", add_special_tokens=True).input_ids
            return (self.tokenizer.decode(special) if special else "") + text
        check_chat_template(self.tokenizer, self.model_id)
        return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)

    def _length(self, text: str) -> int:
        n = self._lengths.get(text)
        if n is None:
            n = self._lengths[text] = len(self.tokenizer(text, add_special_tokens=False).input_ids)
        return n

    def prompt_lengths(self, conversations: Sequence[Conversation]) -> list[int]:
        """Token count of each rendered prompt (tokenizer only, no forward pass)."""
        return [self._length(self.render(c)) for c in conversations]

    def _batches(self, conversations: Sequence[Conversation]):
        """Length-sorted batches (less padding); yields (original indices, encodings)."""
        texts = [self.render(c) for c in conversations]
        lengths = [self._length(t) for t in texts]
        self._lengths.clear()
        order = sorted(range(len(texts)), key=lambda i: -lengths[i])
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            enc = self.tokenizer(
                [texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(self.device)
            yield idx, enc

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig) -> list[str]:
        import torch

        out: list[str | None] = [None] * len(conversations)
        kwargs = dict(max_new_tokens=config.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id)
        if config.temperature is not None:  # None: the model's generation_config decides
            kwargs["do_sample"] = config.temperature > 0
            if config.temperature > 0:
                kwargs.update(temperature=config.temperature, top_p=config.top_p)
        if config.ignore_eos:
            kwargs.update(min_new_tokens=config.max_new_tokens)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        with _progress(len(conversations) if self.show_progress else 0, "generate") as bar, torch.inference_mode():
            for idx, enc in self._batches(conversations):
                gen = self.model.generate(**enc, **kwargs)
                new = gen[:, enc["input_ids"].shape[1] :]
                for i, row in zip(idx, new):
                    out[i] = self.tokenizer.decode(row, skip_special_tokens=True)
                bar.update(len(idx))
        return [o or "" for o in out]

    def choice_token_ids(self, choices: Sequence[str], prompt: str | None = None) -> list[list[int]]:
        """Per label, the ids of every token that is the label (base.backend_label_ids)."""
        return backend_label_ids(self, choices, prompt)

    def _count_first_tokens(self, ids: list[int]) -> None:
        """The most likely first token of each judgment, counted for run.json: what a model
        that puts little mass on the labels says instead (the report names them)."""
        counts = self.computed.setdefault("first_tokens", {})
        for text in self.tokenizer.batch_decode([[i] for i in ids]):
            counts[text] = counts.get(text, 0) + 1

    def _label_probs(self, logits, flat: list[int], groups, choices) -> list[dict[str, float]]:
        """{label: P(label)} per row of last-position logits (float32, full vocabulary)."""
        import torch

        self._count_first_tokens(logits.argmax(dim=-1).tolist())
        out = []
        for row in torch.softmax(logits, dim=-1)[:, flat].cpu().tolist():
            p, pos = {}, 0
            for choice, g in zip(choices, groups):
                p[choice] = float(sum(row[pos:pos + len(g)]))
                pos += len(g)
            out.append(p)
        return out

    def choice_probs(self, conversations: Sequence[Conversation], choices: Sequence[str] = ("1", "2")) -> list[dict[str, float]]:
        import torch

        groups = self.choice_token_ids(choices, self.render(conversations[0]) if conversations else None)
        flat = [i for g in groups for i in g]
        out: list[dict[str, float] | None] = [None] * len(conversations)
        with _progress(len(conversations) if self.show_progress else 0, "score") as bar, torch.inference_mode():
            tops = self._sharing_plan(conversations) if self.prefix_sharing else None
            if tops is not None:
                def take(ends: list[int], logits) -> None:
                    p = self._label_probs(logits[None, :], flat, groups, choices)[0]
                    for i in ends:
                        out[i] = dict(p)
                    if len(ends) > 1:  # identical prompts: one row, counted once per judgment
                        self._count_first_tokens([int(logits.argmax())] * (len(ends) - 1))
                    bar.update(len(ends))

                prefix.score_last_logits(self.model, tops, batch_size=self.batch_size,
                                         pad_id=self.tokenizer.pad_token_id, device=self.device, on_logits=take)
                return out  # type: ignore[return-value]
            for idx, enc in self._batches(conversations):
                # Only the last position's logits: a full (batch, length, vocab) tensor
                # is gigabytes on a real model and is never used.
                logits = self.model(**enc, logits_to_keep=1).logits[:, -1, :].float()
                for i, p in zip(idx, self._label_probs(logits, flat, groups, choices)):
                    out[i] = p
                bar.update(len(idx))
        return out  # type: ignore[return-value]

    def _sharing_plan(self, conversations: Sequence[Conversation]) -> list | None:
        """The prefix tree of the call's prompts (prefix.plan), counted in run.json; None when no
        prefix is worth sharing (then the plain batches run, as with sharing off)."""
        texts = [self.render(c) for c in conversations]
        seqs = self.tokenizer(texts, add_special_tokens=False).input_ids
        tops = prefix.plan(seqs)
        stats = self.computed.setdefault("prefix_tokens", {"prompt": 0, "computed": 0})
        stats["prompt"] += sum(len(s) for s in seqs)
        if not prefix.shares(tops):
            stats["computed"] += sum(len(s) for s in seqs)
            return None
        stats["computed"] += prefix.computed_tokens(tops)
        return tops
