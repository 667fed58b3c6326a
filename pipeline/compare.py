"""Before/after comparison: baseline, prompting mitigations and fine-tuned models,
measured by the same eval module, laid out like the paper's Tables 5 and 21.

Every condition is a DDS run directory. Two protocols side by side: the paper's DDS
(its C2 scored against the baseline's C1, fixed C1 baseline, §7; columns c1_true,
c1_false, dds) and the condition's own (own_c1_true, own_c1_false, own_dds: its own C1
against its own C2; NaN for a run without C1 of its own), with ‡ where its own C1
accuracy fell more than 5 pp below the baseline's (C1 damage). The report adds what a
mitigation study needs beyond one run's summary: deltas against the baseline, McNemar
tests of each condition's C2 judgments against the baseline's on the same items, † where
DDS turned from deference into skepticism (over-correction), invalid judgments and the
median label mass per run, a per-domain DDS heatmap (Figure 4) and before/after bars with
95% CIs; plus a section per other protocol whose runs are given (`--protocols`, or `--<task>`
for any registered task: the task's `comparison_rows`, `comparison_title`/`_note` and
`guarded_metrics` make its rows in comparison_protocols.csv and its section; compare names
no protocol, and `--include my_tasks.py` adds a user's tasks).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from flipguard.config import parse_dataclasses, with_optional_fields
from flipguard.data.pair_sets import read_counts
from flipguard.data.registry import domain_of
from flipguard.errors import UserError
from flipguard.eval import bootstrap as B
from flipguard.eval import paired as P
from flipguard.eval.comparison_rows import PROTOCOL_COLUMNS, comparison_long_rows, named_runs, split_system
from flipguard.eval.dds import metrics as M
from flipguard.eval.dds.report import CROSS_MODE_NOTE, report_run, row_mark
from flipguard.eval.estimate import NOT_MEANINGFUL, Estimate
from flipguard.eval.plots import (
    MAX_WIDTH_IN,
    MIN_FONT,
    TITLE_FONT,
    cell_text,
    draw_estimate_bars,
    finish_heatmap,
    mark_not_meaningful,
    pyplot,
    save_figure,
)
from flipguard.eval.records import C2_CASES, load_run_meta, refuse_busy, refuse_other_kind, require_whole
from flipguard.eval.task_includes import take_includes
from flipguard.eval.task_registry import get_task, task_names
from flipguard.files import atomic_write_json, atomic_write_text, check_outputs
from flipguard.organism.ground_truth import GROUND_TRUTH_JSON, ground_truth
from flipguard.organism.ground_truth import render_markdown as render_ground_truth
from flipguard.pipeline.transfer import build_transfer, condition_units, paired_tests_markdown, write_transfer
from flipguard.pipeline.view import write_view

BASELINE = "Baseline"
# Per-dataset columns taken from each run's stats (see report.STATS_COLUMNS).
OWN_STATS = ("own_c1_true", "own_c1_false", "own_dds", "c1_true_change", "c1_false_change", "c1_damage",
             "median_label_mass", "invalid_judgments")


def parse_conditions(specs: str | Sequence[str], what: str = "--runs") -> dict[str, str]:
    """`[Name=]RUN_DIR` entries (eval/comparison_rows.named_runs; the old 'A=x,B=y' too) -> ordered {name: dir},
    a name defaulting to the run folder's; the first is the baseline."""
    out: dict[str, str] = {}
    for name, path in named_runs(specs, what):
        if not Path(split_system(path)[0]).is_dir():
            raise UserError(f"{what} {f'{name}=' if name else ''}{path}: no such run directory (each condition is "
                            "Name=RUN_DIR, or RUN_DIR named for its folder)")
        name = name or Path(split_system(path)[0]).name
        if name in out:
            raise UserError(f"{what}: two conditions named {name!r}; name them: Name=RUN_DIR")
        out[name] = path
    return out


def _c2_correct(records) -> pd.DataFrame:
    """(item_id, dataset, case) -> correct, for a run's C2 judgments."""
    rows = [{"item_id": r.item_id, "dataset": r.dataset, "case": r.case, "correct": r.correct}
            for r in records if r.case in C2_CASES]
    return pd.DataFrame(rows, columns=["item_id", "dataset", "case", "correct"])


def c2_accuracy_ci(frame: pd.DataFrame, n_boot: int, seed: int) -> tuple[float, float]:
    """95% CI of the macro-averaged C2 accuracy (total_avg row) of a report's item frame:
    items resampled within each dataset, as the report's avg-row CIs are."""
    if n_boot <= 0:
        return math.nan, math.nan
    boots = []
    for ds in M.dataset_order(frame["dataset"].unique()):
        X = M.correctness(frame[frame["dataset"] == ds])
        acc = M.accuracy_distribution(X, n_boot, B.rng_for(seed, f"acc:{ds}"))
        boots.append(acc[2:4].mean(axis=0))
    if not boots:
        return math.nan, math.nan
    macro = np.mean(np.stack(boots), axis=0)
    return float(np.percentile(macro, 2.5)), float(np.percentile(macro, 97.5))


