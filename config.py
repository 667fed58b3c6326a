"""The one config parser: recipes and commands, both on TRL's own parser.

Two entry points over one `trl.TrlParser` subclass and one YAML reader (files.load_yaml):
`parse_recipe` for the training scripts and the study (a sectioned recipe, below) and
`parse_dataclasses` for every other command (its options, or a flat YAML/JSON run config
followed by flag overrides). TrlParser is TRL's HfArgumentParser; importing it took
0.22-0.30 s here (`python -c "import time; t=time.perf_counter(); from trl import TrlParser;
print(time.perf_counter()-t)"`, 3 runs) against 0.76-0.92 s for transformers' own
HfArgumentParser, so the commands build on it too. Where trl is not installed (vLLM's own
environment) the commands fall back to HfArgumentParser itself; recipes need trl.

A recipe is data (alignment-handbook style).

A recipe is data (alignment-handbook style). Its layout::

    model_name_or_path: Qwen/Qwen2.5-7B-Instruct   # top level: trl.ModelConfig fields
    load_in_4bit: true                             # (model, quantization, LoRA) and any
    lora_r: 64                                     # field SFTConfig and DPOConfig share
    seed: 42                                       # (seed, report_to, use_cpu, ...)
    sft: {learning_rate: 2.0e-4, ...}              # a registered trainer (TRAINERS): its TRL
    dpo: {beta: 0.1, dtype: float16, ...}          # config (+ ModelConfig overrides)
    pairs: {strategy: all, dir: ..., ...}          # PairsArguments   (flag prefix pairs_)
    eval: {datasets: bench, mode: logprob, ...}    # EvalPlanArguments (flag prefix eval_plan_)
    tracking: {project: flipguard, ...}            # TrackingArguments (flag prefix tracking_)

`train/<name>.py` reads the top level plus its trainer's section (`train/dpo.py`: `dpo:`);
the top level takes the fields that every trainer the recipe has a section for shares.
Every section is checked by every script, so a typo anywhere is an error that
names the key. Precedence: dataclass defaults < top level < trainer section < command
line. Section keys become flags with the section's prefix (`pairs: {strategy: flips}`
is `--pairs_strategy flips`); trainer and model keys keep their TRL names
(`--learning_rate 1e-4`, `--lora_r 8`).

The recipe path may be given positionally, exactly as typed
(`python train/dpo.py recipes/tiny.yaml`), or as `--config recipes/tiny.yaml` (TRL).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import math
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from flipguard.errors import FlipguardError, UserError
from flipguard.files import PACKAGE_ROOT, check_types, field_types, load_yaml
from flipguard.redact import redact_values


@dataclasses.dataclass(frozen=True)
class Trainer:
    """One registered trainer: everything the recipe parser, the study and the CLI need to know.
    By convention its name is also its recipe section, its script `train/<name>.py` (a
    `main(argv, prog)`), its command `flipguard <name>` and its study stages (<name>,
    <name>-merge, <name>-eval); adding a trainer is that script plus one `register_trainer`."""

    name: str
    config: str  # "module:Class" of its TRL config (the section's fields), imported on use
    pairs: str   # the pair dataset it reads from pairs.dir: "sft" (prompt/completion) or "dpo" (prompt/chosen/rejected)
    label: str   # its condition in the comparison
    help: str    # one line for `flipguard --help`

    def config_class(self):
        module, _, name = self.config.partition(":")
        return getattr(importlib.import_module(module), name)


TRAINERS: dict[str, Trainer] = {}


def register_trainer(trainer: Trainer) -> Trainer:
    TRAINERS[trainer.name] = trainer
    return trainer


register_trainer(Trainer("sft", "trl:SFTConfig", "sft", "SFT", "LoRA SFT from a recipe"))
register_trainer(Trainer("dpo", "trl:DPOConfig", "dpo", "DPO", "LoRA DPO from a recipe"))
register_trainer(Trainer("kto", "trl:KTOConfig", "dpo", "KTO", "LoRA KTO from a recipe, on the DPO pairs unpaired"))


def trainer_entry(name: str, where: str) -> Trainer:
    """The registered trainer `name`; anything else is one error listing the registered ones."""
    if name not in TRAINERS:
        raise UserError(f"{where}: unknown trainer {name!r} (registered trainers: {', '.join(TRAINERS)})")
    return TRAINERS[name]


def is_section(key: str) -> bool:
    """A recipe section (a trainer's, pairs/eval/tracking or env), not a top-level field."""
    return key in TRAINERS or key in ARG_SECTIONS or key == "env"


# section -> flag prefix of its dataclass fields
ARG_SECTIONS = {"pairs": "pairs_", "eval": "eval_plan_", "tracking": "tracking_"}
RECIPE_SUFFIXES = (".yaml", ".yml")




PAIR_STRATEGIES = ("all", "flips", "flip_weighted", "consistency", "afr", "conversation")


@dataclasses.dataclass
class PairsArguments:
    """How SFT/DPO pairs are built from the base model's train-split flip records (`pairs:`)."""

    pairs_strategy: str = dataclasses.field(
        default="all",
        metadata={
            "help": "all: correct and incorrect C2 variant of every train item (paper K.2); flips: both C2 "
            "variants of items the base model flipped; flip_weighted: all, flipped items repeated "
            "pairs_flip_weight times; consistency: C1, C2 and dehumanized framings with one target; "
            "afr: answer-flip judgments (pairs_afr_run); conversation: only the multi-turn pairs of pairs_conversations.",
            "choices": list(PAIR_STRATEGIES),
        },
    )
    pairs_seed: int = dataclasses.field(default=42, metadata={"help": "Seed for balancing and row order."})
    pairs_flip_weight: int = dataclasses.field(
        default=3, metadata={"help": "flip_weighted: each flipped item's rows appear this many times (>= 1)."}
    )
    pairs_accept_weight: int = dataclasses.field(
        default=1,
        metadata={"help": "Multi-turn pairs: each accept pair (the right option taken after an abstention) appears this "
                          "many times (>= 1). A stick-or-switch run yields several hold pairs per accept pair, and a model "
                          "trained mostly on holds can learn never to change its mind."},
    )
    pairs_keep_first_answers: bool = dataclasses.field(
        default=False,
        metadata={"help": "Multi-turn pairs: also replay the turn-1 answers the model got right in those runs (AFR's "
                          "baseline, stick-or-switch's single-shot prompts) as keep pairs, so training on the conversations "
                          "does not teach a letter prior (every stick-or-switch hold replies A or B, every accept C)."},
    )
    pairs_balance: bool = dataclasses.field(
        default=True, metadata={"help": "Down-sample the majority target so '1' and '2' are 50/50."}
    )
    pairs_datasets: str = dataclasses.field(
        default="bench", metadata={"help": "Train datasets (names, groups or comma list)."}
    )
    pairs_data_root: str | None = dataclasses.field(
        default=None, metadata={"help": "Data root (default: $FLIPGUARD_DATA, else the shipped samples)."}
    )
    pairs_framings: list[str] = dataclasses.field(
        default_factory=lambda: ["c1", "c2", "dehumanizing"],
        metadata={"help": "consistency: framings of the same content that share one target."},
    )
    pairs_records: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Run directory of the base model's train-split logprob eval (flipguard eval --split train)."},
    )
    pairs_afr_run: str | None = dataclasses.field(
        default=None, metadata={"help": "afr: run directory of an answer-flip evaluation."}
    )
    pairs_conversations: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"help": "AFR / stick-or-switch run directories of the train split (flipguard afr|sos --split train): "
                          "their conversations are added as multi-turn pairs (prompt = the chat up to the push-back; "
                          "hold the answer, or accept a correct option after an abstention), beside any strategy's rows."},
    )
    pairs_conversation_model: str | None = dataclasses.field(
        default=None, metadata={"help": "pairs_conversations: the model label whose conversations are used "
                                        "(needed when a run holds several)."}
    )
    pairs_include: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "Keep only pair rows matching this rule: a mapping (JSON on the command line) of "
                                        "datasets, kinds (item meta.category / incorrect_category), framings (c1, c2, "
                                        "dehumanizing, be_honest; multi-turn: hold, accept, keep), protocols (dds, afr, sos) "
                                        "and meta {key: values} to names (train/pair_filters.py)."}
    )
    pairs_exclude: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "Drop pair rows matching this rule (same keys as pairs_include)."}
    )
    pairs_held_out: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "What the evaluation holds out (same keys as pairs_include): filters nothing; a pair "
                                        "set holding a matching row is refused before training, and the study's transfer "
                                        "report marks these cells held out."}
    )
    pairs_dir: str = dataclasses.field(
        default="runs/pairs", metadata={"help": "Where the pair datasets are written (flipguard pairs) and read (trainers)."}
    )
    pairs_length_policy: str = dataclasses.field(
        default="refuse",
        metadata={"help": "A prompt over pairs_max_prompt_length tokens: refuse (the trainers stop on any pair over "
                          "their max_length), drop (left out, counted) or truncate (the user turn loses its first "
                          "tokens until it fits, as the paper's Table 37 max prompt length 768). Counted in counts.json.",
                  "choices": ["refuse", "drop", "truncate"]},
    )
    pairs_max_prompt_length: int | None = dataclasses.field(
        default=None, metadata={"help": "drop/truncate: prompt token limit, chat template applied (paper: 768)."}
    )
    pairs_tokenizer: str | None = dataclasses.field(
        default=None, metadata={"help": "drop/truncate: tokenizer that counts prompt tokens (default: the recipe's "
                                        "model_name_or_path)."}
    )


