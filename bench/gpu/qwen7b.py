#!/usr/bin/env python
"""Qwen2.5-7B-shaped model, pairs and DDS scoring for bench/gpu/run.sh (its training and scoring steps).

No weights can reach the GPU machine, so the model is Qwen2.5-7B-Instruct's exact architecture
with random weights, made on the device and saved there; the tokenizer is flipguard's embedded
BPE tokenizer (eval/embedded/tiny_model.build_tokenizer, 4,096 tokens; no Qwen tokenizer is
available offline), the config's vocabulary stays Qwen's 152,064 rows. Token counts therefore
follow the embedded tokenizer, not Qwen's. `--shape tiny` makes the same model at hidden 64 and
2 layers, so that the CPU test runs every step the GPU run does.

    python bench/gpu/qwen7b.py model  --shape 7b --out /dev/shm/q7 --json model.json
    python bench/gpu/qwen7b.py pairs  --tokenizer /dev/shm/q7 --out /tmp/pairs --rows 96 --json pairs.json
    python bench/gpu/qwen7b.py train-stats --adapter runs/sft --pairs /tmp/pairs --kind sft --json sft.json
    python bench/gpu/qwen7b.py dds    --model /dev/shm/q7 --batch_sizes 8,32,64,128 --json dds.json
    python bench/gpu/qwen7b.py matmul --json matmul.json
    python bench/gpu/qwen7b.py plan   --tokenizer /dev/shm/q7 --pairs /tmp/pairs   # the memory plans (CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

# Qwen/Qwen2.5-7B-Instruct config.json (the fields that set shape and numerics)
QWEN25_7B = dict(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", sliding_window=131072,
    max_window_layers=28, use_sliding_window=False, attention_dropout=0.0, bos_token_id=151643,
    eos_token_id=151645,
)
TINY = dict(QWEN25_7B, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
SHAPES = {"7b": QWEN25_7B, "tiny": TINY}

# The paper's DDS evaluation set (bench/bench_dds.py TEST_SPLIT_SIZES): 2,964 Unified Benchmark
# test items + 280 r/AIO = 3,244 items x 4 cases
FULL_DDS_ITEMS = 3244
CASES_PER_ITEM = 4


def write_json(path: str | None, obj: dict) -> None:
    text = json.dumps(obj, indent=2, default=str)
    print(text, flush=True)
    if path:
        Path(path).write_text(text + "\n", encoding="utf-8")


def device_facts() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu"}
    return {"device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3)}


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- model


def cmd_model(args) -> dict:
    """Random weights of the shape, made on the GPU in bf16 (CPU: fp32), saved as safetensors."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flipguard.eval.embedded.tiny_model import build_tokenizer

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    tokenizer = build_tokenizer()
    t_tok = time.perf_counter() - t0
    config = Qwen2Config(**SHAPES[args.shape], dtype=dtype)
    # the embedded tokenizer's special ids, not Qwen's: padding/eos must be ids the tokenizer has
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda" if cuda else "cpu"):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    sync()
    t_init = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    t_save = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in Path(args.out).glob("*.safetensors"))
    return {"shape": args.shape, "config": SHAPES[args.shape], "params": n_params, "dtype": str(dtype),
            "out": args.out, "tokenizer": "flipguard embedded BPE (build_tokenizer), %d tokens" % len(tokenizer),
            "seconds": {"tokenizer": round(t_tok, 2), "init": round(t_init, 2), "save": round(t_save, 2)},
            "saved_gib": round(size / 2**30, 3), **device_facts()}


# ----------------------------------------------------------------------------- pairs


