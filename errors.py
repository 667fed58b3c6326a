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
"""


class FlipguardError(Exception):
    """Bad input: the message names the file and the item or option at fault."""


class UserError(FlipguardError, ValueError):
    """Bad input that no caller tells apart (option, config, recipe, import, pairs)."""


class RecordError(FlipguardError, ValueError):
    """A records file, run directory or output file that cannot be read or written; names file and line."""
