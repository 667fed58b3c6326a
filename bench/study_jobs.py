"""The demo one stage at a time vs two independent stages at once: wall time, and the same files?

    python bench/study_jobs.py --work /tmp/study-jobs --out bench/study_jobs

Runs `flipguard demo --jobs 1` and `flipguard demo --jobs 2` back to back on this machine (fresh
folders, the shipped organism), times each, reads each stage's seconds from its study.json and
compares the two folders record by record and the comparison tables byte for byte
(bench/demo_fp_path.py's comparison). Writes OUT.json and OUT.md with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_fp_path import TABLES, compare_records  # noqa: E402

from flipguard.runtime.threads import cpu_name  # noqa: E402


def run_demo(work: Path, jobs: int) -> dict:
    out = work / f"demo-jobs{jobs}"
    if out.exists():
        shutil.rmtree(out)
    load = os.getloadavg()[0]
    t = time.perf_counter()
    proc = subprocess.run(["flipguard", "demo", "--out", str(out), "--jobs", str(jobs)], capture_output=True, text=True)
    seconds = time.perf_counter() - t
    (work / f"demo-jobs{jobs}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"flipguard demo --jobs {jobs} failed ({proc.returncode}); see {work}/demo-jobs{jobs}.log")
    stages = json.loads((out / "study.json").read_text())["stages"]
    return {"jobs": jobs, "out": str(out), "seconds": round(seconds, 1), "load_at_start": round(load, 2),
            "load_at_end": round(os.getloadavg()[0], 2),
            "stage_seconds": {name: s["seconds"] for name, s in stages.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/study-jobs")
    parser.add_argument("--out", default="bench/study_jobs")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs = [run_demo(work, 1), run_demo(work, 2)]
    a, b = (Path(r["out"]) for r in runs)
    records = {str(p.relative_to(a)): compare_records(p, b / p.relative_to(a)) for p in sorted(a.rglob("records.jsonl"))}
    tables = {t: (a / t).read_bytes() == (b / t).read_bytes() for t in TABLES}
    adapters = {str(p.relative_to(a)): p.read_bytes() == (b / p.relative_to(a)).read_bytes()
                for p in sorted(a.glob("train/*/adapter_model.safetensors"))}
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or None
    result = {"commit": commit, "machine": f"{cpu_name()}, {os.cpu_count()} cores, {platform.machine()}", "torch": torch.__version__,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "runs": runs, "records": records,
              "tables_identical": tables, "adapters_identical": adapters,
              "command": "python bench/study_jobs.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# `flipguard demo --jobs 1` vs `--jobs 2`", "",
             f"{result['machine']}, torch {result['torch']}, commit {commit}; `{result['command']}`", "",
             "| jobs | wall time (demo command) | load at start / end |", "|---|---|---|"]
    lines += [f"| {r['jobs']} | {r['seconds']:.0f} s | {r['load_at_start']} / {r['load_at_end']} |" for r in runs]
    lines += ["", "| records | matched | replies/choices that differ | max probability difference |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['matched']} of {v['records_a']} | {v['replies_or_choices_differ']} | "
              f"{v['max_probability_difference']:.1e} |" for k, v in records.items()]
    lines += ["", *(f"- `{t}`: {'byte-identical' if same else 'DIFFERS'}" for t, same in tables.items()),
              *(f"- `{p}`: {'byte-identical' if same else 'DIFFERS'}" for p, same in adapters.items()), "",
              "| stage | jobs 1 (s) | jobs 2 (s) |", "|---|---|---|"]
    lines += [f"| {n} | {runs[0]['stage_seconds'][n]:.1f} | {runs[1]['stage_seconds'].get(n, float('nan')):.1f} |"
              for n in runs[0]["stage_seconds"]]
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    same = all(tables.values()) and all(adapters.values()) and not any(v["replies_or_choices_differ"] for v in records.values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
