"""The DDS task (DialDefer §3): the same claim judged as a statement (C1) and as a
speaker's answer (C2), for every item, in one of two decision modes.

- generate: the paper's protocol, a JSON {chosen_answer, reasoning} reply, parsed.
- logprob: the one-token judge format (Appendix K.2), one forward pass, P("1") vs
  P("2"); the format the SFT/DPO trainers use, so before/after numbers compare.

`flipguard eval` writes one run directory per condition (model x mitigation x mode x
template x speakers): RUN_DIR/run.json + RUN_DIR/records.jsonl, then the report.
Every run judges all four cases by default, mitigations and fine-tuned models too, so
the report can show both protocols: the paper's DDS with C1 fixed from a baseline run
(`--c1_from`, §7) and the model's own DDS (its own C1 against its own C2), with the
damage to C1 accuracy that a fixed C1 would hide.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from pathlib import Path
from typing import ClassVar

import pandas as pd

from flipguard.config import did_you_mean
from flipguard.data.schema import Item
from flipguard.data.unified import load_items
from flipguard.errors import UserError
from flipguard.eval.backends.base import BackendError, GenerationConfig, model_kwargs, parse_model_ref
from flipguard.eval.backends.openai_api import BACKEND_ARGS_HELP
from flipguard.eval.dds import report
from flipguard.eval.dds.parse import parse_choice
from flipguard.eval.dds.prompts import (
    DEFAULT_TEMPLATE,
    FT_TEMPLATE,
    MITIGATIONS,
    SPEAKER_SETS,
    TEMPLATE_VERSIONS,
    build_messages,
    resolve_speakers,
    shown_speakers,
)
from flipguard.eval.dds.report import cross_mode
from flipguard.eval.estimate import Estimate, not_meaningful
from flipguard.eval.mitigations import system_label
from flipguard.eval.records import (
    CASES,
    EXPECTED_CHOICE,
    RECORDS_FILE,
    Record,
    StaleReport,
    load_run_meta,
    pending_record,
)
from flipguard.eval.runner import DEFAULT_MIN_LABEL_MASS, MIN_LABEL_MASS, MODES
from flipguard.eval.task import (
    DEFAULT_MODEL,
    LIMIT_HELP,
    Batch,
    Plan,
    Task,
    limit_sample,
    protocol_folder,
    register_task,
    run_task,
)
from flipguard.eval.task_commands import command_line
from flipguard.files import git_commit
from flipguard.runtime.threads import THREADS_HELP

# Settings that define a run's condition: a run directory holds exactly one.
# a run folder holds one run: its items (split, datasets, data root, --limit's seeded sample) as well as its
# condition; another value is refused (without --out, other settings get a folder of their own)
CONDITION_KEYS = ("protocol", "model", "backend", "mode", "mitigation", "template", "speakers", "split", "datasets",
                  "data_root", "limit", "seed")


@dataclasses.dataclass
class EvalArgs:
    """DDS evaluation: judge every item under C1 and C2 and write records + report."""

    model: list[str] = dataclasses.field(
        default_factory=lambda: [DEFAULT_MODEL],
        metadata={"help": "The model, [label=][backend:]model[|adapter] (the model-spec syntax of every command): a hub "
                          "id, a local folder, or 'flipguard:tiny' (offline test model); a backend or adapter given "
                          "there takes the place of --backend / --adapter. A DDS run judges one model."},
    )
    out: str | None = dataclasses.field(
        default=None, metadata={"help": "Run directory (records.jsonl, run.json, report/); default "
                                        "runs/dds/<model>/<datasets>-<the settings' fingerprint>."}
    )
    backend: str = dataclasses.field(default="hf", metadata={"help": "hf | vllm | openai"})
    mode: str = dataclasses.field(default="logprob", metadata={"help": "logprob (one forward pass) | generate (paper's JSON reply)"})
    datasets: str = dataclasses.field(
        default="all", metadata={"help": "Comma list of datasets or a group: all (9 + r/AIO), bench (9), aio."}
    )
    split: str = dataclasses.field(default="test", metadata={"help": "test | train (train: items for pair building)."})
    data_root: str | None = dataclasses.field(
        default=None, metadata={"help": "Full data root (layout: docs/data-root.md); default $FLIPGUARD_DATA or the shipped sample."}
    )
    limit: int | None = dataclasses.field(default=None, metadata={"help": LIMIT_HELP})
    mitigations: list[str] = dataclasses.field(
        default_factory=lambda: ["none"],
        metadata={"help": "The prompting mitigation judged: none | be_honest | dehumanizing (one per run directory)."})
    cases: str = dataclasses.field(
        default="auto", metadata={"help": "Comma list of c1_true,c1_false,c2_correct,c2_incorrect; auto = all four (with a mitigation too)."}
    )
    c1_from: str | None = dataclasses.field(
        default=None, metadata={"help": "Baseline run whose C1 gives the paper's fixed-C1 DDS (DialDefer §7); the run's own C1 is reported next to it "
                                        "(recorded in run.json)."}
    )
    allow_cross_mode_c1: bool = dataclasses.field(
        default=False,
        metadata={"help": "Accept a --c1_from baseline from another decision mode (paper Tables 5/21 protocol: "
                          "one-token C2 against the base model's JSON C1); recorded in run.json, marked in reports."},
    )
    speakers: str = dataclasses.field(
        default="speaker", metadata={"help": f"Speaker labels: one of {sorted(SPEAKER_SETS)} or 'Label1,Label2'."}
    )
    template: str = dataclasses.field(
        default=DEFAULT_TEMPLATE,
        metadata={"help": f"Prompt version: {', '.join(TEMPLATE_VERSIONS)}. Default {DEFAULT_TEMPLATE}: the text the "
                          "authors sent (it produced the paper's numbers); v0 = the paper's figures; ft-released = their "
                          "fine-tuned evaluation's raw-text prompt (no chat template). Table: eval/dds/prompts.py."},
    )
    max_new_tokens: int = dataclasses.field(default=300, metadata={"help": "generate mode: reply length limit."})
    temperature: float = dataclasses.field(default=0.0, metadata={"help": "generate mode: 0 = greedy (paper)."})
    seed: int = dataclasses.field(
        default=0,
        metadata={"help": "The --limit sample; generate mode at --temperature > 0: the sampling seed sent with each "
                          "request (openai/vllm) or set in torch (hf). A greedy request carries none, as the authors "
                          "sent theirs."},
    )
    batch_size: int = dataclasses.field(default=8, metadata={"help": "hf backend batch size."})
    adapter: str | None = dataclasses.field(default=None, metadata={"help": "Un-merged LoRA adapter folder to evaluate on top of --model."})
    device: str | None = dataclasses.field(default=None, metadata={"help": "hf backend device (default cuda if available)."})
    backend_args: dict | str | None = dataclasses.field(
        default="{}", metadata={"help": BACKEND_ARGS_HELP}
    )
    min_label_mass: float = dataclasses.field(
        default=DEFAULT_MIN_LABEL_MASS,
        metadata={"help": "logprob mode: a judgment with P('1') + P('2') below this is invalid (counted as wrong "
                          "and as invalid). Part of each record's key and of run.json. 0 = always valid."},
    )
    threads: int | None = dataclasses.field(default=None, metadata={"help": THREADS_HELP})
    report: bool = dataclasses.field(default=True, metadata={"help": "Write the report when the run finishes."})
    # shared words DDS does not take (config/vocabulary.py): refused naming the protocol
    LACKS: ClassVar[dict[str, str]] = {
        "n_boot": "flipguard eval's report bootstraps 2,000 replicates; `flipguard report RUN --n_boot N` rebuilds it "
                  "with another number"}

    def __post_init__(self) -> None:
        if isinstance(self.model, str):  # EvalArgs(model="x"): one model
            self.model = [self.model]


def one_model(args: EvalArgs) -> str:
    """The run's model: a DDS run directory holds one condition."""
    if len(args.model) != 1:
        raise UserError(f"--model {' '.join(args.model)}: a DDS run judges one model (its run directory "
                        "holds one condition); run flipguard eval once per model")
    return args.model[0]


