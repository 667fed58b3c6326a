"""The private internals flipguard's training still touches, each with the versions it is tested on,
checked when train/ is imported (docs/training.md, "What flipguard patches", says why no public hook
serves each). Outside its range an internal is left alone: its feature falls back to the library's
own behaviour, the run's flipguard_training.json records why (`library_checks`), and one line says
so (`note`) when the fallback is taken.

Everything else the trainers extend is public: TRL's fused LM head (`add_fused_lm_head`, the
`fused_lm_head=True` call and its FusedCausalLMOutput), SFTConfig's `dataset_kwargs`, torch's module
hooks, transformers' AttentionInterface, AttentionMaskInterface and set_attn_implementation, and a
TrainerCallback.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

# name -> (package, lowest version tested, first version not tested, what flipguard does, what happens outside);
# the lowest tested is pyproject.toml's floor (.ci/floors runs the tests there), the highest what dev installs
PRIVATE = {
    "trl_use_triton": (
        "trl", "1.16.0", "1.17",
        "trl.trainer.utils._use_triton is wrapped (TRL's fused LM head scores only the labelled positions on CPU too)",
        "the head scores every position on CPU (TRL's own path: slower, the same losses)"),
    "dpo_prepare_dataset": (
        "trl", "1.16.0", "1.17",
        "DPOTrainer._prepare_dataset is overridden (a pair set flipguard tokenized is taken as prepared)",
        "TRL tokenizes the DPO pairs itself"),
    "first_layers_checkpointing": (
        "transformers", "5.0.0", "5.25",
        "the model's gradient_checkpointing_enable is wrapped (a memory plan's first k layers recompute, the rest keep "
        "their activations)",
        "every layer recomputes (less memory than planned, more time)"),
}


def _numbers(text: str) -> tuple[int, ...]:
    """1.16.0 -> (1, 16, 0); a pre-release's or local version's suffix ends the numbers (1.17.0.dev0 -> (1, 17, 0))."""
    out = []
    for part in text.split("."):
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def _installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _outside(name: str) -> str | None:
    """None where the installed version is one the internal is tested on, else the one line saying so."""
    package, low, high, what, fallback = PRIVATE[name]
    found = _installed(package)
    if found is None or _numbers(low) <= _numbers(found) < _numbers(high):
        return None
    return f"{package} {found}: {what} only on {package} >={low},<{high}; here {fallback}"


OUTSIDE = {name: line for name in PRIVATE if (line := _outside(name)) is not None}
_said: set[str] = set()


def within(name: str) -> bool:
    """The installed library is one this internal is tested on."""
    return name not in OUTSIDE


def note(name: str) -> str:
    """Say (once per process, on stderr) that the internal `name` is left alone, and return why."""
    line = OUTSIDE[name]
    if name not in _said:
        _said.add(name)
        print(f"flipguard: {line}", file=sys.stderr, flush=True)
    return line
