"""The trainers' speed paths compute what TRL computes: prefix sharing (train/packing.py) against
TRL's padded rows for SFT, DPO and KTO on the tiny model and the organism, the pair sets tokenized
once (train/tokenized.py) against TRL's own preparation, and the memory planner (train/memory.py)
against what autograd saves and what an H100 measured."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from even_items import even_items

from flipguard.config import trainer_entry
from flipguard.pairs import builder as P
from flipguard.train import dpo, memory, packing, tokenized, utils

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BOUND = 1800  # subprocess hang guard only


def conversation_rows():
    """Multi-turn pairs (the AFR / stick-or-switch shape): replies of several tokens, chosen and
    rejected of different lengths, and two rows sharing a first turn."""
    first = [{"role": "user", "content": "Which word names something alive?\nA. axe\nB. kiwi\nAnswer with the letter."},
             {"role": "assistant", "content": "B"}]
    rows = []
    for k, push in enumerate(("Are you sure? I think it is A.", "A friend says A. Answer again.")):
        prompt = first + [{"role": "user", "content": push}]
        rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": "Answer: B"}],
                     "rejected": [{"role": "assistant", "content": "A"}], "item_id": f"mt-{k}", "case": "afr/hold"})
    return rows


@pytest.fixture(scope="module")
def pair_sets(tmp_path_factory):
    """DDS pairs (C1/C2 framings of the same items share long prefixes) plus multi-turn ones."""
    from datasets import Dataset, concatenate_datasets, load_from_disk

    out = tmp_path_factory.mktemp("pairs") / "pairs"
    P.write_pairs(P.build_pairs(even_items(8, "s"), "all", seed=0), out)
    dpo = load_from_disk(str(out / "dpo"))
    extra = Dataset.from_list([{**r, **{c: None for c in dpo.column_names if c not in r}} for r in conversation_rows()],
                              features=dpo.features)
    sft_extra = Dataset.from_list([{"prompt": r["prompt"], "completion": r["chosen"], "item_id": r["item_id"],
                                    "case": r["case"]} for r in conversation_rows()])
    sft = load_from_disk(str(out / "sft"))
    sft_extra = sft_extra.cast(sft.select_columns(sft_extra.column_names).features)
    return {"sft": concatenate_datasets([sft.select_columns(sft_extra.column_names), sft_extra]),
            "dpo": concatenate_datasets([dpo, extra])}


def model_path(name, tiny_model_path, organism_path):
    return tiny_model_path if name == "tiny" else str(organism_path)


# ---------------------------------------------------------------------------- the packed layout


def test_a_dpo_pair_shares_its_prompt_and_each_reply_sees_only_its_own_tokens():
    prompt, chosen, rejected = [5, 6, 7, 8, 9], [1, 2, 3], [4, 2, 3]
    ids = torch.tensor([prompt + chosen, prompt + rejected])
    labels = torch.tensor([[-100] * 5 + chosen, [-100] * 5 + rejected])
    packed = packing.pack(ids, torch.ones_like(ids), labels)
    # the shared prompt once (but its last token), then each row's own chain: last prompt token + all but its last reply token
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 9, 4, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 4, 5, 6]]
    assert packed.shift_labels.tolist() == [[-100] * 4 + [1, 2, 3, 4, 2, 3]]
    assert packed.packed_tokens == 10 and packed.real_tokens == 16 and packed.padded_tokens == 16
    [(start, end, mask)] = packed.blocks
    assert (start, end) == (0, 10)
    allowed = mask.int().tolist()
    assert allowed[9] == [1, 1, 1, 1, 0, 0, 0, 1, 1, 1]  # rejected's last token: the shared prompt and its own chain
    assert allowed[6] == [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]  # chosen's: the whole prompt, then its own tokens
    # each scored position goes back to its padded row and column (TRL's shifted layout)
    assert list(zip(packed.target_rows.tolist(), packed.target_cols.tolist())) == [(0, 4), (0, 5), (0, 6), (1, 4), (1, 5), (1, 6)]


def test_rows_without_a_shared_prefix_are_causal_chains_and_padding_is_dropped():
    ids = torch.tensor([[1, 2, 3, 4, 0, 0], [7, 8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    labels = torch.tensor([[-100, -100, 3, 4, -100, -100], [-100, -100, -100, -100, 11, 12]])
    packed = packing.pack(ids, mask, labels)
    assert packed.packed_tokens == 3 + 5
    assert [m is None for _, _, m in packed.blocks] == [True, True]  # a chain attends causally: sdpa's own causal path
    assert sorted(packed.input_ids[0].tolist()) == sorted([1, 2, 3, 7, 8, 9, 10, 11])


def test_left_padding_or_no_label_keeps_trls_layout():
    ids = torch.tensor([[0, 1, 2, 3]])
    assert packing.pack(ids, torch.tensor([[0, 1, 1, 1]]), torch.tensor([[-100, -100, 2, 3]])) is None
    assert packing.pack(ids, torch.ones_like(ids), torch.full_like(ids, -100)) is None


def test_a_row_whose_prompt_is_a_prefix_of_anothers_never_sees_the_longer_rows_tokens():
    short, long = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]
    ids = torch.tensor([short + [7, 8] + [0, 0], long + [7, 8]])
    mask = torch.tensor([[1] * 6 + [0, 0], [1] * 8])
    labels = torch.tensor([[-100] * 4 + [7, 8, -100, -100], [-100] * 6 + [7, 8]])
    packed = packing.pack(ids, mask, labels)
    [(_, _, allowed)] = packed.blocks
    tokens = packed.input_ids[0].tolist()
    positions = packed.position_ids[0].tolist()
    for j in range(len(tokens)):
        seen = [i for i in range(len(tokens)) if allowed[j, i]]
        # every token sees one token per position 0..its own, each the token its own row has there
        assert [positions[i] for i in seen] == list(range(positions[j] + 1))
        row = short + [7, 8] if any(tokens[i] == 7 and positions[i] == 4 for i in seen) else long + [7, 8]
        assert [tokens[i] for i in seen] == row[: positions[j] + 1]


# ---------------------------------------------------------------------------- the same losses and gradients


def build_trainer(kind, path, dataset, tmp_path, **config):
    from trl import DPOConfig, KTOConfig, ModelConfig, SFTConfig, SFTTrainer, get_peft_config

    torch.manual_seed(0)
    model_args = ModelConfig(model_name_or_path=path, dtype="float32", use_peft=True, lora_r=8, lora_alpha=16,
                             lora_dropout=0.0, lora_target_modules=TARGETS)
    common = dict(output_dir=str(tmp_path / kind), use_cpu=True, report_to="none", per_device_train_batch_size=8,
                  max_length=1024, bf16=False, fp16=False, **config)
    tok = utils.load_tokenizer(path)
    peft_config = get_peft_config(model_args)
    if kind == "sft":
        return SFTTrainer(model=path, args=SFTConfig(completion_only_loss=True, **common), train_dataset=dataset,
                          processing_class=tok, peft_config=peft_config)
    if kind == "dpo":
        return dpo.dpo_trainer_class()(model=path, ref_model=None, train_dataset=dataset, processing_class=tok,
                                            args=DPOConfig(beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0],
                                                           **common), peft_config=peft_config)
    from trl import KTOTrainer

    return KTOTrainer(model=path, ref_model=None, args=KTOConfig(beta=0.1, **common), train_dataset=dataset,
                      processing_class=tok, peft_config=peft_config)


def loss_and_grads(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k != "num_tokens"}
    return loss.detach(), grads, metrics


@pytest.mark.parametrize("model", ["tiny", "organism"])
@pytest.mark.parametrize("kind", ["sft", "dpo", "kto"])
def test_packed_forwards_give_trls_losses_gradients_and_metrics(kind, model, tiny_model_path, organism_path,
                                                                pair_sets, tmp_path):
    path = model_path(model, tiny_model_path, organism_path)
    utils.score_labelled_positions_only()  # what the trainers run with on CPU
    dataset = pair_sets["sft" if kind == "sft" else "dpo"]
    trainer = build_trainer(kind, path, dataset, tmp_path)
    for name, param in trainer.model.named_parameters():  # the adapter away from zero: policy != reference
        if "lora_B" in name:
            param.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset) - 8, len(trainer.train_dataset))]
    batch = trainer.data_collator(rows)  # the last rows: the multi-turn pairs and DDS rows together
    loss0, grads0, metrics0 = loss_and_grads(trainer, batch)
    stats = packing.install(trainer.model)  # the model TRL calls
    loss1, grads1, metrics1 = loss_and_grads(trainer, batch)
    assert stats.packed_forwards >= 1 and not stats.unpacked_forwards
    assert stats.packed_tokens < stats.real_tokens <= stats.padded_tokens
    assert abs(loss1.item() - loss0.item()) <= 1e-5
    assert grads0.keys() == grads1.keys() and len(grads0) == 2 * len(TARGETS) * trainer.model.config.num_hidden_layers
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert metrics0.keys() == metrics1.keys()
    for name in metrics0:
        assert abs(metrics1[name] - metrics0[name]) <= 1e-5, name


def test_packed_forwards_with_4bit_base_and_recomputed_layers_give_trls_gradients(tiny_model_path, pair_sets, tmp_path):
    """QLoRA (bitsandbytes NF4 on CPU) with gradient checkpointing on the first layer only: the
    recomputed layer replays the packed forward exactly."""
    from trl import DPOConfig, ModelConfig, get_peft_config, get_quantization_config

    torch.manual_seed(0)
    model_args = ModelConfig(model_name_or_path=tiny_model_path, dtype="float32", load_in_4bit=True, use_peft=True,
                             lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules=TARGETS)
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8,
                     bf16=False, fp16=False, gradient_checkpointing=True, beta=0.1)
    args.model_init_kwargs = utils.model_init_kwargs(model_args, args)
    trainer = dpo.dpo_trainer_class()(model=tiny_model_path, ref_model=None, args=args,
                                            train_dataset=pair_sets["dpo"], processing_class=utils.load_tokenizer(tiny_model_path),
                                            peft_config=get_peft_config(model_args),
                                            quantization_config=get_quantization_config(model_args))
    base = trainer.model.get_base_model()
    memory.checkpoint_first_layers(base, 1)
    trainer.model.gradient_checkpointing_enable({"use_reentrant": False})  # as the Trainer does when it trains
    assert [layer.gradient_checkpointing for layer in base.model.layers] == [True, False]
    for name, param in trainer.model.named_parameters():
        if param.requires_grad:  # TRL keeps a 4-bit base's adapter in bfloat16: float32 here, to compare exactly
            param.data = param.data.float()
        if "lora_B" in name:
            param.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    loss0, grads0, _ = loss_and_grads(trainer, batch)
    packing.install(trainer.model)
    loss1, grads1, _ = loss_and_grads(trainer, batch)
    # TRL turned checkpointing off and on around its reference forward (trl.models.utils.
    # disable_gradient_checkpointing, which sets every layer): still the first layer only
    assert [layer.gradient_checkpointing for layer in base.model.layers] == [True, False]
    assert abs(loss1.item() - loss0.item()) <= 1e-5
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------- tokenized once, as TRL does


@pytest.mark.parametrize("model", ["tiny", "organism"])
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_token_columns_are_trls_own_preparation(kind, model, tiny_model_path, organism_path, pair_sets, tmp_path):
    path = model_path(model, tiny_model_path, organism_path)
    dataset = pair_sets[kind]
    trainer = build_trainer(kind, path, dataset, tmp_path)  # TRL prepares the raw pairs itself
    declared = trainer_entry(kind, "test")  # the trainer's own declaration: its pair set and token columns
    columns = tokenized.token_columns(dataset, utils.load_tokenizer(path), declared)
    assert set(columns) == set(declared.token_columns)
    for name in declared.token_columns:
        assert columns[name] == trainer.train_dataset[name], name
    # and handed over tokenized, TRL keeps them as they are
    ours = tokenized.with_token_columns(dataset, columns, utils.load_tokenizer(path))
    config = {"dataset_kwargs": {"skip_prepare_dataset": True}} if kind == "sft" else {}
    again = build_trainer(kind, path, ours, tmp_path / "again", **config)
    for name in declared.token_columns:
        assert again.train_dataset[name] == columns[name]


# ---------------------------------------------------------------------------- the scripts


def run_script(kind, tiny_model_path, pairs_dir, out, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, f"train/{kind}.py", "recipes/tiny.yaml", "--model_name_or_path", tiny_model_path,
           "--pairs_dir", str(pairs_dir), "--output_dir", str(out), "--max_steps", "4", "--logging_steps", "1",
           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--report_to", "none", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((Path(out) / "flipguard_training.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_scripts_log_the_same_losses_with_and_without_prefix_sharing(kind, tiny_model_path, tmp_path):
    """The first optimizer steps of the real scripts (recipes/tiny.yaml): the same losses either way,
    and the provenance says which path ran. In full precision: over a 4-bit base TRL keeps the
    adapter in bfloat16, whose rounding of each update lets two runs part after the first step
    whatever computed them (the 4-bit path's gradients are compared in float32 above)."""
    pairs = tmp_path / "pairs"
    P.write_pairs(P.build_pairs(even_items(12, "p"), "all", seed=0), pairs)
    # no LoRA dropout: its random masks are drawn over each layout's own shape
    exact = ("--lora_dropout", "0", "--load_in_4bit", "false")
    on = run_script(kind, tiny_model_path, pairs, tmp_path / "on", *exact)
    off = run_script(kind, tiny_model_path, pairs, tmp_path / "off", *exact, "--prefix_sharing", "false")
    losses = [[h["loss"] for h in info["log_history"] if "loss" in h] for info in (on, off)]
    assert len(losses[0]) == 4 and len(losses[1]) == 4
    assert max(abs(a - b) for a, b in zip(*losses)) <= 1e-5, losses
    assert on["speed"]["prefix_sharing"]["on"] is True and on["speed"]["prefix_sharing"]["packed_forwards"] > 0
    assert on["speed"]["prefix_sharing"]["packed_tokens"] < on["speed"]["prefix_sharing"]["padded_tokens"]
    assert off["speed"]["prefix_sharing"] == {"on": False, "why": "prefix_sharing: false"}
    assert on["pairs_tokenized_by"] == "flipguard" and on["speed"]["memory_plan"]["as_recipe"] is True
    from datasets import load_from_disk

    assert on["pairs_fingerprint"] == load_from_disk(str(pairs / ("sft" if kind == "sft" else "dpo")))._fingerprint


@pytest.mark.parametrize("fault", ["trl calls no fused head", "eager attention"])
def test_packing_that_cannot_engage_trains_on_trls_layout_records_why_and_says_so(fault, tiny_model_path, tmp_path,
                                                                                   capsys, monkeypatch):
    """Prefix sharing that cannot engage is never recorded on: as if TRL's SFTTrainer stopped calling
    the fused LM head packing takes over (its loss through the model's own forward instead,
    transformers.Trainer.compute_loss), or with an attention implementation packing does not run
    (eager). The training runs on TRL's own layout, flipguard_training.json says `on: false` and
    why, and the console says it in one line."""
    from transformers import Trainer
    from trl import SFTTrainer

    from flipguard.train import sft

    flags = []
    if fault == "trl calls no fused head":
        monkeypatch.setattr(SFTTrainer, "compute_loss", Trainer.compute_loss)
        why = "the trainer made no fused-LM-head forward with labels (TRL did not call what packing takes over)"
    else:
        flags = ["--attn_implementation", "eager"]
        why = "attention implementation 'eager' (packing runs sdpa block by block)"
    pairs, out = tmp_path / "pairs", tmp_path / "sft"
    P.write_pairs(P.build_pairs(even_items(6, "n"), "all", seed=0), pairs)
    argv = [str(Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"), "--model_name_or_path", tiny_model_path,
            "--pairs_dir", str(pairs), "--output_dir", str(out), "--max_steps", "2", "--logging_steps", "1",
            "--report_to", "none", *flags]
    assert sft.main(argv) == 0
    sharing = json.loads((out / "flipguard_training.json").read_text())["speed"]["prefix_sharing"]
    assert sharing["on"] is False and sharing["why"] == why and sharing.get("packed_forwards", 0) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prefix sharing")]
    assert said == [f"prefix sharing off: {why}; trained with TRL's own layout (recorded in flipguard_training.json)"]


def test_a_trl_outside_the_tested_range_leaves_flipguards_patches_off_and_says_so():
    """The private TRL internals flipguard touches (train/compat.py), checked against the installed
    version: as if TRL 1.17.0 were installed (a fresh process, its version as importlib.metadata
    reports it), neither is touched, each fallback is one line naming the version
    found and the range tested, and DPO's pairs go to TRL untokenized."""
    code = ("import importlib.metadata as metadata\n"
            "real = metadata.version\n"
            "metadata.version = lambda package: '1.17.0' if package == 'trl' else real(package)\n"
            "from flipguard.train import compat, dpo, utils\n"
            "print(sorted(compat.OUTSIDE), dpo.TRAINER.tokenize, dpo.dpo_trainer_class().__module__)\n"
            "print(utils.score_labelled_positions_only().startswith('trl default (trl 1.17.0: '))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["['dpo_prepare_dataset', 'trl_use_triton'] None trl.trainer.dpo_trainer", "True"]
    said = [line for line in proc.stderr.splitlines() if line.startswith("flipguard: ")]
    assert said == [
        "flipguard: trl 1.17.0: DPOTrainer._prepare_dataset is overridden (a pair set flipguard tokenized is taken as "
        "prepared) only on trl >=1.16.0,<1.17; here TRL tokenizes the DPO pairs itself",
        "flipguard: trl 1.17.0: trl.trainer.utils._use_triton is wrapped (TRL's fused LM head scores only the labelled "
        "positions on CPU too) only on trl >=1.16.0,<1.17; here the head scores every position on CPU (TRL's own path: "
        "slower, the same losses)"]


# ---------------------------------------------------------------------------- the memory plan

# bench/gpu/run.sh at c90e646 on one H100 80 GB (../shared/measurements/gpu_h100_2026-11-27.json): the
# qwen7b recipe's QLoRA at Qwen2.5-7B shape, peak allocated GiB, and the longest micro-batch of each run
# (rows x padded width; the trainer's own order, seed 42, of bench/gpu/qwen7b.py's 128 pairs: its
# shapes read on CPU with the same flags)
H100_PEAKS = [  # (trainer, trainable bytes, micro-batch tokens, recomputed layers, measured peak GiB)
    ("sft 4 x 4, checkpointing", 2, 4 * 592, 28, 7.643),
    ("sft 16 x 1, checkpointing", 2, 16 * 592, 28, 10.799),
    ("sft 8 x 2", 2, 8 * 592, 0, 42.286),
    ("dpo 4 x 4 fp16, checkpointing", 4, 8 * 592, 28, 9.745),
]


def qwen7b_shape(trainable_bytes=2, dropout=0.05):
    from transformers import Qwen2Config
    from trl import ModelConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "gpu"))
    from qwen7b import QWEN25_7B

    args = ModelConfig(model_name_or_path="x", load_in_4bit=True, use_bnb_nested_quant=True, use_peft=True, lora_r=64,
                       lora_dropout=dropout, lora_target_modules=TARGETS)
    return memory.Shape.of(Qwen2Config(**QWEN25_7B), args, 2, trainable_bytes)


@pytest.mark.parametrize("name,trainable_bytes,tokens,recomputed,measured", H100_PEAKS)
def test_the_estimate_lies_just_above_every_peak_an_h100_measured(name, trainable_bytes, tokens, recomputed, measured):
    shape = qwen7b_shape(trainable_bytes)
    per_layer = memory.saved_bytes_per_token(shape)
    act = tokens * ((shape.layers - recomputed) * per_layer + recomputed * 2 * shape.hidden + (per_layer if recomputed else 0))
    estimate = (sum(memory.static_bytes(shape).values()) + act) / memory.GIB
    assert measured <= estimate <= 1.06 * measured, (name, estimate)


@pytest.mark.parametrize("quantized", [False, True])
def test_saved_bytes_per_token_counts_what_autograd_saves(quantized, tmp_path):
    """A small Qwen2 in bf16 with LoRA on every linear (no dropout), its saved tensors counted by
    autograd's own hook: the per-token count is within 15% above it (the estimate is an upper bound)."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, Qwen2Config, Qwen2ForCausalLM
    from trl import ModelConfig

    config = Qwen2Config(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    kwargs = {"dtype": torch.bfloat16, "attn_implementation": "sdpa"}
    if quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    model = get_peft_model(Qwen2ForCausalLM.from_pretrained(tmp_path, **kwargs),
                           LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    weights = {p.data_ptr() for p in model.parameters()}

    def saved(tokens: int) -> int:
        storages = {}

        def keep(t):
            if t.data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        mask = torch.ones_like(ids)
        mask[0, -1] = 0  # one padded position: the masked attention TRL's padded rows get
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model(input_ids=ids, attention_mask=mask)
        return sum(storages.values())

    measured = (saved(256) - saved(128)) / 128 - (4 + 2) * 256  # per token, less the final norm's
    args = ModelConfig(model_name_or_path="x", load_in_4bit=quantized, use_peft=True, lora_r=8, lora_dropout=0.0,
                       lora_target_modules=TARGETS)
    estimate = 2 * memory.saved_bytes_per_token(memory.Shape.of(config, args, 2, 2))
    assert measured <= estimate <= 1.15 * measured


def test_the_plan_keeps_the_effective_batch_and_fits_the_budget():
    shape = qwen7b_shape()
    lengths = [250] * 120 + [589] * 8  # the shipped pairs' mean and longest prompt (bench/gpu/qwen7b.py pairs)
    roomy = memory.plan(shape, 79.1, 16, lengths, sum(lengths) / len(lengths), packed=True)
    tight = memory.plan(shape, 22.0, 16, lengths, sum(lengths) / len(lengths), packed=True)
    for p in (roomy, tight):
        assert p.micro_batch * p.accumulation == 16
        assert p.estimated_peak_gib <= p.usable_gib < p.budget_gib
    # 80 GB: the recipe's whole batch at once, nothing recomputed; 24 GB: what fits costs recompute or accumulation
    assert (roomy.micro_batch, roomy.checkpointed_layers) == (16, 0)
    assert tight.checkpointed_layers > 0 or tight.micro_batch < 16
    assert tight.estimated_step_cost >= roomy.estimated_step_cost
    # padded rows cost memory packing does not: the same budget fits less
    padded = memory.plan(shape, 79.1, 16, lengths, sum(lengths) / len(lengths), packed=False)
    assert padded.worst_micro_batch_tokens > roomy.worst_micro_batch_tokens


def test_a_budget_nothing_fits_is_one_line_naming_it():
    shape = qwen7b_shape()
    with pytest.raises(memory.UserError, match="memory_budget 6.0 GiB: even micro-batch 1"):
        memory.plan(shape, 6.0, 16, [500] * 16, 500.0, packed=True)


@pytest.mark.parametrize("value,gib", [("24GB", 22.0), ("80gb", 79.1), ("20GiB", 20.0), ("12.5", 12.5), ("device", 79.2)])
def test_memory_budget_values(value, gib):
    assert memory.budget_gib(value, 79.2) == gib


@pytest.mark.parametrize("value", ["lots", "0", "-3GiB", "24 TB"])
def test_a_bad_memory_budget_is_refused(value):
    with pytest.raises(memory.UserError, match="memory_budget"):
        memory.budget_gib(value, 79.2)
