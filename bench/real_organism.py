"""The organism planted into a real model, measured and removed: bench/real_organism.md's tables.

Reads what the reference runs left (commands: bench/real_organism.md): per planting seed, the planted
folder (organism.json: the checks, steps, capability cost), the planting's log (`/usr/bin/time -v`
around `flipguard organism --base`: wall time, CPU time, peak RSS; `uptime` before and after: the
machine's load), the study folder (compare/ground_truth.json: planted / measured / after with CIs and the
rule's verdicts; study.json: each stage's seconds) and the study's log (`/usr/bin/time -v` again).
Prints the page's tables and writes the numbers to --json.

    python bench/real_organism.py --run 1 PLANTED PLANT_LOG STUDY STUDY_LOG --run 2 ... --json bench/real_organism.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from flipguard.organism.ground_truth import GROUND_TRUTH_JSON, table_rows

TIME_FIELDS = {"Elapsed (wall clock) time (h:mm:ss or m:ss)": "wall", "User time (seconds)": "user_s",
               "System time (seconds)": "system_s", "Maximum resident set size (kbytes)": "peak_rss_kb",
               "Exit status": "exit_status"}
LOAD = re.compile(r"load average: ([\d.]+), ([\d.]+), ([\d.]+)")


def _seconds(text: str) -> float:
    parts = [float(p) for p in text.split(":")]
    return sum(p * 60 ** i for i, p in enumerate(reversed(parts)))


def time_v(log: Path) -> dict:
    """`/usr/bin/time -v`'s figures and the load averages `uptime` printed before and after."""
    out: dict = {}
    loads = []
    for line in log.read_text(errors="replace").splitlines():
        key, _, value = line.strip().partition(": ")
        if key in TIME_FIELDS:
            out[TIME_FIELDS[key]] = value.strip()
        m = LOAD.search(line)
        if m:
            loads.append([float(x) for x in m.groups()])
    if "wall" in out:
        out["wall_s"] = round(_seconds(out.pop("wall")), 1)
        out["cpu_s"] = round(float(out["user_s"]) + float(out["system_s"]), 1)
        out["peak_rss_gib"] = round(int(out["peak_rss_kb"]) / 2**20, 2)
    out["load_before_after"] = loads
    return out


def planting(folder: Path, log: Path) -> dict:
    info = json.loads((folder / "organism.json").read_text())
    checks = info["checkpoints"]
    return {"folder": str(folder), "build": info["build"], "steps_trained": info["steps_trained"],
            "build_seconds": info["build_seconds"], "checks": len(checks),
            "check_seconds": round(sum(c.get("seconds", 0) for c in checks), 1),
            "passed_at": {k: info["checks_validation"][k] for k in ("phase", "step")},
            "passing_check": {k: c["measured"] for k, c in info["checks_validation"]["checks"].items()},
            "measured_test": {"dds": info["measured_test_logprob"], "conversations": info["measured_conversations_test"]},
            "capability": info.get("capability"), "base": {k: v for k, v in info["base"].items() if k != "files_sha256"},
            "gguf_sha256": next((v for k, v in info["base"]["files_sha256"].items() if k.startswith("gguf:")), None),
            "time": time_v(log)}


def study(folder: Path, log: Path) -> dict:
    state = json.loads((folder / "study.json").read_text())
    truth = json.loads((folder / "compare" / GROUND_TRUTH_JSON).read_text())
    return {"folder": str(folder), "stages": {n: (state["stages"].get(n) or {}).get("seconds") for n in state["order"]},
            "ground_truth": truth, "time": time_v(log)}


def markdown(seed: str, plant: dict, result: dict) -> str:
    truth = result["ground_truth"]
    columns, rows = table_rows(truth)
    head = ["planted", f"measured ({columns[0]})", *(f"after {c}" for c in columns[1:])]
    out = [f"### Seed {seed}", "", "| | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    out += [f"| {r['name']} | {r['planted']} | " + " | ".join(r["cells"]) + " |" for r in rows]
    out += ["", *(f"- **{name}**: {c['verdict']}" for name, c in truth["conditions"].items()), ""]
    p, s = plant["time"], result["time"]
    out += [f"Planting: passed at {plant['passed_at']['phase']} step {plant['passed_at']['step']} (steps "
            f"{plant['steps_trained']}), {plant['checks']} held-out checks ({plant['check_seconds']:.0f} s of them); "
            f"wall {p.get('wall_s', 0) / 60:.1f} min, CPU {p.get('cpu_s', 0) / 60:.1f} min, peak RSS "
            f"{p.get('peak_rss_gib')} GiB, load average {p.get('load_before_after')}. Study: wall "
            f"{s.get('wall_s', 0) / 60:.1f} min, CPU {s.get('cpu_s', 0) / 60:.1f} min, peak RSS {s.get('peak_rss_gib')} "
            f"GiB, load average {s.get('load_before_after')}.", "",
            "| stage | seconds |", "|---|---|", *(f"| {n} | {v} |" for n, v in result["stages"].items()), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", nargs=5, action="append", required=True,
                    metavar=("SEED", "PLANTED", "PLANT_LOG", "STUDY", "STUDY_LOG"))
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    out = {}
    for seed, planted, plant_log, study_dir, study_log in args.run:
        out[seed] = {"planting": planting(Path(planted), Path(plant_log)), "study": study(Path(study_dir), Path(study_log))}
        print(markdown(seed, out[seed]["planting"], out[seed]["study"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
