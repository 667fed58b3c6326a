"""vLLM offline engine backend (optional extra `flipguard[vllm]` on GPU; vLLM's CPU build: .ci/vllm).

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
with `enable_lora` and a LoRARequest; `max_lora_rank` comes from the adapter's own
adapter_config.json (its largest rank, rounded up to a rank vLLM accepts), and an adapter
vLLM would not apply faithfully is refused before the engine loads (`lora_refusal`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from flipguard.eval.backends.base import (
    Backend,
    BackendError,
    Conversation,
    GenerationConfig,
    backend_label_ids,
    check_chat_template,
    raw_prompt,
    register_backend,
)
from flipguard.runtime.adapters import read_adapter

INSTALL_HINT = ("vLLM is not installed: pip install 'flipguard[vllm]' on a GPU machine; on CPU, vLLM's CPU build "
                "in its own environment (docs/serving.md, .ci/vllm)")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default engine cap on logprobs per token
# vLLM's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks in 0.32; read from the
# installed vLLM when it has them)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM applies LoRA to linear layers (vllm.lora.utils.get_supported_lora_modules); to input and
# output embeddings only on models whose vLLM class declares `embedding_modules` (in 0.32 Llama
# and Qwen3 do, Qwen2 does not); modules_to_save (full copies of a layer) only as a classifier head.
EMBEDDING_MODULES = frozenset({"embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out",
                               "word_embeddings", "tok_embeddings"})
CLASSIFIER_MODULES = frozenset({"classifier", "score"})


def vllm_lora_ranks() -> tuple[int, ...]:
    """The max_lora_rank values the installed vLLM accepts (VLLM_LORA_RANKS without vLLM)."""
    try:
        from vllm.config.lora import MaxLoRARanks

        ranks = tuple(sorted(int(r) for r in typing.get_args(MaxLoRARanks)))
        return ranks or VLLM_LORA_RANKS
    except (ImportError, AttributeError, TypeError, ValueError):
        return VLLM_LORA_RANKS


def adapter_max_lora_rank(config: Mapping[str, Any], ranks: Sequence[int] = VLLM_LORA_RANKS,
                          where: str = "adapter") -> int:
    """max_lora_rank for an adapter: its largest rank (`r` and every `rank_pattern` value),
    rounded up to the next rank vLLM accepts (vLLM pads a smaller adapter to it)."""
    try:
        largest = max([int(config["r"]), *(int(v) for v in (config.get("rank_pattern") or {}).values())])
    except (KeyError, TypeError, ValueError):
        raise BackendError(f"{where}: adapter_config.json has no integer LoRA rank 'r'") from None
    fitting = [r for r in sorted(ranks) if r >= largest]
    if largest < 1 or not fitting:
        raise BackendError(f"{where}: LoRA rank {largest} is outside what vLLM serves (max_lora_rank "
                           f"{min(ranks)}..{max(ranks)})")
    return fitting[0]


def lora_module_names(weight_names: Iterable[str]) -> set[str]:
    """The module each LoRA tensor adapts, from peft's names
    ('base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> 'q_proj',
    'base_model.model.model.embed_tokens.lora_embedding_A' -> 'embed_tokens')."""
    names = set()
    for name in weight_names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.startswith(("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")) and i > 0:
                names.add(parts[i - 1])
                break
    return names


def lora_refusal(config: Mapping[str, Any], weight_names: Iterable[str],
                 embedding_modules: Iterable[str] = ()) -> list[str]:
    """What of this adapter vLLM's LoRA support does not cover (empty: servable): adapted
    embedding modules the model's vLLM class does not declare (`embedding_modules`),
    modules_to_save other than a classifier head, and the LoRA variants vLLM rejects (DoRA,
    LoRA bias). A refusal here is cheaper and clearer than vLLM's error at the first
    request, after the engine has loaded."""
    problems = []
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or ())
    embedded = sorted(((lora_module_names(weight_names) | set(targets)) & EMBEDDING_MODULES) - set(embedding_modules))
    if embedded:
        problems.append(f"LoRA on embedding modules {', '.join(embedded)}")
    saved = sorted(set(config.get("modules_to_save") or ()) - CLASSIFIER_MODULES)
    if saved:
        problems.append(f"modules_to_save {', '.join(saved)}")
    if config.get("use_dora"):
        problems.append("DoRA (use_dora)")
    if config.get("lora_bias") or config.get("bias", "none") != "none":
        problems.append("LoRA bias")
    return problems


def vllm_embedding_modules(model: str) -> set[str]:
    """The embedding modules the installed vLLM adapts with LoRA for `model`'s architecture
    (its class's `embedding_modules`); empty when vLLM or the architecture is unknown here."""
    try:
        from transformers import AutoConfig
        from vllm.model_executor.models import ModelRegistry

        found: set[str] = set()
        for arch in getattr(AutoConfig.from_pretrained(model), "architectures", None) or ():
            cls = ModelRegistry._try_load_model_cls(arch)
            found |= set(getattr(cls, "embedding_modules", None) or ())
        return found
    except Exception:  # noqa: BLE001 - an older/newer vLLM layout: vLLM's own check still applies
        return set()


def check_adapter_for_vllm(adapter: str | Path, max_lora_rank: int | None = None,
                           embedding_modules: Iterable[str] = ()) -> int:
    """The max_lora_rank to serve `adapter` with, or a one-line BackendError naming the
    adapter and what vLLM cannot serve of it."""
    config, names = read_adapter(adapter)
    problems = lora_refusal(config, names, embedding_modules)
    if problems:
        raise BackendError(f"adapter {adapter}: vLLM's LoRA support does not cover {'; '.join(problems)} "
                           "(merge it with train/merge.py and serve the merged model, or use --backend hf)")
    ranks = vllm_lora_ranks()
    needed = adapter_max_lora_rank(config, ranks, where=f"adapter {adapter}")
    if max_lora_rank is None:
        return needed
    if int(max_lora_rank) < needed:
        raise BackendError(f"adapter {adapter}: max_lora_rank {max_lora_rank} is below the adapter's rank "
                           f"(needs {needed}); leave max_lora_rank out to take it from the adapter")
    return int(max_lora_rank)


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
    """P(choice) = sum of exp(logprob) over the choice's token ids (every token that is the
    label, base.label_token_ids) from one position's {token_id: Logprob};
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


def model_dtype(model: str) -> str:
    """The dtype a checkpoint's config.json declares (float32 when it declares none, as
    transformers loads it)."""
    from transformers import AutoConfig

    try:
        dtype = getattr(AutoConfig.from_pretrained(model), "dtype", None)
    except (OSError, ValueError):
        return "auto"  # vLLM's own error about the model follows
    return str(dtype or "float32").removeprefix("torch.")


# vLLM's own parallelism, passed through --backend_args / a recipe's eval.backend_args to vllm.LLM:
# GPUs per model copy (tensor), model copies (data), pipeline stages, and what starts the workers
PARALLEL_ARGS = ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size", "distributed_executor_backend")
EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")


def engine_fields() -> frozenset[str] | None:
    """The settings the installed vLLM's engine takes (vllm.EngineArgs fields); None without vLLM."""
    try:
        from vllm import EngineArgs

        return frozenset(f.name for f in dataclasses.fields(EngineArgs))
    except (ImportError, TypeError):
        return None


