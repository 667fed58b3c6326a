"""Prefix sharing in training: every forward a TRL trainer makes on a padded batch, computed
once per shared token and without padding.

A flipguard pair is a long prompt and a reply of a few tokens (the answer "1"/"2", or a letter,
then the end of turn). TRL lays a batch out row by row, padded to its longest row: DPO runs each
prompt twice (chosen and rejected rows) for the policy and twice for the reference, and on the
shipped pairs a third to a half of an SFT batch is padding. Here a forward's rows become one row
without padding: the rows' shared prefixes (a radix tree, `flipguard.eval.backends.prefix.plan`;
the chosen and rejected rows of a pair share the whole prompt) are laid out once, each row's own
tokens follow, every token keeps the position it had in its row, and attention runs tree by tree
(sdpa on each block, under a mask that shows a token exactly the tokens of its own row). Each
score TRL asks for (the log-probability of each labelled token, with entropy, mean logit and
top-1) is the score the padded row gives, within float rounding, and goes back where TRL expects
it: the trainers' losses, metrics and reference log-probs run unchanged on TRL's own layout.

Why a row's last prompt token is never shared: it predicts the first reply token, and in a DPO
pair it must predict two of them ("1" for chosen, "2" for rejected). A position scores one label,
so each row keeps its own copy of that token (same inputs, same position: the same hidden state)
and of every token up to its last label; the tokens after its last label are not computed at all.
And in the last decoder layer the MLP runs at the scored positions only: nothing reads the others.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Sequence

from flipguard.eval.backends.prefix import Node, plan


@dataclasses.dataclass
class Packed:
    """One forward's packed layout (a single row) and the way back to TRL's padded one."""

    input_ids: Any          # (1, T) long: every tree of the batch, one after another, no padding
    position_ids: Any       # (1, T) long: each token's position in its own padded row
    shift_labels: Any       # (1, T) long: the token each position predicts, -100 where none is scored
    blocks: list[tuple[int, int, Any]]  # (start, end, mask): a tree's tokens attend only within it;
    # mask (end-start, end-start) bool, True = attend, or None where the tree is one chain (causal)
    target_rows: Any        # (K,) long: for the k-th scored position, its row in TRL's (B, L - 1) outputs ...
    target_cols: Any        # (K,) long: ... and its column
    padded_tokens: int      # B x L of the padded batch
    real_tokens: int        # the padded batch's tokens that are not padding
    packed_tokens: int      # T


@dataclasses.dataclass
class _Row:
    """What one padded row contributes: its shareable prefix, then its own tokens from position
    `own_from` (the last prompt token up to the token before its last label) and their labels."""

    index: int
    prefix: list[int]
    own: list[int]
    own_labels: list[int]
    own_from: int


def _size(node: Node, rows: Sequence[_Row]) -> int:
    return len(node.tokens) + sum(len(rows[i].own) for i in node.ends) + sum(_size(c, rows) for c in node.children)


def _cost(tokens: int, attention: float) -> float:
    return tokens + attention * tokens * tokens


def _split(node: Node, rows: Sequence[_Row], attention: float) -> list[Node]:
    """The tree as one block, or, where that costs more, its run of tokens given to each child (and
    to each row that ends at it), which then stand alone. A block's cost: its tokens, plus its
    attention (`attention` x tokens^2, the attention work a query-key pair costs relative to a token's
    linear layers): a DPO pair always shares its prompt; a tree of many rows that share only a
    short system prompt splits where attention is costly (a small model on a CPU)."""
    consumers = len(node.children) + len(node.ends)
    if consumers <= 1 or attention <= 0:
        return [node]
    run = len(node.tokens)
    pieces = [run + len(rows[i].own) for i in node.ends] + [run + _size(c, rows) for c in node.children]
    if sum(_cost(n, attention) for n in pieces) >= _cost(_size(node, rows), attention):
        return [node]
    out = [Node(list(node.tokens), node.start, [], [i]) for i in node.ends]
    for child in node.children:
        child.tokens, child.start = node.tokens + child.tokens, node.start
        out.extend(_split(child, rows, attention))
    return out


def attention_cost(config, lora_r: int = 0) -> float:
    """A query-key pair's attention work relative to one token's linear layers, for a decoder layer
    of `config` (its causal half: the pairs a block of n tokens computes are about n^2 / 2)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    q = heads * head_dim
    kv = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    h, i = text.hidden_size, text.intermediate_size
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    linear = sum(a * b + lora_r * (a + b) for a, b in shapes)
    return q / linear


