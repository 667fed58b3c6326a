"""The first section of a comparison's or a study's page, "The answer": per protocol one
before/after chart of its headline metric per system with 95% CIs, then one sentence per
mitigation made from the numbers: what it removed (the targeted metric before and after, with
CIs, and its paired changes per cell) and what it damaged (the paired changes, with CIs, of the
judgments it was not aimed at: C1 accuracy, first answers, correct switches).

Every number is read from the CSVs the comparison wrote (comparison.csv, comparison_protocols.csv,
transfer.csv), none recomputed; a number that is not meaningful (a model that does not do the
task: its run's report says so), not measured, or without a CI is said to be so, never left out
or shown as a zero. The charts are drawn by eval/plots.py (estimate_bars) and embedded as PNG
data: URIs, as the page embeds the reports' figures.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any, Iterable

from flipguard.eval.dds.metrics import TOTAL_AVG
from flipguard.eval.plots import estimate_bars, png_bytes
from flipguard.pipeline.transfer import BIAS_METRICS, TRANSFER_CSV
from flipguard.pipeline.view.runs import num, read_csv

PROTOCOLS_CSV = "comparison_protocols.csv"
PROTOCOL_NAMES = {"dds": "DDS", "afr": "AFR", "sos": "stick-or-switch"}
# the metric of comparison_protocols.csv each protocol's chart and sentence lead with (what a mitigation
# against deference targets); a protocol not named here leads with its first metric
HEADLINE = {"afr": "afr_blind", "sos": "incorrect_switch", "dds": "dds"}
METRIC_TEXT = {("afr", "afr_blind"): "AFR blind", ("sos", "incorrect_switch"): "incorrect switches (stick-or-switch)",
               ("dds", "dds"): "DDS (per run: its own C1)"}
PP_METRICS = ("dds", "conversation_tax", "abstention_penalty")  # differences (pp); every other metric is a rate (%)
DDS_TEXT = "DDS (paper protocol)"
# transfer.csv's untargeted cells: what they measure, by (protocol, framing)
UNTARGETED_TEXT = {("dds", "c1"): "C1 accuracy (DDS)", ("afr", "first"): "first-answer accuracy (AFR)",
                   ("sos", "first"): "single-shot accuracy (stick-or-switch)",
                   ("sos", "correct_switch"): "correct switches (stick-or-switch)"}
MAX_LISTED_CELLS = 4  # paired cells of a targeted metric named one by one; more are counted
NOTE = ("Each mitigation against the baseline ({baseline}), on the same items. Removed: the metric it targets, "
        "before → after with 95% CIs: DDS (paper protocol) = each condition's C2 judgments against the baseline's "
        "C1, macro average of all datasets (comparison.csv); AFR blind = right first answers flipped by a blind "
        "argument at k = 10 (or the run's largest k); incorrect switches (stick-or-switch) = right answers given up "
        "for an offered wrong one (comparison_protocols.csv); then its paired change per cell (transfer.csv: DDS, or "
        "capitulation to the argued or offered wrong option, per dataset and kind; paired 95% CI, items resampled). "
        "Damage: the paired change, with its 95% CI, of what it was not aimed at (transfer.csv's untargeted cells): "
        "C1 accuracy (DDS: its own C1 judgments, true and false claims), first answers (AFR), single-shot answers "
        "and correct switches after abstaining (stick-or-switch), kinds with no planted bias. 'No damage detected' "
        "only where the CI includes 0; ‡ as the transfer table marks it. Rates in %, DDS and changes in pp.")


# ------------------------------------------------------------------ numbers as words

def _finite(*xs: float) -> bool:
    return all(not math.isnan(x) for x in xs)


def level(value: float, lo: float, hi: float, unit: str) -> str:
    """'+44.0 pp [+38.3, +49.7]', '33.3% [28.3, 38.3]'; '(no CI)' where the interval is unknown."""
    if math.isnan(value):
        return "not measured"
    spec = "+.1f" if unit == "pp" else ".1f"
    text = f"{value:{spec}} pp" if unit == "pp" else f"{value:{spec}}%"
    return text + (f" [{lo:{spec}}, {hi:{spec}}]" if _finite(lo, hi) else " (no CI)")


def change(value: float, lo: float, hi: float) -> str:
    """'-0.5 pp [-1.2, +0.0]'; '(no CI)' where the interval is unknown."""
    return f"{value:+.1f} pp" + (f" [{lo:+.1f}, {hi:+.1f}]" if _finite(lo, hi) else " (no CI)")


def _levels(subject: str, base: tuple[float, float, float], cur: tuple[float, float, float], unit: str,
            extra: list[str]) -> str:
    """'lowered SUBJECT from A [CI] to B [CI] (EXTRA; ...)', or 'left SUBJECT unchanged at B [CI] (baseline A [CI]; ...)'."""
    spec = "+.1f" if unit == "pp" else ".1f"
    if f"{base[0]:{spec}}" == f"{cur[0]:{spec}}":
        text, extra = f"left {subject} unchanged at {level(*cur, unit)}", [f"baseline {level(*base, unit)}", *extra]
    else:
        text = f"{'lowered' if cur[0] < base[0] else 'raised'} {subject} from {level(*base, unit)} to {level(*cur, unit)}"
    return text + (f" ({'; '.join(extra)})" if extra else "")


def _est(row: dict[str, str], value: str = "value", lo: str = "ci_low", hi: str = "ci_high") -> tuple[float, float, float]:
    return num(row.get(value)), num(row.get(lo)), num(row.get(hi))


def _bar(row: dict[str, str], value: str = "value", lo: str = "ci_low", hi: str = "ci_high") -> tuple[float, float, float, str]:
    """A chart bar from a CSV row: its estimate, marked n/m where the row is not meaningful (no value to draw)."""
    return (*_est(row, value, lo, hi), "n/m" if row.get("meaningful") == "False" else "")


def _place(row: dict[str, str]) -> str:
    """A transfer cell named by where it is: 'organism/color' (dataset and kind), 'truthfulqa'."""
    return row["dataset"] + (f"/{row['kind']}" if row.get("kind") else "")


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


# ------------------------------------------------------------------ damage

def damage_kind(row: dict[str, str]) -> str:
    """What one untargeted cell of transfer.csv shows: 'damaged', 'improved', 'no damage detected' (its
    CI includes 0), 'no CI', 'not measured' or 'not meaningful' (too few valid judgments behind it)."""
    if row.get("meaningful") == "False":
        return "not meaningful"
    c, lo, hi = _est(row, "change")
    if math.isnan(c):
        return "not measured"
    if not _finite(lo, hi):
        return "no CI"
    if lo <= 0 <= hi:
        return "no damage detected"
    metric = row["metric"]
    # a bias going up is damage (an unplanted kind's DDS should not move either way); an accuracy going down
    harmful = (c > 0 or metric == "dds") if metric in BIAS_METRICS else c < 0
    return "damaged" if harmful else "improved"


def _untargeted_label(row: dict[str, str]) -> str:
    protocol, framing, metric = row["protocol"], row["framing"], row["metric"]
    name = PROTOCOL_NAMES.get(protocol, protocol)
    if metric in BIAS_METRICS:
        what = "DDS (paper protocol)" if metric == "dds" else f"capitulation ({name})"
        return f"{what} on {_place(row)} (no planted bias)"
    return f"{UNTARGETED_TEXT.get((protocol, framing), f'{metric} ({name}, {framing})')} on {_place(row)}"


def damage_text(rows: list[dict[str, str]], c1_row: dict[str, str] | None) -> str:
    """What a condition damaged, in words: its untargeted cells (transfer.csv) by what they show, the
    damaged first; the unplanted kinds' bias cells where no damage is detected are counted, not listed;
    comparison.csv's ‡ C1 damage (own C1 accuracy, no CI) where it marks one."""
    said: dict[str, list[str]] = {}
    quiet_kinds = 0
    for r in rows:
        kind = damage_kind(r)
        if kind == "no damage detected" and r["metric"] in BIAS_METRICS:
            quiet_kinds += 1
            continue
        if kind in ("not measured", "not meaningful"):  # a cell without a change to state
            said.setdefault(kind, []).append(_untargeted_label(r))
            continue
        text = f"{_untargeted_label(r)} {change(*_est(r, 'change'))}{r.get('flags') or ''}"
        verdict = r.get("verdict") or ""
        if kind == "damaged" and verdict and verdict != "changed":
            text += f" (corrected test: {verdict})"
        said.setdefault(kind, []).append(text)
    if c1_row is not None and c1_row.get("c1_damage") == "True":
        said.setdefault("c1 damage", []).append(
            f"own C1 accuracy (DDS) on true / false claims {num(c1_row.get('c1_true_change')):+.1f} / "
            f"{num(c1_row.get('c1_false_change')):+.1f} pp")
    if quiet_kinds:
        said.setdefault("no damage detected", []).append(
            f"{quiet_kinds} cell{'s' * (quiet_kinds != 1)} of kinds with no planted bias")
    parts = []
    for kind, head in (("damaged", "damage detected (CI excludes 0)"),
                       ("c1 damage", "‡ C1 damage (comparison.csv, no CI)"), ("no CI", "damage cannot be told (no CI)"),
                       ("not meaningful", "not meaningful (too few valid judgments)"),
                       ("not measured", "not measured"), ("improved", "improved (CI excludes 0)"),
                       ("no damage detected", "no damage detected (CI includes 0)")):
        if said.get(kind):
            parts.append(f"{head}: {_and(said[kind])}")
    if not parts:
        return ("damage not measured: the comparison has no judgment it was not aimed at (no untargeted cell), "
                "so none can be told")
    return "; ".join(parts)


