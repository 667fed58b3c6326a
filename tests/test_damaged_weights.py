"""A damaged weights file is one line naming it, in every command that loads a model.

A copy of the tiny model whose model.safetensors is empty, random bytes, or cut short (a copy that
stopped midway), given to eval, the trainers, merge, a study and `organism --base`, each run by the
real CLI in a process of its own: exit 2, one line naming the file, no traceback (it was 34 lines
from `organism --base`, 42 from eval), nothing written where the command would write.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOUND = 900  # seconds: a hang guard only


def _env() -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore::FutureWarning"}  # transformers' deprecation notes about the recipe's keys
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _damage(weights: Path, how: str) -> None:
    data = weights.read_bytes()
    weights.write_bytes({"empty": b"", "random": os.urandom(len(data) // 3), "cut short": data[: len(data) // 2]}[how])


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_path) -> Path:
    """A finished adapter of the tiny model (for merge), trained by the real CLI."""
    folder = tmp_path_factory.mktemp("adapter")
    study = folder / "study"
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw.pop("sft")
    raw.pop("kto")
    raw["report_to"] = "none"
    raw["pairs"]["datasets"] = "bbq"
    raw["dpo"]["max_steps"] = 1
    raw["eval"].update(limit=1, n_boot=10, mitigations=[])
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", "study", str(recipe), "--out", str(study)],
                          env=_env(), capture_output=True, text=True, timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return study / "train" / "dpo"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["empty", "random", "cut short"])
def test_a_damaged_weights_file_is_one_line_naming_it_in_every_command(tmp_path, tiny_model_path, adapter, how):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    weights = model / "model.safetensors"
    _damage(weights, how)
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw["model_name_or_path"] = str(model)
    raw["report_to"] = "none"
    raw["pairs"]["datasets"] = "bbq"
    raw["eval"].update(limit=1, n_boot=10, mitigations=[])
    raw["dpo"]["output_dir"] = str(tmp_path / "dpo-out")
    raw["pairs"]["dir"] = str(adapter.parent.parent / "pairs")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    outs = {"eval": tmp_path / "run", "dpo": tmp_path / "dpo-out", "merge": tmp_path / "merged",
            "study": tmp_path / "study", "organism": tmp_path / "organism"}
    commands = {
        "eval": ["eval", "--model", str(model), "--datasets", "truthfulqa", "--limit", "1", "--out", str(outs["eval"])],
        "dpo": ["dpo", str(recipe)],
        "merge": ["merge", str(recipe), "--adapter", str(adapter), "--out", str(outs["merge"])],
        "study": ["study", str(recipe), "--out", str(outs["study"])],
        "organism": ["organism", "--base", str(model), "--path", str(outs["organism"])],
    }
    if how != "cut short":  # each kind of damage through eval; every command with the likeliest (a copy cut short)
        commands = {name: argv for name, argv in commands.items() if name == "eval"}
    for name, argv in commands.items():
        proc = subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *argv], env=_env(), capture_output=True,
                              text=True, timeout=BOUND)
        assert proc.returncode == 2, (name, proc.stdout[-2000:], proc.stderr[-3000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
        assert lines[0].startswith(f"flipguard {name}: error: {weights}: "), (name, lines[0])
        assert "damaged: copy or download them again" in lines[0]
        assert not outs[name].exists(), name
