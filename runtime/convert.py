"""GGUF in, plain checkpoint out: a `.gguf` file is a model for every command.

transformers reads a GGUF file (`gguf_file=`, with the `gguf` package) and dequantizes it;
such a model cannot be saved (its config keeps a `quantization_config` that
`save_pretrained` refuses), and every later stage (TRL, peft, merge, vLLM, a served
model) wants a folder. So a GGUF model is converted once: the model is rebuilt from its
config without the quantization config, the dequantized weights are loaded into it (tied
embeddings stay tied) and it is saved with its tokenizer and chat template. `flipguard
convert` writes one where the user says; `resolve_model` (every command's model lookup)
converts into a cache under FLIPGUARD_HOME keyed by the file's sha256, so a changed file
is converted again and an unchanged one never.
"""

from __future__ import annotations

import dataclasses
import shutil
import struct
import tempfile
from pathlib import Path

from flipguard.config import parse_dataclasses
from flipguard.errors import UserError
from flipguard.files import atomic_write_json, file_sha256, flipguard_home
from flipguard.publish import publish_dir
from flipguard.runtime.threads import THREADS_HELP, configure_threads

GGUF_SUFFIX = ".gguf"
# written into every converted folder: where the weights came from and how
CONVERT_INFO_FILE = "flipguard_convert.json"
DTYPES = ("float32", "bfloat16", "float16")


def gguf_file(name: str | Path) -> Path | None:
    """The GGUF file `name` denotes (a `.gguf` file, or a folder without config.json that
    holds exactly one), else None. A folder with several is refused, naming them."""
    path = Path(name)
    if path.is_file() and path.name.lower().endswith(GGUF_SUFFIX):
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().endswith(GGUF_SUFFIX))
    if len(found) > 1:
        raise UserError(f"{path}: holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                        "name the one to use (PATH/FILE.gguf)")
    return found[0] if found else None


# magic, version (uint32), tensor count and metadata count (uint64 each): the fixed header
GGUF_HEADER = 24


def checked_gguf(name: str | Path) -> Path | None:
    """gguf_file, for a model about to be read: a path ending in .gguf that is not there, a file
    that cannot be GGUF (another format) or one cut short (a partial download) is one line
    here, not "Repo id must be..." or a struct.error inside the reader."""
    path = Path(name)
    if path.name.lower().endswith(GGUF_SUFFIX) and not path.exists():
        raise UserError(f"{path}: no such GGUF file; check the path")
    src = gguf_file(name)
    if src is None:
        return None
    with open(src, "rb") as fh:
        head = fh.read(GGUF_HEADER)
    if head[:4] != b"GGUF":
        raise UserError(f"{src}: cannot read this GGUF file: it starts with {head[:4]!r}, not b'GGUF' (not a GGUF file)")
    if len(head) < GGUF_HEADER:
        raise UserError(f"{src}: cannot read this GGUF file: truncated ({len(head)} bytes, shorter than the "
                        f"{GGUF_HEADER}-byte header); download it again")
    return src


def convert_gguf(source: str | Path, out: str | Path, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write the plain checkpoint of GGUF `source` to `out` (built beside it, then published
    atomically; an existing folder flipguard did not write is refused unless `overwrite`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer


    src = checked_gguf(source)
    if src is None:
        raise UserError(f"{source}: not a GGUF file (expected PATH.gguf or a folder holding one)")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {list(DTYPES)}")
    out = Path(out)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except ImportError as exc:  # the gguf reader missing from a partial install
        raise UserError(f"{src}: reading GGUF needs the gguf package ({exc}); pip install gguf") from None
    except (OSError, ValueError, KeyError, RuntimeError, struct.error, EOFError) as exc:  # struct: cut short
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{src}: transformers cannot read this GGUF file ({first}); is it complete?") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the dequantized weights are plain tensors
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise UserError(f"{src}: the dequantized weights do not fit {type(model).__name__} "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        info = {"source": str(src.resolve()), "sha256": file_sha256(src), "size": src.stat().st_size,
                "dtype": dtype, "architecture": type(model).__name__, "tie_word_embeddings": tied,
                "chat_template": tokenizer.chat_template is not None}
        atomic_write_json(tmp / CONVERT_INFO_FILE, info)
        publish_dir(tmp, out, writer="flipguard convert", overwrite=overwrite, last=[CONVERT_INFO_FILE],
                    overwrite_hint=", or pass --overwrite to replace only the files convert writes")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cached_checkpoint(source: str | Path) -> str:
    """The plain checkpoint of GGUF `source` under FLIPGUARD_HOME/gguf (converted on first
    use; keyed by the file's sha256, so it follows the file's content)."""
    src = gguf_file(source)
    assert src is not None
    digest = file_sha256(src)
    target = flipguard_home() / "gguf" / f"{src.name[: -len(GGUF_SUFFIX)]}-{digest[:16]}"
    if not (target / CONVERT_INFO_FILE).is_file():
        print(f"{src}: converting the GGUF model to a checkpoint in {target} (once)", flush=True)
        try:
            convert_gguf(src, target)
        except FileExistsError:  # another process published it first
            pass
        except Exception:
            if not (target / CONVERT_INFO_FILE).is_file():
                raise
    return str(target)


@dataclasses.dataclass
class ConvertArgs:
    """Write a plain transformers checkpoint (safetensors, tokenizer, chat template) from a
    GGUF file: dequantized, loadable by every backend, trainer and merge. Any command also
    takes the .gguf path directly and converts it once into $FLIPGUARD_HOME/gguf."""

    gguf: str = dataclasses.field(default="", metadata={"help": "The .gguf file (or a folder holding exactly one)."})
    out: str = dataclasses.field(default="", metadata={"help": "Folder to write (created; refused if it holds "
                                                                 "files flipguard did not write)."})
    dtype: str = dataclasses.field(default="float32", metadata={
        "help": "Weight dtype of the checkpoint. float32 (default) keeps the dequantized values exactly; "
                "bfloat16/float16 halve the size and round them."})
    overwrite: bool = dataclasses.field(default=False, metadata={"help": "Replace the files of an existing folder."})
    threads: int | None = dataclasses.field(default=None, metadata={"help": THREADS_HELP})


def main(argv: list[str]) -> int:
    args = parse_dataclasses(argv, ConvertArgs, prog="flipguard convert", description=ConvertArgs.__doc__,
                             positional="gguf")
    configure_threads(args.threads)
    if not args.gguf or not args.out:
        raise UserError("give the GGUF file and an output folder: flipguard convert FILE.gguf --out FOLDER")
    out = convert_gguf(args.gguf, args.out, args.dtype, args.overwrite)
    print(out)
    return 0
