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


class BackendError(FlipguardError, RuntimeError):
    """A backend that cannot start or answer; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings; greedy by default as in all three papers."""

    max_new_tokens: int = 300
    temperature: float = 0.0
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


def _load_builtin() -> None:
    # Importing registers; heavy engines (vllm, openai) are imported inside their classes.
    from flipguard.eval.backends import hf, openai_api, vllm_engine  # noqa: F401
