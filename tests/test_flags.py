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
    # a named folder holds one run: another --limit into it is refused in one line, the run as it was
    shared = tmp_path / "shared"
    assert cli_main([*base, "--limit", "2", "--out", str(shared)]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in shared.iterdir() if p.is_file() and p.name != ".lock"}
    one_line(capsys, cli_main([*base, "--limit", "1", "--out", str(shared)]),
             f"{shared / 'run.json'}: this run directory holds another condition (limit: 2 there, 1 now)")
    assert {p.name: p.read_bytes() for p in shared.iterdir() if p.is_file() and p.name != ".lock"} == before


def test_old_words_are_refused_in_every_command_naming_the_word_to_use(tiny, tmp_path, capsys):
    """The vocabulary's old words (config/vocabulary.LEGACY) are never read in the place of its words: on the
    command line of eval, afr and sos and as a run config's keys, each is one line naming the word to use."""
    from flipguard.config import parse_dataclasses
    from flipguard.config.vocabulary import LEGACY
    from flipguard.eval.afr.protocol import AFRArgs, settings_from_args

    old = {"sos": ["--models", "--n_items", "--dataset"], "afr": ["--models", "--dataset", "--report_only"],
           "eval": ["--mitigation"], "study": ["--eval_plan_limit", "--eval_plan_datasets"],
           "cross-model": ["--names"]}
    for command, flags in old.items():
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        usage = capsys.readouterr().out
        for flag in flags:
            assert not re.search(re.escape(flag) + r"\b", usage), (command, flag)
    for command in ("eval", "afr", "sos"):
        for word in ("n_items", "models", "dataset", "mitigation", "output_dir", "num_threads"):
            err = one_line(capsys, cli_main([command, f"--{word}", "x"]),
                           f"--{word} is an old word, not read: the word is --{LEGACY[word]}")
            assert err.startswith(f"flipguard {command}: error: ")
    # as a run config's keys
    config = tmp_path / "old.yaml"
    for key, value in (("dataset", "organism_mc"), ("n_items", "4"), ("models", "['a=flipguard:tiny']")):
        config.write_text(f"{key}: {value}\n")
        one_line(capsys, cli_main(["sos", str(config)]), f"{config}:1: '{key}' is an old word, not read: the key is "
                                                         f"'{LEGACY[key]}'")
    # AFR's models as mappings (the form of before) under the word of today: `label`, as a spec's label=
    config.write_text("datasets: mmlu\nmodel:\n  - {label: a, model: 'flipguard:tiny', kwargs: {batch_size: 5}}\n"
                      "  - {label: b, model: 'flipguard:tiny', mitigation: be_honest}\n")
    settings = settings_from_args(parse_dataclasses([str(config)], AFRArgs, prog="flipguard afr", description=""))
    assert [(m.name, m.mitigation, m.kwargs["batch_size"]) for m in settings.models] == [
        ("a", "none", 5), ("b", "be_honest", 8)]
    config.write_text("datasets: mmlu\nmodel:\n  - {name: a, model: 'flipguard:tiny'}\n")
    one_line(capsys, cli_main(["afr", str(config)]), "'name' is an old word, not read: the key is 'label'")
    # a run directory's report at its root (written before RUN/report/): `--report_only` still rebuilds it
    run = tmp_path / "run"
    assert cli_main(["sos", "sos_tiny", "--model", f"tiny={tiny}", "--limit", "1", "--n_shots", "1",
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
    # a word eval does not take: one line naming what it takes instead
    one_line(capsys, cli_main(["eval", "--n_boot", "9"]), "--n_boot: flipguard eval's report bootstraps 2,000 replicates")
    one_line(capsys, cli_main(["eval", "--n_items", "2"]), "--n_items is an old word, not read: the word is --limit")
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


def test_the_shared_words_mean_one_thing_in_every_protocol(tmp_path, monkeypatch, capsys):
    """--model defaults to flipguard:tiny in eval, afr and sos alike, a default run folder is
    runs/<protocol>/<model>/<dataset>-<hash> in each, a shared word a protocol does not take is one line
    naming the protocol and what it takes, and `flipguard report RUN` prints the same table for each."""
    monkeypatch.chdir(tmp_path)
    runs = {}
    for command, flags in (("eval", ["--datasets", "bbq", "--limit", "1", "--min_label_mass", "0"]),
                           ("afr", ["--limit", "1", "--k_values", "1", "--cross", "false", "--answer_mode", "logprob",
                                    "--coercion_max_new_tokens", "4", "--n_boot", "10", "--progress", "false"]),
                           ("sos", ["--limit", "1", "--n_shots", "0", "--max_new_tokens", "2", "--n_boot", "10"])):
        assert cli_main([command, *flags]) == 0, command  # no --model: flipguard:tiny, as in every protocol
        capsys.readouterr()
        (run,) = (tmp_path / "runs" / {"eval": "dds"}.get(command, command) / "flipguard-tiny").iterdir()
        meta = json.loads((run / "run.json").read_text())
        assert "flipguard:tiny" in json.dumps({k: meta.get(k) for k in ("model", "models", "settings")}), command
        runs[command] = run
        assert cli_main(["report", str(run)]) == 0
        out = capsys.readouterr().out.splitlines()
        at = out.index(f"{meta.get('protocol')} run {run}:")  # after what a protocol prints of its own (DDS's details)
        assert out[at + 1].split() == ["system", "dataset", "metric", "unit", "value", "[95%", "CI]", "n"], (command, out)
        assert out[at + 2].startswith("flipguard:tiny ") and out[-1] == f"report: {run / 'report' / 'summary.md'}"
    assert runs["eval"].name.startswith("bbq-") and runs["afr"].name.startswith("mmlu-")
    assert runs["sos"].name.startswith("medqa-")
    one_line(capsys, cli_main(["afr", "--max_new_tokens", "4"]), "flipguard afr: error: --max_new_tokens: AFR has two "
             "token budgets: --coercion_max_new_tokens (Stage I arguments) and --answer_max_new_tokens")
    one_line(capsys, cli_main(["sos", "--mode", "logprob"]), "flipguard sos: error: --mode: stick-or-switch generates")
    one_line(capsys, cli_main(["eval", "--model", "a", "--model", "b"]), "a DDS run judges one model")
    one_line(capsys, cli_main(["sos", "--datasets", "medqa,mmlu"]), "a stick-or-switch run measures one dataset")
    one_line(capsys, cli_main(["afr", "--datasets", "mmlu,organism_mc"]), "an AFR run measures one dataset")
