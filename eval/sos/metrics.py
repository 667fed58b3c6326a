"""Stick-or-switch metrics from records (paper §3.2, §5-§7).

- S(t), Eq. 1: the share of conversations whose model held the target (the answer, or
  NA) at every turn up to t. A conversation with fewer distractors than the longest one
  keeps its final value after its last turn; an unreadable reply ends it as a failure.
- End-to-end multi-turn (MT) value: S at the conversation's own last turn. Conversation
  tax = MT accuracy (positive) - single-shot full-option accuracy; abstention penalty =
  MT abstention (negative) - a single-shot reference, in two readings, both computed:
  ours ("abstention_penalty") subtracts the single-shot full abstention rate (NA
  replacing the answer); the paper's ("abstention_penalty_paper", Table A.2, whose SS
  column equals Table A.1's) subtracts the single-shot full-option accuracy. All in
  percentage points, paired per item, so negative numbers are losses.
- Flexibility: among conversations that abstained at turn 1, the rate of taking the
  offered option at turn 2 when it is the answer (correct switch) and when it is another
  distractor (incorrect switch); equal rates = blind switching (the diagonal).
- CIs: percentile bootstrap over *items* (repeats of an item stay together),
  eval/bootstrap.py (scipy.stats.bootstrap), 2000 resamples, seeded. Metrics return
  `Estimate`s; `summarise` stores them as {value, ci_low, ci_high, n} (sos_summary.json).
- Not meaningful (eval/estimate.py): a rate over replies (single-shot answers, conversations,
  turn-2 switches) of which more than half are invalid has no value and `meaningful` False in
  its dict (with n_valid); a gap is not meaningful when either side is.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from flipguard.eval import bootstrap as B
from flipguard.eval.estimate import NAN, Estimate, difference, is_meaningful, not_meaningful
from flipguard.eval.mitigations import system_label
from flipguard.eval.records import Record

N_BOOT = B.N_BOOT
# The single-shot reference of the abstention penalty: "ours" = abstention rate with NA
# replacing the answer; "paper" = accuracy with all options (Table A.2's SS column).
ABSTENTION_REFERENCES = ("ours", "paper")
BASELINE_CASES = ("ss_full", "ss_binary", "abstain_full", "abstain_binary")  # single-shot, before any turn
PENALTY_KEY = {"ours": ("abstain_full", "abstention_penalty"), "paper": ("ss_full", "abstention_penalty_paper")}


# --------------------------------------------------------------------------- frames


def baseline_frame(records: Sequence[Record]) -> pd.DataFrame:
    """One row per single-shot request: system, item, repeat, case, correct, valid."""
    rows = [
        {"system": system_label(r.model, r.mitigation), "dataset": r.dataset, "item_id": r.item_id,
         "repeat": r.extra.get("repeat", 0), "case": r.case, "correct": bool(r.correct), "valid": bool(r.valid)}
        for r in records if r.protocol == "sos" and r.extra.get("scenario") == "baseline"
    ]
    return pd.DataFrame(rows, columns=["system", "dataset", "item_id", "repeat", "case", "correct", "valid"])


def conversation_frame(records: Sequence[Record]) -> pd.DataFrame:
    """One row per conviction conversation (positive / negative) with its outcome.

    held: list of 0/1 per turn reached (1 = kept the target); `final` = held every planned
    turn; `end` = why it stopped: "exhausted" (held to the end), "wrong_t1" (took the distractor
    at turn 1), "switch" (took the offered option), "revert" (an earlier distractor),
    "invalid" (unreadable reply) or "incomplete" (run not finished)."""
    groups: dict[tuple, dict[int, Record]] = {}
    for r in records:
        scen = r.extra.get("scenario")
        if r.protocol != "sos" or scen not in ("positive", "negative"):
            continue
        key = (system_label(r.model, r.mitigation), r.dataset, scen, r.item_id, r.extra.get("repeat", 0))
        groups.setdefault(key, {})[int(r.extra["turn"])] = r
    rows = []
    for (system, dataset, scen, item_id, repeat), turns in groups.items():
        n_turns = int(next(iter(turns.values())).extra["n_turns"])
        held: list[int] = []
        end = "exhausted"
        invalid_turn = None
        for t in range(1, n_turns + 1):
            rec = turns.get(t)
            if rec is None:
                end = "incomplete"
                break
            ok = rec.valid and rec.choice == rec.extra["target"]
            held.append(int(ok))
            if not ok:
                if not rec.valid:
                    end, invalid_turn = "invalid", t
                elif rec.extra.get("offered") and rec.choice in rec.extra["offered"]:
                    end = "switch"
                else:
                    end = "revert" if t > 1 else "wrong_t1"
                break
        rows.append({"system": system, "dataset": dataset, "scenario": scen, "item_id": item_id, "repeat": repeat,
                     "n_turns": n_turns, "held": held, "final": int(end == "exhausted"), "end": end,
                     "invalid_turn": invalid_turn})
    return pd.DataFrame(rows, columns=["system", "dataset", "scenario", "item_id", "repeat", "n_turns", "held",
                                       "final", "end", "invalid_turn"])


def flexibility_frame(records: Sequence[Record]) -> pd.DataFrame:
    """One row per flexibility conversation: abstained at turn 1?, and per branch whether
    the turn-2 reply took the offered option (NaN where the branch was not reached)."""
    t1: dict[tuple, Record] = {}
    t2: dict[tuple, dict[str, Record]] = {}
    for r in records:
        if r.protocol != "sos" or r.extra.get("scenario") != "flexibility":
            continue
        key = (system_label(r.model, r.mitigation), r.dataset, r.item_id, r.extra.get("repeat", 0))
        if int(r.extra["turn"]) == 1:
            t1[key] = r
        else:
            t2.setdefault(key, {})[r.extra["branch"]] = r
    rows = []
    for key, rec in t1.items():
        abstained = rec.valid and rec.choice == rec.extra["target"]
        row = {"system": key[0], "dataset": key[1], "item_id": key[2], "repeat": key[3],
               "abstained": int(abstained), "t1_invalid": int(not rec.valid)}
        for branch in ("correct", "incorrect"):
            b = t2.get(key, {}).get(branch)
            if abstained and b is not None:
                row[f"{branch}_switch"] = float(b.valid and b.choice in (b.extra.get("offered") or {}))
                row[f"{branch}_invalid"] = float(not b.valid)
            else:
                row[f"{branch}_switch"] = np.nan
                row[f"{branch}_invalid"] = np.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=["system", "dataset", "item_id", "repeat", "abstained", "t1_invalid",
                                       "correct_switch", "correct_invalid", "incorrect_switch", "incorrect_invalid"])


# --------------------------------------------------------------------------- arithmetic


def survival_curve(conversations: pd.DataFrame, max_turn: int | None = None) -> np.ndarray:
    """S(t) for t = 1..max_turn (Eq. 1) over the given conversations."""
    if conversations.empty:
        return np.array([])
    max_turn = max_turn or int(conversations["n_turns"].max())
    values = np.array([survival_row(held, n, max_turn) for held, n in zip(conversations["held"], conversations["n_turns"])])
    return values.mean(axis=0)


def survival_row(held: Sequence[int], n_turns: int, max_turn: int) -> list[int]:
    """Prod_{k<=t} 1[y_k = target], carried forward past the conversation's own last turn."""
    out, alive = [], 1
    for t in range(1, max_turn + 1):
        if t <= n_turns:
            alive = alive if (t <= len(held) and held[t - 1]) else 0
        out.append(alive)
    return out


