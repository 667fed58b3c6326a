"""bench/gpu/run.sh, the GPU machine's one command, checked where CI runs: without CUDA.

The dry run installs the pinned wheels (bench/gpu/prepare.sh downloads them when .whl/ lacks
them: CI reaches PyPI) into a temp --target and imports every module the GPU steps use from
there; the tiny-shape run executes every step the GPU run does (the same scripts, real
trainers through `accelerate launch`) at hidden 64 / 2 layers on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "bench" / "gpu" / "wheels.txt"


def pinned() -> list[tuple[str, str, str]]:
    rows = []
    for line in WHEELS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            spec, file, sha = line.split()
            rows.append((spec, file, sha))
    return rows


def ensure_wheels() -> None:
    if all((ROOT / ".whl" / f).is_file() for _, f, _ in pinned()):
        return
    subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "prepare.sh")], check=True, timeout=600,
                   env={**os.environ, "PYTHON": sys.executable})


def env(**extra) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # this venv's python3 and accelerate first
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1", **extra}


def test_the_pins_name_the_cuda13_bitsandbytes_wheel_and_one_version_each():
    rows = pinned()
    names = [spec.split("==")[0] for spec, _, _ in rows]
    assert len(names) == len(set(names))
    assert {"trl", "datasets", "dill", "multiprocess", "bitsandbytes"} <= set(names)
    bnb = next(f for spec, f, _ in rows if spec.startswith("bitsandbytes=="))
    assert bnb == "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    assert all(len(sha) == 64 for _, _, sha in rows)


def test_dry_run_installs_the_wheels_into_a_temp_target_and_imports_every_gpu_module(tmp_path):
    ensure_wheels()
    import zipfile

    with zipfile.ZipFile(ROOT / ".whl" / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl") as z:
        assert "bitsandbytes/libbitsandbytes_cuda130.so" in z.namelist()
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run.sh"), "--dry-run"], cwd=ROOT, text=True,
                          capture_output=True, timeout=600, env=env(FG_SITE=str(tmp_path / "site")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run: all imports ok" in proc.stdout
    for name in ("trl", "datasets", "bitsandbytes", "peft"):  # imported from the temp target, not this venv
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"ok {name} "))
        assert str(tmp_path / "site") in line
    assert "ok entry points flipguard.tasks ['afr', 'dds', 'inspect', 'lm-eval', 'sos']" in proc.stdout


def test_a_checkout_without_install_metadata_reads_pyprojects_entry_points(monkeypatch):
    from flipguard import plugins

    monkeypatch.setattr(plugins, "entry_points", lambda group: [])  # as on the GPU machine: no dist-info
    found = plugins.plugins(plugins.BACKENDS)
    assert {n: ep.value for n, ep in found.items()} == {
        "hf": "flipguard.eval.backends.hf", "vllm": "flipguard.eval.backends.vllm_engine",
        "openai": "flipguard.eval.backends.openai_api"}
    assert found["hf"].group == plugins.BACKENDS
    assert plugins.plugins(plugins.MODELS)["flipguard:organism"].value == "flipguard.eval.embedded.organism:shipped_organism"


def test_an_installed_entry_point_wins_over_the_source_tree(monkeypatch):
    from flipguard import plugins

    mine = EntryPoint("hf", "flipguard.eval.backends.hf", plugins.BACKENDS)
    other = EntryPoint("echo", "echo_backend", plugins.BACKENDS)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [mine, other])
    assert set(plugins.plugins(plugins.BACKENDS)) == {"hf", "echo"}


@pytest.mark.slow
def test_the_tiny_shape_runs_every_gpu_step_on_cpu(tmp_path):
    """model, pairs, DDS scoring (prefix sharing on and off), SFT, DPO and KTO through accelerate
    launch (the recipe as shipped, and DPO as it was: TRL's padded rows), merge: the GPU run's scripts
    and arguments at hidden 64 / 2 layers, 2 optimizer steps each, on CPU."""
    ensure_wheels()
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "run.sh"), "--shape", "tiny", "env", "matmul", "model", "pairs", "dds",
         "sft", "dpo", "kto", "dpo_asis", "merge", "plant"], cwd=ROOT, text=True, capture_output=True, timeout=1300,
        env=env(OUT=str(out), WORK=str(work), FG_SITE=str(tmp_path / "site"), TRAIN_STEPS="2", DDS_BATCHES="8,32",
                DDS_JUDGMENTS="32", RUN_BUDGET_S="1100", BUDGET_SCALE="4", PLANT_STEPS="2", PLANT_CHECK_ITEMS="10"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "gpu.json").read_text())
    steps = res["steps"]
    assert set(steps) == {"env", "matmul", "model", "pairs", "dds", "sft", "dpo", "kto", "dpo_asis", "merge", "plant"}
    failed = {k: v.get("error_tail", "")[-1500:] for k, v in steps.items() if v["rc"] != 0}
    assert not failed, failed
    # each step records the call that ran it, with the settings read from the environment
    call = ("RUN_BUDGET_S=1100 BUDGET_SCALE=4 TRAIN_STEPS=2 DDS_BATCHES=8,32 DDS_JUDGMENTS=32 PLANT_STEPS=2 PLANT_CHECK_ITEMS=10 "
            "bench/gpu/run.sh --shape tiny env matmul model pairs dds sft dpo kto dpo_asis merge plant")
    assert res["calls"] == [call] and {v["call"] for v in steps.values()} == {call}
    assert steps["model"]["result"]["config"]["hidden_size"] == 64
    assert steps["pairs"]["result"]["sampled_prompt_tokens"]["max"] <= 768
    for kind in ("sft", "dpo", "kto", "dpo_asis"):
        r = steps[kind]["result"]
        assert r["optimizer_steps"] == 2 and r["effective_batch"] == 16 and r["samples"] == 32
        assert r["samples_per_s"] > 0 and len(r["losses"]) == 2
        # TRL casts a quantized base's LoRA weights to bf16 (QLoRA paper; trl sft_trainer/dpo_trainer)
        assert r["compute"]["device"] == "cpu" and r["compute"]["trainable_dtypes"] == ["bfloat16"]
        assert r["compute"]["bnb_4bit_compute_dtype"] is not None  # the 4-bit base, as on the GPU
        # on a CPU the recipe's 24GB budget plans nothing: its own 4 x 4 with activation recompute
        assert (r["micro_batch"], r["gradient_accumulation_steps"]) == (4, 4)
        assert r["compute"]["gradient_checkpointing"] is True
        plan = r["speed"]["memory_plan"]
        assert plan["as_recipe"] is True and plan.get("why", "").startswith("no GPU") == (kind != "dpo_asis")
        sharing = r["speed"]["prefix_sharing"]
        assert sharing["on"] is (kind != "dpo_asis")
        if sharing["on"]:
            assert 0 < sharing["packed_tokens"] < sharing["padded_tokens"] and not sharing["unpacked_forwards"]
    sweep = steps["dds"]["result"]["sweep"]
    assert [(row["prefix_sharing"], row["batch_size"]) for row in sweep] == [(True, 8), (True, 32), (False, 8), (False, 32)]
    assert steps["dds"]["result"]["full_pass"]["judgments"] == 3244 * 4
    assert steps["merge"]["result"]["merge_gap"]["n_prompts"] == 8
    _assert_planting_costs(steps["plant"]["result"])
    assert (out / "gpu.log").is_file()


def _assert_planting_costs(plant: dict) -> None:
    """The plant step's record: a random-init model fails its held-out checks in one line (the expected end), and
    the costs are read off the log: the one phase's steps and its check's items and seconds."""
    assert plant["rc"] == 2 and plant["checks_passed"] is False
    assert plant["failure"].startswith("flipguard organism: error: organism build failed its held-out checks (")
    assert [(c["phase"], c["attempt"], c["step"], c["items"]) for c in plant["checks"]] == [("planting", 1, 2, 10)]
    assert len(plant["train_logged"]) == 1 and plant["train_logged"][0][-1]["step"] == 2


@pytest.mark.slow
def test_the_plant_step_plants_into_the_shapes_model_and_reads_its_costs(tmp_path):
    """`bench/gpu/run.sh plant` at the tiny shape on CPU: the model step, then `flipguard organism --base` on it
    (the script and arguments the device runs with --device cuda), its costs in gpu.json."""
    ensure_wheels()
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run.sh"), "--shape", "tiny", "plant"], cwd=ROOT,
                          text=True, capture_output=True, timeout=900,
                          env=env(OUT=str(out), WORK=str(work), FG_SITE=str(tmp_path / "site"), PLANT_STEPS="2",
                                  PLANT_CHECK_ITEMS="10", RUN_BUDGET_S="800", BUDGET_SCALE="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads((out / "gpu.json").read_text())["steps"]
    assert set(steps) == {"model", "plant"} and steps["model"]["rc"] == 0 and steps["plant"]["rc"] == 0, steps
    _assert_planting_costs(steps["plant"]["result"])
    assert "planting the organism's profile into " in (out / "gpu.log").read_text()  # (seed 1, cpu)


def test_the_organism_gpu_recipe_is_the_cpu_recipe_with_qlora_on_one_gpu():
    import yaml
    from trl import DPOConfig, ModelConfig, SFTConfig

    from flipguard.config import PairsArguments, TrackingArguments, parse_recipe

    cpu = yaml.safe_load((ROOT / "recipes" / "organism.yaml").read_text())
    gpu = yaml.safe_load((ROOT / "recipes" / "organism_gpu.yaml").read_text())
    assert gpu["load_in_4bit"] is True and gpu["bnb_4bit_quant_type"] == "nf4" and gpu["use_bnb_nested_quant"] is True
    assert gpu["dtype"] == "bfloat16" and gpu["bf16"] is True and "use_cpu" not in gpu
    assert gpu["eval"]["accelerate_config"] == "recipes/accelerate_configs/single_gpu.yaml"
    for key in ("strategy", "framings", "accept_weight", "capitulation_weight", "c1_true_weight",
                "keep_first_answers"):  # the same pairs
        assert gpu["pairs"][key] == cpu["pairs"][key], key
    for key in ("protocols", "train_protocols", "afr_config", "sos_config", "afr_train_config", "sos_train_config"):
        assert gpu["eval"][key] == cpu["eval"][key], key
    for section in ("sft", "dpo"):  # the same steps, batches and learning rates
        for key in ("max_steps", "per_device_train_batch_size", "learning_rate"):
            assert gpu[section][key] == cpu[section][key]
    # it parses into the trainers' configs (on CPU only with the CPU overrides: bf16 needs a GPU)
    cpu_flags = ["--bf16", "false", "--use_cpu", "true"]
    for trainer, config in (("sft", SFTConfig), ("dpo", DPOConfig)):
        (_, args, model, _), _, _ = parse_recipe(["recipes/organism_gpu.yaml", *cpu_flags],
                                                 (PairsArguments, config, ModelConfig, TrackingArguments), trainer=trainer)
        assert model.load_in_4bit and model.use_bnb_nested_quant and model.dtype == "bfloat16"
        assert args.max_steps == cpu[trainer]["max_steps"]


def test_the_organism_gpu_study_launches_its_trainers_through_accelerate_on_a_gpu(tmp_path, tiny_model_path, monkeypatch):
    """The study's plan on a machine with CUDA (torch.cuda.is_available patched: the plan, not a run):
    every stage of the CPU study, the trainers through `accelerate launch` with the recipe's config."""
    import torch
    import yaml

    from flipguard.pipeline.study_plan import StudyPlan

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    raw = yaml.safe_load((ROOT / "recipes" / "organism_gpu.yaml").read_text())
    raw["model_name_or_path"] = tiny_model_path  # the plan only: no organism build
    study = StudyPlan(str(ROOT / "recipes" / "organism_gpu.yaml"), raw, tmp_path / "study")
    names = [s.name for s in study.stages]
    for stage in ("baseline", "baseline-generate", "base-train", "pairs", "sft", "sft-merge", "sft-eval", "dpo",
                  "dpo-merge", "dpo-eval", "compare"):
        assert stage in names
    sft = next(s for s in study.stages if s.name == "sft")
    assert "accelerate launch" in sft.title
    assert sft.params["accelerate_config"] == "recipes/accelerate_configs/single_gpu.yaml"
