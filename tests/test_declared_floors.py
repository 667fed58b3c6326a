"""Declared = tested: the lower bound pyproject.toml gives each package of the training and eval stack
is the version .ci/floors.txt pins, and .ci/run runs .ci/floors, which installs those pins in a
fresh environment and runs the training and eval tests there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the packages whose oldest accepted version CI installs (torch is installed as README's commands
# install it, torch==2.13.0, in every CI environment)
STACK = ("trl", "transformers", "peft", "accelerate", "datasets", "tokenizers", "safetensors", "bitsandbytes")


def declared() -> dict[str, str]:
    """name -> the version after `>=` of each of pyproject.toml's dependencies."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    out = {}
    for requirement in dependencies:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", requirement)
        if match:
            out[match[1].lower()] = match[2]
    return out


def pinned() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name.strip().lower()] = version.strip()
    return out


def test_every_floor_of_the_training_and_eval_stack_is_the_pin_ci_installs():
    floors = declared()
    assert set(STACK) <= set(floors), sorted(set(STACK) - set(floors))
    assert pinned() == {name: floors[name] for name in STACK}


def test_ci_installs_the_floors_and_runs_the_training_and_eval_tests():
    run, script = (ROOT / ".ci" / "run").read_text(), (ROOT / ".ci" / "floors").read_text()
    assert "bash .ci/floors" in run
    assert "-c .ci/floors.txt" in script and "torch==2.13.0" in script
    tests = set(re.findall(r"tests/test_\w+\.py", script))
    assert {"tests/test_train.py", "tests/test_train_speed.py", "tests/test_eval_dds.py"} <= tests
    assert all((ROOT / t).is_file() for t in tests)