@dataclasses.dataclass
class EvalPlanArguments:
    """The before/after plan `flipguard study` runs (`eval:`): what is measured, how, and
    which mitigations are compared against the baseline."""

    eval_plan_datasets: str = dataclasses.field(default="all", metadata={"help": "Test datasets to evaluate (names, groups or comma list).",
                                                                          "flag": "datasets"})
    eval_plan_data_root: str | None = dataclasses.field(
        default=None, metadata={"help": "Data root (default: $FLIPGUARD_DATA, else the shipped samples)."}
    )
    eval_plan_mitigations: list[str] = dataclasses.field(
        default_factory=lambda: ["be_honest", "dehumanizing"],
        metadata={"help": "Prompting mitigations run on the base model (the baseline, 'none', always runs).", "flag": "mitigations"},
    )
    eval_plan_trainers: list[str] | None = dataclasses.field(
        default=None, metadata={"help": "Trainers whose merged models are measured (registered: config.TRAINERS; "
                                        "default: every trainer section of the recipe; [] = none)."}
    )
    eval_plan_mode: str = dataclasses.field(
        default="logprob", metadata={"help": "logprob (one-token P('1')/P('2')) or generate (paper JSON).", "choices": ["logprob", "generate"]}
    )
    eval_plan_extra_modes: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "The baseline is also measured in these decision modes (own reports; the comparison uses `mode`)."}
    )
    eval_plan_backend: str = dataclasses.field(default="hf", metadata={"help": "Backend for the eval runs (hf, vllm, openai).",
                                                                       "flag": "backend"})
    eval_plan_batch_size: int = dataclasses.field(default=8, metadata={"help": "hf backend batch size.", "flag": "batch_size"})
    eval_plan_backend_args: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "Settings for every eval run's backend, as eval's --backend_args takes them (a "
                                        "mapping in the recipe, JSON on the command line): for vllm tensor_parallel_size, "
                                        "data_parallel_size, pipeline_parallel_size, distributed_executor_backend, "
                                        "gpu_memory_utilization ...; for openai base_url ...", "flag": "backend_args"}
    )
    eval_plan_limit: int | None = dataclasses.field(default=None, metadata={"help": "Items per dataset, test and train split (None: all).",
                                                                            "flag": "limit"})
    eval_plan_generate_limit: int | None = dataclasses.field(
        default=None, metadata={"help": "generate mode: items per dataset (default: limit)."}
    )
    eval_plan_max_new_tokens: int = dataclasses.field(default=300, metadata={"help": "generate mode: reply length limit."})
    eval_plan_min_label_mass: float | None = dataclasses.field(
        default=None, metadata={"help": "logprob mode label-mass threshold (default: eval's; 0 for the random-init flipguard:tiny)."}
    )
    eval_plan_protocols: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "Registered tasks also run before and after and added to the comparison "
                                                "(built in or a user's: --include FILE, a flipguard.tasks entry point); "
                                                "a task's run config is eval.<task>_config (--eval_plan_<task>_config)."}
    )
    eval_plan_train_protocols: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "Multi-turn pairs: these tasks' runs of the base model on the TRAIN split "
                                                "(stages <task>-train, the task's config above) are added to the pairs "
                                                "(pairs.conversations)."}
    )
    eval_plan_capability: bool = dataclasses.field(
        default=False, metadata={"help": "Capability guard: MMLU accuracy of the base and every merged model through "
                                         "lm-evaluation-harness on a local task (pip install 'flipguard[capability]'), "
                                         "in the transfer report with a paired CI (stage `capability`)."}
    )
    eval_plan_capability_per_subject: int | None = dataclasses.field(
        default=None, metadata={"help": "Capability guard: questions per MMLU subject (seeded; None: all of the data root's)."}
    )
    eval_plan_n_boot: int = dataclasses.field(default=2000, metadata={"help": "Bootstrap replicates in reports."})
    eval_plan_accelerate_config: str | None = dataclasses.field(
        default=None, metadata={"help": "On a GPU the trainers run under `accelerate launch --config_file` this (default single_gpu.yaml); on CPU in process."}
    )
    eval_plan_flip_sample: int = dataclasses.field(
        default=50, metadata={"help": "Flip records (baseline test split) logged to wandb as a sample table."}
    )


