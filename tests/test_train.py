"""Trainers on the tiny model on CPU: QLoRA path, label masking, P("1") moves, wandb offline,
length refusal, bad model, merge round-trip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from even_items import even_items, write_all_pairs

from flipguard.eval.dds.prompts import build_messages
from flipguard.pairs import builder as P
from flipguard.train import utils

# Subprocess limits are hang guards only (a loaded 2-core machine must never hit them),
# never synchronisation points: tests wait on files and events.
BOUND = 1800

ITEMS = even_items(6, "t")


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    return write_all_pairs(ITEMS, tmp_path_factory.mktemp("pairs"))


@pytest.fixture(scope="module")
def ones_dir(tmp_path_factory):
    """Only target-'1' rows: a preference the tiny model can learn in a few DPO steps."""
    ps = P.build_pairs(ITEMS, "all", seed=0, balance=False)
    ps.rows = [r for r in ps.rows if r.target == "1"]
    out = tmp_path_factory.mktemp("ones") / "pairs"
    P.write_pairs(ps, out)
    return out


def env(tmp_path):
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
            "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}


def answer_logprobs(model_path, adapter, messages) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
    return {a: float(logp[tok.convert_tokens_to_ids(a)]) for a in ("1", "2")}


def test_sft_labels_cover_only_answer_and_end_of_turn_on_a_4bit_base(tiny_model_path, pairs_dir, tmp_path):
    from trl import ModelConfig, SFTConfig, SFTTrainer, get_peft_config, get_quantization_config

    model_args = ModelConfig(model_name_or_path=tiny_model_path, dtype="float32", load_in_4bit=True,
                             use_bnb_nested_quant=True, use_peft=True, lora_r=4, lora_alpha=8,
                             lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, fp16=False, report_to="none",
                     completion_only_loss=True, max_length=2048)
    args.model_init_kwargs = utils.model_init_kwargs(model_args, args)
    tok = utils.load_tokenizer(tiny_model_path)
    ds = utils.load_pair_dataset(str(pairs_dir), "sft")
    trainer = SFTTrainer(model=tiny_model_path, args=args, train_dataset=ds, processing_class=tok,
                         peft_config=get_peft_config(model_args), quantization_config=get_quantization_config(model_args))
    names = {type(m).__name__ for m in trainer.model.modules()}
    assert "Linear4bit" in names  # the real QLoRA path: bitsandbytes NF4 on CPU
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    for row, labels, ids in zip((ds[i] for i in range(4)), batch["labels"], batch["input_ids"]):
        kept = labels[labels != -100].tolist()
        assert tok.convert_ids_to_tokens(kept) == [row["completion"][0]["content"], "<|im_end|>", "\n"] or \
            tok.decode(kept) == row["completion"][0]["content"] + "<|im_end|>\n"
        # and those are the last real tokens of the sequence, right after the assistant header
        prompt_ids = tok(tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False).input_ids
        real = ids[ids != tok.pad_token_id].tolist() if tok.pad_token_id not in kept else ids.tolist()
        assert real[: len(prompt_ids)] == prompt_ids


def test_fp16_training_keeps_the_4bit_bases_adapter_weights_in_float32(tiny_model_path, pairs_dir, tmp_path):
    """TRL casts a quantized base's LoRA weights to bfloat16 whatever the autocast; under fp16 (the
    qwen7b recipe's DPO) the GradScaler then fails on CUDA ('_amp_foreach_non_finite_check_and_unscale_cuda'
    not implemented for 'BFloat16', seen on an H200: bench/gpu.md). The trainers put them back in
    float32 under fp16 and leave them as TRL made them otherwise. (CPU's unscale accepts bfloat16, so
    the failure itself needs a GPU; what reaches the optimizer is checked here.)"""
    from trl import DPOConfig, DPOTrainer, ModelConfig, get_peft_config, get_quantization_config

    model_args = ModelConfig(model_name_or_path=tiny_model_path, dtype="float32", load_in_4bit=True, use_peft=True,
                             lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"])
    tok = utils.load_tokenizer(tiny_model_path)
    ds = utils.load_pair_dataset(str(pairs_dir), "dpo")
    trainable = {}
    for fp16 in (False, True):
        args = DPOConfig(output_dir=str(tmp_path / str(fp16)), use_cpu=True, bf16=False, fp16=False, report_to="none")
        args.model_init_kwargs = utils.model_init_kwargs(model_args, args)
        trainer = DPOTrainer(model=tiny_model_path, ref_model=None, args=args, train_dataset=ds, processing_class=tok,
                             peft_config=get_peft_config(model_args), quantization_config=get_quantization_config(model_args))
        before = {p.dtype for p in trainer.model.parameters() if p.requires_grad}
        args.fp16 = fp16  # set after construction: transformers refuses fp16 without a GPU
        cast = utils.fp16_adapters_in_fp32(trainer.model, args)
        trainable[fp16] = (before, cast, {p.dtype for p in trainer.model.parameters() if p.requires_grad})
    assert trainable[False][0] == {torch.bfloat16}  # TRL's cast, the cause
    assert trainable[False][1:] == (0, {torch.bfloat16})  # bf16 or no autocast: left as TRL made them
    assert trainable[True][1] > 0 and trainable[True][2] == {torch.float32}


def test_sft_cli_moves_p1_toward_the_target(tiny_model_path, pairs_dir, tmp_path):
    out = tmp_path / "sft"
    cmd = [sys.executable, "train/sft.py", "recipes/tiny.yaml", "--model_name_or_path", tiny_model_path,
           "--pairs_dir", str(pairs_dir), "--output_dir", str(out), "--max_steps", "10", "--per_device_train_batch_size", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(tmp_path), timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "adapter_model.safetensors").is_file() and (out / "README.md").is_file()
    msgs = build_messages(ITEMS[0], "c2_correct", fmt="one_token")  # a training prompt, target "1"
    before = answer_logprobs(tiny_model_path, None, msgs)
    after = answer_logprobs(tiny_model_path, str(out), msgs)
    # the tiny random model starts near uniform (log P ~ -ln 599); ten steps must lift P("1") by > 60%
    assert after["1"] > before["1"] + 0.5


def test_dpo_cli_moves_margin_and_writes_wandb_offline_run(tiny_model_path, ones_dir, tmp_path):
    out = tmp_path / "dpo"
    cmd = [sys.executable, "train/dpo.py", "--config", "recipes/tiny.yaml", "--model_name_or_path", tiny_model_path,
           "--pairs_dir", str(ones_dir), "--output_dir", str(out), "--max_steps", "6", "--report_to", "wandb",
           "--per_device_train_batch_size", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(tmp_path), timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    msgs = build_messages(ITEMS[1], "c2_correct", fmt="one_token")
    before = answer_logprobs(tiny_model_path, None, msgs)
    after = answer_logprobs(tiny_model_path, str(out), msgs)
    assert after["1"] - after["2"] > before["1"] - before["2"] + 0.5
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, "no offline wandb run directory"
    # offline runs keep the config inside the run's .wandb log (protobuf; the strings are plain bytes)
    blob = b"".join(p.read_bytes() for p in runs[0].rglob("*") if p.is_file())
    assert b"pairs_fingerprint" in blob and b"recipes/tiny.yaml" in blob and b"git_commit" in blob


def test_fused_lm_head_on_labelled_positions_equals_trls_every_position_path(tiny_model_path, monkeypatch):
    """score_labelled_positions_only: TRL's fused head gets only the labelled rows on CPU and
    returns the log-probs, entropy, top-1 flags and gradients of TRL's own every-position path."""
    import trl.kernels
    import trl.kernels.chunked_logprob as trl_kernel
    import trl.trainer.utils as trl_utils
    from transformers import AutoModelForCausalLM

    # TRL's own switch (a trainer run earlier in this process may have patched it), restored after
    monkeypatch.setattr(trl_utils, "_use_triton", trl_kernel._use_triton)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(10, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[0, 30:32], labels[1, 39], labels[2, 5:9] = ids[0, 30:32], ids[1, 39], ids[2, 5:9]
    rows = []  # the rows the head projects, call by call

    class Recorded:
        @staticmethod
        def apply(hidden, *args):
            rows.append(len(hidden))
            return trl.kernels.ChunkedLogProbFunction.apply(hidden, *args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Recorded)

    def run():
        model.zero_grad()
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        out.loss.backward()
        return out, model.model.layers[0].mlp.down_proj.weight.grad.clone()

    every, every_grad = run()
    assert utils.score_labelled_positions_only() == "labelled positions only"
    assert utils.score_labelled_positions_only() == "labelled positions only"  # twice: patched once
    compact, compact_grad = run()
    assert rows == [3 * 39, 7]  # every shifted position, then the 7 labelled ones
    for field in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(compact, field), getattr(every, field), rtol=1e-5, atol=1e-5)
    assert torch.equal(compact.is_top1, every.is_top1)
    torch.testing.assert_close(compact.loss, every.loss)
    torch.testing.assert_close(compact_grad, every_grad, rtol=1e-4, atol=1e-6)


