"""QLoRA SFT of a one-token deference judge (paper K.2) from a flipguard recipe.

    flipguard sft recipes/tiny.yaml                       # CPU, tiny local model
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \
        -m flipguard.train.sft qwen7b [--learning_rate 1e-4 ...]

Reads the recipe's top level + `sft:` section (config/recipe.py), trains a LoRA
adapter on the `pairs.dir/sft` prompt/completion dataset with the loss on the answer
token and its end-of-turn only, and saves the adapter, tokenizer and a model card. Each step is
computed with prefix sharing and no padding (train/packing.py; `prefix_sharing: false` for TRL's
own layout), split to fit `memory_budget` on a GPU (train/memory.py).
"""

from __future__ import annotations

from flipguard.config import Trainer
from flipguard.train import utils
from flipguard.train.utils import TrainError

TOKEN_COLUMNS = ("input_ids", "labels")


def sft_columns(prompt_ids, full) -> dict[str, list[list[int]]]:
    """TRL's SFT preparation of prompt/completion conversations: each prompt + completion's ids, and
    its labels, -100 up to where the tokenized prompt and prompt + completion part (TRL's rule):
    the loss on the answer and its end of turn only."""
    from trl.data_utils import common_prefix_length  # TRL's own rule for where a reply starts

    ids, labels = [], []
    for p, f in zip(prompt_ids, full["completion"]):
        n = common_prefix_length(p, f)
        ids.append(f)
        labels.append([-100] * n + f[n:])
    return {"input_ids": ids, "labels": labels}


def sft_arguments(training_args) -> None:
    if training_args.completion_only_loss is False:
        raise TrainError("completion_only_loss must stay on: the loss belongs on the answer token only")
    training_args.completion_only_loss = True
    # the pair set comes tokenized (TOKEN_COLUMNS): TRL's SFT takes input_ids and labels as prepared
    training_args.dataset_kwargs = {**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True}


def main(argv: list[str], prog: str = "train/sft.py") -> int:
    from trl import SFTTrainer

    # recipe -> SFTConfig, model, pairs (tokenized once), memory plan, tracking
    job = utils.prepare(argv, TRAINER, prog, check=sft_arguments)
    return utils.train_and_save(SFTTrainer(**job.trainer_kwargs()), job)


TRAINER = Trainer(name="sft", config="trl:SFTConfig", pairs="sft", main=main, label="SFT", help="LoRA SFT from a recipe (same as flipguard sft RECIPE)",
                  tokenize=sft_columns, token_columns=TOKEN_COLUMNS, order=10)


if __name__ == "__main__":
    from flipguard.train.utils import run_main

    run_main(main, "train/sft.py" if __spec__ is None else f"python -m {__spec__.name}")  # a script, or -m
