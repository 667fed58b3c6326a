"""Run a list of pending records through a backend, resumably.

Protocols (DDS, AFR, stick-or-switch) build `Record`s with their messages and
metadata; this module fills in the model's output and appends them to the run's
store chunk by chunk. Records already in the store (same content key) are skipped, so
rerunning the same command after a crash continues where it stopped.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from tqdm.auto import tqdm

from flipguard.eval.backends.base import Backend, ContextTooLong, GenerationConfig, check_backend
from flipguard.eval.parallel import data_parallel, shard_and_gather
from flipguard.eval.records import Record, RecordStore, now_iso

# raw text -> (choice or None, reasoning or None)
Parser = Callable[[str], tuple[str | None, str | None]]

MODES = ("generate", "logprob")

# logprob mode: a judgment whose label mass P("1") + P("2") is below this is invalid. A
# chat model following "Return exactly one of: 1 or 2" puts most of its next-token mass
# on the labels; an argmax over two labels holding 1e-7 of the mass is not a judgment.
DEFAULT_MIN_LABEL_MASS = 0.5
# The threshold travels in the record's `extra` under this name, so it is part of the
# record's content key: a rerun with another threshold never mixes with these records.
MIN_LABEL_MASS = "min_label_mass"
# extra[NO_LABEL] = True: the backend saw no probability on any label (an HTTP server
# whose top logprobs hold neither "1" nor "2"); the judgment is invalid and counted.
NO_LABEL = "no_label_in_top_logprobs"


def label_mass(probs: dict[str, float], choices: Sequence[str] = ("1", "2")) -> float:
    """Probability mass the model put on the answer labels (sum over `choices`)."""
    return float(sum(probs[c] for c in choices))



def check_context(backend: Backend, records: Sequence[Record], gen_config: GenerationConfig | None = None) -> None:
    """Refuse, before any forward pass, records whose prompt (+ the reply budget in
    generate mode, + the answer token in logprob mode) exceeds the model's context.
    A backend that knows its limit (`Backend.max_context`) and can count tokens
    (`Backend.prompt_lengths` not None) is checked; the error names the item, its token
    count and the limit."""
    limit = backend.max_context
    if not limit or not records:
        return
    lengths = backend.prompt_lengths([r.messages for r in records])
    if lengths is None:
        return
    budget = {r.mode: ((gen_config or GenerationConfig()).max_new_tokens if r.mode == "generate" else 1)
              for r in records}
    too_long = [(r, n) for r, n in zip(records, lengths) if n + budget[r.mode] > limit]
    if not too_long:
        return
    rec, n = max(too_long, key=lambda x: x[1])
    n_items = len({(r.dataset, r.item_id) for r, _ in too_long})
    more = f"; {n_items} item(s), {len(too_long)} judgment(s) too long in all" if len(too_long) > 1 else ""
    reply = f" + {budget[rec.mode]} reply tokens" if rec.mode == "generate" else ""
    source = backend.max_context_source or "its context"
    raise ContextTooLong(
        f"item {rec.item_id!r} ({rec.dataset}, {rec.case}): the prompt is {n:,} tokens{reply}, more than "
        f"{backend.model_id} takes ({limit:,} tokens, {source}){more}; nothing was run. "
        "Shorten or remove the item"
    )


def run_records(
    store: RecordStore,
    records: Iterable[Record],
    backend: Backend,
    *,
    gen_config: GenerationConfig | None = None,
    parse: Parser | None = None,
    choices: Sequence[str] = ("1", "2"),
    chunk_size: int = 32,
    desc: str = "judgments",
    progress: bool = True,
    context_checked: bool = False,
) -> int:
    """Fill and append every record not yet in the store; returns how many were run.

    All records must share one mode. `generate` needs `parse`; `logprob` takes the
    argmax over `choices` and keeps the probabilities; a record whose
    extra["min_label_mass"] exceeds its label mass is invalid (choice None, counted as
    wrong and as invalid, like an unparseable reply; raw_output keeps the argmax label).
    A record with no mass at all on the labels is invalid whatever the threshold
    (raw_output None, extra["no_label_in_top_logprobs"] True). Records are stored per
    chunk, or one by one as they finish for a backend with `supports_on_result`. The
    backend must follow base.py's `Backend` contract (a BackendError says what it lacks).
    """
    check_backend(backend, f"run_records({desc})")
    todo: list[Record] = []
    seen: set[str] = set()
    for rec in records:
        if rec.key in store or rec.key in seen:
            continue
        seen.add(rec.key)
        todo.append(rec)
    if not todo:
        return 0
    modes = {r.mode for r in todo}
    if len(modes) != 1 or not modes <= set(MODES):
        raise ValueError(f"run_records needs one mode out of {MODES}, got {sorted(modes)}")
    mode = modes.pop()
    if mode == "generate" and parse is None:
        raise ValueError("generate mode needs a parser")
    if not context_checked:
        check_context(backend, todo, gen_config)  # an oversized item: refused before any forward pass
    backend.show_progress = False  # one bar here instead of one per chunk
    gen_config = gen_config or GenerationConfig()

    def fill(rec: Record, out) -> None:
        if mode == "generate":
            rec.raw_output = out
            rec.choice, rec.reasoning = parse(out)
            rec.valid = rec.choice is not None
            return
        p = out
        threshold = (rec.extra or {}).get(MIN_LABEL_MASS)
        mass = label_mass(p, choices)
        if not mass > 0.0:
            # no label among what the backend saw (e.g. an HTTP server's top logprobs):
            # not a judgment, whatever the threshold; counted as invalid, nothing made up
            rec.valid, rec.choice, rec.raw_output = False, None, None
            rec.extra = {**rec.extra, NO_LABEL: True}
        else:
            best = max(choices, key=lambda c: p[c])
            rec.valid = threshold is None or mass >= float(threshold)
            rec.choice = best if rec.valid else None
            rec.raw_output = best
        if tuple(choices) == ("1", "2"):
            rec.p1, rec.p2 = p["1"], p["2"]
        else:
            rec.extra = {**rec.extra, "probs": p}

    dp = data_parallel()  # several ranks: each answers a slice of every chunk, rank 0 stores
    incremental = backend.supports_on_result and dp is None
    done = 0
    with tqdm(total=len(todo), desc=desc, unit="req", disable=not progress) as bar:
        for start in range(0, len(todo), chunk_size):
            chunk = todo[start : start + chunk_size]
            convs = [r.messages for r in chunk]
            t0 = time.perf_counter()
            finished = [0]

            def store_one(i: int, out, chunk=chunk, t0=t0, finished=finished) -> None:
                # a backend that answers request by request (openai): each is stored as
                # it finishes, so a failure later in the chunk loses none of them
                nonlocal done
                finished[0] += 1
                rec = chunk[i]
                fill(rec, out)
                rec.time, rec.latency_s = now_iso(), (time.perf_counter() - t0) / finished[0]
                done += store.append([rec])
                bar.update(1)

            kwargs = {"on_result": store_one} if incremental else {}

            def answer(convs: list, kwargs=kwargs) -> list:
                if mode == "generate":
                    return backend.generate(convs, gen_config, **kwargs)
                return backend.choice_probs(convs, choices, **kwargs)

            outputs = answer(convs) if dp is None else shard_and_gather(dp, convs, answer)
            if incremental:
                continue
            latency = (time.perf_counter() - t0) / len(chunk)
            for rec, out in zip(chunk, outputs):
                fill(rec, out)
            stamp = now_iso()
            for rec in chunk:
                rec.time, rec.latency_s = stamp, latency
            done += store.append(chunk)
            bar.update(len(chunk))
    return done
