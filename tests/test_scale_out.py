"""Several processes for real: `accelerate launch --num_processes 2` on this CPU machine (torchrun
starts two processes that join a gloo group) trains SFT and DPO like one process with the
doubled batch, and a data-parallel DDS evaluation writes every record once and the same report.

Nothing is simulated: real launches, real gloo all-reduce/all-gather. Limits are hang guards only."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from even_items import even_items, write_all_pairs
from safetensors.torch import load_file
from served import free_port

BOUND = 1800
ROOT = Path(__file__).resolve().parents[1]
DDP_CONFIG = ROOT / "recipes" / "accelerate_configs" / "ddp.yaml"
STEPS = 4  # 16 pair rows, a global batch of 4: one epoch, every row seen once by both layouts

ITEMS = even_items(8, "s")


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    return write_all_pairs(ITEMS, tmp_path_factory.mktemp("pairs"))


def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
            "WANDB_DIR": str(tmp_path), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def accelerate_launch(processes: int) -> list[str]:
    """The documented launcher: the shipped DDP config (torchrun), its GPU count overridden."""
    return [shutil.which("accelerate") or str(Path(sys.executable).parent / "accelerate"), "launch",
            "--config_file", str(DDP_CONFIG), "--num_processes", str(processes), "--main_process_port", str(free_port())]


def train_both_layouts(trainer: str, model: str, pairs: Path, tmp_path: Path,
                       as_study: bool = False) -> tuple[dict, dict, str]:
    """The same recipe, seed and rows: 1 process with batch 4 and 2 processes with batch 2 each,
    started together (the comparison never depends on timing). LoRA dropout is off: its masks come
    from each process's own RNG stream and cannot coincide between the layouts. `as_study`: the 2
    processes run the trainer as a study's stage launches it (`accelerate launch -m flipguard NAME`,
    any registered trainer), not its script."""
    common = ["recipes/tiny.yaml", "--model_name_or_path", model, "--pairs_dir", str(pairs),
              "--max_steps", str(STEPS), "--lora_dropout", "0"]
    one = [sys.executable, f"train/{trainer}.py", *common, "--output_dir", str(tmp_path / "one"),
           "--per_device_train_batch_size", "4"]
    script = ["-m", "flipguard", trainer] if as_study else [f"train/{trainer}.py"]
    two = [*accelerate_launch(2), *script, *common, "--output_dir", str(tmp_path / "two"),
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
    # is far below what other rows make: consecutive steps' losses differ by 1-8%.
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == STEPS
    assert all(abs(x - y) <= 1e-3 * abs(x) for x, y in zip(a, b)), (a, b)
    # The adapters agree to 5% (relative Frobenius norm). Adam divides each update by the
    # root of its own squared gradient, so elements whose gradient is float noise take steps
    # of up to the learning rate in either layout; the adapter is also saved in bf16
    # (2^-8 relative per element). Measured 0.9% (SFT) and 0.3% (DPO); an SFT adapter trained
    # with batch 2 instead of 4 (other rows at each step) differs by 24%, so 5% still tells them apart.
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
    # the first tokens both ranks counted, summed: what the single process counted; prefix sharing's
    # prompt tokens summed too (each rank shares within its own slice: it computed at least as many)
    single = json.loads((one / "run.json").read_text())["computed"]
    assert meta["computed"].keys() == single.keys()
    for label, info in meta["computed"].items():
        shared, alone = info.pop("prefix_tokens"), single[label].pop("prefix_tokens")
        assert shared["prompt"] == alone["prompt"] and alone["computed"] <= shared["computed"] <= shared["prompt"]
    assert meta["computed"] == single


# ---------------------------------------------------------------- accelerate configs, vLLM pass-through

CONFIGS = ROOT / "recipes" / "accelerate_configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_accelerate_config_loads_with_accelerates_own_loader(name):
    """Each file parses into accelerate's ClusterConfig as its header says (ddp.yaml is also
    launched for real above, on CPU, by the training and eval tests); a new file must be added here."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    expected = {"single_gpu.yaml": (DistributedType.NO, 1), "ddp.yaml": (DistributedType.MULTI_GPU, 8),
                "fsdp_qlora.yaml": (DistributedType.FSDP, 2)}
    config = load_config_from_file(str(CONFIGS / name))
    assert (config.distributed_type, config.num_processes) == expected[name]
    header = (CONFIGS / name).read_text().split("compute_environment")[0]
    assert "Requires" in header  # what the machine must have, next to the settings
    if config.distributed_type == DistributedType.FSDP:
        fsdp = config.fsdp_config
        # accelerate loads the weights on rank 0 only and broadcasts them: the two go together
        assert fsdp["fsdp_cpu_ram_efficient_loading"] is True and fsdp["fsdp_sync_module_states"] is True
        assert "bnb_4bit_quant_storage" in header


