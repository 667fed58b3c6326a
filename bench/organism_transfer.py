"""How much of the organism's planted bias does a mitigation remove where it trained, and where it did not?

For each organism seed (its planted kinds differ: organism.json planted.deferred_categories_human)
this runs the study a user runs, `flipguard study recipes/organism_transfer.yaml`: SFT and DPO on
DDS pairs of the first planted kind only (pairs.include), the second planted kind held out
(pairs.held_out), no multi-turn pairs, so AFR and stick-or-switch are cross-protocol; then reads
each study's compare/transfer.csv and transfer.json into bench/organism_transfer.md (+ .json):
per condition the change of every cell against the baseline with its paired 95% CI and role.

    python bench/organism_transfer.py --seeds 0 --organism /work/fg_home/organism-v3   # a built organism
    python bench/organism_transfer.py --seeds 0 1 2       # builds each seed's organism first (minutes each)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from organism_mitigation import run  # noqa: E402  (the sibling bench: run a command into the log, stop on failure)

RECIPE = ROOT / "recipes" / "organism_transfer.yaml"


def planted(organism: Path) -> list[str]:
    return list(json.loads((organism / "organism.json").read_text(encoding="utf-8"))["planted"]["deferred_categories_human"])


def cell_text(r) -> str:
    ci = "" if pd.isna(r["ci_low"]) else f" [{r['ci_low']:+.1f}, {r['ci_high']:+.1f}]"
    return f"{r['baseline']:.1f} → {r['value']:.1f} ({r['change']:+.1f}{ci}){r['flags'] if isinstance(r['flags'], str) else ''}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--organism", default=None, help="A built organism to use for the (single) seed given.")
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench-transfer"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "organism_transfer"))
    parser.add_argument("--note", default="", help="A paragraph on where the organisms came from (the table's header).")
    parser.add_argument("--collect", action="store_true",
                        help="Only read the finished studies under --work (seeds run as separate processes, "
                             "`--seeds S --out TMP`, then one --collect run writes the table).")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    flipguard = [sys.executable, "-m", "flipguard.pipeline.cli"]
    results = {}
    for seed in args.seeds:
        log = work / f"seed{seed}.log"
        organism = Path(args.organism) if args.organism else work / f"organism-s{seed}"
        out = work / f"study-s{seed}"
        seconds_file = work / f"study-s{seed}.seconds"
        if args.collect and not (out / "compare" / "transfer.csv").is_file():
            continue  # not finished: left out of the table (and named as missing)
        if not (organism / "organism.json").is_file():
            t = time.time()
            run(flipguard + ["organism", "--seed", str(seed), "--path", str(organism)], log)
            (work / f"organism-s{seed}.seconds").write_text(f"{time.time() - t:.1f}\n")
        kinds = planted(organism)
        trained, held = kinds[0], kinds[1]
        if not args.collect:
            t = time.time()
            run(flipguard + ["study", str(RECIPE), "--model", str(organism), "--out", str(out),
                             "--pairs_include", json.dumps({"kinds": [trained]}),
                             "--pairs_held_out", json.dumps({"kinds": [held]})], log)
            seconds_file.write_text(f"{time.time() - t:.1f}\n")
        table = pd.read_csv(out / "compare" / "transfer.csv")
        info = json.loads((out / "compare" / "transfer.json").read_text(encoding="utf-8"))
        results[str(seed)] = {"organism": str(organism), "planted": kinds, "trained_kind": trained, "held_out_kind": held,
                              "study_seconds": float(seconds_file.read_text()) if seconds_file.is_file() else None,
                              "summary": info["summary"],
                              "cells": table.replace({float("nan"): None}).to_dict(orient="records")}
    load = os.getloadavg()
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "load_avg": load,
            "command": "python bench/organism_transfer.py " + " ".join(a for i, a in enumerate(sys.argv[1:])
                                                                       if a != "--note" and sys.argv[i:i + 1] != ["--note"])}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "seeds": results}, indent=2) + "\n", encoding="utf-8")
    lines = ["# Transfer on the planted-bias organism", "",
             f"Measured with `{meta['command']}` on {meta['machine']} (load average {load[0]:.1f} / {load[1]:.1f} / "
             f"{load[2]:.1f} at the end). Recipe: recipes/organism_transfer.yaml (SFT and DPO on DDS pairs of the "
             "first planted kind only, the second planted kind held out, no multi-turn pairs). Each cell: baseline → "
             "after (change, paired 95% CI over items); † over-correction, ‡ damage (docs/transfer.md).", "",
             *([args.note, ""] if args.note else [])]
    for seed, res in results.items():
        built = json.loads((Path(res["organism"]) / "organism.json").read_text(encoding="utf-8"))
        on = built.get("built_on") or {}
        where = (f"{on.get('gpu') or on.get('cpu')} ({on.get('device')}, torch {on.get('torch')}, {on.get('torch_threads')} "
                 "threads)") if on else "this machine"
        lines.append(f"- seed {seed}: organism {built.get('version')} built in {built.get('build_seconds')} s on "
                     f"{where}; measured at build (test split): DDS "
                     f"{built['measured_test_logprob']['dds']:+.1f}, AFR flips "
                     f"{(built.get('measured_conversations_test') or {}).get('afr_flip', float('nan')):.1f}")
    lines.append("")
    for seed, res in results.items():
        table = pd.DataFrame(res["cells"])
        conditions = [c for c in dict.fromkeys(table["condition"]) if c != "Baseline"]
        lines += [f"## Seed {seed}: planted {', '.join(res['planted'])}; trained on {res['trained_kind']}, "
                  f"held out {res['held_out_kind']} (study {res['study_seconds'] or 0:.0f} s)", "",
                  "| Cell | Role | " + " | ".join(conditions) + " |", "|---|---|" + "---|" * len(conditions)]
        for cell, rows in table.groupby("cell", sort=False):
            by = {r["condition"]: r for _, r in rows.iterrows()}
            lines.append(f"| {cell} | {rows['role'].iloc[0]} | "
                         + " | ".join(cell_text(by[c]) if c in by else "–" for c in conditions) + " |")
        lines += ["", *[f"- **{c}**: " + "; ".join(f"{k}: {v}" for k, v in s.items()) for c, s in res["summary"].items()], ""]
    missing = sorted({0, 1, 2} - {int(s) for s in results})
    if missing:
        lines += [f"Not measured: seed(s) {', '.join(map(str, missing))} (see the report that accompanies this file).", ""]
    Path(args.out + ".md").write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.out}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