@dataclasses.dataclass
class TrackingArguments:
    """Weights & Biases settings (`tracking:`); `report_to` itself is a trainer field."""

    tracking_project: str = dataclasses.field(default="flipguard", metadata={"help": "wandb project."})
    tracking_entity: str | None = dataclasses.field(default=None, metadata={"help": "wandb entity (team/user)."})
    tracking_run_name: str | None = dataclasses.field(
        default=None, metadata={"help": "Base run name; scripts append -<trainer> (-sft, -dpo, ...) unless --run_name is given."}
    )
    tracking_group: str | None = dataclasses.field(
        default=None, metadata={"help": "wandb group of the training and study runs (default: run_name)."}
    )
    tracking_tags: list[str] = dataclasses.field(default_factory=list, metadata={"help": "wandb tags."})


# GPU memory profiles by card class, in GiB: what torch reports as the total memory of the smallest
# card of the class (24GB: L4 / A10G; 40GB: A100 40 GB; 48GB: L40S / A6000; 80GB: A100 / H100 80 GB).
# The planner fills that less the CUDA context and some slack (train/memory.py).
MEMORY_PROFILES = {"24GB": 22.0, "40GB": 39.4, "48GB": 44.4, "80GB": 79.1}


@dataclasses.dataclass
class TrainingSpeedArguments:
    """How a trainer spends its GPU (top level or a trainer's section; command line as is). The
    recipe's learning settings and effective batch (per_device_train_batch_size x
    gradient_accumulation_steps) are never changed: only how a step is computed."""

    prefix_sharing: bool = dataclasses.field(
        default=True, metadata={"help": "Compute each forward packed: shared prompt prefixes once (a DPO pair's "
                                        "prompt once for chosen and rejected), no padding; the same losses and "
                                        "gradients as TRL's padded rows (train/packing.py). false: TRL's layout."})
    memory_budget: str | None = dataclasses.field(
        default=None, metadata={"help": "GPU memory the trainer may use: a card profile (24GB, 40GB, 48GB, 80GB), an "
                                        "amount (20GiB), or 'device' (the GPU's own). Micro-batch, accumulation and "
                                        "how many layers recompute their activations follow from it, the effective "
                                        "batch kept (train/memory.py). Unset or 'none': the recipe's batch and "
                                        "gradient_checkpointing as written. Ignored on CPU."})


SECTION_CLASSES = {"pairs": PairsArguments, "eval": EvalPlanArguments, "tracking": TrackingArguments}

# eval.<task>_config (flag --eval_plan_<task>_config): the run config of that task's study stage.
# One key per task, whichever tasks are registered, so config names none of them.
TASK_CONFIG_SUFFIX = "_config"


def task_config_key(task: str) -> str:
    """The eval: key of a task's run config ('-' in a task's name becomes '_')."""
    return task.replace("-", "_") + TASK_CONFIG_SUFFIX


def is_task_config_key(key: str) -> bool:
    return key.endswith(TASK_CONFIG_SUFFIX) and "eval_plan_" + key not in _fields(EvalPlanArguments)


def with_optional_fields(base: type, helps: dict[str, str], type_: Any = Optional[str]) -> type:
    """`base` with an optional field of `type_` (default None) for each name -> help that is not already
    one of its fields: a per-task option added to a command's arguments (same class name)."""
    have = _fields(base)
    extra = [(name, type_, dataclasses.field(default=None, metadata={"help": text}))
             for name, text in helps.items() if name not in have]
    return dataclasses.make_dataclass(base.__name__, extra, bases=(base,)) if extra else base


def eval_plan_arguments(tasks: Iterable[str]) -> type:
    """EvalPlanArguments with an `eval_plan_<task>_config` field per task: the study's parser and plan."""
    return with_optional_fields(EvalPlanArguments, {
        "eval_plan_" + task_config_key(task): f"{task}: run config whose settings the study's {task} stage uses "
                                              "(models are the study's; default: the task's own)."
        for task in tasks})


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _trainer_classes():
    """The registered trainers' TRL configs, and the fields every trainer section and the top level
    also take: trl's ModelConfig and flipguard's TrainingSpeedArguments."""
    from trl import ModelConfig

    shared = dataclasses.make_dataclass("ModelConfig", [], bases=(ModelConfig, TrainingSpeedArguments))
    return {name: t.config_class() for name, t in TRAINERS.items()}, shared


def _top_level_classes(raw: dict[str, Any], trainers: dict[str, Any]) -> list[Any]:
    """The trainer configs the top level applies to: those the recipe has a section for (every
    registered one when it has none), so registering a trainer changes no existing recipe."""
    present = [cls for name, cls in trainers.items() if name in raw]
    return present or list(trainers.values())


