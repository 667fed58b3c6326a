"""run.json is one typed, versioned RunLog (eval/records.py) for every protocol: run
directories the release at 25137aa wrote (tests/fixtures/runs_25137aa, no format_version)
read through it unchanged and feed the report, compare and view loaders; a rerun stamps
the current format; a run.json from a newer flipguard, or with a header of the wrong
type, is one error naming the file."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from fixture_runs import unpack_run, written_by_flipguard

from flipguard.errors import RecordError
from flipguard.eval.records import RUN_LOG_VERSION, RunLog, load_records, load_run_meta, read_run_log
from flipguard.pipeline.cli import main as cli_main

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "runs_25137aa"
RUNS = {"dds_logprob": "dds", "dds_generate": "dds", "sos": "sos", "afr": "afr"}


def _copy(name: str, tmp_path: Path) -> Path:
    """A fixture run directory as the release left it (its .jsonl files unzipped)."""
    return unpack_run(FIXTURES / name, tmp_path / name)


def _raw_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "records.jsonl").read_text(encoding="utf-8").splitlines() if line]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_release_run_directory_reads_through_the_run_log(name, tmp_path):
    run = _copy(name, tmp_path)
    file = json.loads((run / "run.json").read_text(encoding="utf-8"))
    log = read_run_log(run)
    assert "format_version" not in file and log.format_version == 0  # written before the field
    assert log.protocol == RUNS[name] == file["protocol"]
    assert (log.created, log.updated, log.flipguard_version) == (file["created"], file["updated"], file["flipguard_version"])
    assert log.invocations == file["invocations"] and log.invocations[0]["calls_total"] > 0
    assert log.computed == file["computed"] and all(c["backend"] == "hf" for c in log.computed.values())
    assert not set(log.task_meta) & set(RunLog.HEADER_TYPES)
    meta = load_run_meta(run)  # the flat mapping the readers look keys up in: the file's keys, as they were
    assert meta.pop("format_version") == 0 and meta == file
    raw = _raw_lines(run)
    records = load_records(run)
    assert [r.key for r in records] == [row["key"] for row in raw]
    assert {r.protocol for r in records} == {RUNS[name]}


def _accuracy(rows: list[dict], dataset: str, case: str) -> float:
    """Percent of one dataset's judgments in one case that are valid and right, from the raw lines."""
    cell = [r for r in rows if r["dataset"] == dataset and r["case"] == case]
    return 100.0 * sum(r["valid"] and r["choice"] == r["expected"] for r in cell) / len(cell)


def _invalid(rows: list[dict], dataset: str, case: str) -> float:
    """Percent of one dataset's judgments in one case that are invalid."""
    cell = [r for r in rows if r["dataset"] == dataset and r["case"] == case]
    return 100.0 * sum(not r["valid"] for r in cell) / len(cell)


def test_report_compare_and_view_read_the_release_runs(tmp_path):
    base, honest = _copy("dds_logprob", tmp_path), _copy("dds_generate", tmp_path)
    afr, sos = _copy("afr", tmp_path), _copy("sos", tmp_path)

    for run, datasets in ((base, ("truthfulqa", "aio")), (honest, ("truthfulqa",))):
        assert cli_main(["report", str(run)]) == 0
        rows = _raw_lines(run)
        with open(run / "report" / "summary.csv", newline="") as fh:
            summary = {r["dataset"]: r for r in csv.DictReader(fh)}
        for dataset in datasets:
            for case in ("c1_true", "c1_false", "c2_correct", "c2_incorrect"):
                if summary[dataset][case] == "":  # not meaningful: most of the case's judgments invalid (the tiny model)
                    assert summary[dataset]["meaningful"] == "False" and _invalid(rows, dataset, case) > 50, (run, case)
                else:
                    assert float(summary[dataset][case]) == pytest.approx(_accuracy(rows, dataset, case)), (run, case)

    out = tmp_path / "cmp"  # the two DDS runs differ in decision mode: compared one at a time
    assert cli_main(["compare", "--runs", f"Baseline={honest}", "--protocols", f"Baseline={afr}@a,Be Honest={afr}@b",
                     "--sos", f"Baseline={sos}", "--out", str(out), "--n_boot", "50"]) == 0
    with open(out / "comparison.csv", newline="") as fh:
        table = {(r["condition"], r["dataset"]): r for r in csv.DictReader(fh)}
    row = table["Baseline", "truthfulqa"]  # dds_generate: every judgment of the tiny model invalid
    assert row["meaningful"] == "False" and row["c2_correct"] == row["dds"] == "" and row["n"] == "2"
    with open(out / "comparison_protocols.csv", newline="") as fh:
        protocols = {r["protocol"] for r in csv.DictReader(fh)}
    assert protocols == {"afr", "sos"}

    from flipguard.pipeline.view import write_view

    for run in (base, honest, afr, sos):
        page = write_view(run).read_text(encoding="utf-8")
        assert f"flipguard {read_run_log(run).protocol} run" in page, run.name


