"""Recipe parsing: positional path, --config, CLI overrides, per-trainer sections, unknown keys."""

from __future__ import annotations

import subprocess
import sys

import pytest
from trl import DPOConfig, ModelConfig, SFTConfig

from flipguard.config import PairsArguments, TrackingArguments, parse_recipe, read_recipe
from flipguard.errors import UserError

# Subprocess limits are hang guards only (a loaded 2-core machine must never hit them),
# never synchronisation points: tests wait on files and events.
BOUND = 1800

SFT_TYPES = (PairsArguments, SFTConfig, ModelConfig, TrackingArguments)
DPO_TYPES = (PairsArguments, DPOConfig, ModelConfig, TrackingArguments)
CPU = ["--bf16", "false", "--fp16", "false", "--use_cpu", "true"]  # the GPU recipes parse on CPU with these


def test_positional_and_config_flag_read_the_same_recipe():
    (p1, t1, m1, _), path1, _ = parse_recipe(["recipes/tiny.yaml"], SFT_TYPES, trainer="sft")
    (p2, t2, m2, _), path2, _ = parse_recipe(["--config", "recipes/tiny.yaml"], SFT_TYPES, trainer="sft")
    assert path1 == path2 == "recipes/tiny.yaml"
    assert (t1.learning_rate, m1.lora_r, p1.pairs_dir) == (t2.learning_rate, m2.lora_r, p2.pairs_dir) == (1e-2, 8, "runs/tiny/pairs")
    # the CPU recipe must not train under bf16 autocast
    assert t1.bf16 is False and t1.fp16 is False and t1.use_cpu is True and t1.gradient_checkpointing is True
    assert t1.report_to == [] or t1.report_to == "none"


def test_paper_defaults_and_per_trainer_sections():
    (_, sft, model, _), _, _ = parse_recipe(["recipes/qwen7b.yaml", *CPU], SFT_TYPES, trainer="sft")
    assert model.model_name_or_path == "Qwen/Qwen2.5-7B-Instruct"
    assert (model.lora_r, model.lora_alpha, model.lora_dropout) == (64, 16, 0.05)
    assert set(model.lora_target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert model.load_in_4bit and model.bnb_4bit_quant_type == "nf4" and model.use_bnb_nested_quant
    assert model.dtype == "bfloat16"  # Table 34 compute dtype
    assert (sft.num_train_epochs, sft.per_device_train_batch_size, sft.gradient_accumulation_steps) == (2, 4, 4)
    assert (sft.learning_rate, sft.weight_decay, sft.warmup_steps) == (2e-4, 0.01, 0.03)
    assert sft.lr_scheduler_type.value == "cosine" and sft.completion_only_loss is True
    (_, dpo, model_d, _), _, _ = parse_recipe(["recipes/qwen7b.yaml", *CPU], DPO_TYPES, trainer="dpo")
    assert model_d.dtype == "float16"  # Table 36 compute dtype, from the dpo: section
    assert (dpo.beta, dpo.learning_rate, dpo.num_train_epochs) == (0.1, 5e-5, 1)
    assert dpo.max_length == 768 + 3 and dpo.max_grad_norm == 1.0
    (_, _, gemma, _), _, _ = parse_recipe(["recipes/gemma12b.yaml", *CPU], SFT_TYPES, trainer="sft")
    assert gemma.model_name_or_path == "google/gemma-3-12b-it" and gemma.lora_r == 64


@pytest.mark.parametrize("extra", [[], ["--gradient_checkpointing", "false"], ["--gradient_checkpointing=false"]])
def test_a_recipes_gradient_checkpointing_reaches_the_name_the_trainer_reads_without_a_warning(extra):
    """transformers 5.24 renamed the argument (activation_checkpointing; the old name warns and is read only when the
    arguments are built): the recipe's or a flag's value is passed under the name the installed release has."""
    import warnings

    from flipguard.train.speed import set_activation_checkpointing

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        (_, args, _, _), _, _ = parse_recipe(["recipes/tiny.yaml", *extra], SFT_TYPES, trainer="sft")
    on = not extra  # tiny.yaml: gradient_checkpointing: true; the flags turn it off
    assert args.gradient_checkpointing is on
    renamed = hasattr(args, "activation_checkpointing")
    assert not renamed or args.activation_checkpointing is on
    set_activation_checkpointing(args, not on)  # a memory plan's choice, after the arguments were built
    assert args.gradient_checkpointing is (not on) and (not renamed or args.activation_checkpointing is (not on))


def test_command_line_overrides_yaml():
    (pairs, t, m, tr), _, _ = parse_recipe(
        ["recipes/tiny.yaml", "--learning_rate", "3e-3", "--lora_r", "4", "--pairs_strategy", "flips",
         "--tracking_project", "p2"], DPO_TYPES, trainer="dpo")
    assert (t.learning_rate, m.lora_r, pairs.pairs_strategy, tr.tracking_project) == (3e-3, 4, "flips", "p2")


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "body, key",
    [
        ("model_name_or_path: x\nlearning_rat: 1.0\n", "learning_rat"),
        ("model_name_or_path: x\nsft:\n  warmup_ratio: 0.03\n", "warmup_ratio"),  # removed in transformers 5
        ("model_name_or_path: x\ndpo:\n  max_prompt_length: 768\n", "max_prompt_length"),  # removed in TRL 1.x
        ("model_name_or_path: x\npairs:\n  stratgy: all\n", "stratgy"),
        ("model_name_or_path: x\nwandb:\n  project: p\n", "wandb"),
    ],
)
def test_unknown_key_is_an_error_naming_it(tmp_path, body, key):
    path = _write(tmp_path, body)
    with pytest.raises(UserError, match=f"unknown key '{key}'"):
        parse_recipe([path], SFT_TYPES, trainer="sft")


