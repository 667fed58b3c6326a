"""Shared by the analyses: a run's per-item table, and writing a report folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from flipguard.eval.backends.openai_api import BACKEND_ARGS_HELP
from flipguard.eval.dds.metrics import dds_from_accuracies
from flipguard.eval.dds.prompts import TEMPLATE_VERSIONS
from flipguard.eval.dds.protocol import EvalArgs
from flipguard.eval.dds.report import DDSReport, _csv, _fmt, report_run
from flipguard.eval.estimate import NOT_MEANINGFUL
from flipguard.eval.runner import DEFAULT_MIN_LABEL_MASS
from flipguard.files import atomic_write_text
from flipguard.runtime.threads import THREADS_HELP

ITEM_COLUMNS = ("dataset", "item_id", "c1_true", "c1_false", "c2_correct", "c2_incorrect", "flip", "item_dds")


@dataclasses.dataclass(kw_only=True)
class JudgedModelArgs:
    """How the analyses that run DDS evaluations reach and decode the judged model: the
    same options as `flipguard eval`, declared once for every analysis."""

    backend: str = dataclasses.field(default="hf", metadata={"help": "hf | vllm | openai"})
    backend_args: str = dataclasses.field(default="{}", metadata={"help": BACKEND_ARGS_HELP})
    mode: str = dataclasses.field(default="generate", metadata={"help": "generate (paper's JSON reply) | logprob"})
    template: str = dataclasses.field(default="v0-released", metadata={"help": f"Prompt version: {', '.join(TEMPLATE_VERSIONS)}"})
    max_new_tokens: int = dataclasses.field(default=300, metadata={"help": "generate mode: reply length limit."})
    temperature: float = dataclasses.field(default=0.0, metadata={"help": "generate mode: 0 = greedy."})
    batch_size: int = dataclasses.field(default=8, metadata={"help": "hf backend batch size."})
    device: str | None = dataclasses.field(default=None, metadata={"help": "hf backend device."})
    min_label_mass: float = dataclasses.field(default=DEFAULT_MIN_LABEL_MASS, metadata={"help": "logprob mode, as flipguard eval."})
    n_boot: int = dataclasses.field(default=2000, metadata={"help": "Bootstrap replicates for CIs (0 = none)."})
    threads: int | None = dataclasses.field(default=None, metadata={"help": THREADS_HELP})

    def eval_args(self, **fields):
        """`flipguard eval`'s arguments for one run of the judged model (no per-run report:
        the analysis writes its own)."""
        return EvalArgs(backend=self.backend, mode=self.mode, template=self.template,
                        max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                        batch_size=self.batch_size, device=self.device, backend_args=self.backend_args,
                        min_label_mass=self.min_label_mass, threads=self.threads, report=False, **fields)


def run_report(run_dir: str | Path, allow_cross_mode_c1: bool = False) -> DDSReport:
    """The DDS report of a run (its --c1_from baseline as recorded in run.json), without
    the bootstrap: the analyses need its per-item flips, not CIs."""
    return report_run(run_dir, n_boot=0, allow_cross_mode_c1=allow_cross_mode_c1)


def item_table(flips: pd.DataFrame) -> pd.DataFrame:
    """One row per item from a report's flips frame: the four cases' 0/1 correctness
    (invalid = 0, as the authors' analyzer scores "" != "1"), `flip` (the paper's
    deference/skepticism, or None) and the per-item DDS of taxonomy/run_full_taxonomy.py:
    (C2-correct − C1-true) − (C2-incorrect − C1-false), in {-2, ..., 2}."""
    wide = {}
    for pair, (c1, c2) in {"correct": ("c1_true", "c2_correct"), "incorrect": ("c1_false", "c2_incorrect")}.items():
        sub = flips[flips["pair"] == pair].set_index(["dataset", "item_id"])
        wide[c1] = sub["c1_correct"].astype(int)
        wide[c2] = sub["c2_correct"].astype(int)
        wide[f"flip_{pair}"] = sub["flip"]
    t = pd.DataFrame(wide)
    # an item has at most one paper flip: deference needs C1-false right and skepticism
    # C1-true right, and both can happen in one item only as two flips; keep both named
    t["flip"] = [("+".join(f for f in (a, b) if isinstance(f, str)) or None)
                 for a, b in zip(t["flip_incorrect"], t["flip_correct"])]
    X = t[["c1_true", "c1_false", "c2_correct", "c2_incorrect"]].to_numpy(dtype=float)
    t["item_dds"] = dds_from_accuracies(X)[:, 0] if len(X) else np.array([])
    return t.reset_index()[list(ITEM_COLUMNS)]


def fmt(x: Any, nd: int = 1, signed: bool = False) -> str:
    """As the DDS report formats numbers (eval.dds.report), counts with thousands separators."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return f"{int(x):,}"
    return "–" if x is None or x is pd.NA else _fmt(x, signed, nd)


def md_table(df: pd.DataFrame, formats: Mapping[str, tuple[int, bool]] | None = None,
             meaningful: Sequence[bool] | None = None) -> str:
    """A markdown table; `formats` maps column -> (decimals, signed). A row not `meaningful` (default: the
    frame's `meaningful` column) shows its empty numbers as n/m (not meaningful), never as '–'."""
    formats = formats or {}
    if meaningful is None:
        meaningful = df["meaningful"].tolist() if "meaningful" in df.columns else [True] * len(df)
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    rows = []
    for (_, r), ok in zip(df.iterrows(), meaningful):
        cells = []
        for c in df.columns:
            v = r[c]
            if not ok and (v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v))):
                cells.append(NOT_MEANINGFUL)
            elif c in formats:
                cells.append(fmt(v, *formats[c]))
            elif isinstance(v, (float, np.integer)) or v is None or v is pd.NA:
                cells.append(fmt(v))
            else:
                cells.append(str(v))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *rows])


def write_csv(path: Path, df: pd.DataFrame) -> None:
    atomic_write_text(path, _csv(df))
