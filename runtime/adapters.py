"""A LoRA adapter folder checked before any model loads: merge, `eval --adapter` (hf) and the
vLLM engine read it through here, so an unfinished or corrupt adapter is one line naming the
file instead of a peft/torch traceback.

- unfinished: no flipguard_training.json (the trainers write it last, so a killed or running
  training has none); an adapter trained outside flipguard is taken only when the caller says so;
- corrupt: adapter_config.json that is not a JSON object with an integer rank, a safetensors
  file shorter than its header says (truncated copy, killed save), LoRA tensors whose rank is
  not the config's, or tensors that do not fit the base model (peft's size mismatch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flipguard.errors import UserError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PROVENANCE_FILE = "flipguard_training.json"  # written last by train/utils.save_adapter
FOREIGN_ADAPTER_ARGS = "--backend_args '{\"foreign_adapter\": true}'"  # eval's way to take one anyway


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors header, after checking the file holds every byte
    the header points to (a truncated file is refused here, not deep inside a load)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise UserError(f"{path}: truncated or not a safetensors file ({size} bytes)")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{path}: corrupt safetensors header") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        shapes = {k: [int(d) for d in v["shape"]] for k, v in tensors.items()}
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise UserError(f"{path}: corrupt safetensors header") from None
    if 8 + n + end > size:
        raise UserError(f"{path}: truncated ({size} bytes; its header needs {8 + n + end})")
    return shapes


def read_adapter(adapter: str | Path) -> tuple[dict[str, Any], list[str]]:
    """adapter_config.json and the tensor names of a peft adapter folder, both checked."""
    folder = Path(adapter)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{folder}: not an adapter folder (no {CONFIG_FILE})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f"line {exc.lineno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise UserError(f"{path}: not valid JSON ({where})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a JSON object")
    ranks = {config.get("r"), *(config.get("rank_pattern") or {}).values()}
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks):
        raise UserError(f"{path}: no positive integer LoRA rank 'r' (got {config.get('r')!r})")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        return config, []
    shapes = safetensors_shapes(weights)
    for name, shape in shapes.items():
        rank_dim = 0 if "lora_A" in name else 1 if "lora_B" in name else None
        if rank_dim is not None and (len(shape) != 2 or shape[rank_dim] not in ranks):
            raise UserError(f"{weights}: {name} has shape {shape}, which does not match the LoRA rank "
                            f"{config.get('r')} of {CONFIG_FILE}")
    return config, list(shapes)


def require_weights(adapter: str | Path) -> None:
    """An adapter folder with its config but no weights (a partial copy): one line, not peft's
    HFValidationError from taking the folder for a hub id."""
    folder = Path(adapter)
    read_adapter(folder)
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / "adapter_model.bin").is_file():
        raise UserError(f"{folder}: has {CONFIG_FILE} but no weights ({WEIGHTS_FILE}); the adapter is incomplete: "
                        "copy its weights there or retrain it")


def check_adapter(adapter: str | Path, *, foreign_ok: bool = False, foreign_flag: str = "") -> dict[str, Any]:
    """Refuse an unfinished or corrupt adapter (one line naming the file); return its config."""
    folder = Path(adapter)
    require_weights(folder)
    config, _ = read_adapter(folder)
    provenance = folder / PROVENANCE_FILE
    if provenance.is_file():
        try:
            json.loads(provenance.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{provenance}: unreadable provenance; retrain this adapter") from None
    elif not foreign_ok:
        hint = f"; an adapter trained outside flipguard: {foreign_flag}" if foreign_flag else ""
        raise UserError(f"{folder}: no {PROVENANCE_FILE}, so its training did not finish (killed, failed or "
                        f"still running); rerun the training{hint}")
    return config


def load_peft_adapter(model, adapter: str | Path, *, foreign_ok: bool = False, foreign_flag: str = ""):
    """PeftModel over `model` after check_adapter; weights that do not fit the base are one line."""
    from peft import PeftModel

    check_adapter(adapter, foreign_ok=foreign_ok, foreign_flag=foreign_flag)
    try:
        return PeftModel.from_pretrained(model, str(adapter))
    except RuntimeError as exc:
        first = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), None)
        if first is None:
            raise
        raise UserError(f"{Path(adapter) / WEIGHTS_FILE}: does not fit the base model "
                        f"{getattr(getattr(model, 'config', None), '_name_or_path', '?')} ({first})") from None
