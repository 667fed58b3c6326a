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
import datetime
import enum
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

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


def atomic_write_text(path: str | os.PathLike, text: str, *, adopt: Callable[[Path], bool] | None = None,
                      log: bool = False) -> None:
    """Write via a temp file in the same folder and rename, so readers never see half a file,
    under the ownership rule (`owned_replace`): a file already there is replaced only when the
    folder's manifest records it as flipguard's, with the same bytes."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        refuse_link(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise RecordError(f"{path}: cannot write ({exc.strerror or exc})") from None
    data = text.encode("utf-8")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide reports from other users
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise RecordError(f"{path}: cannot write ({exc.strerror or exc}); the previous version, if any, "
                          "is unchanged") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    owned_replace(Path(tmp), path, sha=hashlib.sha256(data).hexdigest(), adopt=adopt, log=log)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, dumps_utf8(obj, indent=2) + "\n")


# ---------------------------------------------------------------- ownership
#
# One rule under every file flipguard writes (docs/reliability-ownership.md): flipguard
# replaces or removes only a file it can prove it wrote. The proof is the folder's own
# manifest, OWNER_FILE: {"written_by", "time", "files": [names], "sha256": {name: hex},
# "logs": [names]}. A name with a sha256 was written whole by flipguard (atomic_write_text,
# save_figure) and is flipguard's while its bytes still match: a file the user edited is
# theirs again. A name in "logs" is an append-only records file (records.jsonl). A name
# listed without either was published by name (model weights, pair sets: publish_dir).
# A symbolic link is never written through or followed: the folder written into and the
# file replaced are checked with lstat right before the rename.

OWNER_FILE = ".flipguard.json"
LOCK_NAME = ".lock"  # a run or study folder's writer lock (eval/records.run_lock)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def refuse_link(path: str | os.PathLike) -> None:
    """A symbolic link where flipguard would write (a folder or a file inside the one it owns)
    could point at the user's files: refused, never followed."""
    if os.path.islink(path):
        raise RecordError(f"{path}: is a symbolic link; flipguard never writes through one (it could point at "
                          "your files); nothing was changed: replace it with a real folder or file, or use another --out")