def _edits(a: str, b: str) -> int:
    """Edits from a to b: insertions, deletions, substitutions and swaps of two neighbours (a typo's)."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def closest(given: str, choices: Iterable[str]) -> str | None:
    """The choice a mistyped `given` most likely meant (fewest typo edits, the same letters first),
    or None when none is close."""
    given, choices = str(given), list(dict.fromkeys(str(c) for c in choices))
    if not given or not choices:
        return None
    near = [(_edits(given, c), sorted(given) != sorted(c), c) for c in choices]
    best = min(near)
    if best[0] <= max(1, len(given) // 4):
        return best[2]
    close = difflib.get_close_matches(given, choices, n=1, cutoff=0.8)  # a longer name, a few letters off
    return close[0] if close else None


def did_you_mean(given: str, choices: Iterable[str], show=repr) -> str:
    """"; did you mean 'x'?" for the choice closest to a mistyped `given` (closest), or "" when none is."""
    close = closest(given, choices)
    return f"; did you mean {show(close)}?" if close is not None else ""


def _unknown(path: str, where: str, key: str, valid: Iterable[str]) -> UserError:
    return UserError(f"{path}: unknown key {key!r} in {where}{did_you_mean(key, valid)}")


# ---------------------------------------------------------------- shipped recipes

# the recipes and run configs shipped in the package (pyproject's package-data): found by name
# from any folder, and by the path they have in a clone (recipes/NAME.yaml) where that is no file
SHIPPED_RECIPES = PACKAGE_ROOT / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """name -> file of every shipped recipe and run config (accelerate configs as accelerate_configs/NAME)."""
    found = {p.stem: p for p in sorted(SHIPPED_RECIPES.glob("*.yaml"))}
    found |= {f"{p.parent.name}/{p.stem}": p for p in sorted(SHIPPED_RECIPES.glob("accelerate_configs/*.yaml"))}
    return found


def find_recipe(given: str | os.PathLike, what: str = "recipe") -> str:
    """A recipe or run config as given when it is a file; else the shipped one it names
    (`organism`, `afr_tiny.yaml`, or `recipes/afr_tiny.yaml` from a folder that is not a clone);
    else one line naming the shipped ones."""
    given = str(given)
    if Path(given).is_file():
        return given
    path = Path(given)
    name = path.name[: -len(path.suffix)] if path.suffix in RECIPE_SUFFIXES else path.name
    shipped = shipped_recipes()
    if path.parent in (Path("."), Path("recipes")) and name in shipped:
        return str(shipped[name])
    if path.exists():
        raise UserError(f"{given}: a {what} is a YAML file, not a folder")
    names = [n for n in shipped if "/" not in n]
    raise UserError(f"{given}: no such {what} (not a file, nor a shipped one: {', '.join(names)}; "
                    f"`flipguard recipes` lists them){did_you_mean(name, names)}")


def recipe_title(path: Path) -> str:
    """A recipe file's first comment line (what it is), without the '#'."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def recipes_main(argv: list[str]) -> int:
    """`flipguard recipes [show NAME]`: the shipped recipes and run configs, or one of them."""
    usage = ("usage: flipguard recipes [show NAME]\n\nThe recipes and run configs shipped with flipguard, each with its "
             "first comment line;\n`show NAME` prints one (flipguard recipes show organism > my.yaml, then edit it).\n"
             "Every command that takes a recipe or run config takes NAME too, from any folder.")
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        raise SystemExit(0)  # as argparse's --help does for every other command
    if argv in ([], ["list"]):
        shipped = shipped_recipes()
        width = max(map(len, shipped))
        for name, path in shipped.items():
            print(f"{name.ljust(width)}  {recipe_title(path)}")
        print(f"\n(in {SHIPPED_RECIPES}; flipguard recipes show NAME prints one)")
        return 0
    if argv[0] == "show" and len(argv) == 2:
        shipped = shipped_recipes()
        key = argv[1][: -len(Path(argv[1]).suffix)] if Path(argv[1]).suffix in RECIPE_SUFFIXES else argv[1]
        key = key.removeprefix("recipes/")
        if key not in shipped:
            raise UserError(f"show {argv[1]}: no shipped recipe of that name (flipguard recipes lists them)"
                            f"{did_you_mean(key, shipped)}")
        sys.stdout.write(shipped[key].read_text(encoding="utf-8"))
        return 0
    raise UserError(f"unexpected arguments {argv}; usage: flipguard recipes [show NAME]"
                    f"{did_you_mean(argv[0], ['show', 'list'])}")


def read_recipe(path: str | os.PathLike) -> dict[str, Any]:
    """The YAML mapping of a recipe file, validated: every key known, sections are mappings.
    `path` may name a shipped recipe (find_recipe)."""
    path = find_recipe(path)
    # bytes that are not UTF-8 and broken YAML: one line naming path:line
    raw, lines = load_yaml(path, UserError, "recipe file")
    if raw is None or raw == {}:
        raise UserError(f"{path}: the recipe is empty (it needs at least model_name_or_path and the sections "
                          "to run; see recipes/tiny.yaml)")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a recipe must be a YAML mapping, got {type(raw).__name__}")
    validate_recipe(raw, path, lines)
    return raw


def check_recipe_types(raw: dict[str, Any], path: str = "<recipe>", lines: dict[str, int] | None = None) -> None:
    """Every value of the right type for its field (`n_items: 2.5`, `beta: [0.1]` and
    the like are refused here, naming file:line and the key, before any model loads)."""
    trainers, model_cls = _trainer_classes()
    top = field_types(model_cls, *_top_level_classes(raw, trainers))
    plain = {k: v for k, v in raw.items() if not is_section(k)}
    check_types(plain, top, path, UserError, lines)
    for section in TRAINERS:
        values = raw.get(section) or {}
        check_types(values, field_types(trainers[section], model_cls), path, UserError, lines,
                    {k: f"{section}.{k}" for k in values})
    for section, prefix in ARG_SECTIONS.items():
        values = {prefix + k: v for k, v in (raw.get(section) or {}).items()}
        types = field_types(SECTION_CLASSES[section])
        if section == "eval":  # a task's run config: a path
            types |= {prefix + k: Optional[str] for k in raw.get(section) or {} if is_task_config_key(str(k))}
        check_types(values, types, path, UserError, lines, {prefix + k: f"{section}.{k}" for k in (raw.get(section) or {})})


def validate_recipe(raw: dict[str, Any], path: str = "<recipe>", lines: dict[str, int] | None = None) -> None:
    _check_keys(raw, path)
    check_recipe_types(raw, path, lines)
    check_recipe_values(raw, path, lines)


def _non_empty(v: Any) -> str | None:
    return None if str(v).strip() else "a non-empty list of datasets"


