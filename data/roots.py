"""Where the data lives: an explicit root, $FLIPGUARD_DATA, or the samples shipped in data/samples/.

Below every loader (data/unified.py, aio.py, medqa.py ...), so each finds the root the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

from flipguard.data.schema import DataError

DATA_ENV = "FLIPGUARD_DATA"
SAMPLES_ROOT = Path(__file__).resolve().parent / "samples"


def default_data_root() -> Path | None:
    """$FLIPGUARD_DATA if set, else None (meaning the shipped samples)."""
    value = os.environ.get(DATA_ENV, "").strip()
    return Path(value).expanduser() if value else None


def shared_data_root() -> Path | None:
    """The full shared data folder next to the repository (../shared/data), if present."""
    candidate = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return candidate if (candidate / "dialdefer").is_dir() else None


def resolve_data_root(data_root: str | Path | None = None) -> Path:
    """Explicit argument > $FLIPGUARD_DATA > the shipped samples."""
    root = Path(data_root).expanduser() if data_root else default_data_root()
    if root is None:
        return SAMPLES_ROOT
    if not root.is_dir():
        source = "data_root" if data_root else f"${DATA_ENV}"
        raise DataError(f"{source} {str(root)!r} is not a directory")
    return root


def is_sample_root(root: Path) -> bool:
    return Path(root).resolve() == SAMPLES_ROOT
