"""The trainer registry: every trainer a recipe may have a section for, a study may train and
`flipguard <name>` runs."""

from __future__ import annotations

import dataclasses
import importlib

from flipguard.errors import UserError


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