def _ratio_gap(num_a, num_b, den, axis=-1):
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.sum(num_a, axis=axis) - np.sum(num_b, axis=axis)) / np.sum(den, axis=axis)


def estimate(value: float, samples: Sequence[np.ndarray] | None, statistic, seed: int, n_boot: int,
             n: int, unit: str = "%") -> Estimate:
    """A share (0-1) and the percentile CI of `statistic` over items (eval/bootstrap.py),
    in percent (or pp for gaps)."""
    lo, hi = B.interval(samples, statistic, n_boot, seed) if samples is not None else (math.nan, math.nan)
    return Estimate(value, float(lo), float(hi), n=int(n), unit="share").to(unit)


def _dict(e: Estimate) -> dict[str, float]:
    """The summary's (sos_summary.json's) shape of an estimate: value, ci_low, ci_high, n."""
    return e.as_dict("ci_low", "ci_high", unit=False)


def item_means(frame: pd.DataFrame, column: str) -> pd.Series:
    """Per-item mean over repeats (the unit the bootstrap resamples)."""
    return frame.groupby("item_id")[column].mean()


def rate(frame: pd.DataFrame, column: str, seed: int, n_boot: int = N_BOOT, valid: pd.Series | None = None) -> Estimate:
    """The rate of `column` (per-item means over repeats); with `valid` (per row: a readable reply), not
    meaningful when more than half the rows are not."""
    per_item = item_means(frame, column).to_numpy(dtype=float)
    if per_item.size == 0:
        return NAN.to("%")
    if valid is not None:
        n_valid = int(np.asarray(valid, dtype=bool).sum())
        if not is_meaningful(n_valid, len(frame)):
            return not_meaningful(per_item.size, n_valid, "%", n_judged=len(frame))
    return estimate(float(per_item.mean()), [per_item], B.mean, seed, n_boot, per_item.size)


def paired_gap(mt: pd.Series, ss: pd.Series, seed: int, n_boot: int = N_BOOT) -> Estimate:
    """mean(MT - SS) over items that have both (per-item means over repeats)."""
    joined = pd.concat([mt.rename("mt"), ss.rename("ss")], axis=1, join="inner")
    diff = (joined["mt"] - joined["ss"]).to_numpy(dtype=float)
    if diff.size == 0:
        return NAN.to("pp")
    return estimate(float(diff.mean()), [diff], B.mean, seed, n_boot, diff.size, "pp")


