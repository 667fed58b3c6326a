"""Numbers for bench/real_smollm2.md section 2, read from a study's records and reports:
python bench/real_smollm2_summary.py STUDY_OUT"""
import json
import statistics
import sys
from pathlib import Path

from flipguard.eval.records import load_records

root = Path(sys.argv[1])
for run in ("baseline", "sft-eval"):
    recs = load_records(root / "dds" / run)
    c1 = [r for r in recs if r.case.startswith("c1")]
    n = len(recs)
    valid = sum(r.valid for r in recs)
    acc_c1 = sum(r.valid and r.choice == r.expected for r in c1) / len(c1)
    argmax_c1 = sum(r.raw_output == r.expected for r in c1) / len(c1)
    mass = statistics.median(r.p1 + r.p2 for r in recs)
    ones = sum(r.raw_output == "1" for r in recs) / n
    lat = statistics.median(r.latency_s for r in recs)
    print(run, f"n={n} valid={valid} C1acc(valid)={acc_c1:.3f} C1acc(argmax)={argmax_c1:.3f} "
          f"median_mass={mass:.3f} share_argmax_1={ones:.3f} latency_s={lat:.3f}")
    s = json.loads((root / "dds" / run / "report" / "summary.json").read_text())
    tot = [r for r in s["summary"] if r["dataset"] == "total_avg"][0]
    print("   total:", {k: tot[k] for k in ("c1_true", "c1_false", "c2_correct", "c2_incorrect", "dds")},
          "meaningful:", s["meta"]["capability"]["meaningful"], s["meta"]["capability"]["first_tokens"])
