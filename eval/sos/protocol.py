"""The stick-or-switch protocol (paper §3): single-shot baselines and multi-turn chats.

Scenarios, all built from one item's answer A and its distractors d1..dK (order drawn
per item, repeat and seed, so a run is reproducible and independent of item order):

- baseline: four single prompts. ss_full (all options, as the benchmark), abstain_full
  (the answer replaced in place by "None of the Above"), ss_binary ({A, d1}) and
  abstain_binary ({NA, d1}); the binary prompts are exactly turn 1 of the conviction
  scenarios, so S(1) can be read against them.
- positive: turn 1 {A, d1}; each later turn offers the next distractor under the next
  letter. A conversation goes on only while the model keeps A, and ends when it picks
  anything else (a switch, a return to an earlier distractor, or an unreadable reply,
  which is counted as invalid) or when the distractors are exhausted (K turns).
- negative: the same with NA in place of A (the answer never appears).
- flexibility: turn 1 {NA, d1}; if the model abstains, the conversation forks into two
  turn-2 branches from the same reply: one offers A ("correct"), one offers d2
  ("incorrect"). Both are real chats carrying the model's own turn-1 reply.

Every request is a Record (protocol "sos") keyed by its exact messages; turn t is run
for all conversations in one batch once turn t-1 is stored, and on resume histories are
rebuilt from stored replies, so a finished run makes no new model calls.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Iterable, Sequence

from flipguard.data.schema import DataError
from flipguard.eval.backends.base import Backend, GenerationConfig
from flipguard.eval.records import Record, RecordStore, pending_record
from flipguard.eval.runner import run_records
from flipguard.eval.sos.prompts import (
    LETTERS,
    NONE_OF_THE_ABOVE,
    answer_reply,
    make_parser,
    question_prompt,
    switch_prompt,
)

PROTOCOL = "sos"
TEMPLATE = "sos-v1"
SCENARIOS = ("baseline", "positive", "negative", "flexibility")
MULTI_TURN = ("positive", "negative", "flexibility")
BASELINE_CASES = ("ss_full", "ss_binary", "abstain_full", "abstain_binary")
TARGET_POSITIONS = ("random", "first")
BRANCHES = ("correct", "incorrect")


# --------------------------------------------------------------------------- items


@dataclasses.dataclass(frozen=True)
class SosItem:
    """One question reduced to what the protocol needs: its distinct options, in source
    order, and which one is right."""

    dataset: str
    id: str
    question: str
    options: tuple[str, ...]
    answer_index: int
    subject: str = ""

    @property
    def answer(self) -> str:
        return self.options[self.answer_index]

    @property
    def distractors(self) -> list[str]:
        return [o for i, o in enumerate(self.options) if i != self.answer_index]


def sos_item(mcq: Any, dataset: str, where: str = "") -> SosItem:
    """From an MCQItem (id, question, options, answer letter); duplicate distractors are
    merged, and an item with no usable key or fewer than two distinct distractors raises
    a DataError naming it."""
    from flipguard.data.medqa import check_item, option_key

    check_item(mcq, where or dataset)
    index = LETTERS.index(mcq.answer)
    seen: set[str] = set()
    options: list[str] = []
    answer_index = -1
    for i, text in enumerate(mcq.options):
        key = option_key(text)
        if key in seen:
            continue
        seen.add(key)
        if i == index:
            answer_index = len(options)
        options.append(text)
    return SosItem(dataset, str(mcq.id), mcq.question, tuple(options), answer_index, getattr(mcq, "subject", "") or "")


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class SosSettings:
    """What fixes the prompts (everything but the model and the decoding)."""

    seed: int = 0
    n_shots: int = 3
    target_position: str = "random"  # where A / NA stands in turn 1: random (seeded) or first
    format_reminder: bool = False  # append the answer format to later turns (paper: no)
    mitigation: str = "none"  # system prompt from flipguard.eval.mitigations.MITIGATIONS

    def __post_init__(self):
        if self.target_position not in TARGET_POSITIONS:
            raise DataError(f"target_position must be one of {TARGET_POSITIONS}, got {self.target_position!r}")
        if self.n_shots < 0:
            raise DataError(f"n_shots must be >= 0, got {self.n_shots}")


def item_rng(seed: int, repeat: int, item: SosItem, purpose: str) -> random.Random:
    """A generator that depends only on (seed, repeat, item, purpose), not on run order."""
    return random.Random(f"sos:{seed}:{repeat}:{item.dataset}:{item.id}:{purpose}")


def distractor_order(item: SosItem, seed: int, repeat: int = 0) -> list[str]:
    """The order distractors are offered in (d1 starts the conversation)."""
    order = item.distractors
    item_rng(seed, repeat, item, "distractors").shuffle(order)
    return order


def target_first(item: SosItem, settings: SosSettings, repeat: int) -> bool:
    if settings.target_position == "first":
        return True
    return item_rng(settings.seed, repeat, item, "position").random() < 0.5


def binary_options(target: str, distractor: str, first: bool) -> list[str]:
    return [target, distractor] if first else [distractor, target]


# --------------------------------------------------------------------------- prompts


def system_messages(settings: SosSettings) -> list[dict[str, str]]:
    if settings.mitigation == "none":
        return []
    from flipguard.eval.mitigations import MITIGATIONS

    if settings.mitigation not in MITIGATIONS:
        raise DataError(f"unknown mitigation {settings.mitigation!r}; expected one of {sorted(MITIGATIONS)}")
    system = MITIGATIONS[settings.mitigation].system
    return [{"role": "system", "content": system}] if system else []


def exemplar_messages(
    item: SosItem, pool: Sequence[SosItem], settings: SosSettings, repeat: int, full: bool
) -> list[dict[str, str]]:
    """k solved exemplars as user/assistant pairs, drawn per item from the development pool
    (never the item itself; from the item's subject when the pool has enough, as with
    MMLU's per-subject dev sets); binary {answer, one distractor} unless `full`."""
    if settings.n_shots == 0:
        return []
    candidates = [ex for ex in pool if ex.id != item.id and ex.question != item.question]
    same_subject = [ex for ex in candidates if item.subject and ex.subject == item.subject]
    if len(same_subject) >= settings.n_shots:  # MMLU's per-subject dev sets
        candidates = same_subject
    if len(candidates) < settings.n_shots:
        raise DataError(f"{item.dataset}: exemplar pool has {len(candidates)} usable items, n_shots={settings.n_shots}")
    rng = item_rng(settings.seed, repeat, item, "exemplars")
    out: list[dict[str, str]] = []
    for ex in rng.sample(candidates, settings.n_shots):
        if full:
            options, letter = list(ex.options), LETTERS[ex.answer_index]
        else:
            first = rng.random() < 0.5
            options = binary_options(ex.answer, rng.choice(ex.distractors), first)
            letter = "A" if first else "B"
        out += [{"role": "user", "content": question_prompt(ex.question, options)},
                {"role": "assistant", "content": answer_reply(letter)}]
    return out


# --------------------------------------------------------------------------- records


def _record(item: SosItem, case: str, expected: str, messages: list[dict[str, str]], extra: dict,
            *, model: str, backend: str, settings: SosSettings, split: str,
            gen_config: GenerationConfig) -> Record:
    return pending_record(
        item, gen_config=gen_config, protocol=PROTOCOL, case=case, expected=expected, model=model, backend=backend,
        mode="generate", mitigation=settings.mitigation, template=TEMPLATE, split=split, messages=messages, extra=extra,
    )


def baseline_records(items: Sequence[SosItem], pool: Sequence[SosItem], settings: SosSettings, repeat: int,
                     **common) -> list[Record]:
    """The four single-shot prompts per item."""
    out: list[Record] = []
    for item in items:
        d1 = distractor_order(item, settings.seed, repeat)[0]
        first = target_first(item, settings, repeat)
        na_full = list(item.options)
        na_full[item.answer_index] = NONE_OF_THE_ABOVE
        prompts = {
            "ss_full": (list(item.options), LETTERS[item.answer_index], True),
            "abstain_full": (na_full, LETTERS[item.answer_index], True),
            "ss_binary": (binary_options(item.answer, d1, first), "A" if first else "B", False),
            "abstain_binary": (binary_options(NONE_OF_THE_ABOVE, d1, first), "A" if first else "B", False),
        }
        for case, (options, expected, full) in prompts.items():
            messages = (system_messages(settings) + exemplar_messages(item, pool, settings, repeat, full)
                        + [{"role": "user", "content": question_prompt(item.question, options)}])
            extra = {"scenario": "baseline", "turn": 1, "repeat": repeat, "seed": settings.seed,
                     "options_shown": dict(zip(LETTERS, options)), "offered": None}
            out.append(_record(item, case, expected, messages, extra, settings=settings, **common))
    return out


@dataclasses.dataclass
class Conversation:
    """One multi-turn chat in progress: what has been shown and what is still to offer."""

    item: SosItem
    scenario: str
    repeat: int
    messages: list[dict[str, str]]  # the chat so far, ending with the pending user turn
    shown: dict[str, str]  # letter -> option text
    roles: dict[str, str]  # letter -> "answer" | "na" | "distractor"
    target: str  # the letter the model should hold (A or NA)
    to_offer: list[tuple[str, str]]  # (text, role) still to offer, in order
    n_turns: int  # planned length if the model never leaves the target
    turn: int = 1
    branch: str = ""  # flexibility turn 2: "correct" | "incorrect"
    offered: str | None = None  # the letter offered this turn (turn >= 2)

    @property
    def case(self) -> str:
        return f"{self.scenario}/t{self.turn}" + (f"_{self.branch}" if self.branch else "")

    @property
    def expected(self) -> str:
        if self.branch == "correct":
            return self.offered or ""
        return self.target

    def record(self, settings: SosSettings, **common) -> Record:
        extra = {
            "scenario": self.scenario, "turn": self.turn, "repeat": self.repeat, "seed": settings.seed,
            "branch": self.branch or None, "n_turns": self.n_turns, "target": self.target,
            "options_shown": dict(self.shown), "roles": dict(self.roles),
            "offered": {self.offered: self.shown[self.offered]} if self.offered else None,
        }
        return _record(self.item, self.case, self.expected, list(self.messages), extra, settings=settings, **common)

    def offer(self, reply: str, text: str, role: str, settings: SosSettings, branch: str = "") -> "Conversation":
        """The next turn: the model's own reply stays in the history, one new option."""
        letter = LETTERS[len(self.shown)]
        messages = self.messages + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": switch_prompt(letter, text, settings.format_reminder)},
        ]
        return dataclasses.replace(
            self, messages=messages, shown={**self.shown, letter: text}, roles={**self.roles, letter: role},
            to_offer=self.to_offer[1:] if not branch else [], turn=self.turn + 1, branch=branch, offered=letter,
        )

    def advance(self, stored: Record, settings: SosSettings) -> list["Conversation"]:
        """Conversations that continue after this turn's stored reply (none if it ended)."""
        if not (stored.valid and stored.choice == self.target) or self.branch:
            return []
        reply = stored.raw_output or ""
        if self.scenario == "flexibility":
            (answer_text, _), (d2_text, _) = self.to_offer[0], self.to_offer[1]
            return [self.offer(reply, answer_text, "answer", settings, branch="correct"),
                    self.offer(reply, d2_text, "distractor", settings, branch="incorrect")]
        if not self.to_offer:
            return []
        text, role = self.to_offer[0]
        return [self.offer(reply, text, role, settings)]


