"""flipguard against a REAL vLLM (CPU build) on the embedded organism model — no stub.

- `--backend vllm` (offline engine) against `--backend hf`, without and with an un-merged
  LoRA adapter (vLLM's LoRARequest; hf: peft), logprob mode;
- vLLM's OpenAI-compatible api_server of a MERGED checkpoint (a real subprocess) measured with
  `--backend openai` in both modes against `--backend hf` on the same checkpoint; resume (a
  rerun sends no request); the server killed mid-run (SIGKILL), then restarted and the run
  completed.
Probabilities must agree within 1e-4 and every choice must be equal. Every run goes through
the `flipguard eval` command line (`python -m flipguard.pipeline.cli`), the commands docs/serving.md
shows.

vLLM's CPU build needs its own environment (it pins torch and transformers): `bash .ci/vllm`
builds it and runs this file with FLIPGUARD_REQUIRE_VLLM=1, where a missing engine fails. In
any other environment the module skips with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REQUIRE = os.environ.get("FLIPGUARD_REQUIRE_VLLM") == "1"
try:
    import vllm  # noqa: F401
except ImportError as exc:  # the default CI environment
    if REQUIRE:
        raise ImportError(f"FLIPGUARD_REQUIRE_VLLM=1 but vLLM does not import: {exc}") from exc
    pytest.skip(f"vLLM is not installed ({exc}); `bash .ci/vllm` runs these against a real vLLM",
                allow_module_level=True)

from served import ServerProcess  # noqa: E402

from flipguard.eval.records import load_records  # noqa: E402  (after the module-level skip)

# Hang guard only (never reached by a healthy run, however loaded the machine): the tests wait
# on events (a server answering, a records file growing, a process exiting).
BOUND = 1800
TOL = 1e-4
LIMIT = "4"  # organism items per run: 4 items x 4 cases = 16 judgments
SERVED_NAME = "organism-merged"
# float32 as hf computes; eager (no graph capture on CPU); 20 logprobs (flipguard asks for 20)
ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048}
ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}


def flipguard_eval(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`flipguard eval ARGS` on the organism dataset (the console script's module)."""
    cmd = [sys.executable, "-m", "flipguard.pipeline.cli", "eval", "--datasets", "organism", "--limit", LIMIT,
           "--report", "false", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=BOUND)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def by_judgment(run_dir: Path) -> dict:
    return {(r.dataset, r.item_id, r.case): r for r in load_records(run_dir)}


def assert_same_judgments(run: Path, ref: Path, mode: str) -> None:
    """Same judgments, choices equal; logprob: P("1"), P("2") within TOL; generate: same text."""
    got, want = by_judgment(run), by_judgment(ref)
    assert got.keys() == want.keys() and len(got) == 4 * int(LIMIT)
    for key, w in want.items():
        g = got[key]
        assert (g.choice, g.valid) == (w.choice, w.valid), key
        if mode == "logprob":
            assert abs(g.p1 - w.p1) < TOL and abs(g.p2 - w.p2) < TOL, (key, g.p1, w.p1, g.p2, w.p2)
        else:
            assert g.raw_output == w.raw_output, key
    if mode == "logprob":  # the organism is a trained judge: its labels carry the mass
        assert all(w.valid for w in want.values())
        gap = max(max(abs(got[k].p1 - w.p1), abs(got[k].p2 - w.p2)) for k, w in want.items())
        print(f"\n{run.name} vs {ref.name}: {len(want)} judgments, choices equal, max |dP| = {gap:.2e}")
    else:
        print(f"\n{run.name} vs {ref.name}: {len(want)} replies identical, choices equal")


# ---------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def organism() -> str:
    from flipguard.eval.embedded.organism import shipped_organism

    return shipped_organism()  # the shipped organism (eval/embedded/organism_model)


LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(organism: str, out: Path, target_modules: list[str]) -> Path:
    """A peft LoRA adapter (r 8) of the organism, saved un-merged. Its B matrices are drawn,
    not zero, so it changes the answers' probabilities."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(organism, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, task_type="CAUSAL_LM",
                        target_modules=target_modules)
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.mul_(0.05)
    # finished as flipguard's trainers finish theirs (peft's files recorded, the provenance last): eval --adapter
    # takes only finished adapters
    from flipguard.train.utils import adapter_saved

    with adapter_saved(str(out), {"trainer": "test", "base_model": organism}, None):
        model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapter(organism, tmp_path_factory) -> Path:
    """An un-merged LoRA adapter of the organism on every linear layer."""
    return make_adapter(organism, tmp_path_factory.mktemp("adapter") / "organism-lora", LINEAR)


@pytest.fixture(scope="module")
def merged(organism, adapter, tmp_path_factory) -> Path:
    """The adapter merged into the organism: what a user serves."""
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(organism, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    out = tmp_path_factory.mktemp("merged") / "organism-merged"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (Path(organism) / name).exists():
            shutil.copy(Path(organism) / name, out / name)
    return out


# ---------------------------------------------------------------------------- offline engine


def test_offline_engine_matches_hf(organism, tmp_path):
    flipguard_eval("--model", organism, "--backend", "hf", "--out", str(tmp_path / "hf"))
    flipguard_eval("--model", organism, "--backend", "vllm", "--backend_args", json.dumps(ENGINE_ARGS),
                   "--out", str(tmp_path / "vllm"))
    assert_same_judgments(tmp_path / "vllm", tmp_path / "hf", "logprob")


def test_offline_engine_with_unmerged_adapter_matches_hf(organism, adapter, tmp_path):
    flipguard_eval("--model", organism, "--adapter", str(adapter), "--backend", "hf", "--out", str(tmp_path / "hf"))
    flipguard_eval("--model", organism, "--adapter", str(adapter), "--backend", "vllm",
                   "--backend_args", json.dumps(ENGINE_ARGS), "--out", str(tmp_path / "vllm"))
    assert_same_judgments(tmp_path / "vllm", tmp_path / "hf", "logprob")
    # the adapter was applied: the base organism answers with other probabilities
    flipguard_eval("--model", organism, "--backend", "hf", "--out", str(tmp_path / "base"))
    base, tuned = by_judgment(tmp_path / "base"), by_judgment(tmp_path / "hf")
    assert max(abs(base[k].p1 - tuned[k].p1) for k in base) > 100 * TOL


VLLM_DIRECT = """
import sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=2048, enable_lora=True,
          max_lora_rank=8)
llm.generate(["1 or 2?"], SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 1, sys.argv[2]))
print("ACCEPTED")
"""


def test_adapter_vllm_does_not_cover_is_refused_in_one_line(organism, tmp_path):
    """LoRA on the organism's embed_tokens: vLLM 0.32 adapts no embeddings of Qwen2 models.
    flipguard refuses it before the engine loads, in one line naming the adapter and the
    module — and vLLM itself, asked directly, rejects the same adapter (the refusal follows
    vLLM, it is not a guess)."""
    adapter = make_adapter(organism, tmp_path / "embed-lora", ["q_proj", "embed_tokens"])
    proc = flipguard_eval("--model", organism, "--adapter", str(adapter), "--backend", "vllm",
                          "--backend_args", json.dumps(ENGINE_ARGS), "--out", str(tmp_path / "run"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # vLLM's import may log warnings first; flipguard's refusal is its last line, and no traceback
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("flipguard eval: error: adapter ") and "Traceback" not in proc.stderr, proc.stderr
    assert str(adapter) in error and "embedding modules embed_tokens" in error, error
    assert not (tmp_path / "run" / "records.jsonl").exists() and not (tmp_path / "run" / "run.json").exists()

    direct = subprocess.run([sys.executable, "-c", VLLM_DIRECT, organism, str(adapter)], capture_output=True,
                            text=True, env=ENV, timeout=BOUND)
    assert direct.returncode != 0 and "ACCEPTED" not in direct.stdout
    said = [line for line in (direct.stdout + direct.stderr).splitlines() if "embed_tokens" in line]
    assert said, direct.stderr[-3000:]
    print(f"\nflipguard: {error}\nvLLM itself: {said[-1][:300]}")


# ---------------------------------------------------------------------------- api_server


class VLLMServer(ServerProcess):
    """vLLM's OpenAI-compatible api_server of one checkpoint; ready when /v1/models lists it."""

    name = "vLLM api_server"
    ready_path = "/v1/models"
    ready_text = SERVED_NAME

    def __init__(self, model: Path, log_dir: Path):
        super().__init__(log_dir, ready_cap_s=BOUND, env=ENV)
        self.model = model

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--served-model-name", SERVED_NAME, "--dtype", "float32", "--enforce-eager",
                "--max-logprobs", "20", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(self.port)]

    def completions_served(self) -> int:
        """Chat-completion requests this server process answered (its access log)."""
        return len(self.chat_requests("200"))


