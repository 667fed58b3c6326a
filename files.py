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
import random
import shutil
import subprocess
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import yaml

from flipguard.errors import FlipguardError, RecordError, UserError, write_failed

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


class _KeyTwice(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _KeyTwice(key)
        seen[key] = value
    return seen


def loads_json(text: str, where: str, error: type[FlipguardError] = UserError) -> Any:
    """JSON a user gave (a flag's value, a line of a file), with a key given twice in one object refused
    as load_yaml refuses it in YAML (json keeps the last value silently); a JSONDecodeError is the
    caller's to word."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except _KeyTwice as exc:
        raise error(f"{where}: key {exc.key!r} is given twice in one object; only the last would count, so nothing "
                    "was run: keep one") from None


def read_json(path: str | os.PathLike, error: type[FlipguardError] = RecordError, what: str = "JSON file") -> Any:
    """A whole JSON file flipguard (or a user) wrote: a missing or unreadable file, bytes that are
    not UTF-8 or text that does not parse (a truncated file, a hand edit) raise `error` naming
    path:line, never a JSONDecodeError traceback."""
    text = read_text(path, error, what)
    try:
        return loads_json(text, str(path), error)
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno}); the {what} is damaged "
                    "or cut short: write it again") from None


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
                      log: bool = False, kind: str | None = None) -> None:
    """Write via a temp file in the same folder and rename, so readers never see half a file,
    under the ownership rule (`owned_replace`): a file already there is replaced only when the
    folder's manifest records it as flipguard's, with the same bytes, and of the same `kind`
    (default: the file's name; see check_replace)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        refuse_link(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise write_failed(f"{path}: cannot write ({exc.strerror or exc})", exc, path) from None
    data = text.encode("utf-8")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide reports from other users
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise write_failed(f"{path}: cannot write ({exc.strerror or exc}); the previous version, if any, "
                           "is unchanged", exc, path) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    owned_replace(Path(tmp), path, sha=hashlib.sha256(data).hexdigest(), adopt=adopt, log=log, kind=kind)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, dumps_utf8(obj, indent=2) + "\n")


# ---------------------------------------------------------------- ownership
#
# One rule under every file flipguard writes (docs/reliability-ownership.md): flipguard
# replaces or removes only a file it can prove it wrote. The proof is the folder's own
# manifest, OWNER_FILE: {"written_by", "time", "files": [names], "sha256": {name: hex},
# "logs": [names], "kinds": {name: kind}, "replacing": {name: hex}}. A name with a sha256
# was written whole by flipguard (atomic_write_text, save_figure) and is flipguard's while its
# bytes still match ("replacing": or the bytes it had while a write was under way): a file the
# user edited is theirs again. A name in "logs" is an append-only records file
# (records.jsonl). A listed folder (a pair set's dataset folder) is flipguard's when its own manifest
# proves everything in it (owns_tree). Nothing else is proof: a file listed without its hash (an
# older manifest) is not flipguard's, and neither a header line nor a format string inside a file
# ever is. Every file also has a kind, what it was written as: its own name unless
# "kinds" says otherwise (a page written by `view --out FILE` is a view.html whatever its
# name). A write replaces only a file of its own kind: a page replaces a page, never a run.json.
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
    kinds = doc.get("kinds")
    doc["sha256"] = sha if isinstance(sha, dict) else {}
    doc["logs"] = logs if isinstance(logs, list) else []
    doc["kinds"] = kinds if isinstance(kinds, dict) else {}
    if not isinstance(doc.get("replacing"), dict):
        doc["replacing"] = {}
    return doc


def kind_of(doc: dict[str, Any], name: str) -> str:
    """What a listed file was written as: its recorded kind, else its own name."""
    kind = doc["kinds"].get(name)
    return kind if isinstance(kind, str) and kind else name


def owns(folder: str | os.PathLike, name: str, manifest: dict[str, Any] | None = None) -> bool:
    """Whether FOLDER/NAME is flipguard's by proof: its folder's manifest lists it with the sha256 of
    the bytes it was written with and the bytes still match (an append-only log: listed as one; a
    folder: owns_tree). A file listed without a hash proves nothing."""
    doc = read_manifest(folder) if manifest is None else manifest
    if doc is None or name not in doc["files"]:
        return False
    path = Path(folder) / name
    if path.is_symlink():
        return False
    if name in doc["logs"]:
        return path.is_file()
    if path.is_dir():
        return owns_tree(path)
    sha = doc["sha256"].get(name)
    if sha is None or not path.is_file():
        return False
    found = file_sha256(path)
    # "replacing": the bytes it had while a write of new ones was under way (owned_replace)
    return found == sha or found == doc["replacing"].get(name)


def unproven(doc: dict[str, Any], folder: str | os.PathLike, name: str) -> str:
    """Why a file its folder's manifest lists is not flipguard's (owns is False), in a phrase."""
    if name not in doc["logs"] and name not in doc["sha256"] and not (Path(folder) / name).is_dir():
        return (f"listed in {Path(folder) / OWNER_FILE} without its sha256 (an older flipguard's manifest), so nothing "
                "proves it flipguard's")
    return f"changed since flipguard wrote it (its bytes differ from the sha256 recorded in {Path(folder) / OWNER_FILE})"


def owns_tree(folder: str | os.PathLike) -> bool:
    """Whether everything in FOLDER (a folder flipguard published inside another: a pair set's
    dataset) is flipguard's by its own manifest, file by file, folder by folder."""
    folder = Path(folder)
    doc = read_manifest(folder)
    if doc is None:
        return False
    return all(owns(folder, name, doc) for name in os.listdir(folder) if name not in (OWNER_FILE, LOCK_NAME))


def record_tree(folder: str | os.PathLike, writer: str) -> dict[str, str]:
    """Write FOLDER's manifest, and each folder's under it, listing every file with its sha256 (a
    folder a library wrote whole, before it is published); returns FOLDER's {name: sha256}."""
    folder = Path(folder)
    names = sorted(n for n in os.listdir(folder) if n not in (OWNER_FILE, LOCK_NAME))
    hashes = {}
    for name in names:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            record_tree(path, writer)
        elif path.is_file() and not path.is_symlink():
            hashes[name] = file_sha256(path)
    doc = {"written_by": writer, "time": now_iso(), "files": names, "sha256": hashes, "logs": []}
    before = read_manifest(folder)
    if before is not None and before.get(STAGING_MARK):  # a staging folder stays one until it is published
        doc[STAGING_MARK] = before[STAGING_MARK]
    write_manifest(folder, doc)
    return hashes


def check_replace(path: str | os.PathLike, *, adopt: Callable[[Path], bool] | None = None,
                  log: bool = False, kind: str | None = None, flag: str = "--out") -> None:
    """Refuse (RecordError, one line, nothing changed) to replace PATH unless it is absent or
    flipguard's own output of the kind written now (`kind`, default the file's name): recorded
    in its folder's manifest with the hash of its bytes (an append-only records file only when
    `log`) as that kind; `adopt` may only widen the kind of a file the manifest proves (a page
    recorded before kinds were) or name the package's own shipped samples. Callers check their --out with
    this before any work (`flag`: the option the message names); every write checks it again at
    the moment of the rename."""
    path = Path(path)
    kind = kind or path.name
    refuse_link(path.parent)
    refuse_link(path)
    if not os.path.lexists(path):
        return
    if path.is_dir():
        raise RecordError(f"{path}: is a folder, not a file flipguard wrote; nothing was changed: choose another {flag}")
    doc = read_manifest(path.parent)
    listed = doc is not None and path.name in doc["files"]
    if listed and path.name in doc["logs"] and not log:
        raise RecordError(f"{path}: is the records file of a flipguard run, not an output to replace; nothing was "
                          f"changed: choose another {flag}")
    if listed and owns(path.parent, path.name, doc):
        written_as = kind_of(doc, path.name)
        if written_as == kind or (adopt is not None and adopt(path)):
            return
        raise RecordError(f"{path}: is flipguard's {written_as}, not a {kind} (a write replaces only a file of its own "
                          f"kind); nothing was changed: choose another {flag}")
    if listed:
        raise RecordError(f"{path}: {unproven(doc, path.parent, path.name)}; nothing was changed: move your copy away "
                          "and rerun")
    if adopt is not None and adopt(path):
        return
    why = (f"{path.parent / OWNER_FILE} does not list it" if doc is not None else
           f"no {OWNER_FILE} beside it: a file of yours, or one from before flipguard recorded what it wrote")
    raise RecordError(f"{path}: exists and was not written by flipguard ({why}); "
                      f"nothing was changed: move it away or choose another {flag}")


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
    """The manifest itself, atomically (the one file written outside the rule it keeps); a
    full disk or a read-only folder is a RecordError naming it, the old manifest unchanged."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{OWNER_FILE}.", dir=folder)
        with os.fdopen(fd, "wb") as fh:
            fh.write((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, folder / OWNER_FILE)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise write_failed(f"{Path(folder) / OWNER_FILE}: cannot write ({exc.strerror or exc}); the previous version, "
                           "if any, is unchanged: free some space (or make the folder writable) and rerun", exc,
                           Path(folder) / OWNER_FILE) from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def claim(folder: str | os.PathLike, name: str, *, sha: str | None = None, log: bool = False,
          writer: str | None = None, kind: str | None = None, replacing: str | None = None) -> None:
    """Record FOLDER/NAME in the folder's manifest as flipguard's (with the sha256 of the bytes
    written, or as an append-only log), of `kind` (default: its name); `replacing`: the sha256
    of the bytes it holds until the write under way lands (accepted as flipguard's meanwhile)."""
    folder = Path(folder)
    refuse_link(folder)
    with _folder_locked(folder):
        doc = read_manifest(folder) or {"files": [], "sha256": {}, "logs": [], "kinds": {}}
        doc.setdefault("written_by", writer or "flipguard")
        doc["time"] = now_iso()
        if name not in doc["files"]:
            doc["files"] = sorted([*doc["files"], name])
        doc["sha256"].pop(name, None)
        if sha is not None:
            doc["sha256"][name] = sha
        if log and name not in doc["logs"]:
            doc["logs"] = sorted([*doc["logs"], name])
        doc["kinds"].pop(name, None)
        if kind is not None and kind != name:
            doc["kinds"][name] = kind
        _set_replacing(doc, name, replacing)
        write_manifest(folder, _tidy(doc))


def _set_replacing(doc: dict[str, Any], name: str, sha: str | None) -> None:
    pending = doc.setdefault("replacing", {})
    pending.pop(name, None)
    if sha is not None:
        pending[name] = sha


def _tidy(doc: dict[str, Any]) -> dict[str, Any]:
    """The manifest as written: the optional maps left out while empty."""
    return {k: v for k, v in doc.items() if not (k in ("kinds", "replacing") and not v)}


def claim_written_since(folder: str | os.PathLike, since: float, writer: str | None = None) -> list[str]:
    """Record, each with its sha256, the files in FOLDER that a library writer flipguard called (a
    trainer's save_model, a tokenizer's save_pretrained) wrote since `since` (time.time() before the
    call, less a second for the file system's coarse clock)."""
    folder = Path(folder)
    refuse_link(folder)
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink()
                   and p.name not in (OWNER_FILE, LOCK_NAME) and p.lstat().st_mtime >= since)
    _record_files(folder, names, writer or "flipguard")
    return names


def _record_files(folder: Path, names: list[str], writer: str) -> None:
    """List `names` in FOLDER's manifest as flipguard's, each with its sha256 now (under the folder's lock)."""
    with _folder_locked(folder):
        doc = read_manifest(folder) or {"files": [], "sha256": {}, "logs": [], "kinds": {}}
        doc.setdefault("written_by", writer)
        doc["time"] = now_iso()
        doc["files"] = sorted(set(doc["files"]) | set(names))
        for name in names:
            doc["sha256"][name] = file_sha256(folder / name)
            doc["kinds"].pop(name, None)
            _set_replacing(doc, name, None)
        write_manifest(folder, _tidy(doc))


def owned_replace(tmp: Path, path: Path, *, sha: str | None = None, adopt: Callable[[Path], bool] | None = None,
                  log: bool = False, kind: str | None = None) -> None:
    """Rename a finished temp file (same folder) onto PATH under the ownership rule, recording its
    hash and kind: checked at the moment of the write, and the temp file removed when refused.
    The manifest is updated before the rename and once more after it: first it records the new
    bytes' hash and keeps the old bytes' as "replacing", so a full disk (the manifest cannot be
    written: nothing changed) or a kill between the two steps never leaves a file of flipguard's
    that its manifest does not prove; the second update drops "replacing"."""
    try:
        check_replace(path, adopt=adopt, log=log, kind=kind)
        sha = None if log else (sha or file_sha256(tmp))  # an append-only log is listed as one, without a hash
        before = file_sha256(path) if sha is not None and path.is_file() else None
        claim(path.parent, path.name, sha=sha, log=log, kind=kind, replacing=before)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise write_failed(f"{path}: cannot write ({exc.strerror or exc}); the previous version, if any, "
                           "is unchanged", exc, path) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if before is not None:
        with contextlib.suppress(RecordError):  # a full disk now: "replacing" stays, harmless (both are flipguard's)
            claim(path.parent, path.name, sha=sha, log=log, kind=kind)


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


def remove_owned(root: str | os.PathLike) -> list[Path]:
    """Remove what flipguard wrote under ROOT (a file or folder), keep everything else, and return
    what was kept. Flipguard's: a file its folder's manifest records with the hash of its bytes
    (owns); a file the user changed since is theirs and kept. Symbolic links are kept, never
    followed; a folder left empty (but for the manifest and lock) is removed; a folder that keeps
    a user's file keeps its manifest, pruned (a trainer's output_dir that keeps the user's files is
    still a folder flipguard made)."""
    root = Path(root)
    kept: list[Path] = []
    if not os.path.lexists(root):
        return kept
    if root.is_symlink() or not root.is_dir():
        if not root.is_symlink() and owns(root.parent, root.name):
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
            if not path.is_symlink() and doc is not None and owns(folder, name, doc):
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
                gone = set(removed) | {n for n in doc["files"] if not os.path.lexists(folder / n)}
                doc["files"] = [n for n in doc["files"] if n not in gone]
                doc["sha256"] = {n: h for n, h in doc["sha256"].items() if n not in gone}
                doc["logs"] = [n for n in doc["logs"] if n not in gone]
                doc["kinds"] = {n: k for n, k in doc["kinds"].items() if n not in gone}
                for name in gone:
                    _set_replacing(doc, name, None)
                write_manifest(folder, _tidy(doc))
    return sorted(kept)


def blocking_kept(root: str | os.PathLike) -> list[tuple[Path, str]]:
    """What a redo of ROOT (remove_owned) would keep that the redo would then have to write over, each
    with why it is kept: a file its folder's manifest lists that is not flipguard's by proof any more
    (the user changed it, or an older flipguard's manifest lists it without a hash), and anything not
    proven inside a folder its parent's manifest lists as a whole (a pair set's dataset). A file the
    manifests do not list (the user's notes in a run folder) is kept and blocks nothing. Nothing is
    changed: a stage checks this before it removes anything, so a refused redo leaves every file as
    it was."""
    root = Path(root)
    found: dict[Path, str] = {}
    if root.is_symlink() or not root.is_dir():
        doc = read_manifest(root.parent) if root.parent.is_dir() and not root.is_symlink() else None
        if os.path.lexists(root) and doc is not None and root.name in doc["files"] and not owns(root.parent, root.name, doc):
            found[root] = unproven(doc, root.parent, root.name)
        return sorted(found.items())
    for folder, _, _ in os.walk(root, followlinks=False):
        folder = Path(folder)
        doc = read_manifest(folder)
        if doc is None:
            continue
        for name in sorted(doc["files"]):
            path = folder / name
            if not os.path.lexists(path) or owns(folder, name, doc):
                continue
            if path.is_dir() and not path.is_symlink():
                for inner, why in _unproven_in(path):
                    found.setdefault(inner, why)
            else:
                found.setdefault(path, unproven(doc, folder, name))
    return sorted(found.items())


def unlisted_files(root: str | os.PathLike) -> list[Path]:
    """The files under ROOT that no manifest lists (nor a folder its parent's manifest lists as a whole):
    the user's, never flipguard's. A stage resumed over them keeps them as the user's, as a redo does
    (remove_owned); nothing is changed, and symbolic links are not followed."""
    root = Path(root)
    out: list[Path] = []
    if root.is_symlink() or not root.is_dir():
        return out
    for folder, dirs, names in os.walk(root, followlinks=False):
        folder = Path(folder)
        doc = read_manifest(folder)
        listed = set(doc["files"]) if doc is not None else set()
        dirs[:] = [d for d in dirs if d not in listed]  # a folder published whole: its files are its own
        out += [folder / n for n in sorted(names)
                if n not in (OWNER_FILE, LOCK_NAME) and n not in listed and not (folder / n).is_symlink()]
    return out


def _unproven_in(folder: Path) -> list[tuple[Path, str]]:
    """The files under FOLDER (a folder flipguard published whole) that its manifests do not prove."""
    out = []
    for sub, _, names in os.walk(folder, followlinks=False):
        doc = read_manifest(sub)
        for n in sorted(names):
            if n in (OWNER_FILE, LOCK_NAME) or (doc is not None and owns(sub, n, doc)):
                continue
            why = (unproven(doc, sub, n) if doc is not None and n in doc["files"] else
                   f"not part of {folder}, which flipguard published whole (its {OWNER_FILE} does not list it)")
            out.append((Path(sub) / n, why))
    return out


def claim_stage_files(root: str | os.PathLike, *, since: float, until: float | None = None,
                      keep: Iterable[str | os.PathLike] = (), changed: bool = False,
                      writer: str = "flipguard study") -> list[Path]:
    """Record as flipguard's, each with its sha256 in its folder's manifest, the files under ROOT (a
    study stage's own folder) that the libraries flipguard drove wrote there while the stage ran: a
    trainer's checkpoints and cards, a harness's outputs, a write a full disk or a kill cut short.
    Claimed: each file no manifest proves whose modification time is `since` (the stage's start,
    less a second for the file system's clock) or later (and `until` or earlier: when the run that
    wrote them ended, where it is known), except the paths in `keep` (the user's files that were
    there when the stage began); a file a manifest lists with other bytes is claimed
    only with `changed` (at the end of the invocation that rewrote it, never on a later run: a file
    the user edits after a kill stays theirs). Symbolic links are never claimed or followed."""
    root = Path(root)
    keep = {os.path.abspath(k) for k in keep}
    claimed: list[Path] = []
    if root.is_symlink() or not root.is_dir():
        return claimed
    for folder, _dirs, names in os.walk(root, topdown=False, followlinks=False):
        folder = Path(folder)
        doc = read_manifest(folder)
        take = []
        for name in names:
            path = folder / name
            if name in (OWNER_FILE, LOCK_NAME) or path.is_symlink() or os.path.abspath(path) in keep:
                continue
            listed = doc is not None and name in doc["files"]
            if (doc is not None and owns(folder, name, doc)) or (listed and not changed):
                continue
            try:
                mtime = path.lstat().st_mtime
            except OSError:
                continue
            if mtime < since or (until is not None and mtime > until):
                continue
            take.append(name)
        if not take:
            continue
        _record_files(folder, take, writer)
        claimed += [folder / n for n in take]
    return sorted(claimed)


def written_files(root: str | os.PathLike, skip: Iterable[str] = ()) -> dict[str, list[int]]:
    """Every regular file under ROOT (symbolic links not followed) as path -> [size, mtime_ns],
    less the paths in `skip`: what a finished stage wrote (study.json keeps it to tell a run cut
    short; it is never a proof of ownership: the manifests are)."""
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


def now_iso() -> str:
    """The time now, UTC, to the second: every timestamp flipguard writes."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------- YAML


def load_yaml(path: str | os.PathLike, error: type[FlipguardError] = UserError, what: str = "config file"):
    """(data, key lines) of a YAML (or JSON) file. `key lines` maps a top-level key, and
    "section.key" one level down, to its 1-based line. Broken YAML raises `error` naming
    path:line and the problem; so does a key given twice in one mapping (`check_unique_keys`)."""
    text = read_text(path, error, what)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        check_unique_keys(node, path, error)
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


_YAML_MERGE = "tag:yaml.org,2002:merge"  # `<<: *defaults`: keys given after it override on purpose


def check_unique_keys(node: Any, path: str | os.PathLike, error: type[FlipguardError], prefix: str = "") -> None:
    """Refuse a key that one YAML mapping gives twice, at any depth, naming path:line of the second
    and the line of the first. YAML keeps the last value silently: a duplicated `learning_rate`
    trains at the value further down, an appended `sft:` section replaces the first one whole."""
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            check_unique_keys(child, path, error, prefix)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first: dict[tuple[str, str], int] = {}
    for key, value in node.value:
        name = f"{prefix}{key.value}" if isinstance(key, yaml.ScalarNode) else None
        if name is not None and key.tag != _YAML_MERGE:
            line = key.start_mark.line + 1
            seen = first.get((key.tag, key.value))
            first.setdefault((key.tag, key.value), line)
            if seen is not None:
                kind = "section" if isinstance(value, yaml.MappingNode) and not prefix else "key"
                keeps = "the second replaces the first whole" if kind == "section" else "only the last would count"
                raise error(f"{path}:{line}: {kind} {name!r} is given twice (first at line {seen}); {keeps}, so "
                            "nothing was run: keep one")
        check_unique_keys(value, path, error, f"{name}." if name is not None else prefix)


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
#
# A build (a merged model, an embedded model, a worker's temp folder) is made in a staging
# folder beside its final path, `.NAME.XXXXXXXX`, and published by rename. A build killed
# mid-way leaves it behind, so the next build of NAME removes it, but only by proof, never by
# its name: the lock beside it, `.NAME.XXXXXXXX.lock`, holds a marker flipguard wrote (JSON
# naming the folder and its final name) and is flock'ed while the build runs; the folder's
# manifest (OWNER_FILE) carries the same marker ("staging_for"). A folder or lock of the user's
# named like one has neither and is never touched.

STAGING_MARK = "staging_for"


def _staging_lock(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".lock")  # beside the folder: never published with it


def _lock_marker(fd: int) -> dict[str, Any] | None:
    """The marker a staging lock holds (read through its open fd), or None when it holds none."""
    try:
        data = os.pread(fd, 4096, 0)
        doc = json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) and doc.get("written_by") == "flipguard" else None


def is_staging(tmp: Path, final_name: str) -> bool:
    """Whether TMP is a staging folder flipguard made for FINAL_NAME (its manifest's marker)."""
    if tmp.is_symlink() or not tmp.is_dir():
        return False
    doc = read_manifest(tmp)
    return doc is not None and doc.get(STAGING_MARK) == final_name


def clean_stale_staging(final: str | os.PathLike) -> list[Path]:
    """Remove the staging folders of killed builds of `final` (`.NAME.XXXXXXXX` beside it, as
    staging_dir makes them): those whose lock holds flipguard's marker naming the folder and
    `final`, and that no live process holds. A folder that is not marked as a staging folder of
    `final` is removed only when empty (a build killed between making it and marking it); a
    lock whose folder is gone goes too. Anything named alike without the marker is kept."""
    final = Path(final)
    removed: list[Path] = []
    if not final.parent.is_dir():
        return removed
    prefix = f".{final.name}."
    for lock in sorted(final.parent.iterdir()):
        name = lock.name
        if not (name.startswith(prefix) and name.endswith(".lock")) or lock.is_symlink() or not lock.is_file():
            continue
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # removed meanwhile, or not ours to open
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a build still writing it
            marker = _lock_marker(fd)
            tmp = lock.with_name(name[: -len(".lock")])
            if marker is None or marker.get("folder") != tmp.name or marker.get(STAGING_MARK) != final.name:
                continue  # not a lock staging_dir wrote for this folder
            if os.path.lexists(tmp):
                if is_staging(tmp, final.name):
                    shutil.rmtree(tmp, ignore_errors=True)
                elif tmp.is_dir() and not tmp.is_symlink() and not any(tmp.iterdir()):
                    tmp.rmdir()
                else:
                    continue  # something else stands at its name: kept, and so is the lock naming it
            lock.unlink(missing_ok=True)
            removed.append(tmp)
        finally:
            os.close(fd)
    return removed


def _new_staging(final: Path) -> tuple[Path, int]:
    """A staging folder for `final` with its lock, both marked: the lock is made first (O_EXCL),
    locked, then marked; the folder after it, then its manifest. A kill at any point leaves
    only what clean_stale_staging can prove."""
    chars = "abcdefghijklmnopqrstuvwxyz0123456789_"
    rng = random.SystemRandom()
    for _ in range(100):
        tmp = final.parent / f".{final.name}.{''.join(rng.choice(chars) for _ in range(8))}"
        lock = _staging_lock(tmp)
        if os.path.lexists(tmp):
            continue
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            continue
        except OSError as exc:  # a read-only or full folder: one line, nothing made
            raise RecordError(f"{lock}: cannot make a staging lock for {final} ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            marker = {"written_by": "flipguard", "folder": tmp.name, STAGING_MARK: final.name, "pid": os.getpid()}
            os.write(fd, json.dumps(marker).encode("utf-8"))
            os.fsync(fd)
            try:
                os.mkdir(tmp, 0o700)
            except FileExistsError:  # made meanwhile by someone else: not ours, try another name
                lock.unlink(missing_ok=True)
                os.close(fd)
                continue
            write_manifest(tmp, {"written_by": "flipguard", "time": now_iso(), "files": [], "sha256": {}, "logs": [],
                                 STAGING_MARK: final.name})
            return tmp, fd
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            lock.unlink(missing_ok=True)
            os.close(fd)
            raise RecordError(f"{tmp}: cannot make a staging folder ({exc.strerror or exc})") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            lock.unlink(missing_ok=True)
            os.close(fd)
            raise
    raise RecordError(f"{final.parent}: no free name for a staging folder of {final.name}")


@contextlib.contextmanager
def staging_dir(final: str | os.PathLike) -> Iterator[Path]:
    """A folder beside `final` (same filesystem: publishing renames from it) to build `final` in,
    locked while this process uses it and removed afterwards; a killed build's leftover is
    removed by the next one (clean_stale_staging). Its manifest carries the staging marker:
    publish_dir writes the published folder's own manifest over it."""
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecordError(f"{final.parent}: cannot make the folder ({exc.strerror or exc})") from None
    clean_stale_staging(final)
    tmp, fd = _new_staging(final)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _staging_lock(tmp).unlink(missing_ok=True)
        os.close(fd)


def beside(path: str | os.PathLike, anchor: str | os.PathLike | None) -> Path:
    """A path a config names: as given when it exists (or is absolute), else relative to
    the folder of `anchor` (the config file), so a recipe runs from any current folder."""
    given = Path(path)
    if given.is_absolute() or given.exists() or not anchor:
        return given
    return Path(anchor).resolve().parent / given
