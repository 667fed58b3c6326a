"""bench/training_speed.py compares the same work on both sides, or refuses and says why.

Two checkouts whose own recipes train different schedules (the base's recipe: other max_steps) are
run by the real bench, in processes of its own, on the tiny model's pairs: both read the one --recipe,
so both train its schedule, and the report says which. A pair of runs whose schedules differ (what a
checkout that reads the recipe otherwise would give) is refused in one line, nothing written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOUND = 1800  # subprocess hang guard only


def _bench():
    spec = importlib.util.spec_from_file_location("training_speed", ROOT / "bench" / "training_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env() -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore::FutureWarning"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _cli(*argv: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *argv], env=_env(), capture_output=True,
                          text=True, timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_both_sides_train_the_one_recipe_and_differing_work_is_refused(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw["dpo"]["max_steps"] = 3
    recipe.write_text(yaml.safe_dump(raw))
    records, pairs = tmp_path / "records", tmp_path / "pairs"
    _cli("eval", "--model", "flipguard:tiny", "--datasets", "bbq", "--split", "train", "--limit", "4", "--out",
         str(records), "--no_report")
    _cli("pairs", str(recipe), "--records", str(records), "--datasets", "bbq", "--out", str(pairs))

    # the base checkout: this tree, whose own organism and tiny recipes train another schedule
    base = tmp_path / "base-checkout"
    shutil.copytree(ROOT, base, ignore=shutil.ignore_patterns(".git", "__pycache__", "runs", "*.egg-info", "build"))
    for name in ("organism.yaml", "tiny.yaml"):
        own = yaml.safe_load((base / "recipes" / name).read_text())
        own["dpo"]["max_steps"] = 7
        (base / "recipes" / name).write_text(yaml.safe_dump(own))
    out = tmp_path / "speed"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "training_speed.py"), "--base", str(base), "--pairs",
                           str(pairs), "--recipe", str(recipe), "--stages", "dpo", "--rounds", "1", "--work",
                           str(tmp_path / "work"), "--out", str(out)], env=_env(), capture_output=True, text=True,
                          timeout=BOUND, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["recipe"] == str(recipe)
    assert {r["side"]: r["schedule"]["steps"] for r in result["runs"]} == {"base": 3, "new": 3}  # the recipe's, not 7
    assert f"trained from {recipe}" in out.with_suffix(".md").read_text()
    assert "| dpo | 3 steps, " in out.with_suffix(".md").read_text()

    # runs that did other work (the base's own 7 steps): refused, naming the stage and what differs
    runs = result["runs"]
    runs[0]["schedule"] = {**runs[0]["schedule"], "steps": 7, "max_steps": 7}
    with pytest.raises(SystemExit) as refused:
        _bench().summarize(runs)
    line = str(refused.value)
    assert len(line.splitlines()) == 1 and line.startswith("dpo: the two checkouts did not do the same work (")
    assert "max_steps 7" in line and "max_steps 3" in line and "nothing was written" in line
