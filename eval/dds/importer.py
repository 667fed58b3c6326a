"""`flipguard import-records DIR --out RUN_DIR`: the DialDefer authors' per-item records
as a flipguard run, so `flipguard report` reproduces their published numbers.

Each input line (one item) becomes up to four records (one per case present), mode
"imported", backend "dialdefer", template "v0-released". Rows with only c2_* answers
(the authors' mitigation runs) import as a C2-only run, reported with --c1_from. Keys
hash (source file name, item id, case, model), so importing again adds nothing.
Answers are read as the authors' analyzer reads them (code/benchmark/bench_analyzer.py,
code/common/utils.py): a stored answer is `str(answer).strip()`, valid when "1" or "2";
answers stored as JSON numbers (2 instead of "2", seen in the Qwen r/AIO file) therefore
count as valid, as in the authors' overall accuracies (`extra["answer_json_type"]` marks
them). An empty or null stored answer is recovered from the first assistant message of
the case's `*_history` field (`recover_answer`: a JSON "chosen_answer", else a leading
1/2, else the first standalone 1/2); such judgments carry `extra["recovered"] = True`
and are counted in reports (their release leaves every DPO C2 answer blank).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterator

from flipguard.config import parse_dataclasses
from flipguard.data.schema import AIO_DATASET, ALL_DATASETS, DataError, read_jsonl
from flipguard.errors import UserError
from flipguard.eval.dds.prompts import RELEASED_TEMPLATE
from flipguard.eval.records import (
    CASES,
    EXPECTED_CHOICE,
    RECORDS_FILE,
    RUN_CONTENTS,
    RUN_META_FILE,
    Record,
    RecordStore,
    load_run_meta,
    now_iso,
    open_run_dir,
    read_records,
    refuse_other_protocol,
    request_key,
    run_contents,
)
from flipguard.files import atomic_write_text, dumps_utf8

BACKEND = "dialdefer"
REDACTED = "[redacted]"

# The authors' spellings of our dataset names (their HARP rows say "harp_mc").
DATASET_ALIASES = {"harp_mc": "harp_mcq", "halueval": "halueval_qa", "harp": "harp_mcq"}

# our case -> the authors' field stem
FIELD_STEMS = {
    "c1_true": "c1_true_statement",
    "c1_false": "c1_false_statement",
    "c2_correct": "c2_correct_chat",
    "c2_incorrect": "c2_incorrect_chat",
}




def _dataset_of(path: Path, row: dict[str, Any], where: str) -> str:
    name = row.get("dataset")
    if name is None:  # fall back to the file name: "<dataset>[_<model>...].jsonl"
        stem = path.stem.lower()
        matches = [d for d in ALL_DATASETS if stem == d or stem.startswith(d + "_")]
        name = max(matches, key=len) if matches else stem
    name = DATASET_ALIASES.get(name, name)
    if name not in ALL_DATASETS:
        raise UserError(f"{where}: unknown dataset {name!r}; expected one of {', '.join(ALL_DATASETS)}")
    return name


# The authors' answer recovery (code/common/utils.py extract_answer_from_text), in order.
_JSON_ANSWER = re.compile(r'"chosen_answer"\s*:\s*"?([12])"?')
_JSON_REASONING = re.compile(r'"reasoning"\s*:\s*"(.*?)"(?:\s*[,}]|$)', re.DOTALL)
_LEADING = re.compile(r"^\s*([12])\b")
_TRAILING = re.compile(r"\s*[12]\s*$")
_STANDALONE = re.compile(r"\b([12])\b")


def recover_answer(text: str | None) -> tuple[str | None, str | None]:
    """(answer, reasoning) from a model reply, by the authors' rules: a JSON-ish
    `"chosen_answer": "1"` (quotes optional; fenced ```json blocks included) with its
    "reasoning"; else a reply starting with 1 or 2 (the rest, minus a trailing 1/2, is
    the reasoning); else the first standalone 1 or 2; else (None, None)."""
    if not text or not isinstance(text, str):
        return None, None
    m = _JSON_ANSWER.search(text)
    if m:
        r = _JSON_REASONING.search(text)
        return m.group(1), r.group(1) if r else None
    m = _LEADING.match(text)
    if m:
        rest = _TRAILING.sub("", text[m.end():].strip()).strip()
        return m.group(1), rest or None
    m = _STANDALONE.search(text)
    if m:
        return m.group(1), None
    return None, None


def is_blank(answer: Any) -> bool:
    """The analyzer's "null" answer: None or blank after str()."""
    return answer is None or str(answer).strip() == ""


def _parse_chat(raw: str) -> Any:
    """A stored chat: Python repr (their usual format) or JSON (their fine-tuned runs)."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    return json.loads(raw)


def _history(row: dict[str, Any], stem: str, where: str) -> list[dict[str, str]] | None:
    for field in (f"{stem}_t1_history", f"{stem}_history_t1"):
        raw = row.get(field)
        if raw is None or raw == REDACTED or raw == "":
            continue
        if isinstance(raw, list):
            return raw
        try:
            value = _parse_chat(raw)
        except (ValueError, TypeError) as exc:
            raise UserError(f"{where}: {field} is neither a Python-repr nor a JSON chat "
                               f"({exc.__class__.__name__})") from None
        if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
            raise UserError(f"{where}: {field} is not a list of chat messages")
        return value
    return None


def records_from_row(row: dict[str, Any], path: Path, lineno: int, model: str) -> list[Record]:
    """The records of one input line (one per case whose answer field is present)."""
    where = f"{path}:{lineno}"
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if row.get("id") in (None, ""):
        raise UserError(f"{where}: missing field 'id'")
    item_id = str(row["id"])
    dataset = _dataset_of(path, row, where)
    present = [c for c in CASES if f"{FIELD_STEMS[c]}_ans_t1" in row]
    if not present:
        raise UserError(
            f"{where}: item {item_id!r} has none of the answer fields "
            + ", ".join(f"{s}_ans_t1" for s in FIELD_STEMS.values())
        )
    if dataset == AIO_DATASET:
        speakers = [str(row.get("judgee", "Speaker A")), str(row.get("judger", "Speaker B"))]
        stratum = row.get("ground_truth")
        if stratum is None:
            raise UserError(f"{where}: r/AIO item {item_id!r} lacks 'ground_truth' (its OR/NOR stratum)")
    else:
        speakers = [str(row.get("speaker1", "Speaker 1")), str(row.get("speaker2", "Speaker 2"))]
        stratum = None
    out = []
    for case in present:
        stem = FIELD_STEMS[case]
        answer = row[f"{stem}_ans_t1"]
        # the analyzer's reading: str(answer).strip() == expected (so 2 reads as "2")
        choice = str(answer).strip() if answer is not None and not isinstance(answer, bool) else None
        history = _history(row, stem, where)
        messages, raw_output = history, None
        if history and history[-1].get("role") == "assistant":
            messages, raw_output = history[:-1], history[-1].get("content")
        if raw_output is None and answer is not None:
            raw_output = str(answer)
        reasoning = row.get(f"{stem}_reasoning_t1")
        extra: dict[str, Any] = {"source_file": path.name, "source_line": lineno}
        if is_blank(answer):
            # the analyzer's null recovery: the first assistant message of the history
            reply = next((m.get("content", "") for m in history or [] if isinstance(m, dict)
                          and m.get("role") == "assistant"), None)
            choice, recovered_reasoning = recover_answer(reply)
            if choice in ("1", "2"):
                extra["recovered"] = True
                if recovered_reasoning and reasoning is None:
                    reasoning = recovered_reasoning
            else:
                choice = None
                extra["recovered"] = False  # blank and not recoverable: invalid
        valid = choice in ("1", "2")
        if stratum is not None:
            extra.update(stratum=str(stratum), effective_ground_truth=row.get("effective_ground_truth"))
        if answer is not None and not isinstance(answer, str):
            extra["answer_json_type"] = type(answer).__name__
        out.append(Record(
            key=request_key(source=path.name, item_id=item_id, case=case, model=model),
            protocol="dds", item_id=item_id, dataset=dataset, case=case,
            expected=EXPECTED_CHOICE[case], model=model, backend=BACKEND, mode="imported",
            speakers=speakers, template=RELEASED_TEMPLATE, messages=messages,
            raw_output=raw_output, choice=choice if valid else None, valid=valid,
            reasoning=reasoning, time=now_iso(), extra=extra,
        ))
    return out


def read_file(path: Path, model: str) -> Iterator[Record]:
    try:
        rows = read_jsonl(path)
    except DataError as exc:
        raise UserError(str(exc)) from None
    for lineno, row in rows:
        yield from records_from_row(row, path, lineno, model)


def source_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise UserError(f"{src}: no such file or directory")
    files = sorted(p for p in src.glob("*.jsonl") if not p.name.startswith("published_"))
    if not files:
        raise UserError(f"{src}: no DialDefer records (*.jsonl) found")
    return files


def _content(rec: Record) -> dict[str, Any]:
    """What a record says (not when or from which line it was read): two imports of the
    same judgment compare equal, a corrected answer does not."""
    d = rec.to_dict()
    for name in ("key", "time", "latency_s"):
        d.pop(name, None)
    d["extra"] = {k: v for k, v in (d.get("extra") or {}).items() if k not in ("source_line",)}
    return d


def _where(rec: Record, paths: dict[str, Path] | None = None) -> str:
    name = rec.extra.get("source_file")
    return f"{(paths or {}).get(name, name)}:{rec.extra.get('source_line')}"


def _diff(a: Record, b: Record) -> str:
    da, db = _content(a), _content(b)
    names = [k for k in da if da[k] != db.get(k)]
    shown = ", ".join(f"{k} {da[k]!r} vs {db.get(k)!r}" if k in ("choice", "raw_output", "valid") else k
                      for k in names[:3])
    return shown or "content"


def unique_records(records: list[Record], paths: dict[str, Path] | None = None) -> list[Record]:
    """The records of one import, each judgment once. The same item twice (same dataset,
    id and case) is refused when the two lines differ, naming both; a repeated identical
    line in one file counts once; the same item in two files is refused (it would be
    counted twice)."""
    seen: dict[tuple[str, str, str], Record] = {}
    out = []
    for rec in records:
        ident = (rec.dataset, rec.item_id, rec.case)
        first = seen.get(ident)
        if first is None:
            seen[ident] = rec
            out.append(rec)
            continue
        if first.key == rec.key and _content(first) == _content(rec):
            continue  # the same line repeated in one file
        what = "conflicting duplicate" if _content(first) != _content(rec) else "duplicate"
        raise UserError(
            f"{_where(rec, paths)}: {what} item {rec.item_id!r} ({rec.dataset}, {rec.case}) first at "
            f"{_where(first, paths)}"
            + (f" (they differ: {_diff(first, rec)})" if what.startswith("conflicting") else " (another file)")
            + "; keep one of them; nothing was imported"
        )
    return out


def _refuse_other_run(out: Path, model: str) -> None:
    """One model per run directory: an --out holding another protocol's run, another
    model's records or a run that is not an import is refused, naming both."""
    refuse_other_protocol(out, "dds")
    meta = load_run_meta(out)
    if not meta:
        return
    clash = {k: (meta.get(k), v) for k, v in (("model", model), ("backend", BACKEND), ("mode", "imported"))
             if meta.get(k) is not None and meta.get(k) != v}
    if clash:
        detail = ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in clash.items())
        raise UserError(f"{out / RUN_META_FILE}: this run directory holds another run ({detail}); one model "
                           "per run directory: use another --out (or --model to name this one); nothing was imported")


def _apply_corrections(store: RecordStore, changed: dict[str, Record]) -> RecordStore:
    """Rewrite the records file with `changed` records in place of the stored ones with
    the same key (atomically, under the run lock); returns the reopened store."""
    lines = []
    for rec in read_records(store.path):
        lines.append(dumps_utf8(changed.get(rec.key, rec).to_dict()) + "\n")
    mode = store.path.stat().st_mode & 0o777
    atomic_write_text(store.path, "".join(lines), log=True)
    store.path.chmod(mode)
    return RecordStore(store.path)


def import_records(src: str | Path, out: str | Path, model: str | None = None) -> dict[str, Any]:
    """Import every *.jsonl under `src` (published_*.csv and similar are skipped).

    All files are parsed before anything is written, so bad input leaves `out` as it was.
    A re-import of a corrected file replaces the records whose answers changed (counted as
    "corrected"); conflicting duplicate items and a second model in one --out are refused.
    Returns {"files": ..., "records": n read, "added": n new, "corrected": n replaced,
    "invalid": n unparsed}.
    """
    src, out = Path(src), Path(out)
    model = model or (src.name if src.is_dir() else src.parent.name)
    files = source_files(src)
    records = unique_records([rec for path in files for rec in read_file(path, model)], {p.name: p for p in files})
    _refuse_other_run(out, model)  # before the lock: a clear refusal, nothing created
    with open_run_dir(out, "dds") as run:  # one writer per run directory
        _refuse_other_run(out, model)
        store = RecordStore(out / RECORDS_FILE)
        changed = {r.key: r for r in records if r.key in store and _content(store.stored[r.key]) != _content(r)}
        if changed:
            store = _apply_corrections(store, changed)
        added = store.append(records)
        meta = dict(run.old)
        cases = sorted({r.case for r in records}, key=CASES.index)
        meta.update(
            model=model, backend=BACKEND, mode="imported", mitigation=meta.get("mitigation", "none"),
            template=RELEASED_TEMPLATE, speakers=["Speaker 1", "Speaker 2"], protocol="dds",
            source=str(src.resolve()), files=[p.name for p in files], cases=cases,
            datasets=sorted({r.dataset for r in records}), imported_at=now_iso(),
        )
        if changed:
            meta["corrections"] = [*meta.get("corrections", []), {"time": now_iso(), "records": len(changed),
                                                                 "files": sorted({r.extra.get("source_file") for r in changed.values()})}]
        # what the run holds now (records.require_whole checks readers' copies against it)
        meta[RUN_CONTENTS] = run_contents(store.stored, {k: meta.get(k) for k in ("model", "mode")})
        run.write_meta(meta)
    return {"files": [p.name for p in files], "records": len(records), "added": added, "corrected": len(changed),
            "invalid": sum(not r.valid for r in records),
            "recovered": sum(bool(r.extra.get("recovered")) for r in records), "cases": cases}


@dataclasses.dataclass
class ImportArgs:
    source: str = dataclasses.field(metadata={"help": "folder of DialDefer per-item records (<dataset>.jsonl, aio.jsonl) or one file"})
    out: str = dataclasses.field(metadata={"help": "run directory to write records.jsonl and run.json into"})
    model: str | None = dataclasses.field(default=None, metadata={"help": "model name (default: the folder name)"})


def main(argv: list[str]) -> int:
    args = parse_dataclasses(argv, ImportArgs, prog="flipguard import-records",
                             description="read DialDefer-format per-item records into a run directory",
                             positional="source")
    res = import_records(args.source, args.out, args.model)
    print(f"imported {len(res['files'])} file(s): {res['records']} records ({res['added']} new, "
          f"{res['corrected']} corrected (stored answers replaced by the file's), "
          f"{res['recovered']} blank answers recovered from the reply, {res['invalid']} invalid) "
          f"-> {Path(args.out) / RECORDS_FILE}")
    if "c1_true" not in res["cases"] and "c1_false" not in res["cases"]:
        print("no C1 answers: report this run with `flipguard report RUN_DIR --c1_from BASELINE_RUN`")
    return 0
