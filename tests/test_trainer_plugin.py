"""A trainer is a plug-in: examples/orpo_trainer (ORPO, TRL's trl.experimental.orpo) installed with
pip from a package of its own, found by its `flipguard.trainers` entry point and run by name in a
real `flipguard study` on recipes/tiny.yaml; no file of flipguard names it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from flipguard.config import trainers

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "orpo_trainer"
BOUND = 1800  # subprocess hang guard only


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example installed by pip into a folder of its own (a copy of it built there: the source
    tree stays clean), as `pip install ./examples/orpo_trainer` installs it beside flipguard."""
    work = tmp_path_factory.mktemp("orpo")
    shutil.copytree(EXAMPLE, work / "src")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(work / "site"), str(work / "src")], capture_output=True, text=True,
                          timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work / "site" / "flipguard_orpo.py").is_file()
    return work / "site"


def flipguard(site: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    return subprocess.run([sys.executable, "-m", "flipguard", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=BOUND)


def test_flipguard_itself_knows_no_orpo():
    assert "orpo" not in trainers()  # this process has not the plug-in on its path
    package = [ROOT / "pyproject.toml", *(p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in
                                          ("tests", "examples", "bench", "docs", "build"))]
    assert [str(p) for p in package if "flipguard_orpo" in p.read_text(encoding="utf-8")] == []


def test_the_installed_plugin_is_a_command_and_its_help_lists_its_section(site, tmp_path):
    listed = flipguard(site, "--help", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "  orpo " in listed.stdout and "a plug-in: examples/orpo_trainer" in listed.stdout
    own = flipguard(site, "orpo", "--help", cwd=tmp_path)
    assert own.returncode == 0, own.stderr[-2000:]
    assert own.stdout.startswith("usage: flipguard orpo") and "in the ORPO loss" in own.stdout  # ORPOConfig's beta


@pytest.mark.slow
def test_a_study_trains_merges_and_measures_the_plugin_trainer_by_name(site, tmp_path):
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    for own in ("sft", "dpo", "kto"):
        raw.pop(own)
    raw["report_to"] = "none"
    raw["eval"].update(limit=2, n_boot=50, mitigations=[])
    raw["pairs"]["datasets"] = "bbq"
    raw["orpo"] = {"output_dir": "runs/tiny/orpo", "beta": 0.1, "max_steps": 2, "per_device_train_batch_size": 2,
                   "learning_rate": 1.0e-2, "lr_scheduler_type": "constant", "max_length": 2048}
    recipe, out = tmp_path / "orpo.yaml", tmp_path / "study"
    recipe.write_text(yaml.safe_dump(raw))

    proc = flipguard(site, "study", str(recipe), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    state = json.loads((out / "study.json").read_text())
    assert state["order"] == ["baseline", "base-train", "pairs", "orpo", "orpo-merge", "orpo-eval", "compare"]
    assert {s["status"] for s in state["stages"].values()} == {"done"}
    provenance = json.loads((out / "train" / "orpo" / "flipguard_training.json").read_text())
    assert provenance["trainer"] == "orpo" and provenance["pairs_rows"] >= 1
    assert provenance["pairs_tokenized_by"] == "trl"  # it declares no token columns: TRL tokenizes
    # ORPO scores full logits, not through TRL's fused LM head: prefix sharing is recorded off, and why
    sharing = provenance["speed"]["prefix_sharing"]
    assert sharing["on"] is False and sharing["why"].startswith("the model has no TRL fused LM head")
    losses = [h["loss"] for h in provenance["log_history"] if "loss" in h]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert json.loads((out / "dds" / "orpo-eval" / "run.json").read_text())["model"] == str(out / "models" / "orpo-merged")
    table = pd.read_csv(out / "compare" / "comparison.csv")
    assert list(dict.fromkeys(table["condition"])) == ["Baseline", "ORPO"]