# A rule returns None for a good value, else what the value must be. The bounds are sanity, not
# taste: each keeps a typed value from reaching a trainer or a backend that would crash on it
# (or try to allocate it) after the first stages ran.
Rule = Callable[[Any], Optional[str]]

# any integer a user types: no field counts past this (2**53, the last integer a JSON number
# holds exactly); `max_steps: 100000000000000000000000` overflows torch's int64 otherwise
MAX_INT = 2**53
MAX_STEPS = 10**9
MAX_BATCH = 65536
MAX_LORA_RANK = 65536  # and no more than the model's layers take (train/utils.check_lora_rank)


def between(low: float | None = None, high: float | None = None, *, above: bool = False,
            also: tuple = (), text: str | None = None) -> Rule:
    """A number in [low, high] (in (low, high] when `above`; None: no bound that side), or one of `also`."""
    if text is None:
        low_text = None if low is None else f"{'>' if above else '>='} {low:,}"
        text = (f"between {low:,} and {high:,}" if low is not None and high is not None and not above
                else " and ".join(t for t in (low_text, None if high is None else f"<= {high:,}") if t))

    def rule(value: Any) -> str | None:
        if value in also:
            return None
        ok = (low is None or (value > low if above else value >= low)) and (high is None or value <= high)
        return None if ok else text

    return rule


def torch_dtype_name(value: Any) -> str | None:
    """"auto" or a floating-point dtype of the installed torch (float32, bfloat16, ...)."""
    import torch

    if value == "auto" or (isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)
                           and getattr(torch, value).is_floating_point):
        return None
    names = sorted({str(t).removeprefix("torch.") for t in vars(torch).values()
                    if isinstance(t, torch.dtype) and t.is_floating_point and t.itemsize >= 2})
    return f"auto or a floating-point dtype of torch ({', '.join(names)})"


def devices_here() -> list[str]:
    """The devices this machine has, as torch names them: cpu, then each GPU (cuda:0 ...), mps."""
    import torch

    have = ["cpu"]
    if torch.cuda.is_available():
        have += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        have.append("mps")
    return have


def device_here(value: Any) -> str | None:
    """A device this machine has: cpu, cuda (any GPU), cuda:N for one of its GPUs, mps."""
    import torch

    have = devices_here()
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is not None and (str(device) in have or (device.index is None and any(h.startswith(device.type) for h in have))):
        return None
    return f"a device of this machine ({', '.join(have)})"


# the values a field must hold, whatever file, section or flag sets it (fields of the same name
# mean the same thing in every command); a new field of a dataclass is type-checked from its
# annotation and held to MAX_INT and finiteness without an entry here
VALUE_RULES: dict[str, Rule] = {
    "learning_rate": between(0, above=True),
    "lora_r": between(1, MAX_LORA_RANK),
    "lora_alpha": between(0, above=True),
    "lora_dropout": lambda v: None if 0 <= v < 1 else "in [0, 1)",
    "max_steps": between(1, MAX_STEPS, also=(-1,), text=f"-1 (train by epochs) or between 1 and {MAX_STEPS:,}"),
    "num_train_epochs": between(0, MAX_STEPS, above=True),
    "per_device_train_batch_size": between(1, MAX_BATCH),
    "per_device_eval_batch_size": between(1, MAX_BATCH),
    "gradient_accumulation_steps": between(1, MAX_BATCH),
    "beta": between(0, above=True),
    "max_length": between(1),
    "seed": between(0, 2**32 - 1),  # numpy's seeds end there (transformers.set_seed seeds numpy too)
    "dtype": torch_dtype_name,
    "device": device_here,
    "batch_size": between(1, MAX_BATCH),
    "eval_plan_batch_size": between(1, MAX_BATCH),
    "limit": between(1),
    "eval_plan_limit": between(1),
    "eval_plan_generate_limit": between(1),
    "n_items": between(1),
    "per_subject": between(1),
    "repeats": between(1),
    "chunk_size": between(1),
    "cross_k": between(1),
    "threads": between(1),
    "max_new_tokens": between(1),
    "answer_max_new_tokens": between(1),
    "coercion_max_new_tokens": between(1),
    "eval_plan_max_new_tokens": between(1),
    "temperature": between(0),
    "coercion_temperature": between(0),
    "top_p": between(0, 1, above=True),
    "min_label_mass": between(0, 1),
    "eval_plan_min_label_mass": between(0, 1),
    "n_boot": between(0),
    "eval_plan_n_boot": between(1),
    "eval_plan_datasets": _non_empty,
    "pairs_datasets": _non_empty,
}


def value_problem(key: str, value: Any) -> str | None:
    """What `value` must be for field `key` (None: it is fine): any number finite and within
    MAX_INT, a list's numbers too, then the field's VALUE_RULES entry."""
    if isinstance(value, (list, tuple)):
        return next((p for v in value if (p := value_problem(key, v))), None)
    rule = VALUE_RULES.get(key)
    try:
        wanted = rule(value) if rule is not None else None
    except TypeError:  # a value of another type: the type check (files.check_types) names it
        wanted = None
    if wanted is None and isinstance(value, float) and not math.isfinite(value):
        wanted = "a finite number"
    if wanted is None and isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        wanted = f"an integer of at most {MAX_INT:,} in size"
    return wanted


def named(key: str) -> str:
    """How a message names a setting: `option --x` for a flag, `key 'sft.x'` for a file's key."""
    return f"option {key}" if key.startswith("--") else f"key {key!r}"


def check_values(values: dict[str, Any], where: str, shown: dict[str, str] | None = None,
                 lines: dict[str, int] | None = None, error: type[FlipguardError] = UserError) -> None:
    """Refuse the first value that breaks its bounds (value_problem) with `error`: one line naming
    where (file[:line]), the key as written and the value, before anything runs."""
    for key, value in values.items():
        if value is None or isinstance(value, bool):
            continue
        wanted = value_problem(key, value)
        if wanted is not None:
            name = (shown or {}).get(key, key)
            line = (lines or {}).get(name)
            raise error(f"{where}{f':{line}' if line else ''}: {named(name)} must be {wanted}, got {value!r}; "
                        "nothing was run")


