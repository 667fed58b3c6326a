"""The one config parser: recipes and commands, both on TRL's own parser.

Two entry points over one `trl.TrlParser` subclass and one YAML reader (files.load_yaml):
`parse_recipe` for the training scripts and the study (a sectioned recipe, below) and
`parse_dataclasses` for every other command (its options, or a flat YAML/JSON run config
followed by flag overrides). TrlParser is TRL's HfArgumentParser; importing it took
0.22-0.30 s here (`python -c "import time; t=time.perf_counter(); from trl import TrlParser;
print(time.perf_counter()-t)"`, 3 runs) against 0.76-0.92 s for transformers' own
HfArgumentParser, so the commands build on it too. Where trl is not installed (vLLM's own
environment) the commands fall back to HfArgumentParser itself; recipes need trl.

A command's mistakes (an unknown flag, a bad value, a missing argument) are a UserError of one
line naming the closest option or value.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from typing import Any

from flipguard.config.recipe import flatten_recipe, public_recipe, read_recipe, split_recipe_argv
from flipguard.config.run_config import leading_config, read_run_config
from flipguard.config.spelling import did_you_mean
from flipguard.config.trainers import trainer_entry
from flipguard.config.values import check_parsed_values
from flipguard.config.vocabulary import COMMA_LISTS, comma_items, legacy_word
from flipguard.errors import UserError

# ---------------------------------------------------------------- the flag vocabulary
#
# One word for one setting in every command, in its flags and in its run config's keys
# (config/vocabulary.py: VOCABULARY, stated once in docs/cli.md). A field says how it relates to
# them in its metadata:
#   "flag": WORD            its flag is --WORD, though the field keeps its name (a recipe section's
#                           prefix: eval_plan_limit is --limit); --FIELD is no longer listed
# An old word (vocabulary.LEGACY: --n_items, --dataset, --models ...) is refused in every command,
# naming the word to use, never read in its place; a shared word a protocol does not take (its
# argument class's LACKS) is refused naming the protocol and what it takes instead.
# Fields of TRL's configs cannot say so: their names stay listed, the word beside them.
THEIR_FLAG_WORDS = {"model_name_or_path": "model", "output_dir": "out"}


class _Repeatable(argparse.Action):
    """A list option given twice adds up (`--model a --model b`); its first use replaces the
    default (or the run config's value)."""

    def __call__(self, parser, namespace, values, option_string=None):
        # a comma list's values arrive as lists (_comma_type): one list of them
        values = [v for value in values for v in (value if isinstance(value, list) else [value])]
        if getattr(self, "_namespace", None) is namespace:
            values = list(getattr(namespace, self.dest) or []) + values
        self._namespace = namespace
        setattr(namespace, self.dest, values)


def _comma_type(element: Any):
    """argparse's `type` of a comma-list option (vocabulary.COMMA_LISTS): each value a list of its words,
    each of the option's own type."""
    convert = element or str

    def comma_list(text: str) -> list:
        return [convert(v) for v in comma_items(text)]

    comma_list.__name__ = getattr(convert, "__name__", "value")  # argparse names it in "invalid int value"
    return comma_list


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The commands' --help (transformers' default formatter): a comma-list option's values shown as
    one comma list (`--subjects SUBJECTS[,SUBJECTS ...]`), the form every command takes."""

    def _format_args(self, action, default_metavar):
        if action.dest in COMMA_LISTS and action.nargs == "+":
            metavar = self._metavar_formatter(action, default_metavar)(1)[0]
            return f"{metavar}[,{metavar} ...]"
        return super()._format_args(action, default_metavar)


_CHOICE = re.compile(r"invalid choice: '?(?P<given>.*?)'? \(choose from (?P<choices>.*)\)$")

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
            kwargs.setdefault("formatter_class", _HelpFormatter)
            self.hidden: dict[str, str] = {}  # a spelling not listed -> the flag it stands for
            super().__init__(dataclass_types, **kwargs)
            dests = {a.dest for a in self._actions}
            for field, word in THEIR_FLAG_WORDS.items():
                if field in dests and word not in dests and f"--{word}" not in self._option_string_actions:
                    action = next(a for a in self._actions if a.dest == field and a.option_strings)
                    action.option_strings = [*action.option_strings, f"--{word}"]
                    self._option_string_actions[f"--{word}"] = action

        def add_argument(self, *args, **kwargs):
            word = kwargs.pop("flag", None)
            if kwargs.get("nargs") == "+" and "action" not in kwargs:
                kwargs["action"] = _Repeatable
                if kwargs.get("dest", str(args[0]).lstrip("-")) in COMMA_LISTS:
                    kwargs["type"] = _comma_type(kwargs.get("type"))
            if args and str(args[0]).startswith("--no_"):  # a boolean's complement: its field's word is done
                main = self.flag(kwargs.get("dest") or str(args[0])[5:])
                # its own help (not its field's, which says what the flag turns on), no default of its own
                kwargs.update(help=f"Turns {main} off: the same as {main} false.", default=argparse.SUPPRESS)
                return super().add_argument(*args, **kwargs)
            action = super().add_argument(*args, **kwargs)
            if word:  # the field's own spellings become hidden ones of its word
                for string in action.option_strings:
                    del self._option_string_actions[string]
                self.hidden |= dict.fromkeys(action.option_strings, f"--{word}")
                action.option_strings = [f"--{word}"]
                if action.metavar is None and action.nargs != 0:
                    action.metavar = word.upper()
                self._option_string_actions[f"--{word}"] = action
            return action

        usage_lead: str | None = None  # a word the usage line shows first (lead_with)
        usage_positional: str | None = None  # an option the usage line shows as a bare value (show_positional)

        def _typed_usage(self) -> None:
            """The usage line as the command is typed (lead_with, show_positional), made once, when asked."""
            if self.usage is not None or not (self.usage_lead or self.usage_positional):
                return
            usage = super().format_usage().removeprefix("usage: ").rstrip("\n")
            if self.usage_positional:
                usage = usage.replace(f"--{self.usage_positional} ", "", 1)
            if self.usage_lead:
                usage = f"{self.prog} {self.usage_lead} {usage.removeprefix(self.prog).lstrip()}"
            self.usage = usage.replace("%", "%%")

        def format_usage(self):
            self._typed_usage()
            return super().format_usage()

        def format_help(self):
            self._typed_usage()
            return super().format_help()

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
            name = given[2:].replace("-", "_")
            for cls in self.dataclass_types:  # a shared word this protocol does not take: said so, with its own
                lacks = getattr(cls, "LACKS", {})
                if name in lacks:
                    return UserError(f"{given}: {lacks[name]}")
            word = legacy_word(name)
            if word and f"--{word}" in self.listed_flags():
                return UserError(f"{given} is an old word, not read: the word is --{word} ({self.prog} --help lists "
                                 "the options)")
            return UserError(f"unknown option {given}{did_you_mean(given, self.listed_flags(), str)} "
                             f"({self.prog} --help lists the options)")

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
            known = {action.dest for action in self._actions}
            argv = current_flag_names(argv, known)
            if recipe_path is not None:
                raw = read_recipe(recipe_path)
                for key, value in (raw.get("env") or {}).items():
                    os.environ.setdefault(str(key), str(value))
                flat = current_names(flatten_recipe(raw, self.trainer), known)
                # keys of other scripts (the other trainer's fields, eval plan, ...) were
                # validated above and are simply not this script's business
                self.set_defaults_with_config(**{k: v for k, v in flat.items() if k in known})
                # what scripts keep (model cards, flipguard_training.json, wandb config):
                # env names only, never their values (they may be keys)
                self.recipe_path, self.recipe = recipe_path, public_recipe(raw)
            try:
                parsed = self.parse_flags(argv)
            except UserError:  # a flag's own mistake (unknown, a bad choice): the command line's, said as such
                raise
            except ValueError as exc:  # the configs' own checks (TRL's __post_init__): the recipe and flags together
                where = f"{recipe_path} with the command line's flags" if recipe_path and argv else recipe_path
                raise UserError(f"{where or 'command line'}: {exc}") from None
            # the recipe's values were checked where they are written (read_recipe: path:line); what a flag
            # changed is the command line's
            recipe_values = (current_names(flatten_recipe(read_recipe(recipe_path), self.trainer), known)
                             if recipe_path else {})
            check_parsed_values(parsed, "command line", skip=recipe_values, flag=self.flag)
            return parsed

    return RecipeParser


# transformers 5.24 renamed TrainingArguments' gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs),
# keeping the old names as aliases that warn (FutureWarning) and are read only at construction. Recipes and flags keep
# the name every supported release reads; where the parsed class has the new field, the value is passed under it.
RENAMED_ARGUMENTS = {"gradient_checkpointing": "activation_checkpointing",
                     "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}


def current_names(values: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """A recipe's flat keys under the names the installed library's dataclasses have (RENAMED_ARGUMENTS)."""
    return {RENAMED_ARGUMENTS[k] if RENAMED_ARGUMENTS.get(k) in known and RENAMED_ARGUMENTS[k] not in values else k: v
            for k, v in values.items()}


def current_flag_names(argv: list[str], known: set[str]) -> list[str]:
    """`--gradient_checkpointing[=V]` as `--activation_checkpointing[=V]` where the dataclasses have the new field."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        old = name[2:] if name.startswith("--") else None
        if old in RENAMED_ARGUMENTS and RENAMED_ARGUMENTS[old] in known:
            arg = f"--{RENAMED_ARGUMENTS[old]}{eq}{value}"
        out.append(arg)
    return out


