"""A non-editable install carries the data the code reads: every file of a shipped dataset
folder matches a package-data glob of pyproject.toml (a folder added without its glob
works in the editable checkout and is missing from the wheel)."""

import fnmatch
import tomllib
from pathlib import Path

from flipguard.data.registry import SHIPPED_ENTRIES

ROOT = Path(__file__).resolve().parent.parent


def test_every_shipped_dataset_file_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = config["tool"]["setuptools"]["package-data"]["flipguard.data"]
    data = ROOT / "data"
    assert SHIPPED_ENTRIES, "no shipped dataset entries"
    missing = []
    for entry in SHIPPED_ENTRIES:
        for path in sorted(entry.parent.iterdir()):
            if path.is_file() and path.suffix in (".jsonl", ".yaml"):
                rel = path.relative_to(data).as_posix()
                if not any(fnmatch.fnmatch(rel, g) for g in globs):
                    missing.append(rel)
    assert not missing, f"shipped dataset files no package-data glob covers: {missing}"
