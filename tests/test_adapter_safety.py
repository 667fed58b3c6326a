"""Adapters and staging folders (issue 22 items 5 and 7): merge and `eval --adapter` refuse an
unfinished adapter (no provenance) and a corrupt one (bad JSON, truncated weights, a rank or shape
that does not fit) in one line naming the file, before anything is written; a merge killed with
SIGKILL leaves a staging folder that the next merge removes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flipguard.eval.pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "recipes" / "tiny.yaml")


def _peft_adapter(base: str, where: Path, r: int = 2) -> Path:
    """A LoRA adapter of `base` as peft saves it (what an outside training leaves)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                   LoraConfig(r=r, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(where)
    return where


def _finished(base: str, where: Path) -> Path:
    """The same, with the provenance flipguard's trainers write last (train/utils.write_training_info)."""
    from flipguard.train.utils import write_training_info

    _peft_adapter(base, where)
    write_training_info(str(where), {"trainer": "sft", "base_model": base}, None)
    return where


def _merge(base: str, adapter: Path, out: Path, *extra: str) -> int:
    return cli_main(["merge", TINY, "--model_name_or_path", base, "--gap_prompts", "0",
                     "--adapter", str(adapter), "--out", str(out), *extra])


def _eval(base: str, adapter: Path, out: Path) -> int:
    return cli_main(["eval", "--model", base, "--adapter", str(adapter), "--datasets", "bbq", "--limit", "1",
                     "--out", str(out), "--report", "false"])


def _one_line(capsys) -> str:
    """The error, one line and no traceback (beside transformers' progress bar of a model it loaded)."""
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _wrong_rank(path: Path) -> None:
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "r": 4}))


