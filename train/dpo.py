"""QLoRA DPO of a one-token deference judge (paper K.3) from a flipguard recipe.

    flipguard dpo recipes/tiny.yaml                       # CPU, tiny local model
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \
        -m flipguard.train.dpo qwen7b [--beta 0.2 ...]

Reads the recipe's top level + `dpo:` section (config/recipe.py) and trains a LoRA
adapter on `pairs.dir/dpo` (prompt / chosen / rejected, one token each). The reference
policy is the base model with the adapter disabled: no second model in memory. With prefix
sharing (train/packing.py) a pair's prompt goes through the policy once and through the
reference once, not twice each.
"""

from __future__ import annotations

from typing import Any

from flipguard.config import Trainer
from flipguard.train import compat, tokenized, utils

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def dpo_columns(prompt_ids, full) -> dict[str, list[list[int]]]:
    """TRL's DPO preparation of prompt/chosen/rejected conversations: the reply starts where the
    tokenized prompt and prompt + reply part (TRL's rule), for chosen and rejected alike."""
    from trl.data_utils import common_prefix_length  # TRL's own rule for where a reply starts

    out: dict[str, list[list[int]]] = {name: [] for name in TOKEN_COLUMNS}
    for p, c, r in zip(prompt_ids, full["chosen"], full["rejected"]):
        n = min(common_prefix_length(p, c), common_prefix_length(p, r))
        out["prompt_ids"].append(p[:n])
        out["chosen_ids"].append(c[n:])
        out["rejected_ids"].append(r[n:])
    return out


def dpo_trainer_class():
    """TRL's DPOTrainer taking a pair set tokenized here as prepared. DPOTrainer has no public
    switch to skip its preparation (SFT's `dataset_kwargs.skip_prepare_dataset`), so this overrides
    its `_prepare_dataset`, on the TRL versions it is tested on (train/compat.py); on another, TRL's
    own DPOTrainer (and TRAINER declares no token columns). Any other dataset goes through TRL's own
    preparation as before."""
    from trl import DPOTrainer

    if not compat.within("dpo_prepare_dataset"):
        compat.note("dpo_prepare_dataset")
        return DPOTrainer

    class TokenizedDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name: str) -> Any:
            if not getattr(self, "_is_vision_dataset", False) and tokenized.has_columns(dataset, TOKEN_COLUMNS):
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    TokenizedDPOTrainer.__name__ = TokenizedDPOTrainer.__qualname__ = "DPOTrainer"
    return TokenizedDPOTrainer


def main(argv: list[str], prog: str = "train/dpo.py") -> int:
    # recipe -> DPOConfig, model, tokenizer, checked pairs (tokenized once), memory plan, tracking
    job = utils.prepare(argv, TRAINER, prog)
    # TRL's DPOTrainer, taking the tokenized pairs as prepared; with a peft_config the reference is
    # the base with the adapter disabled
    trainer = dpo_trainer_class()(ref_model=None, **job.trainer_kwargs())
    return utils.train_and_save(trainer, job)


# the pair set tokenized once where TRL takes it as prepared (dpo_trainer_class), else by TRL itself
TOKENIZED = compat.within("dpo_prepare_dataset")
TRAINER = Trainer(name="dpo", config="trl:DPOConfig", pairs="dpo", main=main, label="DPO",
                  help="LoRA DPO from a recipe (same as flipguard dpo RECIPE)", concatenated_forward=True, order=20,
                  tokenize=dpo_columns if TOKENIZED else None, token_columns=TOKEN_COLUMNS if TOKENIZED else ())


if __name__ == "__main__":
    from flipguard.train.utils import run_main

    run_main(main, "train/dpo.py" if __spec__ is None else f"python -m {__spec__.name}")  # a script, or -m