def significance_vs_baseline(baseline_records, records) -> pd.DataFrame:
    """Exact McNemar test per dataset: did the condition change C2 correctness on the
    same items (both C2 cases pooled) relative to the baseline? (DDS records of each run,
    as its report loaded them.)"""
    base, cur = _c2_correct(baseline_records), _c2_correct(records)
    merged = base.merge(cur, on=["item_id", "dataset", "case"], suffixes=("_base", "_cur"))
    rows = []
    for ds, sub in merged.groupby("dataset", sort=False):
        res = M.mcnemar_pair(sub["correct_base"].to_numpy(), sub["correct_cur"].to_numpy())
        rows.append({"dataset": ds, "n_judgments": len(sub), "mcnemar_pvalue": res["pvalue"],
                     "worse": res["c1_right_c2_wrong"], "better": res["c1_wrong_c2_right"]})
    if len(merged):
        res = M.mcnemar_pair(merged["correct_base"].to_numpy(), merged["correct_cur"].to_numpy())
        rows.append({"dataset": M.TOTAL_AVG, "n_judgments": len(merged), "mcnemar_pvalue": res["pvalue"],
                     "worse": res["c1_right_c2_wrong"], "better": res["c1_wrong_c2_right"]})
    return pd.DataFrame(rows, columns=["dataset", "n_judgments", "mcnemar_pvalue", "worse", "better"])


def stars(p: float) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return ""
    return "***" if p < 0.001 else "**" if p < 0.01 else "*" if p < 0.05 else ""


def require_whole_runs(conditions: Mapping[str, str], protocol_runs: Sequence[tuple[str, str]] = (),
                       c1_from: str | None = None) -> None:
    """Every run a comparison reads is whole (records.require_whole), checked before any number is
    computed: the conditions, the C1 baselines their run.json names, the other protocols' runs."""
    paths = [*conditions.values(), c1_from, *(load_run_meta(p).get("c1_from") for p in conditions.values()),
             *(split_system(spec)[0] for _, spec in protocol_runs)]
    for path in dict.fromkeys(str(p) for p in paths if p):
        require_whole(path)


def build_comparison(
    conditions: Mapping[str, str], c1_from: str | None = None, n_boot: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """Reports of every condition, aligned on datasets, with deltas against the first."""
    names = list(conditions)
    if not names:
        raise UserError("no conditions to compare")
    baseline_dir = conditions[names[0]]
    c1_from = c1_from or load_run_meta(baseline_dir).get("c1_from") or baseline_dir
    per_condition, long_rows, sig_rows = {}, [], []
    for name in names:
        run_dir = conditions[name]
        own_c1 = load_run_meta(run_dir).get("c1_from")
        rep = report_run(run_dir, c1_from=None if (name == names[0] and not own_c1) else (own_c1 or c1_from),
                         n_boot=n_boot, seed=seed)
        per_condition[name] = rep
        summary = rep.summary.set_index("dataset")
        stats = rep.stats[rep.stats["stratum"] == "all"].set_index("dataset")
        lo, hi = c2_accuracy_ci(rep.frame, n_boot, seed)
        for ds, row in summary.iterrows():
            long_rows.append({"condition": name, "dataset": ds, **row.to_dict(),
                              "c2_avg": (row["c2_correct"] + row["c2_incorrect"]) / 2,
                              "c2_avg_ci_low": lo if ds == M.TOTAL_AVG else math.nan,
                              "c2_avg_ci_high": hi if ds == M.TOTAL_AVG else math.nan,
                              **{c: stats.loc[ds, c] for c in OWN_STATS}})
        if name != names[0]:
            sig = significance_vs_baseline(per_condition[names[0]].records, rep.records)
            sig.insert(0, "condition", name)
            sig_rows.append(sig)
    table = pd.DataFrame(long_rows)
    for col in OWN_STATS[:5] + ("median_label_mass",):  # NaN, not None, where a run has no own C1
        table[col] = pd.to_numeric(table[col], errors="coerce").astype(float)
    table["invalid_judgments"] = pd.array([None if pd.isna(v) else int(v) for v in table["invalid_judgments"]],
                                          dtype="Int64")
    table["c1_damage"] = pd.Series([None if v is None or pd.isna(v) else bool(v) for v in table["c1_damage"]],
                                   dtype=object, index=table.index)
    base = table[table["condition"] == names[0]].set_index("dataset")
    table["delta_c2_avg"] = table.apply(lambda r: r["c2_avg"] - base.loc[r["dataset"], "c2_avg"]
                                        if r["dataset"] in base.index else math.nan, axis=1)
    table["delta_dds"] = table.apply(lambda r: r["dds"] - base.loc[r["dataset"], "dds"]
                                     if r["dataset"] in base.index else math.nan, axis=1)
    table["over_correction"] = table.apply(
        lambda r: r["condition"] != names[0] and r["dataset"] in base.index
        and M.over_correction(base.loc[r["dataset"], "dds"], r["dds"]), axis=1)
    # not meaningful (report.py: too few valid judgments, or a model that does not do the task): its numbers
    # are empty, its flags unknown; `meaningful` last, the counts as integers
    table["meaningful"] = table["meaningful"].astype(bool)
    for col in ("c2_avg_ci_low", "c2_avg_ci_high"):  # an accuracy the report left empty has no interval either
        table[col] = table[col].where(table["c2_avg"].notna())
    table["over_correction"] = pd.Series([bool(v) if ok else None for v, ok in zip(table["over_correction"],
                                                                                   table["meaningful"])],
                                         dtype=object, index=table.index)
    table["n"] = table["n"].astype("Int64")
    table = table[[c for c in table.columns if c != "meaningful"] + ["meaningful"]]
    significance = pd.concat(sig_rows, ignore_index=True) if sig_rows else pd.DataFrame(
        columns=["condition", "dataset", "n_judgments", "mcnemar_pvalue", "worse", "better"])
    # a test against the baseline means something only where both rows do
    ok = {(r.condition, r.dataset): bool(r.meaningful) for r in table.itertuples()}
    significance["meaningful"] = [ok.get((c, d), True) and ok.get((names[0], d), True)
                                  for c, d in zip(significance["condition"], significance["dataset"])]
    significance["mcnemar_pvalue"] = significance["mcnemar_pvalue"].astype(float).where(significance["meaningful"])
    for col in ("n_judgments", "worse", "better"):
        significance[col] = significance[col].astype("Int64")
    return {"conditions": names, "table": table, "significance": significance, "reports": per_condition,
            "runs": {name: str(Path(conditions[name]).resolve()) for name in names}}


def _signed(x: float) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.1f}"


