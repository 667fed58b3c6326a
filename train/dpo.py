"""QLoRA DPO of a one-token deference judge (paper K.3) from a flipguard recipe.

    python train/dpo.py recipes/tiny.yaml                       # CPU, tiny local model
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \
        train/dpo.py recipes/qwen7b.yaml [--beta 0.2 ...]

Reads the recipe's top level + `dpo:` section (config/recipe.py) and trains a LoRA
adapter on `pairs.dir/dpo` (prompt / chosen / rejected, one token each). The reference
policy is the base model with the adapter disabled: no second model in memory. With prefix
sharing (train/packing.py) a pair's prompt goes through the policy once and through the
reference once, not twice each.
"""

from __future__ import annotations

from flipguard.train import tokenized, utils


def main(argv: list[str], prog: str = "train/dpo.py") -> int:
    # recipe -> DPOConfig, model, tokenizer, checked pairs (tokenized once), memory plan, tracking
    job = utils.prepare(argv, "dpo", prog, tokenize=True)
    # TRL's DPOTrainer, taking the tokenized pairs as prepared; with a peft_config the reference is
    # the base with the adapter disabled
    trainer = tokenized.dpo_trainer_class()(ref_model=None, **job.trainer_kwargs())
    return utils.train_and_save(trainer, job)


if __name__ == "__main__":
    from flipguard.train.utils import run_main

    run_main(main, "train/dpo.py")
