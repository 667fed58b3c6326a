"""Which stages a study runs, in which order, and what each reads and writes.

Stages, in order (the recipe decides which exist): `baseline` (DDS, test split, all four
cases) and `baseline-<mode>` for eval.extra_modes; one per prompting mitigation (fixed C1
from the baseline); `base-train` (the base model on the train split: the flip records);
`pairs`; per trainer section (a registered trainer, config/trainers.py: `sft`, `dpo`, ...) the trainer (accelerate launch on a GPU, in process on CPU),
`<trainer>-merge` and `<trainer>-eval` (the merged model, same eval as the baseline);
one per task eval.protocols names (built in or a user's, `--include my_tasks.py` or a
`flipguard.tasks` entry point: the task's `study_run` describes its stage, and its
`comparison_rows` its part of the comparison), `<task>-train` before the pairs for each of
eval.train_protocols; `compare` (comparison report with plots); `wandb` when report_to
names wandb.

A `Stage` says what it reads (`params`, hashed into its fingerprint: fingerprints.py), the
stages whose outputs it reads, the files that mean it finished and the folders a redo
clears. Running the plan (skip, resume, redo, study.json) is study.py's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

from flipguard.config import (
    ARG_SECTIONS,
    PairsArguments,
    TrackingArguments,
    ValidationArguments,
    eval_plan_arguments,
    is_section,
    is_task_config_key,
    read_recipe,
    task_config_key,
    trainer_entry,
    trainers,
)
from flipguard.data.pair_sets import VALIDATION_FILE
from flipguard.data.unified import load_items
from flipguard.errors import FlipguardError, UserError
from flipguard.eval.backends.base import model_kwargs
from flipguard.eval.dds.protocol import EvalArgs, evaluate
from flipguard.eval.dds.report import print_summary, report_run, write_report
from flipguard.eval.embedded.tiny_model import TINY_MODEL_ALIASES
from flipguard.eval.mitigations import MITIGATIONS
from flipguard.eval.records import REPORT_DIR
from flipguard.eval.runner import DEFAULT_MIN_LABEL_MASS, MODES
from flipguard.eval.task import StudyCondition, StudyContext
from flipguard.eval.task_registry import get_task, task_names
from flipguard.files import PACKAGE_ROOT, atomic_write_json, beside
from flipguard.pairs.builder import print_counts
from flipguard.pairs.builder import run as build
from flipguard.pairs.filters import PairRules
from flipguard.pipeline.capability import UNITS_FILE as CAPABILITY_UNITS
from flipguard.pipeline.capability import run_capability
from flipguard.pipeline.compare import build_comparison, protocol_rows, require_whole_runs, write_comparison
from flipguard.pipeline.fingerprints import model_identity
from flipguard.pipeline.tracking import log_study_to_wandb
from flipguard.pipeline.transfer import TRANSFER_JSON, build_transfer
from flipguard.runtime.resolve import resolve_model
from flipguard.train.merge import MERGE_INFO_FILE
from flipguard.train.merge import main as merge_main
from flipguard.train.utils import PROVENANCE_FILE, adapter_bytes, check_lora_rank, check_lora_targets, model_bytes, wants_wandb

PAIRS_DATASETS_DEFAULT = next(f.default for f in dataclasses.fields(PairsArguments) if f.name == "pairs_datasets")
# prompting mitigation -> condition name in the comparison
CONDITION_NAMES = {"be_honest": "Be Honest", "dehumanizing": "Dehumanizing"}


@dataclasses.dataclass
class Stage:
    name: str
    title: str
    params: dict[str, Any]          # exactly what the stage reads (hashed)
    inputs: tuple[str, ...]         # stages whose outputs it reads
    outputs: tuple[Path, ...]       # all present = the stage finished
    clear: tuple[Path, ...]         # removed before a redo
    run: Callable[[], None]
    # what study.json keeps of the finished stage (read once it has run), beside its status
    recorded: Callable[[], dict[str, Any]] | None = None
    # about how many bytes the stage writes, and why that many, before it has ever run (a full disk's message)
    room: Callable[[], tuple[int, str] | None] | None = None

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


def recipe_trainers(raw: dict[str, Any], listed: list[str] | None) -> list[str]:
    """The trainers a study runs: eval.trainers when listed, else every trainer section of the recipe."""
    return [t for t in trainers() if t in raw] if listed is None else list(listed)


class StudyPlan:
    """A recipe's stages for one study folder: the recipe's sections resolved (the eval plan,
    tracking, pairs and trainers writing under `out`), checked, and turned into stages."""

    def __init__(self, recipe_path: str | os.PathLike, raw: dict[str, Any], out: str | os.PathLike,
                 *, print_fn: Callable[[str], None] = print, homes: dict[str, Path] | None = None,
                 variant: dict[str, Any] | None = None):
        self.recipe_path = str(recipe_path)
        self.out = Path(out)
        self.print = print_fn
        # where a part of the plan writes when not in `out` ("base": the base model's runs, "pairs", a
        # trainer's name): a recipe grid's variants share them (pipeline/grid.py); `variant`: its values
        self.homes = dict(homes or {})
        self.variant = dict(variant or {})
        self.raw = copy.deepcopy(raw)
        plan_class = study_plan_class()
        check_task_config_keys(self.raw, self.recipe_path, plan_class)
        self.plan = _as_args(plan_class, "eval", _section(self.raw, "eval", plan_class))
        self.tracking = _as_args(TrackingArguments, "tracking", _section(self.raw, "tracking", TrackingArguments))
        self.model = str(self.raw.get("model_name_or_path") or "flipguard:tiny")
        self.check_plan()
        # this study's folders: pairs from its own train-split records, adapters under it
        pairs = _section(self.raw, "pairs", PairsArguments)
        pairs.update(records=str(self.home("base") / "dds" / "base-train"), dir=str(self.home("pairs") / "pairs"))
        self.raw["pairs"] = pairs
        self.pairs = _as_args(PairsArguments, "pairs", pairs)
        for trainer in self.trainers:
            self.raw[trainer] = {**(self.raw.get(trainer) or {}), "output_dir": str(self.home(trainer) / "train" / trainer)}
        self.raw["eval"] = {k[len("eval_plan_"):]: v for k, v in dataclasses.asdict(self.plan).items()}
        self.raw["tracking"] = {k[len("tracking_"):]: v for k, v in dataclasses.asdict(self.tracking).items()}
        # train until removed (`validation:`): the pairs stage holds the slice back, the trainers measure it
        self.validation = _as_args(ValidationArguments, "validation", _section(self.raw, "validation", ValidationArguments))
        if self.validation.on or self.raw.get("validation"):
            self.raw["validation"] = {k[len("validation_"):]: v for k, v in dataclasses.asdict(self.validation).items()}
        self.recipe_file = self.out / "recipe.yaml"
        self.artefacts: list[tuple[str, Path]] = []
        self.conditions: dict[str, Path] = {}
        self.models: dict[str, Path] = {}
        self.protocol_runs: list[tuple[str, str]] = []  # (condition, RUN_DIR@system) for the comparison
        self.stages = self.build_stages()

    def home(self, part: str) -> Path:
        """The folder `part` of the plan writes in: the study folder, unless `homes` names another."""
        return self.homes.get(part, self.out)

    def effective_recipes(self) -> list[tuple[Path, dict[str, Any]]]:
        """(DIR/recipe.yaml, the effective recipe) of every plan whose stages read one: the study writes
        them before any stage runs."""
        return [(self.recipe_file, self.raw)]

    @property
    def trainers(self) -> list[str]:
        return recipe_trainers(self.raw, self.plan.eval_plan_trainers)

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
                for trainer in self.trainers:  # a trainer section may set a rank of its own
                    section = self.raw.get(trainer) or {}
                    key = f"{trainer}.lora_r" if "lora_r" in section else "lora_r"
                    check_lora_rank(section.get("lora_r", self.raw.get("lora_r")), self.raw.get("lora_target_modules"),
                                    resolve_model(self.model), self.recipe_path, key)
        # every eval run's backend settings, as eval's --backend_args takes them
        model_kwargs(self.plan.eval_plan_backend, self.backend_args_json(), batch_size=self.plan.eval_plan_batch_size,
                     where=f"{self.recipe_path}: eval.backend_args")
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
                 c1_from: Path | None = None, home: str = "base"):
        plan = self.plan
        limit = plan.eval_plan_limit
        if mode == "generate" and plan.eval_plan_generate_limit is not None:
            limit = plan.eval_plan_generate_limit
        return EvalArgs(
            model=model, out=str(self.home(home) / "dds" / name), backend=plan.eval_plan_backend, mode=mode,
            datasets=self.pairs.pairs_datasets if split == "train" else plan.eval_plan_datasets, split=split,
            data_root=(self.pairs.pairs_data_root if split == "train" else plan.eval_plan_data_root), limit=limit,
            mitigations=[mitigation], c1_from=str(c1_from) if c1_from else None, max_new_tokens=plan.eval_plan_max_new_tokens,
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
        if args.mitigations != ["none"]:
            title += f" ({args.mitigations[0]})"
        write_report(report, run_dir / REPORT_DIR, title)
        print_summary(report, title)

    def build_stages(self) -> list[Stage]:
        plan, base = self.plan, self.home("base")
        base_id = model_identity(self.model)
        mode = plan.eval_plan_mode
        stages: list[Stage] = []
        base_dir = base / "dds" / "baseline"
        stages.append(self.dds_stage("baseline", f"DDS baseline, {mode} mode ({plan.eval_plan_datasets} test split, all four cases)",
                                     (), base_id, model=self.model, mode=mode))
        self.conditions["Baseline"] = base_dir
        for extra in plan.eval_plan_extra_modes:
            stages.append(self.dds_stage(f"baseline-{extra}", f"DDS baseline, {extra} mode (own report; not compared)",
                                         (), base_id, model=self.model, mode=extra))
        for m in plan.eval_plan_mitigations:
            stages.append(self.dds_stage(m, f"DDS {m}, {mode} mode (all four cases; fixed C1 from the baseline and own C1)",
                                         ("baseline",), base_id, model=self.model, mode=mode, mitigation=m, c1_from=base_dir))
            self.conditions[CONDITION_NAMES.get(m, m)] = base / "dds" / m
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
                                                                     *(str(self.home("base") / name) for name in trained_on)])

        def run() -> None:
            out_dir, counts = build(pairs, self.recipe_path, records_given=True, validation=self.validation)
            print_counts(counts, out_dir)

        title = "flip records -> pair datasets (recipe strategy)" + (
            f" + multi-turn pairs from {', '.join(trained_on)}" if trained_on else "")
        read = dict.fromkeys(trainers()[t].pairs for t in self.trainers)  # the pair sets the trainers read
        if self.validation.on:
            title += f", less the validation slice ({self.validation.validation_share:g} of the train items)"
        params = {"pairs": self.raw["pairs"], "conversations": pairs.pairs_conversations,
                  **({"validation": self.raw["validation"]} if self.validation.on else {})}
        return Stage("pairs", title, params,
                     ("base-train", *trained_on), (pairs_dir / "counts.json", *(pairs_dir / f"{k}.jsonl" for k in read),
                                                   *([pairs_dir / VALIDATION_FILE] if self.validation.on else [])),
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
        home = self.home(trainer)
        adapter = home / "train" / trainer
        merged = home / "models" / f"{trainer}-merged"
        entry = trainer_entry(trainer, f"{self.recipe_path}: eval.trainers")
        name = entry.label
        self.models[name] = merged
        self.conditions[name] = home / "dds" / f"{trainer}-eval"
        self.artefacts.append((f"{name} merged model", merged))
        gpu = self.on_gpu()
        launch = gpu or self.accelerate_processes() > 1  # a CPU recipe whose accelerate config asks for several

        def train() -> None:
            if launch:
                config = self.plan.eval_plan_accelerate_config or str(PACKAGE_ROOT / "recipes" / "accelerate_configs" / "single_gpu.yaml")
                # `python -m flipguard <trainer>` in each process: a plug-in's trainer as flipguard's own
                cmd = ["accelerate", "launch", "--config_file", config, "-m", "flipguard", trainer, str(self.recipe_file)]
                self.print("$ " + " ".join(cmd))
                code = subprocess.run(cmd).returncode
                if code:
                    raise UserError(f"stage {trainer}: `{' '.join(cmd)}` failed with exit code {code}")
            else:
                entry.main([str(self.recipe_file)], prog=f"flipguard {trainer}")

        def merge() -> None:
            merge_main([str(self.recipe_file), "--adapter", str(adapter), "--out", str(merged),
                        "--pairs_dir", str(self.pairs.pairs_dir)])

        def adapter_room() -> tuple[int, str] | None:
            section = self.raw.get(trainer) or {}
            size = adapter_bytes(section.get("lora_r", self.raw.get("lora_r")), self.raw.get("lora_target_modules"),
                                 resolve_model(self.model)) if self.raw.get("use_peft") else None
            return (size, "the adapter's LoRA weights and the base model's tokenizer files") if size else None

        def merged_room() -> tuple[int, str] | None:
            size = model_bytes(resolve_model(self.model))
            return (size, "the base model's weights, which the merged model holds again") if size else None

        top = self.top_level()
        where = "accelerate launch" if launch else "in process on CPU"
        return [
            Stage(trainer, f"{name} (LoRA adapter, recipe settings), {where}"
                  + (f"; validation every {self.validation.validation_every} steps, max_steps a budget"
                     if self.validation.on else ""),
                  {"top": top, trainer: self.raw[trainer], "pairs": self.raw["pairs"], "model": base_id,
                   "accelerate_config": self.plan.eval_plan_accelerate_config if launch else None,
                   **({"validation": self.raw["validation"]} if self.validation.on else {})},
                  ("pairs",), (adapter / "adapter_config.json", adapter / PROVENANCE_FILE), (adapter,), train,
                  room=adapter_room),
            Stage(f"{trainer}-merge", f"merge the {name} adapter into the base (merge gap measured on train prompts)",
                  {"top": top, "model": base_id}, (trainer, "pairs"), (merged / MERGE_INFO_FILE,), (merged,), merge,
                  room=merged_room),
            self.dds_stage(f"{trainer}-eval", f"{name} model, same DDS evaluation (all four cases; fixed C1 from the baseline and own C1)",
                           ("baseline", f"{trainer}-merge"), None, model=str(merged), mode=self.plan.eval_plan_mode,
                           c1_from=self.home("base") / "dds" / "baseline", home=trainer),
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

        config = (train and self.task_config(task_config_key(name, "train"))) or self.task_config(task_config_key(name))
        ctx = StudyContext(stage, (self.home("base") if train else self.out) / stage, config, conditions, split,
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
        """lm-evaluation-harness on local MMLU: the base model and every merged model (pipeline/capability.py)."""
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
            require_whole_runs(conditions, self.protocol_runs)
            cmp = build_comparison(conditions, n_boot=self.plan.eval_plan_n_boot, seed=0)
            transfer = build_transfer(conditions, self.protocol_runs, self.pairs.pairs_dir if self.trainers else None,
                                      cmp["reports"], PairRules.from_args(self.pairs), n_boot=self.plan.eval_plan_n_boot,
                                      capability=self.out / "capability" / CAPABILITY_UNITS)
            write_comparison(cmp, report, protocols=protocol_rows(self.protocol_runs), protocol_runs=self.protocol_runs,
                             transfer=transfer, n_boot=self.plan.eval_plan_n_boot)

        def recorded() -> dict[str, Any]:
            # every evaluated cell's role (trained-on / held-out / cross-protocol / untargeted), beside the stages
            return {"transfer": {"cells": json.loads((report / TRANSFER_JSON).read_text(encoding="utf-8"))["cells"],
                                 "report": str(report / "transfer.md")}}

        return Stage("compare", "before/after comparison report",
                     {"conditions": {n: str(p) for n, p in self.conditions.items()}, "n_boot": self.plan.eval_plan_n_boot},
                     inputs, tuple(report / f for f in ("comparison.csv", "comparison.md", "before_after.png", "transfer.csv")),
                     (report,), run, recorded)

    def wandb_stage(self) -> Stage:
        marker = self.out / "wandb_run.json"

        def run() -> None:
            info = log_study_to_wandb(self.tracking, self.recipe_path, self.raw, self.out, self.conditions,
                                      self.plan.eval_plan_flip_sample, self.variant)
            atomic_write_json(marker, info)

        return Stage("wandb", f"eval and comparison results to wandb (project {self.tracking.tracking_project}, "
                              f"group {self.tracking.tracking_group or self.tracking.tracking_run_name})",
                     {"tracking": self.raw["tracking"], "flip_sample": self.plan.eval_plan_flip_sample,
                      **({"variant": self.variant} if self.variant else {})},
                     ("compare",), (marker,), (marker,), run)
