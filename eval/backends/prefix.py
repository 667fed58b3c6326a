"""Score each shared token prefix once (the hf backend's prefix sharing).

flipguard's prompts repeat themselves: the four DDS cases of one item share the chat header,
the instructions and the question; AFR's challenges of one question share the whole first
turn and its answer. `plan` puts a batch's token sequences into a radix tree (one node per
run of tokens that a set of sequences shares), `score_last_logits` runs the tree's nodes
wave by wave: a node's tokens go through the model once, on top of its parent's cached
keys/values, and every child continues from there.

Each batch of a wave is laid out as [left-padded past | left-padded new tokens]: the 2-D
attention mask hides both paddings, the position ids count real tokens only (the parent's
length + 0, 1, ...), so every sequence's last real token sits in the last column
(`logits_to_keep=1`) and computes what the sequence alone would, within float tolerance.
Only plain full-attention caches (transformers' `DynamicLayer` on every layer) are shared:
a sliding-window, linear-attention or other cache is not sliced here (`sharing_refusal`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Sequence

# A shared run of tokens is computed on its own only when that saves at least this many
# token computations ((consumers - 1) x its length): below it, one more forward call and
# the copies of the keys/values cost more than recomputing the tokens in each child.
MIN_SAVED_TOKENS = 16


@dataclasses.dataclass
class Node:
    """A run of tokens shared by every sequence below it. `start`: how many tokens come
    before it (its parent's full length); `ends`: the sequences that end with its last token."""

    tokens: list[int]
    start: int
    children: list["Node"] = dataclasses.field(default_factory=list)
    ends: list[int] = dataclasses.field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _common(a: Sequence[int], b: Sequence[int], start: int) -> int:
    """Length of the common prefix of a and b (both share their first `start` tokens)."""
    n, i = min(len(a), len(b)), start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _build(seqs: Sequence[Sequence[int]], order: list[int], depth: int) -> Node:
    """The radix-tree node for `order` (indices into seqs, sorted, all sharing seqs[.][:depth])."""
    first, last = seqs[order[0]], seqs[order[-1]]
    lcp = _common(first, last, depth)  # sorted: the first and last share what all share
    node = Node(list(first[depth:lcp]), depth)
    rest = []
    for i in order:
        (node.ends if len(seqs[i]) == lcp else rest).append(i)
    group: list[int] = []
    for i in rest:  # sorted: the sequences with the same next token are adjacent
        if group and seqs[group[0]][lcp] != seqs[i][lcp]:
            node.children.append(_build(seqs, group, lcp))
            group = []
        group.append(i)
    if group:
        node.children.append(_build(seqs, group, lcp))
    return node


def _push_down(node: Node, min_saved: int) -> list[Node]:
    """The nodes worth computing on their own, `node` first unless its run saves fewer than
    `min_saved` token computations: then its tokens go to the front of each consumer."""
    consumers = len(node.children) + (1 if node.ends else 0)
    if node.children and (consumers - 1) * len(node.tokens) < min_saved:
        out = []
        if node.ends:  # the sequences that end here become a leaf of their own
            out.append(Node(list(node.tokens), node.start, [], node.ends))
        for child in node.children:
            child.tokens, child.start = node.tokens + child.tokens, node.start
            out.extend(_push_down(child, min_saved))
        return out
    node.children = [n for child in node.children for n in _push_down(child, min_saved)]
    return [node]


def plan(seqs: Sequence[Sequence[int]], min_saved: int = MIN_SAVED_TOKENS) -> list[Node]:
    """The top-level nodes of the prefix tree of `seqs` (token id lists, none empty); every
    sequence index appears in exactly one node's `ends`. No node is shared: one per sequence."""
    if not seqs:
        return []
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i]))
    root = _build(seqs, order, 0)
    if not root.tokens:  # nothing common to every sequence: the root's children are the tops
        return [n for child in root.children for n in _push_down(child, min_saved)]
    return _push_down(root, min_saved)


def shares(tops: Sequence[Node]) -> bool:
    """Whether any node of the plan has children (else sharing computes nothing less)."""
    return any(n.children for n in tops)


def computed_tokens(tops: Sequence[Node]) -> int:
    """Tokens the plan runs through the model (each node's own run once)."""
    stack, n = list(tops), 0
    while stack:
        node = stack.pop()
        n += len(node.tokens)
        stack.extend(node.children)
    return n


