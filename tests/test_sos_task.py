"""Stick-or-switch as a registered task on the one runner (eval/task.run_task): the keys and
run directories made before the move (tests/fixtures/sos_8f327eb, written by commit 8f327eb's
code, never by the code under test) are the ones it makes, and such a folder, without a manifest,
is never written into; the runner refuses another condition; `flipguard run sos` and
`flipguard sos` are one command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_sos_protocol import run_scripted

from flipguard.eval.backends.base import ModelRef
from flipguard.eval.records import load_records
from flipguard.eval.sos.protocol import SosArgs, SosTask
from flipguard.eval.task import run_task
from flipguard.eval.task_registry import get_task

REPO = Path(__file__).resolve().parents[1]
BEFORE = REPO / "tests" / "fixtures" / "sos_8f327eb"
KEYS = json.loads((BEFORE / "keys.json").read_text())
BOUND = 1200  # seconds: an upper bound only, never a synchronisation point
# the flags of the run that made BEFORE/records.jsonl (its README)
BEFORE_FLAGS = ["--datasets", "medqa", "--model", "flipguard:tiny", "--device", "cpu", "--limit", "2",
                "--n_shots", "1", "--max_new_tokens", "8", "--mitigations", "none", "be_honest", "--n_boot", "50"]
BEFORE_ARGS = SosArgs(datasets="medqa", model=["flipguard:tiny"], device="cpu", limit=2, n_shots=1, max_new_tokens=8,
                      mitigations=["none", "be_honest"], n_boot=50)


def _env() -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.pop("FLIPGUARD_DATA", None)  # the shipped samples, as the fixture run used
    env["PYTHONPATH"] = os.pathsep.join([str(REPO.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _flipguard(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *args], env=_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=BOUND)


def _copy_before(out: Path) -> Path:
    """A run directory as the parent commit left it: its records.jsonl and run.json."""
    out.mkdir()
    for name in ("records.jsonl", "run.json"):
        shutil.copy(BEFORE / name, out / name)
    return out


def _no_model_load(monkeypatch):
    def refuse(self):
        raise AssertionError(f"model {self.label} loaded, but every answer is stored")

    monkeypatch.setattr(ModelRef, "load", refuse)


def test_sos_is_the_registered_task():
    assert get_task("sos") is SosTask


def test_every_turns_keys_are_those_of_the_parent_commit(tmp_path):
    """The scripted model reaches turns 2 and 3 and both flexibility branches: every key
    matches the list written by commit 8f327eb's run_sos."""
    _, sent, records = run_scripted(tmp_path)
    assert sent == len(records) == len(KEYS["scripted"]) == 66
    assert sorted([r.key, r.item_id, r.case] for r in records) == KEYS["scripted"]


def test_first_batches_keys_are_those_of_the_parent_commit(monkeypatch):
    """Both mitigations' baselines and openings on the shipped MedQA sample, built without a model."""
    monkeypatch.delenv("FLIPGUARD_DATA", raising=False)
    _no_model_load(monkeypatch)
    task = SosTask(BEFORE_ARGS)
    records = [r for b in task.first_batches() for r in b.records]
    assert sorted([r.key, r.item_id, r.case, r.mitigation] for r in records) == KEYS["tiny"]
    assert len(records) == 2 * 2 * (4 + 3)


