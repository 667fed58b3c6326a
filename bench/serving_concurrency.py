"""Throughput of `--backend openai` at 1/2/4/8 requests in flight, against a real server.

By default this starts `transformers serve` (tests/served.py) on 127.0.0.1 and serves the
embedded tiny model; `--base_url` measures a server you started yourself (vLLM,
llama.cpp), named with `--server`. Each setting sends the same `--n` generate requests
(distinct real DDS prompts, greedy, `--max_tokens` new tokens) through OpenAIBackend with
`max_concurrency` fixed, after one warm-up request; the settings are interleaved within
each repeat (a change in machine load hits all of them) and medians over `--repeats` are
reported with each setting's speed relative to one request at a time. Writes
bench/serving_concurrency.{json,md} (appending this server's rows to those already there).

    python bench/serving_concurrency.py                      # transformers serve, tiny model
    python bench/serving_concurrency.py --server vllm --base_url http://127.0.0.1:8000/v1 --model MODEL \
        --note "how the server was started"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the server launcher the tests use
sys.path.insert(0, str(HERE))


def prompts(n: int) -> list[list[dict]]:
    from flipguard.data.unified import load_items
    from flipguard.eval.dds.prompts import build_messages

    items = load_items(["truthfulqa", "gpqa", "harp_mcq", "bbq"], split="test")
    cases = ("c1_true", "c1_false", "c2_correct", "c2_incorrect")
    return [build_messages(items[i % len(items)], cases[i % 4], fmt="json") for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="transformers", help="server kind label (transformers starts one here)")
    ap.add_argument("--base_url", default=None, help="an already running server; default: start transformers serve")
    ap.add_argument("--model", default=None, help="model name/path the server serves (default: the embedded tiny model)")
    ap.add_argument("--serve_args", default="", help="extra `transformers serve` flags, e.g. --continuous-batching")
    ap.add_argument("--label", default=None, help="row label (default: --server plus --serve_args)")
    ap.add_argument("--n", type=int, default=24, help="requests per setting")
    ap.add_argument("--max_tokens", type=int, default=64, help="new tokens per request (greedy)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--note", default="", help="how the server was started (written with the results)")
    ap.add_argument("--shared_machine", action="store_true", help="note that other jobs shared the CPU")
    ap.add_argument("--out_dir", default=str(HERE))
    args = ap.parse_args(argv)

    from bench_dds import machine_info

    from flipguard.eval.backends.base import GenerationConfig, get_backend

    model = args.model
    if model is None:
        from flipguard.eval.embedded.tiny_model import ensure_tiny_model

        model = ensure_tiny_model()
    levels = [int(c) for c in args.concurrency.split(",")]
    convs = prompts(args.n)
    config = GenerationConfig(max_new_tokens=args.max_tokens)
    server = None
    ready_s = None
    if args.base_url is None:
        from served import TransformersServer

        server = TransformersServer(tempfile.mkdtemp(prefix="fg-serve-bench-"), extra_args=tuple(args.serve_args.split()))
        t0 = time.monotonic()
        server.start()
        ready_s = time.monotonic() - t0
        base_url = server.base_url
    else:
        base_url = args.base_url
    label = args.label or " ".join([args.server, args.serve_args]).strip()
    times: dict[int, list[float]] = {c: [] for c in levels}
    try:
        backends = {c: get_backend("openai", model, base_url=base_url, max_concurrency=c, show_progress=False,
                                   timeout=600) for c in levels}
        backends[levels[0]].generate(convs[:1], config)  # warm-up: loads the model
        for r in range(args.repeats):
            for c in levels:
                t0 = time.perf_counter()
                out = backends[c].generate(convs, config)
                times[c].append(time.perf_counter() - t0)
                assert len(out) == len(convs)
                print(f"repeat {r + 1}/{args.repeats} concurrency {c}: {times[c][-1]:.2f} s", flush=True)
    finally:
        if server is not None:
            server.stop()
    base = statistics.median(times[levels[0]])
    rows = [{"server": label, "concurrency": c, "median_s": round(statistics.median(t), 3),
             "req_per_s": round(args.n / statistics.median(t), 3), "speed_vs_1": round(base / statistics.median(t), 3),
             "all_s": [round(x, 3) for x in t]} for c, t in times.items()]
    machine = machine_info()
    machine["load_avg_after"] = os.getloadavg()
    result = {"server": label, "model": str(model), "n": args.n, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "ready_s": round(ready_s, 1) if ready_s else None,
              "command": "python bench/serving_concurrency.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "shared_machine": args.shared_machine, "note": args.note, "machine": machine, "rows": rows}
    out_dir = Path(args.out_dir)
    json_path = out_dir / "serving_concurrency.json"
    runs = json.loads(json_path.read_text()) if json_path.exists() else []
    runs = [r for r in runs if r["server"] != label] + [result]
    json_path.write_text(json.dumps(runs, indent=1) + "\n")
    write_md(runs, out_dir / "serving_concurrency.md")
    for row in rows:
        print(f"{label}: concurrency {row['concurrency']}: {row['req_per_s']} req/s ({row['speed_vs_1']}x vs 1)")
    return 0


def write_md(runs: list[dict], path: Path) -> None:
    lines = ["# `--backend openai` throughput by requests in flight", "",
             "Written by `bench/serving_concurrency.py` (see its docstring). Medians over the repeats; "
             "speed is relative to one request at a time on the same server.", ""]
    for run in runs:
        m = run["machine"]
        lines += [f"## {run['server']}", "",
                  f"`{run['command']}` — model {Path(run['model']).name}, {run['n']} generate requests of "
                  f"{run['max_tokens']} new tokens, {run['repeats']} repeats"
                  + (f", server ready in {run['ready_s']} s" if run.get("ready_s") else ""), "",
                  f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB, {m['platform']}, python {m['python']}, "
                  f"torch {m['torch']}, transformers {m['transformers']}; load average after "
                  f"{', '.join(f'{x:.2f}' for x in m['load_avg_after'])}"
                  + ("; **the CPU was shared with other jobs**" if run.get("shared_machine") else ""), "",
                  *([f"Server: {run['note']}", ""] if run.get("note") else []),
                  "| in flight | median s | requests/s | speed vs 1 | all repeats (s) |", "|---|---|---|---|---|"]
        lines += [f"| {r['concurrency']} | {r['median_s']} | {r['req_per_s']} | {r['speed_vs_1']}x | "
                  f"{', '.join(str(x) for x in r['all_s'])} |" for r in run["rows"]]
        lines.append("")
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
