"""flipguard's own argument dataclasses: the recipe sections `pairs:`, `eval:` and `tracking:`
(PairsArguments, EvalPlanArguments, TrackingArguments under their flag prefixes, ARG_SECTIONS) and
the speed settings every trainer takes (TrainingSpeedArguments). The trainers' own arguments are
TRL's configs (config/trainers.py names them)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

# section -> flag prefix of its dataclass fields
ARG_SECTIONS = {"pairs": "pairs_", "eval": "eval_plan_", "tracking": "tracking_", "validation": "validation_"}

PAIR_STRATEGIES = ("all", "flips", "flip_weighted", "consistency", "afr", "conversation")


@dataclasses.dataclass
class PairsArguments:
    """How SFT/DPO pairs are built from the base model's train-split flip records (`pairs:`)."""

    pairs_strategy: str = dataclasses.field(
        default="all",
        metadata={
            "help": "all: correct and incorrect C2 variant of every train item (paper K.2); flips: both C2 "
            "variants of items the base model flipped; flip_weighted: all, flipped items repeated "
            "pairs_flip_weight times; consistency: C1, C2 and dehumanized framings with one target; "
            "afr: answer-flip judgments (pairs_afr_run); conversation: only the multi-turn pairs of pairs_conversations.",
            "choices": list(PAIR_STRATEGIES),
        },
    )
    pairs_seed: int = dataclasses.field(default=42, metadata={"help": "Seed for balancing and row order."})
    pairs_flip_weight: int = dataclasses.field(
        default=3, metadata={"help": "flip_weighted: each flipped item's rows appear this many times (>= 1)."}
    )
    pairs_accept_weight: int = dataclasses.field(
        default=1,
        metadata={"help": "Multi-turn pairs: each accept pair (the right option taken after an abstention) appears this "
                          "many times (>= 1). A stick-or-switch run yields several hold pairs per accept pair, and a model "
                          "trained mostly on holds can learn never to change its mind."},
    )
    pairs_capitulation_weight: int = dataclasses.field(
        default=1,
        metadata={"help": "Multi-turn pairs: each hold pair from a conversation in which the base model capitulated (gave up "
                          "its answer or abstention against the push-back) appears this many times (>= 1): the rows that "
                          "correct the planted behaviour, a small share of the held ones."},
    )
    pairs_c1_true_weight: int = dataclasses.field(
        default=1,
        metadata={"help": "Each C1-true row (a true statement, judged as a statement, to be called correct) appears this "
                          "many times (>= 1): the rows that keep own C1-true judgments while the C2 rows teach the judge to "
                          "reject a speaker's wrong claim, which drifts it toward 'incorrect' on plain statements too."},
    )
    pairs_keep_first_answers: bool = dataclasses.field(
        default=False,
        metadata={"help": "Multi-turn pairs: also replay the turn-1 answers the model got right in those runs (AFR's "
                          "baseline, stick-or-switch's single-shot prompts) as keep pairs, so training on the conversations "
                          "does not teach a letter prior (every stick-or-switch hold replies A or B, every accept C)."},
    )
    pairs_balance: bool = dataclasses.field(
        default=True, metadata={"help": "Down-sample the majority target so '1' and '2' are 50/50."}
    )
    pairs_datasets: str = dataclasses.field(
        default="bench", metadata={"help": "Train datasets (names, groups or comma list)."}
    )
    pairs_data_root: str | None = dataclasses.field(
        default=None, metadata={"help": "Data root (default: $FLIPGUARD_DATA, else the shipped samples)."}
    )
    pairs_framings: list[str] = dataclasses.field(
        default_factory=lambda: ["c1", "c2", "dehumanizing"],
        metadata={"help": "consistency: framings of the same content that share one target."},
    )
    pairs_records: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Run directory of the base model's train-split logprob eval (flipguard eval --split train)."},
    )
    pairs_afr_run: str | None = dataclasses.field(
        default=None, metadata={"help": "afr: run directory of an answer-flip evaluation."}
    )
    pairs_conversations: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"help": "AFR / stick-or-switch run directories of the train split (flipguard afr|sos --split train): "
                          "their conversations are added as multi-turn pairs (prompt = the chat up to the push-back; "
                          "hold the answer, or accept a correct option after an abstention), beside any strategy's rows."},
    )
    pairs_conversation_model: str | None = dataclasses.field(
        default=None, metadata={"help": "pairs_conversations: the model label whose conversations are used "
                                        "(needed when a run holds several)."}
    )
    pairs_include: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "Keep only pair rows matching this rule: a mapping (JSON on the command line) of "
                                        "datasets, kinds (item meta.category / incorrect_category), framings (c1, c2, "
                                        "dehumanizing, be_honest; multi-turn: hold, accept, keep), protocols (dds, afr, sos) "
                                        "and meta {key: values} to names (pairs/filters.py)."}
    )
    pairs_exclude: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "Drop pair rows matching this rule (same keys as pairs_include)."}
    )
    pairs_held_out: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "What the evaluation holds out (same keys as pairs_include): filters nothing; a pair "
                                        "set holding a matching row is refused before training, and the study's transfer "
                                        "report marks these cells held out."}
    )
    pairs_dir: str = dataclasses.field(
        default="runs/pairs", metadata={"help": "Where the pair datasets are written (flipguard pairs) and read (trainers)."}
    )
    pairs_length_policy: str = dataclasses.field(
        default="refuse",
        metadata={"help": "A prompt over pairs_max_prompt_length tokens: refuse (the trainers stop on any pair over "
                          "their max_length), drop (left out, counted) or truncate (the user turn loses its first "
                          "tokens until it fits, as the paper's Table 37 max prompt length 768). Counted in counts.json.",
                  "choices": ["refuse", "drop", "truncate"]},
    )
    pairs_max_prompt_length: int | None = dataclasses.field(
        default=None, metadata={"help": "drop/truncate: prompt token limit, chat template applied (paper: 768)."}
    )
    pairs_tokenizer: str | None = dataclasses.field(
        default=None, metadata={"help": "drop/truncate: tokenizer that counts prompt tokens (default: the recipe's "
                                        "model_name_or_path)."}
    )

