"""Which local weights a model name means, for every command and every trainer.

Below both eval/ and train/: a backend resolves its --model here, a trainer its
model_name_or_path, so "flipguard:tiny" or a .gguf file means the same weights to both.
"""

from __future__ import annotations

from pathlib import Path

from flipguard import plugins
from flipguard.errors import UserError
from flipguard.runtime.convert import cached_checkpoint, checked_gguf

MODEL_FORMS = "a local folder or .gguf file, a hub id (namespace/name), flipguard:organism or flipguard:tiny"


def resolve_model(name: str) -> str:
    """The local weights a model name means: an embedded model's alias ("flipguard:tiny",
    "flipguard:organism": a 'flipguard.models' entry point, built once and cached) its path; a
    GGUF file (or a folder holding one) its plain checkpoint (runtime/convert.py, converted once);
    anything else (a hub id, a folder) itself."""
    embedded = plugins.plugins(plugins.MODELS).get(name)
    if embedded is not None:
        return plugins.load(embedded)()
    return cached_checkpoint(name) if checked_gguf(name) is not None else name


def check_local_model(name: str, what: str = "--model") -> None:
    """A model named by a path (absolute, ./ ../ ~, or more than one '/': no hub id looks so) that is not
    there: one line, before any folder is made or model library asked (which would answer "Repo id must
    be in the form ..."). Engines that load weights here (hf, vllm, the trainers) call it; a served model's
    name (openai) is the server's business."""
    name = str(name)
    if name in plugins.plugins(plugins.MODELS):
        return
    path_like = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or name.endswith("/")
    if path_like and not Path(name).expanduser().exists():
        raise UserError(f"{what} {name}: no such folder or file (a model is {MODEL_FORMS})")