def check_recipe_values(raw: dict[str, Any], path: str = "<recipe>", lines: dict[str, int] | None = None) -> None:
    check_values({k: v for k, v in raw.items() if not is_section(k)}, path, lines=lines)
    for section in TRAINERS:
        values = raw.get(section) or {}
        check_values(values, path, {k: f"{section}.{k}" for k in values}, lines)
    for section, prefix in ARG_SECTIONS.items():
        values = raw.get(section) or {}
        check_values({prefix + k: v for k, v in values.items()}, path, {prefix + k: f"{section}.{k}" for k in values},
                     lines)


def check_parsed_values(objs: Iterable[Any], where: str, skip: dict[str, Any] | None = None,
                        flag: Callable[[str], str] = lambda field: f"--{field}") -> None:
    """The same rules on parsed dataclasses: command-line flags override a recipe's or a run config's
    values. `skip`: values already checked where they were written (a run config's), unless a flag
    changed them; `flag`: how a field's option is named."""
    skip = skip or {}
    for obj in objs:
        if dataclasses.is_dataclass(obj):
            fields = [f.name for f in dataclasses.fields(obj)]
            check_values({n: getattr(obj, n, None) for n in fields
                          if n not in skip or skip[n] != getattr(obj, n, None)}, where, {n: flag(n) for n in fields})


def _valid_keys(raw: dict[str, Any]) -> tuple[set[str], dict[str, set[str]]]:
    """(the top level's keys, sections included; each trainer and argument section's keys) of a
    recipe like `raw` (the top level takes what every trainer it has a section for shares)."""
    trainers, model_cls = _trainer_classes()
    model_keys = _fields(model_cls)
    shared = set.intersection(*(_fields(c) for c in _top_level_classes(raw, trainers)))
    sections = {name: _fields(cls) | model_keys for name, cls in trainers.items()}
    sections |= {key: {n[len(prefix):] for n in _fields(SECTION_CLASSES[key])} for key, prefix in ARG_SECTIONS.items()}
    return model_keys | shared | set(TRAINERS) | set(ARG_SECTIONS) | {"env"}, sections


def recipe_keys(raw: dict[str, Any]) -> list[str]:
    """Every setting a recipe like `raw` takes, a section's dotted (`lora_r`, `dpo.beta`,
    `pairs.strategy`): what one setting named on its own (`flipguard study --grid KEY=...`) may be."""
    top, sections = _valid_keys(raw)
    return sorted({k for k in top if not is_section(k)} | {f"{name}.{k}" for name, keys in sections.items() for k in keys})


def _check_keys(raw: dict[str, Any], path: str) -> None:
    trainers, _ = _trainer_classes()
    top_valid, section_keys = _valid_keys(raw)
    for key, value in raw.items():
        if key not in top_valid:
            error = _unknown(path, "the top level", key, top_valid)
            if isinstance(value, dict):  # a section: most likely a trainer that is not registered
                error = UserError(f"{error}; a section is a registered trainer ({', '.join(TRAINERS)}) "
                                    f"or {', '.join([*ARG_SECTIONS, 'env'])}")
            raise error
        if key in TRAINERS or key in ARG_SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise UserError(f"{path}: section {key!r} must be a mapping, got {type(value).__name__}")
            valid = section_keys[key]
            if key in TRAINERS:
                label = f"section {key!r} ({trainers[key].__name__} or ModelConfig fields)"
                for sub in value:
                    if sub not in valid:
                        raise _unknown(path, label, sub, valid)
            else:
                for sub in value:
                    if sub not in valid and not (key == "eval" and is_task_config_key(str(sub))):
                        raise _unknown(path, f"section {key!r}", sub, valid)
        if key == "env" and not isinstance(value, dict):
            raise UserError(f"{path}: 'env' must be a mapping of environment variables")


def public_recipe(raw: dict[str, Any]) -> dict[str, Any]:
    """The recipe as flipguard writes it anywhere (model card, provenance, wandb):
    the `env:` section keeps its variable names, every value is redacted."""
    if not raw.get("env"):
        return raw
    return {**raw, "env": redact_values(raw["env"])}


def flatten_recipe(raw: dict[str, Any], trainer: str | None) -> dict[str, Any]:
    """Field name -> value for one script: top level, then its trainer section, then the
    argument sections under their prefixes."""
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if not is_section(key):
            flat[key] = value
    if trainer is not None:
        flat.update(raw.get(trainer) or {})
    for section, prefix in ARG_SECTIONS.items():
        for key, value in (raw.get(section) or {}).items():
            flat[prefix + key] = value
    return flat


def split_recipe_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    """(recipe path, remaining flags): a leading positional (a path, or a shipped recipe's name:
    find_recipe), or --config FILE."""
    argv = list(argv)
    recipe = None
    if argv and not argv[0].startswith("-"):
        recipe = find_recipe(argv.pop(0))
    for flag in ("--config",):
        for i, arg in enumerate(argv):
            if arg == flag:
                if i + 1 >= len(argv):
                    raise UserError("--config needs a recipe file path")
                if recipe is not None:
                    raise UserError(f"two recipes given: {recipe!r} and {argv[i + 1]!r}")
                recipe = find_recipe(argv[i + 1])
                del argv[i : i + 2]
                break
            if arg.startswith(flag + "="):
                if recipe is not None:
                    raise UserError(f"two recipes given: {recipe!r} and {arg.split('=', 1)[1]!r}")
                recipe = find_recipe(arg.split("=", 1)[1])
                del argv[i]
                break
    return recipe, argv


# ---------------------------------------------------------------- the flag vocabulary
#
# One word for one setting in every command, in its flags and in its run config's keys: --model
# (one spec; a list where several models are compared, and repeatable), --backend, --backend_args,
# --device, --batch_size, --datasets, --limit, --mitigations, --out, --seed, --threads. A field says
# how it relates to them in its metadata:
#   "flag": WORD            its flag is --WORD, though the field keeps its name (a recipe section's
#                           prefix: eval_plan_limit is --limit); --FIELD is no longer listed
#   "renamed_from": (OLD,)  it was called OLD: --OLD and a run config's OLD: key are still read,
#                           never listed in --help, for one release
# Fields of TRL's configs cannot say so: their names stay listed, the word beside them.
THEIR_FLAG_WORDS = {"model_name_or_path": "model", "output_dir": "out"}
# what a user types for a word of the vocabulary (its old spellings in other commands, other tools'
# names): the word is what an unknown flag of these names is taken to mean in "did you mean"
MEANT = {"n_items": "limit", "num_items": "limit", "max_items": "limit", "models": "model", "dataset": "datasets",
         "tasks": "datasets", "mitigation": "mitigations", "output": "out", "output_dir": "out", "output_path": "out",
         "num_threads": "threads", "model_name_or_path": "model"}


