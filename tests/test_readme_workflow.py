"""The README's workflow block runs top to bottom on the embedded tiny model: each line, in order,
in a scratch folder, exits 0, finds the run folders it reads already written by an earlier line,
and writes its own. Only the substitutions below change the lines, so the block cannot drift into
commands that do not run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What a CPU runs instead of the README's placeholders and GPU-sized settings, and nothing else:
# the model (MODEL is a hub name or folder there), the training recipe (qwen7b needs a GPU; tiny
# trains the same LoRA path in seconds), and an item limit for the commands that evaluate.
SUBSTITUTIONS = {r"\bMODEL\b": "flipguard:tiny", r"\bqwen7b\b": "tiny"}
EXTRA_FLAGS = {"eval": ["--limit", "2"], "afr": ["--limit", "2"]}


def workflow_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Workflow\n", 1)[1]
    block = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1)
    lines = [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line]


def substituted(line: str) -> list[str]:
    for pattern, value in SUBSTITUTIONS.items():
        line = re.sub(pattern, value, line)
    argv = shlex.split(line)
    return argv + EXTRA_FLAGS.get(argv[1], [])


def _paths(argv: list[str]) -> tuple[str | None, list[str]]:
    """(what the line writes: its --out, what it reads: every other runs/ path it names)."""
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    reads = []
    for i, token in enumerate(argv):
        value = token.split("=", 1)[1] if "=" in token else token
        if value.startswith("runs/") and not (i and argv[i - 1] == "--out"):
            reads.append(value)
    return out, reads


def test_the_block_is_what_the_test_substitutes():
    lines = workflow_lines()
    assert len(lines) >= 8 and all(line.startswith("flipguard ") for line in lines), lines
    assert any("MODEL" in line for line in lines) and any("qwen7b" in line for line in lines)
    # every run folder a line reads is written by an earlier line of the block
    written: set[str] = set()
    for line in lines:
        out, reads = _paths(shlex.split(line))
        missing = [r for r in reads if r not in written]
        assert not missing, f"{line!r} reads {missing}, which no earlier line writes"
        if out:
            written.add(out)


@pytest.mark.slow
def test_the_readme_workflow_runs_on_the_tiny_model(tmp_path, tiny_model_path):
    from flipguard.eval.embedded.tiny_model import TINY_MODEL_VERSION

    home = tmp_path / "home"
    home.mkdir()
    (home / f"tiny-chat-{TINY_MODEL_VERSION}").symlink_to(Path(tiny_model_path))
    work = tmp_path / "work"  # no recipes/ here: the recipes resolve by name from the package
    work.mkdir()
    env = {**os.environ, "FLIPGUARD_HOME": str(home), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("FLIPGUARD_DATA", None)  # the shipped samples
    for line in workflow_lines():
        argv = substituted(line)
        out, reads = _paths(argv)
        for path in reads:
            assert (work / path).exists(), f"{line!r}: {path} does not exist before it runs"
        done = subprocess.run([sys.executable, "-m", "flipguard", *argv[1:]], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if out:
            written = work / out
            assert written.exists() and (written.is_file() or any(written.iterdir())), f"{line!r} wrote nothing to {out}"
    assert (work / "runs/m/compare/comparison.csv").is_file()
