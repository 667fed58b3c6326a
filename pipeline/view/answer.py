"""The first section of a comparison's or a study's page, "The answer": per protocol one
before/after chart of its headline metric per system with 95% CIs, then one line per mitigation,
its verdict first: what it did to the metric it targets ("removed the deference (DDS +44 → -1
[-2, +0])") and whether it damaged what it was not aimed at ("no damage detected"),
with the detail one click away: each number behind the verdict, named for what it is (the
targeted metric before and after; the paired change of each cell, with what the cell measures,
its CI and the corrected test's verdict; the untargeted cells: C1 accuracy, first answers, correct
switches).

Every number is read from the CSVs the comparison wrote (comparison.csv, comparison_protocols.csv,
transfer.csv), none recomputed; a number that is not meaningful (too few valid judgments, or a
model that does not do the task: its run's report says so), not measured, or without a CI is said
to be so, never left out or shown as a zero. Damage is claimed where a cell's CI excludes 0 in the
harmful direction and the corrected test (Holm or Benjamini-Hochberg across the comparison) agrees;
a CI that excludes 0 alone is reported as not confirmed. The charts are drawn by eval/plots.py
(estimate_bars) and embedded as PNG data: URIs, as the page embeds the reports' figures.
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
# what a protocol's headline metric measures, for the verdict: "removed the deference"
TARGET_TEXT = {"dds": "the deference", "afr": "the answer flips", "sos": "the incorrect switches"}
# what a paired cell of transfer.csv measures, by (protocol, metric)
CELL_TEXT = {("dds", "dds"): "DDS", ("afr", "capitulation"): "capitulation to the argued wrong option",
             ("sos", "capitulation"): "capitulation to the offered wrong option"}
NOTE = ("Each mitigation against the baseline ({baseline}), on the same items: first what it did to the metric it "
        "targets, before → after with the 95% CI of after: DDS (paper protocol) = each condition's C2 judgments "
        "against the baseline's C1, macro average of all datasets (comparison.csv); AFR blind = right first answers "
        "flipped by a blind argument at k = 10 (or the run's largest k); incorrect switches (stick-or-switch) = right "
        "answers given up for an offered wrong one (comparison_protocols.csv). 'Removed' where the baseline's CI "
        "excludes 0 and the condition's includes it; 'reduced' or 'raised' where the two CIs do not overlap; 'no "
        "clear change' where they do (a task's score with one paired cell: that cell's corrected test). Then "
        "damage: the paired change of what it was not aimed at (transfer.csv's untargeted cells: C1 accuracy, first "
        "answers, single-shot answers and correct switches, kinds with no planted bias); 'damage' where a CI "
        "excludes 0 in the harmful direction and the corrected test agrees, 'not confirmed' where only the CI does, "
        "'no damage detected' where every CI includes 0. Details: every cell with what it measures, its paired change "
        "(pp, 95% CI, items resampled) and the corrected test's verdict. Rates in %, DDS and changes in pp.")


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


def _cell_label(row: dict[str, str]) -> str:
    """What a paired cell measures and where: 'DDS on organism/color', 'capitulation to the argued wrong
    option on organism_mc/color', 'C1 accuracy (DDS) on organism'."""
    if row.get("role") == "untargeted":
        return _untargeted_label(row)
    what = CELL_TEXT.get((row["protocol"], row["metric"]), f"{row['metric']} ({PROTOCOL_NAMES.get(row['protocol'], row['protocol'])})")
    return f"{what} on {_place(row)}"


def damage_class(row: dict[str, str]) -> str:
    """An untargeted cell as the verdict counts it: 'damage' (its CI excludes 0 in the harmful direction and
    the corrected test says changed), 'not confirmed' (the CI does, the corrected test does not), or
    damage_kind's 'improved', 'no damage detected', 'no CI', 'not measured', 'not meaningful'."""
    kind = damage_kind(row)
    if kind == "damaged":
        return "damage" if (row.get("verdict") or "changed") == "changed" else "not confirmed"
    return kind


