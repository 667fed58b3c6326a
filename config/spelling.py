"""Did you mean: the closest of the valid names to a mistyped one, for every "unknown key",
"unknown option" and "invalid choice" message."""

from __future__ import annotations

import difflib
from typing import Iterable


def _edits(a: str, b: str) -> int:
    """Edits from a to b: insertions, deletions, substitutions and swaps of two neighbours (a typo's)."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def closest(given: str, choices: Iterable[str]) -> str | None:
    """The choice a mistyped `given` most likely meant (fewest typo edits, the same letters first),
    or None when none is close."""
    given, choices = str(given), list(dict.fromkeys(str(c) for c in choices))
    if not given or not choices:
        return None
    near = [(_edits(given, c), sorted(given) != sorted(c), c) for c in choices]
    best = min(near)
    if best[0] <= max(1, len(given) // 4):
        return best[2]
    close = difflib.get_close_matches(given, choices, n=1, cutoff=0.8)  # a longer name, a few letters off
    return close[0] if close else None


def did_you_mean(given: str, choices: Iterable[str], show=repr) -> str:
    """"; did you mean 'x'?" for the choice closest to a mistyped `given` (closest), or "" when none is."""
    close = closest(given, choices)
    return f"; did you mean {show(close)}?" if close is not None else ""
