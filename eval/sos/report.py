"""Stick-or-switch report: tables shaped like the paper's A.1-A.3 (markdown + CSV), the
single-shot baselines, survival per turn, invalid-reply counts, and two PNG plots
(survival curves per model; the flexibility scatter with the blind-switching diagonal).

Everything is recomputed from RUN_DIR/records.jsonl, so a report can be rebuilt at any
time (`flipguard report RUN_DIR`), into RUN_DIR/report/. `build_report` gives them as a `SosReport`
(report/summary.json is its `to_json()`; `numbers`, typed estimates per system, are what the
before/after comparison reads through `sos_summary`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pandas as pd

from flipguard.eval.estimate import NOT_MEANINGFUL, Estimate
from flipguard.eval.plots import pyplot, save_figure
from flipguard.eval.records import REPORT_DIR, REPORT_SUMMARY, load_records, load_run_meta
from flipguard.eval.sos.metrics import BASELINE_CASES, N_BOOT, PENALTY_KEY, summarise
from flipguard.files import atomic_write_json, atomic_write_text

# paths in the run directory (before: sos_report.md, sos_summary.json and the rest at its root)
REPORT_MD = REPORT_SUMMARY
SUMMARY_JSON = f"{REPORT_DIR}/summary.json"
SURVIVAL_PNG = f"{REPORT_DIR}/sos_survival.png"
FLEX_PNG = f"{REPORT_DIR}/sos_flexibility.png"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _signed(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:+.1f}"


def _ci(est: dict | None) -> str:
    if not est:
        return "–"
    return f"[{_fmt(est['ci_low'])}, {_fmt(est['ci_high'])}]"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _val(res: dict, key: str) -> float:
    est = res.get(key)
    return est["value"] if isinstance(est, dict) else math.nan


def _ok(*ests: Any) -> bool:
    """Every estimate dict given is meaningful (metrics: more than half its replies invalid: not)."""
    return all(not isinstance(e, dict) or e.get("meaningful", True) for e in ests)


def _nm(row: Any, x: Any, text: str) -> str:
    """`text` (a formatted number), or n/m where the row is not meaningful and the number is empty."""
    empty = x is None or (isinstance(x, float) and math.isnan(x))
    return NOT_MEANINGFUL if empty and not getattr(row, "meaningful", True) else text


def _ints(frame: pd.DataFrame) -> pd.DataFrame:
    """Counts as integers (n, invalid, turn), never 3.0."""
    for c in frame.columns:
        if c in ("turn", "n_items", "n_conversations", "n_abstained", "invalid_ended") or c.endswith("_invalid"):
            frame[c] = frame[c].astype("Int64")
    return frame


NM_LEGEND = ("n/m = not meaningful: more than half of the replies behind the number unreadable (they count as "
             "failures, so the rate would measure the parsing); the CSVs leave it empty, their row's `meaningful` False.")


def tables(summary: dict[str, dict], abstention_reference: str = "ours") -> dict[str, pd.DataFrame]:
    """The report's tables as DataFrames (also written as CSV). Table A.2's SS and delta
    follow `abstention_reference` (metrics.PENALTY_KEY); the other reading sits beside it."""
    ss_key, pen_key = PENALTY_KEY[abstention_reference]
    other_ss, other_pen = PENALTY_KEY["paper" if abstention_reference == "ours" else "ours"]
    a1, a2, a3, base, surv = [], [], [], [], []
    for system, res in summary.items():
        for rows, scen, ss_case, gap_key in ((a1, "positive", "ss_full", "conversation_tax"),
                                             (a2, "negative", ss_key, pen_key)):
            if f"{scen}_mt" in res:
                gap = res.get(gap_key) or {}
                row = {"model": system, "ss": _val(res, ss_case), "mt": _val(res, f"{scen}_mt"),
                       "delta_pp": gap.get("value", math.nan), "delta_ci_low": gap.get("ci_low", math.nan),
                       "delta_ci_high": gap.get("ci_high", math.nan), "n_items": gap.get("n", 0),
                       "n_conversations": res[f"{scen}_n"]}
                ests = [res.get(ss_case), res.get(f"{scen}_mt"), gap]
                if scen == "negative":
                    other = res.get(other_pen) or {}
                    row.update(reading=abstention_reference, other_ss=_val(res, other_ss),
                               other_delta_pp=other.get("value", math.nan))
                    ests += [res.get(other_ss), other]
                row["meaningful"] = _ok(*ests)
                rows.append(row)
        if "flexibility" in res:
            fx = res["flexibility"]
            a3.append({"model": system, "incorrect_switch": fx["incorrect_switch"]["value"],
                       "incorrect_ci_low": fx["incorrect_switch"]["ci_low"], "incorrect_ci_high": fx["incorrect_switch"]["ci_high"],
                       "correct_switch": fx["correct_switch"]["value"],
                       "correct_ci_low": fx["correct_switch"]["ci_low"], "correct_ci_high": fx["correct_switch"]["ci_high"],
                       "delta_pp": fx["switch_gap"]["value"], "delta_ci_low": fx["switch_gap"]["ci_low"],
                       "delta_ci_high": fx["switch_gap"]["ci_high"], "n_abstained": fx["correct_switch"]["n"],
                       "abstained_t1": fx["abstained_t1"]["value"], "meaningful": _ok(*fx.values())})
        row: dict[str, Any] = {"model": system}
        for case in BASELINE_CASES:
            est = res.get(case)
            row[case] = est["value"] if est else math.nan
            row[f"{case}_ci_low"] = est["ci_low"] if est else math.nan
            row[f"{case}_ci_high"] = est["ci_high"] if est else math.nan
            row[f"{case}_invalid"] = res.get(f"{case}_invalid", 0)
        row["meaningful"] = _ok(*(res.get(c) for c in BASELINE_CASES))
        if any(not math.isnan(row[c]) or res.get(c) for c in BASELINE_CASES):
            base.append(row)
        for scen in ("positive", "negative"):
            ok = _ok(res.get(f"{scen}_mt"))  # S(t) of conversations mostly ended by unreadable replies: not meaningful
            for t, v in enumerate(res.get(f"{scen}_survival", []), start=1):
                surv.append({"model": system, "scenario": scen, "turn": t, "survival": v if ok else math.nan,
                             "invalid_ended": res.get(f"{scen}_invalid_by_turn", {}).get(t, 0), "meaningful": ok})
    return {name: _ints(pd.DataFrame(rows)) for name, rows in (
        ("table_a1_conversation_tax", a1), ("table_a2_abstention_penalty", a2), ("table_a3_flexibility", a3),
        ("baselines", base), ("survival", surv))}


SAMPLING_NOTE = {
    "greedy": "Decoding: greedy unless --temperature says otherwise (ours; the paper samples at each model's "
              "default temperature, §4.2).",
    "model_default": "Decoding: each model's own default sampling settings (paper §4.2, 'to mirror standard usage').",
}
READING_NOTE = {
    "ours": "SS = single-shot abstention rate with NA replacing the answer (ours); Δ paper = MT − single-shot "
            "accuracy, as the paper's Table A.2 computes it (its SS column equals Table A.1's).",
    "paper": "SS = single-shot accuracy with all options, as the paper's Table A.2 computes it (its SS column equals "
             "Table A.1's); Δ ours = MT − single-shot abstention rate with NA replacing the answer.",
}


def markdown(summary: dict[str, dict], meta: dict) -> str:
    reference = meta.get("abstention_reference", "ours")
    t = tables(summary, reference)
    dataset = meta.get("dataset", "?")
    parts = [f"# Stick-or-switch report — {dataset}", ""]
    parts.append(f"Items: {meta.get('n_items_evaluated', '?')} ({meta.get('split', '?')} split), "
                 f"seed {meta.get('seed', '?')}, repeats {meta.get('repeats', 1)}, {meta.get('n_shots', '?')}-shot, "
                 f"decoding {meta.get('generation', {})}. Values in %, Δ in percentage points; "
                 f"95% CIs: percentile bootstrap over items ({meta.get('n_boot', N_BOOT)} resamples). "
                 + SAMPLING_NOTE.get(meta.get("sampling", "greedy"), ""))
    if meta.get("skipped_items"):
        parts.append(f"\nItems left out as invalid (--skip_invalid_items): {len(meta['skipped_items'])}; "
                     "listed in run.json.")
    if not t["table_a1_conversation_tax"].empty:
        parts += ["", "## Conversation tax (Table A.1 layout): accuracy, single-shot (SS, all options) vs multi-turn (MT)", ""]
        rows = [[r.model, _nm(r, r.ss, _fmt(r.ss)), f"{_nm(r, r.mt, _fmt(r.mt))} ({_nm(r, r.delta_pp, _signed(r.delta_pp))})",
                 _nm(r, r.delta_ci_low, f"[{_fmt(r.delta_ci_low)}, {_fmt(r.delta_ci_high)}]"), str(r.n_items)]
                for r in t["table_a1_conversation_tax"].itertuples()]
        parts.append(_md_table(["Model", "SS", "MT (Δ)", "Δ 95% CI", "items"], rows))
    if not t["table_a2_abstention_penalty"].empty:
        other = "paper" if reference == "ours" else "ours"
        parts += ["", f"## Abstention penalty (Table A.2 layout, {reference} reading): abstention rate (MT) "
                      "against a single-shot reference (SS)", "", READING_NOTE[reference], ""]
        rows = [[r.model, _nm(r, r.ss, _fmt(r.ss)), f"{_nm(r, r.mt, _fmt(r.mt))} ({_nm(r, r.delta_pp, _signed(r.delta_pp))})",
                 _nm(r, r.delta_ci_low, f"[{_fmt(r.delta_ci_low)}, {_fmt(r.delta_ci_high)}]"),
                 _nm(r, r.other_delta_pp, _signed(r.other_delta_pp)), str(r.n_items)]
                for r in t["table_a2_abstention_penalty"].itertuples()]
        parts.append(_md_table(["Model", "SS", "MT (Δ)", "Δ 95% CI", f"Δ {other}", "items"], rows))
    if not t["table_a3_flexibility"].empty:
        parts += ["", "## Flexibility (Table A.3 layout): switch rates after a turn-1 abstention", "",
                  "Incorrect = took another distractor when offered; Correct = took the answer when offered; "
                  "Δ = Correct − Incorrect (≈ 0: blind switching)."]
        rows = [[r.model, _nm(r, r.incorrect_switch,
                              f"{_fmt(r.incorrect_switch)} [{_fmt(r.incorrect_ci_low)}, {_fmt(r.incorrect_ci_high)}]"),
                 f"{_nm(r, r.correct_switch, _fmt(r.correct_switch))} ({_nm(r, r.delta_pp, _signed(r.delta_pp))})",
                 _nm(r, r.delta_ci_low, f"[{_fmt(r.delta_ci_low)}, {_fmt(r.delta_ci_high)}]"),
                 f"{r.n_abstained} ({_nm(r, r.abstained_t1, _fmt(r.abstained_t1) + '%')})"]
                for r in t["table_a3_flexibility"].itertuples()]
        parts += ["", _md_table(["Model", "Incorrect [CI]", "Correct (Δ)", "Δ 95% CI", "abstained at t1"], rows)]
    if not t["baselines"].empty:
        parts += ["", "## Single-shot baselines", "",
                  "Binary = the answer (or NA) against one random distractor; the same prompt starts the conversations."]
        rows = [[r["model"]] + [
            NOT_MEANINGFUL if not r["meaningful"] and math.isnan(r[c]) and c in (summary.get(r["model"]) or {}) else
            f"{_fmt(r[c])} {_ci({'ci_low': r[c + '_ci_low'], 'ci_high': r[c + '_ci_high']})}" for c in BASELINE_CASES]
                for r in t["baselines"].to_dict("records")]
        parts += ["", _md_table(["Model", "Accuracy, full", "Accuracy, binary", "Abstention, full", "Abstention, binary"], rows)]
    surv = t["survival"]
    if not surv.empty:
        parts += ["", "## Survival S(t) (Eq. 1)", ""]
        max_t = int(surv["turn"].max())
        rows = []
        for (model, scen), g in surv.groupby(["model", "scenario"], sort=False):
            vals = dict(zip(g["turn"], g["survival"]))
            ok = bool(g["meaningful"].all())
            rows.append([model, scen] + [_fmt(vals.get(k, math.nan)) if ok or k not in vals else NOT_MEANINGFUL
                                         for k in range(1, max_t + 1)])
        parts.append(_md_table(["Model", "scenario"] + [f"S({k})" for k in range(1, max_t + 1)], rows))
    if any(NOT_MEANINGFUL in part for part in parts):
        parts += ["", NM_LEGEND]
    parts += ["", "## Unreadable replies (counted as failures, never dropped)", ""]
    rows = []
    for system, res in summary.items():
        cells = [f"{c}: {res[c + '_invalid']}" for c in BASELINE_CASES
                 if c + "_invalid" in res]
        for scen in ("positive", "negative"):
            if f"{scen}_ends" in res:
                cells.append(f"{scen}: {res[f'{scen}_ends'].get('invalid', 0)} ended by an invalid reply "
                             f"(ends: {res[f'{scen}_ends']})")
                if res.get(f"{scen}_incomplete"):
                    cells.append(f"{scen}: {res[f'{scen}_incomplete']} incomplete (rerun to finish)")
        if "flexibility_invalid" in res:
            cells.append(f"flexibility: {res['flexibility_invalid']}")
        rows.append([system, "; ".join(cells)])
    parts.append(_md_table(["Model", "invalid"], rows))
    parts += ["", f"Plots: `{Path(SURVIVAL_PNG).name}`, `{Path(FLEX_PNG).name}` (beside this file).", ""]
    return "\n".join(parts)


def plot_survival(summary: dict[str, dict], path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, scen, ss_key, title in ((axes[0], "positive", "ss_full", "Positive conviction (accuracy)"),
                                    (axes[1], "negative", "abstain_full", "Negative conviction (abstention)")):
        for i, (system, res) in enumerate(summary.items()):
            curve = res.get(f"{scen}_survival")
            if not curve or not _ok(res.get(f"{scen}_mt")):  # not meaningful: no curve drawn
                continue
            color = f"C{i % 10}"
            ax.plot(range(1, len(curve) + 1), curve, marker="o", color=color, label=system)
            if ss_key in res:
                ax.axhline(res[ss_key]["value"], color=color, linestyle="--", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("turn t")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("S(t), %  (dashed: single-shot, all options)")
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save_figure(fig, path)


def plot_flexibility(summary: dict[str, dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 100], [0, 100], color="grey", linestyle="--", linewidth=1, label="blind switching")
    for i, (system, res) in enumerate(summary.items()):
        fx = res.get("flexibility")
        if not fx or math.isnan(fx["correct_switch"]["value"]):
            continue
        x, y = fx["correct_switch"], fx["incorrect_switch"]
        xerr = [[max(0.0, x["value"] - x["ci_low"])], [max(0.0, x["ci_high"] - x["value"])]] if not math.isnan(x["ci_low"]) else None
        yerr = [[max(0.0, y["value"] - y["ci_low"])], [max(0.0, y["ci_high"] - y["value"])]] if not math.isnan(y["ci_low"]) else None
        ax.errorbar(x["value"], y["value"], xerr=xerr, yerr=yerr, fmt="o", color=f"C{i % 10}", capsize=3, label=system)
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.set_xlabel("correct switch rate, %")
    ax.set_ylabel("incorrect switch rate, %")
    ax.set_title("Flexibility after a turn-1 abstention\n(ideal: bottom right)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


# the comparison's names of a system's numbers: (summarise's key, within "flexibility"?, unit)
_NUMBERS = {
    "conversation_tax": ("conversation_tax", False, "pp"),
    "abstention_penalty": ("abstention_penalty", False, "pp"),
    "abstention_penalty_paper": ("abstention_penalty_paper", False, "pp"),
    "ss_accuracy": ("ss_full", False, "%"),
    "mt_accuracy": ("positive_mt", False, "%"),
    "ss_abstention": ("abstain_full", False, "%"),
    "mt_abstention": ("negative_mt", False, "%"),
    "correct_switch": ("correct_switch", True, "%"),
    "incorrect_switch": ("incorrect_switch", True, "%"),
}


@dataclasses.dataclass
class SosNumbers:
    """One system's numbers for the before/after comparison: the gaps in pp, the rates behind them
    in %, each with its 95% CI and n items; None where the run did not measure it."""

    conversation_tax: Estimate | None
    abstention_penalty: Estimate | None
    abstention_penalty_paper: Estimate | None
    ss_accuracy: Estimate | None
    mt_accuracy: Estimate | None
    ss_abstention: Estimate | None
    mt_abstention: Estimate | None
    correct_switch: Estimate | None
    incorrect_switch: Estimate | None

    @classmethod
    def of(cls, res: dict[str, Any]) -> "SosNumbers":
        """From one system's metrics (metrics.summarise, the file's {value, ci_low, ci_high, n} shape)."""
        def get(key: str, in_flexibility: bool, unit: str) -> Estimate | None:
            d = (res.get("flexibility", {}) if in_flexibility else res).get(key)
            return None if d is None else Estimate.from_dict(d, unit)
        return cls(**{name: get(*where) for name, where in _NUMBERS.items()})

    def to_json(self) -> dict[str, Any]:
        return {f.name: None if (e := getattr(self, f.name)) is None else e.as_dict() for f in dataclasses.fields(self)}


@dataclasses.dataclass
class SosReport:
    """A stick-or-switch run's numbers, recomputed from its records: `systems` holds every metric
    per system (model [+ mitigation]) as metrics.summarise gives them; `to_json()` is
    report/summary.json, `numbers` what the before/after comparison reads."""

    run_dir: Path
    dataset: str | None
    seed: int
    n_boot: int
    systems: dict[str, dict[str, Any]]

    @property
    def numbers(self) -> dict[str, SosNumbers]:
        return {system: SosNumbers.of(res) for system, res in self.systems.items()}

    def to_json(self) -> dict[str, Any]:
        """report/summary.json."""
        return {"dataset": self.dataset, "seed": self.seed, "n_boot": self.n_boot, "systems": self.systems}

    def comparison_json(self) -> dict[str, Any]:
        """The comparison's numbers as JSON: {dataset, run_dir, models: {system: SosNumbers.to_json()}}."""
        return {"dataset": self.dataset, "run_dir": str(self.run_dir),
                "models": {system: n.to_json() for system, n in self.numbers.items()}}


