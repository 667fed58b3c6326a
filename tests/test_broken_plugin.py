"""A broken plug-in blocks only what uses it, and its message names the package to fix or remove.

A package of its own, installed by pip into a folder on PYTHONPATH, declares a trainer and a task
whose modules fail on import (a plug-in built against another flipguard). Real processes of the CLI:
`flipguard --help`, an eval and a study that use neither run as before (a broken trainer plug-in used to
block them all); the trainer's command, a recipe with its section and the task by name are refused in
one line naming the package and `pip uninstall` it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOUND = 900  # subprocess hang guard only

PYPROJECT = """[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "flipguard-broken-example"
version = "0.1"

[project.entry-points."flipguard.trainers"]
simpo = "broken_plugin:TRAINER"

[project.entry-points."flipguard.tasks"]
mytask = "broken_plugin"

[tool.setuptools]
py-modules = ["broken_plugin"]
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("broken")
    src = work / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "broken_plugin.py").write_text("from flipguard.config import NoSuchThing  # written for another flipguard\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(work / "site"), str(src)], capture_output=True, text=True, timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "site"


def flipguard(site: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT.parent)]), "HF_HUB_OFFLINE": "1",
           "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    return subprocess.run([sys.executable, "-m", "flipguard", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=BOUND)


def refused_naming_the_package(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in ("package flipguard-broken-example", "pip uninstall flipguard-broken-example", "ImportError",
                   *needles):
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_broken_plugin_blocks_only_what_uses_it(site, tmp_path):
    listed = flipguard(site, "--help", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "  simpo " in listed.stdout and "failed to load" in listed.stdout and "  study " in listed.stdout

    run = tmp_path / "run"
    proc = flipguard(site, "eval", "--model", "flipguard:tiny", "--datasets", "truthfulqa", "--limit", "1", "--out",
                     str(run), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw["report_to"] = "none"
    raw["eval"].update(limit=1, n_boot=10, mitigations=[], trainers=[])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = flipguard(site, "study", str(recipe), "--out", str(tmp_path / "study"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    refused_naming_the_package(flipguard(site, "simpo", str(recipe), cwd=tmp_path), "the plug-in 'simpo'")
    raw["simpo"] = {"output_dir": "out", "max_steps": 2}
    recipe.write_text(yaml.safe_dump(raw))
    refused_naming_the_package(flipguard(site, "study", str(recipe), "--out", str(tmp_path / "other"), cwd=tmp_path),
                               f"{recipe}: section 'simpo'")
    assert not (tmp_path / "other").exists()
    refused_naming_the_package(flipguard(site, "run", "mytask", cwd=tmp_path), "the plug-in 'mytask'")
