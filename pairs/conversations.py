"""Multi-turn training pairs from AFR and stick-or-switch conversations (`pairs.conversations`).

The single-turn `afr` strategy turns a challenge into a DDS-style judgment ("Is Speaker 2
correct?"); nothing in it is the conversation a model capitulates in. These pairs are:
the prompt is the chat exactly as the evaluation sent it (record.messages: the model's own
stored turn-1 reply, then the push-back), and the completion is the reply the evaluation
reads (the letter in logprob mode, "Answer: X" in generate mode):

- hold   (an AFR challenge; a stick-or-switch turn offering a distractor, also the
          flexibility scenario's incorrect branch): chosen = keep the answer the record
          expects, rejected = the option argued for or offered (the capitulation);
- accept (stick-or-switch flexibility, correct branch: the model abstained on turn 1 and
          the right option is offered): chosen = switch to it, rejected = stay. These keep
          a mitigation from learning "never change your mind", which the report's
          correct-switch column (§) would show as damage;
- keep   (`pairs.keep_first_answers`; AFR's baseline turn, stick-or-switch's single-shot
          prompts): the turn-1 answers the model got right, replayed: chosen = its answer,
          rejected = a wrong option (AFR: the one its challenges argued for; stick-or-switch: a
          seeded other shown letter). Without them the pairs teach a letter prior: stick-or-switch
          letters options in the order shown, so every hold replies A or B and every accept C,
          and on the organism SFT took single-shot accuracy from 87 to 43 (its wrong answers A
          and B) while the right letters are spread over A-D (bench/archive/organism_multiturn_nokeep.md).

Every conversation of the run's train-split records counts, whether or not the model
capitulated in it (held conversations are the majority of the target behaviour), so the
pairs are the same for any model that gave the same turn-1 replies. A hold row from a
conversation where the base model did capitulate has flip "capitulation": the few rows that
correct something (on the organism, 67 of the demo's 3,803 rows corrected stick-or-switch's
switch after abstaining: bench/mitigation_coverage.md); `pairs.capitulation_weight` repeats them. A run of the test
split is refused: training on the conversations the after-measurement replays would
measure memory, not mitigation.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from flipguard.data.organism_datasets import option_kind
from flipguard.errors import FlipguardError, UserError
from flipguard.eval.afr.protocol import load_sample
from flipguard.eval.records import load_records, read_run_log

KINDS = ("hold", "accept", "keep")
# a hold row's flip: the base model gave up the answer in this very conversation (took the option argued
# for or offered, or another): the rows that carry the correction (pairs.capitulation_weight)
CAPITULATION = "capitulation"
RUN_FILE = "run.json"


def _reply(record, letter: str) -> str:
    """A reply in the form the evaluation reads for this record."""
    return letter if record.mode == "logprob" else f"Answer: {letter}"


def _run_meta(run_dir: Path) -> dict[str, Any]:
    """run.json, read through the run log (eval/records.RunLog); a missing one is refused."""
    log = read_run_log(run_dir)
    if log is None:
        raise UserError(f"{run_dir}: no {RUN_FILE}; pairs.conversations takes AFR or stick-or-switch run directories "
                        "(flipguard afr / flipguard sos --split train)")
    return log.to_dict()


def _afr_pair(record) -> tuple[str, str, str] | None:
    if record.case != "challenge":
        return None
    x = (record.extra or {}).get("target_option")
    if not x or x == record.expected:
        return None
    return "hold", record.expected, x


def _sos_pair(record) -> tuple[str, str, str] | None:
    extra = record.extra or {}
    if extra.get("scenario") in (None, "baseline") or int(extra.get("turn") or 1) < 2 or not extra.get("offered"):
        return None
    offered = next(iter(extra["offered"]))
    stay = extra.get("target")
    if offered == record.expected:  # the right option offered after an abstention: switch
        return "accept", offered, stay
    return "hold", record.expected, offered


PAIR_OF = {"afr": _afr_pair, "sos": _sos_pair}


def _kept_first_answer(record, argued: dict[tuple, str]) -> tuple[str, str, str] | None:
    """A turn-1 answer the model got right, as a keep pair (None for any other record)."""
    extra = record.extra or {}
    first = record.case == "baseline" if record.protocol == "afr" else extra.get("scenario") == "baseline"
    if not first or not record.valid or record.choice != record.expected:
        return None
    if record.protocol == "afr":
        rejected = argued.get((record.model, record.item_id, record.mitigation))
    else:
        others = sorted(set(extra.get("options_shown") or ()) - {record.expected})
        rejected = random.Random(record.key).choice(others) if others else None
    return ("keep", record.expected, rejected) if rejected else None


def _option_text(record, letter: str | None, items: dict) -> str | None:
    """An option's text: stick-or-switch records carry the options shown, AFR runs their sample file."""
    if letter is None:
        return None
    shown = (record.extra or {}).get("options_shown")
    if shown:
        return shown.get(letter)
    item = items.get(record.item_id)
    try:
        return item.option_text(letter) if item is not None else None
    except (IndexError, ValueError, KeyError):
        return None


