"""`flipguard sos`: stick-or-switch on one dataset for one or more models, then the report.

    flipguard sos recipes/sos_tiny.yaml
    flipguard sos --dataset medqa --models qwen7b=Qwen/Qwen2.5-7B-Instruct --n_items 200 --out runs/sos/medqa

A run directory holds one dataset and one prompt setting; several models (and prompting
mitigations) may share it and appear side by side in its report. Rerunning the same
command resumes: stored replies are reused turn by turn and nothing is asked twice.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

from flipguard.errors import FlipguardError
from flipguard.eval.backends.openai_api import BACKEND_ARGS_HELP
from flipguard.eval.sos.metrics import ABSTENTION_REFERENCES
from flipguard.eval.threads import THREADS_HELP, configure_threads

DATASETS = ("medqa", "medmcqa", "mmlu")
# dataset -> (evaluated split, exemplar split)
DEFAULT_SPLITS = {"medqa": ("test", "fewshot"), "medmcqa": ("dev", "fewshot"), "mmlu": ("test", "dev")}


@dataclasses.dataclass
class SosArgs:
    """Stick-or-switch evaluation (positive/negative conviction, flexibility) with report."""

    dataset: str = dataclasses.field(default="medqa", metadata={"help": f"One of {', '.join(DATASETS)}."})
    models: list[str] = dataclasses.field(
        default_factory=lambda: ["flipguard:tiny"],
        metadata={"help": "Models as [label=][backend:]model[|adapter_dir] (the model-spec syntax afr shares; backend defaults to --backend): hub id, local folder or 'flipguard:tiny'."},
    )
    backend: str = dataclasses.field(default="hf", metadata={"help": "hf | vllm | openai"})
    backend_args: str = dataclasses.field(default="{}", metadata={"help": BACKEND_ARGS_HELP})
    device: str | None = dataclasses.field(default=None, metadata={"help": "hf backend device (default cuda if available)."})
    batch_size: int = dataclasses.field(default=8, metadata={"help": "hf backend batch size."})
    mitigations: list[str] = dataclasses.field(
        default_factory=lambda: ["none"], metadata={"help": "System-prompt mitigations: none, be_honest, dehumanizing."}
    )
    scenarios: list[str] = dataclasses.field(
        default_factory=lambda: ["baseline", "positive", "negative", "flexibility"],
        metadata={"help": "Any of baseline, positive, negative, flexibility."},
    )
    n_items: int | None = dataclasses.field(default=None, metadata={"help": "Sample this many items (seeded, without replacement); default all."})
    subjects: str | None = dataclasses.field(default=None, metadata={"help": "MMLU only: comma-separated subjects."})
    data_root: str | None = dataclasses.field(default=None, metadata={"help": "Data root (default $FLIPGUARD_DATA, else the shipped samples)."})
    skip_invalid_items: bool = dataclasses.field(
        default=False, metadata={"help": "Leave out items with no usable key or < 2 distinct distractors (listed in run.json) instead of stopping."}
    )
    n_shots: int = dataclasses.field(default=3, metadata={"help": "Few-shot exemplars from the development pool."})
    target_position: str = dataclasses.field(default="random", metadata={"help": "Turn-1 position of the answer/NA: random (seeded) | first (paper's listing)."})
    format_reminder: bool = dataclasses.field(default=False, metadata={"help": "Repeat the 'Answer: <letter>' format in later turns (paper: no)."})
    max_new_tokens: int = dataclasses.field(default=64, metadata={"help": "Reply length limit (direct-answer setting)."})
    sampling: str = dataclasses.field(
        default="greedy",
        metadata={"help": "greedy (ours, the default: --temperature/--top_p apply, 0 = greedy) | model_default "
                          "(paper §4.2: each model's own default sampling settings, 'to mirror standard usage'; hf "
                          "uses its generation_config, vllm its engine defaults, openai requests carry no "
                          "temperature). Recorded in run.json."},
    )
    abstention_reference: str = dataclasses.field(
        default="ours",
        metadata={"help": "What the abstention penalty subtracts: ours (the default) = single-shot abstention rate with "
                          "NA replacing the answer; paper = single-shot accuracy, as Table A.2 computes it (its SS "
                          "column equals Table A.1's). Both are always computed; this picks the one in Table A.2's "
                          "place. Recorded in run.json."},
    )
    temperature: float = dataclasses.field(default=0.0, metadata={"help": "0 = greedy."})
    top_p: float = dataclasses.field(default=1.0, metadata={"help": "Nucleus sampling when temperature > 0."})
    seed: int = dataclasses.field(default=0, metadata={"help": "Item sample, distractor order, positions, exemplars, decoding, bootstrap."})
    repeats: int = dataclasses.field(default=1, metadata={"help": "Repeats per item (each with its own distractor order and decoding seed)."})
    n_boot: int = dataclasses.field(default=2000, metadata={"help": "Bootstrap resamples for the CIs."})
    out: str | None = dataclasses.field(default=None, metadata={"help": "Run directory (default runs/sos/<dataset>)."})
    report: bool = dataclasses.field(default=True, metadata={"help": "Write the report when the run finishes."})
    report_only: str | None = dataclasses.field(default=None, metadata={"help": "Only rebuild the report of this run directory."})
    threads: int | None = dataclasses.field(default=None, metadata={"help": THREADS_HELP})


SAMPLING = ("greedy", "model_default")


def load_mcq(dataset: str, split: str, data_root: str | None, skip_invalid: bool, subjects: str | None):
    """MCQ items of a dataset split (MMLU through its own loader)."""
    from flipguard.data.schema import DataError

    if dataset == "medqa":
        from flipguard.data.medqa import load_medqa

        return load_medqa(split, data_root, skip_invalid=skip_invalid)
    if dataset == "medmcqa":
        from flipguard.data.medmcqa import load_medmcqa

        return load_medmcqa(split, data_root, skip_invalid=skip_invalid)
    if dataset == "mmlu":
        from flipguard.data.mmlu import load_mmlu

        subj = [s.strip() for s in subjects.split(",") if s.strip()] if subjects else None
        return load_mmlu(split=split, data_root=data_root, subjects=subj)
    raise DataError(f"unknown dataset {dataset!r}; expected one of {DATASETS}")


def to_sos_items(mcq_items, dataset: str, skip_invalid: bool) -> tuple[list, list[str]]:
    """SosItems, and the messages of items left out (only with skip_invalid)."""
    from flipguard.data.schema import DataError
    from flipguard.eval.sos.protocol import sos_item

    items, skipped = [], []
    for mcq in mcq_items:
        try:
            items.append(sos_item(mcq, dataset, where=dataset))
        except DataError as exc:
            if not skip_invalid:
                raise DataError(f"{exc} (pass --skip_invalid_items to leave such items out; they are listed in run.json)") from None
            skipped.append(str(exc))
    return items, skipped


def sample_items(items: list, n: int | None, seed: int) -> list:
    """A seeded sample without replacement, kept in source order."""
    if n is None or n >= len(items):
        return list(items)
    chosen = set(random.Random(f"sos-sample:{seed}").sample(range(len(items)), n))
    return [it for i, it in enumerate(items) if i in chosen]


CONDITION_KEYS = ("dataset", "split", "seed", "n_items", "n_shots", "target_position", "format_reminder",
                  "generation", "repeats", "subjects", "data_root")


def claim_run_dir(run, meta: dict, write: bool = True) -> dict:
    """One dataset and prompt setting per run directory (`run`: an open RunDir); models/
    mitigations accumulate. write=False: only the check."""
    from flipguard.errors import UserError
    from flipguard.eval.records import RUN_META_FILE

    old = run.old
    clash = {k: (old.get(k), meta.get(k)) for k in CONDITION_KEYS if k in old and old.get(k) != meta.get(k)}
    if clash:
        detail = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in clash.items())
        raise UserError(f"{run.path / RUN_META_FILE}: this run directory holds another setting ({detail}); use another --out")
    merged = {**old, **meta}
    for key in ("models", "mitigations", "scenarios"):
        merged[key] = list(dict.fromkeys(list(old.get(key, [])) + list(meta.get(key, []))))
    return run.write_meta(merged) if write else merged


def run(args: SosArgs, progress: bool = True) -> tuple[Path, int]:
    """Run (or resume) the evaluation; returns the run directory and the requests sent."""
    from flipguard.eval.backends.base import GenerationConfig, get_backend, parse_backend_args, parse_model_ref
    from flipguard.errors import UserError
    from flipguard.eval.records import RECORDS_FILE, RecordStore, now_iso, open_run_dir
    from flipguard.eval.runner import check_context
    from flipguard.redact import redact_obj
    from flipguard.eval.sos.protocol import SCENARIOS, LazyBackend, SosSettings, first_requests, run_sos

    if args.dataset not in DATASETS:
        raise UserError(f"--dataset must be one of {DATASETS}, got {args.dataset!r}")
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        raise UserError(f"--scenarios: unknown {bad}; expected some of {SCENARIOS}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {args.repeats}")
    backend_kwargs = parse_backend_args(args.backend_args)
    try:
        specs = [parse_model_ref(s, args.backend, "--models") for s in args.models]
    except FlipguardError as exc:
        raise UserError(str(exc)) from None
    eval_split, fewshot_split = DEFAULT_SPLITS[args.dataset]
    mcq = load_mcq(args.dataset, eval_split, args.data_root, args.skip_invalid_items, args.subjects)
    items, skipped = to_sos_items(mcq, args.dataset, args.skip_invalid_items)
    items = sample_items(items, args.n_items, args.seed)
    if not items:
        raise UserError(f"{args.dataset}: no items to evaluate")
    pool, _ = to_sos_items(load_mcq(args.dataset, fewshot_split, args.data_root, False, args.subjects), args.dataset, False)
    if args.sampling not in SAMPLING:
        raise UserError(f"--sampling must be one of {SAMPLING}, got {args.sampling!r}")
    if args.abstention_reference not in ABSTENTION_REFERENCES:
        raise UserError(f"--abstention_reference must be one of {ABSTENTION_REFERENCES}, got {args.abstention_reference!r}")
    gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens,
                                  temperature=None if args.sampling == "model_default" else args.temperature,
                                  top_p=args.top_p, seed=args.seed)
    run_dir = Path(args.out) if args.out else Path("runs") / "sos" / args.dataset
    try:
        settings_of = {m: SosSettings(seed=args.seed, n_shots=args.n_shots, target_position=args.target_position,
                                      format_reminder=args.format_reminder, mitigation=m) for m in args.mitigations}
    except FlipguardError as exc:
        raise UserError(str(exc)) from None
    meta = {
        "protocol": "sos", "dataset": args.dataset, "split": eval_split, "fewshot_split": fewshot_split,
        "seed": args.seed, "n_items": args.n_items, "n_items_evaluated": len(items), "n_shots": args.n_shots,
        "target_position": args.target_position, "format_reminder": args.format_reminder,
        "generation": gen_config.key(), "sampling": args.sampling,
        "abstention_reference": args.abstention_reference, "repeats": args.repeats, "subjects": args.subjects,
        "data_root": args.data_root, "n_boot": args.n_boot, "backend": args.backend,
        "models": [s.label for s in specs],
        **({"model_backends": {s.label: s.backend for s in specs}}
           if any(s.backend != args.backend for s in specs) else {}),
        "mitigations": list(args.mitigations), "scenarios": list(args.scenarios),
        "skipped_items": skipped,
        "command": redact_obj(["flipguard", "sos", *sys.argv[2:]]) if sys.argv[1:2] == ["sos"] else None,
        "updated": now_iso(),
    }
    with open_run_dir(run_dir, "sos") as claimed:  # one writer per run directory, held until the last record
        claim_run_dir(claimed, meta, write=False)  # another setting: refused before any model loads
        store = RecordStore(run_dir / RECORDS_FILE)
        backends = []
        for ref in specs:
            kwargs = dict(backend_kwargs)
            if ref.backend == "hf":
                kwargs = {"batch_size": args.batch_size, "device": args.device, **kwargs}
            if ref.adapter:
                kwargs["adapter"] = ref.adapter
            backends.append((ref.label, LazyBackend(lambda r=ref, kw=kwargs: get_backend(r.backend, r.model, **kw))))
        # an item longer than a model's context: refused (item id, token count, limit) before
        # run.json or any record is written; the first model to run is the one left loaded
        for i, (label, backend) in reversed(list(enumerate(backends))):
            pending = [r for m in args.mitigations
                       for r in first_requests(items, pool, model=label, backend_name=args.backend,
                                               settings=settings_of[m], scenarios=args.scenarios, split=eval_split,
                                               gen_config=gen_config, repeats=args.repeats)
                       if r.key not in store]
            if pending:
                check_context(backend, pending, gen_config)
                if i:
                    backend.release()
        claim_run_dir(claimed, meta)
        sent = 0
        for label, backend in backends:
            for mitigation in args.mitigations:
                sent += run_sos(items, pool, backend, store, model=label, backend_name=args.backend,
                                settings=settings_of[mitigation], scenarios=args.scenarios, split=eval_split,
                                gen_config=gen_config, repeats=args.repeats,
                                chunk_size=max(args.batch_size * 4, 16), progress=progress)
            backend.release()
        del backends
    print(f"{run_dir}: {len(items)} items x {len(specs)} model(s) x {len(args.mitigations)} mitigation(s); "
          f"{sent} new model requests")
    return run_dir, sent


def main(argv: list[str]) -> int:
    from flipguard.config import parse_dataclasses
    from flipguard.eval.sos.report import write_report

    args = parse_dataclasses(argv, SosArgs, prog="flipguard sos", description=SosArgs.__doc__)
    configure_threads(args.threads)
    if args.report_only:
        print(write_report(args.report_only))
        return 0
    run_dir, _ = run(args)
    if args.report:
        path = write_report(run_dir, seed=args.seed, n_boot=args.n_boot)
        print(path)
    return 0
