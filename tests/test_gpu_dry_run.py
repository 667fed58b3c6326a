"""bench/gpu/run.sh, the GPU machine's one command (issue 34), checked where CI runs: without CUDA.

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
    assert "ok entry points flipguard.tasks ['afr', 'dds', 'sos']" in proc.stdout


def test_a_checkout_without_install_metadata_reads_pyprojects_entry_points(monkeypatch):
    from flipguard import plugins

    monkeypatch.setattr(plugins, "entry_points", lambda group: [])  # as on the GPU machine: no dist-info
    found = plugins.plugins(plugins.BACKENDS)
    assert {n: ep.value for n, ep in found.items()} == {
        "hf": "flipguard.eval.backends.hf", "vllm": "flipguard.eval.backends.vllm_engine",
        "openai": "flipguard.eval.backends.openai_api"}
    assert found["hf"].group == plugins.BACKENDS
    assert plugins.plugins(plugins.MODELS)["flipguard:organism"].value == "flipguard.eval.embedded.organism:ensure_organism"


def test_an_installed_entry_point_wins_over_the_source_tree(monkeypatch):
    from flipguard import plugins

    mine = EntryPoint("hf", "flipguard.eval.backends.hf", plugins.BACKENDS)
    other = EntryPoint("echo", "echo_backend", plugins.BACKENDS)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [mine, other])
    assert set(plugins.plugins(plugins.BACKENDS)) == {"hf", "echo"}


@pytest.mark.slow
def test_the_tiny_shape_runs_every_gpu_step_on_cpu(tmp_path):
    """model, pairs, DDS scoring, SFT and DPO through accelerate launch, merge: the GPU run's
    scripts and arguments at hidden 64 / 2 layers, 2 optimizer steps each, on CPU."""
    ensure_wheels()
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "run.sh"), "--shape", "tiny", "env", "matmul", "model", "pairs", "dds",
         "sft", "dpo", "merge"], cwd=ROOT, text=True, capture_output=True, timeout=1200,
        env=env(OUT=str(out), WORK=str(work), FG_SITE=str(tmp_path / "site"), TRAIN_STEPS="2", DDS_BATCHES="8,32",
                DDS_JUDGMENTS="32", RUN_BUDGET_S="1100"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "gpu.json").read_text())
    steps = res["steps"]
    assert set(steps) == {"env", "matmul", "model", "pairs", "dds", "sft", "dpo", "merge"}
    failed = {k: v.get("error_tail", "")[-1500:] for k, v in steps.items() if v["rc"] != 0}
    assert not failed, failed
    assert steps["model"]["result"]["config"]["hidden_size"] == 64
    assert steps["pairs"]["result"]["sampled_prompt_tokens"]["max"] <= 768
    for kind in ("sft", "dpo"):
        r = steps[kind]["result"]
        assert r["optimizer_steps"] == 2 and r["effective_batch"] == 16 and r["samples"] == 32
        assert r["samples_per_s"] > 0 and len(r["losses"]) == 2
        assert r["compute"]["device"] == "cpu" and r["compute"]["trainable_dtypes"] == ["float32"]
        assert r["compute"]["bnb_4bit_compute_dtype"] is not None  # the 4-bit base, as on the GPU
    assert [row["batch_size"] for row in steps["dds"]["result"]["sweep"]] == [8, 32]
    assert steps["dds"]["result"]["full_pass"]["judgments"] == 3244 * 4
    assert steps["merge"]["result"]["merge_gap"]["n_prompts"] == 8
    assert (out / "gpu.log").is_file()
