"""Adapters and staging folders: merge and `eval --adapter` refuse an
unfinished adapter (no provenance) and a corrupt one (bad JSON, truncated weights, a rank or shape
that does not fit) in one line naming the file, before anything is written; a merge killed with
SIGKILL leaves a staging folder that the next merge removes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flipguard.pipeline.cli import main as cli_main

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
    """The same as flipguard's trainers leave it (train/utils.adapter_saved, as tests/test_vllm_real.py's adapter
    is made): peft's files (its README card among them) recorded with their hashes right after the save, then
    the model card and the provenance written last."""
    from flipguard.train.utils import adapter_saved

    with adapter_saved(str(where), {"trainer": "sft", "base_model": base}, None):
        _peft_adapter(base, where)
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
    argv = [sys.executable, "-m", "flipguard.pipeline.cli", "merge", TINY, "--model_name_or_path", tiny_model_path,
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
    argv = [sys.executable, "-m", "flipguard.pipeline.cli", "organism", "--path", str(target), "--steps", "400",
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


HOLD_STAGING = (
    "import sys, time, pathlib\n"
    "from flipguard.files import staging_dir\n"
    "with staging_dir(sys.argv[1]) as tmp:\n"
    "    (tmp / 'model.safetensors').write_bytes(b'partial')\n"
    "    pathlib.Path(sys.argv[2]).write_text(tmp.name)\n"
    "    time.sleep(600)\n")


def _hold_staging(final: Path, ready: Path) -> tuple[subprocess.Popen, Path]:
    """A real process building `final` in a staging folder (files.staging_dir), held open."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_STAGING, str(final), str(ready)],
                              env={**os.environ, "PYTHONPATH": str(ROOT.parent)})
    deadline = time.monotonic() + 300
    while not ready.is_file():
        assert holder.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return holder, final.parent / ready.read_text()


def test_the_next_build_removes_only_staging_it_can_prove_dead_and_flipguards(tmp_path):
    """clean_stale_staging, by proof and never by name: a SIGKILLed build's folder and lock go, and so
    does a lock whose folder is already gone (killed between the two removals); a live build's
    folder stays; a folder or lock of the user's named exactly like one (`.model.20250101`) stays,
    byte for byte, as does one marked for another output."""
    from flipguard.files import clean_stale_staging

    final = tmp_path / "model"
    # three builds at once (a build's start removes dead ones: none is dead yet), then two are killed
    live, live_dir = _hold_staging(final, tmp_path / "live-holds")
    try:
        dead, dead_dir = _hold_staging(final, tmp_path / "dead-holds")
        gone, gone_dir = _hold_staging(final, tmp_path / "gone-holds")
        other, other_dir = _hold_staging(tmp_path / "other", tmp_path / "other-holds")  # another output's
        for proc in (dead, gone, other):
            proc.kill()
            proc.wait()
        shutil.rmtree(gone_dir)  # as if the killed build had got as far as removing its folder
        users = {tmp_path / ".model.20250101" / "x": b"the user's", tmp_path / ".model.20250101.lock": b"mine",
                 tmp_path / ".model.abcdefgh.lock": b'{"written_by": "flipguard", "folder": ".model.abcdefgh"}',
                 tmp_path / ".model.abcdefgh" / "weights.bin": b"not a staging folder", tmp_path / "model.lock": b"mine"}
        for path, data in users.items():
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(data)
        removed = clean_stale_staging(final)
        assert sorted(removed) == sorted([dead_dir, gone_dir])
        assert not dead_dir.exists() and not gone_dir.exists()
        assert not Path(f"{dead_dir}.lock").exists() and not Path(f"{gone_dir}.lock").exists()
        assert (live_dir / "model.safetensors").is_file() and Path(f"{live_dir}.lock").is_file()
        assert other_dir.is_dir()  # not `model`'s: its own output's next build removes it
        assert {path: path.read_bytes() for path in users} == users
        assert clean_stale_staging(tmp_path / "other") == [other_dir] and not other_dir.exists()
    finally:
        live.kill()
        live.wait()


@pytest.mark.slow
def test_a_merge_keeps_a_users_folder_named_like_its_staging_folder(tiny_model_path, tmp_path):
    """`/tmp/m/.merged.20250101` (the user's, named like a staging folder of --out /tmp/m/merged)
    is not one: the merge's clean-up of killed builds removes only its own, so a real merge leaves it whole."""
    adapter = _finished(tiny_model_path, tmp_path / "adapter")
    work = tmp_path / "m"
    mine = {work / ".merged.20250101" / "x": b"b\n", work / ".merged.20250101.lock": b"my lock file\n",
            work / ".merged.abcdefgh" / "model.safetensors": b"my weights"}
    for path, data in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    proc = subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", "merge", TINY, "--model_name_or_path",
                           tiny_model_path, "--gap_prompts", "0", "--adapter", str(adapter), "--out", str(work / "merged")],
                          env={**os.environ, "PYTHONPATH": str(ROOT.parent), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {path: path.read_bytes() for path in mine} == mine
    assert sorted(p.name for p in work.iterdir()) == [".merged.20250101", ".merged.20250101.lock", ".merged.abcdefgh",
                                                      "merged"]


ORGANISM_FAST = ["--steps", "2", "--eval_every", "1", "--multiturn_steps", "0", "--threads", "1"]  # fails in seconds


def _organism(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", "organism", *args],
                          env={**os.environ, "PYTHONPATH": str(ROOT.parent), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"},
                          capture_output=True, text=True, timeout=1800)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_an_organism_build_keeps_a_users_folder_named_like_its_staging_folder(tmp_path):
    """`mkdir -p /tmp/m/.myorg.20250101 && echo b > /tmp/m/.myorg.20250101/x && flipguard organism
    --path /tmp/m/myorg ...` must not delete the user's folder: a real build (one that fails its checks
    in seconds, after its staging clean-up) leaves it, and the lookalike lock, whole."""
    work = tmp_path / "m"
    mine = {work / ".myorg.20250101" / "x": b"b\n", work / ".myorg.20250101.lock": b"b\n"}
    for path, data in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    line = _one_error_line(_organism("--path", str(work / "myorg"), *ORGANISM_FAST))
    assert "organism build failed its held-out checks" in line  # it ran: the clean-up came first
    assert {path: path.read_bytes() for path in mine} == mine
    assert sorted(p.name for p in work.iterdir()) == [".myorg.20250101", ".myorg.20250101.lock"]


def test_organism_path_at_a_users_folder_is_refused_before_any_build(tmp_path):
    """`organism --path` at a folder of the user's (even one holding an organism.json flipguard did not
    publish) is refused in one line naming --out, before the build: no staging folder is made, and a
    folder with a hand-written organism.json is never served as an organism."""
    project = tmp_path / "project"
    project.mkdir()
    mine = {project / "organism.json": b'{"build": {}, "planted": {}}\n', project / "notes.md": b"my notes\n"}
    for path, data in mine.items():
        path.write_bytes(data)
    for extra in ([], ["--seed", "3", *ORGANISM_FAST]):  # served as it is / built with other settings
        line = _one_error_line(_organism("--path", str(project), *extra))
        assert line.startswith(f"flipguard organism: error: {project}: --out exists") and "Choose another --out" in line
        assert "not written by flipguard" in line and "nothing was changed" in line
        assert {path: path.read_bytes() for path in mine} == mine
        assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # no staging folder, no lock