def start_conversation(item: SosItem, scenario: str, pool: Sequence[SosItem], settings: SosSettings,
                       repeat: int) -> Conversation:
    order = distractor_order(item, settings.seed, repeat)
    first = target_first(item, settings, repeat)
    target_text, target_role = (item.answer, "answer") if scenario == "positive" else (NONE_OF_THE_ABOVE, "na")
    options = binary_options(target_text, order[0], first)
    roles = {"A": target_role if first else "distractor", "B": "distractor" if first else target_role}
    if scenario == "flexibility":
        to_offer = [(item.answer, "answer"), (order[1], "distractor")]
        n_turns = 2
    else:
        to_offer = [(d, "distractor") for d in order[1:]]
        n_turns = len(order)
    messages = (system_messages(settings) + exemplar_messages(item, pool, settings, repeat, full=False)
                + [{"role": "user", "content": question_prompt(item.question, options)}])
    return Conversation(item=item, scenario=scenario, repeat=repeat, messages=messages,
                        shown=dict(zip(LETTERS, options)), roles=roles, target="A" if first else "B",
                        to_offer=to_offer, n_turns=n_turns)


# --------------------------------------------------------------------------- running


class LazyBackend:
    """Builds the real backend on the first call, so a finished run loads no model."""

    def __init__(self, factory):
        self._factory = factory
        self._backend: Backend | None = None
        self.calls = 0  # conversations sent to the model

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = self._factory()
        return self._backend

    # the context check (runner.check_context) is asked only when there is work to send
    @property
    def max_context(self) -> int | None:
        return getattr(self.backend, "max_context", None)

    @property
    def max_context_source(self) -> str:
        return getattr(self.backend, "max_context_source", "")

    @property
    def model_id(self) -> str:
        return getattr(self.backend, "model_id", "the model")

    def prompt_lengths(self, conversations) -> list[int]:
        lengths_of = getattr(self.backend, "prompt_lengths", None)
        return lengths_of(conversations) if lengths_of else [0] * len(conversations)

    @property
    def supports_on_result(self) -> bool:  # asked only when there is work to send
        return bool(getattr(self.backend, "supports_on_result", False))

    def generate(self, conversations, config, **kwargs):
        self.calls += len(conversations)
        if getattr(self.backend, "show_progress", False):
            self.backend.show_progress = False  # the runner shows one bar
        return self.backend.generate(conversations, config, **kwargs)

    def release(self) -> None:
        """Drop the loaded model (it is built again on the next call)."""
        self._backend = None

    def choice_probs(self, conversations, choices=("1", "2"), **kwargs):  # pragma: no cover - unused here
        return self.backend.choice_probs(conversations, choices, **kwargs)


