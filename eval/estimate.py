"""One estimate type for every protocol: a value with its interval, sample size and unit.

DDS, AFR and stick-or-switch metrics all return `Estimate`; reports serialise it into
their (unchanged) column names with `columns` / `as_dict`, and the comparison report
reads every protocol's summary back with `from_dict` and prints it with `format`.
Units: "share" (0-1, AFR rates), "%" (a rate in percent), "pp" (percentage points: a
difference of percentages, DDS and the SoS gaps).

Not meaningful: an estimate over judgments of which more than half are invalid (unparsed replies,
or label mass below the threshold: they count as wrong, so the number would measure the parsing,
not the model) has no value (NaN, an empty cell in every CSV) and `meaningful` False; tables
mark it `not_meaningful_text` ("n/m (0 of 24 valid)"), never a fake 0.0. A difference is
meaningful when both its sides are. A protocol may also hold a rate to a least number of items
(AFR: MIN_ITEMS questions, eval/afr/metrics.py): one resting on fewer is not meaningful either,
marked "n/m (1 item; at least 5 needed)" (`too_few`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

_SCALE = {"share": 1.0, "%": 100.0, "pp": 100.0}
# more invalid judgments than this share of a cell's (or a run's): its numbers are not meaningful
INVALID_SHARE_LIMIT = 0.5
NOT_MEANINGFUL = "n/m"  # the short mark (n/m = not meaningful), in every table that shows such a cell


def is_meaningful(n_valid: int, n: int) -> bool:
    """Whether n judgments of which n_valid are valid measure anything: at least one, and at most
    INVALID_SHARE_LIMIT of them invalid."""
    return n > 0 and (n - n_valid) <= INVALID_SHARE_LIMIT * n


def not_meaningful_text(n_valid: int | None = None, n: int | None = None) -> str:
    """The mark of a not-meaningful cell: 'n/m (0 of 24 valid)', or 'n/m' when the counts are unknown."""
    if n_valid is None or n is None or _nan(n_valid) or _nan(n):
        return NOT_MEANINGFUL
    return f"{NOT_MEANINGFUL} ({int(n_valid)} of {int(n)} valid)"


def _nan(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


@dataclasses.dataclass(frozen=True)
class Estimate:
    value: float
    lo: float = math.nan
    hi: float = math.nan
    n: int = 0
    unit: str = "share"
    se: float | None = None  # bootstrap SD, where a report shows it
    p: float | None = None  # differences: two-sided paired bootstrap p-value
    n_clusters: int | None = None  # cluster bootstrap: clusters resampled
    n_valid: int | None = None  # judgments of the n that were valid (None: not counted)
    n_judged: int | None = None  # the judgments n_valid counts among, where not n (repeats of an item)
    meaningful: bool = True  # False: too few valid judgments (value and bounds NaN; see the module doc)
    min_items: int | None = None  # not meaningful because it rests on fewer items (n_clusters) than this

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def to(self, unit: str) -> "Estimate":
        """The same estimate in another unit (share <-> % / pp: a factor of 100)."""
        if unit == self.unit:
            return self
        k = _SCALE[unit] / _SCALE[self.unit]
        scale = (lambda x: x) if k == 1 else (lambda x: None if x is None else x * k)
        return dataclasses.replace(self, value=scale(self.value), lo=scale(self.lo), hi=scale(self.hi),
                                   se=scale(self.se), unit=unit)

    def columns(self, name: str, se: bool = False) -> dict[str, float]:
        """Flat report columns: `name`, `name_ci_low`, `name_ci_high` (and `name_se`)."""
        out = {name: self.value, f"{name}_ci_low": self.lo, f"{name}_ci_high": self.hi}
        if se:
            out[f"{name}_se"] = math.nan if self.se is None else self.se
        return out

    def as_dict(self, lo: str = "lo", hi: str = "hi", unit: bool = True) -> dict[str, Any]:
        """{value, lo, hi, n[, unit][, p]}; `lo`/`hi` rename the bound keys for files that
        store them as ci_low/ci_high (sos_summary.json)."""
        d = {"value": self.value, lo: self.lo, hi: self.hi, "n": self.n}
        if unit:
            d["unit"] = self.unit
        if self.p is not None:
            d["p"] = self.p
        if not self.meaningful:  # why it has no value: its valid judgments (a meaningful one keeps its shape)
            d["meaningful"] = False
            if self.n_valid is not None:
                d["n_valid"] = self.n_valid
            if self.n_judged is not None:
                d["n_judged"] = self.n_judged
            if self.min_items is not None:
                d.update(min_items=self.min_items, n_items=self.n_clusters)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, unit: str = "share") -> "Estimate":
        """Read an `as_dict` back, whichever bound keys it was stored with; NAN when absent."""
        if d and d.get("meaningful") is False:
            if d.get("min_items") is not None:
                return too_few(int(d.get("n") or 0), int(d.get("n_items") or 0), int(d["min_items"]), d.get("unit", unit))
            return not_meaningful(int(d.get("n") or 0), d.get("n_valid"), d.get("unit", unit), n_judged=d.get("n_judged"))
        if not d or _nan(d.get("value")):
            return NAN
        lo = d.get("lo", d.get("ci_low"))
        hi = d.get("hi", d.get("ci_high"))
        return cls(float(d["value"]), math.nan if lo is None else float(lo), math.nan if hi is None else float(hi),
                   int(d.get("n") or 0), d.get("unit", unit), p=d.get("p"), n_valid=d.get("n_valid"),
                   n_judged=d.get("n_judged"))

    @property
    def missing(self) -> bool:
        """Not measured (no unit of that kind); a not-meaningful estimate was measured: not missing."""
        return _nan(self.value) and self.meaningful

    def mark(self) -> str:
        """The not-meaningful mark of this estimate: 'n/m (0 of 24 valid)', or 'n/m (1 item; at least 5
        needed)' for one resting on too few items."""
        if self.min_items is not None:
            items = self.n_clusters or 0
            return f"{NOT_MEANINGFUL} ({items} item{'' if items == 1 else 's'}; at least {self.min_items} needed)"
        return not_meaningful_text(self.n_valid, self.n if self.n_judged is None else self.n_judged)

    def format(self, nd: int = 1, signed: bool = False) -> str:
        """'12.3 [8.1, 16.0]' (no interval when it is unknown); '–' when there is no value; the
        not-meaningful mark ('n/m (0 of 24 valid)') when too few judgments were valid."""
        if not self.meaningful:
            return self.mark()
        if self.missing:
            return "–"
        spec = f"+.{nd}f" if signed else f".{nd}f"
        text = format(self.value, spec)
        if _nan(self.lo) or _nan(self.hi):
            return text
        return f"{text} [{format(self.lo, spec)}, {format(self.hi, spec)}]"


