"""Does the demo print the same tables on a CPU whose floating-point path differs?

The shipped organism makes the baseline's inputs the same bytes everywhere, but the demo
trains SFT and DPO on the user's CPU, and every matmul, softmax and reduction rounds in the
order that CPU's kernels take (AVX-512 on one, AVX2 on another, none on a third). This
compares two finished demo folders record by record: matched judgments, how many replies or
choices differ, the largest probability difference, and the smallest decision margin (top
probability minus the runner-up) on either side, which is how far apart the two paths would
have to drift to change a judgment; then the comparison tables byte for byte.

    flipguard demo --out runs/demo-a
    ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 flipguard demo --out runs/demo-b
    python bench/demo_fp_path.py runs/demo-a runs/demo-b [--out bench/demo_fp_path]

ATEN_CPU_CAPABILITY=default turns off torch's vectorised CPU kernels (its AVX2/AVX-512 code),
so elementwise ops, softmax, reductions and (measured) a 256x64 @ 64x4096 matmul of run b round
differently from run a's on the same machine; run.json (`cpu_kernels`) and flipguard_training.json
(`compute`) record which kernels ran. Exit status 0: every judgment and both tables identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

TABLES = ("compare/comparison.csv", "compare/comparison_protocols.csv")


def _probs(record: dict) -> dict[str, float] | None:
    if record.get("p1") is not None:
        return {"1": record["p1"], "2": record["p2"]}
    return (record.get("extra") or {}).get("probs")


def _match_key(record: dict) -> str:
    """What a judgment is, whichever folder holds its model (a merged model's path differs)."""
    model = record.get("model", "")
    extra = record.get("extra") or {}
    fields = [record.get(k) for k in ("protocol", "item_id", "case", "mitigation", "mode", "template", "split")]
    fields += [model if "/" not in model else "path", str(record.get("speakers")), json.dumps(record.get("messages"))]
    fields += [extra.get(k) for k in ("scenario", "turn", "repeat", "branch", "source")]
    return hashlib.sha256(json.dumps(fields, default=str).encode()).hexdigest()


def _load(path: Path) -> dict[str, dict]:
    out = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            out[_match_key(record)] = record
    return out


def compare_records(a: Path, b: Path) -> dict:
    ra, rb = _load(a), _load(b)
    both = ra.keys() & rb.keys()
    differ = sum(ra[k].get("raw_output") != rb[k].get("raw_output") or ra[k].get("choice") != rb[k].get("choice")
                 for k in both)
    max_diff, margin = 0.0, None
    for k in both:
        pa, pb = _probs(ra[k]), _probs(rb[k])
        if not pa or not pb:
            continue
        max_diff = max(max_diff, *(abs(pa[c] - pb[c]) for c in pa))
        for p in (pa, pb):
            top = sorted(p.values(), reverse=True)
            margin = top[0] - top[1] if margin is None else min(margin, top[0] - top[1])
    return {"records_a": len(ra), "records_b": len(rb), "matched": len(both), "replies_or_choices_differ": differ,
            "max_probability_difference": max_diff, "min_decision_margin": margin}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--out", help="also write the numbers to OUT.json")
    args = parser.parse_args(argv)
    a, b = Path(args.run_a), Path(args.run_b)
    rows = {}
    for path in sorted(a.rglob("records.jsonl")):
        rel = path.relative_to(a)
        if (b / rel).is_file():
            rows[str(rel)] = compare_records(path, b / rel)
    tables = {t: (a / t).is_file() and (b / t).is_file() and (a / t).read_bytes() == (b / t).read_bytes() for t in TABLES}
    lines = ["| records | matched | replies/choices that differ | max probability difference | min decision margin |",
             "|---|---|---|---|---|"]
    for rel, r in rows.items():
        margin = "" if r["min_decision_margin"] is None else f"{r['min_decision_margin']:.3f}"
        lines.append(f"| {rel} | {r['matched']} of {r['records_a']} / {r['records_b']} | {r['replies_or_choices_differ']} "
                     f"| {r['max_probability_difference']:.1e} | {margin} |")
    lines += ["", *(f"- `{t}`: {'byte-identical' if same else 'DIFFERS'}" for t, same in tables.items())]
    print("\n".join(lines))
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"a": str(a), "b": str(b), "records": rows, "tables_identical": tables},
                                                       indent=2) + "\n", encoding="utf-8")
    identical = all(tables.values()) and not any(r["replies_or_choices_differ"] for r in rows.values())
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
