"""No number from an incomplete run: every reader that computes one (a study's stages and its
"up to date", `flipguard compare`, the transfer report, `flipguard view`) checks a run's records
against what its run.json lists, and a study also checks that run.json is the one its stage
finished with. Tried for real on a tiny study (recipes/tiny.yaml, DPO only, two items): a records
file cut to half its bytes, another run put in a stage's folder, a run whose last invocation
stopped before its end, a typo in `--pairs`, a counts.json cut short. A refusal is one line,
exit status 2, and changes nothing; the study resumes what was cut and is then up to date.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from flipguard.eval.records import read_records
from flipguard.pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent


def _tree(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under folder; a folder's manifest without its "time" (the
    study rewrites its effective recipe, the same bytes, at every start), and the lock that names the
    latest holder left out."""
    def content(p: Path) -> bytes:
        if p.name == ".flipguard.json":
            return json.dumps({k: v for k, v in json.loads(p.read_text()).items() if k != "time"}).encode()
        return p.read_bytes()

    return {str(p.relative_to(folder)): hashlib.sha256(content(p)).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def _keys(run: Path) -> list[str]:
    return sorted({r.key for r in read_records(run / "records.jsonl")})


def _cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _refused(capsys, code: int, *needles: str) -> str:
    captured = capsys.readouterr()
    assert code == 2, captured.out[-3000:] + captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(recipe, study folder, copies) of a finished tiny study (baseline, base-train, pairs, dpo,
    dpo-merge, dpo-eval, compare); `copies` holds its baseline and dpo-eval runs and its pair set as
    they finished, for the tests that damage a copy of their own."""
    folder = tmp_path_factory.mktemp("complete-runs")
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    for trainer in ("sft", "kto"):
        raw.pop(trainer)
    raw["dpo"]["max_steps"] = 2
    raw["pairs"]["datasets"] = "bbq"
    raw["eval"].update(limit=2, n_boot=20, mitigations=[])
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    out = folder / "study"
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    copies = folder / "copies"
    for name in ("dds/baseline", "dds/dpo-eval", "pairs"):
        shutil.copytree(out / name, copies / Path(name).name)
    return recipe, out, copies


def test_a_study_resumes_a_run_cut_short_and_refuses_another_run_in_its_place(study, capsys, tmp_path):
    recipe, out, _ = study
    run = out / "dds" / "dpo-eval"
    listed = json.loads((run / "run.json").read_text())["records"]
    keys = _keys(run)
    assert listed["n"] == len(keys) > 1
    capsys.readouterr()

    # 1. cut in half: `--only compare` refuses, naming the stage and how many records remain
    _cut_in_half(run / "records.jsonl")
    left = len(_keys(run))
    assert 0 < left < len(keys)
    before = _tree(out)
    _refused(capsys, cli_main(["study", str(recipe), "--out", str(out), "--only", "compare"]),
             "stage compare: its input stage dpo-eval", f"{run}: incomplete ({left} of {len(keys)} records")
    assert _tree(out) == before  # nothing computed from it, nothing written

    # 2. a plain rerun is not "up to date": it resumes dpo-eval (the missing records only) and redoes compare
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"--- dpo-eval: {run}: incomplete ({left} of {len(keys)} records" in printed
    assert "] dpo-eval (resume, stage" in printed and "] compare (redo, stage" in printed
    assert "--- baseline: skipped (up to date)" in printed and "--- dpo: skipped (up to date)" in printed
    assert _keys(run) == keys
    calls = json.loads((run / "run.json").read_text())["invocations"][-1]["calls_total"]
    assert calls == len(keys) - left

    # 3. now whole: every stage up to date (the quick path)
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    state = json.loads((out / "study.json").read_text())
    assert all(f"--- {name}: skipped (up to date)" in printed for name in state["order"])

    # 4. another run in the stage's folder (the baseline's: whole, but other records and settings):
    #    refused by the stage and by a stage that reads it, one line each, nothing changed
    kept = tmp_path / "dpo-eval"
    shutil.move(run, kept)
    shutil.copytree(out / "dds" / "baseline", run)
    before = _tree(out)
    _refused(capsys, cli_main(["study", str(recipe), "--out", str(out)]),
             f"stage dpo-eval: {run}: holds another run than the one the stage wrote (settings fingerprint",
             "nothing was changed")
    _refused(capsys, cli_main(["study", str(recipe), "--out", str(out), "--only", "compare"]),
             "stage compare: its input stage dpo-eval is not as it finished", "--only dpo-eval")
    assert _tree(out) == before

    # 5. the stage's own run back: up to date again, nothing redone
    shutil.rmtree(run)
    shutil.move(kept, run)
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    assert "--- dpo-eval: skipped (up to date)" in capsys.readouterr().out


def _copy_runs(copies: Path, into: Path) -> tuple[Path, Path]:
    base, dpo = into / "baseline", into / "dpo-eval"
    shutil.copytree(copies / "baseline", base)
    shutil.copytree(copies / "dpo-eval", dpo)
    return base, dpo


def test_compare_refuses_a_run_cut_short(study, capsys, tmp_path):
    base, dpo = _copy_runs(study[2], tmp_path)
    n = len(_keys(dpo))
    _cut_in_half(dpo / "records.jsonl")
    _refused(capsys, cli_main(["compare", "--runs", f"Baseline={base},DPO={dpo}", "--out", str(tmp_path / "cmp"),
                               "--n_boot", "10"]),
             f"{dpo}: incomplete ({len(_keys(dpo))} of {n} records its run.json lists)", "no number is computed")
    assert not (tmp_path / "cmp").exists()


def test_compare_refuses_records_that_are_not_those_its_run_json_lists(study, capsys, tmp_path):
    """The baseline's records under the DPO run's run.json: as many or more lines, other keys."""
    base, dpo = _copy_runs(study[2], tmp_path)
    shutil.copy(base / "records.jsonl", dpo / "records.jsonl")
    _refused(capsys, cli_main(["compare", "--runs", f"Baseline={base},DPO={dpo}", "--out", str(tmp_path / "cmp"),
                               "--n_boot", "10"]),
             f"{dpo}: its records are not the ones its run.json lists")
    assert not (tmp_path / "cmp").exists()


def test_compare_refuses_a_pairs_folder_that_is_not_a_pair_set(study, capsys, tmp_path):
    base, dpo = _copy_runs(study[2], tmp_path)
    runs = f"Baseline={base},DPO={dpo}"
    for pairs, needle in ((tmp_path / "typo", "no such folder"), (tmp_path, "no counts.json there")):
        _refused(capsys, cli_main(["compare", "--runs", runs, "--out", str(tmp_path / "cmp"), "--pairs", str(pairs)]),
                 f"--pairs {pairs}: {needle}")
    assert not (tmp_path / "cmp").exists()
    # a pair set whose counts.json was cut short: one line naming the file and line, not a JSONDecodeError
    pairs = tmp_path / "pairs"
    shutil.copytree(study[2] / "pairs", pairs)
    _cut_in_half(pairs / "counts.json")
    _refused(capsys, cli_main(["compare", "--runs", runs, "--out", str(tmp_path / "cmp"), "--pairs", str(pairs)]),
             f"{pairs / 'counts.json'}:", "not valid JSON")
    assert not (tmp_path / "cmp").exists()
    # the study's own pair set: each cell gets a role
    assert cli_main(["compare", "--runs", runs, "--out", str(tmp_path / "cmp"), "--n_boot", "10",
                     "--pairs", str(study[2] / "pairs")]) == 0
    roles = json.loads((tmp_path / "cmp" / "transfer.json").read_text())["cells"]
    assert roles and "–" not in roles.values()


def test_view_marks_every_table_of_a_run_cut_short(study, capsys, tmp_path):
    _, dpo = _copy_runs(study[2], tmp_path)
    n = len(_keys(dpo))
    _cut_in_half(dpo / "records.jsonl")
    left = len(_keys(dpo))
    page = tmp_path / "page.html"
    assert cli_main(["view", str(dpo), "--out", str(page), "--compress", "never"]) == 0
    mark = f"incomplete ({left} of {n} records its run.json lists)"
    assert f"{dpo}: {mark}: every table of the page is marked so" in capsys.readouterr().out
    html = page.read_text()
    assert html.count(mark) >= 2  # the tables and the subtitle
    assert "DDS per dataset (%, DDS in pp) — " + mark in html


def test_report_refuses_a_run_cut_short_as_compare_does(study, capsys, tmp_path):
    """`flipguard report` of a run whose records.jsonl was cut to half: one line, exit 2, the report it wrote
    when the run was whole left as it was (it used to compute DDS over the items left, `"incomplete": []`)."""
    _, dpo = _copy_runs(study[2], tmp_path)
    n = len(_keys(dpo))
    _cut_in_half(dpo / "records.jsonl")
    report = _tree(dpo / "report")
    _refused(capsys, cli_main(["report", str(dpo)]),
             f"{dpo}: incomplete ({len(_keys(dpo))} of {n} records its run.json lists)", "no number is computed")
    assert _tree(dpo / "report") == report


DIALDEFER = ROOT / "tests" / "fixtures" / "dialdefer" / "qwen-2.5-7b-instruct"


@pytest.fixture(scope="module")
def grown_run(tmp_path_factory) -> tuple[Path, int]:
    """A DDS run reported, then grown: the authors' GPQA records imported and reported, then their r/AIO
    records imported into the same run (`import-records` writes no report). A run of `flipguard eval` can no
    longer grow (a rerun with other settings is refused: test_newcomer), an import can. Its report describes
    the GPQA records only. The CLI's own main, as the commands run."""
    run = tmp_path_factory.mktemp("grown") / "run"
    assert cli_main(["import-records", str(DIALDEFER / "gpqa.jsonl"), "--out", str(run),
                     "--model", "qwen-2.5-7b-instruct"]) == 0
    reported = len(_keys(run))  # the records the report is built from, counted in records.jsonl
    assert cli_main(["report", str(run)]) == 0
    assert cli_main(["import-records", str(DIALDEFER / "aio.jsonl"), "--out", str(run),
                     "--model", "qwen-2.5-7b-instruct"]) == 0
    return run, reported


def _reported_keys(run: Path) -> int:
    """How many records the run's report says it was built from (its meta's basis)."""
    return json.loads((run / "report" / "summary.json").read_text(encoding="utf-8"))["meta"]["records"]["n"]


def test_export_refuses_a_report_older_than_its_records(grown_run, capsys, tmp_path):
    pytest.importorskip("inspect_ai")
    grown_run, built = grown_run
    capsys.readouterr()
    n = len(_keys(grown_run))
    assert 0 < built < n
    out = tmp_path / "logs"
    _refused(capsys, cli_main(["export", str(grown_run), "--out", str(out)]),
             f"{grown_run}: its report is older than its records (built from {built} records, {n} there now)",
             f"flipguard report {grown_run}")
    assert not out.exists()
    # rebuilt from the records there: exported whole, its DDS the one the new report holds
    run = tmp_path / "run"
    shutil.copytree(grown_run, run)
    assert cli_main(["report", str(run)]) == 0
    assert _reported_keys(run) == n
    assert cli_main(["export", str(run), "--out", str(out)]) == 0
    assert "status started" not in capsys.readouterr().out


def test_view_and_compare_rows_mark_or_refuse_a_report_older_than_its_records(grown_run, capsys, tmp_path):
    from flipguard.eval.comparison_rows import comparison_long_rows
    from flipguard.eval.records import StaleReport

    run = tmp_path / "run"
    shutil.copytree(grown_run[0], run)
    capsys.readouterr()
    assert (run / "report" / "summary.csv").is_file()  # the report of the GPQA records, copied with the run
    with pytest.raises(StaleReport, match="its report is older than its records"):
        comparison_long_rows("run", str(run))
    page = tmp_path / "page.html"
    assert cli_main(["view", str(run), "--out", str(page), "--compress", "never"]) == 0
    assert "DDS per dataset (%, DDS in pp) — its report is older than its records" in page.read_text()