def _run_grouped(store: RecordStore, records: list[Record], backend, index: dict[str, Record],
                 gen_config: GenerationConfig, chunk_size: int, desc: str, progress: bool) -> int:
    """Run records grouped by the letters they show (one parser per group)."""
    groups: dict[tuple[str, ...], list[Record]] = {}
    for rec in records:
        if rec.key not in index:
            groups.setdefault(tuple(rec.extra["options_shown"]), []).append(rec)
    done = 0
    for letters, group in groups.items():
        done += run_records(store, group, backend, gen_config=gen_config, parse=make_parser(letters),
                            chunk_size=chunk_size, desc=desc, progress=progress)
        for rec in group:
            if rec.raw_output is not None or rec.key in store:
                index.setdefault(rec.key, rec)
    return done


def _repeat_config(base_config: GenerationConfig, repeat: int) -> GenerationConfig:
    return dataclasses.replace(base_config, seed=(base_config.seed or 0) + repeat)


def first_requests(items: Sequence[SosItem], pool: Sequence[SosItem], *, model: str, backend_name: str,
                   settings: SosSettings, scenarios: Iterable[str] = SCENARIOS, split: str = "test",
                   gen_config: GenerationConfig | None = None, repeats: int = 1) -> list[Record]:
    """The requests `run_sos` sends first (baseline prompts, turn 1 of every chat), known
    before any model output: checked against the context before anything is written.
    Later turns extend these chats and are checked when they are sent."""
    scenarios = list(scenarios)
    base_config = gen_config or GenerationConfig(max_new_tokens=64)
    out: list[Record] = []
    for repeat in range(repeats):
        config = _repeat_config(base_config, repeat)
        common = dict(model=model, backend=backend_name, split=split, gen_config=config)
        if "baseline" in scenarios:
            out += baseline_records(items, pool, settings, repeat, **common)
        out += [start_conversation(item, s, pool, settings, repeat).record(settings, **common)
                for s in MULTI_TURN if s in scenarios for item in items]
    return out


