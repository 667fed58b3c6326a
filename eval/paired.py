"""What a paired comparison needs beyond one cell's interval (eval/bootstrap.py gives that):

- the same items on both sides: two runs are paired item by item, so they must hold the same
  items with the same prompts, targets and task version (`item_mismatch` says which differ);
- a correction across the cells of one comparison: with many cells some p-values fall under 5%
  by chance (Holm's step-down, or Benjamini-Hochberg's false discovery rate: `adjust`);
- the minimal detectable difference: a cell without a significant change may hold no change, or
  too few items to tell; the change its n could have shown (`minimal_detectable_difference`)
  tells the two apart (`verdict`).

In the eval core so that the comparison (pipeline/transfer.py) and the importers of outside
runs (eval/interop/) check items with one rule.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
from scipy.stats import norm
from statsmodels.stats.multitest import multipletests

ALPHA = 0.05
POWER = 0.80
# --correction -> statsmodels' method name
CORRECTIONS = {"holm": "holm", "bh": "fdr_bh"}
# the exact two-sided McNemar test (a binomial test of the discordant pairs) cannot reach p < ALPHA
# with fewer discordant pairs than this, however one-sided they are: 2 * 0.5**k < 0.05 from k = 6
MIN_DISCORDANT = next(k for k in range(1, 64) if 2 * 0.5 ** k < ALPHA)
VERDICTS = ("changed", "no change", "too few items to tell")
SHOWN_IDS = 5  # ids named per difference in a mismatch line


def _ids(keys: Sequence[str]) -> str:
    shown = ", ".join(map(str, keys[:SHOWN_IDS]))
    return shown + (f" and {len(keys) - SHOWN_IDS} more" if len(keys) > SHOWN_IDS else "")


def _items(n: int) -> str:
    return f"{n} item{'s' * (n != 1)}"


def item_mismatch(first: Mapping[str, Mapping[str, str]], second: Mapping[str, Mapping[str, str]],
                  names: tuple[str, str] = ("the first", "the second")) -> str | None:
    """How two runs' items differ, or None when they are the same items: each run maps an item id to
    its signature (component -> value: "task version", "prompt", "target", a hash or a version).
    A component that holds one value per run and differs (another task version) is named once with
    both values; otherwise the ids whose component differs are named."""
    a_name, b_name = names
    parts = []
    only_a = sorted(set(first) - set(second), key=str)
    only_b = sorted(set(second) - set(first), key=str)
    common = [k for k in first if k in second]
    components = list(dict.fromkeys(c for k in common for c in [*first[k], *second[k]]))
    for component in components:
        a_values = {first[k].get(component) for k in common}
        b_values = {second[k].get(component) for k in common}
        if len(a_values) == 1 and len(b_values) == 1 and a_values != b_values and len(common) > 1:
            parts.append(f"{component} {next(iter(a_values))!s} in {a_name}, {next(iter(b_values))!s} in {b_name}")
            continue
        differ = [k for k in common if first[k].get(component) != second[k].get(component)]
        if differ:
            parts.append(f"{_items(len(differ))} of {len(common)} with another {component} (ids {_ids(differ)})")
    if only_a:
        parts.append(f"{_items(len(only_a))} only in {a_name} (ids {_ids(only_a)})")
    if only_b:
        parts.append(f"{_items(len(only_b))} only in {b_name} (ids {_ids(only_b)})")
    return "; ".join(parts) or None


def adjust(pvalues: Sequence[float], correction: str = "holm") -> np.ndarray:
    """p-values adjusted across one family (the cells of a comparison): Holm or Benjamini-Hochberg;
    a missing p (NaN) stays missing and is not counted in the family."""
    if correction not in CORRECTIONS:
        raise ValueError(f"correction {correction!r}: one of {sorted(CORRECTIONS)}")
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, math.nan)
    tested = np.isfinite(p)
    if tested.any():
        out[tested] = multipletests(p[tested], alpha=ALPHA, method=CORRECTIONS[correction])[1]
    return out


def minimal_detectable_difference(se: float, n_units: int) -> float:
    """The smallest true change (in the unit of `se`, pp in the comparison) that a two-sided test at
    ALPHA finds with probability POWER: (z(1 - ALPHA/2) + z(POWER)) x the standard error of the paired
    change (the bootstrap's), never below MIN_DISCORDANT of n_units changed by a whole unit (x100: pp),
    the fewest changed units an exact paired test (McNemar's) can tell from chance. Where no unit
    changed the standard error is 0, and that floor is all there is: zero changes seen in a few units
    say little."""
    if n_units <= 0 or se is None or math.isnan(se):
        return math.nan
    z = norm.ppf(1 - ALPHA / 2) + norm.ppf(POWER)
    return float(max(z * se, 100.0 * MIN_DISCORDANT / n_units))


def verdict(p_adjusted: float, mdd: float, smallest_change: float) -> str:
    """"changed" (the adjusted p is under ALPHA), "no change" (not significant, and a change of
    `smallest_change` pp would have been detectable), or "too few items to tell"; "" untested."""
    if p_adjusted is None or math.isnan(p_adjusted):
        return ""
    if p_adjusted < ALPHA:
        return VERDICTS[0]
    return VERDICTS[1] if mdd <= smallest_change else VERDICTS[2]
