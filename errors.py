"""One error module. Every error caused by the user's input (a file, an item, an option)
is a FlipguardError: the CLI prints it as one clear line and exits non-zero; anything
else is a bug and keeps its traceback. Modules import from here, never from the CLI.

Classes exist only where a caller catches that kind apart from the rest:
  UserError                  bad input that nothing tells apart: a command's option, a
                             run config, a recipe, a records file to import, pair input
                             (one class under one name: no per-module aliases)
  DataError (data/schema.py)         a dataset file or item; caught to add context
  RecordError                a records file, run directory or output file that cannot be
                             read or written (RunDirBusy in eval/records.py: locked)
  MetricsError (eval/dds/metrics.py)     records that cannot be scored (report: C2-only runs)
  BackendError / ContextTooLong      a model backend (eval/backends/base.py)
  TrainError (train/utils.py)        training setup

A full disk, a quota, a file-size limit or a read-only filesystem met outside flipguard's own
writers (a library's save, a log) is the machine's state, not a bug: `disk_error` turns such an
OSError into a RecordError naming the file, and the CLI and the study's workers print it as one
line like any other.
"""

import errno
import os

# errno values that say the disk (not the code) stopped a write
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class FlipguardError(Exception):
    """Bad input: the message names the file and the item or option at fault."""


class UserError(FlipguardError, ValueError):
    """Bad input that no caller tells apart (option, config, recipe, import, pairs)."""


class RecordError(FlipguardError, ValueError):
    """A records file, run directory or output file that cannot be read or written; names file and line."""


class DiskFull(RecordError):
    """A write the disk refused (full, a quota, a file-size limit, read-only): `path` is where, so a
    caller that knows how much its work needs (a study stage) can say so (disk_error)."""

    def __init__(self, message: str, path: str | None = None, reason: str = ""):
        super().__init__(message)
        self.path = path
        self.reason = reason

    def __reduce__(self):  # whole across a study worker's pipe
        return type(self), (str(self), self.path, self.reason)


def write_failed(message: str, exc: OSError, path: str | os.PathLike) -> RecordError:
    """The error of one of flipguard's own writes that failed with `exc`: a DiskFull when the disk
    stopped it (a study adds the room its stage needs: disk_error), else a RecordError."""
    if exc.errno in DISK_ERRNOS:
        return DiskFull(message, str(path), exc.strerror or os.strerror(exc.errno))
    return RecordError(message)


# what a library's own error says when the disk stopped it without an OSError (safetensors' Rust
# writer, torch's zip writer): the operating system's words, or the errno in Rust's form
_DISK_WORDS = {"No space left on device": errno.ENOSPC, "os error 28": errno.ENOSPC,
               "Disk quota exceeded": errno.EDQUOT, "os error 122": errno.EDQUOT,
               "File too large": errno.EFBIG, "os error 27": errno.EFBIG,
               "Read-only file system": errno.EROFS, "os error 30": errno.EROFS}


def disk_cause(exc: BaseException | None) -> tuple[str | None, str] | None:
    """(the file named, the reason in words) when a full disk, a quota, a file-size limit or a
    read-only filesystem stopped `exc` or an exception it was raised from; else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DiskFull):
            return exc.path, exc.reason
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return (str(exc.filename) if exc.filename else None), (exc.strerror or os.strerror(exc.errno))
        text = str(exc)
        for words, code in _DISK_WORDS.items():
            if words in text:
                return None, os.strerror(code)
        exc = exc.__cause__ or exc.__context__
    return None


def size_text(n: float) -> str:
    """Bytes as a person reads them: 316 KB, 1.8 MB, 7.2 GB."""
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes free to this user on the filesystem of PATH (its nearest existing folder)."""
    folder = os.path.abspath(path)
    while folder and not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def disk_error(exc: BaseException, doing: str = "", where: str | os.PathLike | None = None,
               needed: tuple[int, str] | None = None) -> DiskFull | None:
    """One line for a write a full disk, a quota, a file-size limit or a read-only filesystem stopped
    (an OSError, or a library's error that says so), naming the file (or `where`, when the error names
    none), the room left on its filesystem and, when the caller knows it, `needed` (bytes, and why
    that many); None for any other error."""
    cause = disk_cause(exc)
    if cause is None:
        return None
    path, reason = cause
    path = path or (str(where) if where is not None else None)
    room = ""
    if path is not None:
        free = free_bytes(path)
        if free is not None:
            room = f"; {size_text(free)} free there"
            if needed is not None:
                room += f", about {size_text(needed[0])} needed ({needed[1]})"
    named = f"{path}: " if path else ""
    return DiskFull(f"{doing}{named}cannot write ({reason}{room}); what was written before is kept: free some space "
                    "(or make the folder writable) and rerun the same command to resume", path, reason)
