"""The models of a run, each loaded only when it has work.
"""

from __future__ import annotations

from typing import Iterable

from flipguard.errors import UserError
from flipguard.eval.backends.base import Backend, ModelRef, check_backend


class BackendPool:
    """Loads a model's backend only when it has work; keeps at most `max_loaded` loaded
    (the least recently used goes first). `injected` backends (tests, a caller's own
    engine) are used as given."""

    def __init__(self, models: Iterable[ModelRef], injected: dict[str, Backend] | None = None, max_loaded: int = 1):
        self.models = {m.label: m for m in models}
        self.injected = {label: check_backend(b, f"the backend given for model {label!r}")
                         for label, b in (injected or {}).items()}
        self.max_loaded = max_loaded
        self.loaded: dict[str, Backend] = {}
        # label -> what its backend actually computed with (dtype, label tokens): `computed`
        # dicts the backends fill as they work, kept after a backend is unloaded
        self.computed: dict[str, dict] = {}

    def get(self, label: str) -> Backend:
        if label in self.injected:
            return self.injected[label]
        if label in self.loaded:
            self.loaded[label] = self.loaded.pop(label)  # most recently used last
            return self.loaded[label]
        if label not in self.models:
            raise UserError(f"unknown model {label!r}; the run's models are {sorted(self.models)}")
        while len(self.loaded) >= self.max_loaded:
            self.loaded.pop(next(iter(self.loaded)))
        self.loaded[label] = self.models[label].load()
        if self.loaded[label].computed is not None:
            self.computed[label] = self.loaded[label].computed
        return self.loaded[label]