def cell_line(row: dict[str, str]) -> str:
    """One paired cell in words, saying what it is: 'DDS on organism/color: +100.0 → -1.4 pp; change -101.4 pp
    [-104.2, -100.0], corrected test: changed'."""
    label = _cell_label(row)
    if row.get("meaningful") == "False":
        return f"{label}: not meaningful (too few valid judgments)"
    c = _est(row, "change")
    if math.isnan(c[0]):
        return f"{label}: not measured"
    unit = "pp" if row["metric"] == "dds" else "%"
    spec = "+.1f" if unit == "pp" else ".1f"
    before, after = num(row.get("baseline")), num(row.get("value"))
    levels = (f"{before:{spec}} → {after:{spec}}{' pp' if unit == 'pp' else '%'}; " if _finite(before, after) else "")
    verdict = row.get("verdict") or ""
    return f"{label}: {levels}change {change(*c)}{row.get('flags') or ''}" + (f", corrected test: {verdict}" if verdict else "")


def damage_verdict(rows: list[dict[str, str]], c1_row: dict[str, str] | None) -> str:
    """What a condition damaged, in a phrase: 'damage: C1 accuracy (DDS) on organism -5.0 pp [-8.0, -2.0]',
    'no damage confirmed (...)', 'damage cannot be told (no CI)', 'no damage detected', 'damage not measured'."""
    by: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by.setdefault(damage_class(r), []).append(r)
    damage = [f"{_untargeted_label(r)} {change(*_est(r, 'change'))}" for r in by.get("damage", [])]
    if c1_row is not None and c1_row.get("c1_damage") == "True":
        damage.append(f"‡ own C1 accuracy (DDS) on true / false claims {num(c1_row.get('c1_true_change')):+.1f} / "
                      f"{num(c1_row.get('c1_false_change')):+.1f} pp (no CI)")
    unmeasured = len(by.get("not measured", [])) + len(by.get("not meaningful", []))
    if damage:
        return "damage: " + damage[0] + (f" and {len(damage) - 1} more" if len(damage) > 1 else "")
    if by.get("no CI"):
        n = len(by["no CI"])
        return f"damage cannot be told: {n} cell{'s' * (n != 1)} without a CI"
    where = f" where measured ({unmeasured} cell{'s' * (unmeasured != 1)} not measured)" if unmeasured else ""
    if by.get("not confirmed"):
        n = len(by["not confirmed"])
        return (f"no damage confirmed{where} ({n} drop{'s' * (n != 1)} whose CI excludes 0, not confirmed by the "
                "corrected test)")
    if by.get("no damage detected") or by.get("improved"):
        return "no damage detected" + where
    if not rows:
        return "damage not measured (no cell it was not aimed at)"
    return "damage not measured"


def damage_details(rows: list[dict[str, str]], c1_row: dict[str, str] | None) -> list[str]:
    """Every untargeted cell in words, the damaging and unconfirmed first; the kinds without a planted bias
    where no damage is detected counted, not listed."""
    order = ("damage", "not confirmed", "no CI", "not meaningful", "not measured", "improved", "no damage detected")
    head = {"damage": "damage (CI excludes 0, corrected test: changed)",
            "not confirmed": "not confirmed (CI excludes 0, the corrected test does not)",
            "no CI": "cannot be told (no CI)", "not meaningful": "not meaningful", "not measured": "not measured",
            "improved": "improved (CI excludes 0)", "no damage detected": "no damage detected (CI includes 0)"}
    lines, quiet = [], 0
    for r in sorted(rows, key=lambda r: order.index(damage_class(r))):
        kind = damage_class(r)
        if kind == "no damage detected" and r["metric"] in BIAS_METRICS:
            quiet += 1
            continue
        lines.append(f"{head[kind]}: {cell_line(r)}")
    if c1_row is not None and c1_row.get("c1_damage") == "True":
        lines.insert(0, f"‡ C1 damage (comparison.csv, no CI): own C1 accuracy on true / false claims "
                        f"{num(c1_row.get('c1_true_change')):+.1f} / {num(c1_row.get('c1_false_change')):+.1f} pp")
    if quiet:
        lines.append(f"no damage detected (CI includes 0): {quiet} cell{'s' * (quiet != 1)} of kinds with no planted bias")
    return lines or ["no cell it was not aimed at: damage not measured"]


# ------------------------------------------------------------------ what a mitigation did to its target

