"""Backends turn chat conversations into text or answer-token probabilities.

A backend knows nothing about tasks (lm-eval-harness style): protocols build the
conversations, backends run them, metrics read the records. Every backend takes whole
batches so that each can batch, parallelise or cache as it sees fit.

Writing a backend (this module is all you need to read)
-------------------------------------------------------
Subclass `Backend` and register the class under a name::

    @register_backend("echo")
    class EchoBackend(Backend):
        name = "echo"

        def __init__(self, model: str, **kwargs):  # kwargs: the model's --backend_args
            self.model_id = model

        def generate(self, conversations, config):
            return ['{"chosen_answer": "1", "reasoning": "..."}' for _ in conversations]

        def choice_probs(self, conversations, choices=("1", "2")):
            return [{c: 1.0 / len(choices) for c in choices} for _ in conversations]

The constructor is called as `cls(model, **kwargs)` by `get_backend` (`--model echo:some-model`
or `--backend echo` once the class is registered: `flipguard run --include my_backend.py dds
--model echo:some-model` imports the file first; an installed package declares it as a
`flipguard.backends` entry point, `echo = "my_package.echo_backend"`, as flipguard's own hf, vllm
and openai are); a run can also take an instance directly (`run_task(..., backends={label:
instance})`). Required:

- `name` (class attribute): the registered name.
- `model_id` (set in `__init__`): the model as records and messages name it.
- `generate(conversations, config)`: one reply string per conversation, in order.
- `choice_probs(conversations, choices)`: per conversation, {label: P(label)} for the
  first token of the reply (not renormalised; 0.0 for a label the backend did not see).

A backend that cannot do one of the two (a server without logprobs) still defines it and
raises BackendError saying which --mode to use instead.

A conversation is a list of {"role", "content"} dicts; one message with role "raw" is a
plain-text prompt (`raw_prompt`). Optional capabilities have working defaults on
`Backend`; override one to get what the runner does with it (`Backend`'s attribute
docstrings say exactly what). `check_backend_class` is the test every registered class
passes (tests/test_backend_contract.py runs it on all of them).
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import json
import typing
from typing import Any, ClassVar, Sequence

from flipguard import plugins
from flipguard.config import check_values, did_you_mean
from flipguard.errors import FlipguardError
from flipguard.files import check_types, loads_json
from flipguard.runtime.adapters import require_weights
from flipguard.runtime.resolve import check_local_model, resolve_model

Conversation = list[dict[str, str]]
# backends that load a model's weights in this process (a path names a folder or file here)
LOCAL_WEIGHTS = ("hf", "vllm")

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
    if isinstance(text, dict):
        kwargs = dict(text)
    else:
        try:
            kwargs = loads_json(text or "{}", where, BackendError)
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


class Backend(abc.ABC):
    """The contract between a backend and the runner (eval/runner.py, eval/task_runner.py).

    Two abstract methods are required; every other member is an optional capability
    whose default here is what the runner assumes when a backend does not provide it.
    The runner reads these members only, never probes for others."""

    name: ClassVar[str]
    """The registered name ("hf", "vllm", "openai"); also run.json's computed[label]["backend"]."""

    model_id: str
    """The model as records and error messages name it (set by `__init__`; `get_backend`
    rewrites a resolved cache path back to what the user typed, e.g. "flipguard:tiny")."""

    max_context: int | None = None
    """The most tokens one prompt plus its reply may have. With `prompt_lengths` it lets the
    runner refuse an oversized item (naming it, its token count and this limit) before any
    record or run.json is written. None: unknown, nothing is checked."""

    max_context_source: str = ""
    """Where `max_context` comes from ("max_position_embeddings", "vLLM max_model_len"),
    quoted in the oversized-item error."""

    supports_on_result: ClassVar[bool] = False
    """True: `generate` and `choice_probs` take an `on_result(index, output)` keyword and call
    it as each conversation finishes; the runner then stores every record at once, so a
    failure later in a chunk loses none that finished (openai). False: the runner stores
    records chunk by chunk after the call returns, and never passes `on_result`."""

    show_progress: bool = True
    """Whether the backend draws its own progress bar; the runner sets it False while it
    draws one bar for the whole run."""

    computed: dict[str, Any] | None = None
    """What the backend actually computes with (dtype, the label tokens counted, ...),
    filled as it works; the runner stores it in run.json under computed[model label].
    None: nothing to record."""

    @abc.abstractmethod
    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig) -> list[str]:
        """One assistant reply per conversation, in input order (`config`: the decoding)."""

    @abc.abstractmethod
    def choice_probs(
        self, conversations: Sequence[Conversation], choices: Sequence[str] = ("1", "2")
    ) -> list[dict[str, float]]:
        """P(choice) for the first assistant token of each conversation (not renormalised);
        a label the backend saw no probability for is 0.0 (the runner marks a judgment with
        no mass on any label invalid)."""

    def prompt_lengths(self, conversations: Sequence[Conversation]) -> list[int] | None:
        """Token count of each rendered prompt, without running the model; None (the
        default): the backend cannot count, and the runner checks no context."""
        return None


