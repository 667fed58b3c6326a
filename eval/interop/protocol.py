"""The imported runs' tasks: `inspect` (inspect_ai eval logs) and `lm-eval` (lm-evaluation-harness
--log_samples output). They are registered like the built-in protocols, so the comparison and the page
read their runs through the same Task hooks (comparison_rows, transfer_units), but they are never run:
`flipguard import` writes their run folders (eval/interop/importer.py).

A run folder holds one or more systems (each imported run under its label); a record is one sample
(one epoch of it, or one lm-eval filter), its scores mapped to 0-1 in extra["scores"]. Every score is
a metric: its numbers are the mean over the task's samples with a 95% bootstrap CI (the epochs of one
sample resampled together), its units the per-sample values, keyed by sample (and epoch) and carrying
the sample's signature (task version, prompt, target hashes) so that the comparison pairs only runs
of the same items.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from flipguard.eval import bootstrap as B
from flipguard.eval.estimate import Estimate, is_meaningful, not_meaningful
from flipguard.eval.records import load_records
from flipguard.eval.task import Task, register_task

IMPORTED_MODE = "imported"


class ImportedTask(Task):
    """A tool's runs read in: compared and viewed, never run."""

    runnable = False
    tool: ClassVar[str]  # the tool's name, as run.json records it
    comparison_note = ("Imported runs: the mean of each score over the task's samples (%), with a 95% bootstrap CI "
                       "over samples (a sample's epochs resampled together). Scores are mapped to 0-1 on import "
                       "(docs/interop.md); the changes, paired sample by sample: Paired tests.")

    @classmethod
    def transfer_units(cls, run_dir: Path) -> list[dict[str, Any]]:
        """One unit per sample (epoch) and score: framing and metric = the score's name, key = the sample
        (and epoch), cluster = the sample, value = its 0-1 score (NaN where the tool gave none), match =
        the sample's signature."""
        units = []
        for r in load_records(run_dir):
            if r.protocol != cls.name:
                continue
            e = r.extra or {}
            for metric, value in (e.get("scores") or {}).items():
                units.append({"system": cls.system_of(r), "dataset": r.dataset, "kind": "", "framing": metric,
                              "metric": metric, "key": str(e.get("unit", r.item_id)), "cluster": r.item_id,
                              "value": math.nan if value is None else float(value), "match": e.get("signature")})
        return units

    @classmethod
    def comparison_rows(cls, run_dir: Path) -> list[dict[str, Any]]:
        """Per system, task and score: the mean over samples with its 95% CI (samples as clusters)."""
        groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
        for u in cls.transfer_units(run_dir):
            groups[(u["system"], u["dataset"], u["metric"])].append(u)
        rows = []
        for (system, dataset, metric), every in groups.items():
            units = [u for u in every if not math.isnan(u["value"])]
            if not is_meaningful(len(units), len(every)):  # most samples unscored (errors): no mean to show
                rows.append({"system": system, "dataset": dataset, "metric": metric,
                             "estimate": not_meaningful(len(every), len(units))})
                continue
            values = np.array([u["value"] for u in units])
            clusters = [u["cluster"] for u in units]
            lo, hi = B.interval([values], B.ratio, seed=B.rng_for(0, f"{system}|{dataset}|{metric}"), clusters=clusters)
            rows.append({"system": system, "dataset": dataset, "metric": metric,
                         "estimate": Estimate(float(values.mean()), float(lo), float(hi), len(values), "share",
                                              n_clusters=len(set(clusters)))})
        return rows


@register_task("inspect")
class InspectRun(ImportedTask):
    """Samples of inspect_ai eval logs (`flipguard import inspect LOG...`)."""

    tool = "inspect_ai"
    comparison_title = "inspect_ai runs (imported)"


@register_task("lm-eval")
class LmEvalRun(ImportedTask):
    """Samples of lm-evaluation-harness --log_samples output (`flipguard import lm-eval DIR...`)."""

    tool = "lm-eval"
    comparison_title = "lm-evaluation-harness runs (imported)"
