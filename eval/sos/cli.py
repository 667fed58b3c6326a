"""`flipguard sos`: stick-or-switch on one dataset for one or more models, then the report.

    flipguard sos recipes/sos_tiny.yaml          (the same as `flipguard run sos recipes/sos_tiny.yaml`)
    flipguard sos --dataset medqa --models qwen7b=Qwen/Qwen2.5-7B-Instruct --n_items 200 --out runs/sos/medqa

A run directory holds one dataset and one prompt setting; several models (and prompting
mitigations) may share it and appear side by side in its report. Rerunning the same
command resumes: stored replies are reused turn by turn and nothing is asked twice.
The protocol is the registered task `SosTask` (eval/sos/protocol.py), run by eval/task.run_task.
"""

from __future__ import annotations

from pathlib import Path

from flipguard.eval.sos.protocol import SosArgs, SosTask
from flipguard.eval.task import run_task

__all__ = ["SosArgs", "main", "run"]


def run(args: SosArgs, progress: bool = True) -> tuple[Path, int]:
    """Run (or resume) the evaluation; returns the run directory and the requests sent."""
    task = SosTask(args)
    result = run_task(task, Path(args.out) if args.out else SosTask.default_out(args), progress=progress)
    return result.out_dir, result.sent


def main(argv: list[str]) -> int:
    return SosTask.main(argv, prog="flipguard sos")
