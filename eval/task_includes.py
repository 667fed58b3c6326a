"""`--include FILE`: a user's Python file, imported so that its `@register_task` classes are
known (to `flipguard run`, study and compare, and to a study's worker processes).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from flipguard.errors import UserError

_INCLUDED: list[str] = []


def included_task_files() -> list[str]:
    """The files include_tasks imported in this process (a study's worker processes import them too)."""
    return list(_INCLUDED)


def include_tasks(path: str | Path) -> None:
    """Import a user's Python file so its `@register_task` classes are known."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--include {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"flipguard_user_tasks_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:  # sys.exit() at import: named, not a silent exit with its status
        del sys.modules[spec.name]
        raise UserError(f"--include {path}: the file called sys.exit({exc.code!r}) while being imported") from None
    except Exception as exc:  # a user's file: its error, named, without our traceback
        del sys.modules[spec.name]
        raise UserError(f"--include {path}: importing it failed ({type(exc).__name__}: {exc})") from None
    _INCLUDED.append(str(path.resolve()))


def split_includes(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the files of argv's `--include FILE` options, the other arguments), nothing imported."""
    files, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--include":
            if i + 1 >= len(argv):
                raise UserError("--include needs a Python file (--include my_tasks.py)")
            files.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--include="):
            files.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return files, rest


def take_includes(argv: list[str]) -> list[str]:
    """argv without its `--include FILE` options, each file imported (`include_tasks`): how
    `flipguard study` and `flipguard compare` learn a user's tasks, as `flipguard run` does."""
    files, rest = split_includes(argv)
    for path in files:
        include_tasks(path)
    return rest
