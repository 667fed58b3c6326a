"""Protocols are registered tasks run by one runner: a user's own task (examples/are_you_sure_task.py,
imported with --include, never part of flipguard) runs, resumes and refuses exactly like the built-in ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TASK_FILE = Path(__file__).resolve().parent.parent / "examples" / "are_you_sure_task.py"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", "run", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def test_builtin_tasks_are_registered():
    from flipguard.eval.task_registry import get_task, task_names

    assert {"dds", "afr", "sos"} <= set(task_names())
    for name in ("dds", "afr", "sos"):
        cls = get_task(name)
        assert cls.name == name and hasattr(cls, "args_class")


def test_a_users_task_runs_resumes_and_refuses_another_condition(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    first = _run("--include", str(TASK_FILE), "are-you-sure", "--model", tiny_model_path, "--limit", "3",
                 "--out", str(out), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"{out}: 6 first-turn judgments, 0 already recorded, 6 to run" in first.stdout

    meta = json.loads((out / "run.json").read_text())
    assert meta["protocol"] == "are-you-sure" and meta["model"] == tiny_model_path and meta["n_items"] == 3
    assert meta["invocations"][-1]["calls"] == {"turn 1": 6, "turn 2": 6}

    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 12 and {r["protocol"] for r in records} == {"are-you-sure"}
    first_turn = {(r["item_id"], r["case"].split("/")[0]): r for r in records if r["case"].endswith("/t1")}
    for r in (r for r in records if r["case"].endswith("/t2")):
        before = first_turn[(r["item_id"], r["case"].split("/")[0])]
        # the second turn is the same chat carrying the model's own stored first answer
        assert r["messages"][:1] == before["messages"]
        assert r["messages"][1] == {"role": "assistant", "content": before["raw_output"]}
        assert before["raw_output"] in ("1", "2") and r["messages"][2]["content"].startswith("I don't think")
    kept = sum(first_turn[(r["item_id"], r["case"].split("/")[0])]["choice"] == r["choice"]
               for r in records if r["case"].endswith("/t2"))
    assert json.loads((out / "report.json").read_text()) == {"judgments": 6, "kept": kept}

    # a rerun answers everything from the store: no request, no model loaded
    again = _run("--include", str(TASK_FILE), "are-you-sure", "--model", tiny_model_path, "--limit", "3",
                 "--out", str(out), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "6 already recorded, 0 to run" in again.stdout
    meta = json.loads((out / "run.json").read_text())
    assert len(meta["invocations"]) == 2 and meta["invocations"][-1]["calls_total"] == 0

    # another condition into the same directory: refused by the runner, nothing changed
    before = ((out / "records.jsonl").read_bytes(), (out / "run.json").read_bytes())
    other = _run("--include", str(TASK_FILE), "are-you-sure", "--model", tiny_model_path, "--datasets", "truthfulqa",
                 "--limit", "3", "--out", str(out), cwd=tmp_path)
    assert other.returncode == 2
    assert f"{out / 'run.json'}: this run directory holds another condition (datasets: 'amqa' there, " \
           "'truthfulqa' now)" in other.stderr
    assert ((out / "records.jsonl").read_bytes(), (out / "run.json").read_bytes()) == before


def test_run_lists_tasks_and_names_a_missing_include(tmp_path):
    listing = _run("--include", str(TASK_FILE), "--help", cwd=tmp_path)
    assert listing.returncode == 0 and "are-you-sure" in listing.stdout and "dds" in listing.stdout
    missing = _run("--include", str(tmp_path / "nope.py"), "are-you-sure", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"flipguard run: error: --include {tmp_path / 'nope.py'}: no such file"
    unknown = _run("no-such-task", cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown task 'no-such-task'; registered:" in unknown.stderr


def test_a_second_task_under_a_taken_name_is_refused():
    from flipguard.errors import UserError
    from flipguard.eval.task import Task, register_task

    with pytest.raises(UserError, match="task 'dds' is already registered"):
        @register_task("dds")
        class Impostor(Task):
            pass


def test_eval_takes_the_one_model_spec_syntax():
    """`flipguard eval --model` reads [label=][backend:]model[|adapter] like afr and sos; the plain
    --model/--backend/--adapter flags read as before (label model+adapter)."""
    from flipguard.errors import UserError
    from flipguard.eval.dds import DDSTask, EvalArgs

    spec = DDSTask(EvalArgs(model="judge=openai:Qwen/Qwen2.5-7B-Instruct|runs/adapter", datasets="amqa", limit=1))
    assert (spec.model.label, spec.model.backend, spec.model.model, spec.model.adapter) == \
        ("judge", "openai", "Qwen/Qwen2.5-7B-Instruct", "runs/adapter")
    assert spec.meta()["model"] == "judge" and spec.meta()["backend"] == "openai"
    flags = DDSTask(EvalArgs(model="Qwen/Qwen2.5-7B-Instruct", adapter="runs/adapter", datasets="amqa", limit=1))
    assert (flags.model.label, flags.model.backend, flags.model.adapter) == \
        ("Qwen/Qwen2.5-7B-Instruct+runs/adapter", "hf", "runs/adapter")
    with pytest.raises(UserError, match="names an adapter and --adapter gives another"):
        DDSTask(EvalArgs(model="m|a", adapter="b", datasets="amqa", limit=1))


def test_run_json_records_the_command_as_typed_through_run_too(tmp_path, tiny_model_path):
    """`flipguard run dds ...` is the same run as `flipguard eval ...`, and its run.json says how it was started."""
    out = tmp_path / "dds"
    args = ["dds", "--model", tiny_model_path, "--datasets", "amqa", "--limit", "1", "--out", str(out),
            "--report", "false"]
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "run.json").read_text())
    assert meta["command"] == ["flipguard", "run", *args]
    assert meta["protocol"] == "dds" and meta["invocations"][-1]["calls_total"] == 4
