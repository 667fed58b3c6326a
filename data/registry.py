"""Datasets beyond the paper's: the shipped organism domain and the user's own.

A registered dataset is Item-schema JSONL files (one per split) plus a small entry file:

    # my_claims/dataset.yaml
    name: my_claims            # not a built-in name (truthfulqa, bbq, ..., aio)
    domain: Legal              # the report's Domain column
    description: contract clauses judged by lawyers
    splits:                    # paths relative to this file
      test: test.jsonl
      train: train.jsonl       # optional: only datasets with a train split make pairs

A multiple-choice dataset (for `flipguard afr --dataset` and `flipguard sos --dataset`) adds
`kind: multiple_choice`; its JSONL rows are {id, question, options: [..], answer: "B"}
(optional subject, category), one per line.

Use it by path (`--datasets my_claims/dataset.yaml`) or register it once
(`flipguard data --register my_claims/dataset.yaml`, which writes the entry with absolute
paths to $FLIPGUARD_HOME/datasets/) and then by name (`--datasets my_claims`). The group
names all/bench keep meaning the paper's datasets; registered ones are named explicitly.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from flipguard.config import did_you_mean
from flipguard.data.mmlu import LETTERS, MCQItem
from flipguard.data.schema import ALL_DATASETS, DOMAINS, DataError, item_from_row, read_item_rows, read_jsonl
from flipguard.files import atomic_write_text, flipguard_home, load_yaml

ENTRY_FILE = "dataset.yaml"
SHIPPED_ENTRIES = tuple(Path(__file__).resolve().parent / d / ENTRY_FILE for d in ("organism", "organism_mc"))
ENTRY_SPLITS = ("test", "train")
KINDS = ("claims", "multiple_choice")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
    name: str
    domain: str
    splits: dict[str, Path]
    description: str = ""
    source: Path | None = None
    kind: str = "claims"

    def split_file(self, split: str) -> Path:
        if split not in self.splits:
            raise DataError(f"{self.source}: dataset {self.name!r} has no {split!r} split "
                            f"(it lists {', '.join(self.splits) or 'none'})")
        path = self.splits[split]
        if not path.is_file():
            raise DataError(f"{self.source}: {split} file {path} not found")
        return path


def read_entry(path: str | Path) -> DatasetEntry:
    """Parse and check one entry file; errors name the file and the key."""
    path = Path(path)
    # bytes that are not UTF-8, broken YAML and a key given twice: one line naming path:line
    raw, _ = load_yaml(path, DataError, "dataset entry")
    if not isinstance(raw, dict):
        raise DataError(f"{path}: a dataset entry is a mapping with name, domain and splits")
    unknown = sorted(set(raw) - {"name", "kind", "domain", "description", "splits"})
    if unknown:
        raise DataError(f"{path}: unknown key(s) {unknown}; expected name, kind, domain, description, splits")
    kind = raw.get("kind", "claims")
    if kind not in KINDS:
        raise DataError(f"{path}: 'kind' must be one of {list(KINDS)}, got {kind!r}")
    name, domain, splits = raw.get("name"), raw.get("domain"), raw.get("splits")
    if not isinstance(name, str) or not _NAME.match(name):
        raise DataError(f"{path}: 'name' must be a lower-case identifier (letters, digits, _), got {name!r}")
    if name in ALL_DATASETS or name in ("all", "bench", "trainable", "mmlu", "medqa", "medmcqa"):
        raise DataError(f"{path}: {name!r} is a built-in dataset or group name; choose another name")
    if not isinstance(domain, str) or not domain.strip():
        raise DataError(f"{path}: 'domain' must be a non-empty string (the report's Domain column)")
    if not isinstance(splits, dict) or not splits:
        raise DataError(f"{path}: 'splits' must map split names ({', '.join(ENTRY_SPLITS)}) to JSONL files")
    bad = sorted(set(splits) - set(ENTRY_SPLITS))
    if bad:
        raise DataError(f"{path}: unknown split(s) {bad}; expected some of {list(ENTRY_SPLITS)}")
    files = {}
    for split, file in splits.items():
        if not isinstance(file, str) or not file.strip():
            raise DataError(f"{path}: splits.{split} must be a file path")
        files[split] = (path.parent / file).resolve()
    return DatasetEntry(name, domain.strip(), files, str(raw.get("description") or ""), path.resolve(), kind)


def user_registry_dir() -> Path:
    return flipguard_home() / "datasets"


def registered() -> dict[str, DatasetEntry]:
    """Shipped entries, then $FLIPGUARD_HOME/datasets/*.yaml (a name registered twice is an error)."""
    entries: dict[str, DatasetEntry] = {}
    folder = user_registry_dir()
    paths = list(SHIPPED_ENTRIES) + (sorted(folder.glob("*.yaml")) if folder.is_dir() else [])
    for path in paths:
        entry = read_entry(path)
        if entry.name in entries:
            raise DataError(f"{path}: dataset {entry.name!r} is already registered by {entries[entry.name].source}")
        entries[entry.name] = entry
    return entries


def lookup(token: str) -> DatasetEntry | None:
    """The entry a --datasets token names: a path to an entry file, or a registered name."""
    if token.endswith((".yaml", ".yml")) or "/" in token:
        return read_entry(token)
    return registered().get(token)


def domain_of(dataset: str) -> str | None:
    if dataset in DOMAINS:
        return DOMAINS[dataset]
    try:
        entry = registered().get(dataset)
    except DataError:
        return None
    return entry.domain if entry else None


def register(path: str | Path, replace: bool = False) -> Path:
    """Copy an entry (split paths made absolute) into the user registry; returns its path.
    A name registered from other files is refused unless `replace`."""
    entry = read_entry(path)
    check_split_files(entry)
    existing = registered().get(entry.name)
    target = user_registry_dir() / f"{entry.name}.yaml"
    if existing and (existing.source != target.resolve() or (existing.splits != entry.splits and not replace)):
        what = f"from {', '.join(str(p) for p in existing.splits.values())}" if existing.source == target.resolve() \
            else f"by {existing.source}"
        hint = "" if existing.source != target.resolve() else "; pass --replace to register these files instead"
        raise DataError(f"{path}: dataset {entry.name!r} is already registered {what}{hint}")
    target.parent.mkdir(parents=True, exist_ok=True)
    body = {"name": entry.name, **({"kind": entry.kind} if entry.kind != "claims" else {}), "domain": entry.domain, "description": entry.description,
            "splits": {s: str(p) for s, p in entry.splits.items()}}
    atomic_write_text(target, f"# registered from {Path(path).resolve()}\n" + yaml.safe_dump(body, sort_keys=False))
    return target


def check_split_files(entry: DatasetEntry) -> None:
    """Every split file of an entry read as its kind's rows are read when used (UTF-8, one JSON
    object a line, the schema's fields): a bad row is refused at registration, naming file:line,
    not later by the first command that names the dataset."""
    for split in entry.splits:  # an empty file is refused too (schema.parse_jsonl_lines)
        if entry.kind == "multiple_choice":
            read_mc_rows(entry, split)
        else:
            read_item_rows(entry.split_file(split), lambda row, where: item_from_row(row, entry.name, split, where))


def mc_entry(token: str) -> DatasetEntry:
    """The registered multiple-choice dataset a --datasets token names (name or entry path)."""
    entry = lookup(token)
    if entry is None:
        mc = [n for n, e in registered().items() if e.kind == "multiple_choice"]
        raise DataError(f"unknown dataset {token!r}: not a built-in multiple-choice dataset (medqa, medmcqa, mmlu) "
                        f"nor a registered one ({', '.join(mc) or 'none'}); or give the path of a dataset entry with "
                        f"kind: multiple_choice (see flipguard data --help){did_you_mean(token, ['medqa', 'medmcqa', 'mmlu', *mc])}")
    if entry.kind != "multiple_choice":
        raise DataError(f"{entry.source}: dataset {entry.name!r} is not multiple-choice (add kind: multiple_choice)")
    return entry


def load_mc(token: str, split: str) -> list:
    """MCQItems of a registered multiple-choice dataset's split; a bad row names file and line."""
    return read_mc_rows(mc_entry(token), split)


def read_mc_rows(entry: DatasetEntry, split: str) -> list:
    """MCQItems of a multiple-choice entry's split file; a bad row names file and line."""
    path = entry.split_file(split)
    items, seen = [], set()
    for lineno, row in read_jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row is a JSON object with id, question, options, answer")
        missing = [k for k in ("id", "question", "options", "answer") if k not in row]
        if missing:
            raise DataError(f"{where}: missing field(s) {missing}")
        options = row["options"]
        if not isinstance(options, list) or not 2 <= len(options) <= len(LETTERS) \
                or not all(isinstance(o, str) and o.strip() for o in options):
            raise DataError(f"{where}: 'options' must be a list of 2-{len(LETTERS)} non-empty strings")
        answer = row["answer"]
        if not isinstance(answer, str) or answer not in LETTERS[: len(options)]:
            raise DataError(f"{where}: 'answer' must be one of the option letters {LETTERS[:len(options)]}, got {answer!r}")
        if not isinstance(row["question"], str) or not row["question"].strip():
            raise DataError(f"{where}: 'question' must be a non-empty string")
        item_id = str(row["id"])
        if item_id in seen:
            raise DataError(f"{where}: duplicate id {item_id!r}")
        seen.add(item_id)
        subject = str(row.get("subject") or entry.name)
        items.append(MCQItem(id=item_id, subject=subject, category=str(row.get("category") or entry.domain),
                             question=row["question"], options=options, answer=answer, split=split,
                             dataset=entry.name, subcategory=str(row.get("subcategory") or subject)))
    if not items:
        raise DataError(f"{path}: no items")
    return items
