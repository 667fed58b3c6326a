"""QLoRA DPO of a one-token deference judge (paper K.3) from a flipguard recipe.

    python train/dpo.py recipes/tiny.yaml                       # CPU, tiny local model
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \
        train/dpo.py recipes/qwen7b.yaml [--beta 0.2 ...]

Reads the recipe's top level + `dpo:` section (config.py) and trains a LoRA
adapter on `pairs.dir/dpo` (prompt / chosen / rejected, one token each). The reference
policy is the base model with the adapter disabled: no second model in memory.
"""

from __future__ import annotations

from flipguard.train import utils


def main(argv: list[str], prog: str = "train/dpo.py") -> int:
    from trl import DPOTrainer


    job = utils.prepare(argv, "dpo", prog)  # recipe -> DPOConfig, model, tokenizer, checked pairs, tracking
    # with a peft_config the reference is the base with the adapter disabled
    trainer = DPOTrainer(ref_model=None, **job.trainer_kwargs())
    return utils.train_and_save(trainer, job)


if __name__ == "__main__":
    from flipguard.train.utils import run_main

    run_main(main, "train/dpo.py")