def test_pairs_that_would_be_truncated_are_refused(tiny_model_path, pairs_dir):
    tok = utils.load_tokenizer(tiny_model_path)
    ds = utils.load_pair_dataset(str(pairs_dir), "dpo")
    longest = utils.check_pair_lengths(ds, tok, 4096, "dpo")
    with pytest.raises(utils.TrainError, match="t-") as exc:
        utils.check_pair_lengths(ds, tok, longest["prompt"], "dpo")  # the longest prompt leaves no room
    assert "refused" in str(exc.value)


def test_non_binary_pair_dataset_is_refused(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}],
                        "completion": [{"role": "assistant", "content": "yes"}]}]).save_to_disk(str(tmp_path / "sft"))
    with pytest.raises(utils.TrainError, match="'1' or '2'"):
        utils.load_pair_dataset(str(tmp_path), "sft")


def test_a_missing_pair_set_is_one_line_naming_the_command_that_builds_it(tmp_path, tiny_model_path):
    """A trainer reads a pair set and never builds one (the study's pairs stage and `flipguard pairs` do)."""
    missing = tmp_path / "no-pairs"
    cmd = [sys.executable, "train/dpo.py", "recipes/tiny.yaml", "--model_name_or_path", tiny_model_path,
           "--pairs_dir", str(missing), "--output_dir", str(tmp_path / "o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(tmp_path), timeout=BOUND)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr  # (the lines before it are transformers' deprecation warnings)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"train/dpo.py: error: {missing / 'dpo'}: no dpo pair set; build it with `flipguard pairs recipes/tiny.yaml` "
        "(or run `flipguard study recipes/tiny.yaml`, whose pairs stage builds it)")
    assert not missing.exists() and not (tmp_path / "o").exists()


def test_model_that_cannot_load_offline_is_a_clear_error(tmp_path, pairs_dir):
    cmd = [sys.executable, "train/dpo.py", "recipes/tiny.yaml", "--model_name_or_path", "nobody/no-such-model-xyz",
           "--pairs_dir", str(pairs_dir), "--output_dir", str(tmp_path / "o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(tmp_path), timeout=BOUND)
    assert proc.returncode == 2
    assert "cannot be loaded" in proc.stderr and "Traceback" not in proc.stderr


def test_resume_checkpoint_finds_the_last_one(tmp_path):
    from types import SimpleNamespace

    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-10").mkdir()
    args = SimpleNamespace(resume_from_checkpoint=None, output_dir=str(tmp_path))
    assert Path(utils.resume_checkpoint(args)).name == "checkpoint-10"
    args.resume_from_checkpoint = str(tmp_path / "missing")
    with pytest.raises(utils.TrainError):
        utils.resume_checkpoint(args)


def test_merge_round_trip_matches_base_plus_adapter(tiny_model_path, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from flipguard.train.merge import merge_adapter

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, lora)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged_dir = merge_adapter(tiny_model_path, str(tmp_path / "adapter"), str(tmp_path / "merged"), "float32",
                               foreign_adapter=True)  # a peft adapter, no flipguard provenance
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "generation_config.json").is_file()
    assert (merged_dir / "README.md").is_file() and (merged_dir / "tokenizer_config.json").is_file()

    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                                    tmp_path / "adapter").eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want, got, base_logits = ref(ids).logits, merged(ids).logits, plain(ids).logits
    assert not torch.allclose(want, base_logits, atol=1e-3)  # the adapter does change the model
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _p1(model, tok, messages) -> float:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        return float(torch.softmax(model(ids).logits[0, -1].float(), -1)[tok.convert_tokens_to_ids("1")])


def test_merge_measures_the_gap_to_the_4bit_base_as_trained(tiny_model_path, pairs_dir, tmp_path, capsys):
    import json

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from flipguard.train.merge import main as merge_main

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), lora) \
        .save_pretrained(tmp_path / "adapter")
    merged_dir = tmp_path / "merged"
    code = merge_main(["recipes/tiny.yaml", "--model_name_or_path", tiny_model_path, "--adapter", str(tmp_path / "adapter"),
                       "--out", str(merged_dir), "--pairs_dir", str(pairs_dir), "--gap_prompts", "4",
                       "--max_merge_gap", "0", "--foreign_adapter", "true"])
    assert code == 0
    err = capsys.readouterr().err
    gap = json.loads((merged_dir / "flipguard_merge.json").read_text())["merge_gap"]
    assert gap["n_prompts"] == 4 and gap["prompts_from"] == str(pairs_dir / "sft.jsonl")
    assert gap["trained_base"].startswith("4-bit")

    # the same number, computed here with plain transformers: NF4 (nested) base + adapter vs merged
    prompts = [json.loads(line)["prompt"] for line in (pairs_dir / "sft.jsonl").read_text().splitlines()[:4]]
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        tiny_model_path, quantization_config=bnb, dtype=torch.float32), tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    deltas = [abs(_p1(merged, tok, m) - _p1(trained, tok, m)) for m in prompts]
    assert max(deltas) > 0  # 4-bit rounding is real
    assert gap["max_abs_delta_p1"] == pytest.approx(max(deltas), rel=1e-3, abs=1e-7)
    assert gap["exceeds_threshold"] is True and "WARNING: merge gap" in err
    assert "Merge gap: max |ΔP(\"1\")|" in (merged_dir / "README.md").read_text()


