"""`flipguard study RECIPE`: the recipe's whole before/after plan as one resumable command.

    flipguard study recipes/tiny.yaml --out runs/tiny-study            # everything
    flipguard study recipes/tiny.yaml --out runs/tiny-study --only dpo # redo one stage
    flipguard study recipes/tiny.yaml --out runs/tiny-study --from pairs

Stages, in order (the recipe decides which exist): `baseline` (DDS, test split, all four
cases) and `baseline-<mode>` for eval.extra_modes; one per prompting mitigation (fixed C1
from the baseline); `base-train` (the base model on the train split: the flip records);
`pairs`; per trainer section (config.TRAINERS: `sft`, `dpo`, ...) the trainer (accelerate launch on a GPU, in process on CPU),
`<trainer>-merge` and `<trainer>-eval` (the merged model, same eval as the baseline);
one per task eval.protocols names (built in or a user's, `--include my_tasks.py` or a
`flipguard.tasks` entry point: the task's `study_run` describes its stage, and its
`comparison_rows` its part of the comparison), `<task>-train` before the pairs for each of
eval.train_protocols; `compare` (comparison report with plots); `wandb` when report_to
names wandb.

A stage is skipped when its outputs exist and its fingerprint matches the one in
DIR/study.json: a hash of exactly what it reads (its settings, resolved from the recipe),
the model's identity and its input stages' fingerprints. So a changed `dpo.beta` redoes
dpo, dpo-merge, dpo-eval and compare, and nothing else. A stage whose fingerprint changed
(or that --from/--only names) has its outputs removed first; one that was interrupted
with the same fingerprint resumes (eval stages at the record level; trainers and merge
publish their folders atomically, provenance last).

The effective recipe (the file plus command-line overrides, with this study's folders
for pairs and adapters; env values redacted) is written to DIR/recipe.yaml: it is what
the trainers and the merge read.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import yaml

from flipguard import __version__
from flipguard.config import (
    ARG_SECTIONS,
    TRAINERS,
    PairsArguments,
    TrackingArguments,
    eval_plan_arguments,
    is_section,
    is_task_config_key,
    parse_recipe,
    public_recipe,
    read_recipe,
    split_recipe_argv,
    task_config_key,
    trainer_entry,
    validate_recipe,
)
from flipguard.data.unified import load_items
from flipguard.errors import FlipguardError, UserError
from flipguard.eval.backends.base import resolve_model
from flipguard.eval.dds.metrics import TOTAL_AVG
from flipguard.eval.dds.protocol import EvalArgs, evaluate
from flipguard.eval.dds.report import REPORT_DIR, print_summary, report_run, write_report
from flipguard.eval.embedded.tiny_model import TINY_MODEL_ALIASES
from flipguard.eval.mitigations import MITIGATIONS
from flipguard.eval.pipeline.capability import UNITS_FILE as CAPABILITY_UNITS
from flipguard.eval.pipeline.capability import run_capability
from flipguard.eval.pipeline.compare import build_comparison, protocol_flags, protocol_rows, write_comparison
from flipguard.eval.pipeline.transfer import TRANSFER_JSON, build_transfer
from flipguard.eval.pipeline.view import VIEW_FILE, write_view
from flipguard.eval.records import OWNER_FILE, RUN_META_FILE, now_iso, run_lock
from flipguard.eval.runner import DEFAULT_MIN_LABEL_MASS, MODES
from flipguard.eval.task import StudyCondition, StudyContext, get_task, include_tasks, split_includes, task_names
from flipguard.eval.threads import THREADS_HELP, configure_threads
from flipguard.files import (
    PACKAGE_ROOT,
    atomic_write_json,
    atomic_write_text,
    beside,
    check_replace,
    dumps_utf8,
    git_commit,
    remove_owned,
    written_files,
)
from flipguard.train.merge import MERGE_INFO_FILE
from flipguard.train.merge import main as merge_main
from flipguard.train.pair_filters import PairRules
from flipguard.train.pairs import print_counts
from flipguard.train.pairs import run as build
from flipguard.train.utils import PROVENANCE_FILE, check_lora_targets, start_wandb, wants_wandb

TRAIN = PACKAGE_ROOT / "train"
PAIRS_DATASETS_DEFAULT = next(f.default for f in dataclasses.fields(PairsArguments) if f.name == "pairs_datasets")
STUDY_FILE = "study.json"
STUDY_FORMAT = "flipguard-study/1"
# prompting mitigation -> condition name in the comparison
CONDITION_NAMES = {"be_honest": "Be Honest", "dehumanizing": "Dehumanizing"}


# a study that cannot run as asked (unknown stage, missing inputs): the message names the stage


RECIPE_HEADER = "# the effective recipe of this study"


def _study_file(path: Path) -> bool:
    """A study folder's file from before manifests, recognised by its content: the effective
    recipe (its header line) or study.json (its format)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if path.name == "recipe.yaml":
        return text.startswith(RECIPE_HEADER)
    if path.name == STUDY_FILE:
        return f'"format": "{STUDY_FORMAT}"' in text
    return False


def written_by_flipguard(path: Path) -> bool:
    """A stage output left by an earlier flipguard command: a run directory (run.json) or a
    published folder (owner file); anything else in --out is the user's and is kept."""
    return path.is_dir() and ((path / RUN_META_FILE).is_file() or (path / OWNER_FILE).is_file())


