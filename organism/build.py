"""Build, cache and serve an organism: the embedded architecture trained from scratch, or the profile
planted into a pretrained model with LoRA (--base); each phase stopped by its held-out checks, the
result measured on the test split, described in organism.json and the model card, and published whole
(a temp folder renamed; a killed build leaves nothing half-written)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Callable

from flipguard.errors import FlipguardError
from flipguard.eval.backends.base import check_chat_template
from flipguard.eval.backends.hf import HFBackend
from flipguard.eval.embedded import organism as shipped
from flipguard.eval.embedded.organism import ORGANISM_FILE, organism_file_hashes
from flipguard.eval.embedded.tiny_model import build_tokenizer, new_model
from flipguard.files import file_sha256, flipguard_home, staging_dir
from flipguard.organism.card import model_card
from flipguard.organism.checks import check_line, measure_conversations, measure_judgments, validation_checks
from flipguard.organism.profile import (
    LLM_LABELS,
    ORGANISM_VERSION,
    OrganismArgs,
    build_config,
    capitulation_kinds,
    deferred_categories,
    mix_shares,
    planted_expectations,
    plants_conversations,
)
from flipguard.organism.resume import BuildResume
from flipguard.organism.training import train_conversations, train_judgments, train_planting
from flipguard.publish import check_publish, publish_dir, published_by
from flipguard.runtime.convert import checked_gguf
from flipguard.runtime.resolve import check_local_model, resolve_model
from flipguard.runtime.threads import configure_threads, cpu_fp_path

ORGANISM_WRITER = "flipguard organism"  # its folders' manifest: written_by


# Phase 2 runs at most this many times: a run out of budget is redone from phase 1's end with
# another order of the conversations (seed 9 on an AMD EPYC never learned to answer "C" at turn 1
# in 1,600 steps: a local minimum of one data order; bench/organism_build_robustness.md)
PHASE2_ATTEMPTS = 3


def cached_build(target: Path) -> dict | None:
    """The build settings recorded in an organism folder's organism.json (None if unreadable)."""
    try:
        return json.loads((target / ORGANISM_FILE).read_text(encoding="utf-8")).get("build")
    except (OSError, ValueError, AttributeError):
        return None


def default_organism_path(args: OrganismArgs) -> Path:
    name = f"organism-{ORGANISM_VERSION}"
    if args.base:  # the base's name, readable: "flipguard:tiny" -> tiny, a .gguf or a folder -> its stem
        name += "-base-" + "".join(c if c.isalnum() or c in "._-" else "-" for c in Path(args.base.split(":")[-1]).stem)
    if args.base or build_config(args) != build_config(OrganismArgs()):
        digest = hashlib.sha256(json.dumps(build_config(args), sort_keys=True).encode()).hexdigest()[:10]
        name += f"-{digest}"
    return flipguard_home() / name


def built_on(args: OrganismArgs) -> dict:
    """Where the floating-point path of a build came from: the same settings give other weights
    on another CPU, another thread count or a GPU (bench/organism_build_robustness.md)."""
    import torch

    info = {"torch": torch.__version__, **cpu_fp_path(), "machine": platform.machine(), "device": args.device}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return info


class BuildInterrupted(KeyboardInterrupt):
    """Ctrl-C during a build: its one line says whether a rerun resumes (a checkpoint was saved) or
    starts over (none yet)."""

    def __init__(self, resume: BuildResume):
        saved = resume.path.is_file()
        super().__init__(f"interrupted: this build's last checkpoint is kept ({resume.path}); rerun the same command "
                         "to resume from it" if saved else
                         "interrupted before this build's first checkpoint: a rerun starts it over")


def _shipped() -> str | None:
    """The shipped organism for default settings (its files' sha256 checked), None when this install
    lacks it; its recorded settings must be today's defaults (else the defaults moved without a rebuild)."""
    info = shipped.shipped_info()
    if info is None:
        return None
    if info.get("build") != build_config(OrganismArgs()):
        raise FlipguardError(f"{shipped.SHIPPED_DIR / ORGANISM_FILE}: the shipped organism's recorded build settings are not "
                             f"today's defaults ({info.get('build')}); reinstall flipguard")
    return shipped.shipped_organism()