def _num(x: Any, spec: str) -> str:
    """x formatted with `spec`, or '–' when absent."""
    if x is None or pd.isna(x):
        return "–"
    return format(int(x) if spec == "d" else float(x), spec)


def _own_c1(r: Any) -> str:
    """'58.0 / 70.0 (-2.0 / -10.0) ‡': own C1 accuracies, change vs the baseline, C1 damage mark; n/m for
    an accuracy its report left empty as not meaningful."""
    if r is None:
        return "–"
    ok = _ok(r)
    if pd.isna(r["own_c1_true"]) and pd.isna(r["own_c1_false"]):
        return "–" if ok else NOT_MEANINGFUL

    def acc(x: Any) -> str:
        return f"{x:.1f}" if not pd.isna(x) else ("–" if ok else NOT_MEANINGFUL)

    text = f"{acc(r['own_c1_true'])} / {acc(r['own_c1_false'])}"
    if not (pd.isna(r["c1_true_change"]) and pd.isna(r["c1_false_change"])):
        text += f" ({_signed(r['c1_true_change'])} / {_signed(r['c1_false_change'])})"
    damaged = r["c1_damage"] is not None and not pd.isna(r["c1_damage"]) and bool(r["c1_damage"])
    return text + (" ‡" if damaged else "")


def _ok(r: Any) -> bool:
    """A comparison row's numbers are meaningful (report.py; a table without the column: yes)."""
    v = r.get("meaningful", True) if hasattr(r, "get") else True
    return True if v is None or (isinstance(v, float) and math.isnan(v)) else bool(v)


def _row_mark(cmp: dict[str, Any], name: str, dataset: str) -> str:
    """'n/m (0 of 12 valid)': the mark of a condition's not-meaningful row, from its report's counts."""
    rep = (cmp.get("reports") or {}).get(name)
    if rep is None:
        return NOT_MEANINGFUL
    stats = rep.stats[(rep.stats["stratum"] == "all") & (rep.stats["dataset"] == dataset)]
    return row_mark(stats.iloc[0].to_dict()) if len(stats) else NOT_MEANINGFUL


def _arrow(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)) or abs(x) < 0.05:
        return ""
    return f" ({'↑' if x > 0 else '↓'}{abs(x):.1f})"