class _Repeatable(argparse.Action):
    """A list option given twice adds up (`--model a --model b`); its first use replaces the
    default (or the run config's value)."""

    def __call__(self, parser, namespace, values, option_string=None):
        values = list(values)
        if getattr(self, "_namespace", None) is namespace:
            values = list(getattr(namespace, self.dest) or []) + values
        self._namespace = namespace
        setattr(namespace, self.dest, values)


_CHOICE = re.compile(r"invalid choice: '?(?P<given>.*?)'? \(choose from (?P<choices>.*)\)$")


def field_aliases(*types: type) -> dict[str, str]:
    """A run config's key -> the field it sets, where the two differ: a field's flag word and its
    old names (the metadata above)."""
    out: dict[str, str] = {}
    for cls in types:
        for f in dataclasses.fields(cls):
            for alias in (f.metadata.get("flag"), *f.metadata.get("renamed_from", ())):
                if alias and alias != f.name:
                    out[alias] = f.name
    return out


@functools.cache  # one class per base, however many commands parse
def _flag_parser_class(base: type) -> type:
    """`base` (TRL's TrlParser, or transformers' HfArgumentParser) speaking the vocabulary: a field
    under its flag word, its old names read but not listed, list options repeatable; and every
    mistake (an unknown flag, a bad value, a missing argument) a UserError of one line with the
    closest option or value, never argparse's usage and exit or a ValueError's traceback."""

    class FlagParser(base):
        def __init__(self, dataclass_types, **kwargs):
            # no abbreviations: `--max_step 3` is a typo named as one, never a silent --max_steps
            kwargs.setdefault("allow_abbrev", False)
            self.hidden: dict[str, str] = {}  # a spelling not listed -> the flag it stands for
            super().__init__(dataclass_types, **kwargs)
            dests = {a.dest for a in self._actions}
            for field, word in THEIR_FLAG_WORDS.items():
                if field in dests and word not in dests and f"--{word}" not in self._option_string_actions:
                    action = next(a for a in self._actions if a.dest == field and a.option_strings)
                    action.option_strings = [*action.option_strings, f"--{word}"]
                    self._option_string_actions[f"--{word}"] = action

        def add_argument(self, *args, **kwargs):
            word, old = kwargs.pop("flag", None), kwargs.pop("renamed_from", ())
            if kwargs.get("nargs") == "+" and "action" not in kwargs:
                kwargs["action"] = _Repeatable
            action = super().add_argument(*args, **kwargs)
            if args and str(args[0]).startswith("--no_"):  # a boolean's complement: its field's word is done
                return action
            if word:  # the field's own spellings become hidden ones of its word
                for string in action.option_strings:
                    del self._option_string_actions[string]
                self.hidden |= dict.fromkeys(action.option_strings, f"--{word}")
                action.option_strings = [f"--{word}"]
                if action.metavar is None and action.nargs != 0:
                    action.metavar = word.upper()
                self._option_string_actions[f"--{word}"] = action
            for name in old:
                self.hidden |= dict.fromkeys((f"--{name}", f"--{name.replace('_', '-')}"), action.option_strings[0])
            return action

        def flag(self, field: str) -> str:
            """How messages name a field's option: its (first) flag."""
            return next((a.option_strings[0] for a in self._actions if a.dest == field and a.option_strings),
                        f"--{field}")

        def listed_flags(self) -> list[str]:
            return sorted({s for a in self._actions if a.help != argparse.SUPPRESS
                           for s in a.option_strings if s.startswith("--")})

        def parse_known_args(self, args=None, namespace=None):
            args = list(sys.argv[1:] if args is None else args)
            return super().parse_known_args([self._unhide(a) for a in args], namespace)

        def _unhide(self, arg: str) -> str:
            head, sep, value = arg.partition("=")
            return self.hidden[head] + sep + value if arg.startswith("--") and head in self.hidden else arg

        def error(self, message: str):
            match = _CHOICE.search(message)
            if match:
                choices = [c.strip().strip("'") for c in match["choices"].split(",")]
                message += did_you_mean(match["given"], choices)
            raise UserError(message)

        def unknown_option(self, given: str) -> UserError:
            meant = f"--{MEANT.get(given[2:].replace('-', '_'))}"
            hint = f"; did you mean {meant}?" if meant in self.listed_flags() else did_you_mean(given, self.listed_flags(), str)
            return UserError(f"unknown option {given}{hint} ({self.prog} --help lists the options)")

        def parse_flags(self, argv: list[str]) -> tuple:
            """The dataclasses of `argv`; a flag it does not know (named before argparse's other
            complaints, a missing required option among them) or anything left over is one line."""
            for arg in argv:
                head = arg.split("=", 1)[0]
                if arg.startswith("--") and arg != "--" and head not in self._option_string_actions \
                        and head not in self.hidden:
                    raise self.unknown_option(head)
            *parsed, rest = self.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
            if rest:
                flags = [a for a in rest if a.startswith("-")]
                if flags:
                    raise self.unknown_option(flags[0].split("=")[0])
                raise UserError(f"unexpected argument {rest[0]!r}: options are given as --name value"
                                + (" and a run config or recipe goes first" if rest[0] != argv[0] else ""))
            return tuple(parsed)

    FlagParser.__name__ = FlagParser.__qualname__ = f"Flag{base.__name__}"
    return FlagParser


