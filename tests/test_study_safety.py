"""A study is the only writer of its folder and removes only what it wrote:
- a second `flipguard study` started (a real process) while the first one trains is refused at
  once in one line naming the holder, and changes nothing;
- a stage folder that study.json does not record as the study's own (an earlier `flipguard eval`
  run with the user's notes in it, or the user's files where a late stage writes) is refused
  before the first stage runs, and nothing of it is removed."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flipguard.pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent


def _recipe(tmp_path: Path, **eval_plan) -> Path:
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw["report_to"] = "none"
    raw["eval"].update(limit=2, n_boot=50, mitigations=[], trainers=["sft"], **eval_plan)
    raw["pairs"]["datasets"] = "bbq"
    raw["sft"]["max_steps"] = 2
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _study(recipe: Path, out: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "flipguard.pipeline.cli", "study", str(recipe), "--out", str(out)],
                            env=env, text=True, **popen)


@pytest.mark.slow
def test_a_second_study_is_refused_while_the_first_trains(tmp_path):
    raw = yaml.safe_load(_recipe(tmp_path).read_text())
    raw["sft"]["max_steps"] = 400  # long enough to be caught training
    recipe, out = tmp_path / "long.yaml", tmp_path / "study"
    recipe.write_text(yaml.safe_dump(raw))
    first = _study(recipe, out, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while ((json.loads((out / "study.json").read_text())["stages"].get("sft") or {}).get("status") != "running"
               if (out / "study.json").is_file() else True):
            assert first.poll() is None and time.monotonic() < deadline, "the first study ended before training"
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGSTOP)  # frozen mid-training: it holds the study folder throughout
        assert first.poll() is None
        before = _tree(out)
        second = _study(recipe, out, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = second.communicate(timeout=600)
        assert second.returncode == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "another flipguard process is writing" in lines[0]
        assert f"pid {first.pid}" in lines[0] and "study" in lines[0]
        assert "Traceback" not in stderr and "--- " not in stdout  # refused before reading any stage
        assert _tree(out) == before  # study.json, the adapter folder, everything: untouched
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # the kernel dropped the killed holder's lock: the folder is free again
    with open(out / ".lock", "r+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_an_earlier_eval_run_in_a_stage_folder_is_kept(tmp_path, capsys):
    """`flipguard eval` wrote OUT/dds/baseline (run.json, records) and the user added NOTES.md:
    not the study's own output, so the study must not delete it as stale."""
    recipe, out = _recipe(tmp_path), tmp_path / "study"
    earlier = out / "dds" / "baseline"
    assert cli_main(["eval", "--model", "flipguard:tiny", "--datasets", "bbq", "--limit", "1",
                     "--out", str(earlier), "--report", "false"]) == 0
    (earlier / "NOTES.md").write_text("what I saw in this run")
    before = _tree(out)
    capsys.readouterr()
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{earlier} exists and was not written by this study (an earlier flipguard run" in err
    assert "move it away or use another --out" in err
    assert _tree(out) == before  # nothing removed, nothing added (no study.json, no recipe.yaml)


def test_foreign_files_where_a_late_stage_writes_are_refused_before_the_first_stage(tmp_path, capsys):
    """--out holding the user's files where `compare` would write: refused up front, not after
    every earlier stage ran."""
    recipe, out = _recipe(tmp_path), tmp_path / "study"
    mine = out / "compare" / "draft.md"
    mine.parent.mkdir(parents=True)
    mine.write_text("my draft")
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "stage compare:" in err and "not flipguard's" in err
    assert _tree(out) == {"compare/draft.md": b"my draft"}


@pytest.mark.parametrize("section, key, value, message", [
    ("sft", "learning_rate", -0.0001, "key 'sft.learning_rate' must be > 0, got -0.0001; nothing was run"),
    (None, "lora_r", 0, "key 'lora_r' must be between 1 and 65,536, got 0; nothing was run"),
    (None, "lora_dropout", 2.0, "key 'lora_dropout' must be in [0, 1), got 2.0; nothing was run"),
    ("eval", "limit", -3, "key 'eval.limit' must be >= 1, got -3; nothing was run"),
    ("eval", "datasets", "", "key 'eval.datasets' must be a non-empty list of datasets, got ''; nothing was run"),
    ("dpo", "max_steps", -5, "key 'dpo.max_steps' must be -1 (train by epochs) or between 1 and 1,000,000,000, "
                             "got -5; nothing was run"),
])
def test_bad_recipe_values_are_refused_before_the_first_stage(tmp_path, capsys, section, key, value, message):
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    (raw[section] if section else raw)[key] = value
    recipe, out = tmp_path / "bad.yaml", tmp_path / "study"
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False))
    lines = recipe.read_text().splitlines()
    start = lines.index(f"{section}:") if section else 0
    line = next(i for i, text in enumerate(lines[start:], start + 1)
                if text.startswith(f"  {key}:" if section else f"{key}:"))
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flipguard study: error: {recipe}:{line}: {message}"
    assert not out.exists()


def test_an_empty_recipe_is_refused(tmp_path, capsys):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text("# nothing yet\n")
    assert cli_main(["study", str(recipe), "--out", str(tmp_path / "s")]) == 2
    assert f"{recipe}: the recipe is empty" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("command", ["sft", "dpo", "merge"])
def test_standalone_trainers_and_merge_check_the_same_values(tmp_path, capsys, command):
    """A flag overriding a good recipe with a bad value: the same rule, one line, before any model loads."""
    extra = ["--adapter", str(tmp_path / "a"), "--out", str(tmp_path / "m")] if command == "merge" else []
    assert cli_main([command, str(ROOT / "recipes" / "tiny.yaml"), "--lora_dropout", "1.5", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith("option --lora_dropout must be in [0, 1), got 1.5; nothing was run")
