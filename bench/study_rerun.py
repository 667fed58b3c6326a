"""What a rerun of `flipguard study` costs: the same command twice in a fresh folder.

    python bench/study_rerun.py                         # recipes/tiny.yaml, writes bench/study_rerun.{json,md}
    python bench/study_rerun.py --recipe recipes/organism.yaml --out_dir /tmp/bench-study

Each run is a separate `python -m flipguard.pipeline.cli study RECIPE --out DIR` process (the
user's command, imports included), timed wall-clock. The first run does every stage;
the second must find every stage up to date (checked from DIR/study.json: no stage's
`finished` time changes), and the target is second <= 20% of first. A script run by
hand, not a test: the machine's load is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed_run(recipe: str, out: Path, log: Path) -> float:
    cmd = [sys.executable, "-m", "flipguard.pipeline.cli", "study", recipe, "--out", str(out)]
    t = time.perf_counter()
    with log.open("w") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t
    if code:
        raise SystemExit(f"`{' '.join(cmd)}` failed with exit code {code}; see {log}")
    return seconds


def finished(out: Path) -> dict[str, str]:
    return {n: s["finished"] for n, s in json.loads((out / "study.json").read_text())["stages"].items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny.yaml"))
    parser.add_argument("--out_dir", default=None, help="Study folder (default: a fresh temp folder).")
    parser.add_argument("--results", default=str(ROOT / "bench" / "study_rerun"), help="Results path without suffix.")
    args = parser.parse_args()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="flipguard-study-bench-")) / "study"
    if out.exists():
        raise SystemExit(f"{out} exists: the first run must start from nothing")
    load_before = os.getloadavg()
    first = timed_run(args.recipe, out, out.parent / "first.log")
    stamps = finished(out)
    second = timed_run(args.recipe, out, out.parent / "second.log")
    if finished(out) != stamps:
        raise SystemExit("the second run redid a stage: not an unchanged rerun")
    import torch

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
               f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, Python {platform.python_version()}, "
               f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    result = {"recipe": os.path.relpath(args.recipe, ROOT), "stages": list(stamps), "first_s": round(first, 1),
              "second_s": round(second, 1), "ratio": round(second / first, 3), "machine": machine,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "command": "python bench/study_rerun.py"}
    results = Path(args.results)
    results.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    md = [
        "# `flipguard study` rerun cost", "",
        f"Measured with `python bench/study_rerun.py` (recipe `{result['recipe']}`, a fresh study folder) on {machine}; "
        f"load average {load_before[0]:.1f} before, {result['loadavg_after'][0]:.1f} after (a shared machine).", "",
        "| run | wall s | stages |", "|---|---:|---|",
        f"| first (every stage runs) | {first:.1f} | {len(stamps)} run: {', '.join(stamps)} |",
        f"| second, identical (every stage skipped) | {second:.1f} | 0 run |", "",
        f"Second / first: **{second / first:.0%}** (target <= 20%).", "",
    ]
    results.with_suffix(".md").write_text("\n".join(md), encoding="utf-8")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
