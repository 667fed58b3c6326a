"""Several processes for real: `accelerate launch --num_processes 2` on this CPU machine (torchrun
starts two processes that join a gloo group) trains SFT and DPO like one process with the
doubled batch, and a data-parallel DDS evaluation writes every record once and the same report.

Nothing is simulated: real launches, real gloo all-reduce/all-gather. Limits are hang guards only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flipguard.data.schema import Item
from flipguard.train import pairs as P
from served import free_port

BOUND = 1800
ROOT = Path(__file__).resolve().parents[1]
DDP_CONFIG = ROOT / "recipes" / "accelerate_configs" / "ddp.yaml"
STEPS = 4  # 16 pair rows, a global batch of 4: one epoch, every row seen once by both layouts

ITEMS = [Item(id=f"s-{i}", dataset="amqa", question=f"Is {i} even?", correct_answer="yes" if i % 2 == 0 else "no",
              incorrect_answer="no" if i % 2 == 0 else "yes", split="train") for i in range(8)]


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pairs") / "pairs"
    P.write_pairs(P.build_pairs(ITEMS, "all", seed=0), out)
    return out


def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
            "WANDB_DIR": str(tmp_path), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def accelerate_launch(processes: int) -> list[str]:
    """The documented launcher: the shipped DDP config (torchrun), its GPU count overridden."""
    return [shutil.which("accelerate") or str(Path(sys.executable).parent / "accelerate"), "launch",
            "--config_file", str(DDP_CONFIG), "--num_processes", str(processes), "--main_process_port", str(free_port())]


def train_both_layouts(trainer: str, model: str, pairs: Path, tmp_path: Path) -> tuple[dict, dict, str]:
    """The same recipe, seed and rows: 1 process with batch 4 and 2 processes with batch 2 each,
    started together (the comparison never depends on timing). LoRA dropout is off: its masks come
    from each process's own RNG stream and cannot coincide between the layouts."""
    common = ["recipes/tiny.yaml", "--model_name_or_path", model, "--pairs_dir", str(pairs),
              "--max_steps", str(STEPS), "--lora_dropout", "0"]
    one = [sys.executable, f"train/{trainer}.py", *common, "--output_dir", str(tmp_path / "one"),
           "--per_device_train_batch_size", "4"]
    two = [*accelerate_launch(2), f"train/{trainer}.py", *common, "--output_dir", str(tmp_path / "two"),
           "--per_device_train_batch_size", "2", "--report_to", "wandb"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for cmd in (one, two)]
    outputs = [p.communicate(timeout=BOUND)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    info = [json.loads((tmp_path / d / "flipguard_training.json").read_text()) for d in ("one", "two")]
    return info[0], info[1], outputs[1]


def losses(info: dict) -> list[float]:
    return [h["loss"] for h in info["log_history"] if "loss" in h]


def relative_difference(a: Path, b: Path) -> float:
    """||A - B|| / ||A|| over every adapter tensor (Frobenius norm of the concatenation)."""
    x, y = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert x.keys() == y.keys()
    num = sum(float((x[k].float() - y[k].float()).pow(2).sum()) for k in x)
    return (num / sum(float(x[k].float().pow(2).sum()) for k in x)) ** 0.5


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_two_processes_train_like_one_with_the_doubled_batch(trainer, tiny_model_path, pairs_dir, tmp_path):
    one, two, log = train_both_layouts(trainer, tiny_model_path, pairs_dir, tmp_path)
    # provenance: the layout and the batch one optimizer step saw
    assert (one["num_processes"], two["num_processes"]) == (1, 2)
    assert two["distributed_type"] == "MULTI_CPU" and two["distributed_backend"] == "gloo"
    assert one["effective_batch_size"] == two["effective_batch_size"] == 4
    assert two["pairs_rows"] == 16 and two["trainer"] == trainer
    # one adapter, written by rank 0 alone; one wandb run, from the main process
    assert log.count("adapter saved to") == 1
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1
    # The loss curves agree to 1e-3 relative. Both layouts see the same 4 rows at each step
    # (accelerate hands rank r every other batch of the same seeded sampler), and DDP averages
    # the two half-batch gradients into the full-batch one; what differs is float summation
    # order (an all-reduce, padding to each half's own length): measured <= 5e-5 relative over
    # these 4 steps on DPO and 6e-6 on SFT (2026-11-25), so 1e-3 leaves a 20x margin yet
    # is far below what other rows make: consecutive steps' losses differ by 3-8%.
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == STEPS
    assert all(abs(x - y) <= 1e-3 * abs(x) for x, y in zip(a, b)), (a, b)
    # The adapters agree to 5% (relative Frobenius norm). Adam divides each update by the
    # root of its own squared gradient, so elements whose gradient is float noise take steps
    # of up to the learning rate in either layout; the adapter is also saved in bf16
    # (2^-8 relative per element). Measured 0.9% (SFT) and 0.3% (DPO); 5% still fails
    # an adapter trained on other rows or with another effective batch.
    assert relative_difference(tmp_path / "one", tmp_path / "two") < 0.05


def run_evals(model: str, one: Path, two: Path, tmp_path: Path) -> str:
    """The same DDS eval by one process and by two data-parallel ranks, started together; returns
    the 2-rank run's output."""
    args = ["-m", "flipguard", "eval", "--model", model, "--datasets", "truthfulqa", "--limit", "6",
            "--min_label_mass", "0", "--batch_size", "2", "--out"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for cmd in ([sys.executable, *args, str(one)], [*accelerate_launch(2), *args, str(two)])]
    outputs = [p.communicate(timeout=BOUND)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    return outputs[1]


def close(a, b, path: str = "") -> None:
    """Equal reports: the same keys, strings and counts; floats equal to 1e-5 relative (the ranks
    score other batch mixes, so padding changes the last float bits of a probability)."""
    if isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-12), (path, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if k != "run_dir":
                close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def test_data_parallel_dds_eval_writes_every_record_once_and_the_same_report(tiny_model_path, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    log = run_evals(tiny_model_path, one, two, tmp_path)
    assert "over 2 data-parallel processes" in log and log.count("wrote ") == 1  # rank 0 alone reports
    lines = [json.loads(line) for line in (two / "records.jsonl").read_text().splitlines()]
    keys = [r["key"] for r in lines]
    assert len(keys) == len(set(keys)) == 24  # 6 items x 4 cases, each exactly once
    ref = {json.loads(line)["key"]: json.loads(line) for line in (one / "records.jsonl").read_text().splitlines()}
    assert set(keys) == set(ref)
    for rec in lines:
        assert rec["choice"] == ref[rec["key"]]["choice"] and rec["messages"] == ref[rec["key"]]["messages"]
        assert abs(rec["p1"] - ref[rec["key"]]["p1"]) <= 1e-5 * ref[rec["key"]]["p1"]
    for name in ("summary.md", "summary.csv", "flips.csv", "flips_summary.csv", "flip_transitions.csv"):
        assert (two / "report" / name).read_text() == (one / "report" / name).read_text(), name
    close(json.loads((one / "report" / "summary.json").read_text()),
          json.loads((two / "report" / "summary.json").read_text()))
    meta = json.loads((two / "run.json").read_text())
    assert meta["invocations"][-1]["processes"] == 2
    # the first tokens both ranks counted, summed: what the single process counted
    assert meta["computed"] == json.loads((one / "run.json").read_text())["computed"]
