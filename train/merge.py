"""Merge a trained LoRA adapter into its base model for serving.

    flipguard merge recipes/qwen7b.yaml --adapter runs/qwen7b/dpo --out runs/qwen7b/dpo-merged \
        [--metrics_json before_after.json]

The base is loaded unquantized (bf16 on GPU, fp32 on CPU; --merge_dtype to choose),
never in 4 bits: merging into 4-bit weights would round the update away. The adapter
was trained against the 4-bit base, so the merged model differs from base+adapter by
the base's quantization error only. That difference is measured, not assumed: on up to
--gap_prompts prompts of the recipe's pair set (pairs.dir/sft.jsonl) the merge gap is
max |P_merged("1") - P_trained("1")|, with P from the hf eval backend (softmax at the last
prompt position, chat template with the generation prompt) and "trained" = the base as
the recipe trained it (4-bit when load_in_4bit, else its dtype) + the adapter. Past
--max_merge_gap a WARNING is printed; without a pair set the check is skipped (null).
Output: safetensors weights, tokenizer, generation config, flipguard_merge.json (merge
settings and gap) and a README model card (recipe, pair counts, merge gap, before/after
metrics when given).

--out is never the adapter folder (refused), and is written without touching anything
flipguard did not write: a new folder, or one flipguard's merge created (its
.flipguard.json lists the files it wrote; only those are replaced, flipguard_merge.json
last). An existing non-empty folder that flipguard did not create is refused unless
--overwrite, which replaces only the files the merge writes and keeps the rest.

Serving and evaluating:
- merged:   `vllm serve runs/qwen7b/dpo-merged` (an OpenAI-compatible server), or
            `flipguard eval --backend hf --model runs/qwen7b/dpo-merged ...`.
- unmerged: the hf backend loads base + adapter with peft:
            `get_backend("hf", "Qwen/Qwen2.5-7B-Instruct", adapter="runs/qwen7b/dpo")`;
            with vLLM, `LLM(model=base, enable_lora=True, max_lora_rank=64)` and
            `LoRARequest("dpo", 1, "runs/qwen7b/dpo")` per request (r 64 exceeds vLLM's
            default max_lora_rank of 16), or
            `vllm serve BASE --enable-lora --max-lora-rank 64 --lora-modules dpo=runs/qwen7b/dpo`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from flipguard.config import PairsArguments, parse_recipe
from flipguard.data.pair_sets import read_counts
from flipguard.data.schema import DataError, read_jsonl
from flipguard.errors import RecordError
from flipguard.eval.backends.hf import HFBackend
from flipguard.files import staging_dir
from flipguard.publish import check_publish, publish_dir
from flipguard.runtime.adapters import check_adapter, load_peft_adapter
from flipguard.runtime.threads import THREADS_HELP, configure_threads
from flipguard.train import utils
from flipguard.train.utils import TrainError

MERGE_INFO_FILE = "flipguard_merge.json"
MERGE_WRITER = "train/merge.py"  # its output's manifest: written_by
OVERWRITE_HINT = ", or pass --overwrite to replace only the files the merge writes"


@dataclasses.dataclass
class MergeArguments:
    """What to merge and where to write it."""

    adapter: str = dataclasses.field(default=None, metadata={"help": "Adapter folder (a trainer's output_dir)."})
    out: str = dataclasses.field(default=None, metadata={"help": "Folder for the merged model."})
    merge_dtype: str = dataclasses.field(
        default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU), bfloat16, float16 or float32.",
                                  "choices": ["auto", "bfloat16", "float16", "float32"]}
    )
    metrics_json: str | None = dataclasses.field(default=None, metadata={"help": "Before/after metrics for the model card."})
    gap_prompts: int = dataclasses.field(
        default=32, metadata={"help": "Train prompts (from pairs.dir/sft.jsonl) on which the merge gap is measured; 0 = skip."}
    )
    max_merge_gap: float = dataclasses.field(
        default=0.05, metadata={"help": "WARNING when max |P_merged('1') - P_trained('1')| over those prompts exceeds this."}
    )
    overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "Write into an existing non-empty --out that flipguard did not create, replacing "
                                         "only the files the merge writes (others are kept). A folder a previous merge "
                                         "wrote is replaced without it; --out equal to --adapter is always refused."}
    )
    foreign_adapter: bool = dataclasses.field(
        default=False, metadata={"help": "Merge an adapter trained outside flipguard (no flipguard_training.json). "
                                         "Without it such a folder is refused as an unfinished training."}
    )
    threads: int | None = dataclasses.field(default=None, metadata={"help": THREADS_HELP})


def check_out_dir(adapter: str, out: str, overwrite: bool = False) -> None:
    """Refuse, before any model is loaded, an --out that would destroy what flipguard did
    not write: the adapter itself (or a folder holding it), a file, a non-empty folder a merge
    did not write (the user's, or another flipguard output: a run, a pair set), unless
    overwrite (publish.check_publish, the check publish_dir makes again at the end)."""
    a, o = Path(adapter).resolve(), Path(out).resolve()
    if a == o or o in a.parents:
        raise TrainError(f"--out {out}: is (or holds) the adapter folder {adapter}; the merge would replace it. "
                         "Choose another --out")
    try:
        check_publish(out, writer=MERGE_WRITER, overwrite=overwrite, overwrite_hint=OVERWRITE_HINT)
    except RecordError as exc:
        raise TrainError(str(exc)) from None


def sample_gap_prompts(pairs_dir: str | None, n: int = 32) -> tuple[list[list[dict]], str | None]:
    """The first `n` distinct prompts of pairs_dir/sft.jsonl (a seeded shuffle), and the
    file; ([], reason) when there is no pair set to sample from."""
    path = Path(pairs_dir) / "sft.jsonl" if pairs_dir else None
    if path is None or not path.is_file():
        return [], f"no pair set to sample prompts from ({path or 'no pairs.dir'})"
    prompts, seen = [], set()
    try:
        rows = read_jsonl(path)
    except DataError as exc:
        return [], f"{path}: unreadable ({exc})"
    for _, row in rows:
        key = json.dumps(row.get("prompt"), sort_keys=True)
        if row.get("prompt") and key not in seen:
            seen.add(key)
            prompts.append(row["prompt"])
        if len(prompts) >= n:
            break
    return prompts, str(path)


def measure_merge_gap(merged_dir: str | Path, base_path: str, adapter: str, prompts: list[list[dict]],
                      quantization_config=None, dtype: str = "auto", device: str | None = None,
                      foreign_adapter: bool = False) -> dict[str, Any]:
    """max and mean |ΔP("1")| between the merged model and base (as trained) + adapter,
    both scored by the hf eval backend; one model in memory at a time."""
    def p1(**kwargs) -> list[float]:
        backend = HFBackend(device=device, show_progress=False, **kwargs)
        out = [p["1"] for p in backend.choice_probs(prompts)]
        del backend
        gc.collect()
        return out

    merged = p1(model=str(merged_dir))
    trained = p1(model=base_path, adapter=adapter, dtype=dtype or "auto", quantization_config=quantization_config,
                 foreign_adapter=foreign_adapter)
    deltas = [abs(a - b) for a, b in zip(merged, trained)]
    return {"max_abs_delta_p1": max(deltas), "mean_abs_delta_p1": sum(deltas) / len(deltas), "n_prompts": len(deltas)}


def merge_adapter(base_path: str, adapter: str, out: str, dtype: str = "auto", card_config: dict | None = None,
                  metrics: dict | None = None, pairs_dir: str | None = None,
                  gap_check: Callable[[Path], dict[str, Any]] | None = None, overwrite: bool = False,
                  foreign_adapter: bool = False) -> Path:
    """Merge into a temp folder, then publish it (publish.publish_dir: only flipguard's own
    files in --out are replaced, flipguard_merge.json last); returns the output folder.
    `gap_check(saved_dir)` measures the merge gap before the folder is published; its
    result goes into flipguard_merge.json and the model card (None: not measured)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer


    check_out_dir(adapter, out, overwrite)
    check_adapter(adapter, foreign_ok=foreign_adapter, foreign_flag="--foreign_adapter true")
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    utils.check_model_loadable(base_path)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    # never quantized; on the GPU when there is one (a 7B merge on the CPU's bf16 is minutes)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype),
                                                device_map={"": 0} if cuda else None)
    model = load_peft_adapter(base, adapter, foreign_ok=foreign_adapter)
    merged = model.merge_and_unload()
    tok_src = adapter if (Path(adapter) / "tokenizer_config.json").is_file() else base_path
    tokenizer = AutoTokenizer.from_pretrained(tok_src)

    out_path = Path(out)
    with staging_dir(out_path) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)  # also writes generation_config.json
        tokenizer.save_pretrained(tmp)
        computed = {"device": str(next(merged.parameters()).device), "seconds_load_merge_save": round(time.perf_counter() - started, 2)}
        if cuda:
            computed.update(device_name=torch.cuda.get_device_name(),
                            peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3))
        del merged, model, base
        gc.collect()
        gap = gap_check(tmp) if gap_check else None
        info_path = Path(adapter) / "flipguard_training.json"
        config = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
        config.update(card_config or {})
        config.update({"base_model": base_path, "adapter": str(adapter), "merge_dtype": dtype})
        counts = read_counts(pairs_dir) or config.get("pair_counts")
        merge_info = {"base_model": base_path, "adapter": str(adapter), "merge_dtype": dtype, "merge_gap": gap,
                      "computed": computed}
        (tmp / MERGE_INFO_FILE).write_text(json.dumps(merge_info, indent=2, default=str) + "\n", encoding="utf-8")
        card = utils.model_card(config, counts, metrics, title=f"flipguard merged model ({Path(adapter).name})")
        (tmp / "README.md").write_text(card.rstrip("\n") + "\n\n" + merge_gap_line(gap) + "\n", encoding="utf-8")
        try:
            publish_dir(tmp, out_path, writer=MERGE_WRITER, overwrite=overwrite, last=(MERGE_INFO_FILE,),
                        overwrite_hint=OVERWRITE_HINT)
        except RecordError as exc:
            raise utils.TrainError(str(exc)) from None
    return out_path