def test_fsdp_qlora_command_stores_the_4bit_weights_in_the_compute_dtype():
    """The header's command parses, and its quant storage matches the recipe's compute dtype
    (FSDP flattens the 4-bit weights with the others only when they share a dtype)."""
    from trl import ModelConfig, SFTConfig

    from flipguard.config import PairsArguments, TrackingArguments, parse_recipe

    (_, training, model, _), _, _ = parse_recipe(
        ["recipes/gemma12b.yaml", "--bnb_4bit_quant_storage", "bfloat16", "--bf16", "false", "--use_cpu", "true"],
        (PairsArguments, SFTConfig, ModelConfig, TrackingArguments), trainer="sft")
    assert model.load_in_4bit and model.bnb_4bit_quant_storage == model.dtype == "bfloat16"


PARALLEL = {"tensor_parallel_size": 4, "data_parallel_size": 2, "pipeline_parallel_size": 1,
            "distributed_executor_backend": "ray"}


def test_vllm_parallelism_passes_from_backend_args_to_the_engine():
    from flipguard.eval.backends.base import model_kwargs
    from flipguard.eval.backends.vllm_engine import build_engine_kwargs, parallelism

    kwargs = model_kwargs("vllm", json.dumps({**PARALLEL, "gpu_memory_utilization": 0.8}), batch_size=8)
    engine = build_engine_kwargs("Qwen/Qwen2.5-7B-Instruct", "bfloat16", 0, False, kwargs)
    assert {k: engine[k] for k in PARALLEL} == PARALLEL and engine["gpu_memory_utilization"] == 0.8
    assert engine["model"] == "Qwen/Qwen2.5-7B-Instruct" and engine["dtype"] == "bfloat16"
    # what run.json records under computed[model]["parallel"]; vLLM's defaults where unset
    assert parallelism(engine) == PARALLEL
    assert parallelism({}) == {"tensor_parallel_size": 1, "data_parallel_size": 1, "pipeline_parallel_size": 1,
                               "distributed_executor_backend": None}


@pytest.mark.parametrize("bad, named", [({"tensor_parallel_size": 0}, "tensor_parallel_size"),
                                         ({"data_parallel_size": "2"}, "data_parallel_size"),
                                         ({"distributed_executor_backend": "slurm"}, "distributed_executor_backend")])
def test_bad_vllm_parallel_settings_are_refused_naming_the_key(bad, named):
    from flipguard.eval.backends.base import BackendError
    from flipguard.eval.backends.vllm_engine import build_engine_kwargs

    with pytest.raises(BackendError, match=named):
        build_engine_kwargs("m", "bfloat16", 0, False, bad)


def test_a_recipes_eval_backend_args_reach_every_eval_of_the_study(tmp_path):
    from flipguard.config import read_recipe
    from flipguard.eval.backends.base import model_kwargs
    from flipguard.eval.backends.vllm_engine import build_engine_kwargs
    from flipguard.pipeline.study_plan import StudyPlan

    raw = read_recipe("recipes/tiny.yaml")
    raw["eval"] = {**raw["eval"], "backend": "vllm", "backend_args": PARALLEL}
    study = StudyPlan("recipes/tiny.yaml", raw, tmp_path / "study")
    args = study.dds_args("baseline", model="Qwen/Qwen2.5-7B-Instruct", mode="logprob")
    assert args.backend == "vllm"
    engine = build_engine_kwargs(args.model, "bfloat16", 0, False, model_kwargs(args.backend, args.backend_args, batch_size=8))
    assert {k: engine[k] for k in PARALLEL} == PARALLEL
    assert json.loads(study.backend_args_json()) == PARALLEL  # what the afr and sos stages pass on


