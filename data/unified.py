"""Unified Benchmark loading: the paper's released test split and a leakage-free train split.

A data root has the layout of the shared data folder::

    dialdefer/benchmark/test/<dataset>.jsonl   released test items (DialDefer format)
    dialdefer/benchmark/full/<dataset>.jsonl   whole datasets (amqa, gpqa, socialiqa)
    dialdefer/aio/aio.jsonl                    r/AIO
    halueval/qa_data.json, harp/HARP_mcq.jsonl.zip, bbq/<Category>.jsonl   raw sources
    train/<dataset>.jsonl                      optional: a train split already in Item format
                                               (the shipped samples use this)

Without a data root (no argument, no $FLIPGUARD_DATA) the small samples shipped in
data/samples/ are used, through the same code path, so a fresh checkout works.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Iterable

from flipguard.config import did_you_mean
from flipguard.data import converters, registry
from flipguard.data.aio import read_aio_file
from flipguard.data.roots import (  # noqa: F401  (re-exported: the loaders' callers name them here)
    DATA_ENV,
    SAMPLES_ROOT,
    default_data_root,
    is_sample_root,
    resolve_data_root,
    shared_data_root,
)
from flipguard.data.schema import (
    AIO_DATASET,
    ALL_DATASETS,
    BENCHMARK_DATASETS,
    DOMAINS,
    EVAL_ONLY_DATASETS,
    DataError,
    Item,
    item_from_row,
    read_item_rows,
    require_text,
)
from flipguard.data.splits import check_no_leakage, exclude_test_overlap

log = logging.getLogger("flipguard.data")

SPLITS = ("test", "train")

# The released files spell HARP's `dataset` field "harp_mc".
DATASET_ALIASES = {"harp_mc": "harp_mcq"}
# Whole converted datasets were released for these; train = full minus test.
FULL_FILE_DATASETS = ("amqa", "gpqa", "socialiqa")
# Converted here from the raw public source (data/converters.py).
CONVERTED_DATASETS = ("halueval_qa", "harp_mcq", "bbq")
TRAINABLE_DATASETS = tuple(d for d in BENCHMARK_DATASETS if d in FULL_FILE_DATASETS + CONVERTED_DATASETS)
# Only the released test items exist for these (their full files were not retrievable).
TEST_ONLY_DATASETS = ("plausibleqa", "advisorqa")

DATASET_GROUPS: dict[str, tuple[str, ...]] = {
    "bench": BENCHMARK_DATASETS,
    "all": ALL_DATASETS,
    "trainable": TRAINABLE_DATASETS,
}

# Row fields that become Item fields (or are derivable from them) and so stay out of meta.
_CORE_FIELDS = {"id", "dataset", "question", "chosen_correct_answer", "chosen_incorrect_answer",
                "correct_chat", "incorrect_chat", "meta"}


# ---------------------------------------------------------------- dataset names


# Registered datasets resolved by parse_datasets (by name or entry path), for the loaders.
_LOOKED_UP: dict[str, "registry.DatasetEntry"] = {}


def registered_entry(name: str):
    """The registry entry of a non-built-in dataset name already parsed (or registered)."""
    return _LOOKED_UP.get(name) or registry.lookup(name)


def parse_datasets(datasets: str | Iterable[str] | None, default: Iterable[str],
                   groups_within: Iterable[str] | None = None) -> list[str]:
    """Names from a list, a comma-separated string or group names, in order, no repeats.
    With groups_within, a group contributes only its members in that set (so "all" means
    the trainable datasets for a train split) while a name given explicitly is kept."""
    if datasets is None or datasets == "" or datasets == []:
        return list(default)
    raw = datasets.split(",") if isinstance(datasets, str) else list(datasets)
    names: list[str] = []
    for token in (t.strip() for t in raw):
        if not token:
            continue
        if token in DATASET_GROUPS:
            expanded = [d for d in DATASET_GROUPS[token] if groups_within is None or d in groups_within]
        else:
            expanded = [DATASET_ALIASES.get(token, token)]
        if token not in DATASET_GROUPS and expanded[0] not in ALL_DATASETS:
            entry = registry.lookup(token)
            if entry is None:
                raise DataError(
                    f"unknown dataset {token!r}; valid datasets: {', '.join(ALL_DATASETS)}; "
                    f"registered: {', '.join(registry.registered()) or 'none'}; groups: {', '.join(DATASET_GROUPS)}; "
                    f"or a path to a dataset entry ({registry.ENTRY_FILE}, see flipguard data --help)"
                    + did_you_mean(token, [*ALL_DATASETS, *registry.registered(), *DATASET_GROUPS])
                )
            if entry.kind != "claims":
                raise DataError(f"{entry.source}: dataset {entry.name!r} is {entry.kind.replace('_', '-')}: "
                                f"use it with flipguard afr/sos --datasets, not as DDS claims")
            expanded = [entry.name]
            _LOOKED_UP[entry.name] = entry
        for name in expanded:
            if name not in names:
                names.append(name)
    if not names:
        raise DataError("no dataset named")
    return names


# ---------------------------------------------------------------- rows -> Items


def benchmark_row_to_item(row: dict[str, Any], dataset: str, split: str, where: str) -> Item:
    """A DialDefer-format row (released test/full files) as an Item."""
    item_id = row.get("id")
    if not isinstance(item_id, (str, int)) or str(item_id).strip() == "":
        raise DataError(f"{where}: field 'id' is missing or empty")
    declared = row.get("dataset")
    if declared is not None and DATASET_ALIASES.get(declared, declared) != dataset:
        raise DataError(f"{where}: row says dataset {declared!r} but the file holds {dataset!r}")
    question = require_text(row, "question", where)
    correct = require_text(row, "chosen_correct_answer", where)
    incorrect = require_text(row, "chosen_incorrect_answer", where)
    if correct.strip() == incorrect.strip():
        raise DataError(f"{where}: chosen_correct_answer and chosen_incorrect_answer are identical")
    meta = row.get("meta") or {}
    if not isinstance(meta, dict):
        raise DataError(f"{where}: field 'meta' must be an object")
    meta = dict(meta)
    for key, value in row.items():
        if key not in _CORE_FIELDS and value is not None:
            meta.setdefault(key, value)
    return Item(
        id=str(item_id),
        dataset=dataset,
        question=question,
        correct_answer=correct,
        incorrect_answer=incorrect,
        split=split,
        domain=DOMAINS[dataset],
        meta=meta,
    )


def item_row_to_item(row: dict[str, Any], dataset: str, split: str, where: str) -> Item:
    """A row already in Item format (the shipped train samples, `flipguard data --export`); an item
    without a domain gets its dataset's."""
    item = item_from_row(row, dataset, split, where)
    return dataclasses.replace(item, domain=item.domain or registry.domain_of(dataset) or "")