def one_mitigation(args: EvalArgs) -> str:
    """The run's prompting mitigation: a DDS run directory holds one condition."""
    mitigations = list(dict.fromkeys(args.mitigations or ["none"]))
    if len(mitigations) != 1:
        raise UserError(f"--mitigations {' '.join(mitigations)}: a DDS run judges one mitigation (its run directory "
                        "holds one condition); run flipguard eval once per mitigation")
    if mitigations[0] not in MITIGATIONS:
        raise UserError(f"--mitigations must be one of {sorted(MITIGATIONS)}, got {mitigations[0]!r}"
                        f"{did_you_mean(mitigations[0], MITIGATIONS)}")
    return mitigations[0]


def parse_cases(spec: str, mitigation: str = "none") -> tuple[str, ...]:
    """'auto' -> all four cases (for every mitigation); else a validated comma list."""
    if spec == "auto":
        return CASES
    cases = tuple(c.strip() for c in spec.split(",") if c.strip())
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        raise UserError(f"--cases: unknown case(s) {bad}; expected a subset of {list(CASES)}")
    return cases


def build_records(
    items: list[Item],
    *,
    model: str,
    backend: str,
    mode: str,
    cases=CASES,
    mitigation: str = "none",
    speakers: tuple[str, str] = SPEAKER_SETS["speaker"],
    template: str = DEFAULT_TEMPLATE,
    gen_config: GenerationConfig | None = None,
    min_label_mass: float | None = None,
) -> list[Record]:
    """Pending DDS records (keyed, no outputs yet) for every item x case. In logprob mode
    `min_label_mass` goes into each record's extra (and so into its key)."""
    fmt = "one_token" if mode == "logprob" else "json"
    labels = MITIGATIONS[mitigation].speakers or speakers  # Dehumanizing relabels
    out = []
    for item in items:
        for case in cases:
            out.append(pending_record(
                item,
                gen_config=gen_config,
                protocol="dds",
                case=case,
                expected=EXPECTED_CHOICE[case],
                model=model,
                backend=backend,
                mode=mode,
                mitigation=mitigation,
                speakers=list(labels),
                template=template,
                messages=build_messages(item, case, mitigation, speakers, template, fmt),
                # r/AIO: the community verdict on the poster is the Balanced-DDS stratum
                extra={**({"stratum": item.meta["op_verdict"]} if "op_verdict" in item.meta else {}),
                       **({MIN_LABEL_MASS: float(min_label_mass)}
                          if mode == "logprob" and min_label_mass is not None else {})},
            ))
    return out


