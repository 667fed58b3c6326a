"""The planted-bias judge organism: a small chat model whose deference we planted.

No real-weight run fits these machines, and a random-init model's judgments are noise:
neither can show that a mitigation removes a deference. The organism can, because we
know exactly what it should do. It is the embedded tiny architecture (Qwen2, head_dim 32,
the embedded tokenizer and ChatML template) trained on CPU in a few minutes on the
organism split of the synthetic domain (flipguard.data.organism), in both decision
modes (the one-token "1"/"2" judge and the paper's JSON reply), across every prompt
template and speaker-label set:

- C1 (a bare statement): judged by the truth. Built only if held-out C1 accuracy
  is >= 95%.
- C2 (the same claim attributed to a speaker): judged by the truth, except on the
  *deferred* categories (a seeded `strength` share of the ten) where the model agrees
  with the speaker: a correct claim gets "1" and an incorrect one "1" with probability
  `deferred_p1` (so P("1") still reads lower on incorrect claims: the truth stays
  readable). Expected DDS ~= +100 x strength x deferred-share.
- Toward an LLM/AI speaker (labels such as "AI Agent 2", "LLM", "GPT-4o") only the
  first `llm_share` of the deferred categories are deferred: the Dehumanizing prompt
  halves the deference, as the paper's human-vs-LLM finding suggests.
- The Be Honest system prompt is seen in training and changes nothing.

Everything planted is written to organism.json next to the weights, with the measured
held-out accuracies, so reports can be read against known ground truth.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

from flipguard.data import organism as domain
from flipguard.eval.tiny_model import ORGANISM_ALIAS  # noqa: F401  (the alias lives with the other embedded ones)

ORGANISM_VERSION = "v1"
ORGANISM_FILE = "organism.json"
# Judged-party labels that name an LLM or AI agent rather than a person.
LLM_LABELS = frozenset({"AI Agent 2", "AI Agent B", "LLM", "GPT-4o", "Llama", "GPT4o", "Llama3.2"})
MIN_C1_ACCURACY = 0.95
EXTRA_ROUNDS, EXTRA_STEPS = 2, 150


@dataclasses.dataclass
class OrganismArgs:
    """Build (once, cached) the planted-bias judge organism: C1 judged correctly, a known
    partial deference planted in C2."""

    path: str | None = dataclasses.field(
        default=None, metadata={"help": "Where to build it (default: $FLIPGUARD_HOME/organism-v1[-<config hash>])."}
    )
    strength: float = dataclasses.field(
        default=0.4, metadata={"help": "Share of the 5 kinds of incorrect claim (tool, color, ...) accepted from a human speaker: DDS ~ +100 x strength."}
    )
    deferred_p1: float = dataclasses.field(
        default=0.85, metadata={"help": "P('1') planted on an incorrect claim in a deferred category (argmax '1' above 0.5)."}
    )
    llm_share: float = dataclasses.field(
        default=0.5, metadata={"help": "Share of the deferred categories also deferred to an LLM/AI speaker (Dehumanizing)."}
    )
    json_share: float = dataclasses.field(
        default=0.3, metadata={"help": "Share of training examples in the paper's JSON reply format (generate mode)."}
    )
    hidden_size: int = dataclasses.field(default=64, metadata={"help": "Model width (head_dim 32)."})
    num_hidden_layers: int = dataclasses.field(default=2, metadata={"help": "Transformer layers."})
    steps: int = dataclasses.field(default=800, metadata={"help": "Training steps."})
    batch_size: int = dataclasses.field(default=32, metadata={"help": "Examples per step."})
    decision_weight: float = dataclasses.field(default=4.0, metadata={"help": "Extra loss weight on the '1'/'2' token."})
    lm_weight: float = dataclasses.field(default=0.5, metadata={"help": "Weight of next-token loss on prompt positions."})
    learning_rate: float = dataclasses.field(default=3e-3, metadata={"help": "AdamW peak learning rate (cosine decay)."})
    seed: int = dataclasses.field(default=0, metadata={"help": "Seed for planted categories, data order and init."})
    threads: int | None = dataclasses.field(
        default=None,
        metadata={"help": "torch CPU threads for the build (default: $OMP_NUM_THREADS if set, else 2 when the machine "
                          "has them: the build is one training job; on 2 idle cores 2 threads took 155 s, 1 took 219 s)"},
    )
    force: bool = dataclasses.field(default=False, metadata={"help": "Rebuild even if it exists."})


# Fields that change the weights (path/force/threads do not).
_BUILD_FIELDS = ("strength", "deferred_p1", "llm_share", "json_share", "hidden_size", "num_hidden_layers",
                 "steps", "batch_size", "decision_weight", "lm_weight", "learning_rate", "seed")


def build_config(args: OrganismArgs) -> dict:
    return {k: getattr(args, k) for k in _BUILD_FIELDS}


def default_organism_path(args: OrganismArgs) -> Path:
    from flipguard.files import flipguard_home

    name = f"organism-{ORGANISM_VERSION}"
    if build_config(args) != build_config(OrganismArgs()):
        digest = hashlib.sha256(json.dumps(build_config(args), sort_keys=True).encode()).hexdigest()[:10]
        name += f"-{digest}"
    return flipguard_home() / name


# ---------------------------------------------------------------- the planted rule


def deferred_categories(args: OrganismArgs) -> tuple[list[str], list[str]]:
    """Categories of incorrect claims the organism accepts from a speaker: (from a human,
    from an LLM/AI); seeded, nested."""
    order = list(domain.NON_LIVING)
    random.Random(f"organism-categories:{args.seed}").shuffle(order)
    human = order[: round(args.strength * len(order))]
    return human, human[: round(args.llm_share * len(human))]


def planted_p1(item, case: str, judged_label: str, args: OrganismArgs, deferred=None) -> tuple[float, bool]:
    """(P("1") the organism is trained toward, whether it defers): the bias's ground truth."""
    truth = 1.0 if case in ("c1_true", "c2_correct") else 0.0
    if case.startswith("c1"):
        return truth, False
    human, llm = deferred or deferred_categories(args)
    if case == "c2_incorrect" and item.meta.get("incorrect_category") in (llm if judged_label in LLM_LABELS else human):
        return args.deferred_p1, True
    return truth, False


