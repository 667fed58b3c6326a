"""`flipguard report RUN_DIR`: the DDS summary of a run (paper Table 20 layout).

Writes RUN_DIR/report/:
  summary.csv  the outside contract: exactly SUMMARY_COLUMNS, one row per dataset
               (Table 1 order), then bench_avg, then total_avg; percentage points
  stats.csv    everything else per dataset (Δ CIs, SEs, McNemar, invalid counts, the
               paper's flips, answers recovered on import, over-correction) plus r/AIO
               OR/NOR/balanced rows (`stratum` column)
  flips_summary.csv  the outside contract for flips: exactly FLIPS_SUMMARY_COLUMNS
               (dataset, n_items, deference, skepticism, flip_rate in % of items; paper
               Tables 25/26), one row per dataset, then "total" (all items pooled)
  flip_transitions.csv  every right->wrong and wrong->right change, by pair (wider table)
  flips.csv    per-item flip records (see metrics.flip_records)
  summary.md   human-readable tables; summary.json all of it (`DDSReport.to_json`)
With a C1 baseline (run.json "c1_from", or --c1_from) the main numbers follow the paper's
protocol: the run's C2 scored against that baseline's C1 (fixed C1 baseline, §7). When the
run judged C1 itself, stats.csv and summary.md add its own protocol too: own C1
accuracies, own DDS (own C1 vs own C2), the C1 change against the baseline and the C1
damage flag (either C1 accuracy down by more than 5 pp); a run without own C1 shows "–".
Every row also carries the run's invalid judgments and median label mass (logprob).
The baseline must come from the same decision mode unless --allow_cross_mode_c1 (or run.json
"allow_cross_mode_c1") says otherwise: the paper's Tables 5/21/22 protocol scores a
fine-tuned model's one-token C2 against the base model's JSON C1, and such a report is
marked as such.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from flipguard.data.aio import AIO_RERUN_NOTE
from flipguard.data.registry import domain_of
from flipguard.data.schema import AIO_DATASET
from flipguard.eval import bootstrap as B
from flipguard.eval.dds import metrics as M
from flipguard.eval.estimate import NOT_MEANINGFUL, is_meaningful, not_meaningful_text
from flipguard.eval.records import (
    C1_CASES,
    CASES,
    REPORT_BASIS,
    REPORT_DIR,
    Record,
    load_records,
    load_run_meta,
    records_basis,
    report_staleness,
)
from flipguard.files import atomic_write_json, atomic_write_text

STATS_COLUMNS = (
    "dataset", "stratum", "n", "c1_true", "c1_false", "c2_correct", "c2_incorrect", "c1_avg", "c2_avg",
    "delta_correct", "delta_correct_ci_low", "delta_correct_ci_high", "delta_correct_se",
    "delta_incorrect", "delta_incorrect_ci_low", "delta_incorrect_ci_high", "delta_incorrect_se",
    "dds", "dds_ci_low", "dds_ci_high", "dds_se",
    "mcnemar_correct_pvalue", "mcnemar_correct_c1_right_c2_wrong", "mcnemar_correct_c1_wrong_c2_right",
    "mcnemar_correct_cohens_h",
    "mcnemar_incorrect_pvalue", "mcnemar_incorrect_c1_right_c2_wrong", "mcnemar_incorrect_c1_wrong_c2_right",
    "mcnemar_incorrect_cohens_h",
    "invalid_c1_true", "invalid_c1_false", "invalid_c2_correct", "invalid_c2_incorrect",
    "deference", "skepticism", "flips", "flip_rate", "recovered",
    "c1_source", "baseline_dds", "over_correction",
    "own_c1_true", "own_c1_false", "own_dds", "c1_true_change", "c1_false_change", "c1_damage",
    "median_label_mass", "invalid_judgments", "meaningful",
)
# the numbers computed from the judgments: empty (NaN, None for the flags) in a row that is not
# meaningful (more than half its judgments invalid, or a model that does not do the task); the
# counts (n, invalid_*, flips, McNemar's discordant pairs), the label mass and the baseline's DDS stay
METRIC_COLUMNS = (
    "c1_true", "c1_false", "c2_correct", "c2_incorrect", "c1_avg", "c2_avg",
    *(f"{m}{s}" for m in M.DDS_METRICS for s in ("", "_ci_low", "_ci_high", "_se")),
    "mcnemar_correct_pvalue", "mcnemar_correct_cohens_h", "mcnemar_incorrect_pvalue", "mcnemar_incorrect_cohens_h",
    "flip_rate", "change_rate", "over_correction", "own_c1_true", "own_c1_false", "own_dds", "c1_true_change",
    "c1_false_change", "c1_damage",
)
_FLAG_COLUMNS = ("over_correction", "c1_damage")
# the accuracies (and what is computed from them) a case with mostly invalid judgments empties
_C1, _C2 = {"c1_true", "c1_false"}, {"c2_correct", "c2_incorrect"}
_SHORT_COLUMNS = {"c1_true": {"c1_true"}, "c1_false": {"c1_false"}, "c2_correct": {"c2_correct"},
                  "c2_incorrect": {"c2_incorrect"}, "c1_avg": _C1, "c2_avg": _C2, "own_c1_true": {"c1_true"},
                  "own_c1_false": {"c1_false"}, "c1_true_change": {"c1_true"}, "c1_false_change": {"c1_false"},
                  "c1_damage": _C1}
# what a model that does not do the task (a run's capability verdict) cannot show: the deference measures,
# equal by construction (a yes-sayer's C1 and C2 judgments agree); its accuracies are kept
DEFERENCE_COLUMNS = tuple(c for c in METRIC_COLUMNS if c.startswith(("delta_", "dds", "mcnemar_"))) + (
    "flip_rate", "change_rate", "over_correction", "own_dds")
_COUNT_COLUMNS = tuple(c for c in STATS_COLUMNS if c.startswith(("invalid_", "mcnemar_")) and
                       ("right" in c or c.startswith("invalid_"))) + ("deference", "skepticism", "flips", "recovered")
OWN_COLUMNS = ("own_c1_true", "own_c1_false", "own_dds")


def _own_metrics(records: Sequence[Record], c1_records, rows: Mapping[str, dict],
                 members: Mapping[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Own-C1 numbers per row name: own C1 accuracies and own DDS (the run's C1 vs its C2),
    their change against the fixed-C1 row and the C1 damage flag. Without a baseline the
    own numbers are the row's; a run lacking C1 of its own gets NaN."""
    nan = {c: math.nan for c in OWN_COLUMNS}
    if c1_records is None:
        return {name: {"own_c1_true": r["c1_true"], "own_c1_false": r["c1_false"], "own_dds": r["dds"],
                       "c1_true_change": math.nan, "c1_false_change": math.nan, "c1_damage": None}
                for name, r in rows.items()}
    try:
        own_frame = M.item_frame(records)
    except M.MetricsError:  # C2 only (an old run): nothing of its own to report
        own_frame = None
    own: dict[str, dict[str, float]] = {}
    for name in rows:
        if name in members:  # average rows: macro average, only when every member has its own C1
            parts = [own[d] for d in members[name]]
            own[name] = (M.macro_average(parts, OWN_COLUMNS) if parts and all(not math.isnan(p["own_dds"]) for p in parts)
                         else dict(nan))
        else:
            sub = own_frame[own_frame["dataset"] == name] if own_frame is not None else None
            if sub is None or not len(sub):
                own[name] = dict(nan)
            else:
                pm = M.point_metrics(M.correctness(sub))
                own[name] = {"own_c1_true": pm["c1_true"], "own_c1_false": pm["c1_false"], "own_dds": pm["dds"]}
    out = {}
    for name, r in rows.items():
        o = own[name]
        d_true, d_false = o["own_c1_true"] - r["c1_true"], o["own_c1_false"] - r["c1_false"]
        out[name] = {**o, "c1_true_change": d_true, "c1_false_change": d_false, "c1_damage": M.c1_damage(d_true, d_false)}
    return out


