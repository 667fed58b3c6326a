"""Files in and out: reading what a user hands flipguard (data, import, recipe and
run-config files), writing outputs atomically, where cached models live, and which
commit of flipguard wrote an output.

One place decides what a hostile file gets: bytes that are not UTF-8, YAML that does not
parse, or a value of the wrong type raise a FlipguardError (subclass chosen by the caller)
whose one-line message names the file and the line or key, before anything is run or
written. One writer (temp file + rename) for every output, so a reader never sees half a
file. Every layer (data/, eval/, train/) imports these from here, so none has to import
the eval core for a file helper.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Iterator

import yaml

from flipguard.errors import FlipguardError, RecordError, UserError

# The installed package's folder (the repository root): recipes/, train/, data/samples/ are found from it.
PACKAGE_ROOT = Path(__file__).resolve().parent



def _not_utf8(path, data: bytes, exc: UnicodeDecodeError, error: type[FlipguardError], line_offset: int = 0):
    line = data.count(b"\n", 0, exc.start) + 1 + line_offset
    col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
    bad = data[exc.start:exc.end].hex(" ")
    return error(f"{path}:{line}: not UTF-8 text (byte(s) {bad} at column {col}); save the file as UTF-8")


def decode_utf8(data: bytes, path, error: type[FlipguardError] = UserError) -> str:
    """`data` as text; bytes that are not UTF-8 raise `error` naming path:line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, data, exc, error) from None


def read_text(path: str | os.PathLike, error: type[FlipguardError] = UserError, what: str = "file") -> str:
    """A whole text file as UTF-8 (a leading BOM dropped); a missing or unreadable file,
    or bytes that are not UTF-8, raise `error` naming the file (and the line)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror})") from None
    text = decode_utf8(data, path, error)
    return text[1:] if text.startswith("\ufeff") else text


def iter_lines(path: str | os.PathLike, error: type[FlipguardError] = UserError) -> Iterator[str]:
    """Lines of a text file, decoded one by one: a line that is not UTF-8 raises `error`
    naming path:line (the file is never read whole)."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, raw, exc, error, line_offset=lineno - 1) from None


# ---------------------------------------------------------------- writing


def flipguard_home() -> Path:
    """Where embedded models and registered datasets are cached ($FLIPGUARD_HOME)."""
    return Path(os.environ.get("FLIPGUARD_HOME") or Path.home() / ".cache" / "flipguard")


def git_commit() -> str | None:
    """The commit of this flipguard checkout (run.json, training provenance, the study's
    rerun key); None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def dumps_utf8(obj: Any, **kw: Any) -> str:
    """JSON text that is always valid UTF-8: readable non-ASCII text as is, but a string
    holding a lone surrogate (unencodable) makes the whole text \\u-escaped
    (ensure_ascii), which json.loads reads back to the identical string."""
    text = json.dumps(obj, ensure_ascii=False, default=str, **kw)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, ensure_ascii=True, default=str, **kw)
    return text


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write via a temp file in the same folder and rename: readers never see half a file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise RecordError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide reports from other users
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise RecordError(f"{path}: cannot write ({exc.strerror or exc}); the previous version, if any, "
                          "is unchanged") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, dumps_utf8(obj, indent=2) + "\n")


# ---------------------------------------------------------------- YAML


def load_yaml(path: str | os.PathLike, error: type[FlipguardError] = UserError, what: str = "config file"):
    """(data, key lines) of a YAML (or JSON) file. `key lines` maps a top-level key, and
    "section.key" one level down, to its 1-based line. Broken YAML raises `error` naming
    path:line and the problem."""
    text = read_text(path, error, what)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"{where}: not valid YAML ({problem})") from None
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = str(k.value)
            lines[key] = k.start_mark.line + 1
            if isinstance(v, yaml.MappingNode):
                for k2, _ in v.value:
                    lines[f"{key}.{k2.value}"] = k2.start_mark.line + 1
    return data, lines


# ---------------------------------------------------------------- value types


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        elem = {int: "integers", float: "numbers", bool: "true/false values"}.get(args[0]) if len(args) == 1 else None
        return f"a list of {elem}" if elem else "a list"
    if origin is not None:
        return {dict: "a mapping"}.get(origin, str(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list",
            dict: "a mapping"}.get(tp, getattr(tp, "__name__", str(tp)))


def value_fits(value: Any, tp) -> bool:
    """Whether a YAML value can stand for a dataclass field of type `tp`: numbers are not
    strings, lists or booleans (and an int field takes no 2.5); types flipguard does not
    know (TRL's own classes) are left to their parser."""
    if tp is Any or tp is typing.Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(value_fits(value, a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if value is None:
        return False
    if origin in (list, tuple, set, typing.List, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, list):
            return False
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        elem = args[0] if len(args) == 1 else None
        if elem in (int, float, bool):  # list[int] etc.: every element checked
            return all(value_fits(v, elem) for v in value)
        return True
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, str) or isinstance(value, tp)
    return True  # not ours to judge


def field_types(*classes) -> dict[str, Any]:
    """field name -> resolved type annotation, over dataclasses."""
    out: dict[str, Any] = {}
    for cls in classes:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # pragma: no cover - an annotation that cannot be resolved
            hints = {}
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, hints.get(f.name, Any))
    return out


def check_types(values: dict[str, Any], types_: dict[str, Any], path, error: type[FlipguardError] = UserError,
                lines: dict[str, int] | None = None, names: dict[str, str] | None = None) -> None:
    """Raise `error` for the first value whose type does not fit its field: one line naming
    path(:line), the key as written in the file, the type wanted and the value given.
    `names` maps a field name to the key as written (e.g. "sft.beta")."""
    lines, names = lines or {}, names or {}
    for key, value in values.items():
        if key not in types_ or value_fits(value, types_[key]):
            continue
        shown = names.get(key, key)
        line = lines.get(shown)
        where = f"{path}:{line}" if line else str(path)
        raise error(f"{where}: key {shown!r} must be {_type_name(types_[key])}, got {_describe(value)} "
                    f"({type(value).__name__}); nothing was run")



# ---------------------------------------------------------------- staging folders


def _staging_lock(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".lock")  # beside the folder: never published with it


def clean_stale_staging(final: str | os.PathLike) -> list[Path]:
    """Remove the staging folders of killed builds of `final` (`.NAME.XXXXXXXX` beside it, as
    staging_dir makes them): one whose lock no live process holds, or one from before staging
    locks. A staging folder in use by a running build is left alone."""
    final = Path(final)
    pattern = re.compile(rf"\.{re.escape(final.name)}\.[a-z0-9_]{{8}}")
    removed = []
    if not final.parent.is_dir():
        return removed
    for tmp in sorted(final.parent.iterdir()):
        if not tmp.is_dir() or not pattern.fullmatch(tmp.name):
            continue
        lock = _staging_lock(tmp)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a build still writing it
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed.append(tmp)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def staging_dir(final: str | os.PathLike) -> Iterator[Path]:
    """A folder beside `final` (same filesystem: publishing renames from it) to build `final` in,
    locked while this process uses it and removed afterwards; a killed build's leftover is
    removed by the next one (clean_stale_staging)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    lock = _staging_lock(tmp)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(fd)


def beside(path: str | os.PathLike, anchor: str | os.PathLike | None) -> Path:
    """A path a config names: as given when it exists (or is absolute), else relative to
    the folder of `anchor` (the config file), so a recipe runs from any current folder."""
    given = Path(path)
    if given.is_absolute() or given.exists() or not anchor:
        return given
    return Path(anchor).resolve().parent / given
