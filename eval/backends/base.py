"""Backends turn chat conversations into text or answer-token probabilities.

A backend knows nothing about tasks (lm-eval-harness style): protocols build the
conversations, backends run them, metrics read the records. Every backend takes whole
batches so that each can batch, parallelise or cache as it sees fit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

from flipguard.errors import FlipguardError

Conversation = list[dict[str, str]]

# A conversation of exactly one message with this role is a plain completion prompt:
# sent as raw text, no chat template (the authors' fine-tuned evaluation did so).
RAW_ROLE = "raw"


def raw_prompt(conversation: Conversation) -> str | None:
    """The text of a raw (no chat template) conversation, else None."""
    if len(conversation) == 1 and conversation[0].get("role") == RAW_ROLE:
        return conversation[0]["content"]
    if any(m.get("role") == RAW_ROLE for m in conversation):
        raise BackendError("a raw prompt must be the conversation's only message")
    return None


class BackendError(FlipguardError, RuntimeError):
    """A backend that cannot start or answer; the message says what to do."""


def check_chat_template(tokenizer, model_id: str) -> None:
    """A chat conversation needs the model's chat template; a base model has none and takes
    raw-text prompts only (the one-line refusal names the template that is raw text)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise BackendError(f"{model_id}: the tokenizer has no chat template (a base model?); chat prompts need one: "
                           "evaluate it on raw text with --template ft-released")


# --backend_args names that would put a credential on the command line (and so into
# run.json, shell history and process listings): keys come from the environment only.
SECRET_BACKEND_ARGS = ("api_key", "apikey", "key", "token", "access_token", "password", "secret", "authorization")


def parse_backend_args(text: str | dict | None, where: str = "--backend_args") -> dict:
    """--backend_args JSON -> kwargs; refuses a credential with a message that names
    the option, never the value (a FlipguardError, so no traceback)."""
    import json

    if isinstance(text, dict):
        kwargs = dict(text)
    else:
        try:
            kwargs = json.loads(text or "{}")
        except json.JSONDecodeError as exc:
            raise BackendError(f"{where} is not valid JSON: {exc.msg}") from None
    if not isinstance(kwargs, dict):
        raise BackendError(f"{where} must be a JSON object, got {type(kwargs).__name__}")
    secret = sorted(k for k in kwargs if str(k).lower().replace("-", "_") in SECRET_BACKEND_ARGS)
    if secret:
        raise BackendError(
            f"{where}: {', '.join(map(repr, secret))} is not accepted: API keys are read from the environment "
            "only (export OPENAI_API_KEY=..., or name another variable with \"api_key_env\"); nothing was saved"
        )
    return kwargs


# One rule for every backend (hf, vllm, openai): P(label) is the sum of the probabilities
# of every token whose text is the label with only whitespace around it: "1", " 1", "\n1",
# SentencePiece's "▁1" (a first token may carry the space or newline that follows the chat
# template; which of them exist depends on the tokenizer). hf and vllm find those tokens in
# the model's vocabulary (`label_token_ids`); openai applies the same test to the token
# strings the server returns (`token_label`).
SENTENCEPIECE_SPACE = "\u2581"  # "▁", SentencePiece's word-start mark


def token_label(text: str | None, choices: Sequence[str]) -> str | None:
    """The label a token's text stands for (the label with only whitespace around it), else None."""
    bare = (text or "").replace(SENTENCEPIECE_SPACE, " ").strip()
    return bare if bare in choices else None


def label_token_ids(tokenizer, choices: Sequence[str], model_id: str, prompt: str | None = None) -> list[list[int]]:
    """Per label, the ids of every non-special vocabulary token that is the label
    (`token_label`); their probabilities add up to P(label). With `prompt` (a rendered
    request, generation prompt included) the label must also be exactly one token where
    the model answers: tokens(prompt + label) = tokens(prompt) + [one of those ids]."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    found: dict[str, list[int]] = {c: [] for c in choices}
    for i, text in enumerate(tokenizer.batch_decode([[i] for i in range(len(tokenizer))])):
        label = token_label(text, choices)
        if label is not None and i not in special:
            found[label].append(i)
    for choice, ids in found.items():
        if not ids:
            raise BackendError(f"answer {choice!r} is no single token of {model_id}'s vocabulary; "
                               "logprob mode needs one (use --mode generate)")
    if prompt is not None:
        check_label_after_prompt(tokenizer, found, prompt, model_id)
    return [found[c] for c in choices]


def check_label_after_prompt(tokenizer, found: dict[str, list[int]], prompt: str, model_id: str) -> None:
    """Each label, appended to the rendered prompt, adds exactly one of its label tokens."""
    base = tokenizer.encode(prompt, add_special_tokens=False)
    for choice, ids in found.items():
        full = tokenizer.encode(prompt + choice, add_special_tokens=False)
        new = full[len(base):]
        if full[: len(base)] != base or len(new) != 1 or new[0] not in ids:
            pieces = tokenizer.convert_ids_to_tokens(full[max(0, len(base) - 2):])
            raise BackendError(
                f"answer {choice!r} is not one token after {model_id}'s generation prompt (the prompt's end + "
                f"{choice!r} tokenizes as {pieces}); logprob mode needs one (use --mode generate)")


def backend_label_ids(backend, choices: Sequence[str], prompt: str | None = None) -> list[list[int]]:
    """A backend's `choice_token_ids` (hf, vllm): `label_token_ids` of its tokenizer, read once per
    label set and recorded in its `computed` (run.json); with `prompt`, checked to be one token there."""
    key = tuple(choices)
    cache = backend.__dict__.setdefault("_label_ids", {})
    if key not in cache:
        cache[key] = label_token_ids(backend.tokenizer, choices, backend.model_id)
        labels = backend.computed.setdefault("label_tokens", {})
        labels[",".join(key)] = label_tokens_record(backend.tokenizer, choices, cache[key])
    if prompt is not None:
        check_label_after_prompt(backend.tokenizer, dict(zip(key, cache[key])), prompt, backend.model_id)
    return cache[key]


def label_tokens_record(tokenizer, choices: Sequence[str], groups: Sequence[Sequence[int]]) -> dict[str, list]:
    """run.json's account of the label tokens: per label, [id, token] of each counted token."""
    return {c: [[i, tokenizer.convert_ids_to_tokens(i)] for i in g] for c, g in zip(choices, groups)}


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings; greedy by default. temperature None = the model's own default
    sampling settings (hf: its generation_config; vllm: the engine's defaults from it;
    openai: no temperature/top_p in the request) - stick-or-switch §4.2's "default
    temperature ... to mirror standard usage"."""

    max_new_tokens: int = 300
    temperature: float | None = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    # Force exactly max_new_tokens (benchmarks); never used for real evaluations.
    ignore_eos: bool = False

    def key(self) -> dict:
        return dataclasses.asdict(self)


