"""The one record format that flows data -> eval -> flip records -> pairs -> report.

Every model judgment is one JSON line in RUN_DIR/records.jsonl. A record is keyed by a
content hash of the request (model, mode, decoding settings and the exact messages),
so re-running a command skips what is already there: an interrupted run (even
kill -9) loses nothing and duplicates nothing. Lines are appended with a single
O_APPEND write.

Writers and readers:
- one writer per run directory: `run_lock(RUN_DIR)` (fcntl.flock on RUN_DIR/.lock, held
  for the whole run, the file naming the holder) is taken by eval, afr, sos and
  import-records, all through `open_run_dir` (which also refuses another protocol's run
  and writes run.json as a `RunLog`: one typed header - protocol, format_version,
  flipguard_version, created, updated, invocations, computed - and the protocol's own
  keys); a second writer is refused with a message naming the holder.
- readers (`read_records`, `load_records`, reports, compare) never modify a file: a last
  line without its newline that does not parse is a write in progress (or torn by a
  crash) and is skipped, never cut; `load_records` keeps one record per key.
- a writer (`RecordStore`) repairs a torn tail when it opens the file under the lock:
  a last line that parses gets its newline, one that does not parse is cut.

Every folder flipguard writes into carries its manifest (`.flipguard.json`, files.py: the
ownership rule, docs/reliability-ownership.md): run.json and reports with their sha256,
records.jsonl as an append-only log (claimed before its first line; a records file that is
not flipguard's is refused before any repair). Published folders (pair sets, merged models)
list their files there too; `publish_dir` (publish.py) replaces only those and refuses a
non-empty directory it did not write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator

from flipguard import __version__
from flipguard.errors import RecordError, write_failed

# the atomic writers live with the other file helpers; re-exported for callers of this module
from flipguard.files import (  # noqa: F401
    OWNER_FILE,
    atomic_write_text,
    claim,
    dumps_utf8,
    now_iso,
    read_manifest,
    refuse_link,
)
from flipguard.redact import redact

RECORDS_FILE = "records.jsonl"
RUN_META_FILE = "run.json"
LOCK_FILE = ".lock"
# every protocol's report of a run: RUN/report/summary.md and the tables and figures beside it
REPORT_DIR = "report"
REPORT_SUMMARY = f"{REPORT_DIR}/summary.md"

# The four DDS cases, in the paper's order, with the answer that is right in each.
CASES = ("c1_true", "c1_false", "c2_correct", "c2_incorrect")
EXPECTED_CHOICE = {"c1_true": "1", "c1_false": "2", "c2_correct": "1", "c2_incorrect": "2"}
C1_CASES = ("c1_true", "c1_false")
C2_CASES = ("c2_correct", "c2_incorrect")


@dataclasses.dataclass(frozen=True)
class ProtocolFields:
    """What one protocol's records carry beyond the fields every record has: the Record
    fields it owns (of OWNED_FIELDS) and the keys it puts in `extra`."""

    fields: frozenset[str] = frozenset()
    extra: frozenset[str] = frozenset()


# Record fields that belong to some protocols only. A record of a protocol that does not own
# one leaves it out of records.jsonl while it holds its default (`Record.from_dict` fills the
# default back in, so every line written before reads the same); a value it does set is kept.
OWNED_FIELDS = ("speakers", "template", "p1", "p2")
# `extra` keys the runner (eval/runner.py) adds to any protocol's records
RUNNER_EXTRA = frozenset({"min_label_mass", "probs", "no_label_in_top_logprobs"})
# The built-in protocols' own fields and extra keys (a user's task declares none: its records
# keep whatever it sets).
PROTOCOL_FIELDS: dict[str, ProtocolFields] = {
    # speakers/template: the prompt's labels and version; p1/p2: P("1"), P("2") in logprob mode;
    # extra: r/AIO's stratum, and what import-records keeps of the source line
    "dds": ProtocolFields(frozenset({"speakers", "template", "p1", "p2"}),
                          frozenset({"stratum", "source_file", "source_line", "recovered", "effective_ground_truth",
                                     "answer_json_type"})),
    "afr": ProtocolFields(extra=frozenset({"subject", "category", "model_ref", "condition", "k", "source_model",
                                           "target_option"})),
    "sos": ProtocolFields(frozenset({"template"}),
                          frozenset({"scenario", "turn", "repeat", "seed", "branch", "n_turns", "target",
                                     "options_shown", "roles", "offered"})),
}
# Runs another tool made, read in by `flipguard import` (eval/interop): the sample's scores mapped to
# 0-1 and as the tool kept them, what pairs it (unit, signature) and what the tool keeps per sample
IMPORTED_EXTRA = frozenset({"unit", "signature", "scores", "score_values", "explanations", "metadata", "target",
                            "epoch", "error", "doc", "filter", "source_file", "source_line"})
PROTOCOL_FIELDS.update({"inspect": ProtocolFields(extra=IMPORTED_EXTRA), "lm-eval": ProtocolFields(extra=IMPORTED_EXTRA)})


@dataclasses.dataclass
class Record:
    """One judgment: the fields every protocol's records have, the fields some protocols own
    (OWNED_FIELDS, declared per protocol in PROTOCOL_FIELDS), and the protocol's own keys in
    `extra` (AFR's k, a stick-or-switch turn; declared there too)."""

    key: str
    protocol: str
    item_id: str
    dataset: str
    case: str
    expected: str | None
    model: str
    backend: str
    mode: str
    mitigation: str = "none"
    speakers: list[str] = dataclasses.field(default_factory=lambda: ["Speaker 1", "Speaker 2"])
    template: str = "v0"
    split: str = "test"
    messages: list[dict[str, str]] | None = None
    raw_output: str | None = None
    choice: str | None = None
    valid: bool = False
    p1: float | None = None
    p2: float | None = None
    reasoning: str | None = None
    time: str = ""
    latency_s: float | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def correct(self) -> bool:
        """An invalid output is never correct (it is counted, not dropped)."""
        return self.valid and self.choice == self.expected

    @property
    def label_mass(self) -> float | None:
        """logprob mode: mass on the answer labels (P("1") + P("2"), or the sum of
        extra["probs"] for other labels); None for a generated reply."""
        if self.p1 is not None and self.p2 is not None:
            return float(self.p1 + self.p2)
        probs = (self.extra or {}).get("probs")
        return float(sum(probs.values())) if isinstance(probs, dict) and probs else None

    def to_dict(self) -> dict[str, Any]:
        """The records.jsonl line: every field, less the OWNED_FIELDS this record's protocol
        does not own and that hold their default."""
        row = dataclasses.asdict(self)
        owned = PROTOCOL_FIELDS.get(self.protocol, ProtocolFields()).fields
        for name in OWNED_FIELDS:
            if name not in owned and row[name] == _FIELD_DEFAULTS[name]:
                del row[name]
        return row

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "Record":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(row) - names
        if unknown:
            raise RecordError(f"unknown record fields: {sorted(unknown)}")
        return cls(**row)


_FIELD_DEFAULTS = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                   for f in dataclasses.fields(Record) if f.name in OWNED_FIELDS}


