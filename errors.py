"""One base class for errors caused by the user's input (a file, an item, an option).

The CLI prints these as one clear line and exits non-zero; anything else is a bug and
keeps its traceback.
"""


class FlipguardError(Exception):
    """Bad input: the message names the file and the item or option at fault."""
