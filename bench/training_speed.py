"""The demo's SFT and DPO stages, before and after, side by side on this CPU: seconds and losses.

    python bench/training_speed.py --base /tmp/fg-c90e646 --pairs runs/demo/pairs --rounds 3
    # --base: a checkout of the commit to compare against (git worktree add /tmp/fg-c90e646 c90e646)
    # --pairs: the demo's pair set (`flipguard demo` writes runs/demo/pairs)
    # --recipe: the one recipe both sides train from (default: this checkout's recipes/organism.yaml)

Each round runs `train/sft.py RECIPE` and `train/dpo.py RECIPE` from each checkout in turn (the
order alternates between rounds), in a fresh process that imports the trainer first and then times
its `main()` alone, as the study's stage does (the study runs a stage in a process whose imports are
done). Both sides read the same recipe file (--recipe, default this checkout's recipes/organism.yaml)
and the same pair set, so both do the same work: a checkout's own recipe may train another schedule
(7b13e71's organism recipe: 120 SFT / 90 DPO steps; f887e16's: 240 / 300). Recorded per run: wall
seconds, the process's CPU seconds (what a loaded machine moves least), the optimizer steps' seconds
(and per step) and the logged losses. The summary refuses to compare runs whose schedules differ
(steps, rows, effective batch: a checkout that reads the recipe otherwise), compares the medians and
checks that both checkouts logged the same losses at the same steps. Writes OUT.json and OUT.md (the
machine, its load, the commits, the schedule); bench/training_speed.md quotes OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRIVER = r"""
import json, resource, sys, time
from importlib import import_module
module = import_module("flipguard.train." + sys.argv[1])
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
wall, used = time.perf_counter(), cpu()
code = module.main(sys.argv[2:])
wall, used = time.perf_counter() - wall, cpu() - used
print("RESULT " + json.dumps({"code": code, "wall_s": round(wall, 3), "cpu_s": round(used, 3)}))
"""


def git_commit(checkout: Path) -> str:
    proc = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return proc.stdout.strip() + ("+changes" if dirty else "")


def run_stage(checkout: Path, stage: str, pairs: Path, work: Path, threads: int, recipe: Path) -> dict:
    """One trainer run from `checkout` (imported as `flipguard` through a linked folder), on `recipe`."""
    src = work / f"src-{checkout.name}"
    src.mkdir(parents=True, exist_ok=True)
    link = src / "flipguard"
    if not link.exists():
        link.symlink_to(checkout)
    out = Path(tempfile.mkdtemp(dir=work, prefix=f"{stage}-{checkout.name}-"))
    out.rmdir()  # the trainer makes its output folder itself
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    argv = [sys.executable, "-c", DRIVER, stage, str(recipe), "--pairs_dir", str(pairs),
            "--output_dir", str(out), "--report_to", "none"]
    load = os.getloadavg()[0]
    proc = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{stage} from {checkout} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    info = json.loads((out / "flipguard_training.json").read_text())
    steps = (info.get("compute") or {}).get("step_seconds") or []
    result.update(load_at_start=round(load, 2), losses=[h["loss"] for h in info["log_history"] if "loss" in h],
                  step_s=round(sum(steps), 3), per_step_s=round(statistics.median(steps), 4) if steps else None,
                  schedule=schedule(info), speed=info.get("speed"))
    return result


def schedule(info: dict) -> dict:
    """The work a run did, from its provenance: optimizer steps, pair rows, the effective batch, and the
    trainer config's schedule keys as it resolved them."""
    config = next((v for k, v in (info.get("resolved") or {}).items() if k.endswith("Config") and k != "ModelConfig"), {})
    keys = ("max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps", "max_length")
    return {"steps": len((info.get("compute") or {}).get("step_seconds") or []), "pairs_rows": info.get("pairs_rows"),
            "effective_batch_size": info.get("effective_batch_size"), **{k: config.get(k) for k in keys}}


