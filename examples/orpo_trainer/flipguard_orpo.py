"""ORPO (Hong et al. 2024, odds-ratio preference optimisation: a preference loss beside the SFT
loss, no reference model) as a flipguard trainer, shipped as a package of its own.

The whole plug-in is this module and one entry point (pyproject.toml beside it):
`TRAINER` declares what flipguard needs to know (its TRL config, the pair set it reads, its
condition's label) and `main` is the usual three steps: the recipe, model, pairs and tracking
prepared by flipguard (flipguard.train.utils.prepare), TRL's trainer, trained and saved with
flipguard's provenance. A recipe then takes an `orpo:` section (ORPOConfig's fields), the study
trains, merges and measures it, and `flipguard orpo RECIPE` runs it alone.

TRL 1.16 keeps ORPOTrainer in trl.experimental. It takes no `quantization_config` and loads a
model path with device_map "auto", so the model is loaded here with the settings the built-in
trainers give TRL (4-bit base included); its forward scores full logits, not TRL's fused LM head,
so flipguard's prefix sharing does not engage and the training record says so.
"""

from __future__ import annotations

from flipguard.config import Trainer
from flipguard.train import utils


def main(argv: list[str], prog: str = "flipguard orpo") -> int:
    from transformers import AutoModelForCausalLM
    from trl.experimental.orpo import ORPOTrainer

    job = utils.prepare(argv, TRAINER, prog)  # recipe -> ORPOConfig, model, the DPO pair set, tracking
    kwargs = job.trainer_kwargs()
    init = dict(job.training_args.model_init_kwargs or {})
    job.training_args.model_init_kwargs = None  # ORPOTrainer refuses them beside a loaded model
    model = AutoModelForCausalLM.from_pretrained(kwargs.pop("model"), quantization_config=kwargs.pop("quantization_config"),
                                                 **init)
    return utils.train_and_save(ORPOTrainer(model=model, **kwargs), job)


TRAINER = Trainer(name="orpo", config="trl.experimental.orpo:ORPOConfig", pairs="dpo", main=main, label="ORPO",
                  help="LoRA ORPO from a recipe (a plug-in: examples/orpo_trainer)")
