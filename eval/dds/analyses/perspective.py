"""`flipguard perspective-reversal --model M --out DIR`: r/AIO judged from both sides (Table 14).

The paper's r/AIO setup is 2→1: Speaker 2 (B, the original poster) judges Speaker 1 (A,
the other party), and the truth is the community verdict on the poster inverted to be
about A (data/aio.py). Its validation (Appendix C.4, Table 14) also runs 1→2: Speaker 1
judges Speaker 2, and the truth is the verdict on the poster as the community gave it.
Both use the same context, dialogue and frames (Figs 13-14 with {judger}/{judgee}).

This command runs the directions asked for (`--directions`, default both) as two
ordinary `flipguard eval` runs (OUT/2to1, OUT/1to2; all four cases; resumable) and reports
each direction's accuracies and DDS and Δ = DDS(1→2) − DDS(2→1), Table 14's layout.

How 1→2 is built, reusing eval.dds.prompts unchanged: eval.dds.prompts.build_messages lets Speaker
labels[1] judge labels[0] and renames the released "Speaker A"/"Speaker B" in the text to
the labels. 1→2 items carry text with A and B swapped and run with labels ("Speaker B",
"Speaker A"): the renaming swaps them back, so context and dialogue are byte-identical
to 2→1 and only judger/judgee change (checked in tests/test_analyses.py). Dehumanizing
relabels every speaker and is refused here.

Reruns of r/AIO prompt with the released neutral summary (the authors redacted the
dialogues), so numbers are not comparable to the paper's Table 14.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from flipguard.config import parse_dataclasses
from flipguard.data.aio import VERDICT_TEXT
from flipguard.data.schema import AIO_DATASET, Item
from flipguard.data.unified import load_items
from flipguard.errors import UserError
from flipguard.eval.dds.analyses.common import JudgedModelArgs, md_table, write_csv
from flipguard.eval.dds.prompts import AIO_LABELS, relabel
from flipguard.eval.dds.protocol import evaluate
from flipguard.eval.dds.report import report_run
from flipguard.eval.task import limit_sample, settings_folder
from flipguard.files import atomic_write_text
from flipguard.runtime.threads import configure_threads

DIRECTIONS = {"2to1": "Speaker B judges Speaker A (paper's main setup)", "1to2": "Speaker A judges Speaker B"}
REVERSED_LABELS = "Speaker B,Speaker A"


def reverse_item(item: Item) -> Item:
    """The 1→2 version of an r/AIO item: the claim is about the poster (Speaker B), whose
    community verdict is the truth; the text carries A and B swapped (see module doc)."""
    op = item.meta["op_verdict"]
    swap = (AIO_LABELS, AIO_LABELS[::-1])
    return dataclasses.replace(
        item, question=relabel(item.question, *swap), dialogue=relabel(item.dialogue or "", *swap),
        correct_answer=VERDICT_TEXT[op], incorrect_answer=VERDICT_TEXT["NOR" if op == "OR" else "OR"],
        meta={**item.meta, "judger": "Speaker A", "judgee": "Speaker B", "perspective": "1to2",
              "target_verdict": op},
    )


@dataclasses.dataclass
class PerspectiveArgs(JudgedModelArgs):
    """r/AIO perspective reversal (DialDefer Appendix C.4, Table 14): DDS with Speaker B judging
    Speaker A (2to1, the paper's setup) and Speaker A judging Speaker B (1to2), and their difference."""

    model: str = dataclasses.field(default="flipguard:tiny", metadata={"help": "Model judged."})
    out: str | None = dataclasses.field(default=None, metadata={
        "help": "Folder: OUT/2to1, OUT/1to2 + report (default runs/perspective-reversal-<the settings' fingerprint>)."})
    directions: str = dataclasses.field(default="2to1,1to2", metadata={"help": "Comma list of 2to1, 1to2."})
    data_root: str | None = dataclasses.field(default=None, metadata={"help": "Data root holding dialdefer/aio/aio.jsonl."})
    limit: int | None = dataclasses.field(default=None, metadata={"help": "At most this many r/AIO items."})
    mitigation: str = dataclasses.field(default="none", metadata={"help": "none | be_honest (dehumanizing relabels speakers: refused)."})


def parse_directions(spec: str) -> list[str]:
    dirs = [d.strip() for d in spec.split(",") if d.strip()]
    bad = [d for d in dirs if d not in DIRECTIONS]
    if bad or not dirs:
        raise UserError(f"--directions: unknown {bad}; use a comma list of {', '.join(DIRECTIONS)}")
    return list(dict.fromkeys(dirs))


def run_directions(args: PerspectiveArgs, items: list[Item] | None = None) -> dict[str, Path]:
    if args.mitigation not in ("none", "be_honest"):
        raise UserError(f"--mitigation {args.mitigation!r}: perspective reversal supports none and be_honest "
                        "(dehumanizing replaces the speaker labels the reversal is defined by)")
    directions = parse_directions(args.directions)
    if items is None:
        items = load_items(AIO_DATASET, data_root=args.data_root)
    items = limit_sample([it for it in items if it.dataset == AIO_DATASET], args.limit, seed=0)  # --limit's rule
    if not items:
        raise UserError("perspective reversal: no r/AIO items (dataset 'aio') to judge")
    out, dirs = Path(args.out), {}
    for d in directions:
        print(f"direction {d}: {DIRECTIONS[d]}", file=sys.stderr)
        ev = args.eval_args(model=args.model, out=str(out / d), datasets=AIO_DATASET, data_root=args.data_root,
                            mitigations=[args.mitigation],
                            speakers="speaker" if d == "2to1" else REVERSED_LABELS)
        dirs[d] = evaluate(ev, items=items if d == "2to1" else [reverse_item(it) for it in items])
    return dirs


def reversal_table(dirs: dict[str, Path], n_boot: int = 2000) -> pd.DataFrame:
    rows = []
    for d, run in dirs.items():
        st = report_run(run, n_boot=n_boot).stats
        r = st[(st["dataset"] == AIO_DATASET) & (st["stratum"] == "all")].iloc[0]
        rows.append({"direction": d, "judger_judgee": DIRECTIONS[d], "n": int(r["n"]),
                     **{k: r[k] for k in ("c1_true", "c1_false", "c2_correct", "c2_incorrect", "dds",
                                          "dds_ci_low", "dds_ci_high")},
                     "invalid": int(sum(r[f"invalid_{c}"] for c in ("c1_true", "c1_false", "c2_correct", "c2_incorrect"))),
                     "meaningful": bool(r["meaningful"])})
    t = pd.DataFrame(rows)
    if set(t["direction"]) >= {"2to1", "1to2"}:
        by = t.set_index("direction")["dds"]
        t["delta_vs_2to1"] = t["direction"].map({"2to1": 0.0, "1to2": by["1to2"] - by["2to1"]})
        if not t["meaningful"].all():  # a difference with a side that is not meaningful is not either
            t["delta_vs_2to1"] = np.nan
    return t[[c for c in t.columns if c != "meaningful"] + ["meaningful"]]


def render(t: pd.DataFrame, args: PerspectiveArgs) -> str:
    signed = {c: (1, True) for c in ("dds", "dds_ci_low", "dds_ci_high", "delta_vs_2to1")}
    return "\n".join([
        f"# r/AIO perspective reversal: {args.model}", "",
        f"Mode {args.mode}, mitigation {args.mitigation}. Paper Table 14 layout: DDS per direction and "
        "Δ = DDS(1→2) − DDS(2→1) (pp). 2→1 scores the judgment about Speaker A against the inverted "
        "community verdict; 1→2 the judgment about Speaker B against the verdict as given.", "",
        md_table(t, signed), "",
        "**Not comparable to the paper's Table 14**: the authors redacted the r/AIO dialogues, so flipguard "
        "prompts r/AIO with the released neutral summary.", "",
    ])


def main(argv: list[str]) -> int:
    args = parse_dataclasses(argv, PerspectiveArgs, prog="flipguard perspective-reversal", description=PerspectiveArgs.__doc__)
    args.out = args.out or str(settings_folder(Path("runs") / "perspective-reversal", "perspective-reversal", args))
    configure_threads(args.threads)
    parse_directions(args.directions)
    dirs = run_directions(args)
    t = reversal_table(dirs, args.n_boot)
    out = Path(args.out)
    write_csv(out / "perspective_reversal.csv", t)
    atomic_write_text(out / "report.md", render(t, args))
    print(render(t, args))
    print(f"wrote {out}/report.md, perspective_reversal.csv", file=sys.stderr)
    return 0