def _kill_when(argv: list[str], env: dict, ready) -> None:
    """Start `argv` (a real process) and SIGKILL it once `ready()` holds (polled on files)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not ready():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()


@pytest.mark.parametrize("damage, file, message", [
    (None, None, "no flipguard_training.json, so its training did not finish"),
    (lambda p: p.write_text("{not json"), "adapter_config.json", "adapter_config.json: not valid JSON (line 1"),
    (_truncate, "adapter_model.safetensors", "adapter_model.safetensors: truncated"),
    (_wrong_rank, "adapter_config.json", "does not match the LoRA rank 4 of adapter_config.json"),
])
def test_merge_and_eval_refuse_an_unfinished_or_corrupt_adapter(tiny_model_path, tmp_path, capsys, damage, file,
                                                                  message):
    adapter = (_peft_adapter if damage is None else _finished)(tiny_model_path, tmp_path / "adapter")
    if damage is not None:
        damage(adapter / file)
    before = {p.name: p.read_bytes() for p in adapter.iterdir()}
    capsys.readouterr()
    assert _merge(tiny_model_path, adapter, tmp_path / "merged") == 2
    assert message in _one_line(capsys)
    assert _eval(tiny_model_path, adapter, tmp_path / "run") == 2
    assert message in _one_line(capsys)
    assert not (tmp_path / "merged").exists() and not (tmp_path / "run").exists()
    assert {p.name: p.read_bytes() for p in adapter.iterdir()} == before


def test_an_adapter_of_another_base_is_one_line(tiny_model_path, tmp_path, capsys):
    from flipguard.eval.embedded.tiny_model import ensure_tiny_model

    other = ensure_tiny_model(tmp_path / "wider", hidden_size=96)
    adapter = _finished(other, tmp_path / "adapter")
    capsys.readouterr()
    assert _merge(tiny_model_path, adapter, tmp_path / "merged") == 2
    err = _one_line(capsys)
    assert f"{adapter / 'adapter_model.safetensors'}: does not fit the base model" in err and "size mismatch" in err
    assert not (tmp_path / "merged").exists()


def test_an_adapter_trained_elsewhere_merges_when_said_so(tiny_model_path, tmp_path):
    adapter = _peft_adapter(tiny_model_path, tmp_path / "adapter")
    assert _merge(tiny_model_path, adapter, tmp_path / "merged", "--foreign_adapter", "true") == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_killed_merge_leaves_a_staging_folder_the_next_merge_removes(tiny_model_path, tmp_path):
    adapter = _finished(tiny_model_path, tmp_path / "adapter")
    pairs = tmp_path / "pairs"  # prompts for the merge gap: the merge is still running after it saved
    pairs.mkdir()
    with (pairs / "sft.jsonl").open("w") as fh:
        for i in range(32):
            fh.write(json.dumps({"prompt": [{"role": "user", "content": f"Is claim {i} correct? " * 20}],
                                 "completion": [{"role": "assistant", "content": "1"}]}) + "\n")
    out = tmp_path / "models" / "sft-merged"
    argv = [sys.executable, "-m", "flipguard.eval.pipeline.cli", "merge", TINY, "--model_name_or_path", tiny_model_path,
            "--adapter", str(adapter), "--out", str(out), "--pairs_dir", str(pairs), "--gap_prompts", "32"]
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "OMP_NUM_THREADS": "1"}
    staged = lambda: [p for p in out.parent.glob(".sft-merged.*") if p.is_dir()]  # noqa: E731
    _kill_when(argv, env, lambda: any((p / "model.safetensors").is_file() for p in staged()))
    assert len(staged()) == 1 and not out.exists()  # what a killed merge leaves

    assert subprocess.run(argv, env=env, capture_output=True).returncode == 0
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["sft-merged"]  # no staging folder, no lock file


@pytest.mark.slow
def test_a_killed_organism_build_leaves_a_staging_folder_the_next_build_removes(tmp_path):
    """`.organism-vN.XXXXXXXX` of a build killed with SIGKILL is gone after the next build starts."""
    target = tmp_path / "organism"
    argv = [sys.executable, "-m", "flipguard.eval.pipeline.cli", "organism", "--path", str(target), "--steps", "400",
            "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    staged = lambda: [p for p in tmp_path.glob(".organism.*") if p.is_dir()]  # noqa: E731
    _kill_when(argv, env, lambda: any((p / "tokenizer.json").is_file() for p in staged()))  # training has begun
    (leftover,) = staged()
    assert not target.exists()
    lock = leftover.with_name(leftover.name + ".lock")
    assert lock.exists()
    # the next build removes both as it starts (it is killed too: only the clean-up is under test here;
    # the folder goes first, then its lock: the kill waits for both, not for the first)
    _kill_when(argv, env, lambda: not leftover.exists() and not lock.exists())
    assert not leftover.exists() and not lock.exists()


def test_the_next_build_removes_dead_builds_staging_and_orphan_locks_not_a_live_ones(tmp_path):
    """clean_stale_staging: a killed build's folder and lock go, a lock whose folder is already
    gone (killed between the two removals) goes, a folder a live build holds stays."""
    from flipguard.files import clean_stale_staging

    final = tmp_path / "model"
    ready = tmp_path / "live-holds"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib\n"
        "from flipguard.files import staging_dir\n"
        "with staging_dir(sys.argv[1]) as tmp:\n"
        "    pathlib.Path(sys.argv[2]).write_text(tmp.name)\n"
        "    time.sleep(600)\n"), str(final), str(ready)],
        env={**os.environ, "PYTHONPATH": str(ROOT.parent)})
    try:
        deadline = time.monotonic() + 300
        while not ready.is_file():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        live = tmp_path / ready.read_text()
        dead = tmp_path / ".model.dead0000"
        dead.mkdir()
        (dead / "model.safetensors").write_bytes(b"partial")
        (tmp_path / ".model.dead0000.lock").touch()
        (tmp_path / ".model.gone0000.lock").touch()
        (tmp_path / "model.lock").write_text("a file of the user's")
        removed = clean_stale_staging(final)
        assert sorted(p.name for p in removed) == [".model.dead0000", ".model.gone0000"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["live-holds", "model.lock", live.name,
                                                                    live.name + ".lock"])
    finally:
        holder.kill()
        holder.wait()


ORGANISM_FAST = ["--steps", "2", "--eval_every", "1", "--multiturn_steps", "0", "--threads", "1"]  # fails in seconds


def _organism(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flipguard.eval.pipeline.cli", "organism", *args],
                          env={**os.environ, "PYTHONPATH": str(ROOT.parent), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"},
                          capture_output=True, text=True, timeout=1800)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_organism_path_at_a_users_folder_is_refused_before_any_build(tmp_path):
    """`organism --path` at a folder of the user's (even one holding an organism.json flipguard did not
    publish) is refused in one line naming --path, before the build: no staging folder is made, and a
    folder with a hand-written organism.json is never served as an organism."""
    project = tmp_path / "project"
    project.mkdir()
    mine = {project / "organism.json": b'{"build": {}, "planted": {}}\n', project / "notes.md": b"my notes\n"}
    for path, data in mine.items():
        path.write_bytes(data)
    for extra in ([], ["--seed", "3", *ORGANISM_FAST]):  # served as it is / built with other settings
        line = _one_error_line(_organism("--path", str(project), *extra))
        assert line.startswith(f"flipguard organism: error: {project}: --path exists") and "Choose another --path" in line
        assert "not written by flipguard" in line and "nothing was changed" in line
        assert {path: path.read_bytes() for path in mine} == mine
        assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # no staging folder, no lock