def sharing_refusal(model) -> str | None:
    """Why this model's keys/values cannot be shared here (None: they can): every layer of its
    cache must be transformers' plain full-attention `DynamicLayer`."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        layers = DynamicCache(config=model.config).layers
    except Exception as exc:  # noqa: BLE001 - an architecture this transformers cannot describe
        return f"no DynamicCache for this model ({type(exc).__name__})"
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    return f"its cache has {', '.join(kinds)} layers (only full attention is shared)" if kinds else None


def score_last_logits(model, tops: Sequence[Node], *, batch_size: int, pad_id: int, device,
                      on_logits: Callable[[list[int], "object"], None]) -> None:
    """Run the plan: wave by wave, batches of up to `batch_size` nodes, each on its parent's
    cached keys/values; `on_logits(sequence indices, logits row)` gets the float32 logits at
    the last token of every node where sequences end."""
    import torch
    from transformers.cache_utils import DynamicCache

    config = model.config
    cache_arg = _cache_kwarg(model)

    def run(batch: list[tuple[Node, list | None]]) -> list[tuple[Node, list | None]]:
        """One forward pass over a batch of nodes; returns their children, each with its parent's cache."""
        past_len = max(n.start for n, _ in batch)
        new_len = max(len(n.tokens) for n, _ in batch)
        rows = len(batch)
        ids = torch.full((rows, new_len), pad_id, dtype=torch.long)
        mask = torch.zeros((rows, past_len + new_len), dtype=torch.long)
        pos = torch.zeros((rows, new_len), dtype=torch.long)
        for r, (node, _) in enumerate(batch):
            s = len(node.tokens)
            ids[r, new_len - s :] = torch.tensor(node.tokens, dtype=torch.long)
            mask[r, past_len - node.start : past_len] = 1
            mask[r, past_len + new_len - s :] = 1
            pos[r, new_len - s :] = torch.arange(node.start, node.start + s)
        cache = DynamicCache(ddp_cache_data=_padded_past(batch, past_len), config=config) if past_len else None
        need_cache = any(n.children for n, _ in batch)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                    use_cache=need_cache, logits_to_keep=1, **{cache_arg: cache})
        logits = out.logits[:, -1, :].float()
        for r, (node, _) in enumerate(batch):
            if node.ends:
                on_logits(node.ends, logits[r])
        children: list[tuple[Node, list | None]] = []
        if need_cache:
            filled = out.cache if cache_arg == "cache" else out.past_key_values
            layers = [(layer.keys, layer.values) for layer in filled.layers]
            for r, (node, _) in enumerate(batch):
                if node.children:
                    kv = _row_kv(layers, r, past_len, node.start, past_len + new_len - len(node.tokens))
                    children.extend((child, kv) for child in node.children)
        return children

    # The shared nodes wave by wave (each needs its parent's cache); the leaves, which are most of
    # the tokens, all at the end, batched by length across depths (less padding).
    wave: list[tuple[Node, list | None]] = [(n, None) for n in tops]  # (node, parent's per-layer (k, v))
    leaves: list[tuple[Node, list | None]] = []
    while wave:
        leaves += [x for x in wave if not x[0].children]
        nxt: list[tuple[Node, list | None]] = []
        for batch in _length_batches([x for x in wave if x[0].children], batch_size):
            nxt += run(batch)
        wave = nxt
    for batch in _length_batches(leaves, batch_size):
        run(batch)


# A batch's new tokens are padded to its longest node: a node shorter than this share of it
# starts the next batch (unless the gap is a few tokens), so padding stays a small part.
MIN_FILL = 0.75


def _length_batches(items: list, batch_size: int) -> list[list]:
    """Longest first; at most batch_size nodes a batch, of similar lengths (MIN_FILL)."""
    items = sorted(items, key=lambda x: (-len(x[0].tokens), -x[0].start))
    out: list[list] = []
    for item in items:
        n = len(item[0].tokens)
        if out and len(out[-1]) < batch_size:
            longest = len(out[-1][0][0].tokens)
            if n >= MIN_FILL * longest or longest - n <= 8:
                out[-1].append(item)
                continue
        out.append([item])
    return out


def _cache_kwarg(model) -> str:
    """The forward argument that takes the cache: `cache` (transformers >= 5.24), else `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft wrapper passes it on
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _padded_past(batch, past_len: int) -> list[tuple]:
    """Per layer, the batch's parents' keys and values left-padded (zeros, masked) to past_len; a
    top-level node in the batch (no parent) gets padding only."""
    import torch

    shapes = next(kv for _, kv in batch if kv is not None)
    data = []
    for layer, (k0, v0) in enumerate(shapes):
        ks, vs = [], []
        for node, kv in batch:
            k, v = kv[layer] if kv is not None else (k0[:, :0], v0[:, :0])
            if k.shape[-2] != node.start:
                raise RuntimeError(f"prefix sharing: the cached past has {k.shape[-2]} positions, the node "
                                   f"starts at {node.start}")
            pad = past_len - node.start
            if pad:
                k = torch.cat([k.new_zeros(*k.shape[:-2], pad, k.shape[-1]), k], dim=-2)
                v = torch.cat([v.new_zeros(*v.shape[:-2], pad, v.shape[-1]), v], dim=-2)
            ks.append(k)
            vs.append(v)
        data.append((torch.stack(ks), torch.stack(vs)))
    return data


def _row_kv(layers, row: int, past_len: int, start: int, new_from: int) -> list[tuple]:
    """One row's real keys/values (its past, then its own tokens), per layer, padding dropped."""
    import torch

    out = []
    for k, v in layers:
        out.append((torch.cat([k[row, :, past_len - start : past_len], k[row, :, new_from:]], dim=-2),
                    torch.cat([v[row, :, past_len - start : past_len], v[row, :, new_from:]], dim=-2)))
    return out
