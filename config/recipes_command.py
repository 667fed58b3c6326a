"""`flipguard recipes [show NAME]`: the shipped recipes and run configs listed, or one printed."""

from __future__ import annotations

import sys
from pathlib import Path

from flipguard.config.shipped import RECIPE_SUFFIXES, SHIPPED_RECIPES, shipped_recipes
from flipguard.config.spelling import did_you_mean
from flipguard.errors import UserError


def recipe_title(path: Path) -> str:
    """A recipe file's first comment line (what it is), without the '#'."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def recipes_main(argv: list[str]) -> int:
    """`flipguard recipes [show NAME]`: the shipped recipes and run configs, or one of them."""
    usage = ("usage: flipguard recipes [show NAME]\n\nThe recipes and run configs shipped with flipguard, each with its "
             "first comment line;\n`show NAME` prints one (flipguard recipes show organism > my.yaml, then edit it).\n"
             "Every command that takes a recipe or run config takes NAME too, from any folder.")
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        raise SystemExit(0)  # as argparse's --help does for every other command
    if argv in ([], ["list"]):
        shipped = shipped_recipes()
        width = max(map(len, shipped))
        for name, path in shipped.items():
            print(f"{name.ljust(width)}  {recipe_title(path)}")
        print(f"\n(in {SHIPPED_RECIPES}; flipguard recipes show NAME prints one)")
        return 0
    if argv[0] == "show" and len(argv) == 2:
        shipped = shipped_recipes()
        key = argv[1][: -len(Path(argv[1]).suffix)] if Path(argv[1]).suffix in RECIPE_SUFFIXES else argv[1]
        key = key.removeprefix("recipes/")
        if key not in shipped:
            raise UserError(f"show {argv[1]}: no shipped recipe of that name (flipguard recipes lists them)"
                            f"{did_you_mean(key, shipped)}")
        sys.stdout.write(shipped[key].read_text(encoding="utf-8"))
        return 0
    raise UserError(f"unexpected arguments {argv}; usage: flipguard recipes [show NAME]"
                    f"{did_you_mean(argv[0], ['show', 'list'])}")
