"""The shipped planted-bias organism and its alias: the weights every machine loads bit for bit.

`flipguard:organism` (a 'flipguard.models' entry point) names the default organism shipped as package
data in organism_model/ beside this module, its files checked against the sha256 its organism.json
records. How it was built, and how to build or plant your own, is the organism package's
(flipguard.organism, docs/organism.md); this module only serves the shipped files and reads what an
organism folder says was planted (organism.json), which compare, transfer and the report read. The rule a
mitigation is judged by against it is organism_rule.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flipguard.data.organism_datasets import DATASET as ORGANISM_DATASET
from flipguard.data.organism_datasets import MC_DATASET as ORGANISM_MC_DATASET
from flipguard.errors import FlipguardError
from flipguard.files import file_sha256

ORGANISM_ALIAS = "flipguard:organism"  # its 'flipguard.models' entry point (pyproject.toml)
ORGANISM_FILE = "organism.json"
# the shipped default organism: package data beside this module (tests/test_shipped_organism.py)
SHIPPED_DIR = Path(__file__).resolve().parent / "organism_model"


def organism_file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file of a built organism but its description (organism.json, README.md)
    and flipguard's own bookkeeping (dotfiles: the folder's writer record)."""
    return {f.name: file_sha256(f) for f in sorted(folder.iterdir())
            if f.is_file() and f.name not in (ORGANISM_FILE, "README.md") and not f.name.startswith(".")}


def shipped_info() -> dict[str, Any] | None:
    """The shipped organism's organism.json (None when this install lacks it)."""
    info_file = SHIPPED_DIR / ORGANISM_FILE
    if not info_file.is_file():
        return None
    return json.loads(info_file.read_text(encoding="utf-8"))


def shipped_organism() -> str:
    """The alias's folder: the shipped organism, its files checked against the sha256 its
    organism.json records (one line naming the files that differ, or the missing folder)."""
    info = shipped_info()
    if info is None:
        raise FlipguardError(f"{SHIPPED_DIR}: this install has no shipped organism; reinstall flipguard, or build "
                             "your own with `flipguard organism --force`")
    recorded, found = info.get("files_sha256", {}), organism_file_hashes(SHIPPED_DIR)
    if recorded != found:
        bad = sorted(set(recorded) ^ set(found) | {k for k in recorded.keys() & found.keys() if recorded[k] != found[k]})
        raise FlipguardError(f"{SHIPPED_DIR}: the shipped organism's files differ from their recorded sha256 "
                             f"({', '.join(bad)}); reinstall flipguard, or build your own with `flipguard organism --force`")
    return str(SHIPPED_DIR)


def organism_info(model: str | None) -> dict[str, Any] | None:
    """A model's organism.json: the folder's, or for the alias the shipped one; None for any other
    model (nothing planted)."""
    if not model:
        return None
    if model == ORGANISM_ALIAS:
        path = SHIPPED_DIR
    elif Path(model).is_dir():
        path = Path(model)
    else:
        return None
    try:
        info = json.loads((path / ORGANISM_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("planted"), dict) else None


def planted_kinds(model: str | None) -> dict[str, set[str]] | None:
    """dataset -> the kinds with a planted bias, read from an organism's organism.json (organism_info);
    None for any other model."""
    info = organism_info(model)
    if info is None:
        return None
    planted = info["planted"]
    human = set(planted.get("deferred_categories_human") or ())
    return {ORGANISM_DATASET: human, ORGANISM_MC_DATASET: set(planted.get("capitulation_kinds") or human)}
