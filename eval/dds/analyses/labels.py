"""`flipguard label-ablation --model M --out DIR`: the speaker-label study (DialDefer §5.2, Fig. 7).

One DDS run per label set, on the same items, as the paper ran it: the baseline labels
("Speaker 1"/"Speaker 2", set `speaker`) judge all four cases; every other set judges
only C2 (C1 prompts carry no speaker label) and is scored against the baseline's C1
(`--c1_from`, the paper's fixed-C1 protocol). Each set's run directory is an ordinary
`flipguard eval` run under OUT/<set>, so an interrupted ablation resumes.

Reported per set and dataset: DDS, ΔDDS = DDS(set) − DDS(baseline) (the bars of Fig. 7)
and the **human-vs-LLM swing**, the paper's 17.7 pp (§5.2: "When Speaker 2 is labeled
'User', Δ = +1.5; labeled 'LLM', Δ = −16.2, a 17.7 pp swing"):

    swing = ΔDDS(Speaker 2 = "User") − ΔDDS(Speaker 2 = "LLM") = DDS(llm_user) − DDS(user_llm)

(the baseline cancels). Its 95% CI is the paired item bootstrap of eval.dds.metrics: with C1
shared, the swing is the DDS of the matrix [C2 of user_llm | C2 of llm_user].
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from flipguard.config import parse_dataclasses
from flipguard.errors import UserError
from flipguard.eval.bootstrap import rng_for
from flipguard.eval.dds.analyses.common import JudgedModelArgs, md_table, write_csv
from flipguard.eval.dds.metrics import AVG_ROWS, TOTAL_AVG, bootstrap_ci
from flipguard.eval.dds.prompts import SPEAKER_SETS
from flipguard.eval.dds.protocol import evaluate
from flipguard.eval.dds.report import report_run
from flipguard.eval.plots import pyplot, save_figure
from flipguard.eval.task import settings_folder
from flipguard.files import atomic_write_text
from flipguard.runtime.threads import configure_threads

BASELINE = "speaker"
# Fig. 7's sets (abstract, gendered, ethnicity-coded, human-vs-LLM, LLM-vs-LLM), LLM names
# spelt as the authors' labeling runs spelt them.
PAPER_SETS = ("speaker", "ab", "a_b", "qa", "john_jane", "jane_john", "john_soroush", "soroush_john",
              "user_llm", "llm_user", "gpt4o_llama32", "llama32_gpt4o", "gpt4o_gpt4o")
SWING = ("llm_user", "user_llm")  # (Speaker 2 = User, Speaker 2 = LLM)


@dataclasses.dataclass
class LabelAblationArgs(JudgedModelArgs):
    """Speaker-label ablation (DialDefer §5.2, Fig. 7): one DDS run per label set (C2 only, scored
    against the baseline's C1), ΔDDS per set and the human-vs-LLM swing (the paper's 17.7 pp)."""

    model: str = dataclasses.field(default="flipguard:tiny", metadata={"help": "Model judged (paper: GPT-4o-mini)."})
    out: str | None = dataclasses.field(default=None, metadata={
        "help": "Folder: OUT/<set>/ per label set + the report (default runs/label-ablation-<the settings' fingerprint>)."})
    sets: str = dataclasses.field(
        default=",".join(PAPER_SETS),
        metadata={"help": f"Comma list of label sets (eval.dds.prompts.SPEAKER_SETS: {', '.join(sorted(SPEAKER_SETS))}); "
                          f"the baseline '{BASELINE}' is always run."})
    datasets: str = dataclasses.field(default="truthfulqa", metadata={"help": "Datasets (paper: TruthfulQA)."})
    data_root: str | None = dataclasses.field(default=None, metadata={"help": "Data root (as flipguard eval)."})
    limit: int | None = dataclasses.field(default=None, metadata={"help": "At most this many items per dataset."})


def _eval_args(args: LabelAblationArgs, label_set: str, run_dir: Path, baseline: Path | None):
    return args.eval_args(model=args.model, out=str(run_dir), datasets=args.datasets, data_root=args.data_root,
                          limit=args.limit, cases="auto" if baseline is None else "c2_correct,c2_incorrect",
                          c1_from=str(baseline) if baseline else None, speakers=label_set)


def parse_sets(spec: str) -> list[str]:
    sets = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in sets if s not in SPEAKER_SETS]
    if bad:
        raise UserError(f"--sets: unknown label set(s) {bad}; known: {', '.join(sorted(SPEAKER_SETS))}")
    return [BASELINE] + [s for s in dict.fromkeys(sets) if s != BASELINE]


def run_sets(args: LabelAblationArgs, items=None) -> dict[str, Path]:
    """Evaluate (or resume) every label set; returns set -> run directory."""
    out = Path(args.out)
    dirs: dict[str, Path] = {}
    for i, name in enumerate(parse_sets(args.sets)):
        print(f"[{i + 1}/{len(parse_sets(args.sets))}] label set {name}: {SPEAKER_SETS[name]}", file=sys.stderr)
        baseline = dirs.get(BASELINE)
        dirs[name] = evaluate(_eval_args(args, name, out / name, baseline), items=items)
    return dirs


def ablation_table(dirs: dict[str, Path], n_boot: int = 2000, seed: int = 0) -> dict:
    """Per set and dataset: DDS (paper protocol: C2 of the set vs the baseline's C1), ΔDDS,
    invalid C2 judgments; and the swing per dataset with a paired bootstrap CI."""
    rows, item_c2 = [], {}
    for name, run in dirs.items():
        rep = report_run(run, n_boot=n_boot, seed=seed)
        stats = rep.stats[rep.stats["stratum"] == "all"].set_index("dataset")
        real = [d for d in stats.index if d not in AVG_ROWS]
        for ds, r in stats.iterrows():
            if ds in AVG_ROWS and (ds != TOTAL_AVG or len(real) < 2):
                continue  # one dataset: its average rows repeat it
            rows.append({"label_set": name, "speaker1": SPEAKER_SETS[name][0], "speaker2": SPEAKER_SETS[name][1],
                         "dataset": ds, "n": int(r["n"]), "c2_correct": r["c2_correct"], "c2_incorrect": r["c2_incorrect"],
                         "dds": r["dds"], "dds_ci_low": r["dds_ci_low"], "dds_ci_high": r["dds_ci_high"],
                         "invalid_c2": int(r["invalid_c2_correct"] + r["invalid_c2_incorrect"])
                         if ds not in AVG_ROWS else np.nan, "meaningful": bool(r["meaningful"])})
        fl = rep.flips
        item_c2[name] = fl.pivot_table(index=["dataset", "item_id"], columns="pair", values="c2_correct", aggfunc="first")
    table = pd.DataFrame(rows)
    table["invalid_c2"] = table["invalid_c2"].astype("Int64")
    base = table[table["label_set"] == BASELINE].set_index("dataset")["dds"]
    table["delta_dds"] = table["dds"] - table["dataset"].map(base)
    table = table[[c for c in table.columns if c != "meaningful"] + ["meaningful"]]
    swing = []
    if all(s in item_c2 for s in SWING):
        user, llm = item_c2[SWING[0]], item_c2[SWING[1]]
        joint = llm.add_suffix("_llm").join(user.add_suffix("_user"), how="inner")
        for ds in [d for d in table["dataset"].unique() if d not in AVG_ROWS]:
            sub = joint.loc[ds] if ds in joint.index.get_level_values(0) else joint.iloc[:0]
            # CASES order (c1_true, c1_false, c2_correct, c2_incorrect): its DDS is the swing
            X = sub[["correct_llm", "incorrect_llm", "correct_user", "incorrect_user"]].to_numpy(dtype=float)
            ci = bootstrap_ci(X, n_boot, rng_for(seed, f"swing:{ds}"))
            by = table[table["dataset"] == ds].set_index("label_set")
            ok = bool(by.loc[list(SWING), "meaningful"].all())  # both sets' rows: else no swing to tell
            swing.append({"dataset": ds, "n": len(X),
                          "delta_s2_user": by.loc[SWING[0], "delta_dds"], "delta_s2_llm": by.loc[SWING[1], "delta_dds"],
                          "swing": by.loc[SWING[0], "dds"] - by.loc[SWING[1], "dds"],
                          "swing_ci_low": ci["dds_ci_low"] if ok else np.nan,
                          "swing_ci_high": ci["dds_ci_high"] if ok else np.nan, "meaningful": ok})
    return {"table": table, "swing": pd.DataFrame(swing)}


def render(res: dict, args: LabelAblationArgs) -> str:
    t = res["table"][["label_set", "speaker1", "speaker2", "dataset", "n", "dds", "dds_ci_low", "dds_ci_high",
                      "delta_dds", "invalid_c2"]]
    signed = {"dds": (1, True), "dds_ci_low": (1, True), "dds_ci_high": (1, True), "delta_dds": (1, True)}
    lines = [
        f"# Speaker-label ablation: {args.model}", "",
        f"Mode {args.mode}, template {args.template}, datasets {args.datasets}. Paper protocol (§5.2): every "
        f"set's C2 is scored against the C1 of the baseline set '{BASELINE}' (Speaker 1/Speaker 2); "
        "ΔDDS = DDS(set) − DDS(baseline), in pp. Invalid C2 judgments count as wrong and are listed.", "",
        md_table(t, signed, res["table"]["meaningful"].tolist()), "",
        "## Human-vs-LLM swing (paper: 17.7 pp, GPT-4o-mini on TruthfulQA)", "",
        "swing = ΔDDS(Speaker 2 = \"User\", set llm_user) − ΔDDS(Speaker 2 = \"LLM\", set user_llm); "
        "95% CI: paired item bootstrap.", "",
    ]
    if len(res["swing"]):
        lines.append(md_table(res["swing"], {c: (1, True) for c in res["swing"].columns
                                             if c not in ("dataset", "n", "meaningful")}))
    else:
        lines.append("(needs both label sets user_llm and llm_user)")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    t = res["table"]
    t = t[(t["label_set"] != BASELINE) & (~t["dataset"].isin(AVG_ROWS))]
    fig, ax = plt.subplots(figsize=(7, 0.35 * max(4, len(t)) + 1))
    labels = [f"{r.speaker1} / {r.speaker2} ({r.dataset})" for r in t.itertuples()]
    ax.barh(range(len(t)), t["delta_dds"], color=["tab:red" if v < 0 else "tab:blue" for v in t["delta_dds"]])
    ax.set_yticks(range(len(t)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("ΔDDS vs Speaker 1 / Speaker 2 (pp)")
    ax.set_title("Speaker-label ablation (paper Fig. 7)")
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    args = parse_dataclasses(argv, LabelAblationArgs, prog="flipguard label-ablation", description=LabelAblationArgs.__doc__)
    args.out = args.out or str(settings_folder(Path("runs") / "label-ablation", "label-ablation", args))
    configure_threads(args.threads)
    parse_sets(args.sets)  # a bad set name: refused before any model loads
    dirs = run_sets(args)
    res = ablation_table(dirs, args.n_boot)
    out = Path(args.out)
    write_csv(out / "label_ablation.csv", res["table"])
    write_csv(out / "swing.csv", res["swing"])
    atomic_write_text(out / "report.md", render(res, args))
    plot(res, out / "label_ablation.png")
    print(render(res, args))
    print(f"wrote {out}/report.md, label_ablation.csv, swing.csv, label_ablation.png", file=sys.stderr)
    return 0
