"""Reading a recipe: its sections checked key by key, type by type and value by value, then
flattened for one script (parsers.RecipeParser reads it through TRL's TrlParser).

A recipe is data (alignment-handbook style). Its layout::

    model_name_or_path: Qwen/Qwen2.5-7B-Instruct   # top level: trl.ModelConfig fields
    load_in_4bit: true                             # (model, quantization, LoRA) and any
    lora_r: 64                                     # field SFTConfig and DPOConfig share
    seed: 42                                       # (seed, report_to, use_cpu, ...)
    sft: {learning_rate: 2.0e-4, ...}              # a registered trainer (trainers()): its TRL
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
(`flipguard dpo recipes/tiny.yaml`), or as `--config recipes/tiny.yaml` (TRL).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Optional

from flipguard.config.arguments import (
    ARG_SECTIONS,
    SECTION_CLASSES,
    TrainingSpeedArguments,
    field_names,
    is_task_config_key,
)
from flipguard.config.shipped import find_recipe
from flipguard.config.spelling import did_you_mean
from flipguard.config.trainers import broken_trainers, trainers
from flipguard.config.values import check_values
from flipguard.config.vocabulary import legacy_word
from flipguard.errors import UserError
from flipguard.files import check_types, field_types, load_yaml
from flipguard.redact import redact_values


def is_section(key: str) -> bool:
    """A recipe section (a trainer's, pairs/eval/tracking or env), not a top-level field."""
    return key in trainers() or key in ARG_SECTIONS or key == "env"


def _trainer_classes():
    """The registered trainers' TRL configs, and the fields every trainer section and the top level
    also take: trl's ModelConfig and flipguard's TrainingSpeedArguments."""
    from trl import ModelConfig

    shared = dataclasses.make_dataclass("ModelConfig", [], bases=(ModelConfig, TrainingSpeedArguments))
    return {name: t.config_class() for name, t in trainers().items()}, shared


def _top_level_classes(raw: dict[str, Any], configs: dict[str, Any]) -> list[Any]:
    """The trainer configs the top level applies to: those the recipe has a section for (every
    registered one when it has none), so registering a trainer changes no existing recipe."""
    present = [cls for name, cls in configs.items() if name in raw]
    return present or list(configs.values())


# what a recipe calls the model: TRL's name (the commands' word, --model, overrides it in `flipguard study`)
RECIPE_MODEL_KEY = "model_name_or_path"


def _unknown(path: str, where: str, key: str, valid: Iterable[str], line: int | None = None) -> UserError:
    """An unknown key, one line: an old word (config/vocabulary.LEGACY) or the commands' `model` named with
    the key to use where it is written, else the closest key."""
    at = f"{path}:{line}" if line else str(path)
    word = legacy_word(str(key)) or (str(key) if str(key) == "model" else None)
    if word == "model" or word == RECIPE_MODEL_KEY:
        return UserError(f"{at}: {key!r} is not read in {where}: a recipe names its model at the top level as "
                         f"{RECIPE_MODEL_KEY!r} (flipguard study --model overrides it)")
    if word and word in valid:
        return UserError(f"{at}: {key!r} is an old word, not read: the key is {word!r} (in {where})")
    return UserError(f"{at}: unknown key {key!r} in {where}{did_you_mean(key, valid)}")

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
    configs, model_cls = _trainer_classes()
    top = field_types(model_cls, *_top_level_classes(raw, configs))
    plain = {k: v for k, v in raw.items() if not is_section(k)}
    check_types(plain, top, path, UserError, lines)
    for section in configs:
        values = raw.get(section) or {}
        check_types(values, field_types(configs[section], model_cls), path, UserError, lines,
                    {k: f"{section}.{k}" for k in values})
    for section, prefix in ARG_SECTIONS.items():
        values = {prefix + k: v for k, v in (raw.get(section) or {}).items()}
        types = field_types(SECTION_CLASSES[section])
        if section == "eval":  # a task's run config: a path
            types |= {prefix + k: Optional[str] for k in raw.get(section) or {} if is_task_config_key(str(k))}
        check_types(values, types, path, UserError, lines, {prefix + k: f"{section}.{k}" for k in (raw.get(section) or {})})


def validate_recipe(raw: dict[str, Any], path: str = "<recipe>", lines: dict[str, int] | None = None) -> None:
    _check_keys(raw, path, lines or {})
    check_recipe_types(raw, path, lines)
    check_recipe_values(raw, path, lines)

def check_recipe_values(raw: dict[str, Any], path: str = "<recipe>", lines: dict[str, int] | None = None) -> None:
    check_values({k: v for k, v in raw.items() if not is_section(k)}, path, lines=lines)
    for section in trainers():
        values = raw.get(section) or {}
        check_values(values, path, {k: f"{section}.{k}" for k in values}, lines)
    for section, prefix in ARG_SECTIONS.items():
        values = raw.get(section) or {}
        check_values({prefix + k: v for k, v in values.items()}, path, {prefix + k: f"{section}.{k}" for k in values},
                     lines)

def _valid_keys(raw: dict[str, Any]) -> tuple[set[str], dict[str, set[str]]]:
    """(the top level's keys, sections included; each trainer and argument section's keys) of a
    recipe like `raw` (the top level takes what every trainer it has a section for shares)."""
    configs, model_cls = _trainer_classes()
    model_keys = field_names(model_cls)
    shared = set.intersection(*(field_names(c) for c in _top_level_classes(raw, configs)))
    sections = {name: field_names(cls) | model_keys for name, cls in configs.items()}
    sections |= {key: {n[len(prefix):] for n in field_names(SECTION_CLASSES[key])} for key, prefix in ARG_SECTIONS.items()}
    return model_keys | shared | set(configs) | set(ARG_SECTIONS) | {"env"}, sections


def recipe_keys(raw: dict[str, Any]) -> list[str]:
    """Every setting a recipe like `raw` takes, a section's dotted (`lora_r`, `dpo.beta`,
    `pairs.strategy`): what one setting named on its own (`flipguard study --grid KEY=...`) may be."""
    top, sections = _valid_keys(raw)
    return sorted({k for k in top if not is_section(k)} | {f"{name}.{k}" for name, keys in sections.items() for k in keys})


def _check_keys(raw: dict[str, Any], path: str, lines: dict[str, int]) -> None:
    configs, _ = _trainer_classes()
    top_valid, section_keys = _valid_keys(raw)
    broken = broken_trainers()
    for key, value in raw.items():
        if key in broken:  # a section of a trainer plug-in that cannot load: its own line, naming its package
            raise UserError(f"{path}: section {key!r}: {broken[key]}")
        if key not in top_valid:
            error = _unknown(path, "the top level", key, top_valid, lines.get(str(key)))
            if isinstance(value, dict):  # a section: most likely a trainer that is not registered
                error = UserError(f"{error}; a section is a registered trainer ({', '.join(configs)}) "
                                    f"or {', '.join([*ARG_SECTIONS, 'env'])}")
            raise error
        if key in configs or key in ARG_SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise UserError(f"{path}: section {key!r} must be a mapping, got {type(value).__name__}")
            valid = section_keys[key]
            if key in configs:
                label = f"section {key!r} ({configs[key].__name__} or ModelConfig fields)"
                for sub in value:
                    if sub not in valid:
                        raise _unknown(path, label, sub, valid, lines.get(f"{key}.{sub}"))
            else:
                for sub in value:
                    if sub not in valid and not (key == "eval" and is_task_config_key(str(sub))):
                        raise _unknown(path, f"section {key!r}", sub, valid, lines.get(f"{key}.{sub}"))
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

def resolved_recipe(*dataclass_objs) -> dict[str, Any]:
    """Every parsed field, JSON-safe, for the run config and model cards."""
    out: dict[str, Any] = {}
    for obj in dataclass_objs:
        d = obj.to_dict() if hasattr(obj, "to_dict") else dataclasses.asdict(obj)
        out[type(obj).__name__] = {k: (v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)) for k, v in d.items()}
    return out