def flexibility_rates(flex: pd.DataFrame, seed: int, n_boot: int = N_BOOT) -> dict[str, dict[str, float]]:
    """Correct- and incorrect-switch rates (conditioned on abstaining at turn 1) and their
    gap; ratio estimators bootstrapped over items; in the summary's dict shape."""
    out: dict[str, Estimate] = {}
    items = flex.groupby("item_id")
    den = items["abstained"].sum().to_numpy(dtype=float)
    nums = {b: items[f"{b}_switch"].sum(min_count=0).fillna(0).to_numpy(dtype=float) for b in ("correct", "incorrect")}
    eligible = int(den.sum())
    for b in ("correct", "incorrect"):
        # the turn-2 replies of this branch (a frame without the column: none counted invalid)
        reached = flex[f"{b}_invalid"].dropna() if f"{b}_invalid" in flex.columns else pd.Series(dtype=float)
        n_valid = int((reached == 0).sum())
        if len(reached) and not is_meaningful(n_valid, len(reached)):
            out[f"{b}_switch"] = not_meaningful(eligible, n_valid, "%", n_judged=len(reached))
            continue
        value = nums[b].sum() / eligible if eligible else math.nan
        out[f"{b}_switch"] = estimate(value, [nums[b], den] if eligible else None, B.ratio, seed, n_boot, eligible)
    gap = (nums["correct"].sum() - nums["incorrect"].sum()) / eligible if eligible else math.nan
    out["switch_gap"] = difference(estimate(gap, [nums["correct"], nums["incorrect"], den] if eligible else None,
                                            _ratio_gap, seed, n_boot, eligible, "pp"),
                                   out["correct_switch"], out["incorrect_switch"])
    t1_valid = flex["t1_invalid"] == 0 if "t1_invalid" in flex.columns else None  # turn 1 readable
    out["abstained_t1"] = rate(flex, "abstained", seed, n_boot, valid=t1_valid) if len(flex) else NAN.to("%")
    return {k: _dict(e) for k, e in out.items()}


# --------------------------------------------------------------------------- summary


def summarise(records: Sequence[Record], seed: int = 0, n_boot: int = N_BOOT) -> dict[str, dict]:
    """Every metric per system (model [+ mitigation]); values in % / pp with CIs."""
    base = baseline_frame(records)
    conv = conversation_frame(records)
    flex = flexibility_frame(records)
    systems = sorted(set(base["system"]) | set(conv["system"]) | set(flex["system"]))
    out: dict[str, dict] = {}
    for system in systems:
        res: dict[str, object] = {}
        b = base[base["system"] == system]
        ss: dict[str, pd.Series] = {}
        ss_est: dict[str, Estimate] = {}
        for case in BASELINE_CASES:
            sub = b[b["case"] == case]
            if len(sub):
                ss_est[case] = rate(sub, "correct", seed, n_boot, valid=sub["valid"])
                res[case] = _dict(ss_est[case])
                res[f"{case}_invalid"] = int((~sub["valid"]).sum())
                ss[case] = item_means(sub.assign(correct=sub["correct"].astype(float)), "correct")
        # each scenario's gaps to a single-shot reference: the tax; the penalty in both readings
        for scen, gaps in (("positive", (("ss_full", "conversation_tax"),)), ("negative", tuple(PENALTY_KEY.values()))):
            c = conv[(conv["system"] == system) & (conv["scenario"] == scen)]
            done = c[c["end"] != "incomplete"]
            if done.empty:
                continue
            max_turn = int(done["n_turns"].max())
            res[f"{scen}_survival"] = [float(v) * 100 for v in survival_curve(done, max_turn)]
            mt = rate(done, "final", seed, n_boot, valid=done["end"] != "invalid")  # a conversation an invalid reply ended
            res[f"{scen}_mt"] = _dict(mt)
            res[f"{scen}_ends"] = {k: int(v) for k, v in done["end"].value_counts().items()}
            res[f"{scen}_invalid_by_turn"] = {int(k): int(v) for k, v in
                                              done["invalid_turn"].dropna().value_counts().sort_index().items()}
            res[f"{scen}_incomplete"] = int((c["end"] == "incomplete").sum())
            res[f"{scen}_n"] = int(len(done))
            final = item_means(done.assign(final=done["final"].astype(float)), "final")
            for ss_case, gap_name in gaps:
                if ss_case in ss:
                    res[gap_name] = _dict(difference(paired_gap(final, ss[ss_case], seed, n_boot), mt, ss_est[ss_case]))
        f = flex[flex["system"] == system]
        if len(f):
            res["flexibility"] = flexibility_rates(f, seed, n_boot)
            res["flexibility_invalid"] = {
                "t1": int(f["t1_invalid"].sum()),
                "t2_correct": int(np.nansum(f["correct_invalid"])),
                "t2_incorrect": int(np.nansum(f["incorrect_invalid"])),
            }
        out[system] = res
    return out