def _situation(record) -> dict[str, Any]:
    """Where in the conversation the row's prompt ends: the scenario (stick-or-switch's, or AFR's case), the
    turn, and what the model's last answer was (an answer, or an abstention: "None of the Above")."""
    extra = record.extra or {}
    if record.protocol == "afr":
        return {"scenario": record.case, "turn": 2 if record.case == "challenge" else 1, "after": "answer"}
    turn = int(extra.get("turn") or 1)
    roles = extra.get("roles") or {}
    held = roles.get(extra.get("target") or "")
    return {"scenario": extra.get("scenario") or record.case, "turn": turn,
            "after": "-" if turn == 1 else ("abstention" if held == "na" else "answer")}


def _row_meta(record, chosen: str, rejected: str, items: dict) -> dict[str, Any]:
    """The row's kinds (pairs.include/exclude/held_out `kinds`): the answer's (category) and the
    rejected option's, the one argued for or offered (incorrect_category), known on the organism's
    multiple-choice form (flipguard.data.organism_datasets.option_kind), absent elsewhere; and where the
    prompt ends (_situation: scenario, turn, after), which counts.json counts and the rules' `meta` reads."""
    meta: dict[str, Any] = _situation(record)
    for key, letter in (("category", record.expected), ("incorrect_category", rejected)):
        kind = option_kind(record.dataset, _option_text(record, letter, items) or "")
        if kind:
            meta[key] = kind
    return meta


def conversation_rows(run_dir: str | Path, model: str | None = None, keep_first_answers: bool = False) -> list[dict[str, Any]]:
    """Rows {prompt, chosen, rejected, kind, item_id, dataset, protocol, case, mitigation}
    from one AFR or stick-or-switch run directory (its train-split records of one model);
    with keep_first_answers, also its right turn-1 answers as keep rows."""
    run_dir = Path(run_dir)
    meta = _run_meta(run_dir)
    protocol = meta.get("protocol") or meta.get("task")
    if protocol not in PAIR_OF:
        raise UserError(f"{run_dir / RUN_FILE}: protocol {protocol!r}; pairs.conversations takes "
                        f"{' or '.join(sorted(PAIR_OF))} runs")
    records = [r for r in load_records(run_dir) if r.protocol == protocol]
    tested = [r for r in records if r.split == "test"]
    if tested:
        raise UserError(f"{run_dir}: {len(tested)} record(s) of the test split (e.g. {tested[0].dataset}:{tested[0].item_id}); "
                        "multi-turn pairs come from a --split train run, so the after-measurement replays no training conversation")
    models = sorted({r.model for r in records})
    if model is None:
        if len(models) > 1:
            raise UserError(f"{run_dir}: records of {len(models)} models ({', '.join(models)}); "
                            "name one with pairs.conversation_model")
    elif model not in models:
        raise UserError(f"{run_dir}: no records of model {model!r} (it holds {', '.join(models) or 'none'})")
    try:  # AFR: the options' texts, for the rows' kinds
        items = load_sample(run_dir) if protocol == "afr" else {}
    except FlipguardError:
        items = {}
    argued: dict[tuple, str] = {}  # (model, item, mitigation) -> the option its first challenge argued for
    for r in records if keep_first_answers else ():
        if r.case == "challenge" and (r.extra or {}).get("target_option"):
            argued.setdefault((r.model, r.item_id, r.mitigation), r.extra["target_option"])
    rows = []
    for r in records:
        if model is not None and r.model != model:
            continue
        pair = PAIR_OF[protocol](r) or (_kept_first_answer(r, argued) if keep_first_answers else None)
        if pair is None:
            continue
        kind, chosen, rejected = pair
        if not chosen or not rejected or chosen == rejected:
            raise UserError(f"{run_dir}: record {r.key} ({r.item_id}, {r.case}) gives no pair "
                            f"(chosen {chosen!r}, rejected {rejected!r})")
        rows.append({"prompt": r.messages, "chosen": _reply(r, chosen), "rejected": _reply(r, rejected), "kind": kind,
                     "item_id": r.item_id, "dataset": r.dataset, "protocol": protocol, "case": r.case,
                     "mitigation": r.mitigation or "none", "meta": _row_meta(r, chosen, rejected, items),
                     "flip": CAPITULATION if kind == "hold" and r.valid and r.choice != chosen else None})
    if not rows:
        raise UserError(f"{run_dir}: no multi-turn conversation to learn from (no AFR challenge or stick-or-switch "
                        "turn >= 2 among its records)")
    return rows
