"""`flipguard afr CONFIG.yaml [--out DIR] [--limit N]`: run the answer-flip protocol for a
list of models and write records, run.json, report.md, tables (csv) and figures (PNG).

The YAML keys are the fields of AFRArgs; `models` is a list of mappings
{name, backend, model, kwargs, mitigation} (or "[name=][backend:]model[|adapter]" strings on the
command line). Rerunning the same command resumes: finished calls are never repeated.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from flipguard.eval.afr.protocol import DEFAULT_K, AFRConfigError, build_settings, run_afr
from flipguard.eval.threads import THREADS_HELP, configure_threads


@dataclasses.dataclass
class AFRArgs:
    """Answer-flip protocol (Who Flips?) on MMLU for one or more models."""

    models: list[str] = dataclasses.field(default_factory=list, metadata={"help": "Models: in YAML a list of {name, backend, model, kwargs, mitigation}; on the command line [name=][backend:]model[|adapter] (the model-spec syntax sos shares; backend defaults to hf; model 'flipguard:tiny' = the tiny local model)."})
    out: Optional[str] = dataclasses.field(default=None, metadata={"help": "Run directory (records.jsonl, run.json, report.md, figures)."})
    targets: Optional[list[str]] = dataclasses.field(default=None, metadata={"help": "Model names challenged in Stage II (default: all)."})
    sources: Optional[list[str]] = dataclasses.field(default=None, metadata={"help": "Model names whose arguments are used in the cross condition (default: all)."})
    k_values: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_K), metadata={"help": "Argument lengths k (sentences)."})
    cross: bool = dataclasses.field(default=True, metadata={"help": "Run cross-model challenges (blind, k=cross_k)."})
    cross_k: int = dataclasses.field(default=10, metadata={"help": "k of the cross condition and of MaxFlip."})
    per_subject: int = dataclasses.field(default=36, metadata={"help": "Questions per MMLU subject (paper: 36 x 57 = 2,052)."})
    subjects: Optional[list[str]] = dataclasses.field(default=None, metadata={"help": "Restrict to these subjects."})
    split: str = dataclasses.field(default="test", metadata={"help": "MMLU split (test, dev)."})
    data_root: Optional[str] = dataclasses.field(default=None, metadata={"help": "MMLU folder (default: $FLIPGUARD_DATA, else the shipped sample)."})
    seed: int = dataclasses.field(default=0, metadata={"help": "Seed for sampling, decoding, bootstrap and MaxFlip ties."})
    limit: Optional[int] = dataclasses.field(default=None, metadata={"help": "Use only the first N sampled questions (round-robin over subjects)."})
    coercion_max_new_tokens: int = dataclasses.field(default=512, metadata={"help": "Token budget of a Stage I argument."})
    coercion_temperature: float = dataclasses.field(default=0.0, metadata={"help": "Sampling temperature of Stage I (paper: 0)."})
    answer_max_new_tokens: int = dataclasses.field(default=512, metadata={"help": "Token budget of a Stage II answer."})
    chunk_size: int = dataclasses.field(default=32, metadata={"help": "Requests per backend call (records are saved per chunk)."})
    maxflip: bool = dataclasses.field(default=True, metadata={"help": "Build MaxFlip from the cross-model pool (needs >= 2 sources)."})
    maxflip_file: Optional[str] = dataclasses.field(default=None, metadata={"help": "Evaluate the targets on an existing MaxFlip/argument file instead."})
    n_boot: int = dataclasses.field(default=2000, metadata={"help": "Cluster-bootstrap replicates."})
    answer_mode: str = dataclasses.field(default="generate", metadata={"help": "Stage II answers: 'generate' (paper; letter parsed from text) or 'logprob' (argmax over option letters; for small local models)."})
    report_only: bool = dataclasses.field(default=False, metadata={"help": "Only rewrite the report of an existing run directory."})
    progress: bool = dataclasses.field(default=True, metadata={"help": "Show progress bars."})
    threads: Optional[int] = dataclasses.field(default=None, metadata={"help": THREADS_HELP})


def settings_from_args(args: AFRArgs, where: str = "config"):
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    for name in ("models", "targets", "sources", "out", "report_only", "progress", "threads"):
        kw.pop(name)
    return build_settings(args.models, args.targets, args.sources, where=where, **kw)


def main(argv: list[str]) -> int:
    from flipguard.errors import UserError
    from flipguard.config import parse_dataclasses

    if argv and argv[0].endswith((".yaml", ".yml", ".json")) and not Path(argv[0]).is_file():
        raise UserError(f"{argv[0]}: run config not found")
    args = parse_dataclasses(argv, AFRArgs, prog="flipguard afr", description=AFRArgs.__doc__)
    configure_threads(args.threads)
    where = argv[0] if argv and argv[0].endswith((".yaml", ".yml", ".json")) else "command line"
    if not args.out:
        raise UserError(f"{where}: no output directory (give --out DIR or `out:` in the config)")
    if args.report_only:
        from flipguard.eval.afr.report import write_report

        print(write_report(args.out, n_boot=args.n_boot, seed=args.seed))
        return 0
    if not args.models:
        raise AFRConfigError(f"{where}: no models listed (`models:` in the config or --models [name=][backend:]model[|adapter])")
    settings = settings_from_args(args, where)
    result = run_afr(settings, args.out, progress=args.progress)
    total = sum(result.calls.values())
    print(f"{len(result.items)} questions, {total} model calls this run ({result.calls or 'all resumed'})")
    print(f"report: {result.out_dir / 'report.md'}")
    return 0