def _emit(node: Node, rows: Sequence[_Row], out: dict[str, list[int]], targets: list[tuple[int, int]]) -> bool:
    """Lay a tree out depth first: a node's tokens, the own tokens of each row that ends there, then
    its children. A token is attended by the tokens after it up to the end of its subtree. Returns
    whether the tree is one chain (then its mask is the causal one)."""
    first = len(out["ids"])
    out["ids"] += node.tokens
    out["pos"] += range(node.start, node.start + len(node.tokens))
    out["labels"] += [-100] * len(node.tokens)
    out["reach"] += [0] * len(node.tokens)
    for i in node.ends:
        row = rows[i]
        start = len(out["ids"])
        out["ids"] += row.own
        out["pos"] += range(row.own_from, row.own_from + len(row.own))
        out["labels"] += row.own_labels
        out["reach"] += [start + len(row.own)] * len(row.own)
        targets += [(row.index, row.own_from + k) for k, label in enumerate(row.own_labels) if label != -100]
    chain = len(node.ends) + len(node.children) == 1
    for child in node.children:
        chain = _emit(child, rows, out, targets) and chain
    out["reach"][first:first + len(node.tokens)] = [len(out["ids"])] * len(node.tokens)
    return chain


def _renumber(node: Node, numbers: Sequence[int]) -> None:
    """Map a plan's sequence indices (into the list it was given) to indices into all rows."""
    node.ends = [numbers[i] for i in node.ends]
    for child in node.children:
        _renumber(child, numbers)


def pack(input_ids, attention_mask, labels, attention: float = 0.0) -> Packed | None:
    """The packed layout of a right-padded batch, or None where it cannot stand in for it (left
    padding or holes in the mask, no label at all). `attention`: attention_cost of the model, which
    decides where a tree of many rows is cheaper split (0: never)."""
    import torch

    ids = input_ids.tolist()
    mask = attention_mask.tolist() if attention_mask is not None else [[1] * len(r) for r in ids]
    labs = labels.tolist()
    width = len(ids[0]) if ids else 0
    rows: list[_Row] = []
    real = 0
    for b, (r_ids, r_mask, r_labs) in enumerate(zip(ids, mask, labs)):
        n = sum(1 for m in r_mask if m)
        if not all(r_mask[:n]) or any(r_mask[n:]):
            return None  # not right padding: TRL's own layout
        real += n
        scored = [t for t in range(1, n) if r_labs[t] != -100]
        if not scored:
            continue
        first, last = scored[0], scored[-1]
        rows.append(_Row(b, r_ids[:first - 1], r_ids[first - 1:last], r_labs[first:last + 1], first - 1))
    if not rows:
        return None

    with_prefix = [i for i, r in enumerate(rows) if r.prefix]
    trees: list[Node] = []
    if with_prefix:
        for top in plan([rows[i].prefix for i in with_prefix], min_saved=0):
            _renumber(top, with_prefix)
            trees += _split(top, rows, attention)
    trees += [Node([], rows[i].own_from, [], [i]) for i, r in enumerate(rows) if not r.prefix]

    out: dict[str, list[int]] = {"ids": [], "pos": [], "labels": [], "reach": []}
    targets: list[tuple[int, int]] = []
    spans = []
    for tree in trees:
        start = len(out["ids"])
        chain = _emit(tree, rows, out, targets)
        spans.append((start, len(out["ids"]), chain))

    device = input_ids.device

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    reach = tensor(out["reach"])
    blocks = []
    for start, end, chain in spans:
        mask = None
        if not chain:
            idx = torch.arange(start, end, device=device)
            mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < reach[start:end][None, :])
        blocks.append((start, end, mask))
    return Packed(
        input_ids=tensor([out["ids"]]), position_ids=tensor([out["pos"]]), shift_labels=tensor([out["labels"]]),
        blocks=blocks, target_rows=tensor([b for b, _ in targets]), target_cols=tensor([t for _, t in targets]),
        padded_tokens=len(ids) * width, real_tokens=real, packed_tokens=len(out["ids"]),
    )


# the keyword arguments a packed forward takes over from TRL's call (anything else: TRL's own layout)
PACKABLE_KWARGS = {"input_ids", "attention_mask", "use_cache", "num_items_in_batch", "return_dict"}


