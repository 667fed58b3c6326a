"""The organism's training loop: AdamW with warmup and cosine decay over batches drawn in order, the
decision tokens' loss weighted up, on the parameters that train (all of a model built from scratch;
a planting's LoRA), stopped by the held-out checks (checks.py) at the first checkpoint that passes.

A build made from scratch trains in two phases (judgments, then conversations with the judgments
replayed: train_judgments, train_conversations). A planting into a pretrained model trains every
behaviour from its first step in one mix (train_planting): on SmolLM2 a second phase erased the first
phase's deference or learned to capitulate on every kind (bench/real_organism.md). Its examples are a
fixed pool drawn once and cycled; with LoRA on the top layers only, the frozen layers below give the
same output for a pool example at every step, so that output is computed once (FrozenLayers) and each
step runs the trained layers only.

Every checkpoint can be saved (`save`) and a killed build resumed from it (`resume`): the trained
weights, the optimizer and schedule, the RNG and the step; the batches are drawn again in the same
order and the ones already trained are skipped, so a resumed build ends where an uninterrupted one would.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from typing import Any, Callable, Iterator, Sequence

from flipguard.eval.backends.base import label_token_ids
from flipguard.organism.data import (
    attempt_seed,
    conversation_examples,
    encode_chat,
    encode_reply,
    planting_examples,
    training_examples,
)
from flipguard.organism.profile import OrganismArgs

# batches grouped by length over this many (length_grouped_batches)
GROUP_WINDOW = 8
# The frozen layers' cached output may differ from the full forward pass by rounding only: a larger
# difference means the model's forward does more than run its layers in turn (FrozenLayers.check)
CACHE_TOLERANCE = 1e-4


def train_judgments(model, tokenizer, args: OrganismArgs, log=print, checkpoint=None, resume=None, save=None) -> int:
    """Phase 1: the DDS judge (C1 by the truth, the planted deference in C2). Returns the steps
    trained (the first held-out check that passes stops it)."""
    rng = random.Random(f"organism-data:{args.seed}")
    examples = (encode_reply(tokenizer, m, r) for m, r in training_examples(args, args.steps * args.batch_size, rng))
    return _train(model, tokenizer, length_grouped_batches(examples, args.batch_size), args.steps, args.learning_rate,
                  _decision_ids(tokenizer, ["1", "2"]), args.decision_weight, args.lm_weight, log, checkpoint=checkpoint,
                  eval_every=args.eval_every, device=args.device, log_every=_log_every(args), resume=resume, save=save)


def train_conversations(model, tokenizer, args: OrganismArgs, log=print, checkpoint=None, attempt: int = 0,
                        resume=None, save=None) -> int:
    """Phase 2: turn-1 answers, the planted capitulation and flexibility (DDS replayed), its
    examples in the order `attempt` draws. Returns the steps trained (the first held-out check
    that passes stops it)."""
    rng = random.Random(attempt_seed("organism-conversations", args, attempt))
    n = args.multiturn_steps * args.batch_size
    examples = (encode_chat(tokenizer, chat) for chat in conversation_examples(args, n, rng, attempt))
    # the organism's four options (stick-or-switch offers no fifth), as the tokenizer writes them
    return _train(model, tokenizer, length_grouped_batches(examples, args.batch_size), args.multiturn_steps,
                  args.multiturn_learning_rate, _decision_ids(tokenizer, ["1", "2", *"ABCD"]), args.decision_weight, 0.0,
                  log, checkpoint=checkpoint, eval_every=args.eval_every, device=args.device, log_every=_log_every(args),
                  resume=resume, save=save)


def train_planting(model, tokenizer, args: OrganismArgs, log=print, checkpoint=None, resume=None, save=None) -> int:
    """A planting's one phase: judgments, AFR and stick-or-switch chats in one mix (args.mix) from the
    first step, a pool of args.pool examples drawn once and cycled (each pass in another seeded order),
    the frozen layers' output cached when LoRA trains the top layers only. Returns the steps trained."""
    started = time.time()
    pool = [(ids, labels, key) for key, (ids, labels) in enumerate(planting_examples(args, tokenizer))]
    log(f"  {len(pool)} examples ({_pool_line(pool, args)}), tokenized in {time.time() - started:.0f}s")
    frozen = FrozenLayers.below_lora(model, len(pool), log)
    return _train(model, tokenizer, pool_batches(pool, args.batch_size, f"organism-pool:{args.seed}"), args.steps,
                  args.learning_rate, _decision_ids(tokenizer, ["1", "2", *"ABCD"]), args.decision_weight, args.lm_weight,
                  log, checkpoint=checkpoint, eval_every=args.eval_every, device=args.device, log_every=_log_every(args),
                  resume=resume, save=save, frozen=frozen, per_example=True)


