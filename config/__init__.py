"""The one config reader of recipes and commands, one module per concern:

    parsers.py          the flag parsers on TRL's TrlParser: parse_recipe (training scripts, study),
                        parse_dataclasses (every other command), the flag vocabulary
    recipe.py           reading a sectioned recipe (every key, type and value checked; flattened per script)
    run_config.py       reading a command's flat run config (YAML/JSON, then flags)
    values.py           the value rules (VALUE_RULES; a protocol registers its own fields' rules)
    arguments.py        flipguard's argument dataclasses: pairs:, eval:, tracking:, validation:, the training speed
    trainers.py         the trainer registry (the `flipguard.trainers` entry points)
    shipped.py          the shipped recipes and run configs, found by name
    recipes_command.py  `flipguard recipes`
    spelling.py         "did you mean" for every mistyped name
    vocabulary.py       the shared words (VOCABULARY) and the old ones refused with the word to use (LEGACY)

The names commands and plug-ins use are importable from here (`from flipguard.config import
parse_dataclasses`) as well as from their module.
"""

from flipguard.config.arguments import (
    ARG_SECTIONS,
    MEMORY_PROFILES,
    PAIR_STRATEGIES,
    EvalPlanArguments,
    PairsArguments,
    TrackingArguments,
    TrainingSpeedArguments,
    ValidationArguments,
    eval_plan_arguments,
    is_task_config_key,
    task_config_key,
    with_optional_fields,
)
from flipguard.config.parsers import RecipeParser, parse_dataclasses, parse_recipe
from flipguard.config.recipe import (
    is_section,
    public_recipe,
    read_recipe,
    recipe_keys,
    resolved_recipe,
    split_recipe_argv,
    validate_recipe,
)
from flipguard.config.recipes_command import recipes_main
from flipguard.config.run_config import leading_config, positionals_as
from flipguard.config.shipped import SHIPPED_RECIPES, find_recipe, shipped_recipes
from flipguard.config.spelling import did_you_mean
from flipguard.config.trainers import Trainer, trainer_entry, trainers
from flipguard.config.values import between, check_values, register_value_rules

__all__ = ["ARG_SECTIONS", "MEMORY_PROFILES", "PAIR_STRATEGIES", "SHIPPED_RECIPES", "EvalPlanArguments",
           "PairsArguments", "RecipeParser", "TrackingArguments", "Trainer", "TrainingSpeedArguments", "ValidationArguments", "between",
           "check_values", "did_you_mean", "eval_plan_arguments", "find_recipe", "is_section", "is_task_config_key",
           "leading_config", "parse_dataclasses", "parse_recipe", "positionals_as", "public_recipe", "read_recipe",
           "recipe_keys", "recipes_main", "register_value_rules", "resolved_recipe", "shipped_recipes",
           "split_recipe_argv", "task_config_key", "trainer_entry", "trainers", "validate_recipe", "with_optional_fields"]