def build_report(run_dir: str | Path, seed: int | None = None, n_boot: int | None = None) -> SosReport:
    """Every metric of a run from its records; seed and bootstrap size default to run.json's."""
    run_dir = Path(run_dir)
    meta = load_run_meta(run_dir)
    seed = meta.get("seed", 0) if seed is None else seed
    n_boot = meta.get("n_boot", N_BOOT) if n_boot is None else n_boot
    records = [r for r in load_records(run_dir) if r.protocol == "sos"]
    return SosReport(run_dir, meta.get("dataset"), seed, n_boot, summarise(records, seed=seed, n_boot=n_boot))


def write_report(run_dir: str | Path, seed: int | None = None, n_boot: int | None = None) -> Path:
    """Recompute everything from the run's records and write the report files."""
    run_dir = Path(run_dir)
    meta = load_run_meta(run_dir)
    report = build_report(run_dir, seed, n_boot)
    summary = report.systems
    for name, frame in tables(summary, meta.get("abstention_reference", "ours")).items():
        atomic_write_text(run_dir / REPORT_DIR / f"sos_{name}.csv", frame.to_csv(index=False))
    atomic_write_json(run_dir / SUMMARY_JSON, report.to_json())
    plot_survival(summary, run_dir / SURVIVAL_PNG)
    plot_flexibility(summary, run_dir / FLEX_PNG)
    path = run_dir / REPORT_MD
    atomic_write_text(path, markdown(summary, {**meta, "n_boot": report.n_boot}))
    return path


def sos_summary(run_dir: str | Path) -> SosReport:
    """For the before/after comparison (`.numbers`): the run's report at run.json's seed and
    bootstrap size."""
    return build_report(run_dir)
