"""Synthetic DDS records shaped like a real run, for timing (bench/bench_dds.py) and
tests of the report; one generator so the benchmark and the tests time the same data."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from flipguard.eval.records import CASES, EXPECTED_CHOICE, Record, request_key

# Paper Table 1 evaluation sizes: 2,964 Unified Benchmark test items + 280 r/AIO = 3,244.
PAPER_SIZES = {"truthfulqa": 790, "halueval_qa": 300, "plausibleqa": 300, "bbq": 300, "socialiqa": 300,
               "amqa": 240, "harp_mcq": 300, "gpqa": 134, "advisorqa": 300, "aio": 280}


def synthetic_records(sizes: Mapping[str, int] | None = None, seed: int = 0, model: str = "synthetic",
                      invalid_rate: float = 0.01, accuracies: Mapping[str, float] | None = None) -> list[Record]:
    """Random, seeded DDS records: per dataset each case right with probability
    `accuracies[case]` (default: drawn per dataset from U(0.3, 0.9)), `invalid_rate`
    unparsed outputs, OR/NOR strata on r/AIO (every ninth item OR)."""
    rng = np.random.default_rng(seed)
    sizes = dict(PAPER_SIZES if sizes is None else sizes)
    out = []
    for ds, n in sizes.items():
        p = rng.uniform(0.3, 0.9, size=4) if accuracies is None else [accuracies[c] for c in CASES]
        for i in range(n):
            iid = f"{ds}-{i:04d}"
            for case, pc in zip(CASES, p):
                exp = EXPECTED_CHOICE[case]
                valid = rng.random() >= invalid_rate
                choice = (exp if rng.random() < pc else ("2" if exp == "1" else "1")) if valid else None
                out.append(Record(
                    key=request_key(model=model, item_id=iid, dataset=ds, case=case), protocol="dds",
                    item_id=iid, dataset=ds, case=case, expected=exp, model=model, backend="synthetic",
                    mode="generate", choice=choice, valid=valid, raw_output=choice,
                    extra={"stratum": "OR" if i % 9 == 0 else "NOR"} if ds == "aio" else {},
                ))
    return out
