"""Merge a trained LoRA adapter into its base model for serving.

    python train/merge.py recipes/qwen7b.yaml --adapter runs/qwen7b/dpo --out runs/qwen7b/dpo-merged \
        [--metrics_json before_after.json]

The base is loaded unquantized (bf16 on GPU, fp32 on CPU; --merge_dtype to choose),
never in 4 bits: merging into 4-bit weights would round the update away. The adapter
was trained against the 4-bit base, so the merged model differs from base+adapter by
the base's quantization error only. Output: safetensors weights, tokenizer, generation
config and a README model card (recipe, pair counts, before/after metrics when given).

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
import json
from pathlib import Path


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


def merge_adapter(base_path: str, adapter: str, out: str, dtype: str = "auto", card_config: dict | None = None,
                  metrics: dict | None = None, pairs_dir: str | None = None) -> Path:
    """Merge and save atomically (temp folder, then rename); returns the output folder."""
    import shutil
    import tempfile

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flipguard.train import utils

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise utils.TrainError(f"{adapter}: not an adapter folder (no adapter_config.json)")
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    utils.check_model_loadable(base_path)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype))  # never quantized
    model = PeftModel.from_pretrained(base, adapter)
    merged = model.merge_and_unload()
    tok_src = adapter if (Path(adapter) / "tokenizer_config.json").is_file() else base_path
    tokenizer = AutoTokenizer.from_pretrained(tok_src)

    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        merged.save_pretrained(tmp, safe_serialization=True)  # also writes generation_config.json
        tokenizer.save_pretrained(tmp)
        info_path = Path(adapter) / "flipguard_training.json"
        config = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
        config.update(card_config or {})
        config.update({"base_model": base_path, "adapter": str(adapter), "merge_dtype": dtype})
        counts = utils.read_pair_counts(pairs_dir) or config.get("pair_counts")
        (tmp / "README.md").write_text(
            utils.model_card(config, counts, metrics, title=f"flipguard merged model ({Path(adapter).name})"),
            encoding="utf-8",
        )
        if out_path.exists():
            shutil.rmtree(out_path)
        tmp.rename(out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_path


def main(argv: list[str]) -> int:
    from trl import ModelConfig

    from flipguard.recipes.config import PairsArguments, parse_recipe
    from flipguard.train import utils

    (merge_args, model_args, pairs_args), recipe_path, recipe = parse_recipe(
        argv, (MergeArguments, ModelConfig, PairsArguments), trainer=None, prog="train/merge.py"
    )
    if not merge_args.adapter or not merge_args.out:
        raise utils.TrainError("--adapter DIR and --out DIR are required")
    metrics = None
    if merge_args.metrics_json:
        try:
            metrics = json.loads(Path(merge_args.metrics_json).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise utils.TrainError(f"{merge_args.metrics_json}: cannot read metrics ({exc})") from None
    base = utils.resolve_model_path(model_args.model_name_or_path)
    out = merge_adapter(base, merge_args.adapter, merge_args.out, merge_args.merge_dtype,
                        {"recipe_path": recipe_path, "recipe": recipe}, metrics, pairs_args.pairs_dir)
    print(f"merged model written to {out} (serve with: vllm serve {out})")
    return 0


if __name__ == "__main__":
    from flipguard.train.utils import run_main

    run_main(main, "train/merge.py")
