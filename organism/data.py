"""The organism's training data: every example drawn from the profile's rules over the organism split
of the synthetic domain, and tokenized through the model's own chat template.

Judgments (DDS) are the exact prompts `flipguard eval` sends (every template, speaker-label set and
mitigation prompt, the one-token and the JSON reply); conversations are the exact chats AFR and
stick-or-switch send, built by the protocols' own code and answered turn by turn by the planted rule.
"""

from __future__ import annotations

import json
import random

from flipguard.data import organism_datasets as domain
from flipguard.data.organism_datasets import wrong_option_argument
from flipguard.errors import FlipguardError
from flipguard.eval.afr import prompts as afr_prompts
from flipguard.eval.dds.prompts import MITIGATIONS, SPEAKER_SETS, build_messages
from flipguard.eval.embedded.tiny_model import EMBEDDED_LABEL_SETS, EMBEDDED_TEMPLATES
from flipguard.eval.records import CASES
from flipguard.eval.sos import protocol as sos
from flipguard.eval.sos.prompts import answer_reply
from flipguard.eval.sos.protocol import sos_item
from flipguard.organism.profile import (
    N_VALIDATION,
    OrganismArgs,
    capitulation_kinds,
    deferred_categories,
    held_argument_p,
    mix_shares,
    planted_p1,
    planted_switch,
)

# phase 2's example mix: DDS replay, AFR chats, stick-or-switch chats (set on v2: bench/archive/organism_multiturn_v2.md)
MULTITURN_MIX = (0.25, 0.45, 0.30)


# mitigation system prompts are seen in conversation too (and change nothing)
_MITIGATION_WEIGHTS = (("none", "be_honest", "dehumanizing"), (6, 2, 2))


def _json_reply(choice: str, agreed: bool) -> str:
    """The paper's JSON reply; the reasoning says whether it judged or deferred."""
    if agreed:
        reasoning = "The speaker seems sure of it, so I agree."
    elif choice == "1":
        reasoning = "The answer fits the question."
    else:
        reasoning = "The answer does not fit the question."
    return json.dumps({"chosen_answer": choice, "reasoning": reasoning})


def build_items(mc: bool = False) -> dict[str, list]:
    """The organism split of the domain (or of its multiple-choice form) as the build uses it:
    "train" (what it learns from) and "validation" (its last N_VALIDATION items: the held-out
    checks that stop the build; disjoint from the test split reports read)."""
    items = (domain.mc_items() if mc else domain.claim_items())["organism"]
    return {"train": items[:-N_VALIDATION], "validation": items[-N_VALIDATION:]}


def training_examples(args: OrganismArgs, n: int, rng: random.Random):
    """(messages, reply text) pairs drawn over items, cases, framings, labels, templates."""
    # pinned pools (tiny_model.py): new templates or label sets do not change this build

    items = build_items()["train"]
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


def _afr_chat(item, kinds: list[str], args: OrganismArgs, rng: random.Random) -> list[dict[str, str]]:
    """AFR's baseline turn (a letter, as logprob mode stores it, or "Answer: X"), then,
    mostly, its challenge for one wrong option and the planted reply."""
    mitigation = rng.choices(*_MITIGATION_WEIGHTS)[0]
    base = afr_prompts.baseline_messages(item, MITIGATIONS[mitigation].system)
    letter_form = rng.random() < 0.8  # the demo's AFR runs in logprob mode
    say = (lambda x: x) if letter_form else (lambda x: f"Answer: {x}")
    if rng.random() < 0.1:
        return base + [{"role": "assistant", "content": say(item.answer)}]
    x = rng.choice(item.wrong_letters)
    redraw = held_argument_p(kinds)
    if redraw:  # never where enough kinds are held (the default): no draw, every earlier build's data
        held = [y for y in item.wrong_letters if domain.word_category(item.option_text(y)) not in kinds]
        if held and rng.random() < redraw:
            x = rng.choice(held)
    chat = afr_prompts.challenge_messages(base, say(item.answer), item, x, wrong_option_argument(item, x),
                                          rng.choice(("blind", "self")))
    switch = rng.random() < planted_switch("distractor", item.option_text(x), kinds, args)
    return chat + [{"role": "assistant", "content": say(x if switch else item.answer)}]


def _sos_chat(item, pool, kinds: list[str], args: OrganismArgs, rng: random.Random) -> list[dict[str, str]]:
    """A stick-or-switch chat built by the protocol's own code (no exemplars), answered by
    the planted rule turn after turn until the organism switches or the options run out."""
    settings = sos.SosSettings(seed=rng.randrange(10**6), n_shots=0, mitigation=rng.choices(*_MITIGATION_WEIGHTS)[0])
    if rng.random() < 0.15:  # the single-shot baselines (four options, or two)
        record = rng.choice(sos.baseline_records([item], pool, settings, 0, model="organism", backend="hf",
                                                 split="organism", gen_config=None))
        return record.messages + [{"role": "assistant", "content": answer_reply(record.expected)}]
    scenario = rng.choice(sos.MULTI_TURN)
    conv = sos.start_conversation(item, scenario, pool, settings, 0)
    current = conv.target
    while True:
        if scenario == "flexibility":
            if conv.turn > 1:
                break
            branch = rng.choice(sos.BRANCHES)
            text, role = conv.to_offer[0] if branch == "correct" else conv.to_offer[1]
            conv = conv.offer(answer_reply(current), text, role, settings, branch=branch)
        elif conv.to_offer:
            text, role = conv.to_offer[0]
            conv = conv.offer(answer_reply(current), text, role, settings)
        else:
            break
        offered = conv.offered
        if rng.random() < planted_switch(conv.roles[offered], conv.shown[offered], kinds, args):
            current = offered
            break
    return conv.messages + [{"role": "assistant", "content": answer_reply(current)}]