# The declared capabilities and the types a backend's values must have (check_backend_class).
CAPABILITY_TYPES: dict[str, tuple[type, ...]] = {
    "max_context": (int, type(None)),
    "max_context_source": (str,),
    "supports_on_result": (bool,),
    "show_progress": (bool,),
    "computed": (dict, type(None)),
}


def check_backend_class(cls: type) -> list[str]:
    """What keeps `cls` from being a backend the runner can use ([] when nothing): a
    `Backend` subclass, with a `name`, no abstract method left, and every class-level
    capability of its declared type."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        return ["it does not subclass flipguard.eval.backends.base.Backend"]
    problems = []
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        problems.append("no `name` string")
    if inspect.isabstract(cls):
        problems.append(f"abstract method(s) not implemented: {sorted(cls.__abstractmethods__)}")
    for attr, types in CAPABILITY_TYPES.items():
        value = inspect.getattr_static(cls, attr)
        if not isinstance(value, property) and not isinstance(value, types):
            problems.append(f"{attr} is a {type(value).__name__}, expected {' or '.join(t.__name__ for t in types)}")
    return problems


def check_backend(backend: Any, where: str) -> "Backend":
    """`backend` if it is a usable Backend instance, else a BackendError naming `where` and
    what is missing (an injected engine that does not follow base.py's contract)."""
    problems = check_backend_class(type(backend))
    if not problems:
        problems = [f"{attr} is a {type(getattr(backend, attr)).__name__}, expected "
                    f"{' or '.join(t.__name__ for t in types)}"
                    for attr, types in CAPABILITY_TYPES.items() if not isinstance(getattr(backend, attr), types)]
        if not isinstance(getattr(backend, "model_id", None), str):
            problems.append("no `model_id` string (set it in __init__)")
    if problems:
        raise not_a_backend(where, type(backend).__name__, problems)
    return backend


def not_a_backend(where: str, what: str, problems: list[str]) -> "BackendError":
    """The one error for a class or object that breaks the contract: where, what, what it lacks."""
    return BackendError(f"{where}: {what} is not a flipguard backend ({'; '.join(problems)}); "
                        "see the module docstring of flipguard/eval/backends/base.py")


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


_REGISTRY: dict[str, type[Backend]] = {}


def _where(cls) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"


def register_backend(name: str, replace: bool = False):
    """Class decorator: make a `Backend` subclass loadable by name (`get_backend`); a class
    that breaks the contract is refused here, naming what it lacks. A name already taken by
    another class is refused (records would name the wrong backend) unless `replace=True`."""

    def deco(cls):
        problems = check_backend_class(cls)
        if problems:
            raise not_a_backend(f"register_backend({name!r})", getattr(cls, "__name__", str(cls)), problems)
        old = _REGISTRY.get(name)
        if old is not None and _where(old) != _where(cls) and not replace:
            raise BackendError(f"register_backend({name!r}): {_where(cls)} takes a name already registered by "
                               f"{_where(old)}; give yours another name (or register_backend({name!r}, replace=True))")
        _REGISTRY[name] = cls
        return cls

    return deco


def backend_names() -> list[str]:
    plugins.load_plugins(plugins.BACKENDS)
    return sorted(_REGISTRY)


def get_backend(name: str, model: str, **kwargs) -> Backend:
    """Build a backend by name ("hf", "vllm", "openai"); "flipguard:tiny" names the
    local test model."""
    plugins.load_plugins(plugins.BACKENDS)
    if name not in _REGISTRY and plugins.broken(plugins.BACKENDS, name):
        raise BackendError(plugins.broken(plugins.BACKENDS, name))
    if name not in _REGISTRY:
        raise BackendError(f"unknown backend {name!r}; expected one of {sorted(_REGISTRY)}{did_you_mean(name, _REGISTRY)}")
    check_backend_kwargs(name, kwargs)
    if name in LOCAL_WEIGHTS:  # a path that is not there: one line, not the hub's "Repo id must be ..."
        check_local_model(model)
    if name == "hf" and kwargs.get("adapter"):  # hf loads the base model first: an incomplete adapter is refused before
        require_weights(kwargs["adapter"])
    resolved = resolve_model(model)
    backend = _REGISTRY[name](resolved, **kwargs)
    # Records name the model as the user did ("flipguard:tiny"), not by a cache path.
    backend.model_id = backend.model_id.replace(resolved, model)
    return backend



def check_backend_kwargs(name: str, kwargs: dict, where: str = "--backend_args") -> None:
    """A backend's settings checked as a recipe's values are, before the model loads: a key its
    constructor does not take (one line naming it and the keys it does take), a value of another
    type than the constructor's annotation (`"prefix_sharing": "false"` is a string, and a string
    is true: refused, never read as on), and a value out of its bounds (config/values.py VALUE_RULES: a
    `dtype` torch lacks, a `device` this machine lacks, a `batch_size` below 1)."""
    cls = _REGISTRY[name]
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            takes = sorted(k for k, p in params.items() if k not in ("self", "model") and p.kind is not p.VAR_POSITIONAL)
            raise BackendError(f"{where}: the {name} backend takes no {', '.join(map(repr, unknown))} "
                               f"(it takes: {', '.join(takes)}); fix the key")
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an annotation this module cannot resolve: its values go unchecked
        hints = {}
    types = {k: hints[k] for k, p in params.items() if k in hints and p.kind is p.POSITIONAL_OR_KEYWORD}
    named = {k: v for k, v in kwargs.items() if k in params}  # an engine's own **kwargs: the engine checks them
    check_types(named, types, where, BackendError)
    check_values(named, where, error=BackendError)


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


def parse_model_ref(spec: str, default_backend: str = "hf", where: str = "--model") -> ModelRef:
    """The one model-spec syntax of every command (--model of eval, afr and sos):
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
        raise BackendError(f"{where}: unknown backend {backend!r} for {spec!r}; expected one of {backend_names()}"
                           f"{did_you_mean(backend, backend_names())}")
    return ModelRef(label or (model if not adapter else f"{model}+{adapter}"), backend, model, adapter)


def model_kwargs(backend: str, backend_args: str | dict | None, *, batch_size: int, device: str | None = None,
                 where: str = "--backend_args") -> dict:
    """A model's backend settings: its --backend_args (JSON, never a credential) over the
    flags that only the hf backend takes (--batch_size, --device)."""
    kwargs = parse_backend_args(backend_args, where)
    kwargs = {"batch_size": batch_size, "device": device, **kwargs} if backend == "hf" else kwargs
    if backend in backend_names():  # an unknown backend is refused by name where the model is parsed
        check_backend_kwargs(backend, kwargs, where)
    return kwargs
