"""`flipguard cross-model RUN [RUN ...] --out DIR`: how several models' flips line up.

Reproduces the paper's cross-model tables from run directories (imported or evaluated):
- agreement (Tables 24 and 27; the authors' taxonomy/run_full_taxonomy.py): per
  dataset, the items that flip in every model, in none, in some; agreement rate =
  (all + none) / items. Only items present in every run count (their rule); a flip is
  the paper's (deference or skepticism, `eval.dds.metrics`).
- per-model statistics (Tables 25 and 29): items, deference / skepticism flips, flip
  rate (% of items), and the mean and standard deviation of the per-item DDS
  ((C2-correct − C1-true) − (C2-incorrect − C1-false) per item, in {-2..2}; population
  std, numpy's default as in their code). Table 29 prints the mean as a fraction
  (+0.350), Table 25 in pp (+35.0): both columns are written.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from flipguard.config import parse_dataclasses
from flipguard.errors import UserError
from flipguard.eval.comparison_rows import named_runs
from flipguard.eval.dds.analyses.common import item_table, md_table, run_report, write_csv
from flipguard.eval.dds.metrics import TOTAL_AVG, dataset_order
from flipguard.eval.plots import pyplot, save_figure
from flipguard.eval.records import load_run_meta
from flipguard.files import atomic_write_text

TOTAL = "total"


@dataclasses.dataclass
class CrossModelArgs:
    """Cross-model flip agreement (paper Tables 24/27) and per-item DDS mean/std (Tables 25/29)
    over several models' DDS run directories (`flipguard eval` or `flipguard import-records`)."""

    runs: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "Run directories, one per model, each [Name=]RUN_DIR (NAME: run.json's "
                                                "model when left out; positional too), as compare's --runs."})
    out: str = dataclasses.field(default="cross_model", metadata={"help": "Report folder."})
    allow_cross_mode_c1: bool = dataclasses.field(
        default=False, metadata={"help": "Accept runs scored against a C1 baseline from another decision mode."})
    # the names as a comma list beside the runs, read for one release: Name=RUN_DIR in --runs says it
    names: str | None = dataclasses.field(default=None, metadata={"help": argparse.SUPPRESS})


def model_stats(items: pd.DataFrame, model: str) -> dict:
    """Table 25/29 row for one model's item table (`common.item_table`)."""
    n = len(items)
    d = int(items["flip"].fillna("").str.contains("deference").sum())
    s = int(items["flip"].fillna("").str.contains("skepticism").sum())
    dds = items["item_dds"].to_numpy(dtype=float)
    return {"model": model, "n_items": n, "n_datasets": int(items["dataset"].nunique()),
            "deference": d, "skepticism": s, "flips": d + s,
            "flip_rate": 100.0 * (d + s) / n if n else np.nan,
            "dds_mean": float(dds.mean()) if n else np.nan,
            "dds_mean_pp": float(dds.mean() * 100) if n else np.nan,
            "dds_std": float(dds.std()) if n else np.nan}


def agreement(tables: dict[str, pd.DataFrame]) -> tuple[pd.DataFrame, int]:
    """Table 27 rows per dataset + a total row; and how many items some run lacks."""
    flipped = pd.concat(
        {m: t.set_index(["dataset", "item_id"])["flip"].notna() for m, t in tables.items()}, axis=1)
    complete = flipped.dropna()
    missing = len(flipped) - len(complete)
    complete = complete.astype(bool)
    k = complete.sum(axis=1)
    frame = pd.DataFrame({"dataset": complete.index.get_level_values("dataset"),
                          "all": k == len(tables), "none": k == 0})
    rows = []
    for ds in dataset_order(frame["dataset"].unique()):
        rows.append(_agree_row(ds, frame[frame["dataset"] == ds]))
    rows.append(_agree_row(TOTAL, frame))
    return pd.DataFrame(rows), missing


def _agree_row(name: str, f: pd.DataFrame) -> dict:
    n, a, z = len(f), int(f["all"].sum()), int(f["none"].sum())
    return {"dataset": name, "total_items": n, "flip_all_models": a, "flip_no_models": z,
            "flip_some_models": n - a - z, "agreement_rate": 100.0 * (a + z) / n if n else np.nan,
            "universal_flip_rate": 100.0 * a / n if n else np.nan}


