"""Regenerate the shipped samples from a full data root (see PROVENANCE.md).

    python data/samples/make_samples.py /work/shared/data

Test and r/AIO samples are verbatim lines of the released files, so they go through the
same loader as the full data; train samples are Items from the full, leakage-checked
train split, since their raw sources are too large to ship.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from flipguard.data.schema import BENCHMARK_DATASETS
from flipguard.data.unified import SAMPLES_ROOT, build_train_split, test_file
from flipguard.files import atomic_write_text, shipped_sample

N_TEST = 20  # first rows in file order, per benchmark dataset
N_AIO_NOR, N_AIO_OR = 12, 8  # first rows of each op verdict in file order
N_TRAIN = 20  # seeded random sample per trainable dataset, kept in source order
SEED = 42


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main(argv: list[str]) -> int:
    source = Path(argv[0])
    out = SAMPLES_ROOT
    for dataset in BENCHMARK_DATASETS:
        lines = _lines(test_file(source, dataset))[:N_TEST]
        atomic_write_text(test_file(out, dataset), "\n".join(lines) + "\n", adopt=shipped_sample)

    wanted = {"NOR": N_AIO_NOR, "OR": N_AIO_OR}
    aio_lines = []
    for line in _lines(source / "dialdefer" / "aio" / "aio.jsonl"):
        verdict = json.loads(line)["ground_truth"]
        if wanted.get(verdict, 0) > 0:
            wanted[verdict] -= 1
            aio_lines.append(line)
    atomic_write_text(out / "dialdefer" / "aio" / "aio.jsonl", "\n".join(aio_lines) + "\n", adopt=shipped_sample)

    split = build_train_split(None, source)
    by_dataset: dict[str, list] = {}
    for item in split.items:
        by_dataset.setdefault(item.dataset, []).append(item)
    for dataset, items in by_dataset.items():
        picked = sorted(random.Random(f"{SEED}:{dataset}").sample(range(len(items)), N_TRAIN))
        text = "".join(json.dumps(items[i].to_dict(), ensure_ascii=False) + "\n" for i in picked)
        atomic_write_text(out / "train" / f"{dataset}.jsonl", text, adopt=shipped_sample)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
