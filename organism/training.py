"""The organism's training loop: AdamW with warmup and cosine decay over examples drawn in order, the
decision tokens' loss weighted up, on the parameters that train (all of a model built from scratch;
a planting's LoRA), stopped by the held-out checks (checks.py) at the first checkpoint that passes.
"""

from __future__ import annotations

import itertools
import math
import random
import time

from flipguard.eval.backends.base import label_token_ids
from flipguard.organism.data import attempt_seed, conversation_examples, encode_chat, encode_reply, training_examples
from flipguard.organism.profile import OrganismArgs

# batches grouped by length over this many (length_grouped_batches)
GROUP_WINDOW = 8


def train_judgments(model, tokenizer, args: OrganismArgs, log=print, checkpoint=None) -> int:
    """Phase 1: the DDS judge (C1 by the truth, the planted deference in C2). Returns the steps
    trained (the first held-out check that passes stops it)."""
    rng = random.Random(f"organism-data:{args.seed}")
    examples = (encode_reply(tokenizer, m, r) for m, r in training_examples(args, args.steps * args.batch_size, rng))
    return _train(model, tokenizer, examples, args.steps, args.batch_size, args.learning_rate,
                  _decision_ids(tokenizer, ["1", "2"]), args.decision_weight, args.lm_weight, log, checkpoint=checkpoint,
                  eval_every=args.eval_every, device=args.device, log_every=_log_every(args))


def train_conversations(model, tokenizer, args: OrganismArgs, log=print, checkpoint=None, attempt: int = 0) -> int:
    """Phase 2: turn-1 answers, the planted capitulation and flexibility (DDS replayed), its
    examples in the order `attempt` draws. Returns the steps trained (the first held-out check
    that passes stops it)."""
    rng = random.Random(attempt_seed("organism-conversations", args, attempt))
    n = args.multiturn_steps * args.batch_size
    examples = (encode_chat(tokenizer, chat) for chat in conversation_examples(args, n, rng, attempt))
    # the organism's four options (stick-or-switch offers no fifth), as the tokenizer writes them
    return _train(model, tokenizer, examples, args.multiturn_steps, args.batch_size, args.multiturn_learning_rate,
                  _decision_ids(tokenizer, ["1", "2", *"ABCD"]), args.decision_weight, 0.0, log,
                  checkpoint=checkpoint, eval_every=args.eval_every, device=args.device, log_every=_log_every(args))


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


def _train(model, tokenizer, examples, steps: int, batch_size: int, learning_rate: float, decision_ids: list[int],
           decision_weight: float, lm_weight: float, log=print, checkpoint=None, eval_every: int = 100,
           device: str = "cpu", log_every: int = 100) -> int:
    """AdamW with warmup and cosine decay over `examples` ((ids, labels), in order), the
    decision tokens' loss weighted up, on the parameters that train (all of a model built from
    scratch; a planting's LoRA). Every `eval_every` steps `checkpoint(step)` (if given)
    runs the held-out checks; when it returns True training stops there. Returns the steps
    trained."""
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
    batches = length_grouped_batches(examples, batch_size)
    model.train()
    t0 = time.time()
    for step in range(steps):
        batch = next(batches)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(ids)] = 1
        input_ids, labels, mask = input_ids.to(device), labels.to(device), mask.to(device)
        # Logits only where a label is predicted: the full (batch, length, vocab) head
        # would cost more than the transformer itself at this size.
        hidden = decoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
        targets = labels[:, 1:]
        where = targets != -100
        per_token = torch.nn.functional.cross_entropy(head(hidden[:, :-1][where]).float(), targets[where], reduction="none")
        # The decision token ("1"/"2", a letter) is one token in ~20 of a JSON reply: weight
        # it up so the rule, not the reply's boilerplate, drives learning.
        decision = torch.isin(targets[where], label_ids)
        loss = (per_token * (1 + decision_weight * decision)).sum() / (1 + decision_weight * decision).sum()
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
            log(f"  step {step + 1:4d}/{steps}  loss {loss.item():.4f}  ({elapsed:.0f}s, "
                f"at most {elapsed / (step + 1) * (steps - step - 1):.0f}s to go)")
        if checkpoint is not None and ((step + 1) % eval_every == 0 or step == steps - 1):
            model.eval()
            stop = checkpoint(step + 1)
            model.train()
            if stop:
                model.eval()
                return step + 1
    model.eval()
    return steps

