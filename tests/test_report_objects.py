"""The typed report objects (DDSReport, AFRReport, SosReport) serialise to exactly the JSON the
loose dicts before them gave: the same keys, order and values, so report files do not change.
The expected JSON was written by the code of commit 08f9da5, before the objects, from real runs:
the release run directories of tests/fixtures/runs_25137aa (the tiny model) and the organism's
of tests/fixtures/reports_08f9da5/organism_runs; how: README.md and capture.py there. Since issue 47
the reports also say what is not meaningful (`meaningful`, its numbers empty): the expected JSON is
read with exactly that change (_since_not_meaningful), every other key and value as before."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fixture_runs import unpack_run

from flipguard.eval.estimate import Estimate

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXPECTED = FIXTURES / "reports_08f9da5"


@pytest.fixture
def work(tmp_path) -> Path:
    """The run directories, copied as capture.py copied them (their .jsonl unzipped)."""
    for src in [*(FIXTURES / "runs_25137aa").iterdir(), *(EXPECTED / "organism_runs").iterdir()]:
        if not src.is_dir():
            continue
        unpack_run(src, tmp_path / "work" / src.name)
    return tmp_path / "work"


def _text(obj, work: Path) -> str:
    """JSON text as the files hold it (key order kept, NaN as NaN), the run paths as WORK."""
    return json.dumps(obj, indent=1).replace(str(work), "WORK")


# "not meaningful" in every row and estimate: its valid judgments, or (AFR) the items it rests on, fewer than min_items
_NEW_KEYS = ("meaningful", "n_valid", "n_judged", "min_items", "n_items")


def _empty(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _since_not_meaningful(before, now):
    """The JSON of before as it reads since every report marks what is not meaningful: each row and estimate
    gains `meaningful` (an estimate that is not: with its n_valid / n_judged, or min_items / n_items), and where it is
    False, the numbers it left empty are empty (every other key and value as before)."""
    if isinstance(before, dict) and isinstance(now, dict):
        out = {k: _since_not_meaningful(v, now.get(k)) for k, v in before.items()}
        if now.get("meaningful") is False:
            out.update({k: now[k] for k, v in before.items()
                        if k in now and _empty(now[k]) and not _empty(v) and not isinstance(v, (dict, list, str))})
        out.update({k: now[k] for k in now if k in _NEW_KEYS and k not in before})
        return {k: out[k] for k in [*before, *(k for k in now if k in _NEW_KEYS and k not in before)]}
    if isinstance(before, list) and isinstance(now, list) and len(before) == len(now):
        return [_since_not_meaningful(b, n) for b, n in zip(before, now)]
    return before


def _expected(name: str, now=None) -> str:
    """The expected JSON text; with `now` (the object just serialised, paths as WORK), as it reads since
    issue 47 (_since_not_meaningful)."""
    before = json.loads((EXPECTED / name).read_text(encoding="utf-8"))
    return json.dumps(before if now is None else _since_not_meaningful(before, json.loads(now)), indent=1)


@pytest.mark.parametrize("name, run_name, c1_from", [
    ("dds_logprob", "dds_logprob", None), ("dds_generate", "dds_generate", None),
    ("dds_generate_c1_from_logprob", "dds_generate", "dds_logprob"),  # the fixed-C1 protocol, another mode
    ("dds_organism", "dds_organism", None), ("dds_organism_honest", "dds_organism_honest", "dds_organism")])
def test_dds_report_serialises_to_the_summary_json_of_before(name, run_name, c1_from, work):
    from flipguard.eval.dds.report import DDSReport, report_run, write_run_report

    run = work / run_name
    report = report_run(run, c1_from=str(work / c1_from) if c1_from else None, n_boot=200, seed=0,
                        allow_cross_mode_c1=name == "dds_generate_c1_from_logprob")
    assert isinstance(report, DDSReport)
    got = _text(report.to_json(), work)
    # since issue 58 a report's meta records which records it was built from: the run's distinct keys, counted
    # here from records.jsonl itself; the rest is the JSON of before
    basis = json.loads(got)["meta"]["records"]
    lines = [json.loads(line) for line in (run / "records.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    assert basis["n"] == len({r["key"] for r in lines}) > 0
    without = json.loads(got)
    del without["meta"]["records"]
    assert json.dumps(without, indent=1) == _expected(f"{name}.summary.json", json.dumps(without, indent=1))
    # the file the command writes is that JSON
    write_run_report(run, c1_from=str(work / c1_from) if c1_from else None, n_boot=200, seed=0,
                     allow_cross_mode_c1=name == "dds_generate_c1_from_logprob")
    written = json.loads((run / "report" / "summary.json").read_text(encoding="utf-8"))
    assert _text(written, work) == got
    # attributes, not keys: the total row, the capability note
    assert report.row("total_avg")["n"] == report.meta["n_items"]
    assert report.unfit == bool(report.meta.get("capability_note"))


@pytest.mark.parametrize("name, system", [("sos", "flipguard:tiny"), ("sos_organism", "flipguard:organism +be_honest")])
def test_sos_report_serialises_to_the_sos_summary_json_of_before(name, system, work):
    from flipguard.eval.sos.report import SUMMARY_JSON, SosReport, build_report, sos_summary, write_report

    run = work / name
    report = build_report(run)
    assert isinstance(report, SosReport)
    got = _text(report.to_json(), work)
    assert got == _expected(f"{name}.sos_summary.json", got)
    numbers = _text(sos_summary(run).comparison_json(), work)
    assert numbers == _expected(f"{name}.comparison.json", numbers)
    write_report(run)
    assert _text(json.loads((run / SUMMARY_JSON).read_text(encoding="utf-8")), work) == got
    numbers = report.numbers[system]  # attributes, typed: the single-shot accuracy is summarise's ss_full
    assert isinstance(numbers.ss_accuracy, Estimate) and numbers.ss_accuracy.unit == "%"
    ss_full = report.systems[system]["ss_full"]
    assert numbers.ss_accuracy.value == ss_full["value"] or (  # the tiny model's replies are unreadable: n/m, both
        numbers.ss_accuracy.meaningful is ss_full["meaningful"] is False and _empty(numbers.ss_accuracy.value))
    assert numbers.conversation_tax.unit == "pp"


@pytest.mark.parametrize("name, k, targets", [("afr", 1, ["a", "b"]), ("afr_organism", 10, ["organism", "organism_honest"])])
def test_afr_report_serialises_to_the_summary_of_before(name, k, targets, work):
    from flipguard.eval.afr.report import AFRReport, afr_summary

    report = afr_summary(work / name, k=k, n_boot=200, seed=0)
    assert isinstance(report, AFRReport) and list(report.targets) == targets
    got = _text(report.to_json(), work)
    assert got == _expected(f"{name}.k{k}.json", got)
    assert report.targets[targets[0]].k == k and isinstance(report.targets[targets[0]].afr_blind, Estimate)