def render_markdown(cmp: dict[str, Any], extra_sections: list[str] = ()) -> str:
    table, sig, names = cmp["table"], cmp["significance"], cmp["conditions"]
    sig_index = {(r.condition, r.dataset): r.mcnemar_pvalue for r in sig.itertuples()}
    lines = ["# Before/after comparison", "",
             f"Conditions: {', '.join(names)} (deltas, † and ‡ against **{names[0]}**). "
             "Two protocols: **DDS** (paper: fixed C1 from the baseline, DialDefer §7) scores every "
             "condition's C2 against the baseline's C1; **own DDS** (own C1) scores it against the "
             "condition's own C1 judgments (– when the run has none). "
             "† = over-correction: DDS turned from deference (> 0) into skepticism (< 0). "
             f"‡ = C1 damage: the condition's own C1 accuracy (true or false claims) is more than "
             f"{M.C1_DAMAGE_PP:g} pp below the baseline's, which the fixed-C1 DDS cannot show. "
             "Stars: exact McNemar test of C2 correctness against the baseline on the same items "
             "(* p<.05, ** p<.01, *** p<.001). Invalid: judgments of the run counted as wrong "
             "(unparsed replies, or label mass below the threshold); label mass: median P(\"1\")+P(\"2\") "
             "(logprob mode).", ""]
    metas = {n: rep.meta for n, rep in (cmp.get("reports") or {}).items()}  # each condition's DDSReport
    cross = [n for n in names if metas.get(n, {}).get("c1_cross_mode")]
    if cross:
        lines += [f"{', '.join(cross)}: {CROSS_MODE_NOTE}.", ""]
    unfit = {n: metas[n]["capability_note"] for n in names if metas.get(n, {}).get("capability_note")}
    lines += [f"**{n}**: {note} Its DDS cells read n/m (not meaningful).\n" for n, note in unfit.items()]
    lines += ["## Overview (paper Table 5 layout)", "",
              "| Condition | Avg (C2) | Bench DDS (paper) | r/AIO DDS (paper) | own C1 True / False (Δ) "
              "| Bench own DDS | r/AIO own DDS | invalid | label mass |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        sub = table[table["condition"] == name].set_index("dataset")

        def cell(ds, col, delta_col, dagger=True):
            if ds not in sub.index:
                return "–"
            r = sub.loc[ds]
            if not _ok(r) and pd.isna(r[col]):
                return NOT_MEANINGFUL
            mark = "†" if dagger and r["over_correction"] else ""
            delta = "" if name == names[0] else _arrow(r[delta_col])
            return f"{_signed(r[col]) if col == 'dds' else f'{r[col]:.1f}'}{mark}{delta}"

        def own(ds, col):
            if ds not in sub.index:
                return "–"
            return NOT_MEANINGFUL if not _ok(sub.loc[ds]) and pd.isna(sub.loc[ds, col]) else _signed(sub.loc[ds, col])

        avg = cell(M.TOTAL_AVG, "c2_avg", "delta_c2_avg", dagger=False) + stars(sig_index.get((name, M.TOTAL_AVG)))
        tot = sub.loc[M.TOTAL_AVG] if M.TOTAL_AVG in sub.index else None
        lines.append(
            f"| {name} | {avg} | {cell(M.BENCH_AVG, 'dds', 'delta_dds')} | {cell('aio', 'dds', 'delta_dds')} "
            f"| {_own_c1(tot)} | {own(M.BENCH_AVG, 'own_dds')} "
            f"| {own('aio', 'own_dds')} "
            f"| {_num(None if tot is None else tot['invalid_judgments'], 'd')} "
            f"| {_num(None if tot is None else tot['median_label_mass'], '.3f')} |")
    lines += ["", "## Per domain (paper Table 21 layout)", "",
              "| Dataset | Condition | Corr | Incorr | Avg | DDS (paper) | own C1 True / False (Δ) | own DDS |",
              "|---|---|---|---|---|---|---|---|"]
    datasets = [d for d in table["dataset"].unique()]
    for ds in datasets:
        for name in names:
            sub = table[(table["condition"] == name) & (table["dataset"] == ds)]
            if sub.empty:
                continue
            r = sub.iloc[0]
            first = name == names[0]
            label = f"{ds} ({domain_of(ds)})" if domain_of(ds) else ds
            if not _ok(r):  # the numbers its report kept (accuracies of valid judgments), n/m for the rest
                def acc(col: str) -> str:
                    return NOT_MEANINGFUL if pd.isna(r[col]) else f"{r[col]:.1f}"

                avg = acc("c2_avg") + ("" if first or pd.isna(r["c2_avg"]) else _arrow(r["delta_c2_avg"]))
                lines.append(f"| {label if first else ''} | {name} | {acc('c2_correct')} | {acc('c2_incorrect')} "
                             f"| {avg}{stars(sig_index.get((name, ds)))} | {_row_mark(cmp, name, ds)} | {_own_c1(r)} "
                             f"| {NOT_MEANINGFUL} |")
                continue
            avg = f"{r['c2_avg']:.1f}{'' if first else _arrow(r['delta_c2_avg'])}{stars(sig_index.get((name, ds)))}"
            dds = f"{_signed(r['dds'])}{'†' if r['over_correction'] else ''}{'' if first else _arrow(r['delta_dds'])}"
            lines.append(f"| {label if first else ''} | {name} | {r['c2_correct']:.1f} | {r['c2_incorrect']:.1f} | {avg} "
                         f"| {dds} | {_own_c1(r)} | {_signed(r['own_dds'])} |")
    if not table["meaningful"].all():
        lines += ["", "n/m = not meaningful: more than half of a case's judgments invalid (the first cell says how "
                  "many were valid), or a model that does not do the task (the note above); comparison.csv leaves "
                  "its numbers empty (`meaningful` False)."]
    lines += ["", "Figures: `dds_heatmap.png` (per-domain DDS, paper Fig. 4), `before_after.png` "
              "(DDS and C2 accuracy with 95% bootstrap CIs).", ""]
    for section in extra_sections:
        lines += [section, ""]
    return "\n".join(lines)


def plot_heatmap(cmp: dict[str, Any], path: Path) -> None:
    """Per-domain DDS (paper Fig. 4): a row per dataset, a column per condition, each cell's number on it
    (white on a dark cell), n/m where the row is not meaningful, nothing where it was not measured."""
    plt = pyplot()

    table, names = cmp["table"], cmp["conditions"]
    cols = [c for c in table["dataset"].unique()]
    values = table.pivot(index="condition", columns="dataset", values="dds").reindex(names)[cols].to_numpy(dtype=float).T
    ok = table.pivot(index="condition", columns="dataset", values="meaningful").reindex(names)[cols].to_numpy().T
    lim = max(10.0, float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 10.0)
    fig, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, 2.6 + 0.95 * len(names)), 1.4 + 0.42 * len(cols)))
    im = ax.imshow(values, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(len(names)), list(names), fontsize=MIN_FONT, rotation=30, ha="right",
                  rotation_mode="anchor")
    ax.set_yticks(range(len(cols)), [domain_of(c) or c for c in cols], fontsize=MIN_FONT)
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            if np.isfinite(values[i, j]):
                cell_text(ax, j, i, f"{values[i, j]:+.1f}", im.cmap(im.norm(values[i, j])))
            elif not pd.isna(ok[i, j]) and not bool(ok[i, j]):  # measured, not meaningful (a missing cell: NaN)
                mark_not_meaningful(ax, j, i)
    finish_heatmap(fig, ax, im, ">0 deference, <0 skepticism (pp)", "DDS by domain and condition (pp)")
    save_figure(fig, path)


