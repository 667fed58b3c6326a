"""One bootstrap for every protocol: percentile intervals from resampling units with
replacement (scipy.stats.bootstrap's draw), seeded.

Two parameters cover what DDS, AFR and stick-or-switch need:
- paired: every sample passed in is resampled with the same row draw, so statistics
  over them (a difference, a ratio, DDS's four cases) are paired. Always on: a row is
  a unit (an item, a question).
- clusters: a label per row; rows are summed into their cluster first and clusters are
  resampled (AFR: the options of one question move together, Who Flips? §4.2). The
  statistic then sees per-cluster sums, the last sample being the rows per cluster.
A stratified (macro-averaged) interval is the percentile of the average of per-group
distributions, each group resampled with its own generator (`percentile_ci` over
`distribution`s). This is a module of its own, not part of eval/dds/metrics.py, because
metrics.py is the DDS task's and the AFR and SoS tasks must not import it.
"""

from __future__ import annotations

import math
import warnings
import zlib
from typing import Callable, Sequence

import numpy as np
import pandas as pd
from scipy.stats import bootstrap

N_BOOT = 2000
CONFIDENCE = 0.95
# Resamples are drawn in batches of about this many values (rows x replicates): bounded
# memory for large samples; the draws are the same as one batch (checked in the tests).
_BATCH_VALUES = 1 << 22


def rng_for(seed: int | np.random.Generator, name: str | None = None) -> np.random.Generator:
    """The generator for (seed, name): a named statistic's replicates do not depend on
    which others are computed (a subset of datasets reproduces the full run's CIs)."""
    if isinstance(seed, np.random.Generator):
        return seed
    if name is None:
        return np.random.default_rng(int(seed))
    return np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8"))])


def cluster_sums(values: Sequence[float], clusters: Sequence, universe: pd.Index) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster (sum of values, rows) aligned to `universe` (clusters absent: 0, 0)."""
    codes = universe.get_indexer(pd.Index(clusters))
    num = np.bincount(codes, weights=np.asarray(values, dtype=float), minlength=len(universe))
    den = np.bincount(codes, minlength=len(universe)).astype(float)
    return num, den


def distribution(
    samples: Sequence[np.ndarray], statistic: Callable, n_boot: int = N_BOOT,
    seed: int | np.random.Generator = 0, clusters: Sequence | None = None,
) -> np.ndarray:
    """Bootstrap distribution of `statistic(*samples, axis=-1)`, shape (..., n_boot).

    Rows of all samples are resampled together (paired). With `clusters`, the samples are
    first summed per cluster and a last sample of rows per cluster is appended, so the
    statistic is a function of cluster sums (e.g. `ratio`).
    """
    samples = _units(samples, clusters)
    n = len(samples[0])
    if n < 2:  # one unit: every replicate is the sample itself (scipy needs two)
        with np.errstate(invalid="ignore", divide="ignore"):
            value = np.asarray(statistic(*samples, axis=-1), dtype=float)
        return np.repeat(value[..., None], int(n_boot), axis=-1)
    batch = max(2, min(int(n_boot), _BATCH_VALUES // max(n, 1)) // 2 * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # replicates with no eligible unit give NaN; percentile_ci skips them
        res = bootstrap(tuple(samples), statistic, paired=True, vectorized=True, n_resamples=int(n_boot),
                        batch=None if batch >= n_boot else batch, method="percentile",
                        rng=rng_for(seed))
    return np.asarray(res.bootstrap_distribution, dtype=float)


def _units(samples: Sequence[np.ndarray], clusters: Sequence | None) -> list[np.ndarray]:
    """The resampled units: the rows, or per-cluster sums plus rows per cluster."""
    samples = [np.asarray(s, dtype=float) for s in samples]
    if clusters is None:
        return samples
    universe = pd.Index(pd.unique(np.asarray(clusters)))
    sums = [cluster_sums(s, clusters, universe) for s in samples]
    return [num for num, _ in sums] + [sums[0][1]]


def percentile_ci(dist: np.ndarray, confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over the last axis, skipping non-finite replicates; NaN when
    none is finite."""
    dist = np.asarray(dist, dtype=float)
    q = [100 * (1 - confidence) / 2, 100 * (1 - (1 - confidence) / 2)]
    if np.isfinite(dist).all():
        lo, hi = np.percentile(dist, q, axis=-1)
        return lo, hi
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows -> NaN
        lo, hi = np.nanpercentile(np.where(np.isfinite(dist), dist, np.nan), q, axis=-1)
    return lo, hi


def sd(dist: np.ndarray) -> np.ndarray:
    """Bootstrap standard error: the SD of the replicates (finite ones)."""
    dist = np.asarray(dist, dtype=float)
    if np.isfinite(dist).all():  # row by row: the same float sums as np.std of one statistic
        return np.array([np.std(row) for row in dist.reshape(-1, dist.shape[-1])]).reshape(dist.shape[:-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanstd(np.where(np.isfinite(dist), dist, np.nan), axis=-1)


def two_sided_p(dist: np.ndarray) -> float:
    """2 * min(P*(d <= 0), P*(d >= 0)) over the finite replicates of a difference."""
    d = np.asarray(dist, dtype=float)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return math.nan
    return float(min(1.0, 2 * min(np.mean(d <= 0), np.mean(d >= 0))))


def interval(
    samples: Sequence[np.ndarray], statistic: Callable, n_boot: int = N_BOOT,
    seed: int | np.random.Generator = 0, clusters: Sequence | None = None, confidence: float = CONFIDENCE,
) -> tuple[np.ndarray | float, np.ndarray | float]:
    """Percentile CI of `statistic` (see `distribution`); NaN with fewer than two units or
    no replicates; a zero-width interval at the value when every unit is the same."""
    units = _units(samples, clusters)
    if n_boot <= 0 or len(units[0]) < 2:
        with np.errstate(invalid="ignore", divide="ignore"):
            shape = np.shape(statistic(*units, axis=-1)) if len(units[0]) else ()
        return np.full(shape, math.nan)[()], np.full(shape, math.nan)[()]
    dist = distribution(units, statistic, n_boot, seed)
    return percentile_ci(dist, confidence)


# Statistics over resampled rows (axis = the row axis), for `distribution` / `interval`.


def mean(x, axis=-1):
    return np.mean(x, axis=axis)


def ratio(num, den, axis=-1):
    """sum(num) / sum(den): a rate over clusters (the cluster-bootstrap mean)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sum(num, axis=axis) / np.sum(den, axis=axis)