@dataclasses.dataclass
class EvalPlanArguments:
    """The before/after plan `flipguard study` runs (`eval:`): what is measured, how, and
    which mitigations are compared against the baseline."""

    eval_plan_datasets: str = dataclasses.field(default="all", metadata={"help": "Test datasets to evaluate (names, groups or comma list).",
                                                                          "flag": "datasets"})
    eval_plan_data_root: str | None = dataclasses.field(
        default=None, metadata={"help": "Data root (default: $FLIPGUARD_DATA, else the shipped samples)."}
    )
    eval_plan_mitigations: list[str] = dataclasses.field(
        default_factory=lambda: ["be_honest", "dehumanizing"],
        metadata={"help": "Prompting mitigations run on the base model (the baseline, 'none', always runs).", "flag": "mitigations"},
    )
    eval_plan_trainers: list[str] | None = dataclasses.field(
        default=None, metadata={"help": "Trainers whose merged models are measured (registered: flipguard.trainers entry points; "
                                        "default: every trainer section of the recipe; [] = none)."}
    )
    eval_plan_mode: str = dataclasses.field(
        default="logprob", metadata={"help": "logprob (one-token P('1')/P('2')) or generate (paper JSON).", "choices": ["logprob", "generate"]}
    )
    eval_plan_extra_modes: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "The baseline is also measured in these decision modes (own reports; the comparison uses `mode`)."}
    )
    eval_plan_backend: str = dataclasses.field(default="hf", metadata={"help": "Backend for the eval runs (hf, vllm, openai).",
                                                                       "flag": "backend"})
    eval_plan_batch_size: int = dataclasses.field(default=8, metadata={"help": "hf backend batch size.", "flag": "batch_size"})
    eval_plan_backend_args: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "Settings for every eval run's backend, as eval's --backend_args takes them (a "
                                        "mapping in the recipe, JSON on the command line): for vllm tensor_parallel_size, "
                                        "data_parallel_size, pipeline_parallel_size, distributed_executor_backend, "
                                        "gpu_memory_utilization ...; for openai base_url ...", "flag": "backend_args"}
    )
    eval_plan_limit: int | None = dataclasses.field(default=None, metadata={"help": "Items per dataset, test and train split (None: all).",
                                                                            "flag": "limit"})
    eval_plan_generate_limit: int | None = dataclasses.field(
        default=None, metadata={"help": "generate mode: items per dataset (default: limit)."}
    )
    eval_plan_max_new_tokens: int = dataclasses.field(default=300, metadata={"help": "generate mode: reply length limit."})
    eval_plan_min_label_mass: float | None = dataclasses.field(
        default=None, metadata={"help": "logprob mode label-mass threshold (default: eval's; 0 for the random-init flipguard:tiny)."}
    )
    eval_plan_protocols: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "Registered tasks also run before and after and added to the comparison "
                                                "(built in or a user's: --include FILE, a flipguard.tasks entry point); "
                                                "a task's run config is eval.<task>_config (--eval_plan_<task>_config)."}
    )
    eval_plan_train_protocols: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "Multi-turn pairs: these tasks' runs of the base model on the TRAIN split "
                                                "(stages <task>-train, the task's config above) are added to the pairs "
                                                "(pairs.conversations)."}
    )
    eval_plan_capability: bool = dataclasses.field(
        default=False, metadata={"help": "Capability guard: MMLU accuracy of the base and every merged model through "
                                         "lm-evaluation-harness on a local task (pip install 'flipguard[capability]'), "
                                         "in the transfer report with a paired CI (stage `capability`)."}
    )
    eval_plan_capability_per_subject: int | None = dataclasses.field(
        default=None, metadata={"help": "Capability guard: questions per MMLU subject (seeded; None: all of the data root's)."}
    )
    eval_plan_n_boot: int = dataclasses.field(default=2000, metadata={"help": "Bootstrap replicates in reports."})
    eval_plan_accelerate_config: str | None = dataclasses.field(
        default=None, metadata={"help": "On a GPU the trainers run under `accelerate launch --config_file` this (default single_gpu.yaml); on CPU in process."}
    )
    eval_plan_flip_sample: int = dataclasses.field(
        default=50, metadata={"help": "Flip records (baseline test split) logged to wandb as a sample table."}
    )


