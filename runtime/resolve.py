"""Which local weights a model name means, for every command and every trainer.

Below both eval/ and train/: a backend resolves its --model here, a trainer its
model_name_or_path, so "flipguard:tiny" or a .gguf file means the same weights to both.
"""

from __future__ import annotations

from flipguard import plugins
from flipguard.runtime.convert import cached_checkpoint, checked_gguf


def resolve_model(name: str) -> str:
    """The local weights a model name means: an embedded model's alias ("flipguard:tiny",
    "flipguard:organism": a 'flipguard.models' entry point, built once and cached) its path; a
    GGUF file (or a folder holding one) its plain checkpoint (runtime/convert.py, converted once);
    anything else (a hub id, a folder) itself."""
    embedded = plugins.plugins(plugins.MODELS).get(name)
    if embedded is not None:
        return plugins.load(embedded)()
    return cached_checkpoint(name) if checked_gguf(name) is not None else name