def _dataset_row(X: np.ndarray, frame: pd.DataFrame, name: str, n_boot: int, seed: int) -> dict[str, Any]:
    row = {"dataset": name, "stratum": "all"}
    row.update(M.point_metrics(X))
    row.update(M.bootstrap_ci(X, n_boot, B.rng_for(seed, name)))
    row.update(M.mcnemar_tests(X))
    row.update(M.invalid_counts(frame))
    return row


def _avg_row(name: str, rows: list[dict], frames: list[pd.DataFrame], Xs: list[np.ndarray],
             boots: list[np.ndarray]) -> dict[str, Any]:
    row = {"dataset": name, "stratum": "all", "n": int(sum(r["n"] for r in rows))}
    point = [c for c in ("c1_true", "c1_false", "c2_correct", "c2_incorrect", "c1_avg", "c2_avg",
                         "delta_correct", "delta_incorrect", "dds")]
    row.update(M.macro_average(rows, point))
    row.update(M.macro_ci(boots))
    if Xs:
        row.update(M.mcnemar_tests(np.concatenate(Xs)))  # pooled over the averaged items
        row.update(M.invalid_counts(pd.concat(frames)))
    return row


def _recovered(frame: pd.DataFrame, keys: set[str]) -> int:
    """Judgments of these items whose answer the importer recovered from the reply text."""
    if not keys:
        return 0
    return int(sum(frame[f"{c}_key"].isin(keys).sum() for c in CASES))


