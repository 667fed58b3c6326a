"""The recipes and run configs shipped in the package, found by name from any folder."""

from __future__ import annotations

import os
from pathlib import Path

from flipguard.config.spelling import did_you_mean
from flipguard.errors import UserError
from flipguard.files import PACKAGE_ROOT

RECIPE_SUFFIXES = (".yaml", ".yml")

# the recipes and run configs shipped in the package (pyproject's package-data): found by name
# from any folder, and by the path they have in a clone (recipes/NAME.yaml) where that is no file
SHIPPED_RECIPES = PACKAGE_ROOT / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """name -> file of every shipped recipe and run config (accelerate configs as accelerate_configs/NAME)."""
    found = {p.stem: p for p in sorted(SHIPPED_RECIPES.glob("*.yaml"))}
    found |= {f"{p.parent.name}/{p.stem}": p for p in sorted(SHIPPED_RECIPES.glob("accelerate_configs/*.yaml"))}
    return found


def find_recipe(given: str | os.PathLike, what: str = "recipe") -> str:
    """A recipe or run config as given when it is a file; else the shipped one it names
    (`organism`, `afr_tiny.yaml`, or `recipes/afr_tiny.yaml` from a folder that is not a clone);
    else one line naming the shipped ones."""
    given = str(given)
    if Path(given).is_file():
        return given
    path = Path(given)
    name = path.name[: -len(path.suffix)] if path.suffix in RECIPE_SUFFIXES else path.name
    shipped = shipped_recipes()
    if path.parent in (Path("."), Path("recipes")) and name in shipped:
        return str(shipped[name])
    if path.exists():
        raise UserError(f"{given}: a {what} is a YAML file, not a folder")
    names = [n for n in shipped if "/" not in n]
    raise UserError(f"{given}: no such {what} (not a file, nor a shipped one: {', '.join(names)}; "
                    f"`flipguard recipes` lists them){did_you_mean(name, names)}")
