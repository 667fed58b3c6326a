"""Helpers shared by the thin train/*.py scripts (alignment-handbook style).

The scripts read top to bottom; everything with a branch lives here: resolving the
model name (including the local tiny model), loading pair datasets and refusing bad
ones, the token-length check that keeps TRL from silently truncating or dropping a
pair, tracking (wandb with the resolved recipe, git commit and pair fingerprint),
checkpoint resumption and model cards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from flipguard.config import (
    PairsArguments,
    TrackingArguments,
    Trainer,
    TrainingSpeedArguments,
    ValidationArguments,
    parse_recipe,
    resolved_recipe,
)
from flipguard.data.pair_sets import JUDGMENTS, PAIR_COLUMNS, is_conversation_case, read_counts, reply_columns
from flipguard.errors import FlipguardError
from flipguard.files import (
    LOCK_NAME,
    OWNER_FILE,
    atomic_write_json,
    atomic_write_text,
    claim_written_since,
    git_commit,
    owns,
    read_manifest,
    refuse_link,
    unproven,
)
from flipguard.runtime.adapters import PROVENANCE_FILE
from flipguard.runtime.resolve import check_local_model, resolve_model
from flipguard.runtime.threads import configure_threads, cpu_fp_path
from flipguard.train import compat, speed, tokenized, validation

log = logging.getLogger("flipguard.train")


class TrainError(FlipguardError, RuntimeError):
    """Training cannot start with this recipe/input; the message says what to fix."""


def run_main(main: Callable[[list[str]], int], prog: str) -> None:
    """Run a script's main: user errors print one line and exit 2, bugs keep tracebacks."""
    try:
        code = int(main(sys.argv[1:], prog=prog) or 0)
    except FlipguardError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


