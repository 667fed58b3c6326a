"""The trainer registry: every trainer a recipe may have a section for, a study may train and
`flipguard <name>` runs.

A trainer is a plug-in, found as tasks and backends are (plugins.py): an entry point of the
group `flipguard.trainers` naming its `Trainer` declaration. flipguard's own (train/sft.py,
dpo.py, kto.py) are declared in pyproject.toml exactly as a user's package declares its own
(examples/orpo_trainer/: ORPO, outside the package):

    [project.entry-points."flipguard.trainers"]
    mytrainer = "my_package.my_module:TRAINER"

Its name is its recipe section, its command `flipguard <name>` and its study stages (<name>,
<name>-merge, <name>-eval). Everything about it that the recipe parser, the pair sets, the
tokenizer, the memory plan and the study need is in its declaration: nothing outside its own
module names it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from flipguard import plugins
from flipguard.errors import UserError


@dataclasses.dataclass(frozen=True)
class Trainer:
    """One trainer, as its entry point declares it."""

    name: str
    config: str  # "module:Class" of its TRL config (its recipe section's fields), imported on use
    pairs: str   # the kind of pair set it reads from pairs.dir (data/pair_sets.py: "sft" prompt/completion,
    #              "dpo" prompt/chosen/rejected)
    main: Callable[..., int]  # main(argv, prog) -> exit status: `flipguard <name>` and the study's stage
    label: str   # its condition in the comparison
    help: str    # one line for `flipguard --help`
    # the columns its TRL trainer's own preparation writes, computed once by flipguard from each prompt's
    # and each prompt + reply's token ids (train/tokenized.py): tokenize(prompt_ids, {reply column: ids})
    # -> {column: values}. None: the pair set goes to TRL as conversations and TRL tokenizes it.
    tokenize: Callable[[list, dict], dict] | None = None
    token_columns: tuple[str, ...] = ()  # the names tokenize returns
    # a pair's replies go through one forward together (DPO's concatenated chosen and rejected: packed,
    # they share the prompt), not each as a sample of its own (KTO): the memory plan's rows per sample
    concatenated_forward: bool = False
    # where its stages and its condition come among the trainers (a study, the comparison, `flipguard
    # --help`): lower first, then by name. flipguard's own: SFT 10, DPO 20, KTO 30
    order: int = 100

    def config_class(self):
        module, _, name = self.config.partition(":")
        return getattr(importlib.import_module(module), name)


_loaded: dict[str, Trainer] = {}


def trainers() -> dict[str, Trainer]:
    """name -> Trainer of every `flipguard.trainers` entry point, flipguard's own and every installed
    package's, in their declared `order`. Loaded once per process."""
    if not _loaded:
        found = []
        for ep in plugins.plugins(plugins.TRAINERS).values():
            try:
                trainer = plugins.load(ep)
                if not isinstance(trainer, Trainer) or trainer.name != ep.name:
                    package = plugins.package_of(ep)
                    raise UserError(f"'{plugins.TRAINERS}' entry point {ep.name!r} ({ep.value}"
                                    f"{f', package {package}' if package else ''}) is not a flipguard.config.Trainer "
                                    f"named {ep.name!r}: fix the plug-in's pyproject.toml")
            except UserError as exc:
                if plugins.is_builtin(ep):
                    raise
                plugins.mark_broken(plugins.TRAINERS, ep.name, str(exc))  # blocks only what names it
                continue
            found.append(trainer)
        _loaded.update((t.name, t) for t in sorted(found, key=lambda t: (t.order, t.name)))
    return dict(_loaded)


def broken_trainers() -> dict[str, str]:
    """name -> why: the installed trainer plug-ins that failed to load (a recipe section, a study stage or a
    command of that name is refused with its line; nothing else is)."""
    trainers()
    return {name: plugins.broken(plugins.TRAINERS, name) for name in plugins.broken_names(plugins.TRAINERS)}


def trainer_entry(name: str, where: str) -> Trainer:
    """The registered trainer `name`; anything else is one error listing the registered ones."""
    registered = trainers()
    if name in broken_trainers():
        raise UserError(f"{where}: {broken_trainers()[name]}")
    if name not in registered:
        raise UserError(f"{where}: unknown trainer {name!r} (registered trainers: {', '.join(registered)})")
    return registered[name]