def test_data_parallel_launch_refuses_a_backend_that_parallelises_itself(tiny_model_path, tmp_path):
    """Under accelerate launch only the hf backend is split across ranks; vllm gets a one-line
    error naming the engine's own setting (checked before any engine loads)."""
    cmd = [*accelerate_launch(2), "-m", "flipguard", "eval", "--model", tiny_model_path, "--backend", "vllm",
           "--datasets", "truthfulqa", "--limit", "1", "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=BOUND)
    assert proc.returncode != 0
    assert "data-parallel launch" in proc.stderr and "data_parallel_size" in proc.stderr
    assert not (tmp_path / "run").exists()


MULTI_TURN_RUNS = {  # protocol -> (its command's arguments, the model given as a path; its report)
    "sos": (["sos", "recipes/sos_tiny.yaml", "--limit", "4", "--n_boot", "200", "--model"], "report/summary.md"),
    # AFR's challenge quotes the model's own stored first answer; scripted arguments (no Stage I generation)
    "afr": (["afr", "--datasets", "organism_mc", "--split", "train", "--scripted_arguments",
             "data/organism_mc/arguments.jsonl", "--per_subject", "4", "--k_values", "1", "--cross", "false",
             "--answer_mode", "logprob", "--n_boot", "200", "--progress", "false", "--model"], "report/summary.md"),
}


@pytest.mark.parametrize("protocol", sorted(MULTI_TURN_RUNS))
def test_data_parallel_multi_turn_keeps_turn_order_and_report(protocol, tiny_model_path, tmp_path):
    """Stick-or-switch and AFR ask their later turns from the earlier answers: every rank must see
    every answer of a turn before the next one is built. Two ranks write the same conversations
    (messages include the earlier turns and replies) and the same report as one process."""
    one, two = tmp_path / "one" / "run", tmp_path / "two" / "run"  # one name: AFR's report is titled by it
    command, report = MULTI_TURN_RUNS[protocol]
    args = ["-m", "flipguard", *command, tiny_model_path, "--out"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for cmd in ([sys.executable, *args, str(one)], [*accelerate_launch(2), *args, str(two)])]
    for p in procs:
        out = p.communicate(timeout=BOUND)[0]
        assert p.returncode == 0, out[-4000:]
    ref = {r["key"]: r for r in map(json.loads, (one / "records.jsonl").read_text().splitlines())}
    got = [json.loads(line) for line in (two / "records.jsonl").read_text().splitlines()]
    assert len(got) == len({r["key"] for r in got}) == len(ref) > 0
    for rec in got:
        assert (rec["messages"], rec["raw_output"], rec["choice"]) == (
            ref[rec["key"]]["messages"], ref[rec["key"]]["raw_output"], ref[rec["key"]]["choice"])
    strip = {"one": str(one), "two": str(two)}
    assert (two / report).read_text().replace(strip["two"], "RUN") == \
        (one / report).read_text().replace(strip["one"], "RUN")


def rank_pids(marker: str) -> dict[int, int]:
    """rank -> pid of the launched workers whose environment carries `marker` (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = dict(kv.split("=", 1) for kv in (entry / "environ").read_bytes().decode("utf-8", "replace")
                           .split("\0") if "=" in kv)
        except OSError:
            continue
        if environ.get("FLIPGUARD_TEST_MARKER") == marker and "RANK" in environ and "flipguard" in \
                (entry / "cmdline").read_bytes().decode("utf-8", "replace"):
            found[int(environ["RANK"])] = int(entry.name)
    return found


@pytest.mark.parametrize("killed", [1, 0])
def test_kill_9_of_a_rank_then_rerun_resumes_every_record_once(killed, tiny_model_path, tmp_path):
    """A real SIGKILL of one rank mid-run (rank 0 is the writer holding the run lock): torchrun
    ends the other, the records stored so far stay; the same command again runs only the rest,
    and the report equals one process's."""
    import signal
    import time

    one, two = tmp_path / "one", tmp_path / "two"
    args = ["-m", "flipguard", "eval", "--model", tiny_model_path, "--datasets", "truthfulqa", "--limit", "20",
            "--min_label_mass", "0", "--batch_size", "2", "--out"]
    marker = str(tmp_path)
    run_env = {**env(tmp_path), "FLIPGUARD_TEST_MARKER": marker}
    first = subprocess.Popen([*accelerate_launch(2), *args, str(two)], cwd=ROOT, env=run_env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    records = two / "records.jsonl"
    deadline = time.monotonic() + BOUND  # a hang guard, not a synchronisation point
    while not (records.is_file() and records.read_text().count("\n") >= 1):
        assert first.poll() is None and time.monotonic() < deadline, "the run ended before its first records"
        time.sleep(0.05)
    pids = rank_pids(marker)
    assert sorted(pids) == [0, 1], pids
    # freeze the rank first: the other then waits for its half of the next chunk (rank 0 stores nothing more)
    os.kill(pids[killed], signal.SIGSTOP)
    os.kill(pids[killed], signal.SIGKILL)
    out = first.communicate(timeout=BOUND)[0]
    assert first.returncode != 0, out[-3000:]
    kept = [json.loads(line)["key"] for line in records.read_text().splitlines()]
    single = subprocess.run([sys.executable, *args, str(one)], cwd=ROOT, env=env(tmp_path), capture_output=True,
                            text=True, timeout=BOUND)
    assert single.returncode == 0, single.stderr[-3000:]
    ref = {json.loads(line)["key"] for line in (one / "records.jsonl").read_text().splitlines()}
    total = len(ref)  # 20 truthfulqa items x 4 cases
    assert 0 < len(kept) < total and len(kept) == len(set(kept))  # interrupted, nothing doubled
    again = subprocess.run([*accelerate_launch(2), *args, str(two)], cwd=ROOT, env=run_env, capture_output=True,
                           text=True, timeout=BOUND)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(kept)} already recorded, {total - len(kept)} to run" in again.stdout
    keys = [json.loads(line)["key"] for line in records.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == total and keys[: len(kept)] == kept
    assert set(keys) == ref
    for name in ("summary.csv", "flips.csv", "flip_transitions.csv"):
        assert (two / "report" / name).read_text() == (one / "report" / name).read_text(), name
    # summary.md too, but for its "most common first tokens" count: run.json keeps the latest
    # invocation's counts (the resumed run counted only the judgments it ran), one process or two
    def without_first_token_counts(path: Path) -> str:
        return re.sub(r"most common first tokens: [^.]*\.", "", path.read_text())

    assert without_first_token_counts(two / "report" / "summary.md") == \
        without_first_token_counts(one / "report" / "summary.md")


def test_a_cpu_study_launches_its_trainers_when_the_accelerate_config_asks_for_several_processes(tmp_path):
    """On CPU the study trains in process, unless eval.accelerate_config (read by accelerate's
    loader) asks for more than one process: then its trainer stages run `accelerate launch`."""
    import yaml

    from flipguard.config import read_recipe
    from flipguard.pipeline.study_plan import StudyPlan

    two = tmp_path / "ddp2.yaml"
    two.write_text(yaml.safe_dump({**yaml.safe_load(DDP_CONFIG.read_text()), "num_processes": 2}))
    raw = read_recipe("recipes/tiny.yaml")
    plain = StudyPlan("recipes/tiny.yaml", raw, tmp_path / "plain")
    launched = StudyPlan("recipes/tiny.yaml", {**raw, "eval": {**raw["eval"], "accelerate_config": str(two)}},
                     tmp_path / "launched")
    assert (plain.accelerate_processes(), launched.accelerate_processes()) == (1, 2)
    sft = {s.name: s for s in launched.stages}["sft"]
    assert "accelerate launch" in sft.title and sft.params["accelerate_config"] == str(two)
    assert "in process on CPU" in {s.name: s for s in plain.stages}["sft"].title


def test_kto_trains_on_two_processes_with_its_kl_term_per_process(tiny_model_path, pairs_dir, tmp_path):
    """The third registered trainer on 2 processes, launched as a study launches a trainer stage
    (`accelerate launch -m flipguard kto`): one adapter from rank 0, the layout in its provenance.
    Not compared with the 1-process run step for step: KTO estimates its KL term from the other
    replies of each process's own batch (2 rows here, 4 in one process), so the two layouts
    optimise different estimates by design (TRL's KTOTrainer does the same on GPUs)."""
    one, two, log = train_both_layouts("kto", tiny_model_path, pairs_dir, tmp_path, as_study=True)
    assert (one["num_processes"], two["num_processes"]) == (1, 2)
    assert two["distributed_backend"] == "gloo" and one["effective_batch_size"] == two["effective_batch_size"] == 4
    assert two["trainer"] == "kto" and log.count("adapter saved to") == 1
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == STEPS and all(math.isfinite(x) for x in a + b)
    # it trained: LoRA's B matrices start at zero
    weights = load_file(str(tmp_path / "two" / "adapter_model.safetensors"))
    assert any(float(w.abs().max()) > 0 for k, w in weights.items() if "lora_B" in k)
