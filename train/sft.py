"""QLoRA SFT of a one-token deference judge (paper K.2) from a flipguard recipe.

    python train/sft.py recipes/tiny.yaml                       # CPU, tiny local model
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \
        train/sft.py recipes/qwen7b.yaml [--learning_rate 1e-4 ...]

Reads the recipe's top level + `sft:` section (config/recipe.py), trains a LoRA
adapter on the `pairs.dir/sft` prompt/completion dataset with the loss on the answer
token and its end-of-turn only, and saves the adapter, tokenizer and a model card. Each step is
computed with prefix sharing and no padding (train/packing.py; `prefix_sharing: false` for TRL's
own layout), split to fit `memory_budget` on a GPU (train/memory.py).
"""

from __future__ import annotations

from flipguard.train import utils
from flipguard.train.utils import TrainError


def completion_loss_only(training_args) -> None:
    if training_args.completion_only_loss is False:
        raise TrainError("completion_only_loss must stay on: the loss belongs on the answer token only")
    training_args.completion_only_loss = True


def main(argv: list[str], prog: str = "train/sft.py") -> int:
    from trl import SFTTrainer

    # recipe -> SFTConfig, model, pairs (tokenized once), memory plan, tracking
    job = utils.prepare(argv, "sft", prog, check=completion_loss_only, tokenize=True)
    return utils.train_and_save(SFTTrainer(**job.trainer_kwargs()), job)


if __name__ == "__main__":
    from flipguard.train.utils import run_main

    run_main(main, "train/sft.py")
