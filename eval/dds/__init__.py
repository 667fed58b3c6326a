"""DDS (DialDefer): the same claim judged as a statement (C1) and attributed to a speaker (C2).

One protocol package, beside eval/afr/ and eval/sos/:
- protocol.py   `flipguard eval` (task "dds", its command `DDSTask.main`): EvalArgs, DDSTask, build_records, evaluate
- prompts.py    the paper's templates and the text the authors sent (mitigations: eval/mitigations.py)
- parse.py      reading a judgment out of a reply
- metrics.py    accuracies, DDS and flips from records
- report.py     `flipguard report`: summary.csv, flips_summary.csv, stats.csv, summary.md
- importer.py   `flipguard import-records`: the authors' per-item records as a run directory
- analyses/     the paper's further analyses (taxonomy, label ablation, perspective, cross-model)

`from flipguard.eval.dds import evaluate` keeps working: protocol.py's public names are
re-exported here.
"""

from flipguard.eval.dds.protocol import (
    CONDITION_KEYS,
    DDSTask,
    EvalArgs,
    build_records,
    default_run_dir,
    evaluate,
    parse_cases,
)

__all__ = ["CONDITION_KEYS", "DDSTask", "EvalArgs", "build_records", "default_run_dir", "evaluate",
           "parse_cases"]
