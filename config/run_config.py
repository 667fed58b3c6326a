"""Reading a command's run config: a flat YAML (or JSON) mapping of its options, given first on
its command line (TRL / alignment-handbook style), checked key by key before anything runs."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterable

from flipguard.config.shipped import find_recipe
from flipguard.config.spelling import did_you_mean
from flipguard.config.values import check_values
from flipguard.config.vocabulary import COMMA_LISTS, comma_items, legacy_word
from flipguard.errors import UserError
from flipguard.files import check_types, field_types, load_yaml


def field_aliases(*types: type) -> dict[str, str]:
    """A run config's key -> the field it sets, where the two differ: a field's flag word (its metadata's
    "flag", config/parsers.py)."""
    out: dict[str, str] = {}
    for cls in types:
        for f in dataclasses.fields(cls):
            alias = f.metadata.get("flag")
            if alias and alias != f.name:
                out[alias] = f.name
    return out

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
            where = f"{path}{f':{lines[key]}' if key in lines else ''}"
            word = legacy_word(str(key))
            if word and (word in types or word in aliases):
                raise UserError(f"{where}: {str(key)!r} is an old word, not read: the key is {word!r}")
            raise UserError(f"{where}: unknown key {str(key)!r}{did_you_mean(key, types)}")
        if isinstance(value, str) and key in COMMA_LISTS and _takes_list(types[key]):
            config[key] = comma_items(value)  # `subjects: anatomy,astronomy`, as on the command line
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool) and _takes_list(types[key]):
            config[key] = [value]  # `model: flipguard:tiny` for a list of models
    check_types(config, types, path, UserError, lines, written)
    check_values(config, path, written, lines)
    return config

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