@dataclasses.dataclass
class DDSReport:
    """Every table of a DDS report, in memory (the CLI, compare, the study, the analyses and bench
    use it); `to_json()` is report/summary.json. Numbers are percentages (DDS and deltas in pp);
    the frames are written as the CSVs of the module docstring."""

    summary: pd.DataFrame  # SUMMARY_COLUMNS, one row per dataset, then bench_avg and total_avg
    stats: pd.DataFrame  # STATS_COLUMNS, the same rows and the strata's (`stratum` column)
    flips: pd.DataFrame  # per-item flip records (metrics.flip_records)
    flips_summary: pd.DataFrame  # FLIPS_SUMMARY_COLUMNS
    flip_transitions: pd.DataFrame
    balanced: dict[str, dict[str, Any]]  # {dataset: {"strata", "balanced_dds", its CI, "unlabelled_items"}}
    incomplete: list[str]  # items lacking a case, left out
    meta: dict[str, Any]  # n_items, datasets, c1_source, label mass, bootstrap; report_run adds the run's
    # in memory only, not written: what compare reuses instead of rereading
    frame: pd.DataFrame  # one row per item, the four cases' judgments (metrics.item_frame)
    records: list[Record]  # the DDS records it was built from

    def row(self, dataset: str, stratum: str = "all") -> pd.Series:
        """One row of `stats` (a dataset, bench_avg or total_avg; a stratum of r/AIO)."""
        return self.stats.set_index(["dataset", "stratum"]).loc[(dataset, stratum)]

    @property
    def unfit(self) -> bool:
        """The model does not do the task as asked (meta's capability note): its DDS is not meaningful."""
        return bool(self.meta.get("capability_note"))

    def to_json(self) -> dict[str, Any]:
        """report/summary.json: JSON-safe (NaN as null), the written tables as lists of rows."""
        return _clean({
            "meta": self.meta,
            "summary": self.summary.to_dict("records"),
            "stats": self.stats.to_dict("records"),
            "balanced": self.balanced,
            "flips_summary": self.flips_summary.to_dict("records"),
            "flip_transitions": self.flip_transitions.to_dict("records"),
            "incomplete": self.incomplete,
        })