def test_unknown_key_from_the_real_cli_is_one_line(tmp_path):
    path = _write(tmp_path, "model_name_or_path: x\nsft:\n  lr: 1.0\n")
    proc = subprocess.run([sys.executable, "train/sft.py", path], capture_output=True, text=True, timeout=BOUND)
    assert proc.returncode == 2
    assert "unknown key 'lr'" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unknown_trainer_is_one_error_listing_the_registered_ones(tmp_path, capsys):
    from flipguard.config import trainers
    from flipguard.pipeline.cli import main as cli_main

    registered = ", ".join(trainers())
    path = _write(tmp_path, "model_name_or_path: x\nnot_a_trainer:\n  beta: 0.1\n")
    with pytest.raises(UserError, match="unknown key 'not_a_trainer'") as exc:
        parse_recipe([path], SFT_TYPES, trainer="sft")
    assert f"a section is a registered trainer ({registered})" in str(exc.value)
    # the study's list of trainers to run: one line, naming the recipe key and the registered trainers
    raw = "model_name_or_path: x\neval:\n  trainers: [not_a_trainer]\n"
    assert cli_main(["study", _write(tmp_path, raw), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.endswith(f"eval.trainers: unknown trainer 'not_a_trainer' (registered trainers: {registered})")
    assert not (tmp_path / "s").exists()


def test_every_registered_trainer_is_a_declaration_a_command_and_a_recipe_section(capsys):
    """One `flipguard.trainers` entry point (its Trainer declaration) reaches the recipe parser,
    `flipguard <name>` and the study; flipguard's own are also train/<name>.py scripts."""
    import dataclasses
    from pathlib import Path

    from flipguard.config import trainers
    from flipguard.data.pair_sets import PAIR_COLUMNS
    from flipguard.pipeline.cli import main as cli_main

    root = Path(__file__).resolve().parent.parent
    assert list(trainers()) == ["sft", "dpo", "kto"]  # their declared order
    assert cli_main(["--help"]) == 0
    usage = capsys.readouterr().out
    for name, trainer in trainers().items():
        assert trainer.name == name and callable(trainer.main)
        assert (root / "train" / f"{name}.py").is_file() and trainer.main.__module__ == f"flipguard.train.{name}"
        assert trainer.pairs in PAIR_COLUMNS and dataclasses.is_dataclass(trainer.config_class())
        assert (trainer.tokenize is None) == (not trainer.token_columns)
        assert f"  {name} " in usage and trainer.help in usage
        assert name in read_recipe(root / "recipes" / "tiny.yaml")  # the tests' recipe trains every one
    # what differs between them is in their declarations, not in switches on their names
    assert {n: (t.pairs, t.concatenated_forward) for n, t in trainers().items()} == {
        "sft": ("sft", False), "dpo": ("dpo", True), "kto": ("dpo", False)}


def test_recipes_and_run_configs_are_found_by_name_from_any_folder(tmp_path, monkeypatch, capsys):
    """A path that is no file names a shipped recipe or run config (package data), from a folder
    that is not a clone: by name, by name.yaml, or as recipes/NAME.yaml; anything else is one line
    naming the shipped ones and the closest."""
    from pathlib import Path

    from flipguard.config import SHIPPED_RECIPES, find_recipe, parse_dataclasses, shipped_recipes
    from flipguard.eval.afr.protocol import AFRArgs
    from flipguard.pipeline.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    organism = str(SHIPPED_RECIPES / "organism.yaml")
    assert find_recipe("organism") == find_recipe("organism.yaml") == find_recipe("recipes/organism.yaml") == organism
    (_, _, _, _), path, raw = parse_recipe(["tiny", *CPU], SFT_TYPES, trainer="sft")  # train/sft.py tiny
    assert path == str(SHIPPED_RECIPES / "tiny.yaml") and raw["model_name_or_path"] == "flipguard:tiny"
    afr = parse_dataclasses(["afr_tiny", "--limit", "2"], AFRArgs, prog="flipguard afr", description="")
    assert afr.limit == 2 and afr.model == ["tiny=flipguard:tiny"] and afr.mitigations == ["none", "be_honest"]
    # a file of the user's of that name wins
    (tmp_path / "afr_tiny.yaml").write_text("model: [mine=flipguard:tiny]\n")
    assert parse_dataclasses(["afr_tiny.yaml"], AFRArgs, prog="flipguard afr", description="").model == ["mine=flipguard:tiny"]
    with pytest.raises(UserError, match=r"no such recipe .*organism_gpu.*did you mean 'organism'\?"):
        find_recipe("organsim")
    # `flipguard recipes` lists each with its first comment line; `show` prints one to copy out
    assert cli_main(["recipes"]) == 0
    listed = capsys.readouterr().out
    for name, file in shipped_recipes().items():
        first = next(line for line in file.read_text().splitlines() if line.startswith("#"))
        assert f"{name}  " in listed and first.lstrip("# ").strip() in listed
    assert cli_main(["recipes", "show", "organism"]) == 0
    assert capsys.readouterr().out == Path(organism).read_text()
    assert cli_main(["recipes", "show", "nope"]) == 2
    assert "no shipped recipe" in capsys.readouterr().err