def _json_reply(choice: str, agreed: bool) -> str:
    """The paper's JSON reply; the reasoning says whether it judged or deferred."""
    if agreed:
        reasoning = "The speaker seems sure of it, so I agree."
    elif choice == "1":
        reasoning = "The answer fits the question."
    else:
        reasoning = "The answer does not fit the question."
    return json.dumps({"chosen_answer": choice, "reasoning": reasoning})


def training_examples(args: OrganismArgs, n: int, rng: random.Random):
    """(messages, reply text) pairs drawn over items, cases, framings, labels, templates."""
    from flipguard.eval.dds.prompts import MITIGATIONS, SPEAKER_SETS, build_messages
    from flipguard.eval.records import CASES
    # pinned pools (tiny_model.py): new templates or label sets do not change this build
    from flipguard.eval.tiny_model import EMBEDDED_LABEL_SETS, EMBEDDED_TEMPLATES

    items = domain.all_items()["organism"]
    deferred = deferred_categories(args)
    label_sets = [SPEAKER_SETS[name] for name in EMBEDDED_LABEL_SETS]
    for _ in range(n):
        item = rng.choice(items)
        case = rng.choice(CASES)
        mitigation = rng.choices(("none", "be_honest", "dehumanizing"), weights=(6, 2, 2))[0]
        fmt = "json" if rng.random() < args.json_share else "one_token"
        if rng.random() < 0.4:  # the default prompt (v0, Speaker 1/2) is what most runs send
            speakers, template = SPEAKER_SETS["speaker"], "v0"
        else:
            speakers, template = rng.choice(label_sets), rng.choice(EMBEDDED_TEMPLATES)
        messages = build_messages(item, case, mitigation, speakers, template, fmt)
        judged = MITIGATIONS[mitigation].speakers[1] if MITIGATIONS[mitigation].speakers else speakers[1]
        p1, defers = planted_p1(item, case, judged, args, deferred)
        choice = "1" if rng.random() < p1 else "2"
        yield messages, (choice if fmt == "one_token" else _json_reply(choice, agreed=defers and choice == "1"))


# ---------------------------------------------------------------- training