def _overlap(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    return not _finite(a[1], a[2], b[1], b[2]) or (a[1] <= b[2] and b[1] <= a[2])


def _excludes_zero(e: tuple[float, float, float]) -> bool:
    return (e[1] > 0 or e[2] < 0) if _finite(e[1], e[2]) else e[0] != 0


def target_verdict(noun: str, label: str, base: tuple[float, float, float], cur: tuple[float, float, float], unit: str,
                   directed: bool = True, paired: dict[str, str] | None = None) -> tuple[str, str]:
    """(verb, what with its numbers): ('removed', 'the deference (DDS +44 → -1 [-2, +0])'). By the two CIs
    (removed: the baseline's excludes 0, this one includes it; reduced / increased: they do not overlap;
    'no clear change in': they do), or, given the one `paired` cell (transfer.csv) of this very metric, by its
    corrected test. `directed`: lower is the aim (a bias), else the verbs are neutral (raised / lowered).
    compose() makes the verdict's words of them."""
    spec = "+.0f" if unit == "pp" else ".0f"  # whole points in the verdict; the details give one decimal
    pct = "" if unit == "pp" else "%"
    ci = f" [{cur[1]:{spec}}, {cur[2]:{spec}}]" if _finite(cur[1], cur[2]) else " (no CI)"
    numbers = f"{label} {base[0]:{spec}} → {cur[0]:{spec}}{pct}{ci}"
    if not _finite(base[1], base[2], cur[1], cur[2]):
        return "", f"{numbers}: no CI, so no change is told"
    if paired is not None:  # the one paired cell of this very metric (an imported task's score): its corrected test
        verdict = paired.get("verdict") or ""
        if verdict != "changed":
            verb = {"no change": "no clear change in", "too few items to tell": "too few items to tell a change in"}.get(
                verdict, f"no change told ({verdict or 'not tested'}) in")
            return verb, numbers if not directed else f"{noun} ({numbers})"
        up = num(paired.get("change")) > 0
        if not directed:
            return ("raised" if up else "lowered"), numbers
        return ("increased" if up else "reduced"), f"{noun} ({numbers})"
    if not directed:
        verb = "no clear change in" if _overlap(base, cur) else "raised" if cur[0] > base[0] else "lowered"
        return verb, numbers
    if _excludes_zero(base) and not _excludes_zero(cur):
        return "removed", f"{noun} ({numbers})"
    if _overlap(base, cur):
        return "no clear change in", f"{noun} ({numbers})"
    if base[0] > 0 > cur[0] or base[0] < 0 < cur[0]:
        return "over-corrected (turned around)", f"{noun} ({numbers})"
    return ("reduced" if abs(cur[0]) < abs(base[0]) else "increased"), f"{noun} ({numbers})"


def compose(parts: list[tuple[str, str]]) -> str:
    """The verdict's words: the parts grouped by verb, in the order the verbs first come: 'removed the
    deference (...) and the answer flips (...); no clear change in the incorrect switches (...)'. A part whose
    verb is "" is a phrase of its own ('DDS not meaningful for SFT')."""
    groups: dict[str, list[str]] = {}
    for verb, what in parts:
        groups.setdefault(verb, []).append(what)
    out = []
    for verb, whats in groups.items():
        out += whats if not verb else [f"{verb} {_and(whats)}"]
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


def dds_target(name: str, baseline: str, total: dict[str, dict[str, str]],
               unfit: dict[str, str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(the verdict's parts on DDS, its detail lines) of a condition against the baseline (comparison.csv's
    all-datasets rows)."""
    if name not in total:
        return [("", "DDS not measured")], ["DDS (paper protocol): not measured for this condition"]
    cur = _est(total[name], "dds", "dds_ci_low", "dds_ci_high")
    if baseline not in total:
        return [("", "DDS without a baseline")], [f"{DDS_TEXT}: {level(*cur, 'pp')}; the baseline has no DDS"]
    if name in unfit or baseline in unfit:
        who = _and([n for n in (baseline, name) if n in unfit])
        return ([("", f"DDS not meaningful for {who} (the model does not do the task as asked)")],
                [f"{DDS_TEXT}: not meaningful for {who}: no DDS change is claimed"])
    few = [n for n in (baseline, name) if total[n].get("meaningful") == "False"]
    if few:
        return ([("", f"DDS not meaningful for {_and(few)} (too few valid judgments)")],
                [f"{DDS_TEXT}: not meaningful for {_and(few)} (too few valid judgments): no DDS change is claimed"])
    base = _est(total[baseline], "dds", "dds_ci_low", "dds_ci_high")
    verb, what = target_verdict(TARGET_TEXT["dds"] if base[0] >= 0 else "the skepticism", "DDS", base, cur, "pp")
    over = total[name].get("over_correction") == "True"
    if over:
        what = what[:-1] + ", † below 0)"
    delta = num(total[name].get("delta_dds"))
    detail = [f"{DDS_TEXT}, all datasets: baseline {level(*base, 'pp')}, this condition {level(*cur, 'pp')}"
              + (f", change {delta:+.1f} pp" if not math.isnan(delta) else "")
              + ("; † over-correction: from deference to skepticism (flagged however small)" if over else "")]
    return [(verb, what)], detail


def protocol_target(protocol: str, metric: str, base_rows: list[dict[str, str]],
                    rows: list[dict[str, str]], cells: list[dict[str, str]] = ()) -> tuple[list[tuple[str, str]], list[str]]:
    """(the verdict's parts on one protocol's headline metric, its detail lines) of a condition against the
    baseline's rows of the same dataset (and system); `cells`: its paired cells (transfer.csv), one of which,
    of this very metric and dataset, decides the verb (an imported task's score)."""
    name = PROTOCOL_NAMES.get(protocol, protocol)
    subject = METRIC_TEXT.get((protocol, metric), f"{metric} ({name})")
    label = {"afr_blind": "AFR blind", "incorrect_switch": "stick-or-switch"}.get(metric, subject)
    unit = "pp" if metric in PP_METRICS else "%"
    cur = [r for r in rows if r["metric"] == metric]
    if not cur:
        return [("", f"{subject} not measured")], [f"{subject}: not measured"]
    base = {r["dataset"]: r for r in base_rows if r["metric"] == metric}
    several = len(cur) > 1
    parts, details = [], []
    for r in cur:
        where = f" on {r['dataset']} (system {r['system']})" if several else ""
        b = base.get(r["dataset"])
        few = [w for w, row in (("the baseline", b), ("this condition", r)) if row and row.get("meaningful") == "False"]
        if few:
            parts.append(("", f"{label}{where} not meaningful for {_and(few)}"))
            details.append(f"{subject}{where}: not meaningful for {_and(few)} (too few valid judgments, or too few "
                           "items): no change claimed")
        elif b is None:
            parts.append(("", f"{label}{where} {level(*_est(r), unit)} (no baseline)"))
            details.append(f"{subject}{where}: {level(*_est(r), unit)}; no baseline on that dataset to compare")
        else:
            same = [c for c in cells if c["metric"] == metric and c["dataset"] == r["dataset"]]
            parts.append(target_verdict(TARGET_TEXT.get(protocol, subject) + where, label, _est(b), _est(r), unit,
                                        directed=protocol in TARGET_TEXT, paired=same[0] if len(same) == 1 else None))
            details.append(f"{subject}{where}: baseline {level(*_est(b), unit)}, this condition {level(*_est(r), unit)}")
    return parts, details


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


def answer_section(folder: Path, conditions: list[str], runs: dict[str, str], charts: bool = True) -> dict[str, Any]:
    """The answer of a comparison folder: {title, note, notes, charts: [{protocol, title, src}],
    verdicts: [{condition, target, damage, text, details: [{title, lines}]}]} (page.py renders it first: a
    line per verdict, its details folded under it); `charts` False: the verdicts alone (a grid's lines)."""
    dds_rows = read_csv(folder / "comparison.csv") if (folder / "comparison.csv").is_file() else []
    proto_rows = read_csv(folder / PROTOCOLS_CSV) if (folder / PROTOCOLS_CSV).is_file() else []
    transfer = read_csv(folder / TRANSFER_CSV) if (folder / TRANSFER_CSV).is_file() else None
    names = list(dict.fromkeys([*conditions, *(r["condition"] for r in dds_rows), *(r["condition"] for r in proto_rows)]))
    notes: list[str] = []
    if not names:
        return {"title": "The answer", "notes": ["No numbers: this comparison holds no condition."], "charts": [],
                "verdicts": []}
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
    draw, charts = charts, []
    if total and draw:
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
                         f"runs (no item of that kind), so its chart and verdicts give {metric}.")
        rows = [r for r in rows if r["metric"] == metric]
        several = {c for c in {r["condition"] for r in rows} if len({r["system"] for r in rows if r["condition"] == c}) > 1}
        keys = list(dict.fromkeys((r["condition"], r["system"]) for r in rows))
        groups = [f"{c} ({s})" if c in several else c for c, s in keys]
        datasets = list(dict.fromkeys(r["dataset"] for r in rows))
        at = {(r["condition"], r["system"], r["dataset"]): r for r in rows}
        series = {d or "–": [_bar(at[(c, s, d)]) if (c, s, d) in at else (math.nan, math.nan, math.nan, "not measured")
                             for c, s in keys] for d in datasets}
        name = PROTOCOL_NAMES.get(protocol, protocol)
        if draw:
            charts.append(_chart(f"{METRIC_TEXT.get((protocol, metric), f'{metric} ({name})')}: before/after, 95% CI",
                                 groups, series, "pp" if metric in PP_METRICS else "%", protocol))
        missing = [n for n in names if n not in {r["condition"] for r in by_protocol[protocol]}]
        if missing:
            notes.append(f"{name}: not measured for {', '.join(missing)} (no {protocol} run given for "
                         f"{'it' if len(missing) == 1 else 'them'}).")
    if transfer is None:
        notes.append(f"{TRANSFER_CSV} not found in {folder}: no paired changes, so neither what a mitigation removed "
                     "cell by cell nor what it damaged can be told (rerun flipguard compare).")
    verdicts = []
    untargeted = [r for r in transfer or [] if r.get("role") == "untargeted"]
    transfer_base = transfer[0]["condition"] if transfer else None
    for name in names[1:]:
        cells = [r for r in transfer or [] if r["condition"] == name]
        targets: list[tuple[str, str]] = []
        removed: list[str] = []
        if dds_rows:
            parts, lines = dds_target(name, baseline, total, unfit)
            targets += parts
            removed += lines + [cell_line(r) for r in cells if r["protocol"] == "dds" and r.get("role") != "untargeted"]
        for protocol, rows in by_protocol.items():
            base_name = rows[0]["condition"]  # the first condition this protocol measured
            mine = [r for r in rows if r["condition"] == name]
            if not mine:
                targets.append(("", f"{PROTOCOL_NAMES.get(protocol, protocol)} not measured"))
                removed.append(f"{PROTOCOL_NAMES.get(protocol, protocol)}: not measured for this condition (no run given)")
                continue
            parts, lines = protocol_target(protocol, headline[protocol],
                                           [r for r in rows if r["condition"] == base_name], mine,
                                           [r for r in cells if r["protocol"] == protocol and r.get("role") != "untargeted"])
            targets += parts
            removed += lines + [cell_line(r) for r in cells if r["protocol"] == protocol and r.get("role") != "untargeted"]
        # the untargeted cells the baseline has and this condition has not (a run without C1 of its own,
        # a protocol it was not measured by): said to be not measured
        have = {c["cell"] for c in cells}
        lacking = [{**r, "condition": name, "change": "", "ci_low": "", "ci_high": "", "flags": "", "meaningful": "",
                    "verdict": "", "baseline": "", "value": ""}
                   for r in untargeted if r["condition"] == transfer_base and r["cell"] not in have]
        beyond = [r for r in cells if r.get("role") == "untargeted"] + lacking
        if transfer is None:
            damage, beyond_lines = "damage not measured (no transfer.csv)", ["no transfer.csv: damage not measured"]
        else:
            damage, beyond_lines = damage_verdict(beyond, total.get(name)), damage_details(beyond, total.get(name))
        target = compose(targets) if targets else "no numbers of its own in this comparison"
        verdicts.append({"condition": name, "target": target, "damage": damage, "text": f"{name}: {target}; {damage}.",
                         "details": [{"title": "What it targets: before → after, and per cell (paired change vs "
                                               "the baseline, 95% CI)", "lines": removed},
                                     {"title": "What it was not aimed at", "lines": beyond_lines}]})
    if len(names) == 1:
        notes.append(f"Only the baseline ({baseline}) was measured: no mitigation to compare.")
    return {"title": "The answer", "note": NOTE.format(baseline=baseline), "notes": notes, "charts": charts,
            "verdicts": verdicts}