def plot_before_after(cmp: dict[str, Any], path: Path) -> None:
    """DDS and C2 accuracy (all domains) per condition with 95% CIs, n/m where a row is not meaningful."""
    plt = pyplot()

    table, names = cmp["table"], cmp["conditions"]
    tot = table[table["dataset"] == M.TOTAL_AVG].set_index("condition").reindex(names)

    def bars(value: str, lo: str, hi: str) -> dict[str, list[tuple[float, float, float, str]]]:
        return {"all domains": [(float(r[value]), float(r[lo]), float(r[hi]),
                                 NOT_MEANINGFUL if r.get("meaningful") is False else "not measured" if pd.isna(r[value]) else "")
                                for _, r in tot.iterrows()]}

    width = min(MAX_WIDTH_IN, 3.0 + 1.5 * len(names))
    fig, axes = plt.subplots(1, 2, figsize=(width, 3.9))
    draw_estimate_bars(axes[0], names, bars("dds", "dds_ci_low", "dds_ci_high"), "pp", legend=False)
    axes[0].set_title("DDS, all domains (95% CI)", fontsize=TITLE_FONT)
    draw_estimate_bars(axes[1], names, bars("c2_avg", "c2_avg_ci_low", "c2_avg_ci_high"), "%", legend=False)
    axes[1].set_ylim(0, 112)
    axes[1].set_title("C2 accuracy, macro avg (95% CI)", fontsize=TITLE_FONT)
    fig.tight_layout()
    save_figure(fig, path)