def summarize(runs: list[dict]) -> dict:
    """Per stage, both sides' medians and their ratios; refused (SystemExit, one line) when the two sides did
    not do the same work: their times would compare different schedules."""
    out = {}
    for stage in sorted({r["stage"] for r in runs}):
        schedules = {side: [r["schedule"] for r in runs if r["stage"] == stage and r["side"] == side]
                     for side in ("base", "new")}
        every = [sch for side in schedules.values() for sch in side]
        if any(sch != every[0] for sch in every):
            differ = sorted({k for sch in every for k in sch if sch.get(k) != every[0].get(k)})
            shown = "; ".join(f"{side}: " + ", ".join(f"{k} {sch[0].get(k)}" for k in differ)
                              for side, sch in schedules.items())
            raise SystemExit(f"{stage}: the two checkouts did not do the same work ({shown}), so their times do not "
                             "compare; nothing was written: give both the same --recipe and --pairs (a checkout "
                             "that reads the recipe otherwise cannot be compared by this bench)")
        sides = {}
        for side in ("base", "new"):
            mine = [r for r in runs if r["stage"] == stage and r["side"] == side]
            sides[side] = {k: statistics.median(r[k] for r in mine) for k in ("wall_s", "cpu_s", "step_s", "per_step_s")}
            sides[side]["runs"] = len(mine)
        base_losses = next(r["losses"] for r in runs if r["stage"] == stage and r["side"] == "base")
        new_losses = next(r["losses"] for r in runs if r["stage"] == stage and r["side"] == "new")
        out[stage] = {**sides, "speedup_wall": round(sides["base"]["wall_s"] / sides["new"]["wall_s"], 2),
                      "speedup_cpu": round(sides["base"]["cpu_s"] / sides["new"]["cpu_s"], 2),
                      "speedup_steps": round(sides["base"]["step_s"] / sides["new"]["step_s"], 2),
                      "max_loss_difference": max((abs(a - b) for a, b in zip(base_losses, new_losses)), default=None),
                      "losses_logged": [len(base_losses), len(new_losses)], "schedule": every[0]}
    return out


def markdown(result: dict) -> str:
    lines = [f"# Training speed on CPU: the demo's SFT and DPO stages, {result['commits']['base']} vs "
             f"{result['commits']['new']}", "",
             f"Measured {result['date']} on {result['machine']} ({result['threads']} thread(s) a run), "
             f"{result['rounds']} rounds, the order alternating; load average {result['load'][0]} at the start, "
             f"{result['load'][1]} at the end.", "",
             f"    {result['command']}", "",
             f"Both sides trained from {result['recipe']} on the same pair set: the same work (the schedule "
             "column, from each run's flipguard_training.json; the bench refuses runs whose schedules differ).", "",
             "Seconds are medians over the rounds: wall time of the trainer's `main()` (its stage in a study), "
             "the process's CPU time in it, and the optimizer steps' time, in all and per step "
             "(flipguard_training.json).", "",
             "| stage | schedule | base wall s | new wall s | wall x | base CPU s | new CPU s | CPU x | steps x "
             "| base s/step | new s/step | max loss difference |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for stage, s in result["summary"].items():
        sch = s["schedule"]
        lines.append(f"| {stage} | {sch['steps']} steps, {sch['pairs_rows']} rows, batch {sch['effective_batch_size']} | "
                     f"{s['base']['wall_s']:.1f} | {s['new']['wall_s']:.1f} | {s['speedup_wall']} | "
                     f"{s['base']['cpu_s']:.1f} | {s['new']['cpu_s']:.1f} | {s['speedup_cpu']} | {s['speedup_steps']} | "
                     f"{s['base']['per_step_s']:.3f} | {s['new']['per_step_s']:.3f} | {s['max_loss_difference']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a checkout of the commit to compare against")
    parser.add_argument("--new", default=str(ROOT), help="the checkout measured (default: this one)")
    parser.add_argument("--pairs", required=True, help="the demo's pair set (runs/demo/pairs)")
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "organism.yaml"),
                        help="the recipe both sides train from (default: this checkout's recipes/organism.yaml)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads a run (the demo's: 1)")
    parser.add_argument("--stages", default="sft,dpo")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", default="bench/training_speed_cpu")
    args = parser.parse_args(argv)
    sides = {"base": Path(args.base).resolve(), "new": Path(args.new).resolve()}
    pairs = Path(args.pairs).resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="fg-training-speed-"))
    load_start = os.getloadavg()[0]
    runs = []
    for r in range(args.rounds):
        order = ("base", "new") if r % 2 == 0 else ("new", "base")
        for stage in args.stages.split(","):
            for side in order:
                res = run_stage(sides[side], stage, pairs, work, args.threads, Path(args.recipe).resolve())
                runs.append({"round": r, "stage": stage, "side": side, **res})
                print(f"round {r} {stage:4s} {side:4s} wall {res['wall_s']:6.1f} s  cpu {res['cpu_s']:6.1f} s  "
                      f"steps {res['step_s']:6.1f} s  load {res['load_at_start']}", flush=True)
    from flipguard.runtime.threads import cpu_name

    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_name()}, {os.cpu_count()} cores, {platform.system()}",
              "threads": args.threads, "rounds": args.rounds, "load": [round(load_start, 2), round(os.getloadavg()[0], 2)],
              "recipe": str(Path(args.recipe).resolve()),
              "commits": {side: git_commit(path) for side, path in sides.items()},
              "command": "python bench/training_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "summary": summarize(runs), "runs": runs}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
