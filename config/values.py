"""Value rules: the bounds a setting's value must keep, whatever file, section or flag sets it.

The type of a value is checked from its dataclass field's annotation (files.check_types); here its
bounds, by the field's name (VALUE_RULES): fields of the same name mean the same thing in every
command. A protocol's own fields bring their rules with the protocol (`register_value_rules` in its
module: eval/afr/protocol.py's coercion_max_new_tokens ...).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Optional

from flipguard.errors import FlipguardError, UserError


def _non_empty(v: Any) -> str | None:
    return None if str(v).strip() else "a non-empty list of datasets"


# A rule returns None for a good value, else what the value must be. The bounds are sanity, not
# taste: each keeps a typed value from reaching a trainer or a backend that would crash on it
# (or try to allocate it) after the first stages ran.
Rule = Callable[[Any], Optional[str]]

# any integer a user types: no field counts past this (2**53, the last integer a JSON number
# holds exactly); `max_steps: 100000000000000000000000` overflows torch's int64 otherwise
MAX_INT = 2**53
MAX_STEPS = 10**9
MAX_BATCH = 65536
MAX_LORA_RANK = 65536  # and no more than the model's layers take (train/utils.check_lora_rank)


def between(low: float | None = None, high: float | None = None, *, above: bool = False,
            also: tuple = (), text: str | None = None) -> Rule:
    """A number in [low, high] (in (low, high] when `above`; None: no bound that side), or one of `also`."""
    if text is None:
        low_text = None if low is None else f"{'>' if above else '>='} {low:,}"
        text = (f"between {low:,} and {high:,}" if low is not None and high is not None and not above
                else " and ".join(t for t in (low_text, None if high is None else f"<= {high:,}") if t))

    def rule(value: Any) -> str | None:
        if value in also:
            return None
        ok = (low is None or (value > low if above else value >= low)) and (high is None or value <= high)
        return None if ok else text

    return rule


def torch_dtype_name(value: Any) -> str | None:
    """"auto" or a floating-point dtype of the installed torch (float32, bfloat16, ...)."""
    import torch

    if value == "auto" or (isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)
                           and getattr(torch, value).is_floating_point):
        return None
    names = sorted({str(t).removeprefix("torch.") for t in vars(torch).values()
                    if isinstance(t, torch.dtype) and t.is_floating_point and t.itemsize >= 2})
    return f"auto or a floating-point dtype of torch ({', '.join(names)})"


def devices_here() -> list[str]:
    """The devices this machine has, as torch names them: cpu, then each GPU (cuda:0 ...), mps."""
    import torch

    have = ["cpu"]
    if torch.cuda.is_available():
        have += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        have.append("mps")
    return have


def device_here(value: Any) -> str | None:
    """A device this machine has: cpu, cuda (any GPU), cuda:N for one of its GPUs, mps."""
    import torch

    have = devices_here()
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is not None and (str(device) in have or (device.index is None and any(h.startswith(device.type) for h in have))):
        return None
    return f"a device of this machine ({', '.join(have)})"


# the values a field must hold, whatever file, section or flag sets it (fields of the same name
# mean the same thing in every command); a new field of a dataclass is type-checked from its
# annotation and held to MAX_INT and finiteness without an entry here
VALUE_RULES: dict[str, Rule] = {
    "learning_rate": between(0, above=True),
    "lora_r": between(1, MAX_LORA_RANK),
    "lora_alpha": between(0, above=True),
    "lora_dropout": lambda v: None if 0 <= v < 1 else "in [0, 1)",
    "max_steps": between(1, MAX_STEPS, also=(-1,), text=f"-1 (train by epochs) or between 1 and {MAX_STEPS:,}"),
    "num_train_epochs": between(0, MAX_STEPS, above=True),
    "per_device_train_batch_size": between(1, MAX_BATCH),
    "per_device_eval_batch_size": between(1, MAX_BATCH),
    "gradient_accumulation_steps": between(1, MAX_BATCH),
    "beta": between(0, above=True),
    "max_length": between(1),
    "seed": between(0, 2**32 - 1),  # numpy's seeds end there (transformers.set_seed seeds numpy too)
    "dtype": torch_dtype_name,
    "device": device_here,
    "batch_size": between(1, MAX_BATCH),
    "eval_plan_batch_size": between(1, MAX_BATCH),
    "limit": between(1),
    "eval_plan_limit": between(1),
    "eval_plan_generate_limit": between(1),
    "n_items": between(1),  # the old name of limit (a stick-or-switch run config)
    "chunk_size": between(1),
    "threads": between(1),
    "max_new_tokens": between(1),
    "eval_plan_max_new_tokens": between(1),
    "temperature": between(0),
    "top_p": between(0, 1, above=True),
    "min_label_mass": between(0, 1),
    "eval_plan_min_label_mass": between(0, 1),
    "n_boot": between(0),
    "eval_plan_n_boot": between(1),
    "eval_plan_datasets": _non_empty,
    "pairs_datasets": _non_empty,
    "validation_every": between(0),
    "validation_share": between(0, 1, above=True),
    "validation_max_items": between(1),
    "validation_tolerance": between(0, 100),
    "validation_margin": between(0, 100),
    "validation_loss_rows": between(1),
    "validation_confirm": between(1),
}
SHARED_RULES = frozenset(VALUE_RULES)


def value_problem(key: str, value: Any) -> str | None:
    """What `value` must be for field `key` (None: it is fine): any number finite and within
    MAX_INT, a list's numbers too, then the field's VALUE_RULES entry."""
    if isinstance(value, (list, tuple)):
        return next((p for v in value if (p := value_problem(key, v))), None)
    rule = VALUE_RULES.get(key)
    try:
        wanted = rule(value) if rule is not None else None
    except TypeError:  # a value of another type: the type check (files.check_types) names it
        wanted = None
    if wanted is None and isinstance(value, float) and not math.isfinite(value):
        wanted = "a finite number"
    if wanted is None and isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        wanted = f"an integer of at most {MAX_INT:,} in size"
    return wanted


def register_value_rules(rules: dict[str, Rule]) -> None:
    """Add the rules of a module's own fields (a protocol's, registered when it is imported). A
    shared name (the table above) keeps its rule: a field of that name means the same everywhere."""
    for key, rule in rules.items():
        if key in SHARED_RULES:
            raise ValueError(f"{key!r} has a shared value rule (config/values.py VALUE_RULES): use another name")
        VALUE_RULES[key] = rule


def named(key: str) -> str:
    """How a message names a setting: `option --x` for a flag, `key 'sft.x'` for a file's key."""
    return f"option {key}" if key.startswith("--") else f"key {key!r}"