def RecipeParser(dataclass_types, trainer: str | None = None, **kwargs):
    """A `trl.TrlParser` for flipguard recipes (built on first use: trl is imported only by a command that parses)."""
    return _trl_parser_class()(dataclass_types, trainer=trainer, **kwargs)


def parse_recipe(argv: list[str], dataclass_types, trainer: str | None = None, prog: str | None = None,
                 description: str | None = None):
    """Parse argv (recipe path or name + flag overrides) into the dataclasses; returns
    (tuple of dataclass instances, recipe path or None, raw recipe mapping)."""
    parser = RecipeParser(dataclass_types, trainer=trainer, prog=prog, description=description)
    lead_with(parser, "RECIPE")  # a file or a shipped recipe's name, first (--config FILE also reads)
    out = parser.parse_args_and_config(argv)
    return out, parser.recipe_path, parser.recipe

def _command_parser_class():
    """The recipes' TrlParser; where trl is not installed (vLLM's own environment, which takes
    flipguard with --no-deps: docs/serving.md) its base, transformers' HfArgumentParser, which
    parses a command's dataclasses the same way (a command uses nothing TrlParser adds)."""
    try:
        return _trl_parser_class()
    except ImportError:
        from transformers import HfArgumentParser

        return _flag_parser_class(HfArgumentParser)

