"""`flipguard data`: load (and so validate) a split, print counts, optionally export Items."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

from flipguard.config import parse_dataclasses
from flipguard.data.registry import register
from flipguard.data.schema import AIO_DATASET
from flipguard.data.unified import (
    DATASET_GROUPS,
    TEST_ONLY_DATASETS,
    build_train_split,
    is_sample_root,
    load_items,
    resolve_data_root,
)
from flipguard.files import atomic_write_text, check_replace

EXPORT_KIND = "dataset export"  # what `data --export FILE` writes (files.check_replace: a file's kind)


@dataclasses.dataclass
class DataArgs:
    split: str = dataclasses.field(default="test", metadata={"help": "test or train", "choices": ["test", "train"]})
    datasets: str = dataclasses.field(
        default="",
        metadata={"help": f"comma list of datasets or a group ({', '.join(DATASET_GROUPS)}); "
                          "default: all for test, the trainable ones for train"},
    )
    data_root: str = dataclasses.field(
        default="",
        metadata={"help": "data folder (layout: docs/data-root.md); default $FLIPGUARD_DATA, else the shipped samples"},
    )
    export: str = dataclasses.field(default="", metadata={"help": "write the items as Item JSONL to this path"})
    register: str = dataclasses.field(
        default="",
        metadata={"help": "register your own dataset: the path of its dataset.yaml (name, domain, splits: test/train "
                          "Item JSONL); afterwards --datasets NAME works in every command"},
    )
    replace: bool = dataclasses.field(
        default=False,
        metadata={"help": "with --register: take over a name already registered from other files"},
    )


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_dataclasses(
        argv, DataArgs, prog="flipguard data",
        description="Load (and so validate) a Unified Benchmark / r/AIO / registered split; print counts or "
                    "export it; or register your own dataset (--register path/to/dataset.yaml: see data/registry.py).",
    )
    if args.register:
        target = register(args.register, replace=args.replace)
        print(f"registered {args.register} as {target}; use it with --datasets {target.stem}")
        return 0
    if args.export:
        check_replace(args.export, kind=EXPORT_KIND, flag="--export")  # before any work: new, or an earlier export
    root = resolve_data_root(args.data_root or None)
    datasets = args.datasets or None
    excluded: dict[str, dict[str, int]] = {}
    if args.split == "train":
        split = build_train_split(datasets, root)
        items, excluded = split.items, split.excluded_counts()
    else:
        items = load_items(datasets, "test", root)

    where = "shipped samples" if is_sample_root(root) else str(root)
    print(f"split: {args.split}   data: {where}")
    counts = Counter(item.dataset for item in items)
    header = ("dataset", "items") + (("test ids removed", "same-question removed") if args.split == "train" else ())
    rows = [header]
    for dataset in dict.fromkeys(item.dataset for item in items):
        extra = excluded.get(dataset, {"id": 0, "question": 0})
        rows.append((dataset, str(counts[dataset]))
                    + ((str(extra["id"]), str(extra["question"])) if args.split == "train" else ()))
    rows.append(("total", str(len(items))) + (("", "") if args.split == "train" else ()))
    print(_table(rows))
    if args.split == "train" and not args.datasets:
        print(f"note: {', '.join(TEST_ONLY_DATASETS)} have test items only; truthfulqa and {AIO_DATASET} "
              "are evaluation-only")
    if args.export:
        # a file at a path of the user's choosing: it replaces only an earlier export, never a file flipguard
        # wrote as something else (a run's run.json or records) that happens to be there
        atomic_write_text(args.export, "".join(json.dumps(i.to_dict(), ensure_ascii=False) + "\n" for i in items),
                          kind=EXPORT_KIND)
        print(f"wrote {len(items)} items to {args.export}")
    return 0
