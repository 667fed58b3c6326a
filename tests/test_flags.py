"""One vocabulary for every command: the same flags mean the same thing in eval, afr and sos (and
`flipguard run TASK`), every protocol writes RUN/records.jsonl, RUN/run.json and RUN/report/, and
`flipguard report RUN` rebuilds any run's report; the old spellings still work, unlisted; every
mistake on a command line is one line with the closest option; a run folder nobody named holds
one invocation's settings."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from one_line import one_line

from flipguard.pipeline.cli import COMMANDS
from flipguard.pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parent.parent
# the settings every protocol command takes, given alike to each
SHARED = ["--backend", "hf", "--backend_args", '{"prefix_sharing": false}', "--device", "cpu", "--batch_size", "3",
          "--limit", "2", "--mitigations", "be_honest", "--seed", "3", "--threads", "1"]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny(tiny_model_path) -> str:
    return tiny_model_path


# ---------------------------------------------------------------------------- one vocabulary

PROTOCOLS = {  # command -> (the command, and what differs: each protocol's own data and run config)
    "eval": (["eval"], ["--datasets", "bbq", "--min_label_mass", "0"]),
    "afr": (["afr", "afr_tiny"], ["--datasets", "mmlu"]),
    "sos": (["sos", "sos_tiny"], ["--datasets", "medqa", "--n_shots", "1", "--max_new_tokens", "4"]),
    "run dds": (["run", "dds"], ["--datasets", "bbq", "--min_label_mass", "0"]),
    "run afr": (["run", "afr", "afr_tiny"], ["--datasets", "mmlu"]),
    "run sos": (["run", "sos", "sos_tiny"], ["--datasets", "medqa", "--n_shots", "1", "--max_new_tokens", "4"]),
}


@pytest.mark.parametrize("command", list(PROTOCOLS))
def test_every_protocol_takes_the_same_flags_and_writes_the_same_layout(command, tiny, tmp_path, capsys):
    head, own = PROTOCOLS[command]
    run = tmp_path / "run"
    argv = [*head, "--model", f"tiny={tiny}", *SHARED, *own, "--out", str(run)]
    assert cli_main(argv) == 0, capsys.readouterr().err[-3000:]
    # the one layout
    assert {"records.jsonl", "run.json", "report"} <= {p.name for p in run.iterdir()}
    assert (run / "report" / "summary.md").stat().st_size > 0
    assert not list(run.glob("*.csv")) and not (run / "report.md").exists() and not (run / "sos_report.md").exists()
    meta = json.loads((run / "run.json").read_text())
    records = _records(run)
    protocol = meta["protocol"]
    # --model: the spec's label names the model (an AFR model measured with a mitigation is one of the
    # run's models, named for both); --mitigations: every answer given under be_honest (AFR's Stage I
    # arguments are written without one, as the paper's)
    assert {r["model"] for r in records} == {"tiny +be_honest" if protocol == "afr" else "tiny"}
    assert {r["mitigation"] for r in records if r["case"] != "coerce"} == {"be_honest"}
    # --limit: two items
    assert len({r["item_id"] for r in records}) == 2
    # --datasets
    assert {r["dataset"] for r in records} == {own[1]}
    if protocol == "afr":  # --backend, --device, --batch_size and --backend_args reach the model's backend
        (model,) = meta["settings"]["models"]
        assert model["backend"] == "hf" and model["mitigation"] == "be_honest"
        assert {k: model["kwargs"][k] for k in ("device", "batch_size", "prefix_sharing")} == {
            "device": "cpu", "batch_size": 3, "prefix_sharing": False}
        assert meta["settings"]["seed"] == 3
    if protocol == "sos":
        assert meta["seed"] == 3 and meta["n_items"] == 2 and meta["mitigations"] == ["be_honest"]
    # `flipguard report RUN` rebuilds it, whatever the protocol
    (run / "report" / "summary.md").unlink()
    capsys.readouterr()
    assert cli_main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"report: {run / 'report' / 'summary.md'}"
    assert (run / "report" / "summary.md").stat().st_size > 0


def test_a_protocol_run_without_out_goes_to_a_folder_of_its_settings(tiny, tmp_path, monkeypatch, capsys):
    """The default run folder holds one invocation's settings: another --limit (or other backend
    settings: prefix sharing on and off) is another folder whose report covers what was asked; the
    same settings again resume their folder."""
    monkeypatch.chdir(tmp_path)
    base = ["eval", "--model", tiny, "--datasets", "bbq", "--min_label_mass", "0"]

    def run(*flags: str) -> tuple[Path, str]:
        assert cli_main([*base, *flags]) == 0
        out = capsys.readouterr().out
        (line,) = [line for line in out.splitlines() if " judgments, " in line]
        return Path(line.split(":")[0]), line

    two, line = run("--limit", "2")
    assert line.endswith("8 judgments, 0 already recorded, 8 to run")
    one, line = run("--limit", "1")
    assert one != two and one.parent == two.parent and line.endswith("4 judgments, 0 already recorded, 4 to run")
    rows = (one / "report" / "summary.csv").read_text().splitlines()
    assert rows[1].startswith("bbq,1,")  # what was asked: bbq at n=1, not the other run's n=2
    again, line = run("--limit", "1")
    assert again == one and line.endswith("4 judgments, 4 already recorded, 0 to run")
    off, line = run("--limit", "1", "--backend_args", '{"prefix_sharing": false}')
    assert off not in (one, two) and line.endswith("4 judgments, 0 already recorded, 4 to run")
    # a named folder that earlier invocations filled: the report covers them, and says so
    assert cli_main([*base, "--limit", "2", "--out", str(tmp_path / "shared")]) == 0
    capsys.readouterr()
    assert cli_main([*base, "--limit", "1", "--out", str(tmp_path / "shared")]) == 0
    err = capsys.readouterr().err
    assert f"note: {tmp_path / 'shared'} also holds 4 records of earlier invocations with other settings" in err


def test_the_old_spellings_still_work_and_are_not_listed(tiny, tmp_path, capsys):
    from flipguard.config import parse_dataclasses
    from flipguard.eval.afr.protocol import AFRArgs, settings_from_args
    from flipguard.eval.dds.protocol import EvalArgs
    from flipguard.eval.sos.protocol import SosArgs

    old = {"sos": ["--models", "--n_items", "--dataset"], "afr": ["--models", "--dataset", "--report_only"],
           "eval": ["--mitigation"], "study": ["--eval_plan_limit", "--eval_plan_datasets"],
           "cross-model": ["--names"]}
    for command, flags in old.items():
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        usage = capsys.readouterr().out
        for flag in flags:
            assert not re.search(re.escape(flag) + r"\b", usage), (command, flag)
    # on the command line
    sos = parse_dataclasses(["--models", "a=flipguard:tiny", "--n_items", "3", "--dataset", "mmlu"], SosArgs,
                            prog="flipguard sos", description="")
    assert (sos.model, sos.limit, sos.datasets) == (["a=flipguard:tiny"], 3, "mmlu")
    dds = parse_dataclasses(["--mitigation", "be_honest"], EvalArgs, prog="flipguard eval", description="")
    assert dds.mitigations == ["be_honest"]
    # as a run config's keys, and AFR's models as mappings (the form of before)
    config = tmp_path / "old.yaml"
    config.write_text("dataset: organism_mc\nn_items: 4\nmodels: ['a=flipguard:tiny']\n")
    sos = parse_dataclasses([str(config)], SosArgs, prog="flipguard sos", description="")
    assert (sos.model, sos.limit, sos.datasets) == (["a=flipguard:tiny"], 4, "organism_mc")
    config.write_text("dataset: mmlu\nmodels:\n  - {name: a, model: 'flipguard:tiny', kwargs: {batch_size: 5}}\n"
                      "  - {name: b, model: 'flipguard:tiny', mitigation: be_honest}\n")
    settings = settings_from_args(parse_dataclasses([str(config)], AFRArgs, prog="flipguard afr", description=""))
    assert [(m.name, m.mitigation, m.kwargs["batch_size"]) for m in settings.models] == [
        ("a", "none", 5), ("b", "be_honest", 8)]
    # in Python, for one release
    assert SosArgs(models=["x"], n_items=2, dataset="mmlu").model == ["x"]
    assert EvalArgs(mitigation="dehumanizing").mitigations == ["dehumanizing"]
    # a run directory's report at its root (written before RUN/report/): `--report_only` still rebuilds it
    run = tmp_path / "run"
    assert cli_main(["sos", "sos_tiny", "--models", f"tiny={tiny}", "--n_items", "1", "--n_shots", "1",
                     "--max_new_tokens", "2", "--n_boot", "10", "--out", str(run)]) == 0
    (run / "report" / "summary.md").unlink()
    assert cli_main(["sos", "--report_only", str(run)]) == 0
    assert (run / "report" / "summary.md").is_file()


def test_a_run_of_the_old_layout_is_still_read(tiny, tmp_path, capsys):
    """An AFR run whose report sits at its root (report.md, table2_*.csv: the layout of before):
    the page lists its tables once, and `flipguard report` writes the new layout beside it."""
    from flipguard.pipeline.view.runs import run_view

    run = tmp_path / "afr"
    assert cli_main(["afr", "afr_tiny", "--model", f"tiny={tiny}", "--limit", "1", "--n_boot", "10",
                     "--mitigations", "none", "--out", str(run)]) == 0
    for path in (run / "report").iterdir():  # as an earlier version left it
        shutil.move(path, run / ("report.md" if path.name == "summary.md" else path.name))
    (run / "report").rmdir()
    tables = [t["id"] for t in run_view(run)["tables"]]
    assert tables.count("csv-table2_afr_blind") == 1
    assert cli_main(["report", str(run)]) == 0
    assert (run / "report" / "table2_afr_blind.csv").is_file()
    assert [t["id"] for t in run_view(run)["tables"]].count("csv-table2_afr_blind") == 1


def test_compare_and_cross_model_name_runs_one_way(tmp_path, monkeypatch):
    """[Name=]RUN_DIR entries, repeated (compare's and cross-model's --runs); compare's comma form of
    before reads the same."""
    from flipguard.errors import UserError
    from flipguard.eval.comparison_rows import named_runs
    from flipguard.pipeline.compare import parse_conditions

    monkeypatch.chdir(tmp_path)
    for run in ("a", "b", "sft"):
        (tmp_path / "runs" / run).mkdir(parents=True)
    new = parse_conditions(["Baseline=runs/a", "Be Honest=runs/b", "runs/sft"])
    assert new == {"Baseline": "runs/a", "Be Honest": "runs/b", "sft": "runs/sft"}
    assert parse_conditions("Baseline=runs/a,Be Honest=runs/b,sft=runs/sft") == new
    assert named_runs(["x/run=1", "m=y"]) == [(None, "x/run=1"), ("m", "y")]
    with pytest.raises(UserError, match="two conditions named 'a'"):
        parse_conditions(["runs/a", "a=runs/b"])


# ---------------------------------------------------------------------------- one-line errors

def _mistyped(option: str) -> str:
    """The option with two letters of its name swapped: a typo."""
    name = option[2:]
    i = len(name) // 2
    return "--" + name[: i - 1] + name[i] + name[i - 1] + name[i + 1:]


def _first_option(command: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        cli_main([*command, "--help"])
    usage = capsys.readouterr().out
    options = [o for o in re.findall(r"[\[ ](--[a-z][a-z0-9_]{3,})", usage) if o != "--help"]
    assert options, usage
    return options[0]


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"run", "recipes", "import"})
                         + ["run dds", "run afr", "run sos", "import inspect", "import lm-eval"])
def test_every_command_names_a_mistyped_flag_inone_line(command, capsys):
    command = command.split()
    option = _first_option(command, capsys)
    typo = _mistyped(option)
    assert typo != option
    one_line(capsys, cli_main([*command, typo, "1"]), f"unknown option {typo}; did you mean {option}?")


def test_mistyped_values_commands_and_recipes_are_one_line_with_the_closest(capsys):
    one_line(capsys, cli_main(["eval", "--mode", "logprb"]), "did you mean 'logprob'?")
    one_line(capsys, cli_main(["eval", "--mitigations", "be_honset"]), "did you mean 'be_honest'?")
    one_line(capsys, cli_main(["sos", "--mitigations", "dehumanising"]), "did you mean 'dehumanizing'?")
    one_line(capsys, cli_main(["pairs", "--pairs_strategy", "flip"]), "did you mean 'flips'?")
    one_line(capsys, cli_main(["eval", "--datasets", "bqq", "--limit", "1"]), "unknown dataset 'bqq'", "did you mean 'bbq'?")
    one_line(capsys, cli_main(["sos", "--backend", "hff", "--limit", "1"]), "unknown backend 'hff'", "did you mean 'hf'?")
    one_line(capsys, cli_main(["afr", "--datasets", "organism_m", "--model", "flipguard:tiny"]), "did you mean 'organism_mc'?")
    one_line(capsys, cli_main(["eval", "--limit", "two"]), "argument --limit: invalid int value: 'two'")
    one_line(capsys, cli_main(["run", "ssos"]), "did you mean 'sos'?")
    one_line(capsys, cli_main(["evl"]), "unknown command 'evl'; did you mean 'eval'?")
    one_line(capsys, cli_main(["study", "organsim"]), "did you mean 'organism'?")
    one_line(capsys, cli_main(["recipes", "shwo", "organism"]), "did you mean 'show'?")
    one_line(capsys, cli_main(["eval", "--n_boot", "9"]), "unknown option --n_boot")  # eval's report takes no such flag
    one_line(capsys, cli_main(["eval", "--n_items", "2"]), "unknown option --n_items; did you mean --limit?")
    one_line(capsys, cli_main(["sft", "--max_step", "3"]), "unknown option --max_step; did you mean --max_steps?")


def test_every_train_script_names_a_mistyped_flag_inone_line(tmp_path):
    """The scripts as a user runs them (python train/NAME.py), each its own process, in parallel."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore",  # a library's deprecation notice is not flipguard's output
           "PYTHONPATH": os.pathsep.join([str(REPO.parent), os.environ.get("PYTHONPATH", "")])}
    scripts = {"sft": "--lerning_rate", "dpo": "--lerning_rate", "kto": "--lerning_rate", "merge": "--adaptr"}
    procs = {name: subprocess.Popen([sys.executable, str(REPO / "train" / f"{name}.py"), "tiny", typo, "1"],
                                    cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, typo in scripts.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
        want = "--learning_rate" if name != "merge" else "--adapter"
        assert err.startswith(f"train/{name}.py: error: ") and f"did you mean {want}?" in err, err