def test_merge_without_pair_set_records_no_gap(tiny_model_path, tmp_path, capsys):
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from flipguard.train.merge import main as merge_main

    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                   LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    assert merge_main(["recipes/tiny.yaml", "--model_name_or_path", tiny_model_path, "--adapter", str(tmp_path / "adapter"),
                       "--out", str(tmp_path / "merged"), "--pairs_dir", str(tmp_path / "no-pairs"),
                       "--foreign_adapter", "true"]) == 0
    gap = json.loads((tmp_path / "merged" / "flipguard_merge.json").read_text())["merge_gap"]
    assert gap["max_abs_delta_p1"] is None and "no pair set" in gap["skipped"]
    out = capsys.readouterr()
    assert "Merge gap: not measured (no pair set" in out.out and "WARNING" not in out.err


def test_kto_cli_moves_the_margin_on_the_unpaired_dpo_pairs(tiny_model_path, ones_dir, tmp_path):
    """The third registered trainer through its own script, as sft/dpo: the pair builder's DPO set,
    unpaired by KTOTrainer (chosen desirable, rejected undesirable), moves the preference."""
    import json

    out = tmp_path / "kto"
    cmd = [sys.executable, "train/kto.py", "recipes/tiny.yaml", "--model_name_or_path", tiny_model_path,
           "--pairs_dir", str(ones_dir), "--output_dir", str(out), "--max_steps", "6", "--per_device_train_batch_size", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(tmp_path), timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    provenance = json.loads((out / utils.PROVENANCE_FILE).read_text())
    assert provenance["trainer"] == "kto" and provenance["resolved"]["KTOConfig"]["beta"] == 0.1
    msgs = build_messages(ITEMS[1], "c2_correct", fmt="one_token")
    before = answer_logprobs(tiny_model_path, None, msgs)
    after = answer_logprobs(tiny_model_path, str(out), msgs)
    assert after["1"] - after["2"] > before["1"] - before["2"] + 0.5
    # one row per batch leaves KTO no KL estimate: refused in one line before training
    cmd[cmd.index("--per_device_train_batch_size") + 1] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(tmp_path), timeout=BOUND)
    assert proc.returncode == 2 and "kto.per_device_train_batch_size: 1 must be >= 2" in proc.stderr
    assert "Traceback" not in proc.stderr