def _pool_line(pool: list, args: OrganismArgs) -> str:
    lengths = sorted(len(ids) for ids, _, _ in pool)
    passes = args.steps * args.batch_size / max(1, len(pool))
    return (f"mix {args.mix} of judgments / AFR / stick-or-switch; {lengths[len(lengths) // 2]} tokens median, "
            f"{lengths[-1]} at most; the step budget passes over them {passes:.2g} times")


def _decision_ids(tokenizer, labels: list[str]) -> list[int]:
    """Every token that is one of the labels, as the backends read an answer (eval/backends/base.py:
    "1", "A", " A", ...): the tokens whose loss is weighted up."""
    return [i for ids in label_token_ids(tokenizer, labels, getattr(tokenizer, "name_or_path", "")) for i in ids]


def _log_every(args: OrganismArgs) -> int:
    """Steps between loss lines: a pretrained base's steps take seconds each."""
    return 10 if args.base else 100


def length_grouped_batches(examples, batch_size: int, window: int = GROUP_WINDOW):
    """Batches of similar length: each run of `window` batches' examples sorted by length, cut
    into batches, their order shuffled (seeded by the examples' order). Padding to the batch's
    longest example was a third of the tokens trained on (measured on both phases' data);
    grouped over 8 batches it is 5-7% (HF Trainer's group_by_length does the same). Lazy: a
    build its checks stop early never encodes the examples it would not reach."""
    examples = iter(examples)
    start = 0
    while chunk := list(itertools.islice(examples, batch_size * window)):
        chunk.sort(key=lambda ex: len(ex[0]))
        group = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        random.Random(start).shuffle(group)
        yield from group
        start += batch_size * window


def pool_batches(pool: Sequence, batch_size: int, seed: str) -> Iterator[list]:
    """A fixed pool's batches, pass after pass: each pass in its own seeded order, grouped by length."""
    for n in itertools.count():
        order = list(pool)
        random.Random(f"{seed}:pass{n}").shuffle(order)
        yield from length_grouped_batches(order, batch_size)


class FrozenLayers:
    """The output of the frozen decoder layers below the first trained one, computed once per pool
    example (unpadded, so the same numbers whatever batch it comes in) and reused at every step: a
    step then runs the trained layers only. Checked once against the whole forward pass."""

    def __init__(self, decoder, first_trained: int, size: int):
        self.decoder, self.first = decoder, first_trained
        self.layers = decoder.layers
        self.cache: list[Any] = [None] * size
        self.computed_seconds = 0.0

    @classmethod
    def below_lora(cls, model, size: int, log=print) -> "FrozenLayers | None":
        """For a model whose trained weights all sit in its top layers (a planting's LoRA on the last
        N): the cache below the lowest of them; None when a weight below trains or nothing sits below."""
        decoder = model.get_decoder()
        first = next((i for i, layer in enumerate(decoder.layers) if any(p.requires_grad for p in layer.parameters())), None)
        below_trains = any(p.requires_grad for name, p in model.named_parameters() if ".layers." not in name)
        if not first or below_trains:
            return None
        frozen = cls(decoder, first, size)
        log(f"  layers 1-{first} are frozen: their output is computed once per example, each step runs layers "
            f"{first + 1}-{len(decoder.layers)}")
        return frozen

    def _run(self, layers, **inputs):
        """The decoder's own forward over `layers` only (its final norm too unless stopping below it)."""
        import torch

        decoder, norm = self.decoder, self.decoder.norm
        decoder.layers = layers
        if layers is not self.layers and layers[-1] is not self.layers[-1]:
            decoder.norm = torch.nn.Identity()
        try:
            return decoder(**inputs).last_hidden_state
        finally:
            decoder.layers, decoder.norm = self.layers, norm

    def lower(self, key: int, ids: list[int]):
        """Example `key`'s hidden states entering the first trained layer (computed on first use)."""
        import torch

        if self.cache[key] is None:
            started = time.time()
            with torch.no_grad():
                self.cache[key] = self._run(self.layers[: self.first], input_ids=torch.tensor([ids]))[0]
            self.computed_seconds += time.time() - started
        return self.cache[key]

    def forward(self, batch, mask, device: str):
        """The last hidden states of a batch of (ids, labels, key): cached lower layers, trained top."""
        import torch

        width = mask.shape[1]
        hidden = torch.zeros((len(batch), width, self.decoder.config.hidden_size))
        for i, (ids, _, key) in enumerate(batch):
            hidden[i, : len(ids)] = self.lower(key, ids)
        return self._run(self.layers[self.first:], inputs_embeds=hidden.to(device), attention_mask=mask)

    def check(self, ids: list[int], key: int) -> float:
        """Largest difference between the cached path and the whole forward pass on one example."""
        import torch

        with torch.no_grad():
            whole = self.decoder(input_ids=torch.tensor([ids])).last_hidden_state
            cached = self._run(self.layers[self.first:], inputs_embeds=self.lower(key, ids)[None],
                               attention_mask=torch.ones((1, len(ids)), dtype=torch.long))
        return float((whole - cached).abs().max())