@dataclasses.dataclass
class TrackingArguments:
    """Weights & Biases settings (`tracking:`); `report_to` itself is a trainer field."""

    tracking_project: str = dataclasses.field(default="flipguard", metadata={"help": "wandb project."})
    tracking_entity: str | None = dataclasses.field(default=None, metadata={"help": "wandb entity (team/user)."})
    tracking_run_name: str | None = dataclasses.field(
        default=None, metadata={"help": "Base run name; scripts append -<trainer> (-sft, -dpo, ...) unless --run_name is given."}
    )
    tracking_group: str | None = dataclasses.field(
        default=None, metadata={"help": "wandb group of the training and study runs (default: run_name)."}
    )
    tracking_tags: list[str] = dataclasses.field(default_factory=list, metadata={"help": "wandb tags."})

# at the budget (max_steps) with no checkpoint meeting the rule, which one the trainer keeps
VALIDATION_KEEP = ("fewest_misses", "last")
VALIDATION_RULES = ("auto", "organism", "paired")


@dataclasses.dataclass
class ValidationArguments:
    """Train until removed, stop before damage (`validation:`): a slice of the train split held back
    from the pairs by item and measured while the trainers train (train/validation.py)."""

    validation_every: int = dataclasses.field(
        default=0, metadata={"help": "Steps between measurements of the validation slice (0: off). On, max_steps is a "
                                     "budget: each trainer stops once every targeted behaviour has met the rule, with no "
                                     "guard beyond it, at validation_confirm measurements in a row, and the merge takes "
                                     "the last of them."})
    validation_share: float = dataclasses.field(
        default=0.1, metadata={"help": "Share of each train dataset's items held back from the pairs (seeded, by item: an "
                                       "item's judgments, challenges and conversations all go to the slice)."})
    validation_max_items: int | None = dataclasses.field(
        default=None, metadata={"help": "At most this many items held back per dataset (None: the share's)."})
    validation_seed: int | None = dataclasses.field(
        default=None, metadata={"help": "Seed of the items held back (default: pairs.seed)."})
    validation_rule: str = dataclasses.field(
        default="auto", metadata={"help": "What 'removed' means: organism (the ground-truth rule of an organism's planted "
                                          "profile: organism.json and organism/ground_truth.py's thresholds), paired (each "
                                          "targeted behaviour's CI on the slice includes 0; each guard within "
                                          "validation_tolerance of the base), auto (organism for an organism, else paired).",
                                  "choices": list(VALIDATION_RULES)})
    validation_tolerance: float = dataclasses.field(
        default=5.0, metadata={"help": "paired rule: points a guard (own C1, first answers, correct switch) may fall "
                                       "below the base model's on the slice."})
    validation_margin: float = dataclasses.field(
        default=3.0, metadata={"help": "Points every check must hold by on the slice for the rule to count as met there "
                                       "(organism rule: targets and guards, DDS within ±(5 − this), AFR at most 5 − this, "
                                       "own C1 at least 95 + this, ...; paired rule: its guards, its targets are CIs). A "
                                       "check on its limit reads as a miss: on the organism's 60 items a case a rate near "
                                       "its limit moves about 2 points at one standard error (0: the rule exactly as the "
                                       "report reads it)."})
    validation_keep: str = dataclasses.field(
        default="fewest_misses", metadata={"help": "At the budget with no checkpoint meeting the rule: fewest_misses (the "
                                                   "checkpoint missing the fewest checks; of those, the smallest total "
                                                   "shortfall in points) or last (the budget's end).",
                                           "choices": list(VALIDATION_KEEP)})
    validation_confirm: int = dataclasses.field(
        default=1, metadata={"help": "Measurements in a row the rule must hold at before training stops; the last of them "
                                     "is kept (1: the first checkpoint meeting it; like early stopping's patience). On "
                                     "the organism, 2 fixed one held-out build's DPO and made the demo's miss a guard "
                                     "by a point (bench/organism_heldout_round1.md)."})
    validation_stop: bool = dataclasses.field(
        default=True, metadata={"help": "Stop once the rule has held at validation_confirm measurements in a row (false: "
                                        "measure to the budget, then keep the first such checkpoint, else by "
                                        "validation_keep)."})
    validation_loss_rows: int = dataclasses.field(
        default=32, metadata={"help": "Rows of the slice (seeded) the trainer's own evaluation computes its loss on at "
                                      "each measurement (eval_loss; DPO's rewards): the Trainer's held-out loss beside "
                                      "flipguard's measurement."})

    @property
    def on(self) -> bool:
        return bool(self.validation_every)