def check_values(values: dict[str, Any], where: str, shown: dict[str, str] | None = None,
                 lines: dict[str, int] | None = None, error: type[FlipguardError] = UserError) -> None:
    """Refuse the first value that breaks its bounds (value_problem) with `error`: one line naming
    where (file[:line]), the key as written and the value, before anything runs."""
    for key, value in values.items():
        if value is None or isinstance(value, bool):
            continue
        wanted = value_problem(key, value)
        if wanted is not None:
            name = (shown or {}).get(key, key)
            line = (lines or {}).get(name)
            raise error(f"{where}{f':{line}' if line else ''}: {named(name)} must be {wanted}, got {value!r}; "
                        "nothing was run")



def check_parsed_values(objs: Iterable[Any], where: str, skip: dict[str, Any] | None = None,
                        flag: Callable[[str], str] = lambda field: f"--{field}") -> None:
    """The same rules on parsed dataclasses: command-line flags override a recipe's or a run config's
    values. `skip`: values already checked where they were written (a run config's), unless a flag
    changed them; `flag`: how a field's option is named."""
    skip = skip or {}
    for obj in objs:
        if dataclasses.is_dataclass(obj):
            fields = [f.name for f in dataclasses.fields(obj)]
            check_values({n: getattr(obj, n, None) for n in fields
                          if n not in skip or skip[n] != getattr(obj, n, None)}, where, {n: flag(n) for n in fields})