def test_a_run_directory_from_before_manifests_is_refused_unchanged(tmp_path, monkeypatch):
    """The parent commit's run folder has no manifest: nothing proves its files flipguard's, so resuming it is
    refused in one line, its records.jsonl and run.json byte-identical."""
    from flipguard.errors import RecordError

    monkeypatch.delenv("FLIPGUARD_DATA", raising=False)
    _no_model_load(monkeypatch)
    out = tmp_path / "run"
    _copy_before(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RecordError, match="was not written by flipguard .no .flipguard.json beside it"):
        run_task(SosTask(BEFORE_ARGS), out, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == before


def test_another_setting_into_the_same_out_is_refused_by_the_runner(tmp_path):
    """A real `flipguard run sos` process: exit 2, one line naming run.json and the key,
    records.jsonl and run.json byte-identical."""
    out = tmp_path / "run"
    _copy_before(out)
    records, meta = (out / "records.jsonl").read_bytes(), (out / "run.json").read_bytes()
    proc = _flipguard("run", "sos", *BEFORE_FLAGS, "--seed", "1", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert str(out / "run.json") in last and "seed: 0 there, 1 now" in last, last
    assert (out / "records.jsonl").read_bytes() == records and (out / "run.json").read_bytes() == meta
    assert sorted(p.name for p in out.iterdir()) == ["records.jsonl", "run.json"]  # a refusal leaves no lock file


def test_run_sos_and_sos_are_one_command(tmp_path, tiny_model_path):
    """The same YAML and flags through `flipguard run sos` and `flipguard sos` (real
    processes): the same requests; each resumes the other's directory with zero calls."""
    flags = [str(REPO / "recipes" / "sos_tiny.yaml"), "--model", f"tiny={tiny_model_path}", "--limit", "1",
             "--n_shots", "1", "--max_new_tokens", "4", "--n_boot", "20", "--mitigations", "none"]
    runs = {}
    for command in (["run", "sos"], ["sos"]):
        out = tmp_path / "_".join(command)
        proc = _flipguard(*command, *flags, "--out", str(out), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        runs[tuple(command)] = out
        assert (out / "report" / "summary.md").stat().st_size > 0
        meta = json.loads((out / "run.json").read_text())
        assert meta["command"][:1 + len(command)] == ["flipguard", *command]
        # 1 item: 4 baselines + 3 openings, then turn 2 only where the model held its target
        assert meta["invocations"][-1]["calls_total"] == len(load_records(out)) >= 7
    keys = {c: sorted(r.key for r in load_records(out)) for c, out in runs.items()}
    assert keys[("run", "sos")] == keys[("sos",)]
    for command, out in ((["sos"], runs[("run", "sos")]), (["run", "sos"], runs[("sos",)])):
        proc = _flipguard(*command, *flags, "--out", str(out), "--report", "false", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert json.loads((out / "run.json").read_text())["invocations"][-1]["calls_total"] == 0


def test_report_only_through_run_sos(tmp_path):
    """--report_only rebuilds the report of a run directory with no model (here: the fixture's)."""
    out = tmp_path / "run"
    _copy_before(out)
    proc = _flipguard("run", "sos", "--report_only", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"report: {out / 'report' / 'summary.md'}"
    assert "2 (test split)" in (out / "report" / "summary.md").read_text()
    assert (out / "records.jsonl").read_bytes() == (BEFORE / "records.jsonl").read_bytes()


@pytest.mark.parametrize("change, message", [
    ({"scenarios": ["positve"]}, "--scenarios: unknown ['positve']"),
    ({"repeats": 0}, "--repeats must be >= 1"),
    ({"mitigations": ["nope"]}, "--mitigations: unknown ['nope']"),
])
def test_bad_settings_are_refused_before_a_run_directory_exists(tmp_path, change, message):
    from flipguard.errors import FlipguardError

    out = tmp_path / "run"
    with pytest.raises(FlipguardError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_task(SosTask(SosArgs(**{**BEFORE_ARGS.__dict__, **change})), out, progress=False)
    assert not out.exists()


def test_unreadable_replies_are_not_meaningful_in_every_table_and_readable_ones_unchanged(tmp_path):
    """Issue 47. The fixture's run of the tiny model (every reply unreadable, written by flipguard sos): each
    report CSV has `meaningful` False and its rates empty, never 0.0, counts as integers; summary.md marks them
    n/m; compare's comparison_protocols.csv and its section too. The scripted model (readable replies but one)
    keeps its numbers, `meaningful` True."""
    import csv as csv_module

    from flipguard.eval.sos.metrics import summarise
    from flipguard.eval.sos.report import write_report
    from flipguard.pipeline.cli import main as cli_main

    def rows(path):
        with open(path, newline="", encoding="utf-8") as fh:
            return list(csv_module.DictReader(fh))

    run = _copy_before(tmp_path / "tiny")
    assert cli_main(["report", str(run)]) == 0
    report = run / "report"
    rates = {"sos_table_a1_conversation_tax.csv": ("ss", "mt", "delta_pp", "delta_ci_low", "delta_ci_high"),
             "sos_table_a2_abstention_penalty.csv": ("ss", "mt", "delta_pp", "other_ss", "other_delta_pp"),
             "sos_table_a3_flexibility.csv": ("abstained_t1", "correct_switch", "incorrect_switch", "delta_pp"),
             "sos_baselines.csv": ("ss_full", "ss_full_ci_low", "ss_binary", "abstain_full", "abstain_binary"),
             "sos_survival.csv": ("survival",)}
    counts = ("n_items", "n_conversations", "n_abstained", "turn", "invalid_ended", "ss_full_invalid")
    for name, columns in rates.items():
        table = rows(report / name)
        assert len(table) >= 2, name  # both systems (none, be_honest)
        for r in table:
            assert r["meaningful"] == "False" and all(r[c] == "" for c in columns), (name, r)
            assert all(r[c].isdigit() for c in counts if c in r), (name, r)
    md = (report / "summary.md").read_text()
    tax = [line for line in md.splitlines() if line.startswith("| flipguard:tiny") and "| n/m | n/m (n/m) |" in line]
    assert len(tax) == 6 and "n/m = not meaningful" in md  # tables A.1-A.3, both systems
    base = [line for line in md.splitlines() if line.startswith("| flipguard:tiny") and line.endswith("| n/m | n/m | n/m | n/m |")]
    assert base and not any("0.0" in line for line in tax + base)
    summary = json.loads((report / "summary.json").read_text())["systems"]["flipguard:tiny"]
    assert summary["ss_full"]["meaningful"] is False and summary["ss_full"]["n_valid"] == 0

    out = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"Baseline={run}@flipguard:tiny", f"Be Honest={run}@flipguard:tiny +be_honest",
                     "--out", str(out), "--n_boot", "20"]) == 0
    proto = rows(out / "comparison_protocols.csv")
    assert proto and list(proto[0])[-1] == "meaningful"
    assert all(r["meaningful"] == "False" and r["value"] == r["ci_low"] == "" and r["n"] == "2" for r in proto)
    section = (out / "comparison.md").read_text().split("## Stick-or-switch")[1]
    line = next(x for x in section.splitlines() if x.startswith("| Be Honest |"))
    assert "n/m (0 of 2 valid)" in line and "0.0" not in line  # ss_accuracy: 0 of its 2 replies readable
    transfer = rows(out / "transfer.csv")
    assert transfer and all(r["meaningful"] == "False" and r["change"] == "" for r in transfer)

    # readable replies: every number kept, meaningful True
    scripted = tmp_path / "scripted"
    _, _, records = run_scripted(scripted)
    write_report(scripted, n_boot=50)
    res = summarise(records, seed=0, n_boot=50)["scripted"]
    (tax_row,) = rows(scripted / "report" / "sos_table_a1_conversation_tax.csv")
    assert tax_row["meaningful"] == "True" and float(tax_row["delta_pp"]) == pytest.approx(200 / 6 - 50.0)
    assert float(tax_row["ss"]) == res["ss_full"]["value"] and tax_row["n_items"] == "6"
    assert "n/m" not in (scripted / "report" / "summary.md").read_text()