# GPU memory profiles by card class, in GiB: what torch reports as the total memory of the smallest
# card of the class (24GB: L4 / A10G; 40GB: A100 40 GB; 48GB: L40S / A6000; 80GB: A100 / H100 80 GB).
# The planner fills that less the CUDA context and some slack (train/memory.py).
MEMORY_PROFILES = {"24GB": 22.0, "40GB": 39.4, "48GB": 44.4, "80GB": 79.1}


@dataclasses.dataclass
class TrainingSpeedArguments:
    """How a trainer spends its GPU (top level or a trainer's section; command line as is). The
    recipe's learning settings and effective batch (per_device_train_batch_size x
    gradient_accumulation_steps) are never changed: only how a step is computed."""

    prefix_sharing: bool = dataclasses.field(
        default=True, metadata={"help": "Compute each forward packed: shared prompt prefixes once (a DPO pair's "
                                        "prompt once for chosen and rejected), no padding; the same losses and "
                                        "gradients as TRL's padded rows (train/packing.py). false: TRL's layout."})
    memory_budget: str | None = dataclasses.field(
        default=None, metadata={"help": "GPU memory the trainer may use: a card profile (24GB, 40GB, 48GB, 80GB), an "
                                        "amount (20GiB), or 'device' (the GPU's own). Micro-batch, accumulation and "
                                        "how many layers recompute their activations follow from it, the effective "
                                        "batch kept (train/memory.py). Unset or 'none': the recipe's batch and "
                                        "gradient_checkpointing as written. Ignored on CPU."})


SECTION_CLASSES = {"pairs": PairsArguments, "eval": EvalPlanArguments, "tracking": TrackingArguments,
                   "validation": ValidationArguments}

# eval.<task>_config (flag --eval_plan_<task>_config): the run config of that task's study stage.
# One key per task, whichever tasks are registered, so config names none of them.
TASK_CONFIG_SUFFIX = "_config"


def task_config_key(task: str, split: str = "test") -> str:
    """The eval: key of a task's run config ('-' in a task's name becomes '_'): <task>_config for its
    test-split stage, <task>_train_config for its train-split stage (eval.train_protocols)."""
    return task.replace("-", "_") + ("_train" if split == "train" else "") + TASK_CONFIG_SUFFIX


def is_task_config_key(key: str) -> bool:
    return key.endswith(TASK_CONFIG_SUFFIX) and "eval_plan_" + key not in field_names(EvalPlanArguments)


def with_optional_fields(base: type, helps: dict[str, str], type_: Any = Optional[str]) -> type:
    """`base` with an optional field of `type_` (default None) for each name -> help that is not already
    one of its fields: a per-task option added to a command's arguments (same class name)."""
    have = field_names(base)
    extra = [(name, type_, dataclasses.field(default=None, metadata={"help": text}))
             for name, text in helps.items() if name not in have]
    return dataclasses.make_dataclass(base.__name__, extra, bases=(base,)) if extra else base


def eval_plan_arguments(tasks: Iterable[str]) -> type:
    """EvalPlanArguments with an `eval_plan_<task>_config` field per task: the study's parser and plan."""
    tasks = list(tasks)
    return with_optional_fields(EvalPlanArguments, {
        **{"eval_plan_" + task_config_key(task): f"{task}: run config whose settings the study's {task} stage uses "
                                                 "(models are the study's; default: the task's own)." for task in tasks},
        **{"eval_plan_" + task_config_key(task, "train"): f"{task}: run config of its train-split stage ({task}-train, "
                                                          f"eval.train_protocols: the conversations the pairs are built from; "
                                                          f"default: eval.{task_config_key(task)})." for task in tasks}})


def field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}