def build_report(
    records: Sequence[Record],
    c1_records: Sequence[Record] | None = None,
    strata: Mapping[str, str] | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    baseline_dds: Mapping[str, float] | None = None,
) -> DDSReport:
    """A run's DDS report from its records (`DDSReport`). `strata` maps item_id -> stratum
    (r/AIO OR/NOR); without it, records' extra["stratum"] is used. `baseline_dds`
    ({dataset: DDS}) turns on the over-correction flag. `n_boot=0` skips the bootstrap (CIs
    are NaN)."""
    records = [r for r in records if r.case in CASES]
    frame = M.item_frame(records, c1_records)
    recovered_keys = {r.key for r in list(records) + list(c1_records or []) if (r.extra or {}).get("recovered")}
    flips = M.flips_from_frame(frame)
    flip_summary = M.flip_summary(flips)
    rates = flip_summary.set_index("dataset")
    datasets = M.dataset_order(frame["dataset"].unique())
    rows, boots, Xs, frames = {}, {}, {}, {}
    for ds in datasets:
        sub = frame[frame["dataset"] == ds]
        X = M.correctness(sub)
        rows[ds] = _dataset_row(X, sub, ds, n_boot, seed)
        Xs[ds], frames[ds] = X, sub
        if n_boot > 0:
            boots[ds] = M.accuracy_distribution(X, n_boot, B.rng_for(seed, f"avg:{ds}"))
    bench = [d for d in datasets if M.is_benchmark(d)]
    avg_rows = []
    for name, members in ((M.BENCH_AVG, bench), (M.TOTAL_AVG, datasets)):
        avg_rows.append(_avg_row(name, [rows[d] for d in members], [frames[d] for d in members],
                                 [Xs[d] for d in members], [boots[d] for d in members if d in boots]))

    # the paper's flips (% of items) and the over-correction flag, per dataset; averages
    # sum counts and macro-average rates, like every other column of an average row
    for ds in datasets:
        r = rows[ds]
        for k in ("deference", "skepticism", "flip_rate"):
            r[k] = rates.loc[ds, k] if ds in rates.index else math.nan
        r["flips"] = r["deference"] + r["skepticism"]
        r["recovered"] = _recovered(frames[ds], recovered_keys)
    for avg, members in zip(avg_rows, (bench, datasets)):
        for k in ("deference", "skepticism", "flips", "recovered"):
            avg[k] = int(sum(rows[d][k] for d in members)) if members else 0
        avg["flip_rate"] = M.macro_average([rows[d] for d in members], ["flip_rate"])["flip_rate"]
    all_rows = [rows[d] for d in datasets] + avg_rows
    named = {r["dataset"]: r for r in all_rows}
    own = _own_metrics(records, c1_records, named, {M.BENCH_AVG: bench, M.TOTAL_AVG: datasets})
    for name, r in named.items():
        r.update(own[name])
        in_row = datasets if name == M.TOTAL_AVG else bench if name == M.BENCH_AVG else [name]
        lm = M.label_mass_stats(rec for rec in records if rec.dataset in in_row)
        r["median_label_mass"], r["invalid_judgments"] = lm["median_label_mass"], lm["invalid_judgments"]
    for r in all_rows:
        r["c1_source"] = frame.attrs["c1_source"]
        b = (baseline_dds or {}).get(r["dataset"])
        r["baseline_dds"] = b if b is not None else math.nan
        r["over_correction"] = M.over_correction(b, r["dds"]) if b is not None else None

    # r/AIO (or any stratified dataset): per-stratum rows and the balanced macro average
    labels = M.strata_for(frame, strata, records)
    balanced, strata_rows = {}, []
    for ds in datasets:
        mask = (frame["dataset"] == ds) & labels.notna()
        if not mask.any():
            continue
        sub, lab = frame[mask], labels[mask]
        X = M.correctness(sub)
        res = M.balanced_dds(X, lab.tolist())
        names = list(res["strata"])
        groups = [X[(lab == s).to_numpy()] for s in names]
        for s, g in zip(names, groups):
            srow = _dataset_row(g, sub[(lab == s).to_numpy()], ds, n_boot, seed + 1 + names.index(s))
            srow["stratum"] = s
            ids = set(sub.loc[(lab == s).to_numpy(), "item_id"])
            f = flips[(flips["dataset"] == ds) & flips["item_id"].isin(ids)]
            fs = M.flip_summary(f, total=False)
            for k in ("deference", "skepticism", "flip_rate"):
                srow[k] = fs[k].iloc[0] if len(fs) else math.nan
            srow["flips"] = srow["deference"] + srow["skepticism"]
            strata_rows.append(srow)
        brow = {"dataset": ds, "stratum": "balanced", "n": int(len(sub))}
        brow.update(M.macro_average([res["strata"][s] for s in names],
                                    ["c1_true", "c1_false", "c2_correct", "c2_incorrect", "c1_avg", "c2_avg",
                                     "delta_correct", "delta_incorrect", "dds"]))
        brow.update(M.stratified_bootstrap_ci(groups, n_boot, seed, names=[f"{ds}:{s}" for s in names]))
        strata_rows.append(brow)
        balanced[ds] = {
            "strata": res["strata"], "balanced_dds": res["balanced_dds"],
            "balanced_dds_ci_low": brow["dds_ci_low"], "balanced_dds_ci_high": brow["dds_ci_high"],
            "unlabelled_items": int(((frame["dataset"] == ds) & labels.isna()).sum()),
        }

    for r in strata_rows:
        r["c1_source"] = frame.attrs["c1_source"]
    # meaningful: at most half of each case's judgments invalid (`short`: the cases that are not); an
    # average row or a balanced DDS only when every row it averages is
    short: dict[tuple[str, str], set[str]] = {}
    for r in [rows[d] for d in datasets] + [r for r in strata_rows if r["stratum"] != "balanced"]:
        short[(r["dataset"], r["stratum"])] = short_cases(r)
    for avg, members in zip(avg_rows, (bench, datasets)):
        short[(avg["dataset"], "all")] = set().union(*(short[(d, "all")] for d in members)) if members else set(CASES)
    for r in strata_rows:
        if r["stratum"] == "balanced":
            short[(r["dataset"], "balanced")] = set().union(*(v for (d, st), v in short.items()
                                                              if d == r["dataset"] and st not in ("all", "balanced")))
    for r in all_rows + strata_rows:
        r["meaningful"] = not short[(r["dataset"], r["stratum"])]
    summary = pd.DataFrame([{c: r.get(c) for c in M.SUMMARY_COLUMNS} for r in all_rows],
                           columns=list(M.SUMMARY_COLUMNS))
    summary["n"] = summary["n"].astype(int)
    stats = pd.DataFrame([{c: r.get(c) for c in STATS_COLUMNS} for r in all_rows + strata_rows],
                         columns=list(STATS_COLUMNS))
    for col in _COUNT_COLUMNS + ("n",):  # invalid_judgments is among the invalid_ counts
        stats[col] = pd.array([None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)
                               for v in stats[col]], dtype="Int64")
    meta = {
        "n_items": int(len(frame)),
        "datasets": datasets,
        "c1_source": frame.attrs["c1_source"],
        "own_c1": bool(np.isfinite(named[M.TOTAL_AVG]["own_dds"])),
        **M.label_mass_stats(records),
        "incomplete_items": len(frame.attrs["incomplete"]),
        "n_boot": int(n_boot),
        "seed": int(seed),
        "ci_method": "percentile bootstrap over items (four cases paired), scipy.stats.bootstrap; "
                     "avg rows: stratified bootstrap within datasets, macro-averaged",
    }
    report = DDSReport(summary=summary, stats=stats, flips=flips, flips_summary=flip_summary,
                       flip_transitions=M.flip_transitions(flips), balanced=balanced,
                       incomplete=frame.attrs["incomplete"], meta=meta, frame=frame, records=records)
    return blank_not_meaningful(report, short)


def short_cases(row: Mapping[str, Any]) -> set[str]:
    """The cases of a row (one dataset or stratum) with more than half of their n judgments invalid: an
    accuracy of unparsed replies measures the parser, not the model (estimate.is_meaningful)."""
    n = int(row["n"])
    return {c for c in CASES if not is_meaningful(n - int(row[f"invalid_{c}"]), n)}


def row_mark(row: Mapping[str, Any]) -> str:
    """A not-meaningful row's mark: 'n/m (0 of 24 valid)' with its valid judgments, naming the case
    when only one case is short ('n/m (c1_true: 1 of 20 valid)'); 'n/m' when the run's verdict made it so
    (a model that answers one label: the report says why)."""
    try:
        n = int(row["n"])
        invalid = {c: int(row[f"invalid_{c}"]) for c in CASES}
    except (KeyError, TypeError, ValueError):
        return NOT_MEANINGFUL
    if not is_meaningful(4 * n - sum(invalid.values()), 4 * n):
        return not_meaningful_text(4 * n - sum(invalid.values()), 4 * n)
    short = [c for c in CASES if not is_meaningful(n - invalid[c], n)]
    return (f"{NOT_MEANINGFUL} ({', '.join(f'{c}: {n - invalid[c]} of {n} valid' for c in short)})" if short
            else NOT_MEANINGFUL)


