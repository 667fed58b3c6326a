"""A GPU memory budget instead of a hand-tuned batch: micro-batch, accumulation and how many decoder
layers recompute their activations (gradient checkpointing, layer by layer) follow from the budget,
the model's shape and the pairs' lengths, with the recipe's effective batch kept.

The estimate is the sum of what a QLoRA step holds at its peak:
- the weights: 4-bit linear layers (NF4, 0.5 byte a parameter plus its block scales), embeddings,
  LM head and norms in the compute dtype; the LoRA parameters, their gradients and AdamW's two
  moments in the trainable dtype;
- the activations autograd saves, per token of the micro-batch and per decoder layer
  (`saved_bytes_per_token`, counted tensor by tensor: tests/test_train_speed.py checks the count
  against what autograd saves on the CPU); a layer that recomputes keeps only its input, plus one
  layer's worth while it is replayed;
- a transient term: the largest dequantized weight, twice.
On one H100 80 GB it lies 1-5 % above every peak measured at c90e646 (bench/training_speed.md: SFT 4 x 4,
16 x 1 and 8 x 2, DPO 4 x 4), never below. The tokens of a micro-batch are its worst case: the
longest samples of the pair set together (packed: their tokens; padded: the longest times the rows).

Of the plans that fit, the one with the least estimated time: each token costs a forward, a
backward (about one more forward: the 4-bit base takes no weight gradient) and its recompute where
its layer recomputes; each micro-batch costs a fixed overhead (dequantizing every weight for each
pass, launching its kernels), counted as `MICRO_BATCH_OVERHEAD_TOKENS` tokens' forward.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from flipguard.config import MEMORY_PROFILES
from flipguard.errors import UserError

GIB = 2**30
# what the CUDA context and the caching allocator's slack take from a card before any tensor
CONTEXT_GIB = 0.6
# the share of the rest the plan may fill (fragmentation, the DDP buckets, what the estimate misses)
FILL = 0.95
# a micro-batch's fixed cost (every weight dequantized for each of its passes, its kernel launches),
# in tokens' forward time: about what an H100 does for a 7B model in the time it dequantizes it
MICRO_BATCH_OVERHEAD_TOKENS = 800
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def budget_gib(value: str, device_total_gib: float | None) -> float:
    """A memory_budget value in GiB: a card profile (24GB ...), an amount (20GiB, 20), or 'device'."""
    text = str(value).strip()
    if text.lower() == "device":
        if device_total_gib is None:
            raise UserError("memory_budget 'device' needs a GPU (none is visible)")
        return device_total_gib
    if text.upper() in MEMORY_PROFILES:
        return MEMORY_PROFILES[text.upper()]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GiB|G|)", text, flags=re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"memory_budget: {value!r} is not a card profile ({', '.join(MEMORY_PROFILES)}), an amount "
                        "of GPU memory (e.g. 20GiB) or 'device'")
    return float(m.group(1))


@dataclasses.dataclass
class Shape:
    """What the estimate needs of a model and its adapter."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    lora_r: int
    lora_targets: tuple[str, ...]
    lora_dropout: float
    quantized_4bit: bool
    nested_quant: bool
    compute_bytes: int     # the dtype activations and unquantized weights are in
    trainable_bytes: int   # the LoRA weights' dtype (their gradients and moments follow it)

    @classmethod
    def of(cls, config, model_args, compute_bytes: int, trainable_bytes: int) -> "Shape":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        targets = model_args.lora_target_modules
        targets = tuple(ATTENTION_LINEARS + MLP_LINEARS) if targets in (None, "all-linear") else tuple(targets)
        return cls(hidden=text.hidden_size, intermediate=text.intermediate_size, layers=text.num_hidden_layers,
                   heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   vocab=text.vocab_size, tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
                   lora_r=model_args.lora_r if model_args.use_peft else 0, lora_targets=targets if model_args.use_peft else (),
                   lora_dropout=model_args.lora_dropout, quantized_4bit=bool(model_args.load_in_4bit),
                   nested_quant=bool(model_args.use_bnb_nested_quant), compute_bytes=compute_bytes,
                   trainable_bytes=trainable_bytes)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of a decoder layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def saved_bytes_per_token(shape: Shape, mlp: bool = True) -> int:
    """Bytes autograd keeps per token for one decoder layer (Llama/Qwen2 shape), no recompute;
    `mlp=False`: without its MLP's (the last layer under prefix sharing runs it at the scored
    positions only)."""
    s, h, i = shape.compute_bytes, shape.hidden, shape.intermediate
    q = shape.heads * shape.head_dim
    dropout = shape.lora_dropout > 0
    targets = set(shape.lora_targets)

    def lora_inputs(modules: Sequence[str], width: int) -> int:
        """A LoRA's A weight keeps its input: with dropout each adapter its own dropped copy and
        mask, without it the modules that read one input share it."""
        adapted = [m for m in modules if m in targets]
        if not adapted:
            return 0
        return len(adapted) * (s + 1) * width if dropout else s * width

    norms = 2 * (4 + s) * h                 # RMSNorm: the float32 input and the normalized output
    attention = 4 * s * q                   # queries, keys and values (repeated to every head), output
    saved = norms + attention
    saved += lora_inputs(("q_proj", "k_proj", "v_proj"), h) + lora_inputs(("o_proj",), q)
    if mlp:
        saved += 3 * s * i                  # the activation's input, and both factors of gate x up
        saved += lora_inputs(("gate_proj", "up_proj"), h) + lora_inputs(("down_proj",), i)
    return saved


