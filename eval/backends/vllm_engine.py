"""vLLM offline engine backend (GPU machines; optional extra `flipguard[vllm]`).

vLLM is imported only when the backend is built, so this module imports everywhere.
`LLM.chat` applies the model's own chat template and schedules the whole list of
conversations itself (continuous batching), so no batch size is needed here.

Label probabilities: one generated token with logprobs. Newer vLLM takes
`SamplingParams(logprob_token_ids=...)`, which returns the logprobs of exactly the label
tokens, whatever their rank. Older versions do not; then the labels are made the only
allowed tokens (`allowed_token_ids`) and the top `max_logprobs` are asked for. vLLM's
default `logprobs_mode="raw_logprobs"` reports logprobs before that mask, so both routes
give the same unnormalised full-vocabulary P(label) as the hf backend; a label outside
the returned set gets 0.0 (fallback route only). An un-merged LoRA adapter is served
with `enable_lora` and a LoRARequest.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from flipguard.eval.backends.base import (
    BackendError, Conversation, GenerationConfig, label_token_ids, raw_prompt, register_backend,
)

INSTALL_HINT = "vLLM is not installed: pip install 'flipguard[vllm]' (GPU machines only)"
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default engine cap on logprobs per token


def _logprob_value(entry: Any) -> float | None:
    """A vLLM Logprob object (attribute .logprob), a dict or a bare float."""
    if entry is None:
        return None
    if isinstance(entry, (int, float)):
        return float(entry)
    if isinstance(entry, Mapping):
        return entry.get("logprob")
    return getattr(entry, "logprob", None)


def probs_from_step_logprobs(step: Mapping[int, Any] | None, choice_ids: Sequence[int | Sequence[int]],
                             choices: Sequence[str]) -> dict[str, float]:
    """P(choice) = sum of exp(logprob) over the choice's token ids (the label and its
    one-token variants, base.label_token_ids) from one position's {token_id: Logprob};
    missing -> 0.0."""
    out = {}
    for choice, tids in zip(choices, choice_ids):
        total = 0.0
        for tid in ([tids] if isinstance(tids, int) else tids):
            value = _logprob_value((step or {}).get(tid))
            total += math.exp(value) if value is not None and not math.isnan(value) else 0.0
        out[choice] = total
    return out


def first_step_logprobs(request_output: Any) -> Mapping[int, Any] | None:
    """The first generated position's logprobs of a RequestOutput (None if absent)."""
    outputs = getattr(request_output, "outputs", None) or []
    if not outputs:
        return None
    logprobs = getattr(outputs[0], "logprobs", None)
    if not logprobs:
        return None
    return logprobs[0]