@dataclasses.dataclass
class Job:
    """What a train/<name>.py script hands its TRL trainer: the parsed recipe, the checked model,
    tokenizer and pair dataset, the provenance and the tracking run."""

    pairs_args: Any
    training_args: Any
    model_args: Any
    tracking_args: Any
    model_path: str
    tokenizer: Any
    dataset: Any
    config: dict[str, Any]
    run: Any
    checkpoint: str | bool | None
    speed_args: Any = None
    memory_plan: dict[str, Any] = dataclasses.field(default_factory=dict)
    # validation: on (train/validation.py): the slice measured while training, and the rows of it the
    # Trainer's own evaluation computes its held-out loss on
    validation: Any = None
    eval_dataset: Any = None

    def trainer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every TRL trainer takes alike (the adapter's LoRA and the 4-bit base; with
        validation on, the held-out rows its evaluation reads)."""
        from trl import get_peft_config, get_quantization_config

        kwargs = dict(model=self.model_path, args=self.training_args, train_dataset=self.dataset,
                      processing_class=self.tokenizer, peft_config=get_peft_config_checked(self.model_args, get_peft_config),
                      quantization_config=get_quantization_config(self.model_args))
        if self.eval_dataset is not None:
            kwargs["eval_dataset"] = self.eval_dataset
        return kwargs


def prepare(argv: list[str], trainer: Trainer, prog: str, check: Callable[[Any], None] | None = None) -> Job:
    """Everything before a trainer (its declaration, config/trainers.py) trains: its recipe section
    parsed into its TRL config, threads, seed, logging, the checkpoint to resume, the model, the pair
    set it reads (validated, length-checked; tokenized once where it declares how, train/tokenized.py),
    the GPU memory plan, provenance and tracking. `check` refuses training arguments the trainer
    cannot honour (or sets those it needs), before anything is recorded."""
    from transformers import set_seed
    from trl import ModelConfig

    allocator = speed.use_expandable_segments()  # before anything (the config parser included) starts CUDA
    parsed, recipe_path, recipe = parse_recipe(
        argv, (PairsArguments, trainer.config_class(), ModelConfig, TrackingArguments, TrainingSpeedArguments,
               ValidationArguments),
        trainer=trainer.name, prog=prog,
    )
    pairs_args, training_args, model_args, tracking_args, speed_args, validation_args = parsed
    configure_threads(None)  # $OMP_NUM_THREADS, else 1 (see flipguard.runtime.threads)
    set_seed(training_args.seed)
    setup_logging(training_args)
    check_output_dir(training_args.output_dir, recipe_path or prog)
    checkpoint = resume_checkpoint(training_args)

    check_quantization_available(model_args)
    model_path = resolve_model_path(model_args.model_name_or_path)
    check_model_loadable(model_path, recipe_path)
    if model_args.use_peft:
        check_lora_targets(model_args.lora_target_modules, model_path, f"{recipe_path}: lora_target_modules")
        check_lora_rank(model_args.lora_r, model_args.lora_target_modules, model_path, recipe_path or prog)
    tokenizer = load_tokenizer(model_path, training_args.trust_remote_code)

    dataset = load_pair_dataset(pairs_args.pairs_dir, trainer.pairs, recipe_path)
    prompt_ids, full = tokenized.rendered(dataset, tokenizer, trainer.pairs)
    lengths = tokenized.sequence_lengths(prompt_ids, full)
    check_pair_lengths(dataset, tokenizer, training_args.max_length, trainer.pairs, lengths)
    if check is not None:
        check(training_args)
    fingerprint = pairs_fingerprint(dataset)  # of the pair set as written, before the token columns
    if trainer.tokenize is not None:
        dataset = tokenized.with_token_columns(dataset, trainer.tokenize(prompt_ids, full), tokenizer)
    watch, eval_dataset = None, None
    if validation_args.on:
        training_args, watch, eval_dataset = prepare_validation(
            validation_args, training_args, pairs_args, trainer, tokenizer, model_args.model_name_or_path,
            recipe, argv, recipe_path or prog)
    memory_plan = speed.plan_memory(speed_args, training_args, model_args, model_path, lengths,
                                    trainer.concatenated_forward)

    config = run_config(recipe_path, recipe, parsed, dataset,
                        {"trainer": trainer.name, "base_model": model_path, "lm_head_scores": score_labelled_positions_only(),
                         "pairs_fingerprint": fingerprint,
                         "pairs_tokenized_by": "flipguard" if trainer.tokenize is not None else "trl",
                         "cuda_alloc_conf": allocator, "library_checks": dict(compat.OUTSIDE),
                         "validation": {"settings": watch.settings.as_dict(), "probes": len(watch.probes)} if watch else None,
                         **process_layout(training_args)})
    run = init_tracking(training_args, tracking_args, config, trainer.name)
    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
    return Job(pairs_args, training_args, model_args, tracking_args, model_path, tokenizer, dataset, config, run,
               checkpoint, speed_args, memory_plan, watch, eval_dataset)


def prepare_validation(args, training_args, pairs_args, trainer: Trainer, tokenizer, model: str, recipe, argv, where: str):
    """Validation on (train/validation.py): the slice the pair set holds, the rule it is read by, the
    TrainingArguments it runs on (evaluation and checkpoints every validation.every steps, the best by its
    score loaded at the end) and the held-out rows of the Trainer's own evaluation, tokenized as the
    train rows are. A recipe that sets those Trainer settings itself is refused, naming them."""
    from datasets import Dataset

    owned = validation.explicit_conflicts(recipe, trainer.name, argv)
    if owned:
        raise TrainError(f"{where}: validation.every sets {', '.join(owned)} itself (checkpoints every validation.every "
                         "steps, the best by its rule kept); drop them from the recipe, or set validation.every: 0")
    probes = validation.read_probes(pairs_args.pairs_dir, where)
    settings = validation.Settings.from_args(args, model, pairs_args.pairs_seed)
    training_args = validation.configure(training_args, settings)
    rows = validation.loss_rows(probes, trainer.pairs, settings.loss_rows, settings.seed)
    if not rows:
        raise TrainError(f"{pairs_args.pairs_dir}: the validation slice has no probe with a right and a wrong reply "
                         "to compute the Trainer's held-out loss on (rebuild the pair set)")
    eval_dataset = Dataset.from_list(rows)
    prompt_ids, full = tokenized.rendered(eval_dataset, tokenizer, trainer.pairs)
    check_pair_lengths(eval_dataset, tokenizer, training_args.max_length, trainer.pairs,
                       tokenized.sequence_lengths(prompt_ids, full))
    if trainer.tokenize is not None:
        eval_dataset = tokenized.with_token_columns(eval_dataset, trainer.tokenize(prompt_ids, full), tokenizer)
    return training_args, validation.Validation(probes, settings), eval_dataset


def fp16_adapters_in_fp32(model, training_args) -> int:
    """fp16 mixed precision needs trainable weights in float32: its GradScaler unscales their
    gradients, and on CUDA that kernel has no bfloat16 version. TRL (1.16) casts the LoRA weights of
    a quantized base to bfloat16 whatever the autocast, so recipes/qwen7b.yaml's DPO (fp16, 4-bit)
    failed at its first optimizer step on an H200 (bench/gpu.md). Under fp16 the trainable weights
    go back to float32 (fp16 compute, fp32 master weights: the usual mixed precision). Returns how
    many tensors it cast."""
    import torch

    if not training_args.fp16:
        return 0
    cast = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()
            cast += 1
    return cast


def train_and_save(trainer, job: Job) -> int:
    job.config["fp16_trainable_cast_to_fp32"] = fp16_adapters_in_fp32(trainer.model, job.training_args)
    running = speed.apply(trainer, job.speed_args, job.memory_plan)
    reset_peak_memory()
    timer = step_timer()
    trainer.add_callback(timer)
    if job.validation is not None:  # the slice measured at each of the Trainer's evaluations
        job.validation.trainer = trainer
        trainer.add_callback(job.validation.callback(job.tokenizer))
    trainer.train(resume_from_checkpoint=job.checkpoint)
    if job.validation is not None and trainer.accelerator.is_main_process:
        job.config["validation"] = job.validation.record(trainer.state, job.training_args.output_dir)
    job.config["speed"] = speed.record(running)
    # the logged loss curve (DDP: the mean over processes, gathered by the Trainer) goes into the provenance
    job.config["log_history"] = trainer.state.log_history
    job.config["compute"] = {**computed(trainer.model, job.training_args), "step_seconds": timer.seconds}
    save_adapter(trainer, job.tokenizer, job.training_args, job.config, job.pairs_args.pairs_dir, job.run)
    return 0


def step_timer():
    """A callback recording each optimizer step's wall time (the first holds the warm-up: kernels,
    autotuning), so that throughput can be read without it."""
    import torch
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self._start = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():  # the step's kernels, not only their launch
                torch.cuda.synchronize()
            if self._start is not None:
                self.seconds.append(round(time.perf_counter() - self._start, 4))

    return StepTimes()


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def computed(model, training_args) -> dict[str, Any]:
    """What this process actually trained with, for the provenance: the device, the dtypes of the
    frozen base weights (uint8 = 4-bit packed) and of the trainable (LoRA) weights, the autocast
    the Trainer used, the 4-bit compute dtype, and on CUDA the peak memory of this process."""
    import torch

    frozen, trainable = set(), set()
    for p in model.parameters():
        (trainable if p.requires_grad else frozen).add(str(p.dtype).removeprefix("torch."))
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    compute_dtype = getattr(quant, "bnb_4bit_compute_dtype", None) if quant is not None else None
    if isinstance(quant, dict):
        compute_dtype = quant.get("bnb_4bit_compute_dtype")
    info: dict[str, Any] = {
        "device": str(next(model.parameters()).device),
        "base_weight_dtypes": sorted(frozen), "trainable_dtypes": sorted(trainable),
        "autocast": "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "none",
        "bnb_4bit_compute_dtype": str(compute_dtype).removeprefix("torch.") if compute_dtype is not None else None,
        "gradient_checkpointing": bool(training_args.gradient_checkpointing),
    }
    if info["device"] == "cpu":  # what rounded: another CPU's kernels move the adapter slightly (bench/demo_fp_path.md)
        info.update(cpu_fp_path())
    if torch.cuda.is_available():
        info.update(device_name=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                    peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                    peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3))
    return info


def process_layout(training_args) -> dict[str, Any]:
    """How many processes train (accelerate launch --num_processes N) and the batch one optimizer
    step sees across them, for the provenance: per-device batch x accumulation x processes."""
    from accelerate import PartialState

    state = PartialState()
    effective = (training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
                 * state.num_processes)
    if state.is_main_process:
        print(f"{state.num_processes} process(es) ({state.distributed_type.value}, backend {state.backend or 'none'}): "
              f"effective batch {effective} = per_device_train_batch_size {training_args.per_device_train_batch_size}"
              f" x gradient_accumulation_steps {training_args.gradient_accumulation_steps}"
              f" x {state.num_processes} process(es)", flush=True)
    return {"num_processes": state.num_processes, "distributed_type": state.distributed_type.value,
            "distributed_backend": state.backend, "effective_batch_size": effective}


def setup_logging(training_args) -> None:
    import datasets
    import transformers

    level = training_args.get_process_log_level()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    log.setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)


def resolve_model_path(name: str | None) -> str:
    """`flipguard:tiny` -> the locally built tiny model; anything else unchanged."""
    if not name:
        raise TrainError("the recipe sets no model_name_or_path")
    check_local_model(name, "model_name_or_path")
    return resolve_model(name)


def check_model_loadable(model_path: str, recipe: str | None = None) -> None:
    """Fail early, in one line, when the model is neither a folder nor reachable/cached."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
        where = f"{recipe}: " if recipe else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrainError(
            f"{where}model {model_path!r} cannot be loaded{' offline' if offline else ''}: it is not a local "
            f"folder with a config.json and not in the Hugging Face cache ({first}). Download it on a "
            f"connected machine (huggingface-cli download {model_path}) or point model_name_or_path at a folder."
        ) from None