def train_prompts(tokenizer, max_prompt_tokens: int) -> tuple[list, list[int], int]:
    """Real DDS train-split prompts of the shipped samples (one_token format, all 4 cases), their
    token lengths (chat template, generation prompt) and how many were over the limit."""
    from flipguard.data.unified import load_items
    from flipguard.eval.dds.prompts import build_messages
    from flipguard.eval.records import CASES
    from flipguard.runtime.chat_tokens import chat_token_ids

    prompts, lengths, over = [], [], 0
    for item in load_items(["bench"], split="train"):
        for case in CASES:
            messages = build_messages(item, case, fmt="one_token")
            n = len(chat_token_ids(tokenizer, messages, add_generation_prompt=True))
            if n > max_prompt_tokens:
                over += 1
                continue
            prompts.append(messages)
            lengths.append(n)
    return prompts, lengths, over


def cmd_pairs(args) -> dict:
    """SFT and DPO pair sets in `flipguard pairs`' layout (pairs_dir/sft, /dpo, sft.jsonl), whose
    prompts are sampled from the real train-split prompts, so token lengths follow that split."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts, lengths, over = train_prompts(tokenizer, args.max_prompt_tokens)
    rng = random.Random(args.seed)
    pick = [rng.randrange(len(prompts)) for _ in range(args.rows)]
    sft, dpo = [], []
    for k, i in enumerate(pick):
        target = "1" if k % 2 == 0 else "2"
        other = "2" if target == "1" else "1"
        sft.append({"prompt": prompts[i], "completion": [{"role": "assistant", "content": target}]})
        dpo.append({"prompt": prompts[i], "chosen": [{"role": "assistant", "content": target}],
                    "rejected": [{"role": "assistant", "content": other}]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(sft).save_to_disk(str(out / "sft"))
    Dataset.from_list(dpo).save_to_disk(str(out / "dpo"))
    with open(out / "sft.jsonl", "w", encoding="utf-8") as f:
        for row in sft:
            f.write(json.dumps(row) + "\n")
    picked = sorted(lengths[i] for i in pick)
    return {"rows": args.rows, "source": "shipped samples, DDS train split (bench datasets), one_token prompts x 4 cases",
            "source_prompts": len(prompts), "source_over_limit_dropped": over,
            "max_prompt_tokens": args.max_prompt_tokens,
            "source_prompt_tokens": {"mean": round(statistics.mean(lengths), 1), "median": statistics.median(lengths),
                                     "max": max(lengths)},
            "sampled_prompt_tokens": {"mean": round(statistics.mean(picked), 1), "median": statistics.median(picked),
                                      "max": max(picked), "total": sum(picked)}}


def cmd_train_stats(args) -> dict:
    """samples/s, tokens/s and peak memory of one trainer run, from its flipguard_training.json."""
    from datasets import load_from_disk

    info = json.loads((Path(args.adapter) / "flipguard_training.json").read_text(encoding="utf-8"))
    final = next((h for h in reversed(info.get("log_history", [])) if "train_runtime" in h), {})
    data = load_from_disk(str(Path(args.pairs) / ("sft" if args.kind == "sft" else "dpo")))
    steps = int(final.get("step") or info.get("resolved", {}).get("max_steps") or 0)
    batch = int(info.get("effective_batch_size") or 0)
    trainer_config = next((v for k, v in info.get("resolved", {}).items() if k in ("SFTConfig", "DPOConfig", "KTOConfig")), {})
    samples = steps * batch
    runtime = final.get("train_runtime")
    # tokens per sample: the prompt's mean length + the reply (answer, end of turn, newline);
    # DPO runs chosen and rejected, both through the policy (and the reference: adapter off);
    # a KTO sample is one reply (each pair gives two, unpaired)
    mean_prompt = json.loads((Path(args.pairs_json)).read_text())["sampled_prompt_tokens"]["mean"] if args.pairs_json else None
    seqs = 2 if args.kind == "dpo" else 1
    tokens = (mean_prompt + 3) * samples * seqs if mean_prompt else None
    step_s = (info.get("compute") or {}).get("step_seconds") or []
    steady = statistics.median(step_s[1:]) if len(step_s) > 1 else None
    return {"kind": args.kind, "rows": len(data),
            "step_seconds": step_s,
            "steady_samples_per_s": round(batch / steady, 3) if steady else None,
            "steady_tokens_per_s": round(tokens / samples * batch / steady, 1) if steady and tokens else None,
            "steady": "median of the optimizer steps after the first (the first holds the warm-up)", "optimizer_steps": steps, "effective_batch": batch,
            "micro_batch": trainer_config.get("per_device_train_batch_size"),
            "gradient_accumulation_steps": trainer_config.get("gradient_accumulation_steps"),
            "samples": samples, "train_runtime_s": runtime,
            "samples_per_s": round(samples / runtime, 3) if runtime else None,
            "tokens_per_s": round(tokens / runtime, 1) if runtime and tokens else None,
            "tokens_counted": "mean sampled prompt tokens + 3 reply tokens, x2 for DPO (chosen and rejected)",
            "trainer_samples_per_s": final.get("train_samples_per_second"),
            "losses": [h.get("loss") for h in info.get("log_history", []) if "loss" in h],
            "compute": info.get("compute"), "speed": info.get("speed")}


def cmd_plan(args) -> dict:
    """What train/memory.py plans for recipes/qwen7b.yaml at 7B shape on these pairs, per trainer and
    memory profile (its estimate; CPU only: no GPU is needed to plan)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer, Qwen2Config
    from trl import ModelConfig

    from flipguard.config import MEMORY_PROFILES, trainer_entry
    from flipguard.train import memory, tokenized
    from flipguard.train.speed import sample_tokens

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model_args = ModelConfig(model_name_or_path="qwen7b", load_in_4bit=True, use_bnb_nested_quant=True, use_peft=True,
                             lora_r=64, lora_dropout=0.05,
                             lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    out = {}
    for name, trainable_bytes in (("sft", 2), ("dpo", 4), ("kto", 2)):
        trainer = trainer_entry(name, "qwen7b.py plan")
        pairs = load_from_disk(str(Path(args.pairs) / trainer.pairs))
        lengths = tokenized.sequence_lengths(*tokenized.rendered(pairs, tokenizer, trainer.pairs))
        shape = memory.Shape.of(Qwen2Config(**QWEN25_7B), model_args, 2, trainable_bytes)
        for profile in ("24GB", "80GB"):
            tokens, rows = sample_tokens(lengths, trainer.concatenated_forward, packed=True)
            plan = memory.plan(shape, MEMORY_PROFILES[profile], 16, tokens, sum(tokens) / len(tokens), True, rows)
            out[f"{name} {profile}"] = {k: v for k, v in plan.as_record().items() if k != "candidates"}
    return out


# ----------------------------------------------------------------------------- DDS scoring


def forward_flops(config, lengths: list[int]) -> float:
    """Forward FLOPs of logprob scoring: 2 x non-embedding params per real token, causal attention
    (QK^T and AV: 2 x 2 x d x s^2 / 2 per layer), the LM head at the last position only."""
    d, layers = config.hidden_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * config.intermediate_size
    dense = 2 * per_layer * layers
    return sum(dense * s + 2 * d * s * s * layers + 2 * d * config.vocab_size for s in lengths)


def cmd_dds(args) -> dict:
    """Judgments/s of the hf backend in logprob mode on real DDS test prompts, per batch size."""
    import torch

    from flipguard.data.unified import load_items
    from flipguard.eval.backends.hf import HFBackend
    from flipguard.eval.dds.prompts import build_messages
    from flipguard.eval.records import CASES

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    backend = HFBackend(args.model, batch_size=8, dtype=args.dtype if cuda else "float32", show_progress=False)
    sync()
    t_load = time.perf_counter() - t0
    items = load_items(["all"], split="test")
    random.Random(0).shuffle(items)  # items drawn at random, each item's four cases in a row as the runner sends them
    conversations = [build_messages(it, case, fmt="one_token") for it in items for case in CASES][: args.judgments]
    lengths = backend.prompt_lengths(conversations)
    flops = forward_flops(backend.model.config, lengths)
    backend.choice_probs(conversations[: min(len(conversations), 16)])  # warm-up
    sweep = []
    settings = [(sharing, int(bs)) for sharing in args.sharing.split(",") for bs in args.batch_sizes.split(",")]
    for sharing, bs in settings:
        backend.prefix_sharing = sharing == "on" and backend.computed.get("prefix_sharing", False)
        backend.batch_size = bs
        times = []
        for _ in range(args.repeats):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            backend.choice_probs(conversations)
            sync()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        row = {"prefix_sharing": backend.prefix_sharing, "batch_size": bs, "seconds": [round(x, 3) for x in times],
               "median_s": round(t, 3),
               "judgments_per_s": round(len(conversations) / t, 1), "tflops_achieved": round(flops / t / 1e12, 3),
               "projected_full_pass_s": round(FULL_DDS_ITEMS * CASES_PER_ITEM * t / len(conversations), 1),
               **({"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)} if cuda else {})}
        if args.peak_tflops:
            row["mfu"] = round(flops / t / 1e12 / args.peak_tflops, 3)
        sweep.append(row)
        print(json.dumps(row), flush=True)
    best = max(sweep, key=lambda r: r["judgments_per_s"])
    best_by_sharing = {str(on): max((r for r in sweep if r["prefix_sharing"] == on), key=lambda r: r["judgments_per_s"])
                       for on in {r["prefix_sharing"] for r in sweep}}
    floor = flops * FULL_DDS_ITEMS * CASES_PER_ITEM / len(conversations)
    return {"model": args.model, "dtype": backend.computed.get("dtype"), "device_used": backend.computed.get("device"),
            "load_s": round(t_load, 1), "judgments": len(conversations),
            "prompts_from": "shipped samples, test split, all datasets, items shuffled (seed 0), each item's 4 cases "
                            "in a row (the runner's order)",
            "best_by_prefix_sharing": {k: {"batch_size": r["batch_size"], "judgments_per_s": r["judgments_per_s"],
                                           "projected_full_pass_s": r["projected_full_pass_s"], "mfu": r.get("mfu")}
                                       for k, r in best_by_sharing.items()},
            "prompt_tokens": {"mean": round(statistics.mean(lengths), 1), "max": max(lengths)},
            "full_pass": {"judgments": FULL_DDS_ITEMS * CASES_PER_ITEM,
                          "from": "the paper's test split: 3,244 items (bench/bench_dds.py TEST_SPLIT_SIZES) x 4 cases, "
                                  "at the sampled prompts' length distribution",
                          "projected_s_best": best["projected_full_pass_s"], "best_batch_size": best["batch_size"],
                          "flops": floor,
                          "floor_s_at_measured_peak": round(floor / (args.peak_tflops * 1e12), 2) if args.peak_tflops else None},
            "peak_tflops_measured": args.peak_tflops, "sweep": sweep, **device_facts()}


def cmd_matmul(args) -> dict:
    """bf16 n^3 matmul TFLOP/s (median of `repeats` after warm-up, CUDA events): the MFU ceiling."""
    import torch

    if not torch.cuda.is_available():
        n, dtype = 256, torch.float32
    else:
        n, dtype = args.n, torch.bfloat16
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    times = []
    for _ in range(args.repeats):
        if dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"n": n, "dtype": str(dtype), "repeats": args.repeats, "median_s": t,
            "tflops": round(2 * n**3 / t / 1e12, 3), "tflops_each": [round(2 * n**3 / x / 1e12, 1) for x in times],
            **device_facts()}


# ----------------------------------------------------------------------------- plant


STEP_LINE = re.compile(r"^\s+step\s+(\d+)/(\d+)\s+loss (\S+)\s+\((\d+)s,")
CHECK_LINE = re.compile(r"^\s+(phase \d|planting)(?: \(attempt (\d)\))? step (\d+): held-out check "
                        r"\((\d+) validation items, (\d+)s\)")


def cmd_plant_stats(args) -> dict:
    """`flipguard organism --base MODEL`'s costs read off its log: the training seconds at each logged
    step, each held-out check's items and seconds, and how it ended (the planted folder's organism.json,
    or the one-line failure: a random-init model cannot pass its checks in a few steps, and the step's
    figures are its costs, not the plant)."""
    lines = Path(args.log).read_text(errors="replace").splitlines()
    runs: list[list[dict]] = []
    checks = []
    for line in lines:
        m = STEP_LINE.match(line)
        if m:
            step, steps, loss, elapsed = int(m[1]), int(m[2]), float(m[3]), int(m[4])
            if step == 1:
                runs.append([])
            runs[-1].append({"step": step, "of": steps, "loss": loss, "elapsed_s": elapsed})
        m = CHECK_LINE.match(line)
        if m:
            checks.append({"phase": m[1], "attempt": int(m[2] or 1), "step": int(m[3]), "items": int(m[4]),
                           "seconds": int(m[5])})
    out = {"rc": args.rc, "train_logged": runs, "checks": checks,
           "seconds_per_step": [round(r[-1]["elapsed_s"] / r[-1]["step"], 2) for r in runs if r and r[-1]["step"] > 1]}
    info = Path(args.organism) / "organism.json"
    if info.is_file():
        planted = json.loads(info.read_text())
        out.update(checks_passed=True, build_seconds=planted.get("build_seconds"),
                   capability=planted.get("capability"), steps_trained=planted.get("steps_trained"))
    else:
        error = next((ln for ln in reversed(lines) if "error:" in ln), None)
        out.update(checks_passed=False, failure=error)
        if args.rc not in (0, 2) or error is None or "failed its held-out checks" not in error:
            raise SystemExit(f"plant-stats: flipguard organism ended otherwise (rc {args.rc}): {error or lines[-5:]}")
    return {**out, **device_facts()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    m.add_argument("--out", required=True)
    pr = sub.add_parser("pairs")
    pr.add_argument("--tokenizer", required=True)
    pr.add_argument("--out", required=True)
    pr.add_argument("--rows", type=int, default=96)
    pr.add_argument("--max_prompt_tokens", type=int, default=768)
    pr.add_argument("--seed", type=int, default=0)
    ts = sub.add_parser("train-stats")
    ts.add_argument("--adapter", required=True)
    ts.add_argument("--pairs", required=True)
    ts.add_argument("--pairs_json")
    ts.add_argument("--kind", choices=["sft", "dpo", "kto"], required=True)
    d = sub.add_parser("dds")
    d.add_argument("--model", required=True)
    d.add_argument("--dtype", default="bfloat16")
    d.add_argument("--batch_sizes", default="8,32,64,128")
    d.add_argument("--judgments", type=int, default=512)
    d.add_argument("--repeats", type=int, default=2)
    d.add_argument("--peak_tflops", type=float, default=None)
    d.add_argument("--sharing", default="on,off", help="prefix sharing settings to sweep, in order (on, off)")
    pl = sub.add_parser("plan", help=cmd_plan.__doc__)
    pl.add_argument("--tokenizer", required=True)
    pl.add_argument("--pairs", required=True)
    mm = sub.add_parser("matmul")
    mm.add_argument("--n", type=int, default=8192)
    mm.add_argument("--repeats", type=int, default=20)
    ps = sub.add_parser("plant-stats", help=cmd_plant_stats.__doc__.split("\n")[0])
    ps.add_argument("--log", required=True)
    ps.add_argument("--rc", type=int, required=True)
    ps.add_argument("--organism", required=True, help="the --out the planting was given")
    for s in (m, pr, ts, d, pl, mm, ps):
        s.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    fn = {"model": cmd_model, "pairs": cmd_pairs, "train-stats": cmd_train_stats, "dds": cmd_dds,
          "plan": cmd_plan, "matmul": cmd_matmul, "plant-stats": cmd_plant_stats}[args.cmd]
    write_json(args.json, fn(args))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