def merge_gap_line(gap: dict[str, Any] | None) -> str:
    """One sentence for the console and the model card."""
    if not gap or gap.get("max_abs_delta_p1") is None:
        reason = (gap or {}).get("skipped") or "not measured"
        return f"Merge gap: not measured ({reason})."
    return (f"Merge gap: max |ΔP(\"1\")| = {gap['max_abs_delta_p1']:.4f} (mean {gap['mean_abs_delta_p1']:.4f}) "
            f"between the merged model and the base as trained ({gap.get('trained_base', '?')}) + adapter, over "
            f"{gap['n_prompts']} train prompts of {gap.get('prompts_from')}.")


def main(argv: list[str], prog: str = "train/merge.py") -> int:
    from trl import ModelConfig, get_quantization_config


    (merge_args, model_args, pairs_args), recipe_path, recipe = parse_recipe(
        argv, (MergeArguments, ModelConfig, PairsArguments), trainer=None, prog=prog
    )
    if not merge_args.adapter or not merge_args.out:
        raise utils.TrainError("--adapter DIR and --out DIR are required")
    check_out_dir(merge_args.adapter, merge_args.out, merge_args.overwrite)
    check_adapter(merge_args.adapter, foreign_ok=merge_args.foreign_adapter, foreign_flag="--foreign_adapter true")
    configure_threads(merge_args.threads)
    metrics = None
    if merge_args.metrics_json:
        try:
            metrics = json.loads(Path(merge_args.metrics_json).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise utils.TrainError(f"{merge_args.metrics_json}: cannot read metrics ({exc})") from None
    base = utils.resolve_model_path(model_args.model_name_or_path)
    prompts, source = sample_gap_prompts(pairs_args.pairs_dir, merge_args.gap_prompts) if merge_args.gap_prompts > 0 \
        else ([], "--gap_prompts 0")
    quantized = bool(model_args.load_in_4bit or model_args.load_in_8bit)
    trained_base = (f"{'4' if model_args.load_in_4bit else '8'}-bit, {model_args.dtype or 'auto'} compute" if quantized
                    else f"{model_args.dtype or 'auto'}")

    def gap_check(saved: Path) -> dict[str, Any]:
        if not prompts:
            return {"max_abs_delta_p1": None, "skipped": source, "threshold": merge_args.max_merge_gap}
        gap = measure_merge_gap(saved, base, merge_args.adapter, prompts,
                                get_quantization_config(model_args) if quantized else None, model_args.dtype or "auto",
                                foreign_adapter=merge_args.foreign_adapter)
        return {**gap, "prompts_from": source, "trained_base": trained_base, "threshold": merge_args.max_merge_gap,
                "exceeds_threshold": gap["max_abs_delta_p1"] > merge_args.max_merge_gap}

    out = merge_adapter(base, merge_args.adapter, merge_args.out, merge_args.merge_dtype,
                        {"recipe_path": recipe_path, "recipe": recipe}, metrics, pairs_args.pairs_dir, gap_check,
                        overwrite=merge_args.overwrite, foreign_adapter=merge_args.foreign_adapter)
    gap = json.loads((out / MERGE_INFO_FILE).read_text(encoding="utf-8"))["merge_gap"]
    print(merge_gap_line(gap))
    if gap.get("exceeds_threshold"):
        print(f"WARNING: merge gap {gap['max_abs_delta_p1']:.4f} exceeds --max_merge_gap {merge_args.max_merge_gap}: "
              "the merged model does not score like the adapter as trained (base quantization error); evaluate "
              "the adapter on its trained base (flipguard eval --adapter) or report the gap.", file=sys.stderr)
    print(f"merged model written to {out} (serve with: vllm serve {out})")
    return 0


if __name__ == "__main__":
    from flipguard.train.utils import run_main

    run_main(main, "train/merge.py" if __spec__ is None else f"python -m {__spec__.name}")  # a script, or -m