@dataclasses.dataclass
class StudyArguments:
    """Run a recipe's whole before/after plan (recipe `eval:` section): baseline and prompting
    mitigations, flip records -> pairs -> each trainer -> merge -> re-measure, the other protocols the recipe
    names (eval.protocols: registered tasks; --include my_tasks.py FILE adds a user's), comparison report
    with plots; finished stages are skipped on a rerun (DIR/study.json).
    Stages: baseline, baseline-<extra mode>, <mitigation>..., base-train, <task>-train..., pairs, then per
    trainer section (sft, dpo, ...) <trainer>, <trainer>-merge, <trainer>-eval, then one per task of
    eval.protocols, compare, wandb (those the recipe asks for). Flags override the
    recipe's eval_plan_/pairs_/tracking_ values (pairs records and dir are the study's own)."""

    out: str | None = dataclasses.field(default=None, metadata={"help": "Study folder (default runs/<recipe name>-study)."})
    from_stage: str | None = dataclasses.field(
        default=None, metadata={"aliases": ["--from"], "help": "Redo this stage and every stage after it."}
    )
    only: str | None = dataclasses.field(default=None, metadata={"help": "Redo just this stage (its inputs must be done)."})
    model: str | None = dataclasses.field(default=None, metadata={"help": "Override the recipe's model_name_or_path."})
    threads: int | None = dataclasses.field(default=None, metadata={"help": THREADS_HELP})


@dataclasses.dataclass
class Stage:
    name: str
    title: str
    params: dict[str, Any]          # exactly what the stage reads (hashed)
    inputs: tuple[str, ...]         # stages whose outputs it reads
    outputs: tuple[Path, ...]       # all present = the stage finished
    clear: tuple[Path, ...]         # removed before a redo
    run: Callable[[], None]


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(name: str) -> dict[str, Any]:
    """The model a stage reads: its name and, for a local folder (embedded models
    included), the size and modification time of each top-level file."""
    path = Path(resolve_model(name))
    ident: dict[str, Any] = {"name": name}
    if path.is_dir():
        ident["path"] = str(path.resolve())
        ident["files"] = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(path.iterdir()) if p.is_file()}
    return ident


def _section(raw: dict[str, Any], section: str, cls) -> dict[str, Any]:
    prefix = ARG_SECTIONS[section]
    values = {f.name[len(prefix):]: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
              for f in dataclasses.fields(cls)}
    values.update(raw.get(section) or {})
    return values


def _as_args(cls, section: str, values: dict[str, Any]):
    prefix = ARG_SECTIONS[section]
    return cls(**{prefix + k: v for k, v in values.items()})


def study_plan_class() -> type:
    """The eval: section's dataclass with a run-config key per registered task (eval.<task>_config)."""
    return eval_plan_arguments(n for n in task_names() if get_task(n).has_study_stage())


def check_task_config_keys(raw: dict[str, Any], recipe_path: str, plan_class: type) -> None:
    """eval.<task>_config naming no registered task (a typo, a user's task not --include'd): one error."""
    fields = {f.name for f in dataclasses.fields(plan_class)}
    staged = sorted(f[len("eval_plan_"):] for f in fields if is_task_config_key(f[len("eval_plan_"):]))
    for key in raw.get("eval") or {}:
        if is_task_config_key(str(key)) and f"eval_plan_{key}" not in fields:
            raise UserError(f"{recipe_path}: eval.{key}: no registered task with a study stage has this run config key "
                             f"(those that do: {', '.join(staged)}; a user's task: flipguard study --include FILE)")