def request_key(**content: Any) -> str:
    """Content hash of a request; the same request always gets the same key."""
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    # surrogatepass: a lone surrogate (seen in released model outputs) hashes instead of
    # crashing; every other string encodes exactly as UTF-8, so existing keys are unchanged
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def keyed(record: Record, gen_config: Any = None, choices: Iterable[str] = ("1", "2")) -> Record:
    """Set the record's content key from everything that determines the model's output
    (`gen_config`: a GenerationConfig; its key() is the decoding of a generated reply)."""
    decoding = gen_config.key() if record.mode == "generate" and gen_config else {"choices": list(choices)}
    record.key = request_key(
        protocol=record.protocol,
        item_id=record.item_id,
        dataset=record.dataset,
        case=record.case,
        model=record.model,
        mode=record.mode,
        messages=record.messages,
        decoding=decoding,
        extra=record.extra,
    )
    return record


def pending_record(item: Any, *, gen_config: Any = None, choices: Iterable[str] = ("1", "2"), **fields: Any) -> Record:
    """The one builder of a request still to run (no output yet), keyed: item_id, dataset
    and split come from `item` (any item type with id/dataset[/split]) unless given."""
    base = {"item_id": item.id, "dataset": item.dataset}
    if hasattr(item, "split"):
        base["split"] = item.split
    return keyed(Record(key="", **{**base, **fields}), gen_config, choices)