def write_comparison(cmp: dict[str, Any] | None, out_dir: str | Path, extra_sections: list[str] = (),
                     protocols: pd.DataFrame | None = None, protocol_runs: Sequence[tuple[str, str]] = (),
                     transfer: pd.DataFrame | None = None, correction: str = "holm",
                     smallest_change: float = 10.0, n_boot: int = 2000) -> Path:
    """comparison.md/csv/json, significance.csv, the plots and view.html; with protocol rows
    (protocol_rows of `protocol_runs`) also comparison_protocols.csv and a section per protocol; with a
    transfer table (pipeline/transfer.build_transfer, built with `correction` and `smallest_change`)
    transfer.md/csv/json/png, its summary and its paired tests; when the baseline model is an organism, its
    verdicts against the planted profile (organism/ground_truth.py: ground_truth.json and a section). `cmp`
    None: a comparison without DDS runs (other protocols', imported runs): no DDS tables or plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cmp is not None:
        runs = cmp.get("runs") or {}
        model = load_run_meta(next(iter(runs.values()))).get("model") if runs else None
        truth = ground_truth(runs, lambda: condition_units(runs, protocol_runs)[0], cmp["table"], protocols, transfer,
                             model, n_boot)
        if truth is not None:
            atomic_write_json(out / GROUND_TRUTH_JSON, truth)
            extra_sections = [render_ground_truth(truth), *extra_sections]
    if transfer is not None:
        info = write_transfer(transfer, out, correction, smallest_change)
        roles = set(transfer["role"]) - {"–"}  # none: runs compared, no mitigation's cells (imported runs)
        extra_sections = [*extra_sections, "## Transfer and side effects\n\nPer cell (protocol x dataset or kind x "
                          "framing) with its role and a paired 95% CI: transfer.md, transfer.csv, transfer.png.\n\n"
                          + "\n".join(f"- **{c}**: " + "; ".join(f"{k}: {v}" for k, v in line.items() if roles or v != "–")
                                      for c, line in info["summary"].items()),
                          paired_tests_markdown(transfer, correction, smallest_change)]
    if protocols is not None and not protocols.empty:
        atomic_write_text(out / PROTOCOLS_CSV, protocols.to_csv(index=False, columns=PROTOCOL_COLUMNS, float_format="%.4f"))
        extra_sections = [*protocol_sections(protocols), *extra_sections] if cmp is None else \
            [*extra_sections, *protocol_sections(protocols)]
    names = cmp["conditions"] if cmp is not None else list(dict.fromkeys(name for name, _ in protocol_runs))
    if cmp is not None:
        atomic_write_text(out / "comparison.csv", cmp["table"].to_csv(index=False, float_format="%.4f"))
        atomic_write_text(out / "significance.csv", cmp["significance"].to_csv(index=False, float_format="%.6g"))
        atomic_write_text(out / "comparison.md", render_markdown(cmp, extra_sections))
    else:
        atomic_write_text(out / "comparison.md", render_protocols_markdown(names, extra_sections))
    atomic_write_json(out / "comparison.json", {
        "conditions": names,
        # each condition's run directory and the other protocols' runs: flipguard view lists their items
        "runs": (cmp or {}).get("runs") or {},
        "protocol_runs": [[name, str(Path(run_dir).resolve()) + (f"@{system}" if system else "")]
                          for name, spec in protocol_runs for run_dir, system in [split_system(spec)]],
        "table": cmp["table"].replace({np.nan: None}).to_dict(orient="records") if cmp is not None else [],
        "significance": cmp["significance"].replace({np.nan: None}).to_dict(orient="records") if cmp is not None else [],
    })
    if cmp is not None:
        plot_heatmap(cmp, out / "dds_heatmap.png")
        plot_before_after(cmp, out / "before_after.png")

    write_view(out)  # view.html: the same tables, the plots and the items behind them, in one page
    return out


def render_protocols_markdown(names: Sequence[str], sections: Sequence[str]) -> str:
    """comparison.md of a comparison without DDS runs: each protocol's numbers, then the paired changes."""
    head = ["# Before/after comparison", "",
            f"Conditions: {', '.join(names)} (changes against **{names[0] if names else '–'}**, on the same items).", ""]
    return "\n".join(head + [section.strip() + "\n" for section in sections]).rstrip() + "\n"


PROTOCOLS_CSV = "comparison_protocols.csv"
# what write_comparison writes (checked before any work: each is absent or flipguard's)
OUTPUT_FILES = ("comparison.csv", "significance.csv", "comparison.md", "comparison.json", PROTOCOLS_CSV,
                "dds_heatmap.png", "before_after.png", "view.html", "transfer.csv", "transfer.md", "transfer.png",
                "transfer.json", GROUND_TRUTH_JSON)
GUARD_DROP_PP = 10.0  # a guarded metric (stick-or-switch's correct switch) this far below the baseline's is flagged


def protocol_rows(runs: Sequence[tuple[str, str]]) -> pd.DataFrame:
    """comparison_protocols.csv: every protocol run's numbers in long form, values in % (pp for
    differences). Each run's protocol (its run.json) supplies them through Task.comparison_rows;
    `RUN_DIR@system` keeps one system of a run that holds several."""
    rows = [row for condition, spec in runs for row in comparison_long_rows(condition, spec)]
    frame = pd.DataFrame(rows, columns=[*PROTOCOL_COLUMNS, "unit", "n_valid", "n_judged"])  # the last 3: for the tables
    for col in ("n", "n_valid", "n_judged"):
        frame[col] = frame[col].astype("Int64")
    frame["meaningful"] = frame["meaningful"].astype(bool)
    return frame