@pytest.fixture(scope="module")
def server(merged, tmp_path_factory):
    srv = VLLMServer(merged, tmp_path_factory.mktemp("server"))
    srv.start()
    yield srv
    srv.kill()


def openai_args(srv: VLLMServer, **extra) -> list[str]:
    return ["--model", SERVED_NAME, "--backend", "openai",
            "--backend_args", json.dumps({"base_url": srv.base_url, **extra})]


@pytest.mark.parametrize("mode", ["logprob", "generate"])
def test_served_merged_checkpoint_matches_hf(server, merged, mode, tmp_path):
    gen = ["--max_new_tokens", "24"] if mode == "generate" else []
    flipguard_eval("--model", str(merged), "--backend", "hf", "--mode", mode, *gen, "--out", str(tmp_path / "hf"))
    flipguard_eval(*openai_args(server), "--mode", mode, *gen, "--out", str(tmp_path / "served"))
    assert_same_judgments(tmp_path / "served", tmp_path / "hf", mode)

    # resume: the same command again finds every judgment recorded and sends no request
    before = server.completions_served()
    rerun = flipguard_eval(*openai_args(server), "--mode", mode, *gen, "--out", str(tmp_path / "served"))
    assert f"{4 * int(LIMIT)} already recorded, 0 to run" in rerun.stdout
    assert server.completions_served() == before
    print(f"rerun: 0 requests sent ({before} before and after)")
    assert_same_judgments(tmp_path / "served", tmp_path / "hf", mode)


def test_server_killed_mid_run_keeps_records_and_rerun_completes(server, tmp_path):
    """A real SIGKILL of the server while a run is in flight: flipguard stops with a one-line
    error naming the model and the server, keeps what was written, and the same command
    completes the run once the server is back (sending only the missing requests)."""
    out = tmp_path / "served"
    args = [*openai_args(server, max_concurrency=1, max_retries=1), "--mode", "generate",
            "--max_new_tokens", "48", "--limit", "12", "--out", str(out)]
    total = 4 * 12
    cmd = [sys.executable, "-m", "flipguard.pipeline.cli", "eval", "--datasets", "organism", "--report", "false", *args]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    records = out / "records.jsonl"
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:  # the run is under way: a few judgments are on disk
        if records.exists() and records.read_text().count("\n") >= 3:
            break
        assert run.poll() is None, run.communicate()
        time.sleep(0.2)
    server.kill()
    stdout, stderr = run.communicate(timeout=BOUND)
    assert run.returncode != 0, stdout
    last = stderr.strip().splitlines()[-1]
    assert "request failed after retries" in last and SERVED_NAME in last and server.base_url in last, stderr
    assert "Traceback" not in stderr
    kept = len(load_records(out))
    assert 3 <= kept < total  # what was written stays, and the kill came before the end
    print(f"\nserver killed: exit {run.returncode}, {kept}/{total} records kept; {last}")

    server.start()  # the same port: the same command resumes
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=BOUND)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{kept} already recorded, {total - kept} to run" in done.stdout
    recs = load_records(out)
    assert len(recs) == total and len({r.key for r in recs}) == total
    assert server.completions_served() == total - kept
    print(f"restarted server: the rerun sent {total - kept} requests and completed {total} judgments")