@dataclasses.dataclass
class PackingStats:
    """What the packed forwards computed, for the training provenance."""

    packed_forwards: int = 0
    padded_tokens: int = 0
    real_tokens: int = 0
    packed_tokens: int = 0
    unpacked_forwards: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, packed: Packed) -> None:
        self.packed_forwards += 1
        self.padded_tokens += packed.padded_tokens
        self.real_tokens += packed.real_tokens
        self.packed_tokens += packed.packed_tokens

    def skip(self, reason: str) -> None:
        self.unpacked_forwards[reason] = self.unpacked_forwards.get(reason, 0) + 1

    def why_none(self) -> str:
        """Why no forward was packed, for a training that ran on TRL's layout throughout."""
        if not self.unpacked_forwards:
            return "the trainer made no fused-LM-head forward with labels (TRL did not call what packing takes over)"
        return "no forward was packed (" + ", ".join(f"{n} x {why}" for why, n in sorted(self.unpacked_forwards.items())) + ")"

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)
        if self.packed_tokens:
            out["padded_per_packed_token"] = round(self.padded_tokens / self.packed_tokens, 3)
        return out


# the attention implementation of a packed model: sdpa, block by block where a forward is packed
ATTENTION = "flipguard_blocks"


def has_fused_lm_head(model) -> bool:
    """TRL gave the model its fused LM head (trl.trainer.utils.add_fused_lm_head: a forward taking
    `fused_lm_head=True`), the forward packing takes over."""
    try:
        return "fused_lm_head" in inspect.signature(model.forward, follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return False


def refusal(model) -> str | None:
    """Why this model's forwards cannot be packed (None: they can)."""
    if not has_fused_lm_head(model):
        return ("the model has no TRL fused LM head (the trainer scores full logits, or this TRL does not "
                "add one): packing takes over that forward only")
    if not hasattr(model, "set_attn_implementation"):
        return "this transformers has no set_attn_implementation (packing switches the attention through it)"
    config = getattr(model, "config", None)
    kind = getattr(config, "_attn_implementation", None)  # the implementation the model loaded with
    if kind not in ("sdpa", ATTENTION):
        return f"attention implementation {kind!r} (packing runs sdpa block by block)"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(text, "layer_types", None) or []):
        return "sliding-window layers (the packed blocks are full attention)"
    if getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None):
        return "mixture-of-experts routing (its load-balancing loss counts padded tokens)"
    return None


def _block_attention(module, query, key, value, attention_mask, flipguard_blocks=None, **kwargs):
    """sdpa, or, in a packed forward, sdpa on each block of the row: a tree attends within itself
    only, so the row's other trees cost nothing (a chain is plain causal attention)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if flipguard_blocks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    sizes = [end - start for start, end, _ in flipguard_blocks]  # the blocks tile the row in order
    outs = [sdpa_attention_forward(module, q, k, v, None if mask is None else mask[None, None], **kwargs)[0]
            for q, k, v, (_, _, mask) in zip(query.split(sizes, dim=2), key.split(sizes, dim=2),
                                            value.split(sizes, dim=2), flipguard_blocks)]
    return torch.cat(outs, dim=1), None


def _register_attention() -> None:
    """flipguard's attention under its own name through transformers' public registries (its
    "Attention backends" page): block-wise sdpa, and sdpa's own mask function."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, _block_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def _last_layer(model):
    """The causal LM's last decoder layer, if it has the usual `layers[-1].mlp` shape (else None)."""
    backbone = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(backbone, "layers", None)
    if layers is None or not len(layers) or not hasattr(layers[-1], "mlp"):
        return None
    return layers[-1]


class _ScoredOnly:
    """The last decoder layer's MLP run only at the positions the LM head scores. Its output
    elsewhere feeds nothing (the head reads the scored positions only; no later layer reads any),
    so it is left at zero: for a 2-layer model that is a third of the work, for 28 layers about 3%.
    torch's module hooks on the MLP: the pre-hook hands it the scored positions, the hook puts its
    output back in place. Set for the duration of one packed forward (`start`, `stop`); outside it
    the MLP runs everywhere as before."""

    def __init__(self, layer):
        self.layer = layer
        self.scored = None
        self.checkpointing = False
        self.full = None  # the MLP's input of the call in flight, when it was restricted
        layer.mlp.register_forward_pre_hook(self._select)
        layer.mlp.register_forward_hook(self._place, always_call=True)

    def _select(self, module, args):
        hidden_states, scored = args[0], self.scored
        if scored is None or hidden_states.shape[:2] != scored.shape:
            return None
        self.full = hidden_states
        return (hidden_states[scored], *args[1:])

    def _place(self, module, args, output):
        full, self.full = self.full, None
        if full is None or output is None:
            return None
        return full.new_zeros(full.shape).masked_scatter(self.scored[..., None], output)

    def start(self, scored) -> None:
        """Restrict the MLP to `scored`, the layer computed once (gradient checkpointing's replay
        would run after the selection is gone, and compute every position: right, but the saving
        lost). `layer.gradient_checkpointing` is transformers' per-layer switch (GradientCheckpointingLayer)."""
        self.checkpointing = self.layer.gradient_checkpointing
        self.scored, self.layer.gradient_checkpointing = scored, False

    def stop(self) -> None:
        self.scored, self.layer.gradient_checkpointing = None, self.checkpointing


