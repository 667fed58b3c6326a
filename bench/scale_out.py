"""2 processes (1 thread each) vs 1 process (2 threads) on this machine, side by side in one run
(and 1 process x 1 thread as the control):
SFT and DPO training throughput and DDS evaluation throughput on the tiny model (recipes/tiny.yaml).

    python bench/scale_out.py [--steps 16] [--datasets all] [--out bench/scale_out.json]

Training: the same rows, seed and effective batch (4) in both layouts: 1 process with batch 4
and OMP_NUM_THREADS=2, `accelerate launch --num_processes 2` (recipes/accelerate_configs/ddp.yaml,
torchrun + gloo) with batch 2 each and OMP_NUM_THREADS=1. Reported: the Trainer's own train_runtime
(the training loop only) and the command's wall time (imports, model load, process start).
Evaluation: `flipguard eval` (DDS, logprob, hf backend, batch 8) on the bundled sample datasets, the same layouts.
The layouts run one after another, never together. Writes the JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DDP = ROOT / "recipes" / "accelerate_configs" / "ddp.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable]
    return [shutil.which("accelerate") or str(Path(sys.executable).parent / "accelerate"), "launch",
            "--config_file", str(DDP), "--num_processes", str(processes), "--main_process_port", str(free_port())]


def run(cmd: list[str], threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return wall


# 1 process x 1 thread is the control: it shows what a second thread (or process) adds at all
LAYOUTS = [("1 process x 2 threads", 1, 2), ("2 processes x 1 thread", 2, 1), ("1 process x 1 thread", 1, 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--datasets", default="all", help="eval datasets (all: the 10 bundled sample sets, 200 items, 800 judgments)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "scale_out.json"))
    args = ap.parse_args()

    from flipguard.data.schema import Item
    from flipguard.eval.embedded.tiny_model import ensure_tiny_model
    from flipguard.pairs import builder as P

    work = Path(tempfile.mkdtemp(prefix="flipguard-scale-out-"))
    model = ensure_tiny_model(work / "tiny")
    items = [Item(id=f"b-{i}", dataset="amqa", question=f"Is {i} even?", correct_answer="yes" if i % 2 == 0 else "no",
                  incorrect_answer="no" if i % 2 == 0 else "yes", split="train") for i in range(8)]
    P.write_pairs(P.build_pairs(items, "all", seed=0), work / "pairs")  # 16 rows

    rows = []
    for trainer in ("sft", "dpo"):
        for name, processes, threads in LAYOUTS:
            out = work / f"{trainer}-{processes}x{threads}"
            cmd = [*launch(processes), f"train/{trainer}.py", "recipes/tiny.yaml", "--model_name_or_path", model,
                   "--pairs_dir", str(work / "pairs"), "--output_dir", str(out), "--max_steps", str(args.steps),
                   "--per_device_train_batch_size", str(4 // processes)]
            wall = run(cmd, threads)
            info = json.loads((out / "flipguard_training.json").read_text())
            final = [h for h in info["log_history"] if "train_runtime" in h][-1]
            samples = args.steps * info["effective_batch_size"]
            rows.append({"job": f"{trainer} ({args.steps} steps, effective batch {info['effective_batch_size']})",
                         "layout": name, "num_processes": info["num_processes"], "train_runtime_s": final["train_runtime"],
                         "samples_per_s": samples / final["train_runtime"], "wall_s": wall, "command": " ".join(cmd)})
    for name, processes, threads in LAYOUTS:
        out = work / f"eval-{processes}x{threads}"
        cmd = [*launch(processes), "-m", "flipguard", "eval", "--model", model, "--datasets", args.datasets,
               "--min_label_mass", "0", "--batch_size", "8", "--out", str(out)]
        wall = run(cmd, threads)
        n = sum(1 for _ in (out / "records.jsonl").open())
        recs = [json.loads(line) for line in (out / "records.jsonl").open()]
        scoring = sum(r["latency_s"] for r in recs)  # per-record share of its chunk's wall time
        rows.append({"job": f"dds eval ({n} judgments)", "layout": name, "num_processes": processes,
                     "scoring_s": scoring, "judgments_per_s": n / scoring, "wall_s": wall, "command": " ".join(cmd)})
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
               "platform": platform.platform(), "load_average_after": os.getloadavg(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    import torch
    import transformers
    import trl

    machine.update(torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__)
    Path(args.out).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    print(f"machine: {machine}\n")
    print("| job | layout | loop time (s) | throughput | wall incl. start (s) |\n|---|---|---:|---:|---:|")
    for r in rows:
        if "samples_per_s" in r:
            print(f"| {r['job']} | {r['layout']} | {r['train_runtime_s']:.1f} | {r['samples_per_s']:.2f} samples/s | {r['wall_s']:.1f} |")
        else:
            print(f"| {r['job']} | {r['layout']} | {r['scoring_s']:.1f} | {r['judgments_per_s']:.1f} judgments/s | {r['wall_s']:.1f} |")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
