"""One estimate type for every protocol: a value with its interval, sample size and unit.

DDS, AFR and stick-or-switch metrics all return `Estimate`; reports serialise it into
their (unchanged) column names with `columns` / `as_dict`, and the comparison report
reads every protocol's summary back with `from_dict` and prints it with `format`.
Units: "share" (0-1, AFR rates), "%" (a rate in percent), "pp" (percentage points: a
difference of percentages, DDS and the SoS gaps).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

_SCALE = {"share": 1.0, "%": 100.0, "pp": 100.0}


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
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, unit: str = "share") -> "Estimate":
        """Read an `as_dict` back, whichever bound keys it was stored with; NAN when absent."""
        if not d or _nan(d.get("value")):
            return NAN
        lo = d.get("lo", d.get("ci_low"))
        hi = d.get("hi", d.get("ci_high"))
        return cls(float(d["value"]), math.nan if lo is None else float(lo), math.nan if hi is None else float(hi),
                   int(d.get("n") or 0), d.get("unit", unit), p=d.get("p"))

    @property
    def missing(self) -> bool:
        return _nan(self.value)

    def format(self, nd: int = 1, signed: bool = False) -> str:
        """'12.3 [8.1, 16.0]' (no interval when it is unknown); '–' when there is no value."""
        if self.missing:
            return "–"
        spec = f"+.{nd}f" if signed else f".{nd}f"
        text = format(self.value, spec)
        if _nan(self.lo) or _nan(self.hi):
            return text
        return f"{text} [{format(self.lo, spec)}, {format(self.hi, spec)}]"


NAN = Estimate(math.nan)
