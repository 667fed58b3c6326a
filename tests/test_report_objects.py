"""The typed report objects (DDSReport, AFRReport, SosReport) serialise to exactly the JSON the
loose dicts before them gave: the same keys, order and values, so report files do not change.
The expected JSON was written by the code of commit 08f9da5, before the objects, from the
release run directories of tests/fixtures/runs_25137aa (real runs of the tiny model); how:
tests/fixtures/reports_08f9da5/README.md and capture.py there."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from flipguard.eval.estimate import Estimate

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXPECTED = FIXTURES / "reports_08f9da5"


@pytest.fixture
def work(tmp_path) -> Path:
    """The release run directories, copied as capture.py copied them (their .jsonl unzipped)."""
    for src in (FIXTURES / "runs_25137aa").iterdir():
        if not src.is_dir():
            continue
        run = tmp_path / "work" / src.name
        run.mkdir(parents=True)
        for path in src.iterdir():
            if path.suffix == ".gz":
                (run / path.stem).write_bytes(gzip.decompress(path.read_bytes()))
            else:
                shutil.copy(path, run / path.name)
    return tmp_path / "work"


def _text(obj, work: Path) -> str:
    """JSON text as the files hold it (key order kept, NaN as NaN), the run paths as WORK."""
    return json.dumps(obj, indent=1).replace(str(work), "WORK")


def _expected(name: str) -> str:
    return json.dumps(json.loads((EXPECTED / name).read_text(encoding="utf-8")), indent=1)


@pytest.mark.parametrize("name, c1_from", [("dds_logprob", None), ("dds_generate", None),
                                           ("dds_generate_c1_from_logprob", "dds_logprob")])
def test_dds_report_serialises_to_the_summary_json_of_before(name, c1_from, work):
    from flipguard.eval.dds.report import DDSReport, report_run, write_run_report

    run = work / name.split("_c1_from")[0]
    report = report_run(run, c1_from=str(work / c1_from) if c1_from else None, n_boot=200, seed=0,
                        allow_cross_mode_c1=bool(c1_from))
    assert isinstance(report, DDSReport)
    assert _text(report.to_json(), work) == _expected(f"{name}.summary.json")
    # the file the command writes is that JSON
    write_run_report(run, c1_from=str(work / c1_from) if c1_from else None, n_boot=200, seed=0,
                     allow_cross_mode_c1=bool(c1_from))
    written = json.loads((run / "report" / "summary.json").read_text(encoding="utf-8"))
    assert _text(written, work) == _expected(f"{name}.summary.json")
    # attributes, not keys: the total row, the capability note
    assert report.row("total_avg")["n"] == report.meta["n_items"]
    assert report.unfit == bool(report.meta.get("capability_note"))


def test_sos_report_serialises_to_the_sos_summary_json_of_before(work):
    from flipguard.eval.sos.report import SUMMARY_JSON, SosReport, build_report, sos_summary, write_report

    run = work / "sos"
    report = build_report(run)
    assert isinstance(report, SosReport)
    assert _text(report.to_json(), work) == _expected("sos.sos_summary.json")
    assert _text(sos_summary(run).comparison_json(), work) == _expected("sos.comparison.json")
    write_report(run)
    assert _text(json.loads((run / SUMMARY_JSON).read_text(encoding="utf-8")), work) == _expected("sos.sos_summary.json")
    numbers = report.numbers["flipguard:tiny"]
    assert isinstance(numbers.ss_accuracy, Estimate) and numbers.ss_accuracy.unit == "%"
    assert numbers.ss_accuracy.value == report.systems["flipguard:tiny"]["ss_full"]["value"]


def test_afr_report_serialises_to_the_summary_of_before(work):
    from flipguard.eval.afr.report import AFRReport, afr_summary

    report = afr_summary(work / "afr", k=1, n_boot=200, seed=0)
    assert isinstance(report, AFRReport) and list(report.targets) == ["a", "b"]
    assert _text(report.to_json(), work) == _expected("afr.k1.json")
    assert report.targets["a"].k == 1 and isinstance(report.targets["a"].afr_blind, Estimate)
