"""The committed fixture run directories (tests/fixtures/runs_25137aa, ...) keep their .jsonl files
gzipped; a test works on a copy with them unzipped, as the release left them."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path


def unpack_run(src: Path, run: Path) -> Path:
    """Copy the run directory `src` to `run` (created), unzipping each `.gz` file."""
    run.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix == ".gz":
            (run / path.stem).write_bytes(gzip.decompress(path.read_bytes()))
        else:
            shutil.copy(path, run / path.name)
    return run