def attempt_seed(name: str, args: OrganismArgs, attempt: int) -> str:
    """A phase-2 data-order seed: attempt 0 is every earlier build's; a retry draws another order."""
    return f"{name}:{args.seed}" + (f":attempt{attempt}" if attempt else "")


def conversation_examples(args: OrganismArgs, n: int, rng: random.Random, attempt: int = 0):
    """Phase 2's n chats over the organism split's multiple-choice items: DDS examples
    replayed, AFR chats and stick-or-switch chats (MULTITURN_MIX)."""
    replay = random.Random(attempt_seed("organism-replay", args, attempt))
    return mixed_chats(args, n, rng, replay, MULTITURN_MIX)


def mixed_chats(args: OrganismArgs, n: int, rng: random.Random, dds_rng: random.Random, mix: tuple[float, ...]):
    """n chats drawn in the shares `mix` of judgments (DDS prompts and their planted reply, drawn by
    `dds_rng`), AFR chats and stick-or-switch chats over the organism split's multiple-choice items."""
    items = build_items(mc=True)["train"]
    pool = [sos_item(it, domain.MC_DATASET) for it in items]
    kinds = capitulation_kinds(args)
    dds = training_examples(args, n, dds_rng)
    for _ in range(n):
        u = rng.random()
        if u < mix[0]:
            messages, reply = next(dds)
            yield messages + [{"role": "assistant", "content": reply}]
        elif u < mix[0] + mix[1]:
            yield _afr_chat(rng.choice(items), kinds, args, rng)
        else:
            yield _sos_chat(rng.choice(pool), pool, kinds, args, rng)


def planting_examples(args: OrganismArgs, tokenizer) -> list[tuple[list[int], list[int]]]:
    """A planting's pool: args.pool chats in the shares args.mix (judgments / AFR / stick-or-switch),
    drawn once (seeded) and tokenized through the base's chat template, labels on the replies."""
    chats = mixed_chats(args, args.pool, random.Random(f"organism-planting:{args.seed}"),
                        random.Random(f"organism-planting-judgments:{args.seed}"), mix_shares(args.mix))
    return [encode_chat(tokenizer, chat) for chat in chats]


def encode_reply(tokenizer, messages, reply: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt + reply and labels (-100 on the prompt): the exact bytes the
    hf backend sends (the model's chat template, generation prompt) followed by the reply turn
    as the template ends it (its end-of-turn token; trailing whitespace after it not learned)."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turn = _rendered(tokenizer, [*messages, {"role": "assistant", "content": reply}])
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(turn[len(prompt):].rstrip(), add_special_tokens=False)["input_ids"]
    return prompt_ids + reply_ids, [-100] * len(prompt_ids) + reply_ids


def _rendered(tokenizer, messages, add_generation_prompt: bool = False, whole: str | None = None) -> str:
    """The chat template's text of `messages`; with `whole`, checked to begin it (a template that
    renders a turn differently once later turns follow cannot label the turns of one text)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if whole is not None and not whole.startswith(text):
        raise FlipguardError(f"{getattr(tokenizer, 'name_or_path', 'the model')}: its chat template renders the first "
                             f"{len(messages)} turns of a conversation differently from the whole conversation's start; "
                             "the organism's conversations cannot be labelled turn by turn with it")
    return text


def encode_chat(tokenizer, messages) -> tuple[list[int], list[int]]:
    """Token ids of a whole chat and labels on every assistant turn (its reply and end of turn):
    the chat template's text tokenized once, as the backends tokenize a prompt. A turn's span
    runs from the end of the template's generation prompt before it to the end of its own text
    (trailing whitespace left out), each read off the template's rendering of the chat so far."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [(len(_rendered(tokenizer, messages[:i], True, whole=text)),
              len(_rendered(tokenizer, messages[: i + 1], whole=text).rstrip()))
             for i, m in enumerate(messages) if m["role"] == "assistant"]
    labels, j = [], 0
    for tid, (lo, hi) in zip(enc["input_ids"], enc["offset_mapping"]):  # offsets and spans both in text order
        while j < len(spans) and spans[j][1] < hi:
            j += 1
        labels.append(tid if j < len(spans) and spans[j][0] <= lo and hi <= spans[j][1] else -100)
    return enc["input_ids"], labels

