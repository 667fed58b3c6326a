"""AFR report: the paper's Tables 2, 3, 4, 5, 6, 7 (markdown + csv) and Figures 2, 3, 4 (PNG).

Numbers are percentages with the 95% cluster-bootstrap CI half-width after "±"
(the paper prints it as a subscript); significance stars: * p<0.05, ** p<0.01,
*** p<0.001 (paired cluster bootstrap, see metrics.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flipguard.data.mmlu import subject_category
from flipguard.eval.afr import metrics as M
from flipguard.eval.afr.maxflip import MAXFLIP_FILE, load_maxflip, maxflip_afr, maxflip_table
from flipguard.eval.estimate import NOT_MEANINGFUL, difference
from flipguard.eval.plots import MIN_FONT, cell_text, finish_heatmap, mark_not_meaningful, pyplot, save_figure
from flipguard.eval.records import REPORT_DIR, REPORT_SUMMARY, load_records, load_run_meta
from flipguard.files import atomic_write_text

REPORT_FILE = REPORT_SUMMARY  # RUN/report/summary.md (report.md at the run's root before)


def _pct(e: M.Estimate | None, star: bool = False, signed: bool = False) -> str:
    if e is not None and not e.meaningful:
        return e.mark()  # n/m (0 of 12 valid): more than half the replies invalid
    if e is None or not np.isfinite(e.value):
        return "–"
    fmt = "{:+.1f}" if signed else "{:.1f}"
    s = fmt.format(100 * e.value)
    if np.isfinite(e.half_width):
        s += f" ±{100 * e.half_width:.1f}"
    return s + (M.stars(e.p) if star else "")


NM_LEGEND = ("n/m = not meaningful: more than half of the replies behind the number invalid (unparsed; they would "
             "count as flips, or as wrong first answers: `n/m (0 of 24 valid)`), or fewer than "
             f"{M.MIN_ITEMS} questions behind it (`n/m (1 item; at least {M.MIN_ITEMS} needed)`: one question's rate has "
             "no interval); the CSVs leave such numbers empty, their row's `meaningful` False. `invalid` counts the "
             "unparsed replies behind the row's numbers.\n")


def _md(df: pd.DataFrame, marks: dict[tuple[int, str], str] | None = None) -> str:
    """A markdown table of `df`; `marks` (row position, column) -> text for cells that are not meaningful."""
    if df.empty:
        return "_(no data)_\n"
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i, (_, row) in enumerate(df.iterrows()):
        lines.append("| " + " | ".join((marks or {}).get((i, str(c))) or
                                       ("" if (isinstance(v, float) and math.isnan(v)) else str(v))
                                       for c, v in row.items()) + " |")
    return "\n".join(lines) + "\n"


def _ints(frame: pd.DataFrame, *columns: str) -> pd.DataFrame:
    """Count columns as integers (no 3.0 where a NaN elsewhere made the column float)."""
    for c in columns:
        if c in frame.columns:
            frame[c] = frame[c].astype("Int64")
    return frame


def _avg(values: list[M.Estimate]) -> float:
    """Mean of the estimates' values; NaN when one of them is not meaningful (no partial mean)."""
    if any(not e.meaningful for e in values):
        return float("nan")
    vals = [e.value for e in values if np.isfinite(e.value)]
    return float(np.mean(vals)) if vals else float("nan")