def _trl_parser_class():
    from trl import TrlParser

    class RecipeParser(_flag_parser_class(TrlParser)):
        """TrlParser that reads flipguard's sectioned recipe (positional path or name, or --config)."""

        def __init__(self, dataclass_types, trainer: str | None = None, **kwargs):
            if trainer is not None:
                trainer_entry(trainer, "RecipeParser")
            self.trainer = trainer
            self.recipe_path: str | None = None
            self.recipe: dict[str, Any] = {}
            super().__init__(dataclass_types, **kwargs)

        def parse_args_and_config(self, args=None, **kwargs):
            argv = list(sys.argv[1:] if args is None else args)
            recipe_path, argv = split_recipe_argv(argv)
            if recipe_path is not None:
                raw = read_recipe(recipe_path)
                for key, value in (raw.get("env") or {}).items():
                    os.environ.setdefault(str(key), str(value))
                flat = flatten_recipe(raw, self.trainer)
                known = {action.dest for action in self._actions}
                # keys of other scripts (the other trainer's fields, eval plan, ...) were
                # validated above and are simply not this script's business
                self.set_defaults_with_config(**{k: v for k, v in flat.items() if k in known})
                # what scripts keep (model cards, flipguard_training.json, wandb config):
                # env names only, never their values (they may be keys)
                self.recipe_path, self.recipe = recipe_path, public_recipe(raw)
            try:
                parsed = self.parse_flags(argv)
            except ValueError as exc:  # the configs' own checks (TRL's __post_init__) too
                raise UserError(f"{recipe_path or 'command line'}: {exc}") from None
            check_parsed_values(parsed, f"{recipe_path or 'command line'} (with its flags)", flag=self.flag)
            return parsed

    return RecipeParser


def RecipeParser(dataclass_types, trainer: str | None = None, **kwargs):
    """A `trl.TrlParser` for flipguard recipes (built on first use: trl is imported only by a command that parses)."""
    return _trl_parser_class()(dataclass_types, trainer=trainer, **kwargs)


def parse_recipe(argv: list[str], dataclass_types, trainer: str | None = None, prog: str | None = None,
                 description: str | None = None):
    """Parse argv (recipe path or name + flag overrides) into the dataclasses; returns
    (tuple of dataclass instances, recipe path or None, raw recipe mapping)."""
    parser = RecipeParser(dataclass_types, trainer=trainer, prog=prog, description=description)
    out = parser.parse_args_and_config(argv)
    return out, parser.recipe_path, parser.recipe


def resolved_recipe(*dataclass_objs) -> dict[str, Any]:
    """Every parsed field, JSON-safe, for the run config and model cards."""
    out: dict[str, Any] = {}
    for obj in dataclass_objs:
        d = obj.to_dict() if hasattr(obj, "to_dict") else dataclasses.asdict(obj)
        out[type(obj).__name__] = {k: (v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)) for k, v in d.items()}
    return out


def _command_parser_class():
    """The recipes' TrlParser; where trl is not installed (vLLM's own environment, which takes
    flipguard with --no-deps: docs/serving.md) its base, transformers' HfArgumentParser, which
    parses a command's dataclasses the same way (a command uses nothing TrlParser adds)."""
    try:
        return _trl_parser_class()
    except ImportError:
        from transformers import HfArgumentParser

        return _flag_parser_class(HfArgumentParser)


# a command's first argument ending so is a run config (YAML, or JSON)
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def leading_config(argv: list[str], positional: str | None = None) -> str | None:
    """The run config a command's argv starts with, found (find_recipe), or None: its first
    argument when that is no flag (for a command with a positional option, one that ends in
    .yaml/.yml/.json)."""
    if not argv or argv[0].startswith("-") or (positional and not argv[0].endswith(CONFIG_SUFFIXES)):
        return None
    return find_recipe(argv[0], "run config")


def _takes_list(tp: Any) -> bool:
    """A list field (list[str], Optional[list[int]] ...)."""
    return typing.get_origin(tp) is list or any(typing.get_origin(a) is list for a in typing.get_args(tp))


def read_run_config(path: str, types: Iterable[type]) -> dict[str, Any]:
    """A run config's mapping as the command's fields: every key known (the closest named when
    not), a field's flag word or old name as its field (field_aliases), a single value for a list field as a list,
    each value of its field's type and within its bounds (naming path:line and the key as written)."""
    # broken YAML, bytes that are not UTF-8, an unknown key or a value of the wrong
    # type: one line naming the file (line) and key, before anything runs or is written
    config, lines = load_yaml(path, UserError, "run config")
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise UserError(f"{path}: a run config must be a YAML mapping of option: value, got {type(config).__name__}")
    aliases, types = field_aliases(*types), field_types(*types)
    written: dict[str, str] = {}  # field -> the key as written
    for key in list(config):
        new = aliases.get(str(key))
        if new in types and key not in types:
            if new in config:
                raise UserError(f"{path}:{lines.get(key, '?')}: {key!r} and {new!r} name the same setting; keep {new!r}")
            config[new], written[new] = config.pop(key), str(key)
    for key, value in config.items():
        if key not in types:
            raise UserError(f"{path}{f':{lines[key]}' if key in lines else ''}: unknown key {str(key)!r}"
                            f"{did_you_mean(key, types)}")
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and _takes_list(types[key]):
            config[key] = [value]  # `model: flipguard:tiny` for a list of models
    check_types(config, types, path, UserError, lines, written)
    check_values(config, path, written, lines)
    return config


def parse_dataclasses(argv: list[str], *types, prog: str, description: str, positional: str | None = None):
    """Parse a command's argv into the given dataclasses; a YAML/JSON path (or a shipped run
    config's name) first is read as a run config (TRL/alignment-handbook style) and later flags
    override it. `positional`: the option that leading arguments before any flag give
    (`flipguard report RUN_DIR` = `--run_dir RUN_DIR`)."""
    parser = _command_parser_class()(types, prog=prog, description=description)
    argv = list(argv)
    config: dict[str, Any] = {}
    path = leading_config(argv, positional)
    if path is None and positional and argv and not argv[0].startswith("-"):
        argv = [f"--{positional}", *argv]
    if path is not None:
        config = read_run_config(path, types)
        parser.set_defaults(**config)
        argv = argv[1:]
    out = parser.parse_flags(argv)
    # the flags (the config's values were checked above, naming its lines)
    check_parsed_values(out, "command line", skip=config, flag=parser.flag)
    return out if len(types) > 1 else out[0]


def positionals_as(argv: list[str], option: str) -> list[str]:
    """argv with its positional arguments (neither an option nor an option's value, wherever they stand:
    `flipguard export --format inspect RUN`, `flipguard import inspect A.eval B.json --out RUN`) given as
    `--option ARG...`, so that none is read as a run config (an inspect log ends in .json). For commands
    whose every option takes one value (`--name value` or `--name=value`); -h/--help take none."""
    given, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-"):
            rest.append(arg)
            if "=" not in arg and arg not in ("-h", "--help") and i + 1 < len(argv):
                rest.append(argv[i + 1])
                i += 1
        else:
            given.append(arg)
        i += 1
    return ([f"--{option}", *given] if given else []) + rest