def static_bytes(shape: Shape, optimizer_states: int = 2) -> dict[str, int]:
    """Weights, LoRA parameters, their gradients and optimizer moments, and the transient term."""
    linears = shape.linear_shapes()
    per_layer = sum(a * b for a, b in linears.values())
    if shape.quantized_4bit:  # NF4 + one scale per block of 64 (8-bit with nested quantization, else fp32)
        base_linear = shape.layers * per_layer * (0.5 + (1 if shape.nested_quant else 4) / 64)
        largest = max(a * b for a, b in linears.values()) * shape.compute_bytes  # dequantized for a matmul
    else:
        base_linear = shape.layers * per_layer * shape.compute_bytes
        largest = 0
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2) * shape.compute_bytes
    lora = shape.layers * sum(shape.lora_r * (a + b) for name, (a, b) in linears.items() if name in shape.lora_targets)
    return {"base_weights": int(base_linear + embeddings),
            "lora_weights_grads_moments": int(lora * shape.trainable_bytes * (2 + optimizer_states)),
            "transient": int(2 * largest)}


@dataclasses.dataclass
class Plan:
    """The chosen split of the effective batch and what it is estimated to cost."""

    micro_batch: int
    accumulation: int
    checkpointed_layers: int
    estimated_peak_gib: float
    estimated_step_cost: float
    budget_gib: float
    usable_gib: float
    worst_micro_batch_tokens: int
    candidates: list[dict[str, Any]]

    def as_record(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["candidates"] = self.candidates[:12]
        return out


def micro_batch_tokens(sample_tokens: Sequence[int], micro: int, rows_per_sample: int, packed: bool) -> int:
    """The most tokens a micro-batch of `micro` samples can hold: its longest samples together
    (packed: their tokens; padded: each row as long as the longest)."""
    longest = sorted(sample_tokens, reverse=True)[:micro]
    if packed:
        return sum(longest)
    return micro * rows_per_sample * (max(longest) if longest else 0)


def plan(shape: Shape, budget: float, effective_batch: int, sample_tokens: Sequence[int], mean_sample_tokens: float,
         packed: bool, rows_per_sample: int = 1, optimizer_states: int = 2) -> Plan:
    """The fastest (micro-batch, recomputed layers) whose estimated peak fits `budget` GiB, with
    micro-batch x accumulation = effective_batch; refused in one line when none fits. Packed (prefix
    sharing), the last layer never recomputes and keeps no MLP activations but at scored positions."""
    usable = (budget - CONTEXT_GIB) * FILL
    static = static_bytes(shape, optimizer_states)
    fixed = sum(static.values())
    per_layer = saved_bytes_per_token(shape)
    kept_input = shape.compute_bytes * shape.hidden  # what a recomputing layer keeps
    # the layers that may recompute, and what the others beyond them keep
    recomputable = shape.layers - 1 if packed else shape.layers
    last = saved_bytes_per_token(shape, mlp=False) if packed else 0
    step_tokens = effective_batch * mean_sample_tokens
    candidates = []
    for micro in (m for m in range(effective_batch, 0, -1) if effective_batch % m == 0):
        tokens = micro_batch_tokens(sample_tokens, micro, rows_per_sample, packed)
        for k in range(recomputable + 1):
            act = tokens * ((recomputable - k) * per_layer + last + k * kept_input + (per_layer if k else 0))
            peak = (fixed + act) / GIB
            passes = 2.1 + k / shape.layers  # forward, backward, the recomputed share
            cost = step_tokens * passes + (effective_batch // micro) * MICRO_BATCH_OVERHEAD_TOKENS * passes
            candidates.append({"micro_batch": micro, "checkpointed_layers": k, "peak_gib": round(peak, 2),
                               "cost": round(cost), "fits": peak <= usable})
            if peak <= usable:
                break  # more recompute only costs time
    fitting = [c for c in candidates if c["fits"]]
    if not fitting:
        smallest = min(candidates, key=lambda c: c["peak_gib"])
        raise UserError(f"memory_budget {budget:.1f} GiB: even micro-batch 1 with every layer recomputing needs about "
                        f"{smallest['peak_gib']} GiB (weights {fixed / GIB:.1f} GiB); raise the budget, lower lora_r, "
                        "or shorten the pairs (pairs.max_prompt_length)")
    best = min(fitting, key=lambda c: (c["cost"], -c["micro_batch"]))
    return Plan(micro_batch=best["micro_batch"], accumulation=effective_batch // best["micro_batch"],
                checkpointed_layers=best["checkpointed_layers"], estimated_peak_gib=best["peak_gib"],
                estimated_step_cost=best["cost"], budget_gib=round(budget, 2), usable_gib=round(usable, 2),
                worst_micro_batch_tokens=micro_batch_tokens(sample_tokens, best["micro_batch"], rows_per_sample, packed),
                candidates=sorted(fitting, key=lambda c: c["cost"]))


def checkpoint_first_layers(model, k: int) -> None:
    """Gradient checkpointing on the first k decoder layers only; kept when the trainer turns
    checkpointing off and on again around its reference forwards (TRL's DPO and KTO do, through
    trl.models.utils.disable_gradient_checkpointing, and re-enabling sets every layer). No public
    hook serves: a TrainerCallback runs between steps, not around those forwards, and transformers'
    `every_n_layers` spreads the recomputed layers instead of taking the first k. So the model's
    `gradient_checkpointing_enable` is wrapped, on the versions it is tested on (train/compat.py)."""
    backbone = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = list(getattr(backbone, "layers", []) or [])
    if not layers:
        return
    enable = model.gradient_checkpointing_enable

    def enable_first_layers(*args, **kwargs):
        enable(*args, **kwargs)
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index < k

    model.gradient_checkpointing_enable = enable_first_layers
    if any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index < k