def _parse_line(line: str, path: Path, lineno: int) -> Record:
    try:
        return Record.from_dict(json.loads(line))
    except (json.JSONDecodeError, TypeError, RecordError) as exc:
        raise RecordError(f"{path}:{lineno}: bad record ({exc})") from None


def read_records(path: str | os.PathLike) -> Iterator[Record]:
    """Every complete record of a records file, read-only.

    A last line without its newline is kept when it parses (a complete record whose
    newline is missing) and skipped when it does not (a write in progress or a torn
    tail): the file is never modified, so a reader never races a writer."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb") as fh:
        lineno = 0
        for raw in fh:
            lineno += 1
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if not raw.endswith(b"\n"):
                    return  # a partial multi-byte character at the tail
                raise RecordError(f"{path}:{lineno}: bad record (not UTF-8: {exc.reason})") from None
            if not raw.endswith(b"\n"):
                try:
                    json.loads(line)
                except json.JSONDecodeError:
                    return  # partial last line: not a record (yet)
            yield _parse_line(line, path, lineno)


class RecordStore:
    """Append-only JSONL of records with resume by key (the writer's view: take
    `run_lock` on the run directory first; readers use `read_records`). The file is read
    once: `stored` holds its records by key (the first per key, as `load_records`), and
    every record appended after. A `mirror` (a data-parallel rank other than the writer, which
    holds the lock) reads the file the writer prepared and keeps what it appends in memory only,
    so every rank sees the same records and one process writes them."""

    def __init__(self, path: str | os.PathLike, mirror: bool = False):
        self.path = Path(path)
        self.mirror = mirror
        self.stored: dict[str, Record] = {}
        self.claimed = False
        if not mirror:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            check_records_owned(self.path)  # before the repair: a file that is not flipguard's is never cut
            self._repair_torn_tail()
        for rec in self.iter_records():
            self.stored.setdefault(rec.key, rec)

    def _repair_torn_tail(self) -> None:
        """A last line without newline: add the newline when it is a whole JSON record,
        cut it when it does not parse (the write a crash interrupted)."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with os.fdopen(os.open(self.path, os.O_RDWR | os.O_NOFOLLOW), "rb+") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) == b"\n":
                return
            fh.seek(0)
            data = fh.read()
            cut = data.rfind(b"\n") + 1
            try:
                json.loads(data[cut:].decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                fh.truncate(cut)
            else:
                fh.seek(0, os.SEEK_END)
                fh.write(b"\n")
            fh.flush()
            os.fsync(fh.fileno())

    def iter_records(self) -> Iterator[Record]:
        return read_records(self.path)

    def __contains__(self, key: str) -> bool:
        return key in self.stored

    def __len__(self) -> int:
        return len(self.stored)

    def append(self, records: Iterable[Record]) -> int:
        """Append records not yet stored; each line goes out in one O_APPEND write."""
        n = 0
        if self.mirror:
            for rec in records:
                if rec.key not in self.stored:
                    self.stored[rec.key] = rec
                    n += 1
            return n
        if not self.claimed:  # recorded as flipguard's before its first line is written
            claim(self.path.parent, self.path.name, log=True)
            self.claimed = True
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            refuse_link(self.path)
            raise _write_error(self.path, exc, n) from None
        try:
            for rec in records:
                if rec.key in self.stored:
                    continue
                data = (dumps_utf8(rec.to_dict()) + "\n").encode("utf-8")
                while data:  # a short write (disk nearly full, file size limit) continues
                    data = data[os.write(fd, data):]
                self.stored[rec.key] = rec
                n += 1
            os.fsync(fd)
        except OSError as exc:
            # disk full, quota, file too large, a read-only remount: the records written
            # so far are kept (a torn last line is cut by the next writer); rerun resumes
            raise _write_error(self.path, exc, n) from None
        finally:
            os.close(fd)
        return n


def check_records_owned(path: Path) -> None:
    """A records file a writer is about to append to (and repair) must be flipguard's: listed as
    a log in its folder's manifest. Anything else (the user's file; a run from before flipguard
    recorded what it wrote) is refused, unmodified."""
    refuse_link(path.parent)
    refuse_link(path)
    if not os.path.lexists(path):
        return
    doc = read_manifest(path.parent)
    if doc is not None and path.name in doc["logs"]:
        return
    why = (f"not listed in {path.parent / OWNER_FILE}" if doc is not None else
           f"no {OWNER_FILE} beside it: a file of yours, or a run from before flipguard recorded what it wrote")
    raise RecordError(f"{path}: exists and was not written by flipguard ({why}); nothing was changed: move it away "
                      "or choose another --out")


def _write_error(path: Path, exc: OSError, n: int) -> RecordError:
    return write_failed(
        f"{path}: cannot write records ({exc.strerror or exc}); {n} record(s) of this batch were written and "
        "everything stored before is kept. Free space (or fix the permissions) and rerun the same command to resume",
        exc, path)


class RunDirBusy(RecordError):
    """Another process holds the run directory's writer lock."""


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("/flipguard", "flipguard")):
        argv[0] = "flipguard"
    return redact(" ".join(argv))[:500]


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike, command: str | None = None) -> Iterator[Path]:
    """Hold RUN_DIR/.lock (fcntl.flock, exclusive) for the block: one writer per run
    directory. The lock file names the holder (pid, command, since); a second writer
    gets RunDirBusy naming it. The kernel drops the lock when the holder exits (even
    on kill -9), so a stale .lock file never blocks a rerun."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RecordError(f"{run_dir}: exists and is not a directory; use another --out")
    created = not run_dir.exists()
    lock_created = created or not (run_dir / LOCK_FILE).exists()
    refuse_link(run_dir / LOCK_FILE)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        refuse_link(run_dir / LOCK_FILE)
        raise RecordError(f"{run_dir}: cannot write the run directory ({exc.strerror})") from None
    failed = True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            try:
                info = json.loads(holder)
                holder = f"pid {info.get('pid')}, `{info.get('command')}`, since {info.get('since')}"
            except (json.JSONDecodeError, AttributeError):
                holder = holder or "holder not yet named"
            raise RunDirBusy(
                f"{run_dir}: another flipguard process is writing this run directory ({holder}; "
                f"lock {run_dir / LOCK_FILE}); wait for it to finish or use another --out"
            ) from None
        info = {"pid": os.getpid(), "command": command or _command_line(), "since": now_iso()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
        yield run_dir
        failed = False
    finally:
        if failed and lock_created:
            # refused before writing anything (bad input, an oversized item, a folder that is
            # not ours): leave only what was there before, no lock file and no empty run directory
            try:
                if not created or os.listdir(run_dir) == [LOCK_FILE]:
                    os.unlink(run_dir / LOCK_FILE)
                if created:
                    os.rmdir(run_dir)
            except OSError:
                pass
        os.close(fd)  # releases the flock


def refuse_busy(path: str | os.PathLike, what: str = "read") -> None:
    """Readers respect writers: PATH (a run, comparison or study folder) or a folder above it
    (a study holding its stages) whose writer lock a live process holds is refused, naming the
    holder. Nothing is created: a lock file is only opened when it is there."""
    path = Path(path).absolute()
    for folder in [path, *list(path.parents)[:3]]:
        lock = folder / LOCK_FILE
        if lock.is_symlink() or not lock.is_file():
            continue
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            try:
                info = json.loads(holder)
                holder = f"pid {info.get('pid')}, `{info.get('command')}`"
            except (json.JSONDecodeError, AttributeError):
                holder = "holder not yet named"
            raise RunDirBusy(f"{folder}: a flipguard process is writing it ({holder}); nothing was {what}: wait for it "
                             "to finish and rerun") from None
        finally:
            os.close(fd)


# what a folder of flipguard's output is, by the file that makes it one: a folder holds one kind
FOLDER_KINDS = {"run": RUN_META_FILE, "study": "study.json", "comparison": "comparison.json"}
KIND_WRITERS = {"run": "flipguard eval, afr, sos, run or import", "study": "flipguard study or demo",
                "comparison": "flipguard compare"}


def refuse_other_kind(folder: str | os.PathLike, kind: str, flag: str = "--out") -> None:
    """A folder holds one kind of flipguard output (FOLDER_KINDS): a run, a study or a comparison. Writing
    `kind` into a folder that holds another is refused in one line, before anything is written there (its
    subfolders are other folders: a study's runs and comparison live in its own)."""
    folder = Path(folder)
    for other, marker in FOLDER_KINDS.items():
        if other != kind and (folder / marker).is_file():
            raise RecordError(f"{flag} {folder}: holds a flipguard {other} ({marker}, written by {KIND_WRITERS[other]}); "
                              f"a {kind} goes in a folder of its own: give another {flag} (nothing was written)")


def refuse_other_protocol(run_dir: str | os.PathLike, protocol: str) -> None:
    """A run directory holds one protocol: refuse to write `protocol` records into a run
    whose run.json names another one."""
    old = load_run_meta(run_dir).get("protocol")
    if old is not None and old != protocol:
        raise RecordError(
            f"{Path(run_dir) / RUN_META_FILE}: holds a {old!r} run, not {protocol!r}; use another --out"
        )


# run.json's format: RunLog.format_version. 0 = a file written before the field existed
# (read as it is; the next write of that run directory stamps the current version).
RUN_LOG_VERSION = 1


@dataclasses.dataclass
class RunLog:
    """run.json, typed: one versioned log per run directory, for every protocol (the header of
    inspect_ai's EvalLog, in one JSON file). The header fields are typed; the protocol's own
    keys (`Task.meta()`, `Task.finish()`: model, mode, settings ...) are `task_meta` and sit
    flat beside the header in the file, as they always have, so every run.json written before
    this class existed reads unchanged. Written only by `RunDir.write_meta`, read only by
    `read_run_log` / `load_run_meta`."""

    protocol: str | None = None  # None: a run.json from before the header (hand-made, or very old)
    flipguard_version: str | None = None
    created: str | None = None
    updated: str | None = None
    format_version: int = RUN_LOG_VERSION
    # each invocation of the run: {"time", "calls" (requests sent per batch), "calls_total"}
    invocations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # model label -> what its backend computed with (Backend.computed: dtype, label tokens)
    computed: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    task_meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    # header key -> the types its value may have in the file
    HEADER_TYPES: ClassVar[dict[str, tuple[type, ...]]] = {
        "protocol": (str, type(None)), "flipguard_version": (str, type(None)), "created": (str, type(None)),
        "updated": (str, type(None)), "format_version": (int,), "invocations": (list,), "computed": (dict,),
    }

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object: the protocol's keys, then the header (header wins on a clash).
        A header field that is unset (None, or an empty `invocations` / `computed`: a
        hand-made or very old run.json) is left out, so a file reads back as it was."""
        header = {"protocol": self.protocol, "format_version": self.format_version,
                  "flipguard_version": self.flipguard_version, "created": self.created, "updated": self.updated,
                  "invocations": self.invocations, "computed": self.computed}
        return {**self.task_meta, **{k: v for k, v in header.items() if v is not None and v != [] and v != {}}}

    @classmethod
    def from_dict(cls, doc: Any, where: str | os.PathLike = RUN_META_FILE) -> "RunLog":
        """Parse a run.json object; a RecordError names `where` and the key that is wrong, or
        says that a newer flipguard wrote it."""
        if not isinstance(doc, dict):
            raise RecordError(f"{where}: not a run log (a JSON {type(doc).__name__}, expected an object)")
        doc = {"format_version": 0, **doc}
        for key, types in cls.HEADER_TYPES.items():
            if key in doc and (not isinstance(doc[key], types) or isinstance(doc[key], bool)):
                raise RecordError(f"{where}: {key!r} is a {type(doc[key]).__name__}, expected "
                                  f"{' or '.join(t.__name__ for t in types if t is not type(None))}")
        if doc["format_version"] > RUN_LOG_VERSION:
            raise RecordError(f"{where}: format_version {doc['format_version']} was written by a newer flipguard "
                              f"(this one, {_version()}, reads up to {RUN_LOG_VERSION}); upgrade flipguard")
        header = {k: doc.pop(k) for k in list(cls.HEADER_TYPES) if k in doc}
        return cls(**header, task_meta=doc)

    def write(self, run_dir: str | os.PathLike) -> None:
        """run_dir/run.json, atomically (temp file + rename)."""
        atomic_write_text(Path(run_dir) / RUN_META_FILE, dumps_utf8(self.to_dict(), indent=2) + "\n")


def _version() -> str:
    return __version__


def read_run_log(run_dir: str | os.PathLike) -> RunLog | None:
    """The run directory's run.json as a RunLog; None when it has none."""
    path = Path(run_dir) / RUN_META_FILE
    refuse_link(path)  # never read through: it could be any file of the user's
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path}: not valid JSON ({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"{path}: cannot be read ({exc})") from None
    return RunLog.from_dict(doc, path)


class RunDir:
    """A run directory opened for writing by `open_run_dir`: `old` is its run.json as found
    (RunLog.to_dict, the flat mapping every protocol merges its keys into)."""

    def __init__(self, path: Path, protocol: str, old: dict[str, Any]):
        self.path, self.protocol, self.old = path, protocol, old

    def write_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Write run.json atomically through RunLog: `meta` (the protocol's own settings,
        already merged with `old` where the protocol accumulates, plus invocations and
        computed) under the common header (protocol, format_version, flipguard_version,
        created, updated)."""
        now = now_iso()
        log = RunLog.from_dict({k: v for k, v in meta.items() if k != "format_version"}, self.path / RUN_META_FILE)
        log.protocol, log.flipguard_version, log.format_version = self.protocol, _version(), RUN_LOG_VERSION
        log.created = self.old.get("created") or meta.get("created") or meta.get("updated") or now
        log.updated = meta.get("updated") or now
        log.write(self.path)
        self.old = log.to_dict()
        return self.old


@contextlib.contextmanager
def open_run_dir(run_dir: str | os.PathLike, protocol: str, command: str | None = None) -> Iterator[RunDir]:
    """The one way a protocol (eval, afr, sos, import-records) opens a run directory for
    writing: refuse another protocol's run (before and under the lock), hold the writer
    lock (`run_lock`) for the block. Nothing is written but the lock file until the
    protocol calls `write_meta`, so a run refused inside the block (bad input, an
    oversized item) leaves no run directory behind."""
    refuse_other_kind(run_dir, "run")  # a study's or a comparison's folder: not a run's
    refuse_other_protocol(run_dir, protocol)  # before the lock: a clear refusal, nothing created
    with run_lock(run_dir, command) as path:
        refuse_other_kind(path, "run")
        refuse_other_protocol(path, protocol)
        yield RunDir(path, protocol, load_run_meta(path))


def load_records(run_dir: str | os.PathLike) -> list[Record]:
    """All records of a run directory (or a records.jsonl path), read-only, one per key
    (the first): a duplicate line is never counted twice."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / RECORDS_FILE
    if not path.exists():
        raise RecordError(f"{path}: no records file (run `flipguard eval` first)")
    seen: dict[str, Record] = {}
    for rec in read_records(path):
        seen.setdefault(rec.key, rec)
    return list(seen.values())


def load_run_meta(run_dir: str | os.PathLike) -> dict[str, Any]:
    """run.json as the flat mapping readers look keys up in (`RunLog.to_dict`), read and
    checked through `read_run_log`; {} when the run directory has none."""
    log = read_run_log(run_dir)
    return log.to_dict() if log is not None else {}


# ---------------------------------------------------------------- completeness
#
# A finished invocation records in run.json what its run holds (RUN_CONTENTS: how many distinct
# record keys, a digest of them, a digest of the settings the run holds one value of); every
# reader that computes a number from a run (compare, the transfer report, the study's stages,
# the page) checks records.jsonl against it first. A records file cut short, records of another
# run under this run.json, or an invocation that stopped before its end is never read as whole.

RUN_CONTENTS = "records"
# run.json of an imported run that did not finish (--allow_incomplete): {system: why}, with complete False
INCOMPLETE = "incomplete"


def content_digest(obj: Any) -> str:
    """16 hex digits of the JSON of `obj` (keys sorted): the same content, the same digest."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


def run_contents(keys: Iterable[str], settings: dict[str, Any]) -> dict[str, Any]:
    """run.json's RUN_CONTENTS for a run holding the records `keys` under `settings`."""
    keys = sorted(set(keys))
    return {"n": len(keys), "keys": content_digest(keys), "settings": content_digest(settings)}


@dataclasses.dataclass(frozen=True)
class Completeness:
    """A run directory's records against what its run.json lists."""

    run_dir: Path
    found: int                  # distinct record keys in records.jsonl now
    listed: dict[str, Any] | None  # run.json's RUN_CONTENTS (None: a run from before it was written, or none)
    finished: bool              # its last invocation reached the end (run.json "complete" is not False)
    keys: str                   # the digest of the keys found
    why: str = ""               # run.json's own reason it is not finished (an imported run: its status)

    @property
    def whole(self) -> bool:
        return self.finished and (self.listed is None or (self.found == self.listed.get("n")
                                                          and self.keys == self.listed.get("keys")))

    def describe(self) -> str:
        """One phrase: "incomplete (8 of 16 records its run.json lists)" and the like ("whole")."""
        if not self.finished:
            return (f"incomplete: {self.why}" if self.why else
                    f"incomplete: its last run stopped before the end ({self.found} records so far)")
        if self.whole:
            return "whole"
        listed = self.listed.get("n")
        if isinstance(listed, int) and self.found < listed:
            return f"incomplete ({self.found} of {listed} records its run.json lists)"
        return (f"its records are not the ones its run.json lists ({self.found} records there, {listed} listed, "
                "other keys)")


def run_completeness(run_dir: str | os.PathLike) -> Completeness:
    """Read RUN_DIR's records and run.json and say whether they agree (a missing records file counts
    as no records)."""
    run_dir = Path(run_dir)
    meta = load_run_meta(run_dir)
    keys = {rec.key for rec in read_records(run_dir / RECORDS_FILE)}
    listed = meta.get(RUN_CONTENTS)
    reasons = meta.get(INCOMPLETE)
    why = "; ".join(f"{k}: {v}" for k, v in reasons.items()) if isinstance(reasons, dict) else ""
    return Completeness(run_dir, len(keys), listed if isinstance(listed, dict) else None,
                        meta.get("complete") is not False, content_digest(sorted(keys)), why)


# A report written from a run's records records which ones (REPORT_BASIS in its meta: how many distinct
# keys, their digest): a reader of the report's numbers (compare's protocol rows, export, the page) checks
# it against the records there now, so a run grown or cut since its report is never described by it.
REPORT_BASIS = "records"


class StaleReport(RecordError):
    """A run's report describes other records than the run holds now (export refuses it, where a run
    without any report is exported without its numbers)."""


def records_basis(records: Iterable[Record]) -> dict[str, Any]:
    """REPORT_BASIS of a report built from `records`: the same shape run.json's RUN_CONTENTS has."""
    keys = sorted({r.key for r in records})
    return {"n": len(keys), "keys": content_digest(keys)}


def report_staleness(run_dir: str | os.PathLike, basis: Any, report_file: str | os.PathLike) -> str | None:
    """Why RUN_DIR's report (its file `report_file`, built from `basis`) does not describe the records
    there now, in a phrase; None when it does. A report from before reports recorded their basis is
    judged by time: records written after it."""
    run_dir = Path(run_dir)
    if isinstance(basis, dict) and "keys" in basis:
        state = run_completeness(run_dir)
        if basis.get("keys") == state.keys:
            return None
        return (f"its report is older than its records (built from {basis.get('n')} records, {state.found} there now): "
                f"rebuild it with `flipguard report {run_dir}`")
    records, report = run_dir / RECORDS_FILE, Path(report_file)
    if records.is_file() and report.is_file() and records.stat().st_mtime_ns > report.stat().st_mtime_ns:
        return (f"its report is older than its records ({RECORDS_FILE} written after {report.name}): rebuild it with "
                f"`flipguard report {run_dir}`")
    return None


def require_whole(run_dir: str | os.PathLike, then: str = "rerun the command that wrote it (it resumes from the "
                                                                "records there)") -> Completeness:
    """Refuse (RecordError, one line) to compute anything from a run that is not whole; returns its
    completeness otherwise."""
    state = run_completeness(run_dir)
    if not state.whole:
        if state.why:  # an imported run that did not finish: only a finished one, imported again, makes it whole
            then = "import a run of the tool that finished"
        raise RecordError(f"{run_dir}: {state.describe()}; no number is computed from an incomplete run: {then}")
    return state
