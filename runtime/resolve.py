"""Which local weights a model name means, for every command and every trainer.

Below both eval/ and train/: a backend resolves its --model here, a trainer its
model_name_or_path, so "flipguard:tiny" or a .gguf file means the same weights to both.
"""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path

from flipguard import plugins
from flipguard.errors import UserError
from flipguard.runtime.adapters import safetensors_shapes
from flipguard.runtime.convert import cached_checkpoint, checked_gguf

MODEL_FORMS = "a local folder or .gguf file, a hub id (namespace/name), flipguard:organism or flipguard:tiny"


def resolve_model(name: str) -> str:
    """The local weights a model name means: an embedded model's alias ("flipguard:tiny",
    "flipguard:organism": a 'flipguard.models' entry point, built once and cached) its path; a
    GGUF file (or a folder holding one) its plain checkpoint (runtime/convert.py, converted once);
    anything else (a hub id, a folder) itself. A local folder's weight files are checked whole
    first (check_weights): every command that loads a model resolves it here."""
    embedded = plugins.plugins(plugins.MODELS).get(name)
    if embedded is not None:
        path = plugins.load(embedded)()
    else:
        path = cached_checkpoint(name) if checked_gguf(name) is not None else name
    check_weights(path, name)
    return path


def check_weights(path: str, name: str | None = None) -> None:
    """Every weight file of a local model folder read far enough to know it is whole: a safetensors file's
    header and the bytes it points to, a PyTorch .bin file's zip directory. A file of 0 bytes, random bytes or
    cut short is one line naming it (it was a 34- or 42-line traceback from deep inside a load)."""
    folder = Path(path)
    if not folder.is_dir():
        return
    for weights in sorted(folder.iterdir()):
        if weights.suffix in (".safetensors", ".bin") and weights.is_file():
            st = weights.stat()
            _check_file(str(weights), st.st_size, st.st_mtime_ns, name or path)


@functools.lru_cache(maxsize=256)
def _check_file(path: str, size: int, mtime_ns: int, model: str) -> None:  # once per file and state of it
    why = None
    if path.endswith(".safetensors"):
        try:
            safetensors_shapes(Path(path))
        except UserError as exc:
            why = str(exc).removeprefix(f"{path}: ")
    elif not zipfile.is_zipfile(path):
        why = f"not a PyTorch checkpoint ({size:,} bytes; its zip directory is missing: cut short or not one)"
    if why:
        raise UserError(f"{path}: {why}; the weights of model {model} are damaged: copy or download them again")


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
