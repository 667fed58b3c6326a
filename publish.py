"""Output folders a command publishes whole: built beside the target, then moved in.

Pair sets, merged models, converted checkpoints and the embedded models are each one folder
their command writes; the folder's manifest (files.py) says which command wrote it and which
files are its own, so a later run replaces only those and never a folder another command (or
the user) wrote. Below eval/ and train/: both publish folders.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from flipguard.errors import RecordError
from flipguard.files import (
    OWNER_FILE,
    kind_of,
    now_iso,
    owns,
    read_manifest,
    record_tree,
    refuse_link,
    staging_dir,
    unproven,
    write_manifest,
)


def read_owner(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest (owner file) of a directory flipguard created, or None (files.read_manifest)."""
    return read_manifest(out_dir)


def published_by(folder: str | os.PathLike, writer: str, name: str) -> bool:
    """Whether FOLDER is an output WRITER published (its manifest's written_by) and FOLDER/NAME
    is one of its own files, unchanged, of its own kind: the proof a command needs before it
    serves a folder as its output (an organism folder, say), never the mere presence of NAME."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return False
    doc = read_manifest(folder)
    return (doc is not None and doc.get("written_by") == writer and owns(folder, name, doc)
            and kind_of(doc, name) == name)


def check_publish(out_dir: str | os.PathLike, *, writer: str, new: Iterable[str] = (), overwrite: bool = False,
                  flag: str = "--out", overwrite_hint: str = "") -> set[str]:
    """What publish_dir may replace in OUT_DIR (the names of its files that are WRITER's own, by their
    hashes), or a RecordError (one line naming OUT_DIR and `flag`; nothing changed). Commands call it
    with their --out before any work (`new` unknown yet: the folder-level check), publish_dir
    again with the names it brings. An output folder is replaced only by the command that
    wrote it: a merge never replaces a run folder, a pair set or an organism, even one flipguard
    wrote (its manifest's written_by names another writer). A file of the output that changed since
    it was written (the user edited it) is the user's: refused, unless `overwrite`."""
    out = Path(out_dir)
    new = set(new)
    refuse_link(out)
    if not os.path.lexists(out):
        return set()
    if not out.is_dir():
        raise RecordError(f"{out}: {flag} names a file, not a folder; nothing was changed: choose another {flag}")
    present = {p.name for p in out.iterdir()} - {OWNER_FILE}
    owner = read_owner(out)
    if owner is not None and owner.get("written_by") == writer:
        owned = {n for n in set(owner["files"]) & present if owns(out, n, owner)}
        changed = sorted((set(owner["files"]) & present) - owned)
        if changed and not overwrite:
            raise RecordError(
                f"{out / changed[0]}: {unproven(owner, out, changed[0])}"
                f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}; nothing was changed: move your copy "
                f"away and rerun{overwrite_hint}")
    elif not present or overwrite:
        owned = set()
    elif owner is not None:
        raise RecordError(
            f"{out}: {flag} holds another flipguard output (written by {owner.get('written_by') or 'flipguard'}, "
            f"not {writer}); nothing was changed. Choose another {flag}{overwrite_hint}")
    else:
        example = ", ".join(sorted(present)[:3])
        entries = f"{len(present)} entr{'y' if len(present) == 1 else 'ies'}"
        raise RecordError(
            f"{out}: {flag} exists, is not empty ({entries}, e.g. {example}) and was not written by flipguard; "
            f"nothing was changed. Choose another {flag}{overwrite_hint}"
        )
    foreign = sorted((new & present) - owned)
    if foreign and not overwrite:
        raise RecordError(
            f"{out}: would replace {', '.join(foreign)}, which flipguard did not write; nothing was changed. "
            f"Choose another {flag}{overwrite_hint}"
        )
    return owned


def publish_dir(tmp: str | os.PathLike, out_dir: str | os.PathLike, *, writer: str, overwrite: bool = False,
                last: Iterable[str] = (), overwrite_hint: str = "", flag: str = "--out") -> Path:
    """Move the entries of `tmp` (a folder built next to `out_dir`) into `out_dir`, every file
    recorded with its sha256 (a folder inside, with a manifest of its own: files.record_tree).

    - `out_dir` missing: `tmp` is renamed to it (atomic), with its manifest.
    - `out_dir` an output of the same `writer` (its manifest): only its files that are unchanged are
      replaced; others are kept. Entries in `last` (the provenance) are removed first and moved in last.
    - anything else non-empty (another command's output too), or a file: refused
      (check_publish) unless `overwrite`, which then replaces only the entries `tmp` brings,
      keeping the rest.
    `tmp` is consumed (moved or removed)."""
    tmp, out = Path(tmp), Path(out_dir)
    try:
        new = sorted(p.name for p in tmp.iterdir() if p.name != OWNER_FILE)
        hashes = {n: h for n, h in record_tree(tmp, writer).items() if n in new}
        owner_doc = {"written_by": writer, "files": new, "time": now_iso(), "logs": [], "sha256": hashes}
        owned = check_publish(out, writer=writer, new=new, overwrite=overwrite, flag=flag, overwrite_hint=overwrite_hint)
        if not out.exists():
            write_manifest(tmp, owner_doc)
            tmp.rename(out)
            return out
        last = [n for n in last if n in new]
        old = read_owner(out) or {"sha256": {}}
        # the replaced files go to a staging folder marked as flipguard's: a kill midway leaves one the next
        # build of this output removes (files.clean_stale_staging), never an unproven folder beside it
        with staging_dir(out) as trash:
            # claim first (old and new names, each with the hash of the bytes it may hold while the move is under
            # way), so a crash midway leaves only files flipguard can prove
            write_manifest(out, {**owner_doc, "files": sorted(owned | set(new)),
                                 "sha256": {**{n: old["sha256"][n] for n in owned if n in old["sha256"]}, **hashes},
                                 "replacing": {n: old["sha256"][n] for n in owned & set(new) if n in old["sha256"]}})
            for name in last:  # old provenance goes before anything else changes
                if (out / name).exists() or (out / name).is_symlink():
                    (out / name).rename(trash / name)
            for name in [n for n in new if n not in last] + last:
                if (out / name).exists() or (out / name).is_symlink():
                    (out / name).rename(trash / name)
                (tmp / name).rename(out / name)
            for name in sorted(owned - set(new)):  # flipguard's stale files of the old output
                (out / name).rename(trash / name)
            write_manifest(out, owner_doc)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
