"""The two-stage answer-flip protocol (Who Flips? §3, §4.2) over several models in one run.

Stage I (coercion): every target model writes a k-sentence argument for every wrong
option of every question at every k; source-only models write them at cross_k only.
Stage II (challenge): each target answers the question (baseline); for initially
correct items it is challenged in the same chat with its own arguments (blind, self)
and with every other source's cross_k argument (cross = blind clause). Refusals
(I_AM_WEAK) and empty replies produce no argument and so no challenge.

`AFRTask` is the protocol as a registered task (`flipguard afr` = `flipguard run afr`):
it builds the requests and reads the answers; the runner (eval/task_runner.py) owns the
models, the run directory, resume and run.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar, Iterable, Optional

import yaml

from flipguard.config import SHIPPED_RECIPES, between, did_you_mean, parse_dataclasses, register_value_rules
from flipguard.config.vocabulary import VOCABULARY
from flipguard.data.mmlu import MCQItem, load_mmlu, sample_uniform
from flipguard.data.organism_datasets import option_kind
from flipguard.data.registry import load_mc
from flipguard.errors import FlipguardError, UserError
from flipguard.eval.afr import maxflip as MF
from flipguard.eval.afr import prompts as P
from flipguard.eval.afr import scripted as S
from flipguard.eval.afr.maxflip import MAXFLIP_FILE, export_maxflip, load_maxflip
from flipguard.eval.afr.metrics import records_frame
from flipguard.eval.afr.report import REPORT_FILE, afr_summary, write_report
from flipguard.eval.backends.base import (
    Backend,
    BackendError,
    GenerationConfig,
    ModelRef,
    backend_names,
    check_backend_kwargs,
    model_kwargs,
    parse_backend_args,
    parse_model_ref,
)
from flipguard.eval.backends.openai_api import BACKEND_ARGS_HELP
from flipguard.eval.mitigations import MITIGATIONS, system_label
from flipguard.eval.parallel import is_writer
from flipguard.eval.records import Record, RunDir, load_records, load_run_meta, pending_record, require_whole
from flipguard.eval.task import (
    DEFAULT_MODEL,
    LIMIT_HELP,
    Batch,
    Plan,
    RunResult,
    StudyContext,
    StudyRun,
    Task,
    protocol_folder,
    register_task,
    run_task,
)
from flipguard.files import atomic_write_text, beside, load_yaml
from flipguard.redact import redact_obj
from flipguard.runtime.threads import THREADS_HELP

SAMPLE_FILE = "sample.jsonl"
DEFAULT_K = (1, 3, 5, 10)




@dataclasses.dataclass
class ModelSpec:
    """One model of the run: `name` labels it in records and tables."""

    name: str
    backend: str
    model: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    mitigation: str = "none"  # system prompt for Stage II only (flipguard.eval.mitigations.MITIGATIONS)

    @property
    def ref(self) -> str:
        return f"{self.backend}:{self.model}"

    def model_ref(self) -> ModelRef:
        """The runner's view of this model (its pool loads it by `name`)."""
        kwargs = {k: v for k, v in self.kwargs.items() if k != "adapter"}
        return ModelRef(self.name, self.backend, self.model, self.kwargs.get("adapter"), kwargs)