def read_manifest(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The folder's manifest (OWNER_FILE) with its keys filled in, or None when it has none (or
    one that is not a manifest: then nothing in the folder is proven flipguard's)."""
    path = Path(folder) / OWNER_FILE
    refuse_link(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
        return None
    sha = doc.get("sha256")
    logs = doc.get("logs")
    doc["sha256"] = sha if isinstance(sha, dict) else {}
    doc["logs"] = logs if isinstance(logs, list) else []
    return doc


def owns(folder: str | os.PathLike, name: str, manifest: dict[str, Any] | None = None) -> bool:
    """Whether FOLDER/NAME is flipguard's by its folder's manifest (a hash, when one was
    recorded, must still match the bytes)."""
    doc = read_manifest(folder) if manifest is None else manifest
    if doc is None or name not in doc["files"]:
        return False
    sha = doc["sha256"].get(name)
    path = Path(folder) / name
    return sha is None or (path.is_file() and not path.is_symlink() and file_sha256(path) == sha)


def check_replace(path: str | os.PathLike, *, adopt: Callable[[Path], bool] | None = None,
                  log: bool = False) -> None:
    """Refuse (RecordError, one line, nothing changed) to replace PATH unless it is absent or
    flipguard's own output: recorded in its folder's manifest (the same bytes where a hash was
    recorded; an append-only records file only when `log`), or, in a folder from before
    manifests, one `adopt` recognises by its content. Callers check their --out with this
    before any work; every write checks it again at the moment of the rename."""
    path = Path(path)
    refuse_link(path.parent)
    refuse_link(path)
    if not os.path.lexists(path):
        return
    if path.is_dir():
        raise RecordError(f"{path}: is a folder, not a file flipguard wrote; nothing was changed: choose another --out")
    doc = read_manifest(path.parent)
    listed = doc is not None and path.name in doc["files"]
    if listed and path.name in doc["logs"] and not log:
        raise RecordError(f"{path}: is the records file of a flipguard run, not an output to replace; nothing was "
                          "changed: choose another --out")
    if listed and owns(path.parent, path.name, doc):
        return
    if listed:
        raise RecordError(f"{path}: changed since flipguard wrote it (its bytes differ from the sha256 recorded in "
                          f"{path.parent / OWNER_FILE}); nothing was changed: move your copy away and rerun")
    if (doc is None or path.name not in doc["files"]) and adopt is not None and adopt(path):
        return
    raise RecordError(f"{path}: exists and was not written by flipguard ({path.parent / OWNER_FILE} does not list it); "
                      "nothing was changed: move it away or choose another --out")


@contextlib.contextmanager
def _folder_locked(folder: Path) -> Iterator[None]:
    """Manifest updates in one folder, one at a time (flock on the folder itself: no extra file)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_manifest(folder: Path, doc: dict[str, Any]) -> None:
    """The manifest itself, atomically (the one file written outside the rule it keeps)."""
    fd, tmp = tempfile.mkstemp(prefix=f"{OWNER_FILE}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, folder / OWNER_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def claim(folder: str | os.PathLike, name: str, *, sha: str | None = None, log: bool = False,
          writer: str | None = None) -> None:
    """Record FOLDER/NAME in the folder's manifest as flipguard's (with the sha256 of the bytes
    written, or as an append-only log)."""
    folder = Path(folder)
    refuse_link(folder)
    with _folder_locked(folder):
        doc = read_manifest(folder) or {"files": [], "sha256": {}, "logs": []}
        doc.setdefault("written_by", writer or "flipguard")
        doc["time"] = _now()
        if name not in doc["files"]:
            doc["files"] = sorted([*doc["files"], name])
        doc["sha256"].pop(name, None)
        if sha is not None:
            doc["sha256"][name] = sha
        if log and name not in doc["logs"]:
            doc["logs"] = sorted([*doc["logs"], name])
        write_manifest(folder, doc)


def claim_written_since(folder: str | os.PathLike, since: float, writer: str | None = None) -> list[str]:
    """Record, by name, the files in FOLDER that a library writer flipguard called (a trainer's
    save_model, a tokenizer's save_pretrained) wrote since `since` (time.time() before the call,
    less a second for the file system's coarse clock)."""
    folder = Path(folder)
    refuse_link(folder)
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink()
                   and p.name not in (OWNER_FILE, LOCK_NAME) and p.lstat().st_mtime >= since)
    with _folder_locked(folder):
        doc = read_manifest(folder) or {"files": [], "sha256": {}, "logs": []}
        doc.setdefault("written_by", writer or "flipguard")
        doc["time"] = _now()
        doc["files"] = sorted(set(doc["files"]) | set(names))
        for name in names:
            doc["sha256"].pop(name, None)
        write_manifest(folder, doc)
    return names


def owned_replace(tmp: Path, path: Path, *, sha: str | None = None, adopt: Callable[[Path], bool] | None = None,
                  log: bool = False) -> None:
    """Rename a finished temp file (same folder) onto PATH under the ownership rule, then record
    its hash: checked at the moment of the write, and the temp file removed when refused."""
    try:
        check_replace(path, adopt=adopt, log=log)
        sha = sha or file_sha256(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise RecordError(f"{path}: cannot write ({exc.strerror or exc}); the previous version, if any, "
                          "is unchanged") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    claim(path.parent, path.name, sha=sha)


def shipped_sample(path: Path) -> bool:
    """A file of the package's own shipped samples (data/samples, tracked by git): the maintainer
    tools that regenerate them replace them (the `adopt` of their writes)."""
    return (PACKAGE_ROOT / "data" / "samples") in Path(path).resolve().parents


def check_outputs(folder: str | os.PathLike, names: Iterable[str], flag: str = "--out") -> None:
    """An output folder a command is about to fill, checked before any work: not a file, not a
    symbolic link, and every file it would replace flipguard's own (check_replace)."""
    folder = Path(folder)
    refuse_link(folder)
    if os.path.lexists(folder) and not folder.is_dir():
        raise RecordError(f"{folder}: {flag} names a file, not a folder; nothing was changed: give a folder "
                          "(a new one, or one flipguard wrote)")
    for name in names:
        check_replace(folder / name)


def check_own_folder(folder: str | os.PathLike, flag: str = "--out") -> None:
    """A folder a command is about to write into, checked before any work: absent, empty, or one flipguard
    wrote (its manifest is there). A folder of anyone else's is refused whole, not file by file."""
    folder = Path(folder)
    check_outputs(folder, (), flag)
    if folder.is_dir() and read_manifest(folder) is None:
        present = sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)
        if present:
            raise RecordError(f"{folder}: {flag} exists, is not empty ({len(present)} entries, e.g. "
                              f"{', '.join(present[:3])}) and was not written by flipguard; nothing was changed: "
                              "choose another folder")


def remove_owned(root: str | os.PathLike, also: dict[str, list[int]] | None = None) -> list[Path]:
    """Remove what flipguard wrote under ROOT (a file or folder), keep everything else, and return
    what was kept. Flipguard's: a file its folder's manifest records (same bytes where hashed),
    or one in `also` (path -> [size, mtime_ns], a study's record of what a stage wrote) that is
    unchanged. Symbolic links are kept, never followed; a folder left empty (but for the
    manifest and lock) is removed; a folder that keeps a user's file keeps its manifest, pruned."""
    root = Path(root)
    also = also or {}
    kept: list[Path] = []

    def recorded(path: Path) -> bool:
        want = also.get(str(path))
        if want is None:
            return False
        st = path.lstat()
        return [st.st_size, st.st_mtime_ns] == list(want)

    if not os.path.lexists(root):
        return kept
    if root.is_symlink() or not root.is_dir():
        if not root.is_symlink() and (owns(root.parent, root.name) or recorded(root)):
            root.unlink()
        else:
            kept.append(root)
        return kept
    for folder, dirs, names in os.walk(root, topdown=False, followlinks=False):
        folder = Path(folder)
        doc = read_manifest(folder)
        removed = []
        for name in [*names, *(d for d in dirs if (folder / d).is_symlink())]:
            path = folder / name
            if name in (OWNER_FILE, LOCK_NAME):
                continue
            if not path.is_symlink() and ((doc is not None and owns(folder, name, doc)) or recorded(path)):
                path.unlink()
                removed.append(name)
            else:
                kept.append(path)
        left = [p for p in os.listdir(folder) if p not in (OWNER_FILE, LOCK_NAME)]
        if not left:
            for name in (LOCK_NAME, OWNER_FILE):
                (folder / name).unlink(missing_ok=True)
            folder.rmdir()
        elif doc is not None and removed:
            with _folder_locked(folder):
                doc["files"] = [n for n in doc["files"] if n not in removed]
                doc["sha256"] = {n: h for n, h in doc["sha256"].items() if n not in removed}
                doc["logs"] = [n for n in doc["logs"] if n not in removed]
                write_manifest(folder, doc)
    return sorted(kept)


def written_files(root: str | os.PathLike, skip: Iterable[str] = ()) -> dict[str, list[int]]:
    """Every regular file under ROOT (symbolic links not followed) as path -> [size, mtime_ns],
    less the paths in `skip`: what a finished stage wrote, for remove_owned's `also`."""
    root, skip = Path(root), set(skip)
    out: dict[str, list[int]] = {}
    if root.is_file() and not root.is_symlink():
        paths = [root]
    elif root.is_dir() and not root.is_symlink():
        paths = [Path(f) / n for f, _, names in os.walk(root, followlinks=False) for n in names]
    else:
        paths = []
    for path in paths:
        if path.is_symlink() or str(path) in skip or path.name in (OWNER_FILE, LOCK_NAME):
            continue
        st = path.lstat()
        out[str(path)] = [st.st_size, st.st_mtime_ns]
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


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
        if not os.path.lexists(tmp):  # a folder's lock, removed with it above
            continue
        if tmp.name.endswith(".lock") and pattern.fullmatch(tmp.name[:-5]) and not tmp.with_suffix("").exists():
            tmp = tmp.with_suffix("")  # the lock of a folder already removed (a build killed between the two)
        elif not tmp.is_dir() or not pattern.fullmatch(tmp.name):
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
