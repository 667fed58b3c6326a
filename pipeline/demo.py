"""`flipguard demo`: the whole loop, end to end, offline, on the embedded default.

The embedded default is the planted-bias judge organism (flipguard.organism; the shipped build in eval/embedded/organism_model): a
small chat model built here in a few minutes, judging C1 by the truth and deferring to
speakers on a known share of C2 claims, and, in conversation, giving up a right answer
to an argument or offer for a wrong option of known kinds while accepting a correct option
after abstaining. Against that known ground truth a newcomer sees every stage and every
artefact, on a CPU, in minutes:

  1. the planted behaviour measured: DDS baseline (both decision modes, with CIs),
     Be Honest and Dehumanizing (all four cases); AFR (scripted arguments) and
     stick-or-switch on the multiple-choice form (organism_mc);
  2. train-split evaluation (DDS, AFR and stick-or-switch conversations) -> flip records
     and multi-turn pairs -> LoRA SFT and DPO -> merge -> re-measure every protocol ->
     before/after comparison, whose own-C1 and correct-switch columns show what the
     mitigation did to the judgments it did not target.

The demo is `flipguard study recipes/organism.yaml --out runs/demo` (pipeline/study.py) after
building the organism and printing what was planted; its options override the recipe's
`eval:` values. Every stage resumes: rerunning the demo skips what is already done.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flipguard.config import SHIPPED_RECIPES, find_recipe, parse_dataclasses, read_recipe
from flipguard.eval.embedded.organism import ORGANISM_ALIAS, organism_info
from flipguard.eval.task import SMOKE_TEST_LINE, smoke_test_line
from flipguard.organism.card import capability_card
from flipguard.pipeline.study import JOBS_HELP, print_artefacts, run_study
from flipguard.runtime.resolve import check_local_model, resolve_model
from flipguard.runtime.threads import THREADS_HELP, configure_threads


@dataclasses.dataclass
class DemoArgs:
    """Run the whole flipguard loop end to end on the planted-bias organism (shipped with
    flipguard, 1.6 MB) and its shipped synthetic dataset: detect the deference, mitigate it, re-measure.
    It is `flipguard study recipes/organism.yaml`; options left unset keep the recipe's values."""

    out: str = dataclasses.field(default="runs/demo", metadata={"help": "Where every artefact goes."})
    model: str = dataclasses.field(
        default=ORGANISM_ALIAS,
        metadata={"help": "Base model (default: the planted-bias organism; 'flipguard:tiny' is the random-init one)."},
    )
    datasets: str | None = dataclasses.field(
        default=None, metadata={"help": "Datasets to evaluate and train on (default: the recipe's, the organism's domain)."}
    )
    recipe: str = dataclasses.field(
        default=str(SHIPPED_RECIPES / "organism.yaml"), metadata={"help": "Recipe the study runs (a file, or a shipped recipe's name)."}
    )
    trainers: str | None = dataclasses.field(
        default=None, metadata={"help": "Comma list of registered trainers (flipguard.trainers entry points: sft, dpo, ...; "
                                        "empty: no training; default: the recipe's)."}
    )
    generate_limit: int | None = dataclasses.field(default=None, metadata={"help": "generate mode: items per dataset (recipe: 40)."})
    generate_tokens: int | None = dataclasses.field(default=None, metadata={"help": "generate mode: max new tokens (recipe: 48)."})
    protocols: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Multi-turn protocols in the comparison (comma list of afr, sos; recipe: both, on organism_mc, "
                          "where the organism's capitulation is planted). Empty: DDS only."},
    )
    n_boot: int | None = dataclasses.field(default=None, metadata={"help": "Bootstrap replicates in reports (recipe: 2000)."})
    min_label_mass: float | None = dataclasses.field(
        default=None,
        metadata={"help": "logprob mode label-mass threshold (flipguard eval --min_label_mass). Default: eval's, "
                          "except 0 for the random-init tiny model (~0.3%% of its mass is on '1'+'2')."},
    )
    threads: int | None = dataclasses.field(default=None, metadata={"help": THREADS_HELP})
    jobs: int | None = dataclasses.field(default=None, metadata={"help": JOBS_HELP})


def _comma(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def study_recipe(args: DemoArgs) -> dict:
    """The recipe with the demo's options applied (its `eval:` / `pairs:` values)."""
    raw = read_recipe(args.recipe)
    plan = dict(raw.get("eval") or {})
    raw["model_name_or_path"] = args.model
    if args.datasets is not None:
        plan["datasets"] = args.datasets
        raw["pairs"] = {**(raw.get("pairs") or {}), "datasets": args.datasets}
    for key, value in (("trainers", None if args.trainers is None else _comma(args.trainers)),
                       ("protocols", None if args.protocols is None else _comma(args.protocols)),
                       ("generate_limit", args.generate_limit), ("max_new_tokens", args.generate_tokens),
                       ("n_boot", args.n_boot), ("min_label_mass", args.min_label_mass)):
        if value is not None:
            plan[key] = value
    if args.protocols is not None:  # multi-turn pairs only from the protocols measured
        plan["train_protocols"] = [p for p in plan.get("train_protocols") or [] if p in plan["protocols"]]
    raw["eval"] = plan
    return raw


def main(argv: list[str]) -> int:
    args = parse_dataclasses(argv, DemoArgs, prog="flipguard demo", description=DemoArgs.__doc__)
    args.recipe = find_recipe(args.recipe)  # a file, or a shipped recipe's name
    if args.threads:
        configure_threads(args.threads)  # an explicit choice holds for the organism build too
    check_local_model(args.model)  # a path that is not there: one line, before anything is printed or made
    if smoke_test_line([args.model]):  # the random-init model: said before any number is
        print(SMOKE_TEST_LINE, flush=True)
    print(f"=== embedded model {args.model} (the organism is shipped; `flipguard organism` builds your own)", flush=True)
    path = resolve_model(args.model)  # the organism build picks its own threads unless told
    configure_threads(args.threads)
    print(f"model: {args.model} -> {path}")
    organism = organism_info(path)
    if organism is not None:
        info = organism["planted"]
        if organism.get("base"):
            print(f"planted into {organism['base']['model']} by `flipguard organism --base` (LoRA, merged; "
                  f"{path}/organism.json: the base's files' sha256, every held-out check)")
        print(f"planted (ground truth): deference on incorrect {'/'.join(info['deferred_categories_human'])} claims "
              f"from a human speaker (expected DDS {info['expected_dds']:+.0f}), on "
              f"{'/'.join(info['deferred_categories_llm']) or 'none'} from an AI speaker "
              f"(Dehumanizing: {info['expected_dehumanizing_dds']:+.0f}); Be Honest: {info['be_honest']}")
        if info.get("capitulation_kinds"):
            print(f"planted (ground truth): in conversation, switches to an argued or offered wrong "
                  f"{'/'.join(info['capitulation_kinds'])} option (expected AFR flip rate {info['expected_afr_flip']:.0f}%), "
                  f"holds on the other kinds; accepts a correct option after abstaining "
                  f"(expected correct switch {info['expected_correct_switch']:.0f}%)")
        for line in capability_card(organism.get("capability")):
            if line:
                print(f"what planting cost the base: {line}")
    study = run_study(args.recipe, args.out, study_recipe(args), jobs=args.jobs)
    print(f"\n=== done. Same as: flipguard study {args.recipe} --out {args.out}")
    print_artefacts(study.artefacts)
    print(f"\nEvery item behind these numbers, in one page: open {Path(args.out) / 'view.html'} in a browser")
    return 0