def protocol_flags(frame: pd.DataFrame) -> dict[tuple[str, str, str], str]:
    """(condition, protocol, system) -> marks for guarded metrics more than GUARD_DROP_PP below the
    baseline's (the first condition), dataset by dataset."""
    flags: dict[tuple[str, str, str], str] = {}
    if frame.empty:
        return flags
    for protocol, rows in frame.groupby("protocol", sort=False):
        baseline = rows["condition"].iloc[0]  # the first condition measured by this protocol
        for metric, mark in get_task(protocol).guarded_metrics.items():
            sel = rows[rows["metric"] == metric]
            base = sel[sel["condition"] == baseline].groupby("dataset")["value"].first()
            for r in sel[sel["condition"] != baseline].itertuples():
                if r.dataset in base and r.value < base[r.dataset] - GUARD_DROP_PP:
                    key = (r.condition, protocol, r.system)
                    flags[key] = flags.get(key, "") + mark
    return flags


def protocol_estimate(r: Any) -> Estimate:
    """A row of comparison_protocols (a namedtuple or a dict) as the Estimate it was written from."""
    get = r.get if isinstance(r, Mapping) else lambda k, d=None: getattr(r, k, d)
    def count(key: str) -> int | None:
        v = get(key)
        return None if v is None or pd.isna(v) else int(v)

    meaningful = get("meaningful", True)
    return Estimate(get("value"), get("ci_low"), get("ci_high"), int(get("n")), get("unit"), n_valid=count("n_valid"),
                    n_judged=count("n_judged"),
                    meaningful=True if meaningful is None or pd.isna(meaningful) else bool(meaningful))


def protocol_sections(frame: pd.DataFrame) -> list[str]:
    """One markdown section per protocol, from its rows: a row per condition x system x dataset,
    a column per metric ('value [ci_low, ci_high]'), the flags last."""
    flags = protocol_flags(frame)
    sections = []
    for protocol, rows in frame.groupby("protocol", sort=False):
        task = get_task(protocol)
        metrics = list(dict.fromkeys(rows["metric"]))
        lines = [f"## {task.comparison_title or protocol}", ""] + ([task.comparison_note, ""] if task.comparison_note else [])
        lines += ["| Condition | System | Dataset | " + " | ".join(metrics) + " | Flags |",
                  "|---" * (len(metrics) + 4) + "|"]
        for (condition, system, dataset), group in rows.groupby(["condition", "system", "dataset"], sort=False):
            by_metric = {r.metric: r for r in group.itertuples()}
            cells = []
            for m in metrics:
                r = by_metric.get(m)
                cells.append("–" if r is None else protocol_estimate(r).format(signed=r.unit == "pp"))
            lines.append(f"| {condition} | {system} | {dataset or '–'} | " + " | ".join(cells)
                         + f" | {flags.get((condition, protocol, system), '')} |")
        if not rows["meaningful"].astype(bool).all():
            lines += ["", f"{NOT_MEANINGFUL} = not meaningful: more than half of the replies behind it invalid (the "
                      "counts in brackets); comparison_protocols.csv leaves it empty, `meaningful` False."]
        sections.append("\n".join(lines))
    return sections


@dataclasses.dataclass
class CompareArgs:
    """Before/after comparison report across baseline, prompting and fine-tuned runs."""

    runs: list[str] = dataclasses.field(
        metadata={"help": "Conditions, each [Name=]RUN_DIR (Name: the folder's name when left out): "
                          "--runs Baseline=RUN_DIR 'Be Honest=RUN_DIR' SFT=RUN_DIR; the first is the baseline. "
                          "DDS runs make the DDS tables; a run of another protocol (an afr or sos run, a run that "
                          "`flipguard import` wrote) is compared as --protocols compares it ('Name=RUN_DIR@system' "
                          "picks one system of a run holding several)."}
    )
    out: str = dataclasses.field(default="runs/compare", metadata={"help": "Output folder for the report."})
    c1_from: str | None = dataclasses.field(default=None, metadata={"help": "C1 baseline run (default: the first condition)."})
    protocols: list[str] | None = dataclasses.field(
        default=None, metadata={"help": "Runs of any other registered task per condition (a user's: --include FILE), "
                                        "each Name=RUN_DIR[@system] (@ picks one system of a run holding several); "
                                        "their numbers go to comparison_protocols.csv and a section each. "
                                        "--<task> SPEC ... is the same for runs of that task only."}
    )
    n_boot: int = dataclasses.field(default=2000, metadata={"help": "Bootstrap replicates."})
    seed: int = dataclasses.field(default=0, metadata={"help": "Bootstrap seed."})
    correction: str = dataclasses.field(
        default="holm", metadata={"help": "Multiple-comparison correction of the paired tests across the comparison's "
                                          "cells: holm (family-wise error) or bh (Benjamini-Hochberg, false discovery "
                                          "rate).", "choices": sorted(P.CORRECTIONS)})
    smallest_change: float = dataclasses.field(
        default=10.0, metadata={"help": "The smallest change (pp) worth detecting: a cell without a significant change "
                                        "reads 'no change' when its minimal detectable difference is at most this, "
                                        "else 'too few items to tell'."})
    pairs: str | None = dataclasses.field(
        default=None, metadata={"help": "The pair set the fine-tuned conditions learned from (its counts.json): gives each "
                                        "cell of transfer.md its role (trained-on, held-out, cross-protocol)."})