NAN = Estimate(math.nan)


def not_meaningful(n: int, n_valid: int | None = None, unit: str = "share", **kw: Any) -> Estimate:
    """A not-meaningful estimate: no value, no interval, its counts."""
    return Estimate(math.nan, n=int(n), unit=unit, n_valid=None if n_valid is None else int(n_valid),
                    meaningful=False, **kw)


def too_few(n: int, n_items: int, min_items: int, unit: str = "share") -> Estimate:
    """A rate over `n` judgments of only `n_items` items, fewer than `min_items`: not meaningful."""
    return Estimate(math.nan, n=int(n), unit=unit, n_clusters=int(n_items), meaningful=False, min_items=int(min_items))


def checked(est: Estimate, n_valid: int, n_judged: int | None = None) -> Estimate:
    """`est` with its valid count (of `n_judged` judgments, default its n); not meaningful (no value)
    when too few of them were valid."""
    judged = est.n if n_judged is None else int(n_judged)
    if is_meaningful(n_valid, judged):
        return dataclasses.replace(est, n_valid=int(n_valid), n_judged=n_judged)
    return not_meaningful(est.n, n_valid, est.unit, n_clusters=est.n_clusters, n_judged=n_judged)


def difference(est: Estimate, *sides: Estimate | None) -> Estimate:
    """A difference `est` of the estimates `sides`: not meaningful when any side is not."""
    if all(s is None or s.meaningful for s in sides):
        return est
    return not_meaningful(est.n, None, est.unit, n_clusters=est.n_clusters)
