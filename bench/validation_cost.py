"""What validation (`validation:`, train/validation.py) costs a training stage on CPU.

The demo's SFT and DPO stages as the study runs them (`python train/<trainer>.py recipes/organism.yaml`
on one pair set, the organism recipe's budgets), each trained to the same number of steps three ways,
interleaved so that the machine's load drifts over all of them alike:

    off       validation.every 0: no slice measured, no checkpoint (the stage as it was)
    measured  validation.every 20, validation.stop false: the same steps, the slice measured and a
              checkpoint written every 20 steps (both sides do the same training work; the difference
              is what validation costs)
    stopped   validation.every 20 as the recipe ships it: training stops at the first checkpoint meeting
              the rule (what a user's stage takes)

Each row is the whole trainer process's wall time (loading, training, measuring, saving), and the
seconds the slice's measurements took by their own account (flipguard_training.json). The pair set
must hold a validation slice (`flipguard pairs recipes/organism.yaml --validation_every 20`, or a
study's pairs folder).

    python bench/validation_cost.py --pairs runs/demo/pairs [--rounds 2] [--work runs/bench-validation]
    python bench/validation_cost.py --pairs runs/demo/pairs --every 40 --out bench/validation_cost_every40
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
def modes(every: int) -> dict[str, list[str]]:
    """Each mode's flags: off, measured and stopped at a measurement every `every` steps."""
    return {"off": ["--validation_every", "0"],
            "measured": ["--validation_every", str(every), "--validation_stop", "false"],
            "stopped": ["--validation_every", str(every)]}


def train(trainer: str, pairs: Path, out: Path, flags: list[str]) -> dict:
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, f"train/{trainer}.py", "recipes/organism.yaml", "--pairs_dir", str(pairs), "--output_dir",
           str(out), *flags]
    load = os.getloadavg()[0]
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    info = json.loads((out / "flipguard_training.json").read_text(encoding="utf-8"))
    v = info.get("validation") or {}
    steps = max((h.get("step", 0) for h in info["log_history"]), default=0)
    return {"command": " ".join(cmd), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_at_start": round(load, 1),
            "load_at_end": round(os.getloadavg()[0], 1), "steps": steps,
            "measuring_s": v.get("measuring_seconds"), "measuring_cpu_s": v.get("measuring_cpu_seconds"),
            "measurements": len(v.get("curve") or []),
            "chosen_step": (v.get("chosen") or {}).get("step"), "train_runtime_s": next(
                (h["train_runtime"] for h in info["log_history"] if "train_runtime" in h), None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", required=True, help="a pair set holding a validation slice")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trainers", nargs="*", default=["sft", "dpo"])
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench-validation"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "validation_cost"))
    parser.add_argument("--every", type=int, default=20, help="steps between measurements (the recipe ships 20)")
    parser.add_argument("--modes", nargs="*", default=["off", "measured", "stopped"], choices=["off", "measured", "stopped"],
                        help="which modes to run (off is what the others are read against)")
    args = parser.parse_args()
    if "off" not in args.modes:
        parser.error("--modes: off is what the cost is read against; include it")
    chosen_modes = {m: f for m, f in modes(args.every).items() if m in args.modes}
    pairs, work = Path(args.pairs).resolve(), Path(args.work).resolve()
    if not (pairs / "validation.jsonl").is_file():
        raise SystemExit(f"{pairs}: no validation.jsonl; build the pairs with --validation_every 20")
    rows = []
    for n in range(args.rounds):
        for trainer in args.trainers:
            for mode, flags in chosen_modes.items():
                row = {"round": n + 1, "trainer": trainer, "mode": mode,
                       **train(trainer, pairs, work / f"{trainer}-{mode}", flags)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    import torch

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    lines = ["# What validation costs a training stage (CPU)" + (f", measuring every {args.every} steps" if args.every != 20 else ""), "",
             f"Measured with `python bench/validation_cost.py --pairs {args.pairs} --rounds {args.rounds}"
             + (f" --every {args.every}" if args.every != 20 else "")
             + (f" --modes {' '.join(args.modes)}" if len(args.modes) < 3 else "") + f"` on {machine} "
             f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; a shared machine: the load at each run's "
             f"start is in the table). Modes: off (validation.every 0), measured (every {args.every} steps, the same steps as off: "
             "the slice measured and a checkpoint written each time, no stop), stopped (stop at the first checkpoint "
             f"meeting the rule{', as recipes/organism.yaml ships it' if args.every == 20 else '; the recipe ships every 20'}). "
             "Wall and CPU: the whole trainer process (CPU: user + "
             "system seconds, which a loaded machine's waiting does not inflate); measuring: the slice's measurements "
             "by their own clocks (flipguard_training.json).", "",
             "| round | trainer | mode | steps | wall s | CPU s | measuring wall s / CPU s | measurements | chosen step | load start / end |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        meas = f"{r['measuring_s']} / {r['measuring_cpu_s']}" if r["measuring_s"] is not None else "–"
        lines.append(f"| {r['round']} | {r['trainer']} | {r['mode']} | {r['steps']} | {r['wall_s']} | {r['cpu_s']} | "
                     f"{meas} | {r['measurements']} | {r['chosen_step'] if r['chosen_step'] is not None else '–'} | "
                     f"{r['load_at_start']} / {r['load_at_end']} |")
    lines += ["", "Cost of validation (measured against off, the same steps), per trainer, summed over the rounds:", ""]
    for trainer in args.trainers:
        def total(mode: str, key: str) -> float:
            return sum(r[key] or 0 for r in rows if r["trainer"] == trainer and r["mode"] == mode)

        for key, what in (("wall_s", "wall"), ("cpu_s", "CPU")):
            off, on, stop = total("off", key), total("measured", key), total("stopped", key)
            meas = total("measured", "measuring_s" if key == "wall_s" else "measuring_cpu_s")
            parts = []
            if "measured" in args.modes:
                parts.append(f"measured {on:.0f} s against off {off:.0f} s: **{100 * (on - off) / off:+.0f}%** "
                             f"(of which measuring the slice {meas:.0f} s, {100 * meas / off:.0f}% of off)")
            if "stopped" in args.modes:
                parts.append(f"stopped at the first checkpoint meeting the rule {stop:.0f} s, {100 * (stop - off) / off:+.0f}%")
            lines.append(f"- {trainer}, {what} (off {off:.0f} s): " + "; ".join(parts) + ".")
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "every": args.every, "rows": rows}, indent=1) + "\n",
                                        encoding="utf-8")
    print(out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