class Backend(Protocol):
    name: str
    model_id: str

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig) -> list[str]:
        """One assistant reply per conversation."""

    def choice_probs(
        self, conversations: Sequence[Conversation], choices: Sequence[str] = ("1", "2")
    ) -> list[dict[str, float]]:
        """P(choice) for the first assistant token of each conversation (not renormalised)."""


class ContextTooLong(BackendError):
    """An item whose prompt does not fit the model's context; names the item and counts."""


# A tokenizer's model_max_length at or above this is transformers' "not set" placeholder.
UNSET_MAX_LENGTH = 10**8


def context_limit(model_config, tokenizer) -> tuple[int | None, str]:
    """(the most tokens the model takes, where that number comes from): the smaller of
    the model config's max_position_embeddings and the tokenizer's model_max_length
    (when set); (None, "") when neither says."""
    found = []
    n = getattr(model_config, "max_position_embeddings", None)
    if isinstance(n, int) and n > 0:
        found.append((n, "max_position_embeddings"))
    n = getattr(tokenizer, "model_max_length", None)
    if isinstance(n, int) and 0 < n < UNSET_MAX_LENGTH:
        found.append((n, "tokenizer model_max_length"))
    return min(found) if found else (None, "")


_REGISTRY: dict[str, Callable[..., Backend]] = {}


def register_backend(name: str):
    def deco(factory):
        _REGISTRY[name] = factory
        return factory

    return deco


def backend_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_backend(name: str, model: str, **kwargs) -> Backend:
    """Build a backend by name ("hf", "vllm", "openai"); "flipguard:tiny" names the
    local test model."""
    from flipguard.eval.tiny_model import resolve_model

    _load_builtin()
    if name not in _REGISTRY:
        raise BackendError(f"unknown backend {name!r}; expected one of {sorted(_REGISTRY)}")
    resolved = resolve_model(model)
    backend = _REGISTRY[name](resolved, **kwargs)
    # Records name the model as the user did ("flipguard:tiny"), not by a cache path.
    backend.model_id = backend.model_id.replace(resolved, model)
    return backend



@dataclasses.dataclass(frozen=True)
class ModelRef:
    """One model of a run: `label` names it in records and tables; `kwargs` are its
    backend's settings (batch size, device, base_url ...)."""

    label: str
    backend: str
    model: str
    adapter: str | None = None
    kwargs: dict = dataclasses.field(default_factory=dict, compare=False)

    def load(self) -> "Backend":
        """The model's backend, built now (resolves "flipguard:tiny"; an adapter goes on top)."""
        kwargs = {**self.kwargs, **({"adapter": self.adapter} if self.adapter else {})}
        return get_backend(self.backend, self.model, **kwargs)


def parse_model_ref(spec: str, default_backend: str = "hf", where: str = "--models") -> ModelRef:
    """The one model-spec syntax of every command (eval's --model, afr's and sos's --models):
    "[label=][backend:]model[|adapter]". A `backend:` prefix counts only when it names a
    registered backend, so ids such as "flipguard:tiny" or "org/model" pass through whole;
    the label defaults to the model (+adapter)."""
    head, sep, tail = spec.partition("=")
    label, rest = (head.strip(), tail) if sep and not any(c in head for c in ":/|") else ("", spec)
    prefix, colon, after = rest.partition(":")
    backend, rest = (prefix.strip(), after) if colon and prefix.strip() in backend_names() else (default_backend, rest)
    model, _, adapter = rest.partition("|")
    model, adapter = model.strip(), adapter.strip() or None
    if not model:
        raise BackendError(f"{where}: no model in {spec!r}; expected [label=][backend:]model[|adapter]")
    if backend not in backend_names():
        raise BackendError(f"{where}: unknown backend {backend!r} for {spec!r}; expected one of {backend_names()}")
    return ModelRef(label or (model if not adapter else f"{model}+{adapter}"), backend, model, adapter)


def model_kwargs(backend: str, backend_args: str | dict | None, *, batch_size: int, device: str | None = None,
                 where: str = "--backend_args") -> dict:
    """A model's backend settings: its --backend_args (JSON, never a credential) over the
    flags that only the hf backend takes (--batch_size, --device)."""
    kwargs = parse_backend_args(backend_args, where)
    return {"batch_size": batch_size, "device": device, **kwargs} if backend == "hf" else kwargs


def _load_builtin() -> None:
    # Importing registers; heavy engines (vllm, openai) are imported inside their classes.
    from flipguard.eval.backends import hf, openai_api, vllm_engine  # noqa: F401