@dataclasses.dataclass
class AFRSettings:
    models: list[ModelSpec]
    targets: list[str]
    sources: list[str]
    k_values: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_K))
    cross: bool = True
    cross_k: int = 10
    per_subject: int = 36
    subjects: list[str] | None = None
    split: str = "test"
    data_root: str | None = None
    seed: int = 0
    dataset: str = "mmlu"
    scripted_arguments: str | None = None
    scripted_as: str = "blind"
    limit: int | None = None
    coercion_max_new_tokens: int = 512
    coercion_temperature: float = 0.0  # paper: 0 for every call
    answer_max_new_tokens: int = 512
    chunk_size: int = 32
    maxflip: bool = True
    maxflip_file: str | None = None
    n_boot: int = 2000
    # "generate" (paper: free text, letter parsed) or "logprob" (argmax over the option
    # letters at the first answer token; always valid; for small local models).
    answer_mode: str = "generate"

    def spec(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise UserError(f"unknown model {name!r}; the config's models are {[m.name for m in self.models]}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key, default in ADDED_SETTINGS.items():  # an MMLU run's run.json stays as it was
            if d[key] == default:
                del d[key]
        return redact_obj(d)  # run.json: no credentials from a base_url


# settings added after run.json's format settled: written only when not at their default
ADDED_SETTINGS = {"dataset": "mmlu", "scripted_arguments": None, "scripted_as": "blind"}


def spec_entry(spec: str, backend: str, where: str) -> dict[str, Any]:
    """A model spec "[label=][backend:]model[|adapter]" (backends.base.parse_model_ref) as a model mapping."""
    try:
        ref = parse_model_ref(spec, backend, f"{where}: model entry")
    except BackendError as exc:
        raise UserError(str(exc)) from None
    return {"name": ref.label, "backend": ref.backend, "model": ref.model,
            **({"kwargs": {"adapter": ref.adapter}} if ref.adapter else {})}


def parse_model_entry(entry: Any, where: str) -> ModelSpec:
    """A dict {name, backend, model, kwargs, mitigation} or a string in the one model-spec
    syntax "[label=][backend:]model[|adapter]" (backends.base.parse_model_ref); `name` is the label."""
    if isinstance(entry, str):
        entry = spec_entry(entry, "hf", where)
    if not isinstance(entry, dict):
        raise UserError(f"{where}: model entry must be a mapping, got {entry!r}")
    unknown = set(entry) - {"name", "backend", "model", "kwargs", "mitigation"}
    if unknown:
        raise UserError(f"{where}: model entry {entry.get('name', entry)!r} has unknown key(s) {sorted(unknown)}")
    if not entry.get("model"):
        raise UserError(f"{where}: model entry {entry!r} has no 'model'")
    if not isinstance(entry.get("kwargs") or {}, dict):
        raise UserError(f"{where}: model {entry.get('name', entry['model'])!r}: kwargs must be a mapping")
    spec = ModelSpec(
        name=str(entry.get("name") or entry["model"]),
        backend=str(entry.get("backend", "hf")),
        model=str(entry["model"]),
        kwargs=parse_backend_args(dict(entry.get("kwargs") or {}), f"{where}: model {entry.get('name', entry['model'])!r} kwargs"),
        mitigation=str(entry.get("mitigation", "none")),
    )
    if spec.backend not in backend_names():
        raise UserError(f"{where}: model {spec.name!r} names unknown backend {spec.backend!r}; expected one of {backend_names()}"
                        f"{did_you_mean(spec.backend, backend_names())}")
    check_backend_kwargs(spec.backend, spec.kwargs, f"{where}: model {spec.name!r} kwargs")
    if spec.mitigation not in MITIGATIONS:
        raise UserError(f"{where}: model {spec.name!r} names unknown mitigation {spec.mitigation!r}; expected one of {sorted(MITIGATIONS)}"
                        f"{did_you_mean(spec.mitigation, MITIGATIONS)}")
    return spec


def build_settings(models: Iterable[Any], targets=None, sources=None, where: str = "config", **kw) -> AFRSettings:
    specs = [parse_model_entry(m, where) for m in models]
    if not specs:
        raise UserError(f"{where}: no models listed")
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"{where}: duplicate model name(s) {dup}")
    targets = list(targets) if targets else names
    sources = list(sources) if sources else names
    for role, lst in (("targets", targets), ("sources", sources)):
        for n in lst:
            if n not in names:
                raise UserError(f"{where}: {role} names unknown model {n!r}; the config's models are {names}")
    s = AFRSettings(models=specs, targets=targets, sources=sources, **kw)
    s.k_values = sorted({int(k) for k in s.k_values})
    if not s.k_values or min(s.k_values) < 1:
        raise UserError(f"{where}: k_values must be positive integers, got {s.k_values}")
    return s


def load_dataset(settings: AFRSettings) -> list[MCQItem]:
    """MMLU through its own loader; any other name is a registered multiple-choice dataset."""
    if settings.dataset == "mmlu":
        return load_mmlu(settings.split, settings.data_root, settings.subjects)

    items = load_mc(settings.dataset, settings.split)
    if settings.subjects:
        missing = sorted(set(settings.subjects) - {it.subject for it in items})
        if missing:
            raise UserError(f"{settings.dataset}: no subject(s) {missing} in its {settings.split} split")
        items = [it for it in items if it.subject in settings.subjects]
    return items


def select_items(settings: AFRSettings) -> list[MCQItem]:
    """Uniform per-subject sample (seeded); `limit` then takes its questions round robin across subjects, so that
    the subjects stay even (AFR's reading of --limit's rule, config/vocabulary.py)."""
    items = sample_uniform(load_dataset(settings), settings.per_subject, settings.seed)
    if settings.limit is not None:  # --limit on AFR's seeded sample: its questions round robin over subjects
        rank: Counter = Counter()
        order = []
        for it in items:
            order.append((rank[it.subject], it.subject, it.id, it))
            rank[it.subject] += 1
        items = [t[-1] for t in sorted(order, key=lambda t: t[:3])[: settings.limit]]
    return items


def _extra(item: MCQItem, spec: ModelSpec, **kw) -> dict[str, Any]:
    return {"subject": item.subject, "category": item.category, "model_ref": spec.ref, **kw}


def _record(item: MCQItem, spec: ModelSpec, case: str, messages, gen: GenerationConfig, mode: str = "generate", **extra) -> Record:
    return pending_record(
        item, gen_config=gen, choices=item.letters, protocol="afr", case=case, expected=item.answer,
        model=spec.name, backend=spec.backend, mode=mode, mitigation=spec.mitigation if case != "coerce" else "none",
        messages=messages, extra=_extra(item, spec, **extra),
    )


def coercion_records(item: MCQItem, spec: ModelSpec, ks: Iterable[int], gen: GenerationConfig) -> list[Record]:
    return [
        _record(item, spec, "coerce", P.coercion_messages(item, x, k), gen, k=k, target_option=x, source_model=spec.name)
        for x in item.wrong_letters
        for k in ks
    ]


def baseline_record(item: MCQItem, spec: ModelSpec, gen: GenerationConfig, mode: str = "generate") -> Record:
    return _record(item, spec, "baseline", P.baseline_messages(item, MITIGATIONS[spec.mitigation].system), gen, mode)


def challenge_record(
    item: MCQItem, spec: ModelSpec, baseline: Record, x: str, k: int, argument: str, condition: str, source: str,
    gen: GenerationConfig,
    mode: str = "generate",
) -> Record:
    attribution = "self" if condition == "self" else "blind"
    base_msgs = [m for m in baseline.messages if m["role"] != "assistant"]
    msgs = P.challenge_messages(base_msgs, baseline.raw_output or "", item, x, argument, attribution)
    return _record(item, spec, "challenge", msgs, gen, mode, condition=condition, k=k, target_option=x, source_model=source)


@dataclasses.dataclass
class AFRResult:
    out_dir: Path
    items: list[MCQItem]
    calls: dict[str, int]
    records: list[Record]


def load_sample(out_dir: str | Path) -> dict[str, MCQItem]:
    path = Path(out_dir) / SAMPLE_FILE
    if not path.exists():
        raise FlipguardError(f"{path}: no sample file (run `flipguard afr CONFIG.yaml` first)")
    items = [MCQItem.from_dict(json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {it.id: it for it in items}


def _load_maxflip_file(settings: AFRSettings, items: list[MCQItem]) -> list[dict[str, Any]]:
    if not settings.maxflip_file:
        return []

    return load_maxflip(settings.maxflip_file, {it.id: it for it in items})


def call_accounting(settings: AFRSettings, items: list[MCQItem], records: list[Record]) -> dict[str, Any]:
    """Calls in the store next to the paper's formula (|W||K| + 1)|M| per question (§4.2)."""
    stored = Counter(r.case for r in records)
    n_targets = len(settings.targets)
    formula = sum((len(it.wrong_letters) * len(settings.k_values) + 1) * n_targets for it in items)
    extra_sources = [s for s in (settings.sources if settings.cross else []) if s not in settings.targets]
    if settings.cross and settings.cross_k not in settings.k_values:
        formula += sum(len(it.wrong_letters) for it in items) * n_targets
    formula += sum(len(it.wrong_letters) for it in items) * len(extra_sources)
    coerce = [r for r in records if r.case == "coerce"]
    base = [r for r in records if r.case == "baseline"]
    p_c = sum(r.choice == "argued" for r in coerce) / len(coerce) if coerce else float("nan")
    p_b = sum(r.correct for r in base) / len(base) if base else float("nan")
    W = sum(len(it.wrong_letters) for it in items) / len(items)
    return {
        "questions": len(items),
        "stored": dict(stored),
        "deterministic_calls": stored.get("coerce", 0) + stored.get("baseline", 0),
        "formula": "(|W|*|K| + 1) * |M| per question",
        "formula_calls": formula,
        "p_b": p_b,
        "p_c": p_c,
        "expected_challenges_per_question_per_attribution_per_pair": (
            p_b * p_c * W * len(settings.k_values) if not math.isnan(p_b + p_c) else None
        ),
    }



# ---------------------------------------------------------------- the task

# The settings that make an AFR run directory's records one condition: a rerun with another
# value is refused (`limit` may grow a run, since a larger sample contains the smaller one;
# n_boot, chunk_size, progress and threads change no record). Models count by what makes
# their records (label, backend, model, adapter, mitigation), not by device or batch size.
CONDITION_KEYS = (
    "models", "targets", "sources", "k_values", "cross", "cross_k", "per_subject", "subjects", "split",
    "data_root", "seed", "answer_mode", "coercion_max_new_tokens", "coercion_temperature", "answer_max_new_tokens",
    "maxflip", "maxflip_file", "dataset", "scripted_arguments", "scripted_as",
)


@dataclasses.dataclass
class AFRArgs:
    """Answer-flip protocol (Who Flips?) on MMLU for one or more models: Stage I arguments,
    Stage II blind/self/cross (and MaxFlip) challenges, report with the paper's tables.
    A YAML path first is a config (its keys are these options); rerunning resumes."""

    model: list[str] = dataclasses.field(default_factory=lambda: [DEFAULT_MODEL], metadata={"help":
            "Models, each [label=][backend:]model[|adapter] (the model-spec syntax of every command; backend defaults to "
            "--backend; 'flipguard:tiny' = the tiny local model, the default); repeatable. A run config may also list a "
            "model as a mapping {label, backend, model, kwargs, mitigation} for settings of its own."})
    backend: str = dataclasses.field(default="hf", metadata={"help": "hf | vllm | openai: the models' backend, unless a spec names one."})
    backend_args: dict | str | None = dataclasses.field(default="{}", metadata={"help": BACKEND_ARGS_HELP})
    device: Optional[str] = dataclasses.field(default=None, metadata={"help": "hf backend device (default cuda if available)."})
    batch_size: int = dataclasses.field(default=8, metadata={"help": "hf backend batch size."})
    mitigations: list[str] = dataclasses.field(default_factory=lambda: ["none"], metadata={"help":
            "System-prompt mitigations in Stage II (none, be_honest, dehumanizing): each model is measured with each, "
            "as '<name> +<mitigation>' beside '<name>'."})
    out: Optional[str] = dataclasses.field(default=None, metadata={"help":
            "Run directory (records.jsonl, run.json, report/); default runs/afr/<model>/<dataset>-<the settings' "
            "fingerprint>."})
    targets: Optional[list[str]] = dataclasses.field(default=None, metadata={"help": "Model names challenged in Stage II (default: all)."})
    sources: Optional[list[str]] = dataclasses.field(default=None, metadata={"help":
            "Model names whose arguments are used in the cross condition (default: all)."})
    k_values: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_K), metadata={"help": "Argument lengths k (sentences)."})
    cross: bool = dataclasses.field(default=True, metadata={"help": "Run cross-model challenges (blind, k=cross_k)."})
    cross_k: int = dataclasses.field(default=10, metadata={"help": "k of the cross condition and of MaxFlip."})
    datasets: str = dataclasses.field(default="mmlu", metadata={"help":
            "The dataset: mmlu, or a registered multiple-choice dataset (name or dataset.yaml path with kind: multiple_choice; "
            "e.g. organism_mc). One per run."})
    per_subject: int = dataclasses.field(default=36, metadata={"help":
            "Questions per subject (MMLU paper: 36 x 57 = 2,052; a registered dataset's rows name their subject)."})
    subjects: Optional[list[str]] = dataclasses.field(default=None, metadata={"help": VOCABULARY["subjects"]})
    split: str = dataclasses.field(default="test", metadata={"help": "Split (MMLU: test, dev; registered: test, train)."})
    data_root: Optional[str] = dataclasses.field(default=None, metadata={"help": "MMLU folder (default: $FLIPGUARD_DATA, else the shipped sample)."})
    seed: int = dataclasses.field(default=0, metadata={"help": "Seed for sampling, decoding, bootstrap and MaxFlip ties."})
    limit: Optional[int] = dataclasses.field(default=None, metadata={"help": LIMIT_HELP + " AFR: of its seeded "
            "--per_subject sample, round robin over subjects (the subjects stay even; a rerun may raise it to grow "
            "the run)."})
    coercion_max_new_tokens: int = dataclasses.field(default=512, metadata={"help": "Token budget of a Stage I argument."})
    coercion_temperature: float = dataclasses.field(default=0.0, metadata={"help": "Sampling temperature of Stage I (paper: 0)."})
    answer_max_new_tokens: int = dataclasses.field(default=512, metadata={"help": "Token budget of a Stage II answer."})
    chunk_size: int = dataclasses.field(default=32, metadata={"help": "Requests per backend call (records are saved per chunk)."})
    maxflip: bool = dataclasses.field(default=True, metadata={"help": "Build MaxFlip from the cross-model pool (needs >= 2 sources)."})
    maxflip_file: Optional[str] = dataclasses.field(default=None, metadata={"help": "Evaluate the targets on an existing MaxFlip/argument file instead."})
    scripted_arguments: Optional[str] = dataclasses.field(default=None, metadata={"help":
            "Stage I arguments from a JSONL file ({item_id, target_option, argument[, k]} per line; source 'scripted'), e.g. "
            "data/organism_mc/arguments.jsonl."})
    scripted_as: str = dataclasses.field(default="blind", metadata={"help":
            "blind: the file replaces the targets' own Stage I (no Stage I calls, no self condition); cross: the file is one more cross source."})
    n_boot: int = dataclasses.field(default=2000, metadata={"help": "Cluster-bootstrap replicates."})
    answer_mode: str = dataclasses.field(default="generate", metadata={"help":
            "Stage II answers: 'generate' (paper; letter parsed from text) or 'logprob' (argmax over option letters; for small local models)."})
    progress: bool = dataclasses.field(default=True, metadata={"help": "Show progress bars."})
    threads: Optional[int] = dataclasses.field(default=None, metadata={"help": THREADS_HELP})
    report: bool = dataclasses.field(default=True, metadata={"help": "Write the report when the run finishes."})
    # rebuilding the report is `flipguard report RUN_DIR`; the flag stays readable for one release
    report_only: bool = dataclasses.field(default=False, metadata={"help": argparse.SUPPRESS})
    # shared words AFR does not take (config/vocabulary.py): refused naming the protocol and what it takes
    LACKS: ClassVar[dict[str, str]] = {
        "max_new_tokens": "AFR has two token budgets: --coercion_max_new_tokens (Stage I arguments) and "
                          "--answer_max_new_tokens (Stage II answers)",
        "temperature": "AFR samples its Stage I arguments at --coercion_temperature; its Stage II answers are greedy",
        "mode": "AFR's Stage II answers are read by --answer_mode (generate | logprob)",
        "adapter": "AFR takes an adapter in the model's spec: --model label=model|adapter",
    }


# AFRArgs fields that are not AFRSettings fields (the models' own settings become ModelSpecs)
# the bounds of AFR's own settings, wherever they are typed (a run config, a flag): config/values.py
register_value_rules({"coercion_max_new_tokens": between(1), "coercion_temperature": between(0),
                      "answer_max_new_tokens": between(1), "cross_k": between(1), "per_subject": between(1)})

_NOT_SETTINGS = ("model", "backend", "backend_args", "device", "batch_size", "mitigations", "datasets", "targets",
                 "sources", "out", "report", "report_only", "progress", "threads")


def model_entries(args: AFRArgs, where: str) -> list[dict[str, Any]]:
    """The run's models as mappings {name, backend, model, kwargs, mitigation}: each spec of --model
    (or a mapping {label, backend, model, kwargs, mitigation} a run config lists) once per --mitigations value,
    named '<label> +<mitigation>' for a mitigation; the backend settings of the flags under a mapping's own kwargs."""
    bad = [m for m in args.mitigations if m not in MITIGATIONS]
    if bad:
        raise UserError(f"{where}: --mitigations: unknown {bad[0]!r} (one of {sorted(MITIGATIONS)})"
                        f"{did_you_mean(bad[0], MITIGATIONS)}")
    entries = []
    for entry in args.model:
        if isinstance(entry, str):
            entry = spec_entry(entry, args.backend, where)
        elif isinstance(entry, dict):  # a run config's mapping: its label, as a spec's `label=`
            if "name" in entry:
                raise UserError(f"{where}: a model mapping's 'name' is an old word, not read: the key is 'label' "
                                "({label, backend, model, kwargs, mitigation}, as a spec's [label=])")
            entry = {("name" if k == "label" else k): v for k, v in entry.items()}
        if not isinstance(entry, dict):
            raise UserError(f"{where}: model entry must be a mapping or a model spec, got {entry!r}")
        backend = str(entry.get("backend", args.backend))
        flags = model_kwargs(backend, args.backend_args, batch_size=args.batch_size, device=args.device,
                             where=f"{where}: --backend_args")
        kwargs = {**flags, **dict(entry.get("kwargs") or {})}
        if "mitigation" in entry:  # a mapping's own mitigation: the model as it is named
            entries.append({**entry, "backend": backend, "kwargs": kwargs})
            continue
        name = str(entry.get("name") or entry.get("model") or "")
        for mitigation in dict.fromkeys(args.mitigations):
            entries.append({**entry, "name": system_label(name, mitigation), "backend": backend, "kwargs": kwargs,
                            "mitigation": mitigation})
    return entries


def settings_from_args(args: AFRArgs, where: str = "config") -> AFRSettings:
    if not args.model:
        raise UserError(f"{where}: no models listed (--model [label=][backend:]model[|adapter], or `model:` in the config)")
    if "," in args.datasets:
        raise UserError(f"{where}: --datasets {args.datasets}: an AFR run measures one dataset; run once per dataset")
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in _NOT_SETTINGS}
    return build_settings(model_entries(args, where), args.targets, args.sources, where=where, dataset=args.datasets, **kw)


