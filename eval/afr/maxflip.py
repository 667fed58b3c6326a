"""MaxFlip (Who Flips? §5.6, Table 7): per question, the cross-model-pool argument that
flips the most target models, ties broken by a seeded draw.

The pool is every argued cross_k argument (any source, any wrong option) that was shown
to at least one target under the blind clause: the source's own blind challenge counts
as well as cross challenges (the full CMFR matrix including its diagonal). A question
whose arguments no target was challenged with is left out (no evidence to select on).
Curated AFR for models of the pool is therefore in-sample, as in the paper; any other
model is evaluated on the exported set with `flipguard afr` (`maxflip_file`).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flipguard.data.mmlu import MCQItem
from flipguard.data.schema import DataError, read_jsonl
from flipguard.eval.afr import metrics as M
from flipguard.eval.estimate import difference
from flipguard.files import atomic_write_text

MAXFLIP_FILE = "maxflip.jsonl"
REQUIRED = ("item_id", "target_option", "argument", "producer", "k")


def flip_counts(frame: pd.DataFrame, k: int = 10) -> pd.DataFrame:
    """(item_id, target_option, source_model) -> number of targets flipped / challenged."""
    c = M.challenges(frame, k=k)
    c = c[c["condition"].isin(["blind", "cross"])]  # the pool matrix only: reruns select the same
    if c.empty:
        return pd.DataFrame(columns=["item_id", "target_option", "source_model", "n_flipped", "n_challenged"])
    c = c.drop_duplicates(["item_id", "target_option", "source_model", "model"])
    g = c.groupby(["item_id", "target_option", "source_model"])["flipped"]
    return pd.DataFrame({"n_flipped": g.sum().astype(int), "n_challenged": g.size()}).reset_index()


def select_maxflip(counts: pd.DataFrame, seed: int = 0) -> list[dict[str, Any]]:
    """One (target_option, source) per question: most flips, seeded draw among ties."""
    chosen = []
    for item_id, g in counts.groupby("item_id", sort=True):
        best = g[g["n_flipped"] == g["n_flipped"].max()].sort_values(["source_model", "target_option"])
        rng = random.Random(f"{seed}:{item_id}")
        row = best.iloc[rng.randrange(len(best))]
        chosen.append(
            {
                "item_id": item_id,
                "target_option": row["target_option"],
                "producer": row["source_model"],
                "n_flipped": int(row["n_flipped"]),
                "n_challenged": int(row["n_challenged"]),
                "n_tied": int(len(best)),
            }
        )
    return chosen


def build_maxflip(
    frame: pd.DataFrame, arguments: dict[tuple[str, str, str, int], str], items: dict[str, MCQItem], k: int = 10, seed: int = 0
) -> list[dict[str, Any]]:
    """MaxFlip entries with the question, options, answer, argument and producer model."""
    entries = []
    for sel in select_maxflip(flip_counts(frame, k), seed):
        item = items[sel["item_id"]]
        entries.append(
            {
                **sel,
                "k": k,
                "argument": arguments[(sel["producer"], item.id, sel["target_option"], k)],
                "dataset": item.dataset,
                "subject": item.subject,
                "category": item.category,
                "question": item.question,
                "options": item.options,
                "answer": item.answer,
            }
        )
    return entries


def export_maxflip(entries: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    atomic_write_text(path, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
    return path


def load_maxflip(path: str | Path, items: dict[str, MCQItem] | None = None) -> list[dict[str, Any]]:
    """Read a MaxFlip/argument file; with `items`, every question must be in the sample."""
    entries = []
    for lineno, row in read_jsonl(path):
        missing = [f for f in REQUIRED if f not in row]
        if missing:
            raise DataError(f"{path}:{lineno}: missing field(s) {missing}")
        if items is not None:
            item = items.get(row["item_id"])
            if item is None:
                raise DataError(f"{path}:{lineno}: item {row['item_id']!r} is not in this run's MMLU sample")
            if row["target_option"] not in item.wrong_letters:
                raise DataError(f"{path}:{lineno}: item {row['item_id']!r}: {row['target_option']!r} is not a wrong option")
        entries.append(row)
    return entries


def curated_outcomes(frame: pd.DataFrame, entries: list[dict[str, Any]], model: str) -> pd.DataFrame:
    """The model's challenge rows on the curated arguments (reusing blind/cross/maxflip rows)."""
    c = M.challenges(frame, model=model)
    c = c[c["condition"].isin(["blind", "cross", "maxflip"])]
    if c.empty or not entries:
        return c.iloc[0:0]
    sel = pd.DataFrame(
        [{"item_id": e["item_id"], "target_option": e["target_option"], "source_model": e["producer"], "k": int(e["k"])} for e in entries]
    )
    c = c.astype({"k": "int64"}).merge(sel, on=["item_id", "target_option", "source_model", "k"])
    return c.drop_duplicates(["item_id"])


def producer_shares(entries: list[dict[str, Any]]) -> dict[str, float]:
    counts = Counter(e["producer"] for e in entries)
    total = sum(counts.values())
    return {m: n / total for m, n in sorted(counts.items())} if total else {}


def maxflip_table(frame: pd.DataFrame, entries: list[dict[str, Any]], k: int = 10, n_boot: int = M.N_BOOT, seed: int = 0) -> pd.DataFrame:
    """Table 7: AFR blind(k) with own arguments vs curated AFR, gain, p, producer %."""
    shares = producer_shares(entries)
    rows = []
    for model in M.models_in(frame):
        std = M.challenges(frame, model, "blind", k)
        cur = curated_outcomes(frame, entries, model)
        e_std = M.rate_ci(std["flipped"].astype(float), std["item_id"], n_boot, seed, valid=std["valid"])
        e_cur = M.rate_ci(cur["flipped"].astype(float), cur["item_id"], n_boot, seed, valid=cur["valid"])
        d = difference(M.mean_of_rates_delta([(cur["flipped"].astype(float), cur["item_id"])],
                                             [(std["flipped"].astype(float), std["item_id"])], n_boot, seed), e_std, e_cur)
        rows.append(
            {
                "model": model,
                "afr_standard": e_std.value, "standard_lo": e_std.lo, "standard_hi": e_std.hi,
                "afr_curated": e_cur.value, "curated_lo": e_cur.lo, "curated_hi": e_cur.hi, "n_curated": e_cur.n,
                "delta": d.value, "delta_lo": d.lo, "delta_hi": d.hi, "p": d.p,
                "producer_share": shares.get(model, 0.0),
                "meaningful": e_std.meaningful and e_cur.meaningful,
            }
        )
    return pd.DataFrame(rows)


def maxflip_afr(frame: pd.DataFrame, entries: list[dict[str, Any]], model: str, n_boot: int = M.N_BOOT, seed: int = 0) -> M.Estimate:
    cur = curated_outcomes(frame, entries, model)
    return M.rate_ci(np.asarray(cur["flipped"], dtype=float), cur["item_id"], n_boot, seed, valid=cur["valid"])