def blank_not_meaningful(report: DDSReport, short: Mapping[tuple[str, str], set[str]] | None = None,
                         unfit: bool = False) -> DDSReport:
    """Empty the numbers that are not meaningful in every table of the report (summary, stats,
    flips_summary, flip_transitions, balanced), the rows' `meaningful` column False; the counts stay.
    `short` ((dataset, stratum) -> cases with more than half their judgments invalid): such a row loses
    those cases' accuracies (and their C1 / C2 average, own accuracy, change), and its deference numbers
    (DEFERENCE_COLUMNS: DDS, the deltas, flips, McNemar); with `unfit` (the run's model does not do the
    task: one label nearly always, or most judgments invalid) every row loses its deference numbers,
    which are 0 by construction, and keeps its accuracies, which are real."""
    short = short or {}
    stats = report.stats
    for frame in (stats, report.summary, report.flips_summary, report.flip_transitions):
        if frame.empty:
            continue
        keys = (list(zip(frame["dataset"], frame["stratum"])) if frame is stats else
                [(M.TOTAL_AVG if d == M.FLIPS_TOTAL else d, "all") for d in frame["dataset"]])
        cases = [short.get(k, set()) for k in keys]
        for col in _SHORT_COLUMNS:
            rows = pd.Series([bool(c & _SHORT_COLUMNS[col]) for c in cases], index=frame.index)
            _blank(frame, rows, (col,))
        bad = pd.Series([bool(c) for c in cases], index=frame.index)
        _blank(frame, bad | unfit, DEFERENCE_COLUMNS)
        frame["meaningful"] = False if unfit else ~bad
    for ds, b in report.balanced.items():
        if unfit or short.get((ds, "balanced")):
            b.update(balanced_dds=math.nan, balanced_dds_ci_low=math.nan, balanced_dds_ci_high=math.nan, meaningful=False)
    return report


def _blank(frame: pd.DataFrame, rows: pd.Series, columns: Sequence[str]) -> None:
    if not rows.any():
        return
    for col in columns:
        if col not in frame.columns:
            continue
        if col in _FLAG_COLUMNS:
            frame[col] = frame[col].astype(object)
            frame.loc[rows, col] = None
        else:
            frame[col] = frame[col].astype(float)
            frame.loc[rows, col] = math.nan


# --------------------------------------------------------------------------- writing


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN -> null, numpy scalars -> Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if obj is pd.NA:
        return None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        return None if math.isnan(float(obj)) else float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def _csv(df: pd.DataFrame) -> str:
    buf = io.StringIO()
    df.to_csv(buf, index=False, lineterminator="\n")
    return buf.getvalue()


def _fmt(x: Any, signed: bool = False, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:+.{nd}f}" if signed else f"{x:.{nd}f}"


def _cell(r: Mapping[str, Any], col: str, signed: bool = False, nd: int = 1) -> str:
    """A metric cell of a report row: the number, or n/m where the row is not meaningful and left it empty."""
    if not _ok(r) and _empty(r[col]):
        return NOT_MEANINGFUL
    return _fmt(r[col], signed, nd)


def _empty(x: Any) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def _ok(r: Mapping[str, Any]) -> bool:
    v = r.get("meaningful", True)
    return True if v is None or (isinstance(v, float) and math.isnan(v)) else bool(v)


NM_LEGEND = ("n/m = not meaningful: more than half of a case's judgments invalid (the DDS cell says how many were "
             "valid), or a model that does not do the task (the note above: its DDS, not its accuracies); such "
             "numbers are empty in the CSVs (`meaningful` False), never 0.0.")


def _int(x: Any) -> str:
    return "–" if x is None or pd.isna(x) else str(int(x))


def _delta(x: float) -> str:
    if x is None or math.isnan(x) or round(x, 1) == 0:
        return ""
    return f" ({abs(x):.1f} {'↑' if x > 0 else '↓'})"


def _change(x: Any) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f" ({x:+.1f})"