def build_engine_kwargs(model: str, dtype: str, seed: int, trust_remote_code: bool, extra: dict[str, Any],
                        fields: frozenset[str] | None = None) -> dict[str, Any]:
    """The keyword arguments of vllm.LLM: flipguard's settings plus the backend args (checked:
    a parallel size is an integer >= 1, the executor one vLLM knows), the error naming the key.
    Automatic prefix caching is asked for where the engine has the setting (`fields`: its
    EngineArgs names), unless the backend args set it: DDS's four cases and AFR's challenges
    share most of their prompt, and cached prefixes change no logprob."""
    for key in PARALLEL_ARGS[:3]:
        value = extra.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BackendError(f"--backend_args {key}: {value!r} must be an integer >= 1")
    executor = extra.get("distributed_executor_backend")
    if executor is not None and executor not in EXECUTOR_BACKENDS:
        raise BackendError(f"--backend_args distributed_executor_backend: {executor!r} is not one of "
                           f"{', '.join(EXECUTOR_BACKENDS)} (multi-node: ray)")
    kwargs = dict(model=model, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code, **extra)
    if fields is not None and PREFIX_CACHING in fields:
        kwargs.setdefault(PREFIX_CACHING, True)
    return kwargs


PREFIX_CACHING = "enable_prefix_caching"