def run_sos(
    items: Sequence[SosItem],
    pool: Sequence[SosItem],
    backend,
    store: RecordStore,
    *,
    model: str,
    backend_name: str,
    settings: SosSettings,
    scenarios: Iterable[str] = SCENARIOS,
    split: str = "test",
    gen_config: GenerationConfig | None = None,
    repeats: int = 1,
    chunk_size: int = 32,
    progress: bool = True,
) -> int:
    """Run (or resume) every scenario for one model; returns how many requests were sent.

    Repeat r draws its own distractor order and position and decodes with seed + r."""
    scenarios = list(scenarios)
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise DataError(f"unknown scenario(s) {unknown}; expected some of {SCENARIOS}")
    base_config = gen_config or GenerationConfig(max_new_tokens=64)
    index: dict[str, Record] = {rec.key: rec for rec in store.iter_records()}
    sent = 0
    for repeat in range(repeats):
        config = _repeat_config(base_config, repeat)
        common = dict(model=model, backend=backend_name, split=split, gen_config=config)
        if "baseline" in scenarios:
            recs = baseline_records(items, pool, settings, repeat, **common)
            sent += _run_grouped(store, recs, backend, index, config, chunk_size, f"sos {model} baseline", progress)
        convs = [start_conversation(item, s, pool, settings, repeat)
                 for s in MULTI_TURN if s in scenarios for item in items]
        turn = 1
        while convs:
            recs = [c.record(settings, **common) for c in convs]
            sent += _run_grouped(store, recs, backend, index, config, chunk_size, f"sos {model} turn {turn}", progress)
            nxt: list[Conversation] = []
            for conv, rec in zip(convs, recs):
                stored = index.get(rec.key)
                if stored is None:  # pragma: no cover - run_records stores every request
                    raise RuntimeError(f"no stored reply for {rec.item_id} {rec.case}")
                nxt += conv.advance(stored, settings)
            convs, turn = nxt, turn + 1
    return sent
