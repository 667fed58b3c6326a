"""How a trainer spends its device, decided and recorded in one place (the recipe's
`prefix_sharing` and `memory_budget`, config/arguments.py TrainingSpeedArguments):

- `plan_memory` (before the trainer exists): under a GPU memory budget, the micro-batch,
  accumulation and recomputed layers (train/memory.py), the effective batch kept;
- `apply` (after it exists, before it trains): prefix sharing on the forwards TRL calls
  (train/packing.py) and gradient checkpointing on the planned layers only;
- what ran goes into flipguard_training.json under "speed" (`record`).
"""

from __future__ import annotations

import os
from typing import Any

from flipguard.config.parsers import RENAMED_ARGUMENTS
from flipguard.train import compat, memory, packing

# set before CUDA starts: the caching allocator grows segments instead of keeping one per size,
# so micro-batches of changing lengths do not fragment the card
ALLOCATOR = "expandable_segments:True"


def use_expandable_segments() -> str:
    """PYTORCH_CUDA_ALLOC_CONF, ours unless the user set one (theirs is kept and recorded)."""
    return os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)


def on_gpu(training_args) -> bool:
    import torch

    return torch.cuda.is_available() and not training_args.use_cpu


def sample_tokens(lengths: dict[str, list[int]], concatenated_forward: bool, packed: bool) -> tuple[list[int], int]:
    """Per sample of the trainer's batch, the tokens its forward with gradients holds, and how many
    padded rows a sample takes. A trainer whose forward takes a pair's replies together (DPO's chosen
    and rejected, Trainer.concatenated_forward) has a row per reply, and packed they share the
    prompt; any other has each reply as a sample of its own (KTO; SFT's one completion)."""
    prompt = lengths["prompt"]
    replies = [seqs for col, seqs in lengths.items() if col != "prompt"]
    if concatenated_forward and len(replies) > 1:
        if packed:
            return [sum(r) - (len(r) - 1) * p for p, *r in zip(prompt, *replies)], len(replies)
        return [max(r) for r in zip(*replies)], len(replies)
    return [max(r) for r in zip(*replies)], 1


def set_activation_checkpointing(training_args, on: bool) -> None:
    """Recompute on or off after the arguments were built: under both names where the installed transformers has
    the new one (config/parsers.py RENAMED_ARGUMENTS: from 5.24 the Trainer reads only activation_checkpointing)."""
    training_args.gradient_checkpointing = on
    if hasattr(training_args, RENAMED_ARGUMENTS["gradient_checkpointing"]):
        training_args.activation_checkpointing = on


def plan_memory(speed_args, training_args, model_args, model_path: str, lengths: dict[str, list[int]],
                concatenated_forward: bool) -> dict[str, Any]:
    """Under `memory_budget` on a GPU: set micro-batch, accumulation and gradient checkpointing in
    training_args from memory.plan; returns the record (the plan, or why none was made)."""
    if str(speed_args.memory_budget or "").strip().lower() in ("", "none", "off"):
        return {"memory_budget": None, "as_recipe": True}
    if not on_gpu(training_args):
        return {"memory_budget": speed_args.memory_budget, "as_recipe": True, "why": "no GPU: the budget is a GPU's"}
    import torch
    from accelerate import PartialState
    from transformers import AutoConfig

    device = PartialState().local_process_index
    total = torch.cuda.get_device_properties(device).total_memory / memory.GIB
    budget = min(memory.budget_gib(speed_args.memory_budget, total), total)
    compute_bytes = 4 if str(model_args.dtype) in ("float32", "torch.float32") else 2
    trainable_bytes = 4 if training_args.fp16 or compute_bytes == 4 else 2
    shape = memory.Shape.of(AutoConfig.from_pretrained(model_path), model_args, compute_bytes, trainable_bytes)
    packed = bool(speed_args.prefix_sharing)
    tokens, rows = sample_tokens(lengths, concatenated_forward, packed)
    effective = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    chosen = memory.plan(shape, budget, effective, tokens, sum(tokens) / max(len(tokens), 1), packed, rows)
    recipe = {"per_device_train_batch_size": training_args.per_device_train_batch_size,
              "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
              "gradient_checkpointing": bool(training_args.gradient_checkpointing)}
    training_args.per_device_train_batch_size = chosen.micro_batch
    training_args.gradient_accumulation_steps = chosen.accumulation
    set_activation_checkpointing(training_args, chosen.checkpointed_layers > 0)
    return {"memory_budget": speed_args.memory_budget, "as_recipe": False, "device_total_gib": round(total, 2),
            "recipe": recipe, **chosen.as_record()}


def apply(trainer, speed_args, plan: dict[str, Any]) -> dict[str, Any]:
    """Prefix sharing on the trainer's models and the planned gradient checkpointing; returns the
    running record (its packing counts fill in as the trainer runs). Where packing cannot engage
    (packing.refusal: an attention implementation it does not support, a model TRL gave no fused LM
    head) nothing is installed, the trainer runs TRL's own layout, and one line says so."""
    record: dict[str, Any] = {"memory_plan": plan}
    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
    bases = [m.get_base_model() if hasattr(m, "get_base_model") else m for m in models]
    if plan.get("checkpointed_layers") is not None and not plan.get("as_recipe"):
        if compat.within("first_layers_checkpointing"):
            for base in bases:
                memory.checkpoint_first_layers(base, plan["checkpointed_layers"])
        else:
            plan["checkpointed_layers_run"] = f"every layer ({compat.note('first_layers_checkpointing')})"
    if not speed_args.prefix_sharing:
        record["prefix_sharing"] = {"on": False, "why": "prefix_sharing: false"}
        return record
    why = packing.refusal(bases[0])
    if why is not None:
        record["prefix_sharing"] = {"on": False, "why": why}
        say_off(why)
        return record
    stats = packing.PackingStats()
    for model in models:  # the objects TRL calls (a PEFT model, or the causal LM itself)
        packing.install(model, stats)
    record["prefix_sharing"] = {"on": True, "stats": stats}
    return record


def record(speed: dict[str, Any]) -> dict[str, Any]:
    """The JSON form of `apply`'s record, once the trainer has run (its packing counts). Sharing is
    `on` only where packed forwards were counted: installed but never reached (a TRL whose trainer no
    longer calls the fused LM head it hooks, every batch left-padded ...) it is recorded off, with why,
    and one line says so."""
    sharing = dict(speed.get("prefix_sharing") or {})
    stats = sharing.pop("stats", None)
    if stats is not None:
        sharing.update(stats.summary())
        if not stats.packed_forwards:
            sharing.update(on=False, why=stats.why_none())
            say_off(sharing["why"])
    return {**speed, "prefix_sharing": sharing}


def say_off(why: str) -> None:
    """The one console line (main process) of a training whose prefix sharing did not engage."""
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"prefix sharing off: {why}; trained with TRL's own layout (recorded in flipguard_training.json)", flush=True)