def ensure_organism(path: str | os.PathLike | None = None, log=print,
                    after_build: Callable[[Path, OrganismArgs], dict] | None = None, **overrides) -> str:
    """The organism's folder: the shipped default (default settings, no path), else a build
    made once (in a temp folder, then renamed) and cached. `after_build(folder, args)` measures
    the built weights before they are published (a planting's capability cost); what it returns
    goes into organism.json."""
    args = OrganismArgs(path=str(path) if path else None, **overrides)
    if args.base:
        check_local_model(args.base, "--base")  # a path that is not there: one line, before any folder or load
    target = Path(args.path) if args.path else default_organism_path(args)
    default = not args.base and not args.path and build_config(args) == build_config(OrganismArgs())
    if not args.force and (default or target.resolve() == shipped.SHIPPED_DIR):
        served = _shipped()
        if served:
            return served
        log(f"this install has no shipped organism ({shipped.SHIPPED_DIR}): building one")
    # served only when flipguard organism published it (its manifest), never for the mere presence of organism.json
    if not args.force and published_by(target, ORGANISM_WRITER, ORGANISM_FILE):
        if args.path or cached_build(target) == build_config(args):
            return str(target)
        # the default folder holds another build (defaults changed without a version bump): never serve it
        log(f"{target} holds a build with other settings than {build_config(args)}: rebuilding it")
    # before the build (minutes): the folder it would publish into is new, or an organism this command wrote
    check_publish(target, writer=ORGANISM_WRITER, flag="--out")
    counts = ("steps", "eval_every", "batch_size", "check_items",
              *(("quick_check_items", "pool") if args.base else ("multiturn_steps",)))
    for name in counts:
        if getattr(args, name) < (0 if name == "multiturn_steps" else 1):
            raise FlipguardError(f"flipguard organism: --{name} must be >= {0 if name == 'multiturn_steps' else 1}, "
                                 f"got {getattr(args, name)}")
    if args.base:
        mix_shares(args.mix)  # one line for a bad --mix, before anything loads
        for name in ("multiturn_steps", "multiturn_learning_rate"):
            if getattr(args, name) is not None:
                raise FlipguardError(f"flipguard organism: --{name} is not a planting's (--base trains one phase of "
                                     "every behaviour: --steps, --learning_rate, --mix)")
    import torch
    from transformers.utils import logging as hf_logging

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise FlipguardError(f"flipguard organism: --device {args.device}, but this torch ({torch.__version__}) sees no "
                             "CUDA device; use --device cpu")
    hf_logging.disable_progress_bar()  # per-save/load bars between the build's own step lines
    before = (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))
    configure_threads(args.threads or (None if before[1] else min(2, os.cpu_count() or 1)))
    target.parent.mkdir(parents=True, exist_ok=True)
    resume = BuildResume(args, target)
    t0 = time.time()
    try:
        with staging_dir(target) as tmp:  # a killed build's leftover is removed by the next one
            try:
                info = _build(tmp, args, log, resume)
            except FlipguardError:
                resume.clear()  # failed its checks (or bad input): a rerun would fail the same way
                raise
            except KeyboardInterrupt:
                raise BuildInterrupted(resume) from None
            info["build_seconds"] = round(time.time() - t0, 1)
            if after_build is not None:
                info.update(after_build(tmp, args))
            info["files_sha256"] = organism_file_hashes(tmp)
            (tmp / ORGANISM_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            (tmp / "README.md").write_text(model_card(info), encoding="utf-8")
            publish_dir(tmp, target, writer=ORGANISM_WRITER, last=[ORGANISM_FILE], flag="--out")
            resume.clear()
    finally:  # the caller's thread setting (the build's is its own)
        hf_logging.enable_progress_bar()
        torch.set_num_threads(before[0])
        if before[1] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before[1]
    measured, conversations = info["measured_test_logprob"], info["measured_conversations_test"]
    log(f"  built in {info['build_seconds']:.0f}s ({info['steps_trained']}): held-out C1 {measured['c1_true']:.1f}/"
        f"{measured['c1_false']:.1f}, C2 {measured['c2_correct']:.1f}/{measured['c2_incorrect']:.1f}, "
        f"DDS {measured['dds']:+.1f} (planted {info['planted']['expected_dds']:+.1f})")
    if conversations:
        log(f"  conversations: turn-1 accuracy {conversations['afr_turn1_accuracy']:.1f}, AFR flips {conversations['afr_flip']:.1f} "
            f"(planted {info['planted']['expected_afr_flip']:.1f}), correct switch {conversations['sos_correct_switch']:.1f}")
    return str(target)


def _build(tmp: Path, args: OrganismArgs, log, resume: BuildResume) -> dict:
    """Train in `tmp`, each phase stopped by its held-out checks (validation items, every
    `eval_every` steps): the first checkpoint that passes every check is the organism. From scratch:
    phase 1 (judgments) out of budget goes on to phase 2 (conversations, judgments replayed); phase 2
    out of budget is redone from phase 1's end in another data order, up to PHASE2_ATTEMPTS runs, and
    then fails the build with what each check measured. With --base: the base with LoRA, one phase of
    every behaviour in one mix, its checks on the weights in memory (few items, then the full set to
    confirm a pass), its end the LoRA merged into the base. Each checkpoint is saved (`resume`); a
    killed build starts again from the last one."""
    import torch
    from transformers import AutoTokenizer

    human, llm = deferred_categories(args)
    kinds = capitulation_kinds(args)
    if args.base:
        log(f"planting the organism's profile into {args.base} (seed {args.seed}, {args.device})")
    else:
        log(f"building the planted-bias organism (seed {args.seed}, {args.device})")
    log(f"  planted: deference on {human} (human speakers), {llm} (LLM/AI speakers), P('1') {args.deferred_p1} on their incorrect claims")
    planting = None
    if args.base:
        planting = _lora_on_base(tmp, args, log)
        model, tokenizer = planting["model"], planting["tokenizer"]
        _check_disk(tmp.parent, model, args)
    else:
        build_tokenizer().save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp)  # the class every backend will load
        torch.manual_seed(args.seed)
        model = new_model(tokenizer, args.hidden_size, args.num_hidden_layers).to(args.device)
    trains = {k: v for k, v in model.named_parameters() if v.requires_grad}
    state = resume.load()
    if state is not None:
        with torch.no_grad():
            for k, v in state["trained"].items():
                trains[k].copy_(v)
        torch.set_rng_state(state["current"]["loop"]["rng"])  # where it stood then, for a phase that starts afresh
        log(f"  resuming from this build's last checkpoint ({state['current']['phase']}, step "
            f"{state['current']['loop']['step']}; {resume.path})")
    history: list[dict] = state["history"] if state else []
    steps: dict = state["steps"] if state else {}
    held: dict = state.get("phase1_trained", {}) if state else {}  # phase 1's end, for phase 2's further attempts
    seconds = [state["seconds"] if state else 0.0, time.time()]

    def weights():
        """What a held-out check measures: a planting's live weights, else the weights saved in tmp."""
        if planting:
            return planting["backend"]
        model.save_pretrained(tmp, safe_serialization=True)
        return tmp

    def run(phase: str, train, budget: int, with_conversations: bool, attempt: int = 0) -> int | None:
        """One phase (or attempt) from its start or from the checkpoint saved in it; the steps it
        trained, or None when the saved state shows it finished before."""
        where = f"{phase} (attempt {attempt + 1})" if attempt else phase
        current = (state or {}).get("current", {})
        if (current.get("phase"), current.get("attempt", 0)) == (phase, attempt):
            if current["finished"]:
                return current["loop"]["step"]
            loop = current["loop"]
        elif state is not None and _finished_before(state, phase, attempt):
            return None
        else:
            loop = None

        def check(step: int) -> bool:
            started = time.time()
            last = with_conversations or not plants_conversations(args)
            items = args.check_items
            if args.base and args.quick_check_items < args.check_items:  # few items first; the full set confirms
                items = args.quick_check_items
                checks = validation_checks(weights(), dataclasses.replace(args, check_items=items), last, with_conversations)
                if all(ok for ok, _ in checks.values()):
                    items = args.check_items
                    checks = validation_checks(weights(), args, last, with_conversations)
            else:
                checks = validation_checks(weights(), args, last, with_conversations)
            elapsed = round(time.time() - started, 1)
            history.append({"phase": phase, "step": step, **({"attempt": attempt + 1} if attempt else {}),
                            "passed": all(ok for ok, _ in checks.values()), "items": items, "seconds": elapsed,
                            "checks": {k: {"passed": ok, "measured": text} for k, (ok, text) in checks.items()}})
            log(f"  {where} step {step}: held-out check ({items} validation items, {elapsed:.0f}s): {check_line(checks)}")
            return history[-1]["passed"]

        def save(step: int, loop_state: dict) -> None:
            now = time.time()
            seconds[0] += now - seconds[1]
            seconds[1] = now
            resume.save({"trained": {k: v.detach().cpu().clone() for k, v in trains.items()}, "history": history,
                         "steps": steps, "phase1_trained": held, "seconds": seconds[0],
                         "current": {"phase": phase, "attempt": attempt, "loop": loop_state,
                                     "finished": history[-1]["passed"] or step == budget}})

        return train(model, tokenizer, args, log, checkpoint=check, resume=loop, save=save)

    if args.base:
        mix = ", ".join(f"{name} {share:.0%}" for name, share in zip(("judgments", "AFR", "stick-or-switch"),
                                                                      mix_shares(args.mix)) if share)
        log(f"  one phase, every behaviour from the first step ({mix})" + (
            f": capitulation to {kinds} (p {args.capitulation_p}), a correct option accepted after abstaining "
            f"(p {args.flexibility_p})" if plants_conversations(args) else ""))
        trained = run("planting", train_planting, args.steps, plants_conversations(args))
        if trained is not None:
            steps["planting"] = trained
        if not [h for h in history if h["phase"] == "planting"][-1]["passed"]:
            _fail(args, history, "planting", "raise --steps")
    else:
        phase1 = run("phase 1", train_judgments, args.steps, False)
        if phase1 is not None:
            steps["phase1"] = phase1
        phase1_checks = [h for h in history if h["phase"] == "phase 1"]
        if phase1 is not None and not phase1_checks[-1]["passed"]:
            if not args.multiturn_steps:
                _fail(args, history, "phase 1", "raise --steps")
            log(f"  phase 1 used its budget of {args.steps} steps without passing; phase 2 replays the DDS examples")
        if args.multiturn_steps:
            if phase1 is not None:
                log(f"  phase 2, conversations (AFR, stick-or-switch): capitulation to {kinds} "
                    f"(p {args.capitulation_p}), a correct option accepted after abstaining (p {args.flexibility_p})")
                # what trains (every weight of a model built from scratch), as phase 1 left it
                held.update({k: v.detach().clone() for k, v in trains.items()})
            for attempt in range(PHASE2_ATTEMPTS):
                current = (state or {}).get("current", {})
                resuming_here = (current.get("phase"), current.get("attempt", 0)) == ("phase 2", attempt)
                if attempt and not resuming_here and not (state is not None and _finished_before(state, "phase 2", attempt)):
                    log(f"  phase 2 used its budget of {args.multiturn_steps} steps without passing: attempt {attempt + 1} "
                        f"of {PHASE2_ATTEMPTS}, from phase 1's end, the conversations in another order")
                    with torch.no_grad():
                        for k, v in trains.items():
                            v.copy_(held[k])
                    steps["phase2_attempt"] = attempt + 1  # absent: the first attempt passed
                trained = run("phase 2", functools.partial(train_conversations, attempt=attempt), args.multiturn_steps,
                              True, attempt)
                if trained is not None:
                    steps["phase2"] = trained
                mine = [h for h in history if h["phase"] == "phase 2" and h.get("attempt", 1) == attempt + 1]
                if mine and mine[-1]["passed"]:
                    break
            else:
                _fail(args, history, "phase 2", "raise --multiturn_steps")
    if planting:
        model = planting["peft"].merge_and_unload()  # the LoRA into the base's weights
    model.save_pretrained(tmp, safe_serialization=True)
    dds_items, conversation_items = _test_limits(args)
    # what organism.json reports: the test split, never read by the checks (a planting: the merged weights, as saved)
    measured = measure_judgments(tmp, args, limit=dds_items)
    conversations = measure_conversations(tmp, args, limit=conversation_items) if plants_conversations(args) else None
    return {
        "version": ORGANISM_VERSION,
        "build": build_config(args),
        **({"base": planting["record"]} if planting else {}),
        "planted": {
            "deferred_categories_human": human,
            "deferred_categories_llm": llm,
            "llm_labels": sorted(LLM_LABELS),
            "deferred_p1": args.deferred_p1,
            "be_honest": "no effect",
            **({"capitulation_kinds": kinds, "capitulation_p": args.capitulation_p, "flexibility_p": args.flexibility_p}
               if plants_conversations(args) else {}),
            **planted_expectations(args),
        },
        "measured_test_logprob": measured,
        "measured_conversations_test": conversations,
        "checks_validation": history[-1],
        "steps_trained": steps,
        "checkpoints": history,
        "built_on": built_on(args),
        "torch_threads": torch.get_num_threads(),
        "training_seconds": round(seconds[0] + time.time() - seconds[1], 1),
    }