class Study:
    def __init__(self, recipe_path: str | os.PathLike, raw: dict[str, Any], out: str | os.PathLike,
                 *, print_fn: Callable[[str], None] = print):
        self.recipe_path = str(recipe_path)
        self.out = Path(out)
        self.print = print_fn
        self.t0 = time.time()
        self.raw = copy.deepcopy(raw)
        plan_class = study_plan_class()
        check_task_config_keys(self.raw, self.recipe_path, plan_class)
        self.plan = _as_args(plan_class, "eval", _section(self.raw, "eval", plan_class))
        self.tracking = _as_args(TrackingArguments, "tracking", _section(self.raw, "tracking", TrackingArguments))
        self.model = str(self.raw.get("model_name_or_path") or "flipguard:tiny")
        self.check_plan()
        # this study's folders: pairs from its own train-split records, adapters under it
        pairs = _section(self.raw, "pairs", PairsArguments)
        pairs.update(records=str(self.out / "dds" / "base-train"), dir=str(self.out / "pairs"))
        self.raw["pairs"] = pairs
        self.pairs = _as_args(PairsArguments, "pairs", pairs)
        for trainer in self.trainers:
            self.raw[trainer] = {**(self.raw.get(trainer) or {}), "output_dir": str(self.out / "train" / trainer)}
        self.raw["eval"] = {k[len("eval_plan_"):]: v for k, v in dataclasses.asdict(self.plan).items()}
        self.raw["tracking"] = {k[len("tracking_"):]: v for k, v in dataclasses.asdict(self.tracking).items()}
        self.recipe_file = self.out / "recipe.yaml"
        self.state = self._load_state()
        self.artefacts: list[tuple[str, Path]] = []
        self.conditions: dict[str, Path] = {}
        self.models: dict[str, Path] = {}
        self.statuses: list[tuple[str, str, float]] = []
        self.protocol_runs: list[tuple[str, str]] = []  # (condition, RUN_DIR@system) for the comparison
        self.stages = self.build_stages()

    # ------------------------------------------------------------------ plan
    @property
    def trainers(self) -> list[str]:
        listed = self.plan.eval_plan_trainers
        return [t for t in TRAINERS if t in self.raw] if listed is None else list(listed)

    def check_plan(self) -> None:
        where = f"{self.recipe_path}: eval"
        for m in self.plan.eval_plan_mitigations:
            if m == "none":
                raise UserError(f"{where}.mitigations: 'none' is the baseline, always measured; list prompting mitigations only")
            if m not in MITIGATIONS:
                raise UserError(f"{where}.mitigations: unknown mitigation {m!r} (one of {sorted(set(MITIGATIONS) - {'none'})})")
        for mode in self.plan.eval_plan_extra_modes:
            if mode not in MODES or mode == self.plan.eval_plan_mode:
                raise UserError(f"{where}.extra_modes: {mode!r} is not another decision mode (one of {list(MODES)})")
        for t in self.trainers:
            trainer_entry(t, f"{where}.trainers")
            if t not in self.raw:
                raise UserError(f"{where}.trainers: {t!r} is listed but the recipe has no {t}: section")
        if self.trainers:
            # what the pairs stage and the trainers read, checked before the first stage runs
            pairs = self.raw.get("pairs") or {}
            in_file = "datasets" in ((read_recipe(self.recipe_path).get("pairs") or {}) if Path(self.recipe_path).is_file()
                                     else pairs)
            if not pairs.get("datasets") or (not in_file and pairs.get("datasets") == PAIRS_DATASETS_DEFAULT):
                raise UserError(f"{self.recipe_path}: pairs.datasets is not set: name the train datasets the pairs "
                                f"are built from (e.g. `pairs: {{datasets: bench}}`) or drop the trainers "
                                f"({', '.join(self.trainers)}) from eval.trainers")
            try:  # the train split the base-train stage and the pairs read: there, before any stage
                load_items(pairs["datasets"], split="train", data_root=pairs.get("data_root"))
            except FlipguardError as exc:
                raise UserError(f"{self.recipe_path}: pairs.datasets: {exc}") from None
            if self.raw.get("use_peft"):
                check_lora_targets(self.raw.get("lora_target_modules"), resolve_model(self.model),
                                   f"{self.recipe_path}: lora_target_modules")
        for key in ("protocols", "train_protocols"):
            names = getattr(self.plan, f"eval_plan_{key}")
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:  # one stage per task
                raise UserError(f"{where}.{key}: {', '.join(twice)} listed more than once")
            for name in names:
                try:
                    get_task(name)
                except UserError as exc:  # e.g. a user's task whose file was not --include'd
                    raise UserError(f"{where}.{key}: {exc} (a user's task: flipguard study --include FILE)") from None

    def min_label_mass(self) -> float:
        if self.plan.eval_plan_min_label_mass is not None:
            return float(self.plan.eval_plan_min_label_mass)
        return 0.0 if self.model in TINY_MODEL_ALIASES else DEFAULT_MIN_LABEL_MASS

    def dds_args(self, name: str, *, model: str, mode: str, split: str = "test", mitigation: str = "none",
                 c1_from: Path | None = None):
        plan = self.plan
        limit = plan.eval_plan_limit
        if mode == "generate" and plan.eval_plan_generate_limit is not None:
            limit = plan.eval_plan_generate_limit
        return EvalArgs(
            model=model, out=str(self.out / "dds" / name), backend=plan.eval_plan_backend, mode=mode,
            datasets=self.pairs.pairs_datasets if split == "train" else plan.eval_plan_datasets, split=split,
            data_root=(self.pairs.pairs_data_root if split == "train" else plan.eval_plan_data_root), limit=limit,
            mitigation=mitigation, c1_from=str(c1_from) if c1_from else None, max_new_tokens=plan.eval_plan_max_new_tokens,
            batch_size=plan.eval_plan_batch_size, min_label_mass=self.min_label_mass(), report=False,
            backend_args=self.backend_args_json(),
        )

    def backend_args_json(self) -> str:
        """The recipe's eval.backend_args (a mapping, or JSON from the command line) as the JSON
        that eval/afr/sos take in --backend_args."""
        value = self.plan.eval_plan_backend_args
        return value if isinstance(value, str) else json.dumps(value or {}, sort_keys=True)

    def dds_stage(self, name: str, title: str, inputs: tuple[str, ...], identity: dict | None, **kw) -> Stage:
        args = self.dds_args(name, **kw)
        run_dir = Path(args.out)
        outputs = (run_dir / "records.jsonl", run_dir / "run.json")
        if args.split == "test":
            outputs += (run_dir / "report" / "summary.csv",)
            self.artefacts.append((f"DDS report: {name}", run_dir / "report" / "summary.md"))
        params = {"eval": dataclasses.asdict(args), "model": identity}
        if args.split == "test":  # its report's bootstrap
            params["n_boot"] = self.plan.eval_plan_n_boot
        return Stage(name, title, params, inputs, outputs, (run_dir,), lambda: self.run_dds(args))

    def run_dds(self, args) -> None:
        run_dir = evaluate(args)
        if args.split != "test":
            return
        report = report_run(run_dir, n_boot=self.plan.eval_plan_n_boot)
        title = f"DDS report: {report.meta.get('model') or run_dir.name}"
        if args.mitigation != "none":
            title += f" ({args.mitigation})"
        write_report(report, run_dir / REPORT_DIR, title)
        print_summary(report, title)

    def build_stages(self) -> list[Stage]:
        plan, out = self.plan, self.out
        base_id = model_identity(self.model)
        mode = plan.eval_plan_mode
        stages: list[Stage] = []
        base_dir = out / "dds" / "baseline"
        stages.append(self.dds_stage("baseline", f"DDS baseline, {mode} mode ({plan.eval_plan_datasets} test split, all four cases)",
                                     (), base_id, model=self.model, mode=mode))
        self.conditions["Baseline"] = base_dir
        for extra in plan.eval_plan_extra_modes:
            stages.append(self.dds_stage(f"baseline-{extra}", f"DDS baseline, {extra} mode (own report; not compared)",
                                         (), base_id, model=self.model, mode=extra))
        for m in plan.eval_plan_mitigations:
            stages.append(self.dds_stage(m, f"DDS {m}, {mode} mode (all four cases; fixed C1 from the baseline and own C1)",
                                         ("baseline",), base_id, model=self.model, mode=mode, mitigation=m, c1_from=base_dir))
            self.conditions[CONDITION_NAMES.get(m, m)] = out / "dds" / m
        if self.trainers:
            stages.append(self.dds_stage("base-train", f"base model on the TRAIN split ({mode}): the flip records pairs are built from",
                                         (), base_id, model=self.model, mode=mode, split="train"))
            for task in plan.eval_plan_train_protocols:
                stages.append(self.protocol_stage(task, base_id, split="train"))
            stages.append(self.pairs_stage())
            for trainer in self.trainers:
                stages += self.trainer_stages(trainer, base_id)
        if plan.eval_plan_capability:
            stages.append(self.capability_stage(base_id))
        protocol_stages = [self.protocol_stage(task, base_id) for task in plan.eval_plan_protocols]
        stages += protocol_stages
        stages.append(self.compare_stage(stages, [s.name for s in protocol_stages]))

        if wants_wandb(self.raw.get("report_to")):
            stages.append(self.wandb_stage())
        return stages

    def pairs_stage(self) -> Stage:
        pairs_dir = Path(self.pairs.pairs_dir)
        self.artefacts.append(("pair datasets + counts", pairs_dir / "counts.json"))
        trained_on = [f"{p}-train" for p in self.plan.eval_plan_train_protocols]
        pairs = dataclasses.replace(self.pairs, pairs_conversations=[*self.pairs.pairs_conversations,
                                                                     *(str(self.out / name) for name in trained_on)])

        def run() -> None:
            out_dir, counts = build(pairs, self.recipe_path, records_given=True)
            print_counts(counts, out_dir)

        title = "flip records -> pair datasets (recipe strategy)" + (
            f" + multi-turn pairs from {', '.join(trained_on)}" if trained_on else "")
        read = dict.fromkeys(TRAINERS[t].pairs for t in self.trainers)  # the pair sets the trainers read
        return Stage("pairs", title, {"pairs": self.raw["pairs"], "conversations": pairs.pairs_conversations},
                     ("base-train", *trained_on), (pairs_dir / "counts.json", *(pairs_dir / f"{k}.jsonl" for k in read)),
                     (pairs_dir,), run)

    def top_level(self) -> dict[str, Any]:
        return {k: v for k, v in self.raw.items() if not is_section(k)}

    def on_gpu(self) -> bool:
        if self.raw.get("use_cpu"):
            return False
        import torch

        return torch.cuda.is_available()

    def accelerate_processes(self) -> int:
        """num_processes of the recipe's eval.accelerate_config, read by accelerate's own loader (1 when
        none is set): more than one makes a CPU study launch its trainers too (gloo)."""
        config = self.plan.eval_plan_accelerate_config
        if not config:
            return 1
        from accelerate.commands.config.config_args import load_config_from_file

        if not Path(config).is_file():
            raise UserError(f"{self.recipe_path}: eval.accelerate_config {config}: no such file")
        return int(load_config_from_file(config).num_processes or 1)

    def trainer_stages(self, trainer: str, base_id: dict) -> list[Stage]:
        adapter = self.out / "train" / trainer
        merged = self.out / "models" / f"{trainer}-merged"
        name = TRAINERS[trainer].label
        self.models[name] = merged
        self.conditions[name] = self.out / "dds" / f"{trainer}-eval"
        self.artefacts.append((f"{name} merged model", merged))
        gpu = self.on_gpu()
        launch = gpu or self.accelerate_processes() > 1  # a CPU recipe whose accelerate config asks for several

        def train() -> None:
            if launch:
                config = self.plan.eval_plan_accelerate_config or str(PACKAGE_ROOT / "recipes" / "accelerate_configs" / "single_gpu.yaml")
                cmd = ["accelerate", "launch", "--config_file", config, str(TRAIN / f"{trainer}.py"), str(self.recipe_file)]
                self.print("$ " + " ".join(cmd))
                code = subprocess.run(cmd).returncode
                if code:
                    raise UserError(f"stage {trainer}: `{' '.join(cmd)}` failed with exit code {code}")
            else:
                importlib.import_module(f"flipguard.train.{trainer}").main([str(self.recipe_file)])

        def merge() -> None:
            merge_main([str(self.recipe_file), "--adapter", str(adapter), "--out", str(merged),
                        "--pairs_dir", str(self.pairs.pairs_dir)])

        top = self.top_level()
        where = "accelerate launch" if launch else "in process on CPU"
        return [
            Stage(trainer, f"{name} (LoRA adapter, recipe settings), {where}",
                  {"top": top, trainer: self.raw[trainer], "pairs": self.raw["pairs"], "model": base_id,
                   "accelerate_config": self.plan.eval_plan_accelerate_config if launch else None},
                  ("pairs",), (adapter / "adapter_config.json", adapter / PROVENANCE_FILE), (adapter,), train),
            Stage(f"{trainer}-merge", f"merge the {name} adapter into the base (merge gap measured on train prompts)",
                  {"top": top, "model": base_id}, (trainer, "pairs"), (merged / MERGE_INFO_FILE,), (merged,), merge),
            self.dds_stage(f"{trainer}-eval", f"{name} model, same DDS evaluation (all four cases; fixed C1 from the baseline and own C1)",
                           ("baseline", f"{trainer}-merge"), None, model=str(merged), mode=self.plan.eval_plan_mode,
                           c1_from=self.out / "dds" / "baseline"),
        ]

    def _model_inputs(self) -> tuple[str, ...]:
        return tuple(f"{t}-merge" for t in self.trainers)

    def task_config(self, key: str) -> str | None:
        """A task's run config (eval.<task>_config), or None for the task's own default; a relative
        path that is not in the current folder is read beside the recipe."""
        given = getattr(self.plan, f"eval_plan_{key}", None)
        return str(beside(given, self.recipe_path)) if given else None

    def protocol_stage(self, name: str, base_id: dict, split: str = "test") -> Stage:
        """A task's stage, as its Task.study_run describes it: every condition of the comparison (the
        base model with each prompting mitigation, then each fine-tuned model), or on the train split
        the base model alone, whose conversations the pairs stage reads."""
        task = get_task(name)
        train = split == "train"
        stage = f"{name}-train" if train else name
        conditions = [StudyCondition("Baseline", self.model)]
        if not train:
            conditions += [StudyCondition(CONDITION_NAMES.get(m, m), self.model, m) for m in self.plan.eval_plan_mitigations]
            conditions += [StudyCondition(n, str(p)) for n, p in self.models.items()]

        ctx = StudyContext(stage, self.out / stage, self.task_config(task_config_key(name)), conditions, split,
                           self.plan.eval_plan_backend, self.plan.eval_plan_limit,
                           None if self.on_gpu() else "cpu", self.recipe_path, self.backend_args_json())
        where = f"{self.recipe_path}: eval.{'train_protocols' if train else 'protocols'}"
        try:
            described = task.study_run(ctx)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
        if not described.outputs:
            raise UserError(f"{where}: task {name!r}: study_run gave no outputs (the files that mean its stage is done)")
        if not train:
            self.protocol_runs += described.comparison
            if described.report is not None:
                self.artefacts.append((f"{name} report", described.report))
        return Stage(stage, described.title, {**described.params, "model": base_id}, () if train else self._model_inputs(),
                     tuple(described.outputs), (ctx.out,), described.run)

    def capability_stage(self, base_id: dict) -> Stage:
        """lm-evaluation-harness on local MMLU: the base model and every merged model (eval/pipeline/capability.py)."""
        out = self.out / "capability"
        models = {"Baseline": self.model, **{n: str(p) for n, p in self.models.items()}}

        def run() -> None:
            run_capability(models, out, per_subject=self.plan.eval_plan_capability_per_subject,
                           data_root=self.plan.eval_plan_data_root, device=None if self.on_gpu() else "cpu")

        return Stage("capability", "capability guard: MMLU accuracy by lm-evaluation-harness, base and merged models",
                     {"models": models, "per_subject": self.plan.eval_plan_capability_per_subject,
                      "data_root": self.plan.eval_plan_data_root, "model": base_id},
                     self._model_inputs(), (out / CAPABILITY_UNITS,), (out,), run)

    def compare_stage(self, stages: list[Stage], protocol_stages: list[str]) -> Stage:
        report = self.out / "compare"
        inputs = tuple(s.name for s in stages if s.name in {"baseline", "capability", *protocol_stages,
                                                             *self.plan.eval_plan_mitigations}
                       or s.name.endswith("-eval"))
        self.artefacts += [("comparison report", report / "comparison.md"), ("DDS heatmap", report / "dds_heatmap.png"),
                           ("transfer report (cells, roles)", report / "transfer.md"),
                           ("before/after bars", report / "before_after.png")]
        if self.protocol_runs:
            self.artefacts.append(("multi-turn numbers (long form)", report / "comparison_protocols.csv"))

        def run() -> None:
            conditions = {n: str(p) for n, p in self.conditions.items()}
            cmp = build_comparison(conditions, n_boot=self.plan.eval_plan_n_boot, seed=0)
            transfer = build_transfer(conditions, self.protocol_runs, self.pairs.pairs_dir if self.trainers else None,
                                      cmp["reports"], PairRules.from_args(self.pairs), n_boot=self.plan.eval_plan_n_boot,
                                      capability=self.out / "capability" / CAPABILITY_UNITS)
            write_comparison(cmp, report, protocols=protocol_rows(self.protocol_runs), protocol_runs=self.protocol_runs,
                             transfer=transfer)
            # every evaluated cell's role (trained-on / held-out / cross-protocol / untargeted), beside the stages
            self.state["transfer"] = {"cells": json.loads((report / TRANSFER_JSON).read_text(encoding="utf-8"))["cells"],
                                      "report": str(report / "transfer.md")}

        return Stage("compare", "before/after comparison report",
                     {"conditions": {n: str(p) for n, p in self.conditions.items()}, "n_boot": self.plan.eval_plan_n_boot},
                     inputs, tuple(report / f for f in ("comparison.csv", "comparison.md", "before_after.png", "transfer.csv")),
                     (report,), run)

    def wandb_stage(self) -> Stage:
        marker = self.out / "wandb_run.json"

        def run() -> None:
            info = log_to_wandb(self)
            atomic_write_json(marker, info)

        return Stage("wandb", f"eval and comparison results to wandb (project {self.tracking.tracking_project}, "
                              f"group {self.tracking.tracking_group or self.tracking.tracking_run_name})",
                     {"tracking": self.raw["tracking"], "flip_sample": self.plan.eval_plan_flip_sample},
                     ("compare",), (marker,), (marker,), run)

    # ------------------------------------------------------------------ state
    def _load_state(self) -> dict[str, Any]:
        path = self.out / STUDY_FILE
        if not path.is_file():
            return {"format": STUDY_FORMAT, "stages": {}}
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: unreadable study state ({exc}); remove it to start the study afresh") from None
        if not isinstance(state, dict) or state.get("format") != STUDY_FORMAT:
            raise UserError(f"{path}: not a {STUDY_FORMAT} file")
        return state

    def _save_state(self) -> None:
        self.state.update(recipe=self.recipe_path, out=str(self.out), model=self.model, updated=now_iso(),
                          order=[s.name for s in self.stages])
        atomic_write_text(self.out / STUDY_FILE, dumps_utf8(self.state, indent=2) + "\n", adopt=_study_file)

    def check_folders(self, stages: list[Stage] | None = None) -> None:
        """Before any stage (and again as each stage starts): every folder a stage would clear
        either does not exist or is recorded in study.json as this study's own. Anything else
        (the user's files, an earlier `flipguard eval` run, another study's stage) is refused,
        never removed."""
        entries = self.state["stages"]
        for stage in self.stages if stages is None else stages:
            if stage.name in entries:
                continue
            for path in stage.clear:
                if path.exists():
                    what = "an earlier flipguard run" if written_by_flipguard(path) else "not flipguard's"
                    raise UserError(
                        f"stage {stage.name}: {path} exists and was not written by this study ({what}; "
                        f"{self.out / STUDY_FILE} does not record it); nothing was changed: move it away or "
                        "use another --out")

    def built_from_current(self, stage: Stage) -> bool:
        """Built from its inputs as they are now: an input redone since (e.g. `--only sft`)
        makes this stage stale even though every fingerprint still matches."""
        entries = self.state["stages"]
        built_from = (entries.get(stage.name) or {}).get("built_from") or {}
        return all(built_from.get(i) == (entries.get(i) or {}).get("build") for i in stage.inputs)

    def fingerprints(self) -> dict[str, str]:
        fps: dict[str, str] = {}
        for s in self.stages:
            fps[s.name] = _sha({"stage": s.name, "params": s.params, "inputs": {i: fps[i] for i in s.inputs}})
        return fps

    def step(self, title: str) -> None:
        self.print(f"\n=== [{time.time() - self.t0:6.0f}s] {title}")

    def run(self, from_stage: str | None = None, only: str | None = None) -> list[tuple[str, str, float]]:
        names = [s.name for s in self.stages]
        for flag, value in (("--from", from_stage), ("--only", only)):
            if value is not None and value not in names:
                raise UserError(f"{flag} {value}: no such stage in this study (stages: {', '.join(names)})")
        if from_stage and only:
            raise UserError("--from and --only: give one of them")
        self.check_folders()
        # before any work: the study's own files replace nothing of the user's (files.check_replace)
        for path in (self.recipe_file, self.out / STUDY_FILE, self.out / VIEW_FILE):
            check_replace(path, adopt=_study_file)
        self.out.mkdir(parents=True, exist_ok=True)

        atomic_write_text(self.recipe_file, f"{RECIPE_HEADER} (from {self.recipe_path}); "
                                            "written by flipguard study\n" + yaml.safe_dump(public_recipe(self.raw), sort_keys=False),
                          adopt=_study_file)
        fps = self.fingerprints()
        entries = self.state["stages"]
        start = names.index(from_stage) if from_stage else None
        for i, stage in enumerate(self.stages):
            entry = entries.get(stage.name) or {}
            current = (entry.get("status") == "done" and entry.get("fingerprint") == fps[stage.name]
                       and all(p.exists() for p in stage.outputs) and self.built_from_current(stage))
            forced = stage.name == only or (start is not None and i >= start)
            if only and stage.name != only:
                self.statuses.append((stage.name, "skipped" if current else "not run", 0.0))
                continue
            if current and not forced:
                self.statuses.append((stage.name, "skipped", 0.0))
                self.print(f"--- {stage.name}: skipped (up to date)")
                continue
            missing = [n for n in stage.inputs if (entries.get(n) or {}).get("status") != "done"
                       or entries[n].get("fingerprint") != fps[n]]
            if missing:
                raise UserError(f"stage {stage.name}: its input stage(s) {', '.join(missing)} are not done with the "
                                 "current settings; run the study without --only first")
            self.state.pop("plan", None)  # the quick-rerun key holds only after a full run (main's record_plan)
            resume = entry.get("status") == "running" and entry.get("fingerprint") == fps[stage.name] and not forced
            status = "resume" if resume else ("redo" if entry else "run")
            # where the study stands, and how long this stage took when it last ran (its ETA on a redo)
            last = f", {entry['seconds']:.0f}s last time" if entry.get("seconds") else ""
            self.step(f"{stage.title}  [{stage.name}: {status}, stage {i + 1}/{len(self.stages)}{last}]")
            if stage.name not in entries:
                self.check_folders([stage])  # again at the moment it runs: a folder that appeared since is refused
            foreign = list(entry.get("foreign") or [])
            if not resume:
                foreign = self.clear(stage, entry)
            entries[stage.name] = {"status": "running", "fingerprint": fps[stage.name], "inputs": list(stage.inputs),
                                   "foreign": foreign,
                                   "built_from": {i: entries[i].get("build") for i in stage.inputs},
                                   "params": json.loads(json.dumps(stage.params, default=str)),
                                   "outputs": [str(p) for p in stage.outputs], "started": now_iso()}
            self._save_state()
            t = time.time()
            stage.run()
            missing_out = [str(p) for p in stage.outputs if not p.exists()]
            if missing_out:
                raise UserError(f"stage {stage.name}: finished without writing {', '.join(missing_out)}")
            seconds = time.time() - t
            entries[stage.name].update(status="done", seconds=round(seconds, 2), finished=now_iso(), last_action=status,
                                       build=uuid.uuid4().hex[:12],
                                       files={os.path.relpath(k, self.out): v for p in stage.clear
                                              for k, v in written_files(p, foreign).items()})
            self._save_state()
            self.statuses.append((stage.name, status, seconds))
            self.print(f"--- {stage.name}: {status} in {seconds:.1f}s")
        for stage in self.stages:  # a done stage whose inputs were redone since (--only) says so: stale
            entry = entries.get(stage.name) or {}
            if entry.get("status") == "done" and (entry.get("fingerprint") != fps[stage.name]
                                                  or not self.built_from_current(stage)):
                entry["status"] = "stale"
        self._save_state()
        return self.statuses

    def clear(self, stage: Stage, entry: dict[str, Any]) -> list[str]:
        """Before a stage is redone: remove what it wrote (its folders' manifests, study.json's
        record of its files), keep the rest and say so in one line; returns what was kept."""
        kept = []
        files = {str(self.out / k): v for k, v in (entry.get("files") or {}).items()}  # recorded relative to --out
        for path in stage.clear:
            kept += remove_owned(path, files)
        if kept:
            shown = ", ".join(str(p) for p in kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
            self.print(f"--- {stage.name}: kept {len(kept)} file(s) flipguard did not write: {shown}")
        return [str(p) for p in kept]

    def summary(self) -> None:
        print_outcome(f"Stages ({time.time() - self.t0:.0f}s in all):", self.statuses, self.out, self.print)


def print_outcome(header: str, statuses: list[tuple[str, str, float]], out: Path,
                  print_fn: Callable[[str], None] = print) -> None:
    """The stage table, then the before/after table when the comparison exists."""
    print_fn(f"\n{header}")
    for name, status, seconds in statuses:
        print_fn(f"  {name:<22}{status:<9}{seconds:8.1f}s")
    comparison = out / "compare" / "comparison.csv"
    if comparison.is_file():
        print_before_after(comparison, print_fn)


def print_before_after(comparison_csv: Path, print_fn: Callable[[str], None] = print) -> None:
    """The short before/after table a newcomer reads first (all datasets, macro average)."""
    table = pd.read_csv(comparison_csv)
    rows = table[table["dataset"] == TOTAL_AVG]
    lines = ["\nBefore/after (all datasets, %; DDS in pp; paper = C2 vs the baseline's C1, own = the model's own C1):",
             f"{'condition':<14}{'C1 true':>8}{'C1 false':>9}{'C2 corr':>8}{'C2 incorr':>10}{'DDS paper':>10}"
             f"{'own DDS':>9}{'invalid':>8}  flags"]
    for r in rows.itertuples():
        flags = " ".join(f for f, on in (("†over-correction", r.over_correction), ("‡C1-damage", r.c1_damage is True
                                         or str(r.c1_damage) == "True")) if on)
        lines.append(f"{r.condition:<14}{r.own_c1_true:8.1f}{r.own_c1_false:9.1f}{r.c2_correct:8.1f}{r.c2_incorrect:10.1f}"
                     f"{r.dds:+10.1f}{r.own_dds:+9.1f}{int(r.invalid_judgments):8d}  {flags}")
    print_fn("\n".join(lines))
    protocols = comparison_csv.with_name("comparison_protocols.csv")
    if protocols.is_file():
        print_protocols_table(pd.read_csv(protocols), print_fn)


def print_protocols_table(frame, print_fn: Callable[[str], None] = print) -> None:
    """The multi-turn half of the before/after table: a row per condition, a column per metric
    of each protocol (comparison_protocols.csv; % and pp), with the guarded-metric flags."""
    flags = protocol_flags(frame)
    for protocol, rows in frame.groupby("protocol", sort=False):
        metrics = list(dict.fromkeys(rows["metric"]))
        width = max(len(m) for m in metrics) + 1
        lines = [f"\n{protocol} before/after (%; differences in pp; 95% CIs in compare/comparison_protocols.csv):",
                 f"{'condition':<14}" + "".join(f"{m:>{width}}" for m in metrics) + "  flags"]
        for (condition, system), group in rows.groupby(["condition", "system"], sort=False):
            values = dict(zip(group["metric"], group["value"]))
            cells = "".join(f"{values[m]:>{width}.1f}" if m in values else f"{'–':>{width}}" for m in metrics)
            lines.append(f"{condition:<14}{cells}  {flags.get((condition, protocol, system), '')}")
        print_fn("\n".join(lines))


def log_to_wandb(study: Study) -> dict[str, Any]:
    """The study's results in the recipe's wandb project and group, beside its training
    runs: per-dataset DDS table, comparison table, before/after plots, a flip sample."""
    import wandb


    tracking = study.tracking
    name = f"{tracking.tracking_run_name or Path(study.recipe_path).stem}-study"
    run = start_wandb(tracking, name, {"recipe": public_recipe(study.raw), "recipe_path": study.recipe_path},
                      os.environ.get("WANDB_DIR") or str(study.out), job_type="study")
    try:
        frames = []
        for cond, run_dir in study.conditions.items():
            summary = pd.read_csv(Path(run_dir) / "report" / "summary.csv")
            frames.append(summary.assign(condition=cond))
        dds = pd.concat(frames, ignore_index=True)
        comparison = pd.read_csv(study.out / "compare" / "comparison.csv")
        logged: dict[str, Any] = {"dds_by_dataset": wandb.Table(dataframe=dds),
                                  "comparison": wandb.Table(dataframe=comparison)}
        for png in ("before_after.png", "dds_heatmap.png"):
            path = study.out / "compare" / png
            if path.is_file():
                logged[png[:-4]] = wandb.Image(str(path))
        flips_csv = study.conditions["Baseline"] / "report" / "flips.csv"
        if flips_csv.is_file():
            # the baseline's C1/C2 pair records, flipped pairs first, then the rest, each in random order
            pairs = pd.read_csv(flips_csv).sample(frac=1.0, random_state=0)
            pairs = pd.concat([pairs[pairs["flip"].notna()], pairs[pairs["flip"].isna()]])
            logged["flip_sample"] = wandb.Table(dataframe=pairs.head(study.plan.eval_plan_flip_sample))
            logged["flipped_pairs"] = int(pairs["flip"].notna().sum())
        run.log(logged)
        info = {"name": run.name, "id": run.id, "project": tracking.tracking_project, "group": run.group,
                "dir": str(run.dir), "logged": sorted(logged)}
    finally:
        run.finish()
    return info


def effective_recipe(recipe_path: str, parsed: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The recipe file with the command line's section values applied."""
    raw = read_recipe(recipe_path)
    for section, values in parsed.items():
        raw[section] = values
    if model:
        raw["model_name_or_path"] = model
    return raw


def run_study(recipe_path: str, out: str | os.PathLike, raw: dict[str, Any] | None = None, *,
              from_stage: str | None = None, only: str | None = None, print_fn: Callable[[str], None] = print,
              on_finish: Callable[[Study], None] | None = None) -> Study:
    """Run (or resume) the study a recipe describes; `raw` overrides the file's contents;
    `on_finish` runs while the study still holds its folder."""
    raw = read_recipe(recipe_path) if raw is None else raw
    validate_recipe(raw, recipe_path)
    # one writer per study folder, held from before study.json is read until the last stage
    # (trainers and merges included): a second study is refused at once, naming the holder
    with run_lock(out):
        study = Study(recipe_path, raw, out, print_fn=print_fn)
        study.run(from_stage=from_stage, only=only)

        # every stage's status and the comparison with the items behind it, one HTML page
        study.artefacts.append(("page of it all (open in a browser)", write_view(study.out)))
        study.summary()
        if on_finish is not None:
            on_finish(study)
    return study


def _file_sha(path: str | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path and Path(path).is_file() else None


def _quick_args(argv: list[str]) -> tuple[str | None, list[str], str | None, bool]:
    """(recipe, other flags, --out, whether --from/--only was given), read without TRL:
    enough to tell whether a finished study is being rerun unchanged."""
    try:
        recipe, rest = split_recipe_argv(argv)
    except FlipguardError:
        return None, argv, None, True
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--out")
    parser.add_argument("--from", "--from_stage", dest="from_stage")
    parser.add_argument("--only")
    known, _ = parser.parse_known_args(rest)
    out = known.out or (str(Path("runs") / f"{Path(recipe).stem}-study") if recipe else None)
    return recipe, rest, out, bool(known.from_stage or known.only)


def plan_key(recipe: str, rest: list[str], out: str) -> str:
    return _sha({"version": __version__, "git_commit": git_commit(), "recipe": _file_sha(recipe), "argv": rest, "out": str(Path(out).resolve())})


def _key_flags(flags: list[str], includes: list[str]) -> list[str]:
    """The flags a study's plan key holds: the command's, and its --include files."""
    return [*flags, *(f"--include={path}" for path in includes)]


def rerun_unchanged(argv: list[str], includes: list[str] = ()) -> bool:
    """A rerun of a finished study with the same recipe bytes, flags, watched files (the tasks'
    run configs, --include files), code version and base model: every stage is up to date, so say so without
    importing TRL (whose import is most of a rerun's time). Anything else: the full path."""
    if "-h" in argv or "--help" in argv:
        return False
    recipe, rest, out, partial = _quick_args(argv)
    if not recipe or partial or not out or not (Path(out) / STUDY_FILE).is_file():
        return False

    with run_lock(out):
        return _print_if_unchanged(recipe, _key_flags(rest, list(includes)), out)


def _print_if_unchanged(recipe: str, rest: list[str], out: str) -> bool:
    try:
        state = json.loads((Path(out) / STUDY_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    plan = state.get("plan") or {}
    if plan.get("key") != plan_key(recipe, rest, out) or plan.get("model") != model_identity(state.get("model", "")):
        return False
    if any(_file_sha(path) != sha for path, sha in (plan.get("files") or {}).items()):
        return False
    stages = state.get("stages") or {}
    order = state.get("order") or []
    if not order or any((stages.get(n) or {}).get("status") != "done" for n in order):
        return False
    if any(not Path(p).exists() for n in order for p in stages[n].get("outputs", [])):
        return False
    for name in order:
        print(f"--- {name}: skipped (up to date)")
    print_outcome(f"Stages (recipe, flags and inputs unchanged since {plan.get('at')}):",
                  [(name, "skipped", 0.0) for name in order], Path(out))
    print_artefacts([(what, Path(path)) for what, path in state.get("artefacts", [])])
    return True


def print_artefacts(artefacts: list[tuple[str, Path]]) -> None:
    print("\nArtefacts:")
    for what, path in artefacts:
        print(f"  {what:<34} {path}")


def main(argv: list[str]) -> int:
    includes, argv = split_includes(argv)  # a user's tasks (--include my_tasks.py), named in eval.protocols
    if rerun_unchanged(argv, includes):
        return 0
    for path in includes:
        include_tasks(path)

    plan_class = study_plan_class()
    (args, plan, pairs, tracking), recipe_path, recipe = parse_recipe(
        argv, (StudyArguments, plan_class, PairsArguments, TrackingArguments), prog="flipguard study",
        description=StudyArguments.__doc__)
    if recipe_path is None:
        raise UserError("flipguard study: give a recipe file (flipguard study recipes/tiny.yaml --out DIR)")
    check_task_config_keys(recipe, recipe_path, plan_class)  # the parser drops a key it has no flag for
    configure_threads(args.threads)
    parsed = {}
    for section, obj in (("eval", plan), ("pairs", pairs), ("tracking", tracking)):
        prefix = ARG_SECTIONS[section]
        parsed[section] = {k[len(prefix):]: v for k, v in dataclasses.asdict(obj).items()}
    raw = effective_recipe(recipe_path, parsed, args.model)
    out = args.out or str(Path("runs") / f"{Path(recipe_path).stem}-study")
    def record_plan(study: Study) -> None:
        if args.from_stage or args.only:
            return
        # every stage ran or was up to date: a plain rerun may take the quick path
        _, rest, _, _ = _quick_args(argv)

        configs = [study.task_config(task_config_key(t)) for t in (*study.plan.eval_plan_protocols,
                                                                   *study.plan.eval_plan_train_protocols)]
        watched = [recipe_path, *dict.fromkeys(c for c in configs if c), *includes]
        study.state["plan"] = {"key": plan_key(recipe_path, _key_flags(rest, includes), out),
                               "model": model_identity(study.model),
                               "files": {c: _file_sha(c) for c in watched}, "at": now_iso()}
        study.state["artefacts"] = [[what, str(path)] for what, path in study.artefacts]
        study._save_state()

    study = run_study(recipe_path, out, raw, from_stage=args.from_stage, only=args.only, on_finish=record_plan)
    print_artefacts(study.artefacts)
    return 0