def task_flag(task: str) -> str:
    """The CompareArgs field of a task's runs: `--afr`, `--are_you_sure`."""
    return task.replace("-", "_")


def compare_arguments(tasks: Sequence[str]) -> type:
    """CompareArgs with a `--<task> SPEC` option per registered task (one that would shadow an option is left out)."""
    return with_optional_fields(CompareArgs, {
        task_flag(t): f"{t} runs per condition, each Name=RUN_DIR[@system] (as --protocols; each a {t} run)."
        for t in tasks}, Optional[list[str]])


def protocol_runs_of(args: Any, tasks: Sequence[str]) -> list[tuple[str, str]]:
    """(condition, RUN_DIR[@system]) of --protocols and of every --<task> option, in that order; a
    --<task> run of another protocol is refused, naming it."""
    runs = list(parse_conditions(args.protocols, "--protocols").items()) if args.protocols else []
    own_options = {f.name for f in dataclasses.fields(CompareArgs)}  # a task named like one has no --<task>
    for task in tasks:
        spec = getattr(args, task_flag(task), None)
        if not spec or task_flag(task) in own_options:
            continue
        flag = f"--{task_flag(task)}"
        for name, run in parse_conditions(spec, flag).items():
            run_dir, _ = split_system(run)
            protocol = load_run_meta(run_dir).get("protocol")
            if protocol != task:
                raise UserError(f"{flag} {name}={run}: {Path(run_dir) / 'run.json'} is a {protocol!r} run, not {task!r} "
                                "(--protocols takes a run of any task)")
            runs.append((name, run))
    return runs


def split_protocols(conditions: Mapping[str, str]) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """--runs as (the DDS conditions, the runs of other protocols): a run whose run.json names another
    protocol (an afr or sos run, an imported run) is compared as a --protocols run."""
    dds, others = {}, []
    for name, spec in conditions.items():
        protocol = load_run_meta(split_system(spec)[0]).get("protocol")
        if protocol in (None, "dds") and split_system(spec)[1] is None:
            dds[name] = spec
        else:
            others.append((name, spec))
    return dds, others


def main(argv: list[str]) -> int:
    argv = take_includes(argv)  # a user's tasks: --include my_tasks.py
    tasks = task_names()
    args = parse_dataclasses(argv, compare_arguments(tasks), prog="flipguard compare", description=CompareArgs.__doc__)
    conditions, others = split_protocols(parse_conditions(args.runs))
    runs = others + protocol_runs_of(args, tasks)
    for name, spec in runs:
        if not (Path(split_system(spec)[0]) / "run.json").is_file():
            raise UserError(f"{name}={spec}: {Path(split_system(spec)[0]) / 'run.json'} not found: not a run folder")
    # before any work: the inputs are not being written, the outputs are flipguard's to replace
    for path in [*conditions.values(), *(split_system(spec)[0] for _, spec in runs), args.c1_from, args.out]:
        if path:
            refuse_busy(path, "compared")
    refuse_other_kind(args.out, "comparison")  # a run's or a study's folder holds no comparison
    check_outputs(args.out, OUTPUT_FILES)
    require_whole_runs(conditions, runs, args.c1_from)
    read_counts(args.pairs, "--pairs")  # a typo in --pairs, or a cut-short counts.json: refused before any number
    cmp = build_comparison(conditions, c1_from=args.c1_from, n_boot=args.n_boot, seed=args.seed) if conditions else None
    transfer = build_transfer(conditions, runs, args.pairs, cmp["reports"] if cmp else None, n_boot=args.n_boot,
                              seed=args.seed, pairs_flag="--pairs", correction=args.correction,
                              smallest_change=args.smallest_change)
    out = write_comparison(cmp, args.out, protocols=protocol_rows(runs), protocol_runs=runs, transfer=transfer,
                           correction=args.correction, smallest_change=args.smallest_change, n_boot=args.n_boot)
    print((out / "comparison.md").read_text(encoding="utf-8"))
    written = ["comparison.md", *(["comparison.csv"] if cmp else []), *(["comparison_protocols.csv"] if runs else []),
               *(["significance.csv", "dds_heatmap.png", "before_after.png"] if cmp else []), "transfer.md/csv/png",
               "view.html"]
    print(f"\ncomparison written to {out}/ ({', '.join(written)})")
    return 0