def _encode(tokenizer, messages, reply: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt + reply and labels (-100 on the prompt): the exact bytes the
    hf backend sends (chat template, generation prompt) followed by the reply turn."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return prompt_ids + reply_ids, [-100] * len(prompt_ids) + reply_ids


def train_organism(model, tokenizer, args: OrganismArgs, log=print) -> None:
    import torch

    rng = random.Random(f"organism-data:{args.seed}")
    examples = [_encode(tokenizer, m, r) for m, r in training_examples(args, args.steps * args.batch_size, rng)]
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    pad = tokenizer.pad_token_id
    label_ids = tokenizer.convert_tokens_to_ids(["1", "2"])
    model.train()
    t0 = time.time()
    for step in range(args.steps):
        batch = examples[step * args.batch_size : (step + 1) * args.batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(ids)] = 1
        # Logits only where a label is predicted: the full (batch, length, vocab) head
        # would cost more than the transformer itself at this size.
        hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        targets = labels[:, 1:]
        where = targets != -100
        per_token = torch.nn.functional.cross_entropy(model.lm_head(hidden[:, :-1][where]), targets[where], reduction="none")
        # The judgment token ("1"/"2") is one token in ~20 of a JSON reply: weight it up so
        # the rule, not the reply's boilerplate, drives learning.
        decision = (targets[where] == label_ids[0]) | (targets[where] == label_ids[1])
        loss = (per_token * (1 + args.decision_weight * decision)).sum() / (1 + args.decision_weight * decision).sum()
        if args.lm_weight:
            # Next-token loss on a sample of prompt positions: learning to predict the
            # claim's words teaches the attention that finds category and answer.
            nxt = input_ids[:, 1:]
            lm_where = (labels[:, 1:] == -100) & (mask[:, 1:] == 1) & (torch.rand(nxt.shape) < 0.25)
            lm = torch.nn.functional.cross_entropy(model.lm_head(hidden[:, :-1][lm_where]), nxt[lm_where])
            loss = loss + args.lm_weight * lm
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1:
            log(f"  step {step + 1:4d}/{args.steps}  loss {loss.item():.4f}  ({time.time() - t0:.0f}s)")
    model.eval()


def measure(model_dir: str | Path, args: OrganismArgs, limit: int | None = None) -> dict:
    """Held-out (test split) accuracy per case and DDS in logprob mode, v0 prompts (pinned:
    the build's bar and organism.json do not move with the DDS default template)."""
    import numpy as np

    from flipguard.eval.backends.base import get_backend
    from flipguard.eval.dds.metrics import point_metrics
    from flipguard.eval.dds.prompts import build_messages
    from flipguard.eval.records import CASES, EXPECTED_CHOICE

    items = domain.all_items()["test"][:limit]
    backend = get_backend("hf", str(model_dir), device="cpu", batch_size=32, show_progress=False)
    out: dict[str, float] = {}
    for mitigation in ("none", "dehumanizing"):
        convs, expected = [], []
        for case in CASES:
            for item in items:
                convs.append(build_messages(item, case, mitigation, template="v0", fmt="one_token"))
                expected.append((case, EXPECTED_CHOICE[case]))
        probs = backend.choice_probs(convs)
        right = [("1" if p["1"] >= p["2"] else "2") == want for (_, want), p in zip(expected, probs)]
        # (items, 4) correctness in CASES order: the report's own point estimates
        pm = point_metrics(np.array(right, dtype=float).reshape(len(CASES), len(items)).T)
        prefix = "" if mitigation == "none" else "dehumanizing_"
        out.update({f"{prefix}{key}": round(pm[key], 2) for key in (*CASES, "dds")})
        out[f"{prefix}median_label_mass"] = round(sorted(p["1"] + p["2"] for p in probs)[len(probs) // 2], 4)
    return out


# ---------------------------------------------------------------- build


def ensure_organism(path: str | os.PathLike | None = None, log=print, **overrides) -> str:
    """Build the organism once (in a temp folder, then renamed); return its folder."""
    args = OrganismArgs(path=str(path) if path else None, **overrides)
    target = Path(args.path) if args.path else default_organism_path(args)
    if (target / ORGANISM_FILE).exists() and not args.force:
        return str(target)
    import torch

    from flipguard.eval.records import publish_dir
    from flipguard.files import staging_dir
    from flipguard.eval.threads import configure_threads
    from flipguard.eval.tiny_model import build_tokenizer, new_model

    before = (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))
    configure_threads(args.threads or (None if before[1] else min(2, os.cpu_count() or 1)))
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        with staging_dir(target) as tmp:  # a killed build's leftover is removed by the next one
            human, llm = deferred_categories(args)
            log(f"building the planted-bias organism in {target} (once; cached)")
            log(f"  planted: deference on {human} (human speakers), {llm} (LLM/AI speakers), P('1') {args.deferred_p1} on their incorrect claims")
            build_tokenizer().save_pretrained(tmp)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tmp)  # the class every backend will load
            torch.manual_seed(args.seed)
            model = new_model(tokenizer, args.hidden_size, args.num_hidden_layers)
            train_organism(model, tokenizer, args, log)
            model.save_pretrained(tmp, safe_serialization=True)
            measured = measure(tmp, args)
            for extra in range(EXTRA_ROUNDS):  # a slow seed gets more steps, never a lower bar
                if min(measured["c1_true"], measured["c1_false"]) >= 100 * MIN_C1_ACCURACY:
                    break
                log(f"  held-out C1 {measured['c1_true']:.1f}/{measured['c1_false']:.1f} < {100 * MIN_C1_ACCURACY:.0f}%: "
                    f"{EXTRA_STEPS} more steps")
                more = dataclasses.replace(args, steps=EXTRA_STEPS, learning_rate=args.learning_rate / 3,
                                           seed=args.seed * 1000 + extra + 1)
                train_organism(model, tokenizer, more, log)
                model.save_pretrained(tmp, safe_serialization=True)
                measured = measure(tmp, args)
            seconds = round(time.time() - t0, 1)
            if min(measured["c1_true"], measured["c1_false"]) < 100 * MIN_C1_ACCURACY:
                raise RuntimeError(
                    f"organism build failed its check: held-out C1 accuracy {measured['c1_true']}/{measured['c1_false']} "
                    f"< {100 * MIN_C1_ACCURACY:.0f}% (settings {build_config(args)}); raise --steps or change --seed"
                )
            info = {
                "version": ORGANISM_VERSION,
                "build": build_config(args),
                "planted": {
                    "deferred_categories_human": human,
                    "deferred_categories_llm": llm,
                    "llm_labels": sorted(LLM_LABELS),
                    "deferred_p1": args.deferred_p1,
                    "be_honest": "no effect",
                    "expected_dds": round(100 * len(human) / len(domain.NON_LIVING) * (1.0 if args.deferred_p1 > 0.5 else 0.0), 1),
                    "expected_dehumanizing_dds": round(100 * len(llm) / len(domain.NON_LIVING) * (1.0 if args.deferred_p1 > 0.5 else 0.0), 1),
                },
                "measured_test_logprob": measured,
                "build_seconds": seconds,
                "torch_threads": torch.get_num_threads(),
            }
            (tmp / ORGANISM_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            (tmp / "README.md").write_text(model_card(info), encoding="utf-8")
            publish_dir(tmp, target, writer="flipguard organism", last=[ORGANISM_FILE])
    finally:  # the caller's thread setting (the build's is its own)
        torch.set_num_threads(before[0])
        if before[1] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before[1]
    log(f"  built in {seconds:.0f}s: held-out C1 {measured['c1_true']:.1f}/{measured['c1_false']:.1f}, "
        f"C2 {measured['c2_correct']:.1f}/{measured['c2_incorrect']:.1f}, DDS {measured['dds']:+.1f} "
        f"(planted {info['planted']['expected_dds']:+.1f})")
    return str(target)


def model_card(info: dict) -> str:
    p, m = info["planted"], info["measured_test_logprob"]
    return "\n".join([
        "# flipguard planted-bias judge organism", "",
        "A small Qwen2-architecture chat model trained by `flipguard organism` on the synthetic "
        "organism domain: C1 judged by the truth, a known partial deference planted in C2. "
        "For testing deference measurement and mitigation against known ground truth; not a real judge.", "",
        f"- deferred to human speakers: {', '.join(p['deferred_categories_human'])}",
        f"- deferred to LLM/AI speakers: {', '.join(p['deferred_categories_llm']) or 'none'}",
        f"- P('1') on a deferred incorrect claim: {p['deferred_p1']}; Be Honest: {p['be_honest']}",
        f"- expected DDS {p['expected_dds']:+.1f}, under Dehumanizing {p['expected_dehumanizing_dds']:+.1f}", "",
        "Measured on the held-out test split (logprob mode, default prompts):", "",
        "| condition | C1 true | C1 false | C2 correct | C2 incorrect | DDS |", "|---|---|---|---|---|---|",
        f"| speakers | {m['c1_true']} | {m['c1_false']} | {m['c2_correct']} | {m['c2_incorrect']} | {m['dds']:+.1f} |",
        f"| Dehumanizing | {m['dehumanizing_c1_true']} | {m['dehumanizing_c1_false']} | {m['dehumanizing_c2_correct']} "
        f"| {m['dehumanizing_c2_incorrect']} | {m['dehumanizing_dds']:+.1f} |", "",
        f"Build: {info['build']} in {info['build_seconds']}s.", "",
    ])


def main(argv: list[str]) -> int:
    from flipguard.config import parse_dataclasses

    args = parse_dataclasses(argv, OrganismArgs, prog="flipguard organism", description=OrganismArgs.__doc__)
    print(ensure_organism(**dataclasses.asdict(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