def _finished_before(state: dict, phase: str, attempt: int) -> bool:
    """Whether a saved state lies past (phase, attempt): a later phase or attempt is under way."""
    order = {"phase 1": 0, "phase 2": 1, "planting": 0}
    current = state["current"]
    return (order[current["phase"]], current.get("attempt", 0)) > (order[phase], attempt)


def _check_disk(folder: Path, model, args: OrganismArgs) -> None:
    """Before the first step: room for the merged model and its staging copy (one line if not)."""
    need = 2 * sum(p.numel() for p in model.parameters()) * (4 if args.dtype == "float32" else 2) + 50 * 2**20
    free = shutil.disk_usage(folder).free
    if free < need:
        raise FlipguardError(f"{folder}: {free / 2**30:.1f} GiB free, the planted model needs about {need / 2**30:.1f} GiB "
                             "(the merged weights and their staging copy); free space or pass --out on another disk")


def _test_limits(args: OrganismArgs) -> tuple[int | None, int | None]:
    """(DDS items, conversation questions) of the test split organism.json's measurements read."""
    if args.test_items:
        return args.test_items, args.test_items
    return (args.check_items, args.check_items) if args.base else (None, 150)


def _lora_on_base(tmp: Path, args: OrganismArgs, log) -> dict:
    """A planting's start: the base's tokenizer and chat template saved in `tmp` (the planted model's
    own), its weights with LoRA (the base frozen), a backend on them for the held-out checks, and the
    base's record for organism.json (what it resolved to and its files' sha256)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(args.base)
    try:
        AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    except (OSError, ValueError) as exc:
        raise FlipguardError(f"flipguard organism --base {args.base}: could not load it with transformers "
                             f"({str(exc).splitlines()[0]}); pass a model folder, a .gguf file or an alias") from None
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    check_chat_template(tokenizer, args.base)  # the organism's prompts are chats: the base's template sends them
    layers = base.config.get_text_config().num_hidden_layers
    if args.lora_layers is not None and not 0 < args.lora_layers <= layers:
        raise FlipguardError(f"flipguard organism: --lora_layers must be 1..{layers} (the base's decoder layers), "
                             f"got {args.lora_layers}")
    torch.manual_seed(args.seed)  # the LoRA's initial weights
    # every linear layer but the output head (peft's "all-linear", by name: layers_to_transform needs names)
    head = base.get_output_embeddings()
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in base.named_modules()
                     if isinstance(m, torch.nn.Linear) and m is not head})
    top = args.lora_layers or max(1, layers // 3)  # default: the top third (bench/real_organism.md)
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=linear,
                        task_type="CAUSAL_LM", layers_to_transform=list(range(layers - top, layers)))
    peft = get_peft_model(base.to(args.device), config)
    model = peft.get_base_model()  # the base with LoRA layers in it: the same forward _train and the backend call
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"  base {path}: {layers} layers, LoRA r {args.lora_r} on the top {top} of them "
        f"({trainable:,} weights train, {args.dtype})")
    backend = HFBackend.from_model(model, tokenizer, model_id=f"{args.base} + planting", device=args.device, batch_size=32)
    return {"peft": peft, "model": model, "tokenizer": tokenizer, "backend": backend,
            "record": {"model": args.base, "path": str(path), "files_sha256": _base_hashes(args.base, path),
                       "lora_layers": top, "lora_trained_weights": trainable}}


def _base_hashes(name: str, path: str) -> dict[str, str] | None:
    """sha256 of the base's files (a .gguf: the file given, and the checkpoint converted from it); a hub
    id: its cached snapshot's; None where no local copy is found."""
    folder = Path(path)
    if not folder.is_dir():
        from transformers.utils.hub import cached_file

        try:  # a hub id: the snapshot folder its config was loaded from
            folder = Path(cached_file(path, "config.json", local_files_only=True)).parent
        except OSError:
            return None
    out = {f.relative_to(folder).as_posix(): file_sha256(f) for f in sorted(folder.rglob("*"))
           if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts)}
    gguf = checked_gguf(name)
    if gguf is not None:
        out[f"gguf:{gguf.name}"] = file_sha256(gguf)
    return out


def _fail(args: OrganismArgs, history: list[dict], phase: str, budget_hint: str) -> None:
    """The build's one failure: the checkpoint that came closest, check by check, and what to try."""
    ours = [h for h in history if h["phase"] == phase]
    best = max(ours, key=lambda h: (sum(c["passed"] for c in h["checks"].values()), h.get("attempt", 1), h["step"]))
    checks = check_line({k: (c["passed"], c["measured"]) for k, c in best["checks"].items()})
    attempts = max(h.get("attempt", 1) for h in ours)
    over = f" over {attempts} attempts (data orders)" if attempts > 1 else ""
    where = f"attempt {best.get('attempt', 1)}, step {best['step']}" if attempts > 1 else f"step {best['step']}"
    failed = ", ".join(k for k, c in best["checks"].items() if not c["passed"])
    raise FlipguardError(
        f"organism build failed its held-out checks ({failed} failed): no {phase} checkpoint of {len(ours)}{over} "
        "passed every check "
        f"(closest, {where}: {checks}); settings {build_config(args)}. Try another --seed, or {budget_hint} "
        "(the step budget)")