def default_run_dir(args: EvalArgs) -> Path:
    """Where a run of these settings goes without --out: runs/<model>/<split>-<mitigation>-<mode>-<the
    settings' fingerprint> (Task.out_dir)."""
    return DDSTask.out_dir(dataclasses.replace(args, out=None), "command line")


@register_task("dds")
class DDSTask(Task):
    """One DDS condition (model x mitigation x mode x template x speakers): every item
    judged in each case, one batch."""

    condition_keys = CONDITION_KEYS
    unit = "judgments"
    args_class = EvalArgs

    comparison_title = "DDS (dialogic deference, per run)"
    comparison_note = ("From each run's report/summary.csv: C1/C2 accuracies (%) and DDS (pp, 95% bootstrap CI; > 0 "
                       "deference, < 0 skepticism). The study's main table (comparison.csv) compares DDS conditions "
                       "with fixed and own C1; these rows are for DDS runs given with --protocols. "
                       "DDS has no study_run: a study measures every condition with it.")

    @classmethod
    def comparison_rows(cls, run_dir: Path) -> list[dict]:
        """The run's report/summary.csv as written (`flipguard report RUN_DIR` writes it), one row per
        dataset and metric; the system is the model, with its prompting mitigation."""
        summary_csv = Path(run_dir) / "report" / "summary.csv"
        if not summary_csv.is_file():
            raise UserError(f"{summary_csv}: no DDS report; write it first (flipguard report {run_dir})")
        stale = report.report_problem(run_dir)
        if stale:  # a run grown (or cut) since its report: the report's numbers are not the run's
            raise StaleReport(f"{run_dir}: {stale}; no number is read from it")
        meta = load_run_meta(run_dir)
        system = system_label(str(meta.get("model") or Path(run_dir).name), meta.get("mitigation"))
        rows = []
        for r in pd.read_csv(summary_csv).itertuples():
            ok = getattr(r, "meaningful", True)  # a report written before the column: every row was shown
            for metric in ("c1_true", "c1_false", "c2_correct", "c2_incorrect", "dds"):
                unit = "pp" if metric == "dds" else "%"
                if ok is False or str(ok) == "False":  # the report's verdict: empty numbers, marked n/m
                    rows.append({"system": system, "dataset": r.dataset, "metric": metric,
                                 "estimate": not_meaningful(int(r.n), unit=unit)})
                    continue
                lo, hi = ((r.dds_ci_low, r.dds_ci_high) if metric == "dds" else (math.nan, math.nan))
                rows.append({"system": system, "dataset": r.dataset, "metric": metric,
                             "estimate": Estimate(float(getattr(r, metric)), float(lo), float(hi), int(r.n), unit)})
        return rows

    @classmethod
    def default_out(cls, args: EvalArgs) -> Path:
        return protocol_folder(cls.name, [one_model(args)], args.datasets)

    def __init__(self, args: EvalArgs, items: list[Item] | None = None):
        if args.mode not in MODES:
            raise UserError(f"--mode must be one of {MODES}, got {args.mode!r}{did_you_mean(args.mode, MODES)}")
        try:
            speakers = resolve_speakers(args.speakers)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        self.mitigation = mitigation = one_mitigation(args)
        self.speakers = MITIGATIONS[mitigation].speakers or speakers
        if args.template not in TEMPLATE_VERSIONS:
            raise UserError(f"--template must be one of {TEMPLATE_VERSIONS}, got {args.template!r}"
                            f"{did_you_mean(args.template, TEMPLATE_VERSIONS)}")
        if args.template == FT_TEMPLATE and mitigation != "none":
            raise UserError(f"--template {FT_TEMPLATE} is raw text without a chat template (no system turn): "
                            f"it takes no --mitigations (got {mitigation!r})")
        self.cases = parse_cases(args.cases, mitigation)
        if not 0.0 <= args.min_label_mass <= 1.0:
            raise UserError(f"--min_label_mass must be between 0 and 1, got {args.min_label_mass}")
        self.min_label_mass = float(args.min_label_mass) if args.mode == "logprob" else None
        model = one_model(args)
        try:
            ref = parse_model_ref(model, args.backend, "--model")
        except BackendError as exc:
            raise UserError(str(exc)) from None
        if args.adapter:
            if ref.adapter:
                raise UserError(f"--model {model!r} names an adapter and --adapter gives another; give one")
            ref = dataclasses.replace(ref, adapter=args.adapter, label=ref.label if "=" in model
                                      else f"{ref.model}+{args.adapter}")
        self.model = dataclasses.replace(ref, kwargs=model_kwargs(ref.backend, args.backend_args,
                                                                  batch_size=args.batch_size, device=args.device))
        self.models = [self.model]
        self.args = args
        if items is None:
            items = load_items(args.datasets, split=args.split, data_root=args.data_root)
        self.items = limit_sample(items, args.limit, args.seed)
        self.cross_mode_c1, self.c1_differs = self._check_c1_from()
        # a greedy reply needs no seed: none is sent, as the authors sent their requests (model, messages,
        # temperature, max_tokens); a sampled one is seeded with --seed
        self.gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                           seed=args.seed if args.temperature > 0 else None)

    def _check_c1_from(self) -> tuple[bool, dict]:
        """The --c1_from baseline: a DDS run of the same split and decision mode (or the
        paper's cross-mode protocol, asked for); another model or template is recorded."""
        args = self.args
        if not args.c1_from:
            return False, {}
        if not (Path(args.c1_from) / RECORDS_FILE).is_file():
            raise UserError(f"--c1_from {args.c1_from}: no {RECORDS_FILE} there (a baseline run directory of "
                            "`flipguard eval` is needed); nothing was run")
        base_meta = load_run_meta(args.c1_from)
        if base_meta.get("protocol") not in (None, "dds"):
            raise UserError(f"--c1_from {args.c1_from}: holds a {base_meta.get('protocol')!r} run, not a DDS "
                            "baseline; nothing was run")
        cross = cross_mode(args.mode, base_meta.get("mode"))
        if cross and not args.allow_cross_mode_c1:
            raise UserError(
                f"--c1_from {args.c1_from} was evaluated in {base_meta['mode']!r} mode, this run in "
                f"{args.mode!r}: C1 and C2 must come from the same decision mode "
                "(--allow_cross_mode_c1 for the paper's Tables 5/21 protocol)"
            )
        base_split = base_meta.get("split")
        if base_split and base_split != args.split:
            raise UserError(f"--c1_from {args.c1_from}: a {base_split!r}-split run, this run is {args.split!r}: "
                            "its C1 judges other items; nothing was run")
        this = {"model": self.model.label, "template": args.template}
        differs = {k: [base_meta.get(k), v] for k, v in this.items()
                   if base_meta.get(k) is not None and base_meta.get(k) != v}
        if differs:
            detail = ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in differs.items())
            print(f"warning: --c1_from {args.c1_from} was judged with another {' and '.join(differs)} "
                  f"({detail}): the paper's DDS of this run scores its C2 against that C1 (recorded in run.json "
                  "as c1_from_differs)", file=sys.stderr)
        return cross, differs

    def meta(self) -> dict:
        args, items, speakers = self.args, self.items, self.speakers
        return {
            "protocol": "dds",
            "model": self.model.label,
            "backend": self.model.backend,
            "mode": args.mode,
            "mitigation": self.mitigation,
            "template": args.template,
            "speakers": list(speakers),
            # where a dataset's prompts show other labels (r/AIO Dehumanizing under v0-released)
            **({"speakers_shown": shown} if (shown := {
                d: list(shown_speakers(d, self.mitigation, speakers, args.template))
                for d in sorted({it.dataset for it in items})
                if shown_speakers(d, self.mitigation, speakers, args.template) != tuple(speakers)}) else {}),
            "cases": list(self.cases),
            "split": args.split,
            "datasets": sorted({it.dataset for it in items}),
            "data_root": args.data_root,
            "limit": args.limit,
            "seed": args.seed,
            "c1_from": str(Path(args.c1_from).resolve()) if args.c1_from else None,
            "allow_cross_mode_c1": bool(args.allow_cross_mode_c1),
            "c1_cross_mode": self.cross_mode_c1,
            # what the C1 baseline was judged with that differs from this run (model, template)
            "c1_from_differs": self.c1_differs or None,
            "generation": self.gen_config.key() if args.mode == "generate" else None,
            MIN_LABEL_MASS: self.min_label_mass,
            "command": command_line("eval", "run"),
            "git_commit": git_commit(),
        }

    def condition_clash(self, old: dict, meta: dict) -> dict:
        clash = super().condition_clash(old, meta)
        if old and meta.get("mode") == "logprob" and old.get("mode") == "logprob" \
                and old.get(MIN_LABEL_MASS) != meta.get(MIN_LABEL_MASS):  # absent: a run from before the threshold
            clash[MIN_LABEL_MASS] = (old.get(MIN_LABEL_MASS), meta.get(MIN_LABEL_MASS))
        return clash

    def merge_meta(self, old: dict, meta: dict) -> dict:
        merged = {**old, **meta}
        if old.get("cases"):
            merged["cases"] = sorted(set(old["cases"]) | set(meta["cases"]), key=CASES.index)
        return merged

    @functools.cached_property
    def _batch(self) -> Batch:
        args = self.args
        records = build_records(
            self.items, model=self.model.label, backend=self.model.backend, mode=args.mode, cases=self.cases,
            mitigation=self.mitigation, speakers=self.speakers, template=args.template, gen_config=self.gen_config,
            min_label_mass=self.min_label_mass,
        )
        return Batch(records, self.model.label, self.gen_config, parse_choice, desc=f"dds {self.mitigation}/{args.mode}",
                      chunk_size=max(args.batch_size * 4, 16))

    def first_batches(self) -> list[Batch]:
        return [self._batch]

    def solve(self) -> Plan:
        yield self._batch

    def write_report(self, run_dir: Path) -> Path:
        return report.write_run_report(run_dir, self.args.c1_from, allow_cross_mode_c1=self.args.allow_cross_mode_c1)

    @classmethod
    def rebuild_report(cls, run_dir: Path, args) -> Path:
        out = report.write_run_report(run_dir, args.c1_from, 2000 if args.n_boot is None else args.n_boot,
                                      0 if args.seed is None else args.seed, args.allow_cross_mode_c1)
        return out / "summary.md"


def evaluate(args: EvalArgs, items: list[Item] | None = None) -> Path:
    """Run (or resume) one DDS condition; returns the run directory."""
    task = DDSTask(args, items)
    run_dir = DDSTask.out_dir(args, "command line")
    run_task(task, run_dir)
    return run_dir