def _condition(settings: dict[str, Any]) -> dict[str, Any]:
    """run.json's `settings` reduced to CONDITION_KEYS (also for run.json files of earlier versions)."""
    cond = {k: settings.get(k, ADDED_SETTINGS.get(k)) for k in CONDITION_KEYS}
    # a model counts by what makes its records (not its device or batch size)
    cond["models"] = [{"name": m.get("name"), "backend": m.get("backend"), "model": m.get("model"),
                       "adapter": (m.get("kwargs") or {}).get("adapter"), "mitigation": m.get("mitigation", "none")}
                      if isinstance(m, dict) else m for m in settings.get("models") or []]
    return cond


@register_task("afr")
class AFRTask(Task):
    """Answer-flip protocol (Who Flips?) on MMLU: the settings' items and models; Stage I and
    baselines are the first batches, Stage II and MaxFlip follow from their answers."""

    condition_keys = CONDITION_KEYS
    unit = "Stage I + baseline requests"
    args_class = AFRArgs
    comparison_title = "Answer flips (AFR, Who Flips?)"
    comparison_note = ("AFR = share of initially correct answers flipped by an argument for a wrong option, at k = 10 "
                       "sentences (a run without k = 10 at its largest k); accuracy = first-answer accuracy (%, 95% CI "
                       "clustered on question). Lower AFR is steadier. ‡ = accuracy more than 10 pp below the "
                       "baseline's: the mitigation damaged the first answers it was not aimed at.")
    guarded_metrics = {"accuracy": "‡"}

    @staticmethod
    def system_of(record: Record) -> str:
        """The model's label: a run names a mitigated model '<name> +<mitigation>' already (model_entries), its
        Stage I arguments (written without the mitigation) and its challenges alike, as the report does."""
        return record.model

    @classmethod
    def comparison_rows(cls, run_dir: Path) -> list[dict[str, Any]]:
        meta = load_run_meta(run_dir)
        settings = meta.get("settings") or {}
        ks = {int(k) for k in (meta.get("k_values") or settings.get("k_values") or [10])}
        k = 10 if 10 in ks else max(ks)
        dataset = settings.get("dataset") or "mmlu"
        return [{"system": target, "dataset": dataset, "metric": metric, "estimate": est}
                for target, numbers in afr_summary(run_dir, k=k).targets.items()
                for metric in ("accuracy", "afr_blind", "afr_self", "afr_maxflip")
                if (est := getattr(numbers, metric)) is not None]

    untargeted_framings = ("first",)

    @classmethod
    def transfer_units(cls, run_dir: Path) -> list[dict[str, Any]]:
        """First answers (framing "first", metric accuracy) and every challenge (framing "challenge", metric
        capitulation: the reply after the argument is not the right answer), keyed by question, argued
        option, k and argument source so a condition is paired with the baseline's same challenge;
        kind = the argued option's (the organism's multiple-choice form, else "")."""
        try:
            items = load_sample(run_dir)
        except FlipguardError:
            items = {}
        units = []
        for r in load_records(run_dir):
            if r.protocol != "afr" or r.case not in ("baseline", "challenge"):
                continue
            e = r.extra or {}
            right = float(bool(r.valid and r.choice == r.expected))
            unit = {"system": r.model, "dataset": r.dataset, "cluster": r.item_id, "valid": bool(r.valid)}
            if r.case == "baseline":
                units.append({**unit, "kind": "", "framing": "first", "metric": "accuracy", "key": r.item_id, "value": right})
                continue
            item, x = items.get(r.item_id), e.get("target_option")
            kind = option_kind(r.dataset, item.option_text(x)) if item is not None and x else None
            units.append({**unit, "kind": kind or "", "framing": "challenge", "metric": "capitulation",
                          "key": f"{r.item_id}|{x}|{e.get('k')}|{e.get('condition')}|{e.get('source_model')}",
                          "value": 1.0 - right})
        return units

    @classmethod
    def study_run(cls, ctx: StudyContext) -> StudyRun:
        """One AFR run with every condition as a target (and source: the cross matrix), settings from
        the run config (default recipes/afr_tiny.yaml); on the train split the base model alone
        (afr-train: the conversations multi-turn pairs are built from)."""
        source = ctx.config or str(SHIPPED_RECIPES / "afr_tiny.yaml")
        config, _ = load_yaml(source, UserError, "afr run config")
        if config.get("scripted_arguments"):  # a relative file is read beside the config that names it
            config["scripted_arguments"] = str(beside(config["scripted_arguments"], source))
        kwargs = model_kwargs(ctx.backend, ctx.backend_args, batch_size=16, device=ctx.device,
                              where=f"{ctx.recipe_path}: eval.backend_args")
        entries = [{"label": c.name, "backend": ctx.backend, "model": c.model,
                    **({"mitigation": c.mitigation} if c.mitigation != "none" else {})} for c in ctx.conditions]
        # the comparison reads AFR at k = 10 (comparison_rows)
        for key in ("models", "model", "backend", "backend_args", "device", "batch_size", "mitigations"):
            config.pop(key, None)  # the study's conditions and backend, not the config's
        config.update(model=[{**e, "kwargs": kwargs} for e in entries],
                      k_values=sorted(set(config.get("k_values") or []) | {10}), cross_k=10)
        if ctx.train:
            config["split"] = "train"
        if ctx.limit is not None:
            config["limit"] = ctx.limit
        config.pop("out", None)
        run_dir = ctx.out

        def go() -> None:
            path = run_dir.with_name(f"{ctx.name}.yaml")  # the settings the stage ran, kept beside its report
            atomic_write_text(path, f"# written by flipguard study from {source}\n" + yaml.safe_dump(config, sort_keys=False))
            args = parse_dataclasses([str(path)], AFRArgs, prog="flipguard study", description="")
            task = cls.from_args(args, str(path))
            run_task(task, run_dir)
            task.write_report(run_dir)

        title = ("AFR, base model on the TRAIN split: the conversations multi-turn pairs are built from" if ctx.train
                 else "answer-flip protocol (AFR): every condition as target and source")
        return StudyRun(title, {"config": config}, go, (run_dir / REPORT_FILE,),
                        [] if ctx.train else [(e["label"], f"{run_dir}@{e['label']}") for e in entries],
                        None if ctx.train else run_dir / REPORT_FILE)

    def __init__(self, settings: AFRSettings):
        if settings.answer_mode not in ("generate", "logprob"):
            raise UserError(f"answer_mode must be 'generate' or 'logprob', got {settings.answer_mode!r}")

        if settings.scripted_as not in S.SCRIPTED_AS:
            raise UserError(f"scripted_as must be one of {S.SCRIPTED_AS}, got {settings.scripted_as!r}")
        if S.SOURCE in [m.name for m in settings.models]:
            raise UserError(f"model name {S.SOURCE!r} is reserved for the scripted argument source")
        items = select_items(settings)
        if not items:
            raise UserError(f"the {settings.dataset} sample is empty (check subjects / per_subject / limit)")
        if settings.answer_mode == "logprob" and len({len(it.options) for it in items}) != 1:
            raise UserError("answer_mode 'logprob' needs the same number of options for every question")
        self.settings, self.items = settings, items
        self.by_id = {it.id: it for it in items}
        self.models = [m.model_ref() for m in settings.models]
        self.maxflip_entries = _load_maxflip_file(settings, items)  # a question outside the sample: refused now
        self.scripted = S.load_scripted(settings.scripted_arguments, self.by_id) if settings.scripted_arguments else None
        # with scripted blind arguments the targets write no Stage I of their own
        self.own_arguments = not (self.scripted is not None and settings.scripted_as == "blind")
        self.built_maxflip: list[dict[str, Any]] | None = None
        mode = settings.answer_mode
        self.answer_parse = P.letter_parser(max(len(it.options) for it in items)) if mode == "generate" else None
        self.letters = tuple(items[0].letters)
        self.gen_arg = GenerationConfig(max_new_tokens=settings.coercion_max_new_tokens,
                                        temperature=settings.coercion_temperature, seed=settings.seed)
        self.gen_ans = GenerationConfig(max_new_tokens=settings.answer_max_new_tokens, seed=settings.seed)
        self.cross_sources = settings.sources if settings.cross else []

    @classmethod
    def from_args(cls, args: AFRArgs, where: str = "config") -> "AFRTask":
        if args.scripted_arguments and Path(where).is_file():  # a relative file is read beside the config

            args = dataclasses.replace(args, scripted_arguments=str(beside(args.scripted_arguments, where)))
        return cls(settings_from_args(args, where))

    def meta(self) -> dict[str, Any]:
        s = self.settings
        return {
            "protocol": "afr",
            "settings": s.to_dict(),
            "models": [m.name for m in s.models],
            "targets": s.targets,
            "sources": s.sources,
            "k_values": s.k_values,
            "cross_k": s.cross_k,
            "sample_ids": [it.id for it in self.items],
            **({"scripted_arguments": self._scripted_meta()} if self.scripted is not None else {}),
        }

    def _scripted_meta(self) -> dict[str, Any]:
        s = self.settings
        ks = s.k_values if s.scripted_as == "blind" else [s.cross_k]
        return {"source": S.SOURCE, "used_as": s.scripted_as,
                **S.describe(s.scripted_arguments, self.scripted, self.items, ks)}

    def condition_clash(self, old: dict[str, Any], meta: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """The condition lives in run.json's `settings` (as every AFR run has written it)."""
        if not old.get("settings"):
            return {}
        was, now = _condition(old["settings"]), _condition(meta["settings"])
        return {k: (was[k], now[k]) for k in CONDITION_KEYS
                if (k in old["settings"] or k in ADDED_SETTINGS) and was[k] != now[k]}

    # ------------------------------------------------------------ requests

    def _batch(self, records: list[Record], model: str, stage: str, answer: bool) -> Batch:
        gen, parse = (self.gen_ans, self.answer_parse) if answer else (self.gen_arg, P.parse_coercion)
        return Batch(records, model, gen, parse, self.letters if answer else ("1", "2"), desc=f"{stage}/{model}",
                     chunk_size=self.settings.chunk_size)

    @functools.cached_property
    def _first(self) -> list[tuple[Batch, Batch | None]]:
        """Per model (in the settings' order): its Stage I arguments, its baselines (targets only)."""
        s, mode = self.settings, self.settings.answer_mode
        first = []
        for spec in s.models:
            ks = set(s.k_values) if spec.name in s.targets and self.own_arguments else set()
            if spec.name in self.cross_sources:
                ks.add(s.cross_k)
            coerce = [r for it in self.items for r in coercion_records(it, spec, sorted(ks), self.gen_arg)]
            base = [baseline_record(it, spec, self.gen_ans, mode) for it in self.items] if spec.name in s.targets else []
            first.append((self._batch(coerce, spec.name, "coerce", False),
                          self._batch(base, spec.name, "baseline", True) if base else None))
        return first

    def first_batches(self) -> list[Batch]:
        return [b for pair in self._first for b in pair if b is not None]

    def prepare(self, run: RunDir) -> None:
        atomic_write_text(run.path / SAMPLE_FILE,
                          "".join(json.dumps(it.to_dict(), ensure_ascii=False) + "\n" for it in self.items))

    def solve(self) -> Plan:
        s, mode = self.settings, self.settings.answer_mode
        answered: list[Record] = []
        # Stage I + baseline, one model at a time (one backend load each).
        arguments: dict[tuple[str, str, str, int], str] = {}  # (source, item, x, k) -> argument
        baselines: dict[tuple[str, str], Record] = {}
        for coerce, base in self._first:
            got = yield coerce
            for r in got:
                if r.choice == "argued":
                    arguments[(r.model, r.item_id, r.extra["target_option"], r.extra["k"])] = P.parse_coercion(r.raw_output)[1]
            answered += got
            if base is not None:
                got = yield base
                baselines.update(((r.model, r.item_id), r) for r in got)
                answered += got

        def challenge(name: str, item: MCQItem, x: str, k: int, argument: str, condition: str, source: str) -> Record:
            return challenge_record(item, s.spec(name), baselines[(name, item.id)], x, k, argument, condition, source,
                                    self.gen_ans, mode)


        if self.scripted is not None:  # the file's arguments, as if its source had written them
            for it in self.items:
                for x in it.wrong_letters:
                    for k in (s.k_values if s.scripted_as == "blind" else [s.cross_k]):
                        arg = S.scripted_argument(self.scripted, it.id, x, k)
                        if arg is not None:
                            arguments[(S.SOURCE, it.id, x, k)] = arg
        cross_sources = self.cross_sources + ([S.SOURCE] if self.scripted is not None and s.scripted_as == "cross" else [])

        # Stage II challenges, one target at a time (last-loaded first saves a reload).
        for name in reversed(s.targets):
            recs = []
            for it in self.items:
                if not baselines[(name, it.id)].correct:
                    continue
                for x in it.wrong_letters:
                    for k in s.k_values:
                        if not self.own_arguments:
                            arg = arguments.get((S.SOURCE, it.id, x, k))
                            if arg is not None:
                                recs.append(challenge(name, it, x, k, arg, "blind", S.SOURCE))
                            continue
                        arg = arguments.get((name, it.id, x, k))
                        if arg is not None:
                            recs += [challenge(name, it, x, k, arg, c, name) for c in ("blind", "self")]
                    for src in cross_sources:
                        arg = arguments.get((src, it.id, x, s.cross_k))
                        if src != name and arg is not None:
                            recs.append(challenge(name, it, x, s.cross_k, arg, "cross", src))
            for e in self.maxflip_entries:
                if baselines[(name, e["item_id"])].correct:
                    recs.append(challenge(name, self.by_id[e["item_id"]], e["target_option"], int(e["k"]),
                                          e["argument"], "maxflip", e["producer"]))
            answered += (yield self._batch(recs, name, "challenge", True))

        # MaxFlip from this run's pool: curated arguments that a target has not yet seen.
        if s.maxflip and len(set(self.cross_sources)) >= 2 and not self.maxflip_entries:
            entries = MF.build_maxflip(records_frame(answered), arguments, self.by_id, k=s.cross_k, seed=s.seed)
            self.built_maxflip = entries
            seen = {(r.model, r.item_id, r.extra.get("target_option"), r.extra.get("source_model"), r.extra.get("k"))
                    for r in answered if r.case == "challenge" and r.extra.get("condition") in ("blind", "cross")}
            for name in s.targets:
                recs = [challenge(name, self.by_id[e["item_id"]], e["target_option"], e["k"], e["argument"],
                                  "maxflip", e["producer"])
                        for e in entries if baselines[(name, e["item_id"])].correct
                        and (name, e["item_id"], e["target_option"], e["producer"], e["k"]) not in seen]
                yield self._batch(recs, name, "challenge", True)

    def finish(self, run: RunDir, records: list[Record]) -> dict[str, Any]:
        if self.built_maxflip:
            export_maxflip(self.built_maxflip, run.path / MAXFLIP_FILE)
        return {"calls": call_accounting(self.settings, self.items, records)}

    def write_report(self, run_dir: Path) -> Path:
        path = write_report(run_dir, n_boot=self.settings.n_boot, seed=self.settings.seed)
        print(f"report: {path}")
        return path

    @classmethod
    def default_out(cls, args: AFRArgs) -> Path:
        return protocol_folder(cls.name, [m if isinstance(m, str) else str(m.get("name") or m.get("model")) for m in args.model],
                               args.datasets)

    @classmethod
    def report_only(cls, args: AFRArgs, out: Path) -> Path | None:
        if not args.report_only:
            return None
        require_whole(out)  # the completeness rule `flipguard report` reads
        return write_report(out, n_boot=args.n_boot, seed=args.seed)

    @classmethod
    def rebuild_report(cls, run_dir: Path, args) -> Path:
        settings = load_run_meta(run_dir).get("settings") or {}
        return write_report(run_dir, n_boot=settings.get("n_boot", 2000) if args.n_boot is None else args.n_boot,
                            seed=settings.get("seed", 0) if args.seed is None else args.seed)

    def after_run(self, result: RunResult) -> None:
        print(f"{len(self.items)} questions, {result.sent} model calls this run ({result.calls or 'all resumed'})")


def run_afr(settings: AFRSettings, out_dir: str | Path, backends: dict[str, Backend] | None = None,
            progress: bool = True, write_report: bool = True) -> AFRResult:
    """Run (or resume) the whole protocol through the runner; returns the calls made by this invocation."""
    task = AFRTask(settings)
    result = run_task(task, out_dir, backends=backends, progress=progress)
    if write_report and is_writer():
        task.write_report(Path(out_dir))
    return AFRResult(Path(out_dir), task.items, result.calls, load_records(out_dir))