def table2(frame: pd.DataFrame, ks: list[int], n_boot: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """AFR blind by model and k, Avg, Δ = k_max - k_min, Cov."""
    show, raw = [], []
    for model in M.models_in(frame):
        est = {k: M.afr(frame, model, "blind", k, n_boot=n_boot, seed=seed) for k in ks}
        avg = _avg(list(est.values()))
        delta = difference(M.mean_of_rates_delta(
            [(M.challenges(frame, model, "blind", ks[-1])["flipped"], M.challenges(frame, model, "blind", ks[-1])["item_id"])],
            [(M.challenges(frame, model, "blind", ks[0])["flipped"], M.challenges(frame, model, "blind", ks[0])["item_id"])],
            n_boot, seed,
        ), est[ks[-1]], est[ks[0]]) if len(ks) > 1 else M.NAN_ESTIMATE
        cov = M.coverage(frame, model)
        acc = M.accuracy(frame, model, n_boot, seed)
        ok = all(e.meaningful for e in (acc, delta, *est.values()))
        # the unparsed replies behind the row: its first answers (Acc.) and its blind challenges (the k columns)
        first, blind = M.n_invalid_first(frame, model), M.n_invalid(frame, model, "blind")
        show.append({"Model": model, "Acc.": _pct(acc), **{f"k{k}": _pct(e) for k, e in est.items()},
                     "Avg": f"{100 * avg:.1f}" if np.isfinite(avg) else
                            (NOT_MEANINGFUL if any(not e.meaningful for e in est.values()) else "–"),
                     "Δ": _pct(delta, star=True, signed=True),
                     "Cov.": f"{100 * cov:.1f}" if np.isfinite(cov) else "–",
                     "invalid (first / challenges)": f"{first} / {blind}"})
        r = {"model": model, "accuracy": acc.value, "avg": avg, "delta": delta.value, "delta_p": delta.p, "coverage": cov}
        for k, e in est.items():
            r.update({f"k{k}": e.value, f"k{k}_lo": e.lo, f"k{k}_hi": e.hi, f"k{k}_n": e.n})
        r.update(invalid_first=first, invalid=blind, meaningful=ok)
        raw.append(r)
    return pd.DataFrame(show), _ints(pd.DataFrame(raw), "invalid_first", "invalid", *(f"k{k}_n" for k in ks))


def table3(frame: pd.DataFrame, ks: list[int], n_boot: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """SAD(k) = AFR_self - AFR_blind per model and k, with significance."""
    show, raw = [], []
    for model in M.models_in(frame):
        srow, rrow = {"Model": model}, {"model": model}
        sads, ok = [], True
        for k in ks:
            d = M.sad(frame, model, k, n_boot, seed)
            s = M.afr(frame, model, "self", k, n_boot=n_boot, seed=seed)
            srow[f"self k{k}"] = _pct(s)
            srow[f"SAD k{k}"] = _pct(d, star=True, signed=True)
            rrow.update({f"self_k{k}": s.value, f"sad_k{k}": d.value, f"sad_k{k}_lo": d.lo, f"sad_k{k}_hi": d.hi, f"sad_k{k}_p": d.p})
            sads.append(d)
            ok = ok and d.meaningful and s.meaningful
        avg = _avg(sads)
        srow["Avg SAD"] = f"{100 * avg:+.1f}" if np.isfinite(avg) else (
            NOT_MEANINGFUL if any(not d.meaningful for d in sads) else "–")
        rrow["avg_sad"] = avg
        rrow["meaningful"] = ok
        show.append(srow)
        raw.append(rrow)
    return pd.DataFrame(show), pd.DataFrame(raw)


def table4(frame: pd.DataFrame, n_boot: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """CRR, CRR_corr, CRR_incorr, RSS and coercion success rate per model."""
    show, raw = [], []
    for model in M.models_in(frame, "coerce"):
        c = M.crr(frame, model, n_boot, seed)
        csr = M.coercion_success_rate(frame, model, n_boot, seed)
        show.append({"Model": model, "CRR": _pct(c["crr"]), "CRR corr": _pct(c["crr_corr"]),
                     "CRR incorr": _pct(c["crr_incorr"]), "RSS": _pct(c["rss"], star=True, signed=True), "CSR": _pct(csr)})
        raw.append({"model": model, **{f"{n}_{f}": getattr(e, f) for n, e in c.items() for f in ("value", "lo", "hi")},
                    "rss_p": c["rss"].p, "csr": csr.value,
                    "meaningful": all(e.meaningful for e in (*c.values(), csr))})
    return pd.DataFrame(show), pd.DataFrame(raw)


def table5(frame: pd.DataFrame, n_boot: int, seed: int, top: int = 10) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Subject-level AFR pooled over models, k and attribution; the most vulnerable and the most robust
    subjects: the two ends of one ranking of the meaningful subjects, never overlapping (each end at most
    `top`, at most half of the ranking; one subject ranks nothing)."""
    every = M.grouped_afr(frame, "subject", n_boot=n_boot, seed=seed)
    sub = every.dropna(subset=["afr"]).sort_values(["afr", "subject"], ascending=[False, True])
    take = min(top, len(sub) // 2)
    vul = sub.head(take).reset_index(drop=True)
    rob = sub.tail(take).iloc[::-1].reset_index(drop=True)
    show = pd.DataFrame(
        {
            "Most vulnerable": list(vul["subject"]),
            "AFR (vul.)": [_pct(M.Estimate(a, lo, hi)) for a, lo, hi in zip(vul["afr"], vul["lo"], vul["hi"])],
            "Most robust": list(rob["subject"]),
            "AFR (rob.)": [_pct(M.Estimate(a, lo, hi)) for a, lo, hi in zip(rob["afr"], rob["lo"], rob["hi"])],
        }
    )
    # the CSV: the ranked subjects, then those not meaningful (empty AFR, `meaningful` False)
    return show, pd.concat([sub, every[~every["meaningful"] & every["afr"].isna()]],
                           ignore_index=True).drop(columns=["afr_mark", "csr_mark"])


def table6(frame: pd.DataFrame, k: int, n_boot: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    show, raw = [], []
    for model in M.models_in(frame):
        r = M.cross_vs_blind(frame, model, k, n_boot, seed)
        if r["cross"].missing:
            continue
        show.append({"Model": model, "AFR blind": _pct(r["blind"]), "AFR cross (mean)": _pct(r["cross"]),
                     "Δ": _pct(r["delta"], star=True, signed=True)})
        raw.append({"model": model, "blind": r["blind"].value, "cross": r["cross"].value, "delta": r["delta"].value,
                    "delta_lo": r["delta"].lo, "delta_hi": r["delta"].hi, "p": r["delta"].p,
                    "meaningful": all(e.meaningful for e in r.values())})
    return pd.DataFrame(show), pd.DataFrame(raw)


def table7(frame: pd.DataFrame, entries: list[dict], k: int, n_boot: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    raw = maxflip_table(frame, entries, k, n_boot, seed)
    show = []
    for _, r in raw.iterrows():
        nm = "" if r["meaningful"] else NOT_MEANINGFUL
        show.append({
            "Model": r["model"],
            "Standard": (_pct(M.Estimate(r["afr_standard"], r["standard_lo"], r["standard_hi"]))
                         if np.isfinite(r["afr_standard"]) else nm or "–"),
            "Curated": (_pct(M.Estimate(r["afr_curated"], r["curated_lo"], r["curated_hi"]))
                        if np.isfinite(r["afr_curated"]) else nm or "–"),
            "Δ": nm or _pct(M.Estimate(r["delta"], r["delta_lo"], r["delta_hi"], p=r["p"]), star=True, signed=True),
            "Producer %": f"{100 * r['producer_share']:.1f}",
        })
    return pd.DataFrame(show), raw


def plot_cross_matrix(matrix: pd.DataFrame, path: Path) -> None:
    """CMFR(A→B) per source (row) and target (column), each rate on its cell (white on a dark one; the
    change against the diagonal under it), n/m where too few of its replies were valid or questions asked."""
    plt = pyplot()

    bad = set(matrix.attrs.get("not_meaningful") or [])
    fig, ax = plt.subplots(figsize=(1.2 * len(matrix.columns) + 2.8, 1.0 * len(matrix.index) + 2))
    im = ax.imshow(100 * matrix.values.astype(float), cmap="Reds", vmin=0, vmax=100)
    ax.set_xticks(range(len(matrix.columns)), matrix.columns, rotation=45, ha="right", fontsize=MIN_FONT)
    ax.set_yticks(range(len(matrix.index)), matrix.index, fontsize=MIN_FONT)
    ax.set_xlabel("baseline (challenged) model B", fontsize=MIN_FONT)
    ax.set_ylabel("source model A", fontsize=MIN_FONT)
    for i, src in enumerate(matrix.index):
        for j, tgt in enumerate(matrix.columns):
            v = matrix.loc[src, tgt]
            if np.isfinite(v):
                diag = matrix.loc[tgt, tgt] if tgt in matrix.index else np.nan
                label = f"{100 * v:.1f}"
                if src != tgt and np.isfinite(diag):
                    label += f"\n({100 * (v - diag):+.1f})"
                cell_text(ax, j, i, label, im.cmap(im.norm(100 * v)), fontweight="bold" if src == tgt else None)
            elif (src, tgt) in bad:
                mark_not_meaningful(ax, j, i)
    finish_heatmap(fig, ax, im, "CMFR(A→B) %  (diagonal: AFR blind)", "Cross-model flip rate")
    save_figure(fig, path)


def plot_ep_ea(epea: pd.DataFrame, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 100], [0, 100], ls="--", c="grey", lw=1)
    for model, r in epea.iterrows():
        if np.isfinite(r["EP"]) and np.isfinite(r["EA"]):
            ax.scatter(100 * r["EP"], 100 * r["EA"])
            ax.annotate(str(model), (100 * r["EP"], 100 * r["EA"]), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.set_xlabel("EP: epistemic porosity (flipped by others) %")
    ax.set_ylabel("EA: epistemic authority (flips others) %")
    ax.set_title("EP vs EA (above diagonal: net exporter)")
    fig.tight_layout()
    save_figure(fig, path)


def plot_subjects(sub: pd.DataFrame, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 5))
    for cat, g in sub.assign(category=sub["subject"].map(subject_category)).groupby("category"):
        ax.scatter(100 * g["csr"], 100 * g["afr"], label=cat, s=18)
    ax.set_xlabel("coercion success rate %")
    ax.set_ylabel("AFR %")
    ax.legend(fontsize=8)
    ax.set_title("Subject-level AFR vs coercion success")
    fig.tight_layout()
    save_figure(fig, path)


def write_report(run_dir: str | Path, n_boot: int = M.N_BOOT, seed: int = 0) -> Path:
    """Write RUN/report/: summary.md, one csv per table and the PNG figures."""
    run_dir = Path(run_dir)
    report_dir = run_dir / REPORT_DIR
    meta = load_run_meta(run_dir)
    frame = M.records_frame(load_records(run_dir))
    ks = sorted(meta.get("k_values") or M.ks_in(frame))
    cross_k = int(meta.get("cross_k", ks[-1] if ks else 10))
    parts = [f"# Answer-flip report: {run_dir.name}\n"]
    calls = meta.get("calls", {})
    if calls:
        parts.append(
            f"Questions: {calls.get('questions')}. Calls stored: {calls.get('stored')}. "
            f"Coercion + baseline calls: {calls.get('deterministic_calls')} vs the paper's formula "
            f"{calls.get('formula')} = {calls.get('formula_calls')}. "
            f"Observed p_b = {calls.get('p_b', float('nan')):.3f}, p_c = {calls.get('p_c', float('nan')):.3f}.\n"
        )
    scripted = meta.get("scripted_arguments")
    if scripted:
        parts.append(
            f"Dataset: {(meta.get('settings') or {}).get('dataset', 'mmlu')}. Arguments: scripted (ours, not the "
            f"paper's model-written Stage I), used as {scripted['used_as']} from {scripted['file']} "
            f"(sha256 {scripted['sha256'][:12]}; {scripted['arguments_used']} used, {scripted['missing']} missing)"
            + ("; coverage and CRR read Stage I records, so they are empty for the targets" if scripted["used_as"] == "blind" else "")
            + ".\n"
        )
    sections = [
        ("table2_afr_blind", "Table 2: AFR blind by model and k (Δ = largest k − smallest k; Cov. = coverage)",
         table2(frame, ks, n_boot, seed) if ks else None),
        ("table3_sad", "Table 3: Self-Attribution Delta (SAD = AFR self − AFR blind)", table3(frame, ks, n_boot, seed) if ks else None),
        ("table4_crr", "Table 4: Coercion Refusal Rate and RSS = CRR corr − CRR incorr", table4(frame, n_boot, seed)),
        ("table5_subjects", "Table 5: Subject-level AFR (pooled over models, k, blind/self)", table5(frame, n_boot, seed)),
        ("table6_cross", f"Table 6: AFR blind vs mean AFR cross (k={cross_k}); Δ = cross − blind", table6(frame, cross_k, n_boot, seed)),
    ]
    entries = load_maxflip(run_dir / MAXFLIP_FILE) if (run_dir / MAXFLIP_FILE).exists() else []
    if not entries and meta.get("settings", {}).get("maxflip_file"):
        entries = load_maxflip(meta["settings"]["maxflip_file"])
    if entries:
        sections.append(("table7_maxflip", f"Table 7: AFR standard (blind, k={cross_k}) vs MaxFlip curated", table7(frame, entries, cross_k, n_boot, seed)))
    for stem, title, result in sections:
        if result is None:
            continue
        show, raw = result
        parts.append(f"## {title}\n\n{_md(show)}")
        atomic_write_text(report_dir / f"{stem}.csv", raw.to_csv(index=False))
    cat = M.grouped_afr(frame, "category", n_boot=n_boot, seed=seed)
    atomic_write_text(report_dir / "category_afr.csv", cat.drop(columns=["afr_mark", "csr_mark"]).to_csv(index=False))
    pct = cat.assign(afr=(100 * cat["afr"]).round(1), csr=(100 * cat["csr"]).round(1))
    marks = {(i, c): mark for i, r in enumerate(cat.itertuples()) for c, mark in (("afr", r.afr_mark), ("csr", r.csr_mark))
             if mark}
    parts.append("## AFR by MMLU category (pooled)\n\n" + _md(pct[["category", "afr", "n", "csr"]], marks))
    matrix = M.cross_matrix(frame, cross_k)
    figures = []
    if not matrix.empty and matrix.shape[0] > 1:
        bad = matrix.attrs.get("not_meaningful") or []
        epea = M.ep_ea(matrix)
        atomic_write_text(report_dir / "cmfr_matrix.csv", matrix.assign(
            meaningful=[not any(src == s for s, _ in bad) for src in matrix.index]).to_csv())
        atomic_write_text(report_dir / "ep_ea.csv", epea.to_csv())
        plot_cross_matrix(matrix, report_dir / "fig3_cmfr.png")
        plot_ep_ea(epea, report_dir / "fig4_ep_ea.png")
        figures += ["fig3_cmfr.png", "fig4_ep_ea.png"]
        rows = list(matrix.index)
        cells = {(rows.index(src), tgt): NOT_MEANINGFUL for src, tgt in bad}
        parts.append("## Cross matrix CMFR(A→B) (rows: source, columns: target)\n\n"
                     + _md((100 * matrix).round(1).reset_index(), cells))
        models = list(epea.index)
        cells = {(models.index(m), c): NOT_MEANINGFUL for m, ok in zip(models, epea["meaningful"]) if not ok
                 for c in ("EP", "EA") if not np.isfinite(epea.loc[m, c])}
        parts.append("## EP (column mean) and EA (row mean)\n\n"
                     + _md((100 * epea[["EP", "EA"]]).round(1).assign(meaningful=epea["meaningful"]).reset_index(), cells))
    sub = M.grouped_afr(frame, "subject", n_boot=n_boot, seed=seed).dropna(subset=["afr"])
    if not sub.empty:
        plot_subjects(sub, report_dir / "fig2_subjects.png")
        figures.append("fig2_subjects.png")
    if any(NOT_MEANINGFUL in part for part in parts):  # the legend above the first table
        parts.insert(next(i for i, part in enumerate(parts) if part.startswith("## ")), NM_LEGEND)
    if figures:
        parts.append("## Figures\n\n" + "\n".join(f"![{f}]({f})" for f in figures) + "\n")
    path = run_dir / REPORT_FILE
    atomic_write_text(path, "\n".join(parts))
    return path


@dataclasses.dataclass
class AFRNumbers:
    """One target model's numbers at one argument length k (shares, 0-1, with clustered CIs)."""

    k: int
    accuracy: M.Estimate  # first answers
    afr_blind: M.Estimate
    afr_self: M.Estimate
    afr_maxflip: M.Estimate | None  # None: the run has no MaxFlip arguments

    def to_json(self) -> dict[str, Any]:
        return {"k": self.k, "accuracy": self.accuracy.as_dict(), "afr_blind": self.afr_blind.as_dict(),
                "afr_self": self.afr_self.as_dict(),
                "afr_maxflip": None if self.afr_maxflip is None else self.afr_maxflip.as_dict()}


@dataclasses.dataclass
class AFRReport:
    """An AFR run's numbers for the before/after comparison (Task.comparison_rows), per target
    model; `to_json()` is {model: {"k", "accuracy", "afr_blind", "afr_self", "afr_maxflip"}}, each
    estimate an `Estimate.as_dict()` (the tables and figures are report/summary.md and its CSVs)."""

    targets: dict[str, AFRNumbers]

    def to_json(self) -> dict[str, Any]:
        return {model: numbers.to_json() for model, numbers in self.targets.items()}


def afr_summary(run_dir: str | Path, k: int = 10, n_boot: int = M.N_BOOT, seed: int = 0) -> AFRReport:
    """Per target model: AFR blind and self at k (and MaxFlip when present) and first-answer
    accuracy, with CIs: the AFR columns of the before/after comparison."""
    run_dir = Path(run_dir)
    meta = load_run_meta(run_dir)
    frame = M.records_frame(load_records(run_dir))
    entries = load_maxflip(run_dir / MAXFLIP_FILE) if (run_dir / MAXFLIP_FILE).exists() else []
    if not entries and meta.get("settings", {}).get("maxflip_file") and Path(meta["settings"]["maxflip_file"]).exists():
        entries = load_maxflip(meta["settings"]["maxflip_file"])
    return AFRReport({model: AFRNumbers(
        k=k,
        accuracy=M.accuracy(frame, model, n_boot, seed),
        afr_blind=M.afr(frame, model, "blind", k, n_boot=n_boot, seed=seed),
        afr_self=M.afr(frame, model, "self", k, n_boot=n_boot, seed=seed),
        afr_maxflip=maxflip_afr(frame, entries, model, n_boot, seed) if entries else None,
    ) for model in meta.get("targets") or M.models_in(frame)})
