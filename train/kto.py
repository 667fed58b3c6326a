"""QLoRA KTO of a one-token deference judge from a flipguard recipe: the third built-in trainer.

    flipguard kto recipes/tiny.yaml                       # CPU, tiny local model
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \
        -m flipguard.train.kto qwen7b [--beta 0.2 ...]

Reads the recipe's top level + `kto:` section (config/recipe.py) and trains a LoRA adapter with
Kahneman-Tversky optimisation: each reply is labelled desirable or undesirable on its own, so
the loss needs no pairs. Its rows are the pair builder's `pairs.dir/dpo` set (the same items,
checks and length limits as DPO), which KTOTrainer unpairs itself (trl.unpair_preference_dataset):
each pair gives its chosen reply labelled True and its rejected one labelled False.

Why KTO and not ORPO: in the installed TRL (1.16) KTOTrainer is stable API (`from trl import
KTOTrainer`) and takes what DPOTrainer takes (a model path, `quantization_config`, `peft_config`:
the reference is the base with the adapter disabled) and scores through the same fused LM head
(labelled positions only on CPU, train/utils.py); ORPOTrainer sits in trl.experimental, an older
trainer that loads the model itself with device_map "auto" and takes no quantization_config, so
QLoRA and the CPU path would need their own code.
"""

from __future__ import annotations

from flipguard.config import Trainer
from flipguard.train import utils
from flipguard.train.utils import TrainError


def kl_needs_a_batch(training_args) -> None:
    """KTO estimates its KL term from the other replies of a batch: one row per batch cannot."""
    if training_args.loss_type != "apo_zero_unpaired" and training_args.per_device_train_batch_size < 2:
        raise TrainError(f"kto.per_device_train_batch_size: {training_args.per_device_train_batch_size} must be >= 2 "
                         "(KTO estimates its KL term from the other replies in the batch)")


def main(argv: list[str], prog: str = "train/kto.py") -> int:
    from trl import KTOTrainer

    job = utils.prepare(argv, TRAINER, prog, check=kl_needs_a_batch)  # recipe -> KTOConfig, model, pairs, tracking
    # with a peft_config the reference is the base with the adapter disabled
    trainer = KTOTrainer(ref_model=None, **job.trainer_kwargs())
    return utils.train_and_save(trainer, job)


# the DPO pairs, each reply a sample of its own (KTOTrainer unpairs them itself: TRL tokenizes them)
TRAINER = Trainer(name="kto", config="trl:KTOConfig", pairs="dpo", main=main, label="KTO",
                  help="LoRA KTO from a recipe, on the DPO pairs unpaired (same as flipguard kto RECIPE)", order=30)


if __name__ == "__main__":
    from flipguard.train.utils import run_main

    run_main(main, "train/kto.py" if __spec__ is None else f"python -m {__spec__.name}")  # a script, or -m