def prefix_caching(llm: Any, kwargs: dict[str, Any]) -> bool | None:
    """Whether the engine caches prefixes, as its cache config says (what was asked for when it
    does not say; None: neither), for run.json."""
    config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    value = getattr(config, PREFIX_CACHING, None)
    value = kwargs.get(PREFIX_CACHING) if value is None else value
    return None if value is None else bool(value)


def parallelism(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The parallel layout an engine was asked for (vLLM's defaults where unset), for run.json."""
    defaults = {"tensor_parallel_size": 1, "data_parallel_size": 1, "pipeline_parallel_size": 1,
                "distributed_executor_backend": None}
    return {k: kwargs.get(k, v) for k, v in defaults.items()}


@register_backend("vllm")
class VLLMBackend(Backend):
    name = "vllm"

    def __init__(
        self,
        model: str,
        adapter: str | None = None,
        max_lora_rank: int | None = None,  # default: from the adapter (check_adapter_for_vllm)
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
        # "auto" is the model's own dtype (config.json), passed explicitly: vLLM's own "auto"
        # runs a float32 checkpoint in bfloat16 on CPU, silently (not the precision the model was saved in)
        dtype = model_dtype(model) if dtype == "auto" else dtype
        kwargs = build_engine_kwargs(model, dtype, seed, trust_remote_code, engine_kwargs, engine_fields())
        self.lora_request = None
        if adapter:
            from vllm.lora.request import LoRARequest

            rank = check_adapter_for_vllm(adapter, max_lora_rank, vllm_embedding_modules(model))
            kwargs.update(enable_lora=True, max_lora_rank=rank)
            self.lora_request = LoRARequest("flipguard-adapter", 1, adapter)
        try:
            self.llm = vllm.LLM(**kwargs)
        except (OSError, ValueError) as exc:
            raise BackendError(f"vLLM could not load model {model!r}: {exc}") from None
        self.tokenizer = self.llm.get_tokenizer()
        engine_dtype = getattr(getattr(getattr(self.llm, "llm_engine", None), "model_config", None), "dtype", dtype)
        # what the engine actually computes in, for run.json (the runner reads it)
        self.computed: dict = {"backend": self.name, "dtype": str(engine_dtype).removeprefix("torch."),
                               "dtype_requested": dtype, "parallel": parallelism(kwargs),
                               "prefix_caching": prefix_caching(self.llm, kwargs)}
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
            if text is None:
                check_chat_template(self.tokenizer, self.model_id)
            out.append(len(self.tokenizer(text).input_ids) if text is not None else
                       len(self.tokenizer.apply_chat_template(list(c), tokenize=True, add_generation_prompt=True)))
        return out

    def _chat(self, conversations: Sequence[Conversation], params) -> list:
        """LLM.chat for chat conversations, LLM.generate for raw prompts; input order kept."""
        raw = [raw_prompt(c) for c in conversations]
        chat_idx = [i for i, t in enumerate(raw) if t is None]
        raw_idx = [i for i, t in enumerate(raw) if t is not None]
        outputs: list = [None] * len(conversations)
        if chat_idx:  # vLLM would fall back to a default template of its own: refused as on hf
            check_chat_template(self.tokenizer, self.model_id)
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

    def choice_token_ids(self, choices: Sequence[str], prompt: str | None = None) -> list[list[int]]:
        """Per label, the ids of every token that is the label (base.backend_label_ids)."""
        return backend_label_ids(self, choices, prompt)

    def render(self, conversation: Conversation) -> str:
        """The text the engine sees (chat template applied; a raw prompt as given)."""
        text = raw_prompt(conversation)
        if text is not None:
            return text
        check_chat_template(self.tokenizer, self.model_id)
        return self.tokenizer.apply_chat_template(list(conversation), tokenize=False, add_generation_prompt=True)

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
        groups = self.choice_token_ids(choices, self.render(conversations[0]))
        outputs = self._chat(conversations, self.label_sampling_params([i for g in groups for i in g]))
        return [probs_from_step_logprobs(first_step_logprobs(o), groups, choices) for o in outputs]