def check_lora_targets(targets: Any, model_path: str, where: str = "lora_target_modules") -> None:
    """Every name in lora_target_modules must name modules of the model (peft's rule: the module's
    name, or its last dotted parts); checked on an empty (meta-device) copy of the model before
    anything trains, so a typo is one line naming it and the names there are, not a peft
    traceback. A regex string or "all-linear" is left to peft."""
    if not targets or isinstance(targets, str):
        return
    import torch

    model = _meta_model(model_path)
    if model is None:
        return
    names = [n for n, _ in model.named_modules() if n]
    unknown = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unknown:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if n and isinstance(m, torch.nn.Linear)})
        raise TrainError(f"{where}: {', '.join(map(repr, unknown))} names no module of {model_path} "
                         f"(its linear layers: {', '.join(leaves)}); fix the list")


def _meta_model(model_path: str):
    """The model built on the meta device (no weights, no memory), or None for an architecture
    transformers cannot build from its config here (peft and the trainer judge it later)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    except Exception:  # noqa: BLE001 - see above
        return None


def check_lora_rank(rank: Any, targets: Any, model_path: str, where: str = "recipe", key: str = "lora_r") -> None:
    """A LoRA rank the model's layers can hold: a rank above min(in, out) of every layer it adapts
    adds no capacity (the update's rank cannot exceed it) and only allocates; `lora_r: 100000000`
    asked for 25.6 GB. Checked on the meta-device model before anything loads."""
    if not isinstance(rank, int) or isinstance(rank, bool):
        return
    import torch

    model = _meta_model(model_path)
    if model is None:
        return
    chosen = None if not targets or isinstance(targets, str) else set(targets)
    ranks = [min(m.in_features, m.out_features) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and (chosen is None or n.rsplit(".", 1)[-1] in chosen or n in chosen)]
    if ranks and rank > max(ranks):
        raise TrainError(f"{where}: key {key!r} must be at most {max(ranks):,} (min(in, out) of the largest layer it "
                         f"adapts in {model_path}: a larger rank adds nothing and only allocates), got {rank:,}; "
                         "nothing was run")


def model_bytes(path: str) -> int | None:
    """Bytes of a local model's weight files; None where the path is not a local folder or file."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if not p.is_dir():
        return None
    return sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf", ".pt"))


def adapter_bytes(rank: Any, targets: Any, model_path: str) -> int | None:
    """About the bytes a trainer's output folder takes: the LoRA weights (rank x (in + out) float32 values per
    adapted layer of the meta-device model) and the tokenizer files it saves beside them; None when unknown."""
    if not isinstance(rank, int) or isinstance(rank, bool):
        return None
    import torch

    model = _meta_model(model_path)
    if model is None:
        return None
    chosen = None if not targets or isinstance(targets, str) else set(targets)
    values = sum(rank * (m.in_features + m.out_features) for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and (chosen is None or n.rsplit(".", 1)[-1] in chosen or n in chosen))
    folder = Path(model_path)
    tokenizer = sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and "token" in f.name) if folder.is_dir() else 0
    return values * 4 + tokenizer


