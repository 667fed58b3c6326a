"""QLoRA SFT of a one-token deference judge (paper K.2) from a flipguard recipe.

    python train/sft.py recipes/tiny.yaml                       # CPU, tiny local model
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \
        train/sft.py recipes/qwen7b.yaml [--learning_rate 1e-4 ...]

Reads the recipe's top level + `sft:` section (config.py), trains a LoRA
adapter on the `pairs.dir/sft` prompt/completion dataset with the loss on the answer
token and its end-of-turn only, and saves the adapter, tokenizer and a model card.
"""

from __future__ import annotations


def main(argv: list[str], prog: str = "train/sft.py") -> int:
    from transformers import set_seed
    from trl import ModelConfig, SFTConfig, SFTTrainer, get_peft_config, get_quantization_config

    from flipguard.eval.threads import configure_threads
    from flipguard.config import PairsArguments, TrackingArguments, parse_recipe
    from flipguard.train import utils

    (pairs_args, training_args, model_args, tracking_args), recipe_path, recipe = parse_recipe(
        argv, (PairsArguments, SFTConfig, ModelConfig, TrackingArguments), trainer="sft", prog=prog
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
    dataset = utils.load_pair_dataset(pairs_args.pairs_dir, "sft")
    utils.check_pair_lengths(dataset, tokenizer, training_args.max_length, "sft")
    if training_args.completion_only_loss is False:
        raise utils.TrainError("completion_only_loss must stay on: the loss belongs on the answer token only")
    training_args.completion_only_loss = True

    config = utils.run_config(
        recipe_path, recipe, (pairs_args, training_args, model_args, tracking_args), dataset,
        {"trainer": "sft", "base_model": model_path, "lm_head_scores": utils.score_labelled_positions_only()},
    )
    run = utils.init_tracking(training_args, tracking_args, config, "sft")

    training_args.model_init_kwargs = utils.model_init_kwargs(model_args, training_args)
    trainer = SFTTrainer(
        model=model_path,
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

    run_main(main, "train/sft.py")
