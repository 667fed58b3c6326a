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

# errno values that say the disk (not the code) stopped a write
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


class FlipguardError(Exception):
    """Bad input: the message names the file and the item or option at fault."""


class UserError(FlipguardError, ValueError):
    """Bad input that no caller tells apart (option, config, recipe, import, pairs)."""


class RecordError(FlipguardError, ValueError):
    """A records file, run directory or output file that cannot be read or written; names file and line."""


def disk_error(exc: BaseException, doing: str = "") -> "RecordError | None":
    """A one-line RecordError for an OSError a full disk, quota, file-size limit or read-only
    filesystem raised (naming the file when the OSError does), else None."""
    if not isinstance(exc, OSError) or exc.errno not in DISK_ERRNOS:
        return None
    where = f"{exc.filename}: " if exc.filename else ""
    return RecordError(f"{doing}{where}cannot write ({exc.strerror or exc}); what was written before is kept: free some "
                       "space (or make the folder writable) and rerun the same command to resume")