def test_a_release_run_resumes_and_is_stamped_with_the_current_format(tmp_path, monkeypatch):
    monkeypatch.delenv("FLIPGUARD_DATA", raising=False)  # the shipped samples, as the fixture run used
    release = _copy("dds_logprob", tmp_path)
    before = {p.name: p.read_bytes() for p in release.iterdir()}
    # the release folder has no manifest: nothing proves its files flipguard's, so it is never written into
    assert cli_main(["eval", "--model", "flipguard:tiny", "--datasets", "truthfulqa,aio", "--limit", "2", "--mode",
                     "logprob", "--out", str(release), "--report", "false"]) == 2
    assert {p.name: p.read_bytes() for p in release.iterdir() if p.name != ".lock"} == before
    # its records and run.json, written into a folder by flipguard's own writers, resume and are stamped anew;
    # the release took the first 2 items of each dataset, today's --limit a seeded sample: the stored judgments
    # are kept, and only those of the sample it lacks are asked for
    run = written_by_flipguard(release, tmp_path / "run")
    old = json.loads((run / "run.json").read_text(encoding="utf-8"))
    assert old.get("format_version", 0) < RUN_LOG_VERSION  # the release wrote none
    records = (run / "records.jsonl").read_bytes()
    assert cli_main(["eval", "--model", "flipguard:tiny", "--device", "cpu", "--datasets", "truthfulqa,aio",
                     "--limit", "2", "--mode", "logprob", "--min_label_mass", "0", "--out", str(run),
                     "--report", "false"]) == 0
    new = json.loads((run / "run.json").read_text(encoding="utf-8"))
    assert new["format_version"] == RUN_LOG_VERSION == read_run_log(run).format_version
    now = (run / "records.jsonl").read_bytes()
    assert now.startswith(records)  # appended to, never rewritten
    added = now[len(records):].count(b"\n")
    assert new["invocations"][:-1] == old["invocations"] and new["invocations"][-1]["calls_total"] == added
    for key in ("protocol", "model", "backend", "mode", "mitigation", "template", "speakers"):  # the condition
        assert new.get(key) == old.get(key), key


@pytest.mark.parametrize("change, message", [
    ({"format_version": RUN_LOG_VERSION + 1}, f"format_version {RUN_LOG_VERSION + 1} was written by a newer flipguard"),
    ({"invocations": "none"}, "'invocations' is a str, expected list"),
    ({"format_version": "1"}, "'format_version' is a str, expected int"),
])
def test_a_run_log_flipguard_cannot_read_is_one_error_naming_the_file(tmp_path, capsys, change, message):
    run = _copy("dds_logprob", tmp_path)
    doc = json.loads((run / "run.json").read_text(encoding="utf-8"))
    (run / "run.json").write_text(json.dumps({**doc, **change}), encoding="utf-8")
    with pytest.raises(RecordError, match=f"{run / 'run.json'}: {message}"):
        read_run_log(run)
    assert cli_main(["report", str(run)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(run / "run.json") in err and message in err
    assert not (run / "report").exists()


def test_run_json_round_trips_through_the_run_log(tmp_path):
    log = RunLog(protocol="dds", flipguard_version="9.9", created="a", updated="b",
                 invocations=[{"time": "t", "calls": {"x": 1}, "calls_total": 1}], computed={"m": {"dtype": "bf16"}},
                 task_meta={"model": "m", "settings": {"nested": True}})
    log.write(tmp_path)
    assert read_run_log(tmp_path) == log
    assert json.loads((tmp_path / "run.json").read_text())["settings"] == {"nested": True}  # flat beside the header
    assert read_run_log(tmp_path / "missing") is None and load_run_meta(tmp_path / "missing") == {}


# Record's defaults of the fields some protocols own, as the release wrote them on every line
DEFAULTS = {"speakers": ["Speaker 1", "Speaker 2"], "template": "v0", "p1": None, "p2": None}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_records_carry_only_their_protocols_declared_fields(name, tmp_path):
    from flipguard.eval.records import OWNED_FIELDS, PROTOCOL_FIELDS, RUNNER_EXTRA, Record

    run = _copy(name, tmp_path)
    declared = PROTOCOL_FIELDS[RUNS[name]]
    for row in _raw_lines(run):  # what the release wrote: every field on every line
        assert set(row["extra"]) <= declared.extra | RUNNER_EXTRA, sorted(set(row["extra"]) - declared.extra)
        record = Record.from_dict(row)
        line = record.to_dict()
        assert Record.from_dict(line) == record  # nothing lost in the shorter line
        dropped = set(row) - set(line)
        assert dropped <= set(OWNED_FIELDS) - declared.fields
        assert {f: row[f] for f in dropped} == {f: DEFAULTS[f] for f in dropped}  # only defaults left out
    owned = {"dds": {"speakers", "template", "p1", "p2"}, "sos": {"template"}, "afr": set()}[RUNS[name]]
    assert set(OWNED_FIELDS) - owned <= set(OWNED_FIELDS) - set(line)
    assert owned <= set(line)


def test_a_hand_made_run_json_reads_back_as_written(tmp_path):
    """Tests and users write run.json by hand ({"protocol": "dds", "c1_from": ...}): no header
    field appears that the file does not have, but the format version it is read as."""
    doc = {"model": "m", "mode": "generate", "c1_from": None}
    (tmp_path / "run.json").write_text(json.dumps(doc), encoding="utf-8")
    assert load_run_meta(tmp_path) == {**doc, "format_version": 0}
    assert read_run_log(tmp_path).protocol is None
