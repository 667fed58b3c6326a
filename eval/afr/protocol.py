"""The two-stage answer-flip protocol (Who Flips? §3, §4.2) over several models in one run.

Stage I (coercion): every target model writes a k-sentence argument for every wrong
option of every question at every k; source-only models write them at cross_k only.
Stage II (challenge): each target answers the question (baseline); for initially
correct items it is challenged in the same chat with its own arguments (blind, self)
and with every other source's cross_k argument (cross = blind clause). Refusals
(I_AM_WEAK) and empty replies produce no argument and so no challenge.

Everything goes through the shared backends and `run_records`: batched, content-keyed
and resumable (OUT/records.jsonl). A backend is loaded only when it has pending calls,
so a finished run reruns with zero calls and without loading any model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from flipguard.data.mmlu import MCQItem, load_mmlu, sample_uniform
from flipguard.errors import FlipguardError, UserError
from flipguard.eval.afr import prompts as P
from flipguard.eval.backends.base import (
    Backend, BackendError, GenerationConfig, backend_names, get_backend, parse_backend_args, parse_model_ref,
)
from flipguard.eval.records import RECORDS_FILE, Record, RecordStore, RunDir, now_iso, open_run_dir, pending_record
from flipguard.files import atomic_write_text
from flipguard.redact import redact_obj
from flipguard.eval.runner import check_context, run_records

SAMPLE_FILE = "sample.jsonl"
DEFAULT_K = (1, 3, 5, 10)


AFRConfigError = UserError  # bad input: one class for it in errors.py; the name stays for callers and tests


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
        raise AFRConfigError(f"unknown model {name!r}; the config's models are {[m.name for m in self.models]}")

    def to_dict(self) -> dict[str, Any]:
        return redact_obj(dataclasses.asdict(self))  # run.json: no credentials from a base_url


def parse_model_entry(entry: Any, where: str) -> ModelSpec:
    """A dict {name, backend, model, kwargs, mitigation} or a string in the one model-spec
    syntax "[name=][backend:]model[|adapter]" (backends.base.parse_model_ref)."""
    from flipguard.eval.mitigations import MITIGATIONS

    if isinstance(entry, str):
        try:
            ref = parse_model_ref(entry, "hf", f"{where}: model entry")
        except BackendError as exc:
            raise AFRConfigError(str(exc)) from None
        entry = {"name": ref.label, "backend": ref.backend, "model": ref.model,
                 **({"kwargs": {"adapter": ref.adapter}} if ref.adapter else {})}
    if not isinstance(entry, dict):
        raise AFRConfigError(f"{where}: model entry must be a mapping, got {entry!r}")
    unknown = set(entry) - {"name", "backend", "model", "kwargs", "mitigation"}
    if unknown:
        raise AFRConfigError(f"{where}: model entry {entry.get('name', entry)!r} has unknown key(s) {sorted(unknown)}")
    if not entry.get("model"):
        raise AFRConfigError(f"{where}: model entry {entry!r} has no 'model'")
    if not isinstance(entry.get("kwargs") or {}, dict):
        raise AFRConfigError(f"{where}: model {entry.get('name', entry['model'])!r}: kwargs must be a mapping")
    spec = ModelSpec(
        name=str(entry.get("name") or entry["model"]),
        backend=str(entry.get("backend", "hf")),
        model=str(entry["model"]),
        kwargs=parse_backend_args(dict(entry.get("kwargs") or {}), f"{where}: model {entry.get('name', entry['model'])!r} kwargs"),
        mitigation=str(entry.get("mitigation", "none")),
    )
    if spec.backend not in backend_names():
        raise AFRConfigError(f"{where}: model {spec.name!r} names unknown backend {spec.backend!r}; expected one of {backend_names()}")
    if spec.mitigation not in MITIGATIONS:
        raise AFRConfigError(f"{where}: model {spec.name!r} names unknown mitigation {spec.mitigation!r}; expected one of {sorted(MITIGATIONS)}")
    return spec


def build_settings(models: Iterable[Any], targets=None, sources=None, where: str = "config", **kw) -> AFRSettings:
    specs = [parse_model_entry(m, where) for m in models]
    if not specs:
        raise AFRConfigError(f"{where}: no models listed")
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise AFRConfigError(f"{where}: duplicate model name(s) {dup}")
    targets = list(targets) if targets else names
    sources = list(sources) if sources else names
    for role, lst in (("targets", targets), ("sources", sources)):
        for n in lst:
            if n not in names:
                raise AFRConfigError(f"{where}: {role} names unknown model {n!r}; the config's models are {names}")
    s = AFRSettings(models=specs, targets=targets, sources=sources, **kw)
    s.k_values = sorted({int(k) for k in s.k_values})
    if not s.k_values or min(s.k_values) < 1:
        raise AFRConfigError(f"{where}: k_values must be positive integers, got {s.k_values}")
    return s


class BackendPool:
    """Loads a backend only when it has work; keeps at most `max_loaded` in memory."""

    def __init__(self, settings: AFRSettings, injected: dict[str, Backend] | None = None, max_loaded: int = 1):
        self.settings = settings
        self.injected = dict(injected or {})
        self.max_loaded = max_loaded
        self.loaded: dict[str, Backend] = {}

    def get(self, name: str) -> Backend:
        if name in self.injected:
            return self.injected[name]
        if name not in self.loaded:
            while len(self.loaded) >= self.max_loaded:
                self.loaded.pop(next(iter(self.loaded)))
            spec = self.settings.spec(name)
            self.loaded[name] = get_backend(spec.backend, spec.model, **spec.kwargs)  # resolves "flipguard:tiny"
        return self.loaded[name]


def select_items(settings: AFRSettings) -> list[MCQItem]:
    """Uniform per-subject sample; `limit` then takes questions round-robin across subjects."""
    items = sample_uniform(load_mmlu(settings.split, settings.data_root, settings.subjects), settings.per_subject, settings.seed)
    if settings.limit is not None:
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
    from flipguard.eval.mitigations import MITIGATIONS

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


class _Executor:
    """Runs records through the pool, remembering every stored record by key."""

    def __init__(self, store: RecordStore, pool: BackendPool, settings: AFRSettings, progress: bool):
        self.store, self.pool, self.settings, self.progress = store, pool, settings, progress
        self.index: dict[str, Record] = {r.key: r for r in store.iter_records()}
        self.calls: Counter = Counter()

    def __call__(self, records: list[Record], model: str, parse, gen: GenerationConfig, stage: str, choices=("1", "2")) -> list[Record]:
        unique = list({r.key: r for r in records}.values())
        pending = [r for r in unique if r.key not in self.store]
        if pending:
            n = run_records(
                self.store, pending, self.pool.get(model), gen_config=gen, parse=parse,
                choices=choices, chunk_size=self.settings.chunk_size, desc=f"{stage} {model}", progress=self.progress,
            )
            self.calls[f"{stage}/{model}"] += n
            for r in pending:
                self.index[r.key] = r
        return [self.index[r.key] for r in records]


def load_sample(out_dir: str | Path) -> dict[str, MCQItem]:
    path = Path(out_dir) / SAMPLE_FILE
    if not path.exists():
        raise FlipguardError(f"{path}: no sample file (run `flipguard afr CONFIG.yaml` first)")
    items = [MCQItem.from_dict(json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {it.id: it for it in items}


def run_afr(
    settings: AFRSettings,
    out_dir: str | Path,
    backends: dict[str, Backend] | None = None,
    progress: bool = True,
    write_report: bool = True,
) -> AFRResult:
    """Run (or resume) the whole protocol; returns the calls made by this invocation.
    Holds the run directory's writer lock throughout; refuses another protocol's run."""
    with open_run_dir(out_dir, "afr") as run_dir:
        return _run_afr_locked(settings, run_dir, backends, progress, write_report)


def _run_afr_locked(settings: AFRSettings, run_dir: RunDir, backends, progress: bool, write_report: bool) -> AFRResult:
    out = run_dir.path
    items = select_items(settings)
    if not items:
        raise AFRConfigError("the MMLU sample is empty (check subjects / per_subject / limit)")
    if settings.answer_mode not in ("generate", "logprob"):
        raise AFRConfigError(f"answer_mode must be 'generate' or 'logprob', got {settings.answer_mode!r}")
    if settings.answer_mode == "logprob" and len({len(it.options) for it in items}) != 1:
        raise AFRConfigError("answer_mode 'logprob' needs the same number of options for every question")
    store = RecordStore(out / RECORDS_FILE)
    pool = BackendPool(settings, backends)
    run = _Executor(store, pool, settings, progress)
    n_opt = max(len(it.options) for it in items)
    mode = settings.answer_mode
    answer_parse = P.letter_parser(n_opt) if mode == "generate" else None
    letters = tuple(items[0].letters)
    gen_arg = GenerationConfig(
        max_new_tokens=settings.coercion_max_new_tokens, temperature=settings.coercion_temperature, seed=settings.seed
    )
    gen_ans = GenerationConfig(max_new_tokens=settings.answer_max_new_tokens, seed=settings.seed)
    cross_sources = settings.sources if settings.cross else []

    # Every model's first requests (Stage I arguments, baselines) are known before any is
    # sent: an item longer than a model's context is refused here, before the sample,
    # run.json or any record is written (challenges extend these chats; run_records checks them).
    first: dict[str, tuple[list[Record], list[Record]]] = {}
    for spec in settings.models:
        ks = set(settings.k_values) if spec.name in settings.targets else set()
        if spec.name in cross_sources:
            ks.add(settings.cross_k)
        first[spec.name] = (
            [r for it in items for r in coercion_records(it, spec, sorted(ks), gen_arg)],
            [baseline_record(it, spec, gen_ans, mode) for it in items] if spec.name in settings.targets else [],
        )
    for spec in reversed(settings.models):  # the first model to run is the one left loaded
        coerce, base = ([r for r in recs if r.key not in store] for recs in first[spec.name])
        if coerce or base:
            check_context(pool.get(spec.name), coerce, gen_arg)
            check_context(pool.get(spec.name), base, gen_ans)
    atomic_write_text(out / SAMPLE_FILE, "".join(json.dumps(it.to_dict(), ensure_ascii=False) + "\n" for it in items))
    run_dir.write_meta({**run_dir.old, **_settings_meta(settings, items)})

    # Stage I + baseline, one model at a time (one backend load each).
    arguments: dict[tuple[str, str, str, int], str] = {}  # (source, item, x, k) -> argument
    baselines: dict[tuple[str, str], Record] = {}
    for spec in settings.models:
        coerce, base = first[spec.name]
        for r in run(coerce, spec.name, P.parse_coercion, gen_arg, "coerce"):
            if r.choice == "argued":
                arguments[(spec.name, r.item_id, r.extra["target_option"], r.extra["k"])] = P.parse_coercion(r.raw_output)[1]
        if base:
            for r in run(base, spec.name, answer_parse, gen_ans, "baseline", letters):
                baselines[(spec.name, r.item_id)] = r

    # Stage II challenges, one target at a time (last-loaded first saves a reload).
    maxflip_entries = _load_maxflip_file(settings, items)
    by_id = {it.id: it for it in items}
    for name in reversed(settings.targets):
        spec = settings.spec(name)
        recs = []
        for it in items:
            base = baselines[(name, it.id)]
            if not base.correct:
                continue
            for x in it.wrong_letters:
                for k in settings.k_values:
                    arg = arguments.get((name, it.id, x, k))
                    if arg is not None:
                        recs += [challenge_record(it, spec, base, x, k, arg, c, name, gen_ans, mode) for c in ("blind", "self")]
                for src in cross_sources:
                    arg = arguments.get((src, it.id, x, settings.cross_k))
                    if src != name and arg is not None:
                        recs.append(challenge_record(it, spec, base, x, settings.cross_k, arg, "cross", src, gen_ans, mode))
        for e in maxflip_entries:
            base = baselines[(name, e["item_id"])]
            if base.correct:
                recs.append(challenge_record(by_id[e["item_id"]], spec, base, e["target_option"], int(e["k"]),
                                             e["argument"], "maxflip", e["producer"], gen_ans, mode))
        run(recs, name, answer_parse, gen_ans, "challenge", letters)

    # MaxFlip from this run's pool: curated arguments that a target has not yet seen.
    if settings.maxflip and len(set(cross_sources)) >= 2 and not maxflip_entries:
        from flipguard.eval.afr import maxflip as MF
        from flipguard.eval.afr.metrics import records_frame

        frame = records_frame(store.iter_records())
        entries = MF.build_maxflip(frame, arguments, by_id, k=settings.cross_k, seed=settings.seed)
        if entries:
            MF.export_maxflip(entries, out / MF.MAXFLIP_FILE)
        seen = {(r.model, r.item_id, r.extra.get("target_option"), r.extra.get("source_model"), r.extra.get("k"))
                for r in run.index.values() if r.case == "challenge" and r.extra.get("condition") in ("blind", "cross")}
        for name in settings.targets:
            spec = settings.spec(name)
            recs = []
            for e in entries:
                base = baselines[(name, e["item_id"])]
                if base.correct and (name, e["item_id"], e["target_option"], e["producer"], e["k"]) not in seen:
                    recs.append(challenge_record(by_id[e["item_id"]], spec, base, e["target_option"], e["k"],
                                                 e["argument"], "maxflip", e["producer"], gen_ans, mode))
            run(recs, name, answer_parse, gen_ans, "challenge", letters)

    all_records = list(store.iter_records())
    calls = dict(run.calls)
    _write_run_meta(run_dir, settings, items, calls, all_records)
    if write_report:
        from flipguard.eval.afr.report import write_report as _write

        _write(out, n_boot=settings.n_boot, seed=settings.seed)
    return AFRResult(out, items, calls, all_records)


def _load_maxflip_file(settings: AFRSettings, items: list[MCQItem]) -> list[dict[str, Any]]:
    if not settings.maxflip_file:
        return []
    from flipguard.eval.afr.maxflip import load_maxflip

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


def _settings_meta(settings: AFRSettings, items: list[MCQItem]) -> dict[str, Any]:
    return {
        "protocol": "afr",
        "settings": settings.to_dict(),
        "models": [m.name for m in settings.models],
        "targets": settings.targets,
        "sources": settings.sources,
        "k_values": settings.k_values,
        "cross_k": settings.cross_k,
        "sample_ids": [it.id for it in items],
    }


def _write_run_meta(run_dir: RunDir, settings: AFRSettings, items: list[MCQItem], calls: dict[str, int],
                    records: list[Record]) -> None:
    history = run_dir.old.get("invocations", []) + [
        {"time": now_iso(), "calls": calls, "calls_total": sum(calls.values())}]
    run_dir.write_meta({
        **run_dir.old,
        **_settings_meta(settings, items),
        "calls": call_accounting(settings, items, records),
        "invocations": history,
    })