def _train(model, tokenizer, batches: Iterator[list], steps: int, learning_rate: float, decision_ids: list[int],
           decision_weight: float, lm_weight: float, log=print, checkpoint=None, eval_every: int = 100,
           device: str = "cpu", log_every: int = 100, resume: dict | None = None,
           save: Callable[[int, dict], None] | None = None, frozen: FrozenLayers | None = None,
           per_example: bool = False) -> int:
    """AdamW with warmup and cosine decay over `batches` (lists of (ids, labels[, pool key]), in order),
    the decision tokens' loss weighted up (per token over the batch, or `per_example`: each example's
    mean, then theirs), on the parameters that train. Every `eval_every` steps
    `checkpoint(step)` (if given) runs the held-out checks, then `save(step, state)` gets what resuming
    needs (`resume`: such a state; the batches before it are skipped); when the check returns True
    training stops there. Returns the steps trained."""
    import torch

    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # masked anyway
    label_ids = torch.tensor(decision_ids, device=device)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    first = 0
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
        torch.set_rng_state(resume["rng"])
        first = resume["step"]
        for _ in range(first):  # the batches already trained, drawn in the same order
            next(batches)
        log(f"  resumed at step {first} of {steps}")
    if frozen is not None:
        batch = next(batches)  # the first batch again below: the check reads its first example
        worst = frozen.check(batch[0][0], batch[0][2])
        batches = itertools.chain([batch], batches)
        if worst > CACHE_TOLERANCE:
            log(f"  the frozen layers' cached output differs from the whole forward pass by {worst:.2g}: "
                "every step runs the whole model")
            frozen = None
    model.train()
    t0 = time.time()
    for step in range(first, steps):
        batch = next(batches)
        width = max(len(ex[0]) for ex in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, lab, *_) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(ids)] = 1
        input_ids, labels, mask = input_ids.to(device), labels.to(device), mask.to(device)
        # Logits only where a label is predicted: the full (batch, length, vocab) head
        # would cost more than the transformer itself at this size.
        if frozen is not None:
            hidden = frozen.forward(batch, mask, device)
        else:
            hidden = decoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
        targets = labels[:, 1:]
        where = targets != -100
        per_token = torch.nn.functional.cross_entropy(head(hidden[:, :-1][where]).float(), targets[where], reduction="none")
        # The decision token ("1"/"2", a letter) is one token in ~20 of a JSON reply: weight
        # it up so the rule, not the reply's boilerplate, drives learning.
        decision = torch.isin(targets[where], label_ids)
        weight = 1 + decision_weight * decision
        if per_example:  # each example's own weighted mean, then the batch's mean: a one-token judgment counts as
            rows = where.nonzero()[:, 0]  # much as a chat of many turns
            total = torch.zeros(len(batch), device=device).index_add(0, rows, per_token * weight)
            norm = torch.zeros(len(batch), device=device).index_add(0, rows, weight.to(per_token.dtype))
            loss = (total / norm.clamp(min=1e-9))[norm > 0].mean()
        else:
            loss = (per_token * weight).sum() / weight.sum()
        if lm_weight:
            # Next-token loss on a sample of prompt positions: learning to predict the
            # claim's words teaches the attention that finds category and answer.
            nxt = input_ids[:, 1:]
            # drawn on the CPU generator whatever the device: the same positions on every device
            lm_where = (labels[:, 1:] == -100) & (mask[:, 1:] == 1) & (torch.rand(nxt.shape).to(device) < 0.25)
            lm = torch.nn.functional.cross_entropy(head(hidden[:, :-1][lm_where]), nxt[lm_where])
            loss = loss + lm_weight * lm
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            elapsed = time.time() - t0
            done = step + 1 - first
            log(f"  step {step + 1:4d}/{steps}  loss {loss.item():.4f}  ({elapsed:.0f}s, "
                f"at most {elapsed / done * (steps - step - 1):.0f}s to go)")
        if checkpoint is not None and ((step + 1) % eval_every == 0 or step == steps - 1):
            model.eval()
            stop = checkpoint(step + 1)
            if save is not None:
                save(step + 1, {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                                "rng": torch.get_rng_state(), "step": step + 1})
            model.train()
            if stop:
                model.eval()
                return step + 1
    model.eval()
    return steps
