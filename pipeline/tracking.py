"""A study's results in wandb: the `wandb` stage, when the recipe's report_to names wandb.

The run is started by train/utils.start_wandb, as the trainers' runs are, so it lands in the
recipe's project and group (`tracking:`) beside them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd

from flipguard.config import TrackingArguments, public_recipe
from flipguard.train.utils import start_wandb


def log_study_to_wandb(tracking: TrackingArguments, recipe_path: str, raw: dict[str, Any], out: Path,
                       conditions: dict[str, Path], flip_sample: int, variant: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-dataset DDS table of every condition, comparison table, before/after plots and
    `flip_sample` of the baseline's flip records; returns what wandb_run.json records. A recipe
    grid's variant (its values) is a run of its own, named and configured by them, in the same group."""
    import wandb

    name = f"{tracking.tracking_run_name or Path(recipe_path).stem}-study"
    config = {"recipe": public_recipe(raw), "recipe_path": recipe_path}
    if variant:
        name += "-" + ",".join(f"{k}={v}" for k, v in variant.items())
        config["grid_variant"] = variant
    run = start_wandb(tracking, name, config, os.environ.get("WANDB_DIR") or str(out), job_type="study")
    try:
        frames = []
        for cond, run_dir in conditions.items():
            summary = pd.read_csv(Path(run_dir) / "report" / "summary.csv")
            frames.append(summary.assign(condition=cond))
        dds = pd.concat(frames, ignore_index=True)
        comparison = pd.read_csv(out / "compare" / "comparison.csv")
        logged: dict[str, Any] = {"dds_by_dataset": wandb.Table(dataframe=dds),
                                  "comparison": wandb.Table(dataframe=comparison)}
        for png in ("before_after.png", "dds_heatmap.png"):
            path = out / "compare" / png
            if path.is_file():
                logged[png[:-4]] = wandb.Image(str(path))
        flips_csv = Path(conditions["Baseline"]) / "report" / "flips.csv"
        if flips_csv.is_file():
            # the baseline's C1/C2 pair records, flipped pairs first, then the rest, each in random order
            pairs = pd.read_csv(flips_csv).sample(frac=1.0, random_state=0)
            pairs = pd.concat([pairs[pairs["flip"].notna()], pairs[pairs["flip"].isna()]])
            logged["flip_sample"] = wandb.Table(dataframe=pairs.head(flip_sample))
            logged["flipped_pairs"] = int(pairs["flip"].notna().sum())
        run.log(logged)
        info = {"name": run.name, "id": run.id, "project": tracking.tracking_project, "group": run.group,
                "dir": str(run.dir), "logged": sorted(logged)}
    finally:
        run.finish()
    return info