def lead_with(parser: argparse.ArgumentParser, word: str) -> None:
    """--help's usage line as the command is typed when its first argument is a file (`flipguard study RECIPE
    ...`, `flipguard afr [RUN_CONFIG] ...`): the word right after the command's name (made when --help asks)."""
    parser.usage_lead = word


def show_positional(parser: argparse.ArgumentParser, positional: str) -> None:
    """--help as the command is typed: the usage line shows `--<positional> VALUE` as the bare VALUE
    (`flipguard view PATH`), and the option's help says it may be given first without its flag."""
    action = next(a for a in parser._actions if a.dest == positional)
    parser.usage_positional = positional
    text = (action.help or "").rstrip()
    metavar = action.metavar or positional.upper()
    action.help = f"{text}{'' if text.endswith('.') or not text else '.'} Given first, without --{positional}: " \
                  f"{parser.prog} {metavar} ...".replace("%", "%%").lstrip()


def parse_dataclasses(argv: list[str], *types, prog: str, description: str, positional: str | None = None,
                      run_config: bool = False):
    """Parse a command's argv into the given dataclasses; a YAML/JSON path (or a shipped run
    config's name) first is read as a run config (TRL/alignment-handbook style) and later flags
    override it. `positional`: the option that leading arguments before any flag give
    (`flipguard report RUN_DIR` = `--run_dir RUN_DIR`); `run_config`: the usage line shows [RUN_CONFIG] first."""
    parser = _command_parser_class()(types, prog=prog, description=description)
    if positional:
        show_positional(parser, positional)
    elif run_config:  # a protocol's command: its usage shows the run config it may take first
        lead_with(parser, "[RUN_CONFIG]")
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