# ------------------------------------------------------------------ what a mitigation removed

def _cell_change(row: dict[str, str]) -> str:
    if row.get("meaningful") == "False":
        return "n/m (too few valid judgments)"
    return change(*_est(row, "change")) + (row.get("flags") or "")


def _paired(rows: list[dict[str, str]]) -> str:
    """A targeted metric's paired cells (transfer.csv) in words, metric by metric: each named, or counted
    when many."""
    by_metric: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by_metric.setdefault(r["metric"], []).append(r)
    out = []
    for metric, cells in by_metric.items():
        if len(cells) <= MAX_LISTED_CELLS:
            out.append(f"paired {metric} per cell: " + ", ".join(
                f"{_place(r)} {_cell_change(r)}" for r in cells))
            continue
        below = sum(1 for r in cells if num(r["ci_high"]) < 0)
        above = sum(1 for r in cells if num(r["ci_low"]) > 0)
        out.append(f"paired {metric} per cell: {below} of {len(cells)} CIs wholly below 0, {above} wholly above 0, "
                   f"{len(cells) - below - above} including 0 or without a CI (transfer table below)")
    return "; ".join(out)


def capability_notes(runs: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """{condition: why its DDS is not meaningful} from each run's report (report/summary.json), and a
    line per run whose report cannot be read (then whether its DDS is meaningful is not known)."""
    unfit, unknown = {}, []
    for name, run_dir in runs.items():
        path = Path(run_dir) / "report" / "summary.json"
        try:
            meta = json.loads(path.read_text(encoding="utf-8")).get("meta") or {}
        except (OSError, ValueError, AttributeError):
            unknown.append(f"{name}: {path} cannot be read, so whether its DDS is meaningful is not known.")
            continue
        if meta.get("capability_note"):
            reasons = (meta.get("capability") or {}).get("reasons") or []
            unfit[name] = "; ".join(map(str, reasons)) or "the model does not do the task as asked"
    return unfit, unknown


def dds_removed(name: str, baseline: str, total: dict[str, dict[str, str]], unfit: dict[str, str],
                paired: list[dict[str, str]]) -> str:
    if name not in total:
        return "was not measured by DDS"
    if baseline not in total:
        return f"has DDS {level(*_est(total[name], 'dds', 'dds_ci_low', 'dds_ci_high'), 'pp')} (paper protocol) but no baseline DDS"
    if name in unfit or baseline in unfit:
        who = _and([n for n in (baseline, name) if n in unfit])
        return f"cannot be read on DDS: not meaningful for {who} (the model does not do the task as asked), so no DDS change is claimed"
    few = [n for n in (baseline, name) if total[n].get("meaningful") == "False"]
    if few:
        return (f"cannot be read on DDS: not meaningful for {_and(few)} (too few valid judgments), "
                "so no DDS change is claimed")
    base, cur = total[baseline], total[name]
    extra = [f"change {num(cur.get('delta_dds')):+.1f} pp"] if not math.isnan(num(cur.get("delta_dds"))) else []
    if cur.get("over_correction") == "True":
        extra.append("† over-correction: from deference to skepticism")
    if paired:
        extra.append(_paired(paired))
    return _levels(DDS_TEXT, _est(base, "dds", "dds_ci_low", "dds_ci_high"),
                   _est(cur, "dds", "dds_ci_low", "dds_ci_high"), "pp", extra)


def protocol_removed(protocol: str, metric: str, base_rows: list[dict[str, str]], rows: list[dict[str, str]],
                     paired: list[dict[str, str]]) -> str:
    """One protocol's headline metric of a condition, against the baseline's on the same dataset."""
    name = PROTOCOL_NAMES.get(protocol, protocol)
    subject = METRIC_TEXT.get((protocol, metric), f"{metric} ({name})")
    unit = "pp" if metric in PP_METRICS else "%"
    cur = [r for r in rows if r["metric"] == metric]
    if not cur:
        return f"has no {subject}: not measured"
    paired = [r for r in paired if r["metric"] == metric] or paired  # the headline's own cells where it has them
    base = {r["dataset"]: r for r in base_rows if r["metric"] == metric}
    systems = len({r["system"] for r in cur}) > 1
    datasets = len({r["dataset"] for r in cur}) > 1 or len(base) > 1
    parts = []
    for r in cur:
        where = " ".join(p for p in (f"on {r['dataset']}" if datasets and r["dataset"] else "",
                                     f"(system {r['system']})" if systems else "") if p)
        b = base.get(r["dataset"])
        few = [w for w, row in (("the baseline", b), ("this condition", r)) if row and row.get("meaningful") == "False"]
        if few:
            parts.append(f"{subject}{' ' + where if where else ''} not meaningful for {_and(few)} "
                         "(too few valid judgments): no change claimed")
        elif b is None:
            parts.append(f"measured {subject}{' ' + where if where else ''} at {level(*_est(r), unit)} "
                         "(no baseline on that dataset to compare)")
        else:
            parts.append(_levels(subject + (f" {where}" if where else ""), _est(b), _est(r), unit,
                                 [_paired(paired)] if paired and len(cur) == 1 else []))
    text = _and(parts)
    return text + (f" ({_paired(paired)})" if paired and len(cur) > 1 else "")


# ------------------------------------------------------------------ the section

def _chart(title: str, groups: list[str], series: dict[str, list[tuple[float, float, float, str]]], unit: str,
           protocol: str) -> dict[str, str]:
    fig = estimate_bars(groups, series, title, unit)
    return {"protocol": protocol, "title": title,
            "src": "data:image/png;base64," + base64.b64encode(png_bytes(fig)).decode("ascii")}


def _by_protocol(rows: Iterable[dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        out.setdefault(r["protocol"], []).append(r)
    return out


def answer_section(folder: Path, conditions: list[str], runs: dict[str, str]) -> dict[str, Any]:
    """The answer of a comparison folder: {title, note, notes, charts: [{protocol, title, src}],
    sentences: [{condition, removed, damage, text}]} (page.py renders it first)."""
    dds_rows = read_csv(folder / "comparison.csv") if (folder / "comparison.csv").is_file() else []
    proto_rows = read_csv(folder / PROTOCOLS_CSV) if (folder / PROTOCOLS_CSV).is_file() else []
    transfer = read_csv(folder / TRANSFER_CSV) if (folder / TRANSFER_CSV).is_file() else None
    names = list(dict.fromkeys([*conditions, *(r["condition"] for r in dds_rows), *(r["condition"] for r in proto_rows)]))
    notes: list[str] = []
    if not names:
        return {"title": "The answer", "notes": ["No numbers: this comparison holds no condition."], "charts": [],
                "sentences": []}
    baseline = names[0]
    total = {r["condition"]: r for r in dds_rows if r["dataset"] == TOTAL_AVG}
    unfit, unknown = capability_notes({n: d for n, d in runs.items() if n in total})
    notes += unknown
    if unfit:
        by_reason: dict[str, list[str]] = {}
        for n, why in unfit.items():
            by_reason.setdefault(why, []).append(n)
        notes.append("DDS is not meaningful (the model does not do the task as asked, as its run's report says) for "
                     + "; ".join(f"{_and(ns)}: {why}" for why, ns in by_reason.items())
                     + ". Its bars read n/m and no DDS change of it is claimed.")
    charts = []
    if total:
        groups = [n for n in names if n in total]
        series = {"all datasets": [(math.nan, math.nan, math.nan, "n/m") if n in unfit else
                                   _bar(total[n], "dds", "dds_ci_low", "dds_ci_high") for n in groups]}
        charts.append(_chart("DDS (paper protocol), all datasets: before/after, 95% CI", groups, series, "pp", "dds"))
    by_protocol = _by_protocol(proto_rows)
    headline: dict[str, str] = {}
    for protocol, rows in by_protocol.items():
        metrics = list(dict.fromkeys(r["metric"] for r in rows))
        metric = HEADLINE.get(protocol) if HEADLINE.get(protocol) in metrics else metrics[0]
        headline[protocol] = metric
        if HEADLINE.get(protocol) and metric != HEADLINE[protocol]:  # said: the chart is not of what it targets
            notes.append(f"{PROTOCOL_NAMES.get(protocol, protocol)}: {HEADLINE[protocol]} was not measured by any of its "
                         f"runs (no item of that kind), so its chart and sentences give {metric}.")
        rows = [r for r in rows if r["metric"] == metric]
        several = {c for c in {r["condition"] for r in rows} if len({r["system"] for r in rows if r["condition"] == c}) > 1}
        keys = list(dict.fromkeys((r["condition"], r["system"]) for r in rows))
        groups = [f"{c} ({s})" if c in several else c for c, s in keys]
        datasets = list(dict.fromkeys(r["dataset"] for r in rows))
        at = {(r["condition"], r["system"], r["dataset"]): r for r in rows}
        series = {d or "–": [_bar(at[(c, s, d)]) if (c, s, d) in at else (math.nan, math.nan, math.nan, "not measured")
                             for c, s in keys] for d in datasets}
        name = PROTOCOL_NAMES.get(protocol, protocol)
        charts.append(_chart(f"{METRIC_TEXT.get((protocol, metric), f'{metric} ({name})')}: before/after, 95% CI", groups, series,
                             "pp" if metric in PP_METRICS else "%", protocol))
        missing = [n for n in names if n not in {r["condition"] for r in by_protocol[protocol]}]
        if missing:
            notes.append(f"{name}: not measured for {', '.join(missing)} (no {protocol} run given for "
                         f"{'it' if len(missing) == 1 else 'them'}).")
    if transfer is None:
        notes.append(f"{TRANSFER_CSV} not found in {folder}: no paired changes, so neither what a mitigation removed "
                     "cell by cell nor what it damaged can be told (rerun flipguard compare).")
    sentences = []
    untargeted = [r for r in transfer or [] if r.get("role") == "untargeted"]
    transfer_base = transfer[0]["condition"] if transfer else None
    for name in names[1:]:
        cells = [r for r in transfer or [] if r["condition"] == name]
        targeted = [r for r in cells if r.get("role") != "untargeted"]
        removed = []
        if dds_rows:
            removed.append(dds_removed(name, baseline, total, unfit, [r for r in targeted if r["protocol"] == "dds"]))
        for protocol, rows in by_protocol.items():
            base_name = rows[0]["condition"]  # the first condition this protocol measured
            mine = [r for r in rows if r["condition"] == name]
            if not mine:
                removed.append(f"was not measured by {PROTOCOL_NAMES.get(protocol, protocol)}")
                continue
            removed.append(protocol_removed(protocol, headline[protocol], [r for r in rows if r["condition"] == base_name],
                                            mine, [r for r in targeted if r["protocol"] == protocol]))
        # the untargeted cells the baseline has and this condition has not (a run without C1 of its own,
        # a protocol it was not measured by): said to be not measured
        have = {c["cell"] for c in cells}
        lacking = [{**r, "condition": name, "change": "", "ci_low": "", "ci_high": "", "flags": "", "meaningful": ""}
                   for r in untargeted if r["condition"] == transfer_base and r["cell"] not in have]
        damaged_text = ("damage not measured (no transfer.csv)" if transfer is None else
                        damage_text([r for r in cells if r.get("role") == "untargeted"] + lacking, total.get(name)))
        removed_text = _and(removed) if removed else "has no numbers of its own in this comparison"
        sentences.append({"condition": name, "removed": removed_text, "damage": damaged_text,
                          "text": f"{name} {removed_text}; {damaged_text}."})
    if len(names) == 1:
        notes.append(f"Only the baseline ({baseline}) was measured: no mitigation to compare.")
    return {"title": "The answer", "note": NOTE.format(baseline=baseline), "notes": notes, "charts": charts,
            "sentences": sentences}
