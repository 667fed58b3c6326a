#!/usr/bin/env python
"""DDS throughput benchmark: logprob mode vs the paper's generate mode, and report time.

Run by hand (not a test): `python bench/bench_dds.py` writes bench/results.json and
bench/results.md. One model, one backend (hf, CPU by default), one process:

  (a) logprob   — one-token prompts (Listing 3), P("1") vs P("2") from one forward pass,
                  batched;
  (b) generate  — the paper's JSON answer with reasoning, 128 new tokens forced
                  (ignore_eos), one request at a time as the DialDefer authors ran it;
  (c) generate  — the same, batched;
  (d) report    — `build_report` on synthetic records: 3,244 items x 4 cases,
                  2,000 bootstrap replicates.

Every mode goes through the real runner (`run_records`: keying, parsing, appending to a
RecordStore in a temp folder) on real prompts from the shipped sample, after a warm-up.
Each measurement is repeated and the median is reported.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The paper's evaluation set: 2,964 Unified Benchmark test items + 280 r/AIO = 3,244.
TEST_SPLIT_SIZES = {
    "truthfulqa": 790, "halueval_qa": 300, "plausibleqa": 300, "bbq": 300, "socialiqa": 300,
    "amqa": 240, "harp_mcq": 300, "gpqa": 134, "advisorqa": 300, "aio": 280,
}
TARGET_LOGPROB_VS_ONE_AT_A_TIME = 20.0
TARGET_REPORT_SECONDS = 2.0


@dataclasses.dataclass
class BenchArgs:
    """Measure DDS judgments/s (logprob vs generate) and full-report time; writes bench/results.*"""

    model: str | None = dataclasses.field(default=None, metadata={"help": "Model path/id (default: the tiny local model, created once)."})
    device: str = dataclasses.field(default="cpu", metadata={"help": "Device for the hf backend."})
    threads: int | None = dataclasses.field(default=None, metadata={"help": "torch CPU threads (default: torch's own choice)."})
    repeats: int = dataclasses.field(default=3, metadata={"help": "Repetitions of every measurement; medians are reported."})
    warmup: int = dataclasses.field(default=4, metadata={"help": "Requests per mode run once before timing."})
    logprob_requests: int = dataclasses.field(default=64, metadata={"help": "Judgments timed in logprob mode."})
    logprob_batch_size: int = dataclasses.field(default=8, metadata={"help": "Batch size in logprob mode (headline figure)."})
    logprob_batch_sweep: str = dataclasses.field(default="4,16,32", metadata={"help": "Other logprob batch sizes also timed (comma list; empty: none)."})
    generate_requests: int = dataclasses.field(default=16, metadata={"help": "Judgments timed in one-at-a-time generate mode."})
    batched_generate_requests: int = dataclasses.field(default=32, metadata={"help": "Judgments timed in batched generate mode."})
    generate_batch_size: int = dataclasses.field(default=16, metadata={"help": "Batch size in batched generate mode."})
    max_new_tokens: int = dataclasses.field(default=128, metadata={"help": "Tokens forced per generate reply (the paper's typical reply)."})
    n_boot: int = dataclasses.field(default=2000, metadata={"help": "Bootstrap replicates for the report timing."})
    skip_models: bool = dataclasses.field(default=False, metadata={"help": "Only time the report."})
    skip_report: bool = dataclasses.field(default=False, metadata={"help": "Only time the model modes."})
    shared_machine: bool = dataclasses.field(default=False, metadata={"help": "Note in results.md that other jobs shared the CPU."})
    out_dir: str = dataclasses.field(default=str(HERE), metadata={"help": "Where results.json / results.md go."})


# --------------------------------------------------------------------------- machine


def machine_info() -> dict:
    import torch
    import transformers

    from flipguard.runtime.threads import cpu_name

    cpu = cpu_name(default=platform.processor() or "")
    ram_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": ram_gib,
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }


# --------------------------------------------------------------------------- workloads


def sample_requests(n: int, fmt: str, offset: int = 0) -> list[tuple]:
    """n distinct (item, case) requests from the shipped sample, datasets interleaved."""
    from flipguard.data.unified import load_items
    from flipguard.eval.records import CASES

    items = load_items(["bench"], split="test")
    by_ds: dict[str, list] = {}
    for it in items:
        by_ds.setdefault(it.dataset, []).append(it)
    interleaved = [it for group in zip(*by_ds.values()) for it in group]
    pairs = [(it, case) for it in interleaved for case in CASES]
    if offset + n > len(pairs):
        raise SystemExit(f"the shipped sample has {len(pairs)} (item, case) requests; asked for {offset + n}")
    return [(it, case, fmt) for it, case in pairs[offset : offset + n]]


def make_records(requests, model_id: str, mode: str, gen_config, tag: str):
    from flipguard.eval.dds.prompts import build_messages
    from flipguard.eval.records import EXPECTED_CHOICE, Record, keyed

    recs = []
    for item, case, fmt in requests:
        rec = Record(
            key="", protocol="dds", item_id=item.id, dataset=item.dataset, case=case,
            expected=EXPECTED_CHOICE[case], model=model_id, backend="hf", mode=mode,
            messages=build_messages(item, case, fmt=fmt), extra={"bench": tag},
        )
        recs.append(keyed(rec, gen_config))
    return recs


def timed_run(backend, records, *, batch_size: int, chunk_size: int, gen_config=None) -> float:
    """Seconds for run_records over `records` into a fresh store (nothing resumed)."""
    from flipguard.eval.dds.parse import parse_choice
    from flipguard.eval.records import RecordStore
    from flipguard.eval.runner import run_records

    backend.batch_size = batch_size
    with tempfile.TemporaryDirectory() as tmp:
        store = RecordStore(Path(tmp) / "records.jsonl")
        t0 = time.perf_counter()
        n = run_records(store, records, backend, gen_config=gen_config, parse=parse_choice,
                        chunk_size=chunk_size, progress=False)
        seconds = time.perf_counter() - t0
        stored = list(store.iter_records())
    if n != len(records) or len(stored) != len(records):
        raise SystemExit(f"benchmark run stored {len(stored)} of {len(records)} records")
    return seconds


def bench_models(args: BenchArgs) -> dict:
    from flipguard.eval.backends.base import GenerationConfig, get_backend

    model = args.model
    if model is None:
        from flipguard.eval.embedded.tiny_model import ensure_tiny_model

        model = ensure_tiny_model()
    backend = get_backend("hf", model, device=args.device, batch_size=1, show_progress=False)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    n_lp, n_g1, n_gb = args.logprob_requests, args.generate_requests, args.batched_generate_requests
    lp_reqs = sample_requests(n_lp, "one_token")
    g1_reqs = sample_requests(n_g1, "json")
    gb_reqs = sample_requests(n_gb, "json", offset=n_g1)
    plans = {
        "logprob_batched": dict(requests=lp_reqs, mode="logprob", gen=None,
                                batch_size=args.logprob_batch_size, chunk_size=n_lp),
        "generate_one_at_a_time": dict(requests=g1_reqs, mode="generate", gen=gen, batch_size=1, chunk_size=1),
        "generate_batched": dict(requests=gb_reqs, mode="generate", gen=gen,
                                 batch_size=args.generate_batch_size, chunk_size=n_gb),
    }
    sweep = [int(x) for x in args.logprob_batch_sweep.split(",") if x.strip()]
    for bs in sorted(set(sweep) - {args.logprob_batch_size}):
        plans[f"logprob_batch_{bs}"] = dict(requests=lp_reqs, mode="logprob", gen=None, batch_size=bs, chunk_size=n_lp)
    for name, plan in plans.items():  # warm-up: same code paths, not timed
        warm = make_records(plan["requests"][: args.warmup], backend.model_id, plan["mode"], plan["gen"], f"warmup-{name}")
        timed_run(backend, warm, batch_size=plan["batch_size"], chunk_size=plan["chunk_size"], gen_config=plan["gen"])

    results: dict[str, dict] = {}
    for name, plan in plans.items():
        results[name] = {"requests": len(plan["requests"]), "batch_size": plan["batch_size"], "seconds": []}
        if plan["mode"] == "generate":
            results[name]["new_tokens_per_request"] = args.max_new_tokens
    for rep in range(args.repeats):  # interleave modes so drift in machine load hits all of them
        for name, plan in plans.items():
            recs = make_records(plan["requests"], backend.model_id, plan["mode"], plan["gen"], f"{name}-{rep}")
            sec = timed_run(backend, recs, batch_size=plan["batch_size"], chunk_size=plan["chunk_size"], gen_config=plan["gen"])
            results[name]["seconds"].append(round(sec, 4))
            print(f"  [{rep + 1}/{args.repeats}] {name:<24} {len(recs) / sec:9.2f} judgments/s", flush=True)
    for res in results.values():
        per_s = [res["requests"] / s for s in res["seconds"]]
        res["judgments_per_s_runs"] = [round(x, 3) for x in per_s]
        res["judgments_per_s"] = round(statistics.median(per_s), 3)
    lp = results["logprob_batched"]["judgments_per_s"]
    one = results["generate_one_at_a_time"]["judgments_per_s"]
    for res in results.values():
        if res.get("new_tokens_per_request") is None:
            res["ratio_vs_generate_one_at_a_time"] = round(res["judgments_per_s"] / one, 1)
    ratios = {
        "logprob_vs_generate_one_at_a_time": round(lp / results["generate_one_at_a_time"]["judgments_per_s"], 1),
        "logprob_vs_generate_batched": round(lp / results["generate_batched"]["judgments_per_s"], 1),
        "generate_batched_vs_one_at_a_time": round(
            results["generate_batched"]["judgments_per_s"] / results["generate_one_at_a_time"]["judgments_per_s"], 1),
    }
    return {"model": backend.model_id, "backend": "hf", "device": backend.device, "modes": results, "ratios": ratios,
            "target_logprob_vs_one_at_a_time": TARGET_LOGPROB_VS_ONE_AT_A_TIME,
            "meets_target": ratios["logprob_vs_generate_one_at_a_time"] >= TARGET_LOGPROB_VS_ONE_AT_A_TIME}


# --------------------------------------------------------------------------- report


# the paper's worked example (C1-true 60, C1-false 80 -> C2-correct 75, C2-incorrect 65: DDS +30)
WORKED_EXAMPLE = {"c1_true": 0.60, "c1_false": 0.80, "c2_correct": 0.75, "c2_incorrect": 0.65}


def bench_report(args: BenchArgs) -> dict:
    try:
        from flipguard.eval.dds.report import build_report
    except ImportError as exc:
        return {"status": f"skipped: flipguard.eval.dds.report is not available ({exc})"}
    from flipguard.eval.synthetic import synthetic_records

    records = synthetic_records(TEST_SPLIT_SIZES, accuracies=WORKED_EXAMPLE)
    build_report(records[: 4 * 200], n_boot=50, seed=0)  # warm-up (imports, caches)
    seconds = []
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        build_report(records, n_boot=args.n_boot, seed=0)
        seconds.append(round(time.perf_counter() - t0, 4))
        print(f"  [{rep + 1}/{args.repeats}] report                   {seconds[-1]:9.3f} s", flush=True)
    med = statistics.median(seconds)
    return {"status": "ok", "items": sum(TEST_SPLIT_SIZES.values()), "records": len(records),
            "n_boot": args.n_boot, "seconds": seconds, "median_seconds": round(med, 4),
            "target_seconds": TARGET_REPORT_SECONDS, "meets_target": med < TARGET_REPORT_SECONDS}


# --------------------------------------------------------------------------- output


def render_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# DDS benchmark results",
        "",
        f"Measured {res['date']} with `{res['command']}` (medians of {res['args']['repeats']} repeats).",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores visible, torch threads {m['torch_threads']}",
        f"- RAM: {m['ram_gib']} GiB; GPU: {m['gpu'] or 'none'}",
        f"- Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}",
        f"- {m['platform']}",
    ]
    if "load_average_at_start" in res:
        start, end = res["load_average_at_start"], res.get("load_average_at_end", [None])
        lines.append(f"- Load average (1 min) at start / end of the run: {start[0]} / {end[0]}")
    if res["args"].get("shared_machine"):
        lines.append("- **The CPU was shared with other jobs during the run**, so absolute figures are noisy;"
                     " modes were interleaved within each repeat so that ratios are less affected.")
    mb = res.get("models")
    if mb:
        a = res["args"]
        lines += [
            "",
            f"## Judgments per second ({mb['backend']} backend, {mb['device']}, model `{mb['model']}`)",
            "",
            "| mode | requests | batch | judgments/s (median) | runs |",
            "|---|---:|---:|---:|---|",
        ]
        labels = {
            "logprob_batched": "logprob (one-token prompt, P(\"1\") vs P(\"2\"))",
            "generate_one_at_a_time": f"generate, JSON + reasoning, {a['max_new_tokens']} tokens forced, one at a time (authors' setting)",
            "generate_batched": f"generate, JSON + reasoning, {a['max_new_tokens']} tokens forced, batched",
        }
        for name, r in mb["modes"].items():
            if name not in labels:
                continue
            runs = ", ".join(f"{x:g}" for x in r["judgments_per_s_runs"])
            lines.append(f"| {labels[name]} | {r['requests']} | {r['batch_size']} | {r['judgments_per_s']:g} | {runs} |")
        sweep = sorted((r for r in mb["modes"].values() if "ratio_vs_generate_one_at_a_time" in r),
                       key=lambda r: r["batch_size"])
        if len(sweep) > 1:
            lines += ["", "logprob mode by batch size (same prompts, interleaved in the same repeats):", "",
                      "| batch | judgments/s (median) | runs | vs one-at-a-time generate |", "|---:|---:|---|---:|"]
            for r in sweep:
                runs = ", ".join(f"{x:g}" for x in r["judgments_per_s_runs"])
                lines.append(f"| {r['batch_size']} | {r['judgments_per_s']:g} | {runs} | {r['ratio_vs_generate_one_at_a_time']:g}x |")
        ra = mb["ratios"]
        ok = "meets" if mb["meets_target"] else "MISSES"
        lines += [
            "",
            f"- logprob vs one-at-a-time generate: **{ra['logprob_vs_generate_one_at_a_time']:g}x** "
            f"(target >= {mb['target_logprob_vs_one_at_a_time']:g}x: {ok})",
            f"- logprob vs batched generate: **{ra['logprob_vs_generate_batched']:g}x**",
            f"- batched vs one-at-a-time generate: {ra['generate_batched_vs_one_at_a_time']:g}x",
        ]
    rb = res.get("report")
    if rb:
        lines += ["", "## Full report", ""]
        if rb.get("status") != "ok":
            lines.append(f"Not measured: {rb.get('status')}")
        else:
            ok = "meets" if rb["meets_target"] else "MISSES"
            runs = ", ".join(f"{x:.3f}" for x in rb["seconds"])
            lines.append(
                f"`build_report` on {rb['items']:,} synthetic items x 4 cases ({rb['records']:,} records), "
                f"{rb['n_boot']:,} bootstrap replicates: **{rb['median_seconds']:.3f} s** median "
                f"(runs: {runs}; target < {rb['target_seconds']:g} s: {ok})."
            )
    lines += ["", "Raw figures: `bench/results.json`. How to run and what is measured: `bench/README.md`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flipguard.config import parse_dataclasses
    from flipguard.files import atomic_write_json, atomic_write_text

    argv = sys.argv[1:] if argv is None else argv
    args = parse_dataclasses(argv, BenchArgs, prog="bench_dds.py", description=BenchArgs.__doc__)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    res = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python bench/bench_dds.py", *map(shlex.quote, argv)]).strip(),
        "args": dataclasses.asdict(args),
        "machine": machine_info(),
    }
    res["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    if not args.skip_models:
        print("model modes:", flush=True)
        res["models"] = bench_models(args)
    if not args.skip_report:
        print("report:", flush=True)
        res["report"] = bench_report(args)
    res["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out_dir)
    atomic_write_json(out / "results.json", res)
    atomic_write_text(out / "results.md", render_markdown(res))
    print(render_markdown(res))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