def load_tokenizer(model_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if tokenizer.chat_template is None:
        raise TrainError(f"{model_path}: tokenizer has no chat template; flipguard trains chat models")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_init_kwargs(model_args, training_args) -> dict[str, Any]:
    """from_pretrained kwargs the TRL trainers use when given a model path. A 4-bit base
    on GPU gets one copy per process (DDP); under FSDP device_map must stay unset."""
    import torch
    from accelerate import PartialState

    kwargs: dict[str, Any] = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    quantized = model_args.load_in_4bit or model_args.load_in_8bit
    fsdp = bool(getattr(training_args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if quantized and torch.cuda.is_available() and not training_args.use_cpu and not fsdp:
        kwargs["device_map"] = {"": PartialState().local_process_index}
    if training_args.model_init_kwargs:
        kwargs.update(training_args.model_init_kwargs)
    return kwargs


def score_labelled_positions_only() -> str:
    """Make TRL's fused LM head project only the positions that carry a label (the answer
    token and its end of turn) on CPU too. TRL does so on CUDA/XPU, but everywhere else it
    projects every position of every sequence (one tile shape, so that Neuron compiles once):
    on CPU that was 85% of an SFT step's time on the organism (15 SFT steps: train_runtime
    81 s -> 12 s; 8 DPO steps: 74 s -> 6 s; the same losses). tests/test_train.py checks the
    log-probs against TRL's own path. TRL offers no public switch: its private `_use_triton` is
    wrapped, on the TRL versions it is tested on only (train/compat.py). Returns what the head
    computes, for the provenance."""
    if not compat.within("trl_use_triton"):
        return f"trl default ({compat.note('trl_use_triton')})"
    import trl.trainer.utils as trl_utils

    original = getattr(trl_utils, "_use_triton", None)
    if original is None:  # a TRL without the switch: its own behaviour
        return "trl default"
    if not getattr(original, "flipguard_compact", False):

        def compact(device) -> bool:
            return original(device) or device.type == "cpu"

        compact.flipguard_compact = True
        trl_utils._use_triton = compact
    return "labelled positions only"


# ---------------------------------------------------------------- pair datasets

def check_quantization_available(model_args) -> None:
    """A 4-bit/8-bit recipe needs bitsandbytes: say so in one line instead of a traceback."""
    if model_args.load_in_4bit or model_args.load_in_8bit:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise TrainError(
                "this recipe loads the base in 4/8 bits (QLoRA), which needs bitsandbytes: "
                "pip install bitsandbytes (or pip install -e '.[qlora]'); or set load_in_4bit: false"
            ) from None


def load_pair_dataset(pairs_dir: str, kind: str, recipe_path: str | None = None):
    """The `kind` pair set (data/pair_sets.py) that `flipguard pairs` or the study's pairs stage
    wrote, validated; a trainer never builds one (a missing set is one line naming the command). Read
    into memory: a trainer's preparation (TRL's `map`) then writes no cache file into the pair set,
    which is the pairs stage's output and stays exactly as it was published."""
    from datasets import load_from_disk

    path = Path(pairs_dir) / kind
    if not path.is_dir():
        recipe = recipe_path or "RECIPE"
        raise TrainError(f"{path}: no {kind} pair set; build it with `flipguard pairs {recipe}` (or run "
                         f"`flipguard study {recipe}`, whose pairs stage builds it)")
    dataset = load_from_disk(str(path), keep_in_memory=True)
    missing = [c for c in PAIR_COLUMNS[kind] if c not in dataset.column_names]
    if missing:
        raise TrainError(f"{path}: missing column(s) {missing}; expected TRL {kind} format {PAIR_COLUMNS[kind]}")

    completion_cols = reply_columns(kind)
    meta_cols = [c for c in ("item_id", "case") if c in dataset.column_names]
    for i, row in enumerate(dataset.select_columns(list(completion_cols) + meta_cols)):
        multi_turn = is_conversation_case(row.get("case"))  # a letter or "Answer: X" reply, not a 1/2 judgment
        for col in completion_cols:
            msgs = row[col]
            one = isinstance(msgs, list) and len(msgs) == 1 and msgs[0].get("role") == "assistant"
            content = msgs[0].get("content") if one else None
            if not (isinstance(content, str) and content.strip() if multi_turn else content in JUDGMENTS):
                want = "a non-empty reply" if multi_turn else " or ".join(map(repr, JUDGMENTS))
                raise TrainError(
                    f"{path}: row {i} (item {row.get('item_id', '?')}): {col} must be one assistant message "
                    f"{want}, got {msgs!r} (refused)"
                )
        if multi_turn and "rejected" in completion_cols and row["chosen"] == row["rejected"]:
            raise TrainError(f"{path}: row {i} (item {row.get('item_id', '?')}): chosen equals rejected (refused)")
    if len(dataset) == 0:
        raise TrainError(f"{path}: the pair dataset is empty")
    return dataset


def pairs_fingerprint(dataset) -> str:
    return getattr(dataset, "_fingerprint", None) or "unknown"


def check_pair_lengths(dataset, tokenizer, max_length: int | None, kind: str,
                       lengths: dict[str, list[int]] | None = None) -> dict[str, int]:
    """Refuse pairs that TRL would truncate (answer token or its end-of-turn cut) or drop.

    Both trainers tokenize prompt and prompt+completion with the chat template and cut
    at max_length; a prompt that fills max_length loses its answer and is trained on
    with zero loss (SFT) or silently dropped (DPO). `lengths`: tokenized.sequence_lengths' when
    already counted. Returns the longest lengths seen.
    """
    if max_length is None:
        return {}
    lengths = lengths or tokenized.sequence_lengths(*tokenized.rendered(dataset, tokenizer, kind))
    completion_cols = reply_columns(kind)
    too_long: list[str] = []
    answer_lost = 0
    prompt_lengths = lengths["prompt"]
    longest = {"prompt": max(prompt_lengths, default=0),
               "sequence": max((n for col in completion_cols for n in lengths[col]), default=0)}
    for i in range(len(prompt_lengths)):
        for col in completion_cols:
            if lengths[col][i] > max_length:
                row = dataset[i]  # rows are read only to name the ones over the limit
                too_long.append(f"{row.get('item_id', f'row {i}')}/{row.get('case', col)} ({lengths[col][i]} tokens)")
                answer_lost += int(prompt_lengths[i] >= max_length)
                break
    if too_long:
        raise TrainError(
            f"{len(too_long)} pair(s) exceed max_length={max_length} tokens and would be truncated "
            f"({answer_lost} of them lose the answer token itself, the rest its end-of-turn); refused, "
            f"not trained on. Raise max_length, or set the recipe's pairs.length_policy (drop | truncate, with "
            f"pairs.max_prompt_length) and rebuild the pairs: {', '.join(too_long[:20])}"
            + (f" (and {len(too_long) - 20} more)" if len(too_long) > 20 else "")
        )
    return longest


# ---------------------------------------------------------------- checkpoints, tracking


def resume_checkpoint(training_args) -> str | bool | None:
    """--resume_from_checkpoint PATH/true, else the last checkpoint in output_dir."""
    from transformers.trainer_utils import get_last_checkpoint

    value = training_args.resume_from_checkpoint
    if isinstance(value, str) and value.lower() in ("true", "1", "yes"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "0", "no"):
        return None
    if value:
        if not Path(value).is_dir():
            raise TrainError(f"--resume_from_checkpoint {value}: no such checkpoint folder")
        return value
    if Path(training_args.output_dir).is_dir():
        last = get_last_checkpoint(training_args.output_dir)
        if last is not None:
            log.info("resuming from the last checkpoint in output_dir: %s", last)
            return last
    return None


def check_output_dir(output_dir: str, where: str) -> None:
    """The trainer writes straight into output_dir (adapter, tokenizer, card, checkpoints), over
    whatever is there: a folder holding a file flipguard cannot prove it wrote (its manifest lists
    it with the hash of its bytes) is refused before anything loads, and nothing in it is changed:
    a file of the user's, or one of flipguard's the user changed since. Folders in it (a killed
    run's checkpoint-N the trainer resumes from, a tracker's logs) are the trainer's own."""
    folder = Path(output_dir)
    refuse_link(folder)
    if not folder.is_dir():
        return
    doc = read_manifest(folder)
    files = sorted(p.name for p in folder.iterdir() if not p.is_dir() and p.name not in (OWNER_FILE, LOCK_NAME))
    changed = [n for n in files if doc is not None and n in doc["files"] and not owns(folder, n, doc)]
    if changed:
        raise TrainError(f"{where}: {folder / changed[0]} {unproven(doc, folder, changed[0])}"
                         f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}; nothing was changed: move "
                         "your copy away and rerun")
    foreign = [n for n in files if doc is None or n not in doc["files"]]
    if foreign:
        raise TrainError(f"{where}: output_dir {folder} holds files flipguard did not write ({', '.join(foreign[:3])}"
                         f"{' ...' if len(foreign) > 3 else ''}); nothing was changed: choose another output_dir or move "
                         "them away")


def run_config(recipe_path, recipe, parsed, dataset, extra: dict | None = None) -> dict[str, Any]:
    return {
        "recipe_path": recipe_path,
        "recipe": recipe,
        "resolved": resolved_recipe(*parsed),
        "git_commit": git_commit(),
        "pairs_fingerprint": pairs_fingerprint(dataset),
        "pairs_rows": len(dataset),
        **(extra or {}),
    }


def init_tracking(training_args, tracking_args, config: dict[str, Any], suffix: str):
    """Start the wandb run ourselves (the Trainer's callback then reuses it) so the run
    config carries the recipe, git commit and pair fingerprint. WANDB_MODE=offline works."""
    if training_args.run_name in (None, training_args.output_dir) and tracking_args.tracking_run_name:
        training_args.run_name = f"{tracking_args.tracking_run_name}-{suffix}"
    if "wandb" not in (training_args.report_to or []):
        return None
    from accelerate import PartialState

    if not PartialState().is_main_process:  # one wandb run per training, from the main process
        return None
    return start_wandb(tracking_args, training_args.run_name, config,
                       os.environ.get("WANDB_DIR") or training_args.output_dir, job_type=f"train-{suffix}")


def wants_wandb(report_to) -> bool:
    """The recipe's `report_to` (a string or a list, as TRL takes it) names wandb."""
    return "wandb" in ([report_to] if isinstance(report_to, str) else list(report_to or []))


def start_wandb(tracking_args, name: str | None, config: dict[str, Any], run_dir: str, job_type: str):
    """One wandb run in the recipe's project and group (`tracking:`); training and the
    study's eval/comparison share it, so their runs sit side by side. WANDB_MODE=offline works."""
    try:
        import wandb
    except ImportError:
        raise TrainError("report_to includes wandb but wandb is not installed (pip install wandb, or report_to: none)") from None
    os.environ.setdefault("WANDB_PROJECT", tracking_args.tracking_project)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=tracking_args.tracking_project,
        entity=tracking_args.tracking_entity,
        name=name,
        group=tracking_args.tracking_group or tracking_args.tracking_run_name,
        job_type=job_type,
        tags=list(tracking_args.tracking_tags or []),
        config={"flipguard": config},
        dir=run_dir,
    )


def finish_tracking(run) -> None:
    if run is not None:
        run.finish()


def save_adapter(trainer, tokenizer, training_args, config: dict[str, Any], pairs_dir: str | None, run) -> None:
    """Adapter, tokenizer, model card, then the provenance (flipguard_training.json) last;
    then close the tracking run. An older provenance in output_dir is removed before the
    new adapter is written, so a run killed while saving never leaves a new adapter
    described by the old provenance (no provenance = not a finished flipguard adapter)."""
    if trainer.accelerator.is_main_process:
        (Path(training_args.output_dir) / PROVENANCE_FILE).unlink(missing_ok=True)
    trainer.accelerator.wait_for_everyone()
    since = time.time() - 1.0  # the file system's clock is coarser than time.time()
    trainer.save_model(training_args.output_dir)  # every process takes part (a sharded model's gather)
    if trainer.accelerator.is_main_process:
        with adapter_saved(training_args.output_dir, config, pairs_dir, since=since):
            tokenizer.save_pretrained(training_args.output_dir)
        print(f"adapter saved to {training_args.output_dir}")
    finish_tracking(run)


@contextlib.contextmanager
def adapter_saved(output_dir: str, config: dict[str, Any], pairs_dir: str | None, *, since: float | None = None):
    """Around a library's save of an adapter into OUTPUT_DIR (a Trainer's save_model, peft's save_pretrained,
    a tokenizer's): what it writes (the adapter, peft's README card, the tokenizer's files) recorded as
    flipguard's with its hashes right after, then the model card and flipguard_training.json written last
    (write_training_info). The one way an adapter is finished, a trainer's or a test's alike: a library's
    file left unrecorded would make flipguard refuse its own card."""
    since = time.time() - 1.0 if since is None else since  # the file system's clock is coarser than time.time()
    yield
    claim_written_since(output_dir, since, writer="flipguard train")
    write_training_info(output_dir, config, pairs_dir)


def write_training_info(output_dir: str, config: dict[str, Any], pairs_dir: str | None) -> None:
    """A README model card, then flipguard_training.json (atomically, last: it vouches
    for the adapter files already there)."""
    counts = read_counts(pairs_dir)
    atomic_write_text(Path(output_dir) / "README.md", model_card(config, counts))
    atomic_write_json(Path(output_dir) / PROVENANCE_FILE, {**config, "pair_counts": counts})


def model_card(config: dict[str, Any], counts: dict[str, Any] | None, metrics: dict[str, Any] | None = None,
               title: str = "flipguard adapter") -> str:
    lines = [f"# {title}", ""]
    base = config.get("base_model") or (config.get("resolved", {}).get("ModelConfig", {}) or {}).get("model_name_or_path")
    lines += [
        f"- base model: `{base}`",
        f"- trainer: {config.get('trainer', '?')}",
        f"- recipe: `{config.get('recipe_path')}`",
        f"- git commit: `{config.get('git_commit')}`",
        f"- pair dataset fingerprint: `{config.get('pairs_fingerprint')}` ({config.get('pairs_rows')} rows)",
        "",
        "Trained with flipguard to reduce conversational deference (DialDefer, arXiv 2025): "
        "one-token judgments ('1' correct / '2' incorrect) on the Listing 3 prompt.",
        "",
    ]
    if counts:
        lines += ["## Pairs", "", f"strategy `{counts.get('strategy')}`, seed {counts.get('seed')}", "",
                  "| dataset | items | rows | target 1 | target 2 | flipped rows |", "|---|---:|---:|---:|---:|---:|"]
        for ds, c in (counts.get("per_dataset") or {}).items():
            lines.append(f"| {ds} | {c['items']} | {c['rows']} | {c['target_1']} | {c['target_2']} | {c['flipped_rows']} |")
        lines.append("")
    if metrics:
        lines += ["## Before / after", "", "```json", json.dumps(metrics, indent=2, default=str), "```", ""]
    if config.get("recipe"):
        lines += ["## Recipe", "", "```yaml", yaml.safe_dump(config["recipe"], sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def get_peft_config_checked(model_args, get_peft_config):
    """trl.get_peft_config, refusing full fine-tuning of a quantized base (not trainable)."""
    if not model_args.use_peft:
        if model_args.load_in_4bit or model_args.load_in_8bit:
            raise TrainError("load_in_4bit/8bit needs use_peft: true (a quantized base cannot be fully fine-tuned)")
        return None
    return get_peft_config(model_args)
