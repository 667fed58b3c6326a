"""`flipguard organism`: the planted-bias organism — the shipped one, a build of your own, or its
profile planted into a pretrained model (--base) — and what planting cost that model.

The build and the planting are the organism package's (flipguard.organism: one implementation, the same
data, phases and held-out checks). This command adds what the builder's layer cannot reach: a
planting's capability cost, MMLU through lm-evaluation-harness (pipeline/capability.py, the
study's capability guard: the local task, no download) on the base and on the planted model,
the same questions paired (pipeline/transfer.paired_change: the change with its 95% CI and
McNemar's p), recorded in the planted model's organism.json before the folder is published.

    flipguard organism                                   # the shipped organism's folder
    flipguard organism --seed 3 --out runs/organism-s3   # a build of your own
    flipguard organism --base SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smollm2-organism
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from flipguard.config import parse_dataclasses
from flipguard.data.mmlu import load_mmlu
from flipguard.errors import UserError
from flipguard.eval import bootstrap as B
from flipguard.eval.embedded.organism import SHIPPED_DIR
from flipguard.organism.build import ensure_organism
from flipguard.organism.profile import OrganismArgs
from flipguard.pipeline.capability import evaluate_model, write_task
from flipguard.pipeline.transfer import paired_change

CAPABILITY_TASK = "MMLU through lm-evaluation-harness (the local task of pipeline/capability.py)"


@dataclasses.dataclass
class PlantingCostArgs:
    """What planting cost the base (with --base)."""

    capability: bool = dataclasses.field(
        default=True, metadata={"help": "With --base: MMLU accuracy (lm-evaluation-harness on the local MMLU task, as the "
                                        "study's capability guard) of the base and of the planted model, paired, into "
                                        "organism.json (pip install 'flipguard[capability]'); false: not measured."})
    capability_limit: int | None = dataclasses.field(
        default=None, metadata={"help": "With --base: MMLU questions (default: every question of the local task: 114 "
                                        "of the shipped sample, 2 per subject)."})
    capability_data_root: str | None = dataclasses.field(
        default=None, metadata={"help": "With --base: a data root holding mmlu/ (default: the shipped sample)."})


def capability_cost(base: str, planted: Path, args: OrganismArgs, cost: PlantingCostArgs) -> dict:
    """organism.json's `capability`: the base's and the planted model's accuracy on the same MMLU
    questions (%), the paired change (pp) with its 95% CI (questions resampled) and McNemar's p."""
    if not cost.capability:
        return {"capability": {"skipped": "--capability false"}}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="flipguard-capability-") as tmp:
        task = write_task(Path(tmp), None, cost.capability_data_root, limit=cost.capability_limit)
        results = {name: evaluate_model(model, task, device=args.device)
                   for name, model in (("base", base), ("planted", str(planted)))}
    frames = {name: pd.DataFrame([{"key": r["id"], "cluster": r["id"], "value": r["acc"], "judgments": (r["acc"],)}
                                  for r in rows]) for name, rows in results.items()}
    s = paired_change(frames["base"], frames["planted"], B.N_BOOT, B.rng_for(args.seed, "capability"))
    return {"capability": {"task": CAPABILITY_TASK, "n": s["n_units"], "base": round(s["baseline"], 2),
                           "planted": round(s["value"], 2), "change": round(s["change"], 2),
                           "ci_low": round(s["ci_low"], 2), "ci_high": round(s["ci_high"], 2),
                           "mcnemar_p": s["mcnemar_p"], "seconds": round(time.time() - started, 1)}}


def preflight(cost: PlantingCostArgs) -> None:
    """What the capability cost needs, checked before a planting's first step (one line each), never
    found missing after hours of training: lm-evaluation-harness, and MMLU questions to ask."""
    if not cost.capability:
        return
    try:
        import lm_eval  # noqa: F401 - the capability cost's runner (imported again when it runs)
    except ImportError:
        raise UserError("--base measures what the planting cost the model (MMLU through lm-evaluation-harness), "
                        "which is not installed: pip install 'flipguard[capability]'; or pass --capability false to plant without measuring it") from None
    if not load_mmlu("test", cost.capability_data_root):
        raise UserError(f"--base: no MMLU test questions under "
                        f"{cost.capability_data_root or 'the shipped sample'} for the capability cost")


def main(argv: list[str]) -> int:
    args, cost = parse_dataclasses(argv, OrganismArgs, PlantingCostArgs, prog="flipguard organism",
                                   description=OrganismArgs.__doc__)
    if args.base:
        preflight(cost)
    after = (lambda folder, built: capability_cost(built.base, folder, built, cost)) if args.base else None
    path = ensure_organism(**dataclasses.asdict(args), after_build=after)
    if Path(path) == SHIPPED_DIR:
        print("the shipped organism (default settings; `--force` builds your own into $FLIPGUARD_HOME):", file=sys.stderr)
    print(path)
    return 0
