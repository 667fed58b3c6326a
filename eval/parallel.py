"""Which process this is when several are launched together (`accelerate launch
--num_processes N -m flipguard ...`, torchrun): the one data-parallel switch of the runner and
the backends, below both (a backend places itself on its rank's device; the runner shards)."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence


def data_parallel():
    """accelerate's PartialState when this process is one of several launched together
    (`accelerate launch --num_processes N -m flipguard ...`, torchrun: WORLD_SIZE > 1), else
    None: a single process never starts torch.distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    from accelerate import PartialState

    # on a machine without GPUs the ranks join a gloo group (accelerate's MULTI_CPU)
    return PartialState(cpu=not torch.cuda.is_available())


def is_writer() -> bool:
    """The process that writes the run directory: the only one, or rank 0 of several."""
    dp = data_parallel()
    return dp is None or dp.is_main_process


def shard_and_gather(dp, requests: Sequence[Any], answer: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """Data-parallel evaluation as lm-evaluation-harness does it: rank r answers requests r, r+N,
    r+2N, ... and every rank receives every answer in the original order (gloo/NCCL all-gather
    of Python objects), so the plan continues identically on all ranks (multi-turn tasks keep
    their turn order) and rank 0 alone stores them."""
    from accelerate.utils import gather_object

    mine = list(requests[dp.process_index :: dp.num_processes])
    answered = answer(mine) if mine else []
    per_rank = gather_object([answered])  # [answers of rank 0, of rank 1, ...]
    out: list[Any] = [None] * len(requests)
    for rank, answers in enumerate(per_rank):
        out[rank :: dp.num_processes] = answers
    return out


def merge_computed(dp, computed: dict[str, dict]) -> dict[str, dict]:
    """Every rank's `computed` (one per model label) as one: the first tokens each rank counted
    on its slice are summed, so run.json says what a single process would have; so are the
    prompt tokens prefix sharing saw and computed (each rank shares within its own slice, so
    the computed count is the ranks' together, not a single process's)."""
    from accelerate.utils import gather_object

    merged: dict[str, dict] = {}
    for per_rank in gather_object([computed]):
        for label, info in per_rank.items():
            into = merged.setdefault(label, {**info, "first_tokens": {},
                                             **({"prefix_tokens": {}} if "prefix_tokens" in info else {})})
            for tok, k in (info.get("first_tokens") or {}).items():
                into["first_tokens"][tok] = into["first_tokens"].get(tok, 0) + k
            for key, k in (info.get("prefix_tokens") or {}).items():
                into["prefix_tokens"][key] = into["prefix_tokens"].get(key, 0) + k
    for info in merged.values():
        if not info["first_tokens"]:
            del info["first_tokens"]
    return merged
