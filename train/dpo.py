"""QLoRA DPO of a one-token deference judge (paper K.3) from a flipguard recipe.

    python train/dpo.py recipes/tiny.yaml                       # CPU, tiny local model
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \
        train/dpo.py recipes/qwen7b.yaml [--beta 0.2 ...]

Reads the recipe's top level + `dpo:` section (config.py) and trains a LoRA
adapter on `pairs.dir/dpo` (prompt / chosen / rejected, one token each). The reference
policy is the base model with the adapter disabled: no second model in memory.
"""

from __future__ import annotations


def main(argv: list[str], prog: str = "train/dpo.py") -> int:
    from transformers import set_seed
    from trl import DPOConfig, DPOTrainer, ModelConfig, get_peft_config, get_quantization_config

    from flipguard.eval.threads import configure_threads
    from flipguard.config import PairsArguments, TrackingArguments, parse_recipe
    from flipguard.train import utils

    (pairs_args, training_args, model_args, tracking_args), recipe_path, recipe = parse_recipe(
        argv, (PairsArguments, DPOConfig, ModelConfig, TrackingArguments), trainer="dpo", prog=prog
    )
    configure_threads(None)  # $OMP_NUM_THREADS, else 1 (see flipguard.eval.threads)
    set_seed(training_args.seed)
    utils.setup_logging(training_args)
    checkpoint = utils.resume_checkpoint(training_args)

    utils.check_quantization_available(model_args)
    model_path = utils.resolve_model_path(model_args.model_name_or_path)
    utils.check_model_loadable(model_path, recipe_path)
    tokenizer = utils.load_tokenizer(model_path, training_args.trust_remote_code)

    utils.ensure_pairs(pairs_args, recipe_path, model_path)
    dataset = utils.load_pair_dataset(pairs_args.pairs_dir, "dpo")
    utils.check_pair_lengths(dataset, tokenizer, training_args.max_length, "dpo")

    config = utils.run_config(
        recipe_path, recipe, (pairs_args, training_args, model_args, tracking_args), dataset,
        {"trainer": "dpo", "base_model": model_path, "lm_head_scores": utils.score_labelled_positions_only()},
    )
    run = utils.init_tracking(training_args, tracking_args, config, "dpo")

    training_args.model_init_kwargs = utils.model_init_kwargs(model_args, training_args)
    trainer = DPOTrainer(
        model=model_path,
        ref_model=None,  # with a peft_config the reference is the base with the adapter disabled
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=utils.get_peft_config_checked(model_args, get_peft_config),
        quantization_config=get_quantization_config(model_args),
    )
    trainer.train(resume_from_checkpoint=checkpoint)

    utils.save_adapter(trainer, tokenizer, training_args, config, pairs_args.pairs_dir, run)
    return 0


if __name__ == "__main__":
    from flipguard.train.utils import run_main

    run_main(main, "train/dpo.py")
