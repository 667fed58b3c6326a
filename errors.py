"""One error module: the base class for errors caused by the user's input (a file, an
item, an option).

The CLI prints these as one clear line and exits non-zero; anything else is a bug and
keeps its traceback. Subclasses exist only where a caller catches that kind apart
(DataError, RecordError, MetricsError, BackendError/ContextTooLong) or a test names it;
modules import from here, never from the CLI.
"""


class FlipguardError(Exception):
    """Bad input: the message names the file and the item or option at fault."""


# The CLI's name for the same thing (dds, compare and the protocol CLIs raise it); no
# caller tells it apart from FlipguardError, so it is an alias, not a class.
UserError = FlipguardError