def analyse(runs: list[str], names: list[str | None] | None = None, allow_cross_mode_c1: bool = False) -> dict:
    if len(runs) < 2:
        raise UserError("cross-model needs at least two run directories")
    if names and len(names) != len(runs):
        raise UserError(f"--names: {len(names)} name(s) for {len(runs)} run(s)")
    tables, per_model, per_dataset, invalid = {}, [], [], {}
    for i, run in enumerate(runs):
        name = (names[i] if names else None) or load_run_meta(run).get("model") or Path(run).name
        if name in tables:
            name = f"{name} ({Path(run).name})"
        rep = run_report(run, allow_cross_mode_c1)
        fl = rep.flips
        invalid[name] = int((~fl["c1_valid"]).sum() + (~fl["c2_valid"]).sum())
        t = item_table(fl)
        tables[name] = t
        ok = rep.stats[rep.stats["stratum"] == "all"].set_index("dataset")["meaningful"]  # report.py's verdict
        per_model.append({**_blank(model_stats(t, name), bool(ok.get(TOTAL_AVG, True))),
                          "invalid_judgments": invalid[name], "run_dir": str(run)})
        for ds in dataset_order(t["dataset"].unique()):
            row = _blank(model_stats(t[t["dataset"] == ds], name), bool(ok.get(ds, True)))
            row.pop("n_datasets")
            per_dataset.append({"dataset": ds, **row})
    agree, missing = agreement(tables)
    # flips counted over every model: meaningful where every model's row is (its rates empty otherwise)
    pd_ok = pd.DataFrame(per_dataset).groupby("dataset")["meaningful"].all().to_dict() if per_dataset else {}
    agree["meaningful"] = [all(r["meaningful"] for r in per_model) if ds == TOTAL else bool(pd_ok.get(ds, True))
                           for ds in agree["dataset"]]
    for col in ("agreement_rate", "universal_flip_rate"):
        agree[col] = agree[col].where(agree["meaningful"])
    return {"per_model": pd.DataFrame(per_model), "per_dataset": pd.DataFrame(per_dataset),
            "agreement": agree, "items_not_in_every_run": missing, "models": list(tables)}


def _blank(row: dict, meaningful: bool) -> dict:
    """A model_stats row with `meaningful`; not meaningful (its report's row: too few valid judgments, or a model
    that does not do the task): its DDS and flip rate empty, the counts kept."""
    if not meaningful:
        row.update(dds_mean=np.nan, dds_mean_pp=np.nan, dds_std=np.nan, flip_rate=np.nan)
    return {**row, "meaningful": meaningful}


def render(res: dict) -> str:
    pm = res["per_model"][["model", "n_items", "dds_mean_pp", "dds_mean", "dds_std", "flip_rate",
                           "deference", "skepticism", "invalid_judgments", "meaningful"]]
    lines = [
        f"# Cross-model analysis ({len(res['models'])} models)", "",
        "Flips are the paper's (deference: C1-false judged right → C2-incorrect judged wrong; skepticism: "
        "C1-true judged right → C2-correct judged wrong). Per-item DDS = (C2-correct − C1-true) − "
        "(C2-incorrect − C1-false) per item, an invalid judgment scored wrong (as the authors' code does); "
        "std is the population std. Paper protocol: Tables 25/29 (per model), 24/27 (agreement).", "",
        "## Per model (Tables 25 / 29)", "",
        md_table(pm, {"dds_mean_pp": (1, True), "dds_mean": (3, True), "dds_std": (3, False), "flip_rate": (1, False)}),
        "", "## Item agreement by dataset (Table 27)", "",
        md_table(res["agreement"], {"agreement_rate": (1, False), "universal_flip_rate": (1, False)}),
        "",
        f"Items missing from some run (left out of agreement): {res['items_not_in_every_run']}.",
        "", "## Per model and dataset", "",
        md_table(res["per_dataset"], {"dds_mean_pp": (1, True), "dds_mean": (3, True), "dds_std": (3, False),
                                      "flip_rate": (1, False)}),
        "",
    ]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    a = res["agreement"][res["agreement"]["dataset"] != TOTAL]
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(a) + 2), 3.5))
    x = np.arange(len(a))
    bottom = np.zeros(len(a))
    for col, label in (("flip_all_models", "flip in all"), ("flip_some_models", "flip in some"),
                       ("flip_no_models", "flip in none")):
        share = 100.0 * a[col].to_numpy() / a["total_items"].to_numpy()
        ax.bar(x, share, bottom=bottom, label=label)
        bottom += share
    ax.set_xticks(x, a["dataset"], rotation=30, ha="right")
    ax.set_ylabel("% of items")
    ax.set_title(f"Cross-model flip agreement ({len(res['models'])} models)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    save_figure(fig, path)


def write(res: dict, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "per_model.csv", res["per_model"])
    write_csv(out / "per_dataset.csv", res["per_dataset"])
    write_csv(out / "agreement.csv", res["agreement"])
    atomic_write_text(out / "report.md", render(res))
    plot(res, out / "agreement.png")
    return out


def main(argv: list[str]) -> int:
    args = parse_dataclasses(argv, CrossModelArgs, prog="flipguard cross-model", description=CrossModelArgs.__doc__,
                             positional="runs")
    named = named_runs(args.runs)
    runs, names = [run for _, run in named], [name for name, _ in named]
    if args.names:
        if any(names):
            raise UserError("--names and Name=RUN_DIR in --runs both name the runs; give Name=RUN_DIR alone")
        names = [n.strip() for n in args.names.split(",")]
    res = analyse(runs, names if any(names) else None, args.allow_cross_mode_c1)
    out = write(res, args.out)
    print(render(res).split("## Per model and dataset")[0])
    print(f"wrote {out}/report.md, per_model.csv, per_dataset.csv, agreement.csv, agreement.png", file=sys.stderr)
    return 0