def read_items(path: str | Path, split: str | None = None) -> list[Item]:
    """An Item JSONL of any datasets (e.g. `flipguard data --export`), each row validated."""

    def to_item(row: dict[str, Any], where: str) -> Item:
        dataset = row.get("dataset")
        if dataset not in DOMAINS:
            raise DataError(f"{where}: unknown dataset {dataset!r}; valid datasets: {', '.join(ALL_DATASETS)}")
        return item_row_to_item(row, dataset, split or row.get("split") or "test", where)

    return read_item_rows(Path(path), to_item)


def read_benchmark_file(path: str | Path, dataset: str, split: str = "test") -> list[Item]:
    return read_item_rows(Path(path), lambda row, where: benchmark_row_to_item(row, dataset, split, where))


def read_item_file(path: str | Path, dataset: str, split: str) -> list[Item]:
    return read_item_rows(Path(path), lambda row, where: item_row_to_item(row, dataset, split, where))


# ---------------------------------------------------------------- paths


def test_file(root: Path, dataset: str) -> Path:
    return root / "dialdefer" / "benchmark" / "test" / f"{dataset}.jsonl"


def _must_exist(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DataError(f"{path}: {what} not found")
    return path


def _harp_source(root: Path) -> Path:
    for name in ("HARP_mcq.jsonl.zip", "HARD-Math_mcq.jsonl"):
        if (root / "harp" / name).is_file():
            return root / "harp" / name
    raise DataError(f"{root / 'harp' / 'HARP_mcq.jsonl.zip'}: HARP MCQ source not found")


def _raw_train_items(root: Path, dataset: str) -> list[Item]:
    """Every item of the dataset's whole source, test items included (removed later)."""
    prebuilt = root / "train" / f"{dataset}.jsonl"
    if prebuilt.is_file():
        return read_item_file(prebuilt, dataset, "train")
    if dataset in FULL_FILE_DATASETS:
        path = _must_exist(root / "dialdefer" / "benchmark" / "full" / f"{dataset}.jsonl", f"full {dataset} file")
        return read_benchmark_file(path, dataset, split="train")
    if dataset == "halueval_qa":
        return converters.convert_halueval(_must_exist(root / "halueval" / "qa_data.json", "HaluEval QA source"))
    if dataset == "harp_mcq":
        return converters.convert_harp(_harp_source(root))
    if dataset == "bbq":
        if not (root / "bbq").is_dir():
            raise DataError(f"{root / 'bbq'}: BBQ source folder not found")
        return converters.convert_bbq(root / "bbq")
    raise AssertionError(dataset)


# ---------------------------------------------------------------- splits


def _test_path(root: Path, dataset: str) -> Path:
    return root / "dialdefer" / "aio" / "aio.jsonl" if dataset == AIO_DATASET else test_file(root, dataset)


def load_test_items(datasets: Iterable[str], root: Path) -> list[Item]:
    datasets = list(datasets)
    builtin = [d for d in datasets if d in ALL_DATASETS]
    missing = [d for d in builtin if not _test_path(root, d).is_file()]
    if missing and len(builtin) > 1:
        present = [d for d in builtin if d not in missing]
        raise DataError(
            f"{root}: no test file for {len(missing)} of the {len(builtin)} datasets asked for: "
            f"{', '.join(f'{d} ({_test_path(root, d)})' for d in missing)}. "
            + (f"Choose the ones present: --datasets {','.join(present)}" if present else
               "This folder does not have the layout of a data root (docs/data-root.md)")
        )
    items: list[Item] = []
    for dataset in datasets:
        if dataset not in ALL_DATASETS:
            items += read_registered(registered_entry(dataset), "test")
        elif dataset == AIO_DATASET:
            items += read_aio_file(_must_exist(root / "dialdefer" / "aio" / "aio.jsonl", "r/AIO file"))
        else:
            items += read_benchmark_file(_must_exist(test_file(root, dataset), f"{dataset} test file"), dataset)
    return items


def _all_test_items(root: Path, required: Iterable[str]) -> list[Item]:
    """The test items a train split must not overlap: every test file present under root
    (all datasets, so cross-dataset duplicates count too); the requested ones must exist."""
    required = set(required)
    present = [
        d for d in ALL_DATASETS
        if d in required
        or (d == AIO_DATASET and (root / "dialdefer" / "aio" / "aio.jsonl").is_file())
        or (d != AIO_DATASET and test_file(root, d).is_file())
    ]
    return load_test_items(present, root)


@dataclasses.dataclass
class TrainSplit:
    """A built train split and what was kept out of it."""

    items: list[Item]
    # (dataset, kind, train id, test id) with kind "id" (a test item itself) or
    # "question" (a different source item whose normalised question is a test question)
    excluded: list[tuple[str, str, str, str]]
    data_root: Path

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for item in self.items:
            out[item.dataset] = out.get(item.dataset, 0) + 1
        return out

    def excluded_counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for dataset, kind, _, _ in self.excluded:
            out.setdefault(dataset, {"id": 0, "question": 0})[kind] += 1
        return out


def _check_trainable(names: list[str]) -> None:
    for name in names:
        if name in EVAL_ONLY_DATASETS:
            raise DataError(f"{name} is evaluation-only (paper Table 8): it has no train split")
        if name in TEST_ONLY_DATASETS:
            raise DataError(
                f"{name} has no train split here: only its released test items are available "
                f"(the full dataset was not in the DialDefer release); trainable: {', '.join(TRAINABLE_DATASETS)}"
            )


def build_train_split(datasets: str | Iterable[str] | None = None, data_root: str | Path | None = None) -> TrainSplit:
    """Whole sources minus test items, minus items whose normalised question equals a test
    question, then checked strictly for leakage."""
    names = parse_datasets(datasets, TRAINABLE_DATASETS, groups_within=TRAINABLE_DATASETS)
    own = [n for n in names if n not in ALL_DATASETS]
    names = [n for n in names if n in ALL_DATASETS]
    _check_trainable(names)
    root = resolve_data_root(data_root)
    if own and not names:
        return _registered_train_split(own, root)
    test = _all_test_items(root, names)
    items: list[Item] = []
    excluded: list[tuple[str, str, str, str]] = []
    for name in names:
        kept, leaks = exclude_test_overlap(_raw_train_items(root, name), test)
        items += kept
        excluded += [(name, kind, tr.id, te.id) for kind, tr, te in leaks]
        n_text = sum(1 for kind, _, _ in leaks if kind == "question")
        if n_text:
            log.info("%s: %d train item(s) excluded: question text equals a test question", name, n_text)
    check_no_leakage(items, test)
    split = TrainSplit(items=items, excluded=excluded, data_root=root)
    if own:
        extra = _registered_train_split(own, root)
        split.items += extra.items
        split.excluded += extra.excluded
    return split


def read_registered(entry: "registry.DatasetEntry", split: str) -> list[Item]:
    """A registered dataset's split file; items without a domain get the entry's."""
    items = read_item_file(entry.split_file(split), entry.name, split)
    return [it if it.domain else dataclasses.replace(it, domain=entry.domain) for it in items]


def _registered_train_split(names: list[str], root: Path) -> TrainSplit:
    """A registered dataset's train file minus anything that overlaps its own test file."""
    items: list[Item] = []
    excluded: list[tuple[str, str, str, str]] = []
    for name in names:
        entry = registered_entry(name)
        test = read_registered(entry, "test") if "test" in entry.splits else []
        kept, leaks = exclude_test_overlap(read_registered(entry, "train"), test)
        check_no_leakage(kept, test)
        items += kept
        excluded += [(name, kind, tr.id, te.id) for kind, tr, te in leaks]
    return TrainSplit(items=items, excluded=excluded, data_root=root)


def load_benchmark(split: str = "test", datasets: str | Iterable[str] | None = None,
                   data_root: str | Path | None = None) -> list[Item]:
    """Unified Benchmark items. "test": the paper's released evaluation items (all nine
    datasets by default). "train": every other item of the trainable datasets."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    if split == "test":
        names = parse_datasets(datasets, BENCHMARK_DATASETS, groups_within=BENCHMARK_DATASETS)
    else:
        names = parse_datasets(datasets, TRAINABLE_DATASETS, groups_within=TRAINABLE_DATASETS)
    if split == "train":
        return build_train_split(names, data_root).items
    if AIO_DATASET in names:
        raise DataError("r/AIO is not part of the Unified Benchmark: use load_items or load_aio")
    return load_test_items(names, resolve_data_root(data_root))


def load_items(datasets: str | Iterable[str] | None = None, split: str = "test",
               data_root: str | Path | None = None) -> list[Item]:
    """Benchmark and/or r/AIO items; datasets may be names, groups ("bench", "all") or a comma list."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    if split == "train":
        return build_train_split(datasets, data_root).items
    names = parse_datasets(datasets, ALL_DATASETS)
    return load_test_items(names, resolve_data_root(data_root))