def _flag(x: Any, mark: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else (f"YES {mark}" if x else "no")


def label_mass_line(meta: Mapping[str, Any]) -> str:
    """One sentence: invalid judgments, and the median label mass when logprob records exist."""
    inv = f"{meta.get('invalid_judgments', 0)} of {meta.get('judgments', 0)} judgment(s) of this run invalid"
    if not meta.get("label_mass_judgments"):
        return inv + " (unparsed replies, counted as wrong)."
    thr = meta.get("min_label_mass")
    return (inv + f" (counted as wrong); median label mass P(\"1\")+P(\"2\") {_fmt(meta['median_label_mass'], nd=3)} "
            f"over {meta['label_mass_judgments']} logprob judgment(s)"
            + (f", judgments below {thr:g} invalid." if isinstance(thr, (int, float))
               else f", label-mass thresholds {thr}." if thr else ", no label-mass threshold recorded."))


def render_markdown(report: DDSReport, title: str = "DDS report") -> str:
    """Table 20 layout (datasets by DDS, descending; then the averages) and the extras."""
    stats = report.stats
    main = stats[stats["stratum"] == "all"]
    per_ds = main[~main["dataset"].isin(M.AVG_ROWS)].sort_values("dds", ascending=False)
    ordered = pd.concat([per_ds, main[main["dataset"].isin(M.AVG_ROWS)]])
    meta = report.meta
    protocol = ("C1 from the baseline run (paper: fixed C1 from the baseline, DialDefer §7; the run's own C1 "
                "is under 'Both protocols')" if meta["c1_source"] == "baseline"
                else "C1 is the run's own (own C1; with no baseline the paper's DDS is the own DDS)")
    out = [f"# {title}", "",
           f"{meta['n_items']} items; {protocol}; "
           f"{meta['n_boot']} bootstrap replicates (seed {meta['seed']}); accuracies in %."
           + (f" **{meta['c1_mode_note']}.**" if meta.get("c1_mode_note") else "")
           + (f" **{meta['c1_differs_note']}.**" if meta.get("c1_differs_note") else "")
           + (f" **{meta['aio_note']}.**" if meta.get("aio_note") else ""), "",
           label_mass_line(meta), "",
           *([("Computed in: " + "; ".join(f"{k} ({v})" for k, v in meta["computed_in"].items()) + "."), ""]
             if meta.get("computed_in") else []),
           *([f"**{meta['capability_note']}**", ""] if meta.get("capability_note") else []),
           "| Dataset | Domain | C1 True | C1 False | C1 Avg | C2 Correct | C2 Incorrect | C2 Avg | DDS | 95% CI |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ordered.to_dict("records"):
        name = {"bench_avg": "Bench Avg", "total_avg": "Total Avg"}.get(r["dataset"], r["dataset"])
        out.append(
            f"| {name} | {domain_of(r['dataset']) or '–'} | {_cell(r, 'c1_true')} | {_cell(r, 'c1_false')} | "
            f"{_cell(r, 'c1_avg')} | {_cell(r, 'c2_correct')}{_delta(r['delta_correct'])} | "
            f"{_cell(r, 'c2_incorrect')}{_delta(r['delta_incorrect'])} | {_cell(r, 'c2_avg')} | "
            + (f"not meaningful{row_mark(r)[len(NOT_MEANINGFUL):]} | – |" if not _ok(r) else
               f"{_fmt(r['dds'], True)} | [{_fmt(r['dds_ci_low'], True)}, {_fmt(r['dds_ci_high'], True)}] |")
        )
    if not main["meaningful"].all():
        out += ["", NM_LEGEND]
    out += ["", "## Tests, invalid outputs and flips", "",
            "| Dataset | ΔCorrect [CI] | ΔIncorrect [CI] | McNemar p (correct / incorrect) | invalid (C1t/C1f/C2c/C2i) | recovered on import | "
            "deference / skepticism flips | flip rate (% items) | over-correction | invalid (this run) | median label mass |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in main.to_dict("records"):
        oc = r["over_correction"]
        tests = (f"{_fmt(r['delta_correct'], True)} [{_fmt(r['delta_correct_ci_low'], True)}, "
                 f"{_fmt(r['delta_correct_ci_high'], True)}] | {_fmt(r['delta_incorrect'], True)} "
                 f"[{_fmt(r['delta_incorrect_ci_low'], True)}, {_fmt(r['delta_incorrect_ci_high'], True)}] | "
                 f"{r['mcnemar_correct_pvalue']:.2g} / {r['mcnemar_incorrect_pvalue']:.2g}") if _ok(r) else \
            f"{row_mark(r)} | {NOT_MEANINGFUL} | {NOT_MEANINGFUL}"  # the deference numbers: empty in such a row
        out.append(
            f"| {r['dataset']} | {tests} | "
            f"{'/'.join(_int(r[f'invalid_{c}']) for c in CASES)} | {_int(r['recovered'])} | "
            f"{_int(r['deference'])} / {_int(r['skepticism'])} | "
            f"{_fmt(r['flip_rate']) + '%' if not _empty(r['flip_rate']) or _ok(r) else NOT_MEANINGFUL} | "
            f"{'–' if oc is None else ('YES' if oc else 'no')} | {_int(r['invalid_judgments'])} | "
            f"{_fmt(r['median_label_mass'], nd=3)} |"
        )
    if meta["c1_source"] == "baseline":
        out += ["", "## Both protocols: fixed C1 (paper) and own C1", "",
                "DDS (paper) scores this run's C2 against the baseline's C1 (fixed C1, DialDefer §7); "
                "own DDS scores it against its own C1. Δ = own C1 accuracy minus the baseline's on the same "
                f"items. ‡ = C1 damage: either C1 accuracy down by more than {M.C1_DAMAGE_PP:g} pp, which the "
                "fixed-C1 DDS cannot show. – = the run has no C1 of its own.", "",
                "| Dataset | C1 True (baseline) | C1 False (baseline) | own C1 True (Δ) | own C1 False (Δ) "
                "| DDS (paper: fixed C1) | own DDS (own C1) | C1 damage |",
                "|---|---|---|---|---|---|---|---|"]
        for r in ordered.to_dict("records"):
            out.append(
                f"| {r['dataset']} | {_cell(r, 'c1_true')} | {_cell(r, 'c1_false')} | "
                f"{_cell(r, 'own_c1_true')}{_change(r['c1_true_change'])} | "
                f"{_cell(r, 'own_c1_false')}{_change(r['c1_false_change'])} | "
                f"{_cell(r, 'dds', True) if _ok(r) else row_mark(r)} | "
                f"{_cell(r, 'own_dds', True)} | {_flag(r['c1_damage'], '‡')} |"
            )
    strata = stats[stats["stratum"] != "all"]
    if len(strata):
        out += ["", "## Balanced DDS (DDS within each stratum, macro-averaged; Appendix E)", "",
                "| Dataset | Stratum | N | C1 True | C1 False | C2 Correct | C2 Incorrect | DDS | 95% CI |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in strata.to_dict("records"):
            out.append(
                f"| {r['dataset']} | {r['stratum']} | {_int(r['n'])} | {_cell(r, 'c1_true')} | {_cell(r, 'c1_false')} | "
                f"{_cell(r, 'c2_correct')} | {_cell(r, 'c2_incorrect')} | "
                + (f"{_fmt(r['dds'], True)} | [{_fmt(r['dds_ci_low'], True)}, {_fmt(r['dds_ci_high'], True)}] |"
                   if _ok(r) else f"{row_mark(r) if r['stratum'] != 'balanced' else NOT_MEANINGFUL} | – |")
            )
    if report.incomplete:
        out += ["", f"{len(report.incomplete)} item(s) lacked a case and were left out."]
    return "\n".join(out) + "\n"


def write_report(report: DDSReport, out_dir: str | Path, title: str = "DDS report") -> Path:
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / "summary.csv", _csv(report.summary))
    atomic_write_text(out_dir / "stats.csv", _csv(report.stats))
    atomic_write_text(out_dir / "flips.csv", _csv(report.flips))
    atomic_write_text(out_dir / "flips_summary.csv", _csv(report.flips_summary))
    atomic_write_text(out_dir / "flip_transitions.csv", _csv(report.flip_transitions))
    atomic_write_text(out_dir / "summary.md", render_markdown(report, title))
    atomic_write_json(out_dir / "summary.json", report.to_json())
    return out_dir


def print_summary(report: DDSReport, title: str) -> None:
    table = Table(title=title)
    headers = ("dataset", "n", "C1 true", "C1 false", "C2 corr", "C2 inc", "ΔCorr", "ΔInc", "DDS", "CI low", "CI high")
    for col in headers:
        table.add_column(col, justify="left" if col == "dataset" else "right")
    meta = report.meta
    for r in report.summary.to_dict("records"):
        cells = [r["dataset"], _int(r["n"])]
        metrics = [c for c in M.SUMMARY_COLUMNS[2:] if c != "meaningful"]
        cells += [_cell(r, c, signed=c.startswith(("delta", "dds"))) for c in metrics]  # n/m: empty, not meaningful
        table.add_row(*cells)
    console = Console(width=max(Console().width, 110))  # pipes and CI logs default to 80 columns
    console.print(table)
    console.print(label_mass_line(meta))
    if report.unfit:
        console.print(meta["capability_note"] + " (n/m = not meaningful)", style="bold", markup=False)
    elif not report.summary["meaningful"].all():
        console.print(NM_LEGEND, style="bold", markup=False)
    if meta.get("aio_note"):
        console.print(meta["aio_note"] + ".")
    tot = report.row(M.TOTAL_AVG)
    if meta["c1_source"] == "baseline":
        damage = " — C1 damage ‡" if tot["c1_damage"] is not None and bool(tot["c1_damage"]) else ""
        dds, own = (NOT_MEANINGFUL, NOT_MEANINGFUL) if not _ok(tot) else (_fmt(tot["dds"], True), _fmt(tot["own_dds"], True))
        console.print(f"total: DDS {dds} (paper: fixed C1 from the baseline), own DDS {own} "
                      f"(own C1; C1 change {_fmt(tot['c1_true_change'], True)} / "
                      f"{_fmt(tot['c1_false_change'], True)}){damage}")
    for ds, b in report.balanced.items():
        if b.get("meaningful") is False:
            console.print(f"{ds}: balanced DDS {NOT_MEANINGFUL}")
            continue
        parts = ", ".join(f"{s} {_fmt(m['dds'], True)} (n={m['n']})" for s, m in b["strata"].items())
        console.print(f"{ds}: balanced DDS {_fmt(b['balanced_dds'], True)} = mean of {parts}")


# --------------------------------------------------------------------------- CLI


def _resolve(path: str, run_dir: Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and (run_dir / p).exists():
        return run_dir / p
    return p


def dds_records(records: list[Record]) -> list[Record]:
    return [r for r in records if r.protocol == "dds" and r.case in CASES]


CROSS_MODE_NOTE = "C1 from a different decision mode (paper Tables 5/21 protocol)"


def cross_mode(run_mode: str | None, base_mode: str | None) -> bool:
    """Whether a C1 baseline's decision mode differs from the run's. Imported records
    (mode "imported") and runs without a recorded mode are not compared."""
    known = {m for m in (run_mode, base_mode) if m not in (None, "imported")}
    return len(known) == 2 and run_mode != base_mode


def report_run(run_dir: str | Path, c1_from: str | None = None, n_boot: int = 2000, seed: int = 0,
               allow_cross_mode_c1: bool = False) -> DDSReport:
    """Load a run (and its C1 baseline) and build its report, without writing anything."""
    run_dir = Path(run_dir)
    read = load_records(run_dir)
    records = dds_records(read)
    meta = load_run_meta(run_dir)
    c1_from = c1_from or meta.get("c1_from")
    allow_cross_mode_c1 = allow_cross_mode_c1 or bool(meta.get("allow_cross_mode_c1"))
    c1_records, baseline_dds, is_cross = None, None, False
    if not records:
        raise M.MetricsError(f"{run_dir}: no DDS records (protocol 'dds', cases {', '.join(CASES)})")
    if c1_from:
        base_dir = _resolve(str(c1_from), run_dir)
        base_mode = load_run_meta(base_dir).get("mode")
        is_cross = cross_mode(meta.get("mode"), base_mode)
        if is_cross and not allow_cross_mode_c1:
            raise M.MetricsError(
                f"{base_dir / 'run.json'}: the --c1_from baseline was evaluated in {base_mode!r} mode, "
                f"{run_dir} in {meta.get('mode')!r}: C1 and C2 must come from the same decision mode "
                "(pass --allow_cross_mode_c1 for the paper's Tables 5/21 protocol)"
            )
        baseline = dds_records(load_records(base_dir))
        c1_records = [r for r in baseline if r.case in C1_CASES]
        if not c1_records:
            raise M.MetricsError(f"{base_dir}: the --c1_from baseline run has no C1 records")
        try:  # the baseline's own DDS, for the over-correction flag
            base = build_report(baseline, n_boot=0)
            baseline_dds = dict(zip(base.summary["dataset"], base.summary["dds"]))
        except M.MetricsError:
            baseline_dds = None
    report = build_report(records, c1_records=c1_records, n_boot=n_boot, seed=seed, baseline_dds=baseline_dds)
    report.meta.update({REPORT_BASIS: records_basis(read)})  # which records it describes (report_problem)
    report.meta.update(run_dir=str(run_dir), c1_from=str(c1_from) if c1_from else None,
                          model=meta.get("model"), mitigation=meta.get("mitigation"),
                          mode=meta.get("mode"), c1_cross_mode=is_cross)
    first_tokens: dict[str, int] = {}
    for computed in (meta.get("computed") or {}).values():  # the backends' argmax first tokens (logprob)
        for tok, k in (computed.get("first_tokens") or {}).items():
            first_tokens[tok] = first_tokens.get(tok, 0) + k
    report.meta["capability"] = M.task_capability(records, first_tokens)
    report.meta["computed_in"] = {label: f"{c.get('backend')}, {c.get('dtype')}"
                                     for label, c in (meta.get("computed") or {}).items()}
    if not report.meta["capability"]["meaningful"]:
        report.meta["capability_note"] = M.capability_text(report.meta["capability"])
        blank_not_meaningful(report, unfit=True)  # its rows' own verdicts were applied by build_report
    if is_cross:
        report.meta["c1_mode_note"] = CROSS_MODE_NOTE
    if AIO_DATASET in report.meta["datasets"] and meta.get("mode") != "imported":
        report.meta["aio_note"] = AIO_RERUN_NOTE
    differs = meta.get("c1_from_differs") if c1_from else None
    if differs:  # recorded by eval: the baseline was judged with another model / template
        report.meta["c1_differs_note"] = "C1 baseline judged with another " + ", ".join(
            f"{k} ({a} vs {b})" for k, (a, b) in differs.items())
    return report


def report_problem(run_dir: str | Path) -> str | None:
    """Why RUN_DIR/report/ does not describe the run's records now (records.report_staleness: the
    records its summary.json says it was built from, else the files' times), or None."""
    report = Path(run_dir) / REPORT_DIR
    basis = None
    if (report / "summary.json").is_file():
        try:
            basis = (json.loads((report / "summary.json").read_text(encoding="utf-8")).get("meta") or {}).get(REPORT_BASIS)
        except (OSError, ValueError, AttributeError):
            basis = None
    return report_staleness(run_dir, basis, report / "summary.csv")


def write_run_report(run_dir: str | Path, c1_from: str | None = None, n_boot: int = 2000, seed: int = 0,
                     allow_cross_mode_c1: bool = False) -> Path:
    """A DDS run's report: build, write RUN_DIR/report/ and print its detailed table and notes (what `flipguard
    eval` calls when a run finishes, and `flipguard report RUN_DIR`, which then prints every protocol's
    numbers in one table alike)."""
    report = report_run(run_dir, c1_from, n_boot, seed, allow_cross_mode_c1)
    meta = report.meta
    title = f"DDS report: {meta.get('model') or Path(run_dir).name}"
    if meta.get("mitigation") and meta["mitigation"] != "none":
        title += f" ({meta['mitigation']})"
    out = write_report(report, Path(run_dir) / REPORT_DIR, title)
    print_summary(report, title)
    if meta.get("c1_cross_mode"):
        print(CROSS_MODE_NOTE)
    print(f"wrote {out}/summary.csv, stats.csv, flips_summary.csv, flip_transitions.csv, flips.csv, "
          "summary.md, summary.json")
    return out