@register_backend("vllm")
class VLLMBackend:
    name = "vllm"

    def __init__(
        self,
        model: str,
        adapter: str | None = None,
        max_lora_rank: int = 64,
        dtype: str = "auto",
        seed: int = 0,
        trust_remote_code: bool = False,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        show_progress: bool = True,
        batch_size: int | None = None,  # accepted for a uniform CLI; vLLM schedules batches itself
        device: str | None = None,  # accepted for a uniform CLI; vLLM picks its device
        **engine_kwargs: Any,  # tensor_parallel_size, gpu_memory_utilization, max_model_len, ...
    ):
        try:
            import vllm
        except ImportError:
            raise BackendError(INSTALL_HINT) from None
        self._vllm = vllm
        self.model_id = model if adapter is None else f"{model}+{adapter}"
        self.show_progress = show_progress
        self.max_logprobs = max(1, int(max_logprobs))
        kwargs = dict(model=model, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code, **engine_kwargs)
        self.lora_request = None
        if adapter:
            from vllm.lora.request import LoRARequest

            kwargs.update(enable_lora=True, max_lora_rank=int(max_lora_rank))
            self.lora_request = LoRARequest("flipguard-adapter", 1, adapter)
        try:
            self.llm = vllm.LLM(**kwargs)
        except (OSError, ValueError) as exc:
            raise BackendError(f"vLLM could not load model {model!r}: {exc}") from None
        self.tokenizer = self.llm.get_tokenizer()
        # the engine's max_model_len: an item past it is refused before any request
        try:
            self.max_context = int(self.llm.llm_engine.model_config.max_model_len)
            self.max_context_source = "vLLM max_model_len"
        except (AttributeError, TypeError, ValueError):
            self.max_context = None

    def prompt_lengths(self, conversations: Sequence[Conversation]) -> list[int]:
        """Token count of each prompt as the chat template renders it (raw prompts: as
        `tokenizer(text)` encodes them); no request sent."""
        out = []
        for c in conversations:
            text = raw_prompt(c)
            out.append(len(self.tokenizer(text).input_ids) if text is not None else
                       len(self.tokenizer.apply_chat_template(list(c), tokenize=True, add_generation_prompt=True)))
        return out

    def _chat(self, conversations: Sequence[Conversation], params) -> list:
        """LLM.chat for chat conversations, LLM.generate for raw prompts; input order kept."""
        raw = [raw_prompt(c) for c in conversations]
        chat_idx = [i for i, t in enumerate(raw) if t is None]
        raw_idx = [i for i, t in enumerate(raw) if t is not None]
        outputs: list = [None] * len(conversations)
        if chat_idx:
            got = self.llm.chat([list(conversations[i]) for i in chat_idx], sampling_params=params,
                                use_tqdm=self.show_progress, lora_request=self.lora_request)
            for i, o in zip(chat_idx, got):
                outputs[i] = o
        if raw_idx:
            got = self.llm.generate([raw[i] for i in raw_idx], sampling_params=params,
                                    use_tqdm=self.show_progress, lora_request=self.lora_request)
            for i, o in zip(raw_idx, got):
                outputs[i] = o
        if any(o is None for o in outputs):
            missing = sum(o is None for o in outputs)
            raise BackendError(f"vLLM returned no output for {missing} of {len(conversations)} conversations")
        return outputs

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig) -> list[str]:
        if not conversations:
            return []
        params = dict(
            max_tokens=config.max_new_tokens,
            temperature=config.temperature,
            seed=config.seed,
            ignore_eos=config.ignore_eos,
        )
        if config.temperature is None:  # the model's generation_config defaults, as `vllm serve` uses them
            del params["temperature"]
            params = {**self.model_sampling_defaults(), **params}
        elif config.temperature > 0:
            params["top_p"] = config.top_p
        outputs = self._chat(conversations, self._vllm.SamplingParams(**params))
        return [(o.outputs[0].text if o.outputs else "") or "" for o in outputs]

    def model_sampling_defaults(self) -> dict:
        """The sampling settings the model's generation_config sets (temperature, top_p,
        top_k, ...); {} when this vLLM cannot say (its own defaults then apply)."""
        getter = getattr(getattr(self.llm.llm_engine, "model_config", None), "get_diff_sampling_param", None)
        try:
            return dict(getter()) if callable(getter) else {}
        except (TypeError, ValueError, AttributeError):
            return {}

    def choice_token_ids(self, choices: Sequence[str]) -> list[list[int]]:
        """Per label, its token id and those of its one-token variants (base.label_token_ids)."""
        return label_token_ids(self.tokenizer, choices, self.model_id)

    def label_sampling_params(self, choice_ids: Sequence[int]):
        """One greedy token whose logprobs include the labels (see the module docstring)."""
        SamplingParams = self._vllm.SamplingParams
        base = dict(max_tokens=1, temperature=0.0)
        try:
            return SamplingParams(**base, logprobs=len(choice_ids), logprob_token_ids=list(choice_ids))
        except TypeError:  # vLLM without logprob_token_ids
            return SamplingParams(**base, logprobs=self.max_logprobs, allowed_token_ids=list(choice_ids))

    def choice_probs(self, conversations: Sequence[Conversation], choices: Sequence[str] = ("1", "2")) -> list[dict[str, float]]:
        if not conversations:
            return []
        groups = self.choice_token_ids(choices)
        outputs = self._chat(conversations, self.label_sampling_params([i for g in groups for i in g]))
        return [probs_from_step_logprobs(first_step_logprobs(o), groups, choices) for o in outputs]
