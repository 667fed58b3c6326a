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


def written_by_flipguard(old: Path, run: Path) -> Path:
    """The run directory `old` (records.jsonl and run.json, left by a flipguard from before manifests) written
    into `run` by flipguard's own writers (the record store, the atomic writer), so that its manifest proves
    them, as a run made today has: what a command may then resume or rewrite."""
    from flipguard.eval.records import RecordStore, load_records
    from flipguard.files import atomic_write_text

    RecordStore(run / "records.jsonl").append(load_records(old))
    atomic_write_text(run / "run.json", (old / "run.json").read_text(encoding="utf-8"))
    return run