class _PackedCalls:
    """Every fused-LM-head call of one model object TRL calls, packed, by torch's module hooks: the
    forward pre-hook hands the model the packed row in place of TRL's padded batch, the forward hook
    hands TRL its own layout back. The model's forward itself (TRL's fused LM head) is untouched."""

    def __init__(self, model, stats: PackingStats, attention: float, scored_only: _ScoredOnly | None):
        self.stats, self.attention, self.scored_only = stats, attention, scored_only
        self.calls: list[tuple | None] = []  # per call in flight: (packed, rows, width, num_items, scored), or None
        model.register_forward_pre_hook(self._pack, with_kwargs=True)
        model.register_forward_hook(self._unpack, with_kwargs=True, always_call=True)

    def _pack(self, module, args, kwargs):
        import torch

        labels = kwargs.get("labels")
        if not kwargs.get("fused_lm_head") or labels is None:
            self.calls.append(None)
            return None
        reason = ("positional arguments" if args else
                  "input_ids missing" if kwargs.get("input_ids") is None else
                  None)
        extra = sorted(k for k, v in kwargs.items() if k not in PACKABLE_KWARGS | {"fused_lm_head", "labels"}
                       and v is not None)
        if reason is None and extra:
            reason = f"arguments {', '.join(extra)}"
        attention_mask = kwargs.get("attention_mask")
        if reason is None and attention_mask is not None and attention_mask.dim() != 2:
            reason = "a prepared attention mask"
        packed = None if reason else pack(kwargs["input_ids"], attention_mask, labels, self.attention)
        if packed is None:
            self.stats.skip(reason or "left padding or no label")
            self.calls.append(None)
            return None
        self.stats.add(packed)
        scored = packed.shift_labels != -100
        rows, width = kwargs["input_ids"].shape
        self.calls.append((packed, rows, width, kwargs.get("num_items_in_batch"), scored))
        if self.scored_only is not None:
            self.scored_only.start(scored)
        # a 4-D mask is taken as prepared: transformers builds no (T, T) mask the blocks would not read
        no_mask = packed.input_ids.new_ones((1, 1, 1, 1), dtype=torch.bool)
        return (), {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "attention_mask": no_mask,
                    "shift_labels": packed.shift_labels, "flipguard_blocks": packed.blocks, "use_cache": False,
                    "fused_lm_head": True}

    def _unpack(self, module, args, kwargs, output):
        from trl.trainer.utils import FusedCausalLMOutput

        call = self.calls.pop()
        if call is None:
            return None
        packed, rows, width, num_items, scored = call
        if self.scored_only is not None:
            self.scored_only.stop()
        if output is None:  # the forward raised (the hook runs regardless): nothing to hand back
            return None
        where = (packed.target_rows, packed.target_cols)

        def unpacked(values):
            if values is None:
                return None
            return values.new_zeros((rows, width - 1)).index_put(where, values[scored])

        log_probs = unpacked(output.log_probs)
        label_mask = unpacked(scored)
        count = label_mask.sum().clamp(min=1) if num_items is None else num_items
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=unpacked(output.entropy),
                                   log_sum_sq_probs=unpacked(output.log_sum_sq_probs),
                                   mean_logits=unpacked(output.mean_logits), is_top1=unpacked(output.is_top1),
                                   label_mask=label_mask)


def install(model, stats: PackingStats | None = None) -> PackingStats:
    """Pack every fused-LM-head call TRL makes to `model` (the object it calls: the PEFT model, or the
    causal LM TRL gave its fused LM head with `add_fused_lm_head`): the causal LM's attention becomes
    `ATTENTION` (`set_attn_implementation`; sdpa itself wherever a forward is not packed). Returns the
    running counts (`stats`, when several models share them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _register_attention()
    base.set_attn_implementation(ATTENTION)
    stats = stats if stats is not None else PackingStats()
    lora = getattr(model, "peft_config", None) or {}
    lora_r = max((getattr(c, "r", 0) or 0 for c in lora.values()), default=0)
    last = _last_layer(base)
    _PackedCalls(model, stats, attention_cost(base.config, lora_r), _ScoredOnly(last) if last is not None else None)
    return stats
