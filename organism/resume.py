"""A build's last checkpoint on disk, so that a build killed at any moment (SIGKILL, Ctrl-C, the
machine stopping) resumes from it and ends with what an uninterrupted build would have made.

The state lives in flipguard's own home, `$FLIPGUARD_HOME/resume/<folder name>-<hash>/state.pt` (the
hash of the build's settings and the folder it publishes to): never beside a user's files, written
whole (a temp file renamed), and removed when the build is published or fails its checks (a rerun
would fail the same way). It holds what trains (a model built from scratch: every weight; a
planting: its LoRA), the optimizer, schedule and RNG of the phase under way, the checks so far and
the steps each finished phase took; the batches are drawn again in their seeded order and the ones
already trained are skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from flipguard.errors import FlipguardError
from flipguard.files import flipguard_home
from flipguard.organism.profile import OrganismArgs, build_config

STATE_FILE = "state.pt"
STATE_FORMAT = 1


class BuildResume:
    """Where one build's checkpoint is kept, and its save, load and removal."""

    def __init__(self, args: OrganismArgs, target: Path):
        key = json.dumps({"build": build_config(args), "target": str(target.resolve())}, sort_keys=True)
        self.config = build_config(args)
        self.folder = flipguard_home() / "resume" / f"{target.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        self.path = self.folder / STATE_FILE

    def load(self) -> dict[str, Any] | None:
        """The last checkpoint of this build (None when there is none); one line when it is unreadable."""
        import torch

        if not self.path.is_file():
            return None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception as exc:  # a state file cut short by a full disk, or not torch's: never guessed around
            raise FlipguardError(f"{self.path}: this build's checkpoint cannot be read ({type(exc).__name__}); remove "
                                 "that folder to start the build over") from None
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or state.get("build") != self.config:
            raise FlipguardError(f"{self.path}: a checkpoint of another flipguard version or other settings; remove that "
                                 "folder to start the build over")
        return state

    def save(self, state: dict[str, Any]) -> None:
        """Replace the checkpoint whole: a kill while writing leaves the previous one."""
        import torch

        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        try:
            torch.save({**state, "format": STATE_FORMAT, "build": self.config}, tmp)
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove what save wrote (the state and a killed save's temp file), then the folder if that
        leaves it empty."""
        if not self.folder.is_dir() or self.folder.is_symlink():
            return
        self.path.unlink(missing_ok=True)
        for tmp in self.folder.glob(f".{STATE_FILE}.*.tmp"):
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.folder.rmdir()
