"""Runs other tools made, in and out (eval/interop), with the real tools, offline: inspect_ai evaluates a
small task on its `mockllm/model` (replies set per question: examples/inspect_arith.py), lm-evaluation-harness's own command
evaluates the embedded tiny model and the organism on a few local MMLU questions (--log_samples); flipguard
imports two runs, compares them and shows them, refuses runs of other items, and writes its own runs as
inspect_ai logs that inspect_ai's reader and viewer bundle open. Every expected number is read from the
tools' own files or worked out by hand (McNemar: scipy's binomial test of the discordant pairs)."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from importlib.metadata import version
from pathlib import Path

import pytest
from fixture_runs import unpack_run
from scipy.stats import binomtest
from served import ServerProcess

from flipguard.eval.interop.export import log_name
from flipguard.eval.records import Record
from flipguard.eval.task_registry import get_task
from flipguard.pipeline.cli import main as cli_main

pytest.importorskip("inspect_ai")
pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "runs_25137aa"
N = 8  # questions of the inspect task


def _example():
    """examples/inspect_arith.py (the worked example of docs/interop.md): its inspect_ai runs on mockllm."""
    spec = importlib.util.spec_from_file_location("inspect_arith", ROOT / "examples" / "inspect_arith.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inspect_run(log_dir: Path, wrong: set[int], n: int = N, **kw) -> Path:
    """A real inspect_ai run of task `arith` (What is i+i?, target 2i; match and includes) on mockllm/model,
    which answers 2i, or "no idea" for the questions in `wrong`: the log inspect_ai wrote."""
    return _example().inspect_run(log_dir, wrong, n=n, **kw)


@pytest.fixture(autouse=True)
def offline_tool_homes(tmp_path, monkeypatch):
    """inspect_ai keeps traces and buffers under the user's data folder: this test's instead."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


class InspectView(ServerProcess):
    """`inspect view --log-dir DIR`, inspect_ai's own log viewer, as a real server process."""

    name = "inspect view"
    ready_path = "/api/log-files"

    def __init__(self, server_dir: Path, log_dir: Path):
        super().__init__(server_dir, env={**os.environ})
        self.served = log_dir

    def command(self) -> list[str]:
        return [sys.executable, "-m", "inspect_ai", "view", "--log-dir", str(self.served), "--host", "127.0.0.1",
                "--port", str(self.port)]

    def get(self, path: str):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=60) as resp:
            return json.loads(resp.read().decode("utf-8"))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_inspect_runs_imported_compared_and_viewed(tmp_path, capsys):
    wrong = {5, 6, 7}  # before: 5 of 8 right; after: all 8 right
    before = inspect_run(tmp_path / "logs-before", wrong, log_format="eval")
    after = inspect_run(tmp_path / "logs-after", set(), log_format="json")
    run = tmp_path / "runs" / "arith"
    assert cli_main(["import", "inspect", f"before={before}", f"after={after}", "--out", str(run)]) == 0
    printed = capsys.readouterr().out
    assert f"flipguard compare --runs before={run}@before,after={run}@after" in printed

    records = {(r["model"], r["item_id"]): r for r in _lines(run / "records.jsonl")}
    assert len(records) == 2 * N
    miss, hit = records[("before", "5")], records[("after", "5")]
    assert (miss["expected"], miss["raw_output"], miss["messages"]) == ("10", "no idea", [{"role": "user", "content": "What is 5+5?"}])
    assert miss["extra"]["scores"] == {"match": 0.0, "includes": 0.0}
    assert miss["extra"]["score_values"] == {"match": "I", "includes": "I"}  # as inspect_ai logged them
    assert (hit["choice"], hit["extra"]["scores"], hit["extra"]["metadata"]) == ("10", {"match": 1.0, "includes": 1.0},
                                                                                   {"parity": "odd"})
    assert miss["extra"]["signature"] == hit["extra"]["signature"]  # the same question: paired
    meta = json.loads((run / "run.json").read_text())
    assert meta["protocol"] == "inspect" and meta["models"] == ["before", "after"] and meta["datasets"] == ["arith"]
    sources = {s["label"]: s for s in meta["sources"]}
    assert sources["before"]["files"] == [{"path": str(before.resolve()), "sha256": _sha256(before)}]
    assert sources["after"]["files"] == [{"path": str(after.resolve()), "sha256": _sha256(after)}]
    assert {(s["tool"], s["tool_version"], s["model"], json.dumps(s["tasks"])) for s in sources.values()} == {
        ("inspect_ai", version("inspect_ai"), "mockllm/model", '{"arith": "1"}')}

    # importing the same logs again adds nothing
    assert cli_main(["import", "inspect", f"before={before}", f"after={after}", "--out", str(run)]) == 0
    assert "(0 new)" in capsys.readouterr().out

    cmp = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"before={run}@before,after={run}@after", "--out", str(cmp),
                     "--n_boot", "500"]) == 0
    printed = capsys.readouterr().out
    assert "## Paired tests" in printed and "inspect:arith:match" in printed
    levels = {(r["condition"], r["metric"]): float(r["value"]) for r in _csv(cmp / "comparison_protocols.csv")}
    assert levels == {("before", "match"): 62.5, ("before", "includes"): 62.5, ("after", "match"): 100.0,
                      ("after", "includes"): 100.0}
    rows = {r["cell"]: r for r in _csv(cmp / "transfer.csv") if r["condition"] == "after"}
    assert set(rows) == {"inspect:arith:match", "inspect:arith:includes"}
    mcnemar = binomtest(0, len(wrong), 0.5).pvalue  # 3 discordant pairs, all fixed
    for r in rows.values():
        assert (float(r["baseline"]), float(r["value"]), float(r["change"]), int(r["n_units"])) == (62.5, 100.0, 37.5, N)
        assert (r["test"], float(r["mcnemar_p"])) == ("mcnemar", pytest.approx(mcnemar))
        assert float(r["p_adjusted"]) == pytest.approx(min(1.0, 2 * mcnemar))  # Holm over the 2 cells, equal p
        # 8 items: the exact test needs 6 of them changed one way (75 pp), more than the bootstrap's 2.8 SE here
        assert float(r["mdd"]) == pytest.approx(75.0)
        assert r["verdict"] == "too few items to tell"
    assert cli_main(["compare", "--runs", f"before={run}@before,after={run}@after", "--out", str(tmp_path / "cmp-bh"),
                     "--n_boot", "200", "--correction", "bh"]) == 0
    bh = [float(r["p_adjusted"]) for r in _csv(tmp_path / "cmp-bh" / "transfer.csv") if r["condition"] == "after"]
    assert bh == pytest.approx([mcnemar, mcnemar])  # BH, two equal p: p * 2 / 2
    capsys.readouterr()

    from flipguard.pipeline.view import build_view

    page = build_view(cmp)
    changed = {e["item"] for e in page["entries"] if e["type"] == "better" and e["condition"] == "after"}
    assert changed == {str(i) for i in wrong}
    assert {t["id"] for t in page["tables"]} >= {"protocols", "transfer"}
    assert cli_main(["view", str(run)]) == 0 and (run / "view.html").stat().st_size > 0
    samples = build_view(run)["entries"]
    assert len(samples) == 2 * N and {e["type"] for e in samples} == {"all 0", "all 1"}


def test_runs_of_other_items_are_refused_at_import_and_at_compare(tmp_path, capsys):
    before = inspect_run(tmp_path / "logs-before", set())
    # another task version, a reworded question 2, another target for 3, a question 9 more
    changed = inspect_run(tmp_path / "logs-changed", set(), version=2, prompts={2: "Compute 2 + 2."},
                          targets={3: "six"}, n=N + 1)
    out = tmp_path / "runs" / "both"
    assert cli_main(["import", "inspect", f"before={before}", f"changed={changed}", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "task arith" in err and "nothing was imported" in err
    for part in ("task version 1 in before, 2 in changed", "1 item of 8 with another prompt (ids 2)",
                 "1 item of 8 with another target (ids 3)", "1 item only in changed (ids 9)"):
        assert part in err, err
    assert not out.exists()  # refused before anything was written
    mine = tmp_path / "notes"  # a folder of the user's: flipguard writes nothing into it
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert cli_main(["import", "inspect", f"before={before}", "--out", str(mine)]) == 2
    assert "was not written by flipguard" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]

    # imported apart, the two are still refused when compared
    assert cli_main(["import", "inspect", f"before={before}", "--out", str(tmp_path / "a")]) == 0
    assert cli_main(["import", "inspect", f"changed={changed}", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    cmp = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"before={tmp_path / 'a'},changed={tmp_path / 'b'}", "--out", str(cmp)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "changed is not paired with before" in err
    assert "1 item only in changed (ids 9)" in err and not cmp.exists()

    # a second run under a label the folder already holds, with other answers: refused, the folder unchanged
    other = inspect_run(tmp_path / "logs-other", {1})
    held = (tmp_path / "a" / "records.jsonl").read_bytes()
    assert cli_main(["import", "inspect", f"before={other}", "--out", str(tmp_path / "a")]) == 2
    assert "already holds 'before'" in capsys.readouterr().err
    assert (tmp_path / "a" / "records.jsonl").read_bytes() == held


def _provider_error(failing: int):
    """A model call that raises for question `failing`, as a provider's outage does."""
    def before_reply(i: int) -> None:
        if i == failing:
            raise RuntimeError("provider unavailable (HTTP 503)")
    return before_reply


def _killed_inspect_run(log_dir: Path, tmp_path: Path) -> Path:
    """A real inspect_ai run in a second process, killed (SIGKILL) while the model answers question 3:
    the log it leaves behind (status "started")."""
    marker = tmp_path / "answering-3"
    script = (f"import importlib.util, pathlib, sys, time\n"
              f"spec = importlib.util.spec_from_file_location('inspect_arith', {str(ROOT / 'examples' / 'inspect_arith.py')!r})\n"
              "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
              "def hang(i):\n"
              f"    if i == 3:\n        pathlib.Path({str(marker)!r}).write_text('x')\n        time.sleep(3600)\n"
              f"module.inspect_run({str(log_dir)!r}, set(), before_reply=hang, max_connections=1, max_samples=1)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], env=os.environ.copy(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    (log,) = log_dir.glob("*.eval")
    return log


def test_an_inspect_run_that_did_not_finish_is_refused_or_imported_marked_incomplete(tmp_path, capsys):
    from inspect_ai.log import read_eval_log

    failed = inspect_run(tmp_path / "logs-failed", set(), before_reply=_provider_error(5), max_connections=1)
    errors = inspect_run(tmp_path / "logs-errors", set(), before_reply=_provider_error(5), fail_on_error=False)
    killed = _killed_inspect_run(tmp_path / "logs-killed", tmp_path)
    statuses = {p: read_eval_log(str(p)).status for p in (failed, errors, killed)}
    assert statuses == {failed: "error", errors: "success", killed: "started"}  # as inspect_ai logged them
    assert sum(s.error is not None for s in read_eval_log(str(errors)).samples) == 1
    for log, why in ((failed, "status error: RuntimeError"), (errors, "1 of 8 samples ended in an error (sample 5: "
                                                                      "RuntimeError('provider unavailable"),
                     (killed, "status started")):
        out = tmp_path / "runs" / log.parent.name
        assert cli_main(["import", "inspect", str(log), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err and "did not finish" in err, err
        assert str(log) in err and not out.exists()
        # a killed run's log may hold no sample yet (inspect_ai writes them in batches): nothing to import then
        assert "--allow_incomplete" in err or "its log holds no samples" in err

    # imported on purpose: run.json says so, view marks every table, compare computes nothing from it
    ok_run, run = tmp_path / "runs" / "ok", tmp_path / "runs" / "failed"
    assert cli_main(["import", "inspect", f"ok={inspect_run(tmp_path / 'logs-ok', set())}", "--out", str(ok_run)]) == 0
    meta = json.loads((ok_run / "run.json").read_text())
    assert meta["complete"] is True and "incomplete" not in meta
    assert cli_main(["import", "inspect", f"failed={failed}", "--out", str(run), "--allow_incomplete"]) == 0
    printed = capsys.readouterr().out
    assert "failed: mockllm/model" in printed and "INCOMPLETE: status error" in printed
    assert "run.json says complete: false" in printed
    meta = json.loads((run / "run.json").read_text())
    assert meta["complete"] is False and list(meta["incomplete"]) == ["failed"]
    assert meta["incomplete"]["failed"].startswith("status error: RuntimeError")
    assert meta["sources"][0]["incomplete"] == meta["incomplete"]["failed"]
    from flipguard.pipeline.view import build_view

    page = build_view(run)
    assert "incomplete: failed: status error" in page["subtitle"]
    assert page["tables"] and all("incomplete: failed: status error" in t["title"] for t in page["tables"])
    assert "incomplete: failed: status error" in page["entries_title"]
    assert cli_main(["compare", "--runs", f"ok={ok_run},failed={run}", "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "incomplete: failed: status error" in err and not (tmp_path / "cmp").exists()


def lm_eval_run(out: Path, model: str, task_dir: Path, *extra: str) -> Path:
    """lm-evaluation-harness's own command (`lm_eval run ... --log_samples`), in this process."""
    from lm_eval.__main__ import cli_evaluate

    argv = sys.argv
    sys.argv = ["lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
                "--tasks", "flipguard_mmlu", "--include_path", str(task_dir), "--log_samples", "--output_path", str(out),
                "--device", "cpu", "--batch_size", "8", *extra]
    try:
        cli_evaluate()
    finally:
        sys.argv = argv
    return out


@pytest.fixture
def mmlu_task(tmp_path) -> Path:
    """Six local MMLU questions as lm-eval's own task YAML (pipeline/capability.py)."""
    from flipguard.pipeline.capability import write_task

    return write_task(tmp_path / "task", per_subject=1, data_root=None, limit=6)


def _samples(folder: Path) -> dict[str, dict]:
    (path,) = folder.rglob("samples_flipguard_mmlu_*.jsonl")
    return {str(line["doc_id"]): line for line in _lines(path)}


def test_two_lm_eval_runs_imported_and_compared(tmp_path, mmlu_task, tiny_model_path, organism_path, capsys):
    tiny = lm_eval_run(tmp_path / "lm-tiny", tiny_model_path, mmlu_task)
    organism = lm_eval_run(tmp_path / "lm-organism", str(organism_path), mmlu_task)
    run = tmp_path / "runs" / "mmlu"
    assert cli_main(["import", "lm-eval", f"tiny={tiny}", f"organism={organism}", "--out", str(run)]) == 0
    capsys.readouterr()
    lines = {"tiny": _samples(tiny), "organism": _samples(organism)}
    records = {(r["model"], r["item_id"]): r for r in _lines(run / "records.jsonl")}
    assert len(records) == 12
    for (label, doc_id), r in records.items():
        line = lines[label][doc_id]
        assert (r["expected"], r["case"], r["extra"]["scores"]) == (line["target"], "none", {"acc": line["acc"]})
        assert r["extra"]["signature"]["prompt"] == line["prompt_hash"] and r["extra"]["doc"] == line["doc"]
        assert r["messages"][0]["content"] == line["arguments"]["gen_args_0"]["arg_0"]
        # the answer: the option letter whose continuation lm-eval scored highest
        best = max(range(4), key=lambda i: float(line["filtered_resps"][i][0]))
        assert r["choice"] == "ABCD"[best]
    sources = {s["label"]: s for s in json.loads((run / "run.json").read_text())["sources"]}
    (results,) = tiny.rglob("results_*.json")
    assert sources["tiny"]["files"][0] == {"path": str(results.resolve()), "sha256": _sha256(results)}
    assert (sources["tiny"]["tool"], sources["tiny"]["tool_version"], sources["tiny"]["tasks"]) == (
        "lm-eval", version("lm_eval"), {"flipguard_mmlu": "1.0"})
    assert sources["organism"]["model"] == str(organism_path)

    cmp = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"tiny={run}@tiny,organism={run}@organism", "--out", str(cmp),
                     "--n_boot", "300"]) == 0
    (row,) = [r for r in _csv(cmp / "transfer.csv") if r["condition"] == "organism"]
    a = [lines["tiny"][k]["acc"] for k in sorted(lines["tiny"])]
    b = [lines["organism"][k]["acc"] for k in sorted(lines["tiny"])]
    assert row["cell"] == "lm-eval:flipguard_mmlu:acc" and int(row["n_units"]) == 6
    assert float(row["change"]) == pytest.approx(100 * (sum(b) - sum(a)) / 6, abs=1e-3)
    fixed, broken = sum(x == 0 and y == 1 for x, y in zip(a, b)), sum(x == 1 and y == 0 for x, y in zip(a, b))
    expected_p = binomtest(min(fixed, broken), fixed + broken, 0.5).pvalue if fixed + broken else 1.0
    assert float(row["mcnemar_p"]) == pytest.approx(expected_p)
    assert float(row["mdd"]) == pytest.approx(100.0) and row["verdict"] == "too few items to tell"  # 6 of 6 items


def test_an_lm_eval_run_with_another_prompt_is_refused(tmp_path, mmlu_task, tiny_model_path, capsys):
    zero = lm_eval_run(tmp_path / "lm-zero", tiny_model_path, mmlu_task)
    one = lm_eval_run(tmp_path / "lm-one", tiny_model_path, mmlu_task, "--num_fewshot", "1")
    capsys.readouterr()  # lm-eval's own log lines
    out = tmp_path / "runs" / "both"
    assert cli_main(["import", "lm-eval", f"zero={zero}", f"one={one}", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "task flipguard_mmlu" in err
    assert "n-shot 0 in zero, 1 in one" in err and "6 items of 6 with another prompt" in err and not out.exists()


@pytest.mark.parametrize("name", ["dds_logprob", "afr", "sos"])
def test_a_flipguard_run_exported_opens_in_inspect_ai(name, tmp_path, capsys):
    from inspect_ai.log import bundle_log_dir, list_eval_logs, read_eval_log, read_eval_log_sample_summaries

    run = unpack_run(FIXTURES / name, tmp_path / name)
    protocol = json.loads((run / "run.json").read_text())["protocol"]
    if protocol == "dds":
        assert cli_main(["report", str(run)]) == 0  # the DDS numbers go into the log's results
    out = tmp_path / "exported"
    assert cli_main(["export", "--format", "inspect", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    lines = _lines(run / "records.jsonl")
    system_of = get_task(protocol).system_of
    logs = sorted(out.glob("*.eval"))
    assert logs and len(list_eval_logs(str(out))) == len(logs)
    total = 0
    for path in logs:
        log = read_eval_log(str(path))
        mine = [r for r in lines if system_of(Record.from_dict(r)) == log.eval.model]
        assert mine and len(log.samples) == len(mine) and log.status == "success"
        assert log.eval.task == f"flipguard/{protocol}" and log.eval.metadata["protocol"] == protocol
        assert len({s.id for s in log.samples}) == len(mine)
        by_key = {s.metadata["record_key"]: s for s in log.samples}
        for r in mine:
            right = r["valid"] and r["choice"] == r["expected"]
            s = by_key[r["key"]]
            assert (s.scores["correct"].value, s.scores["correct"].answer) == ("C" if right else "I", r["choice"])
            assert s.target == (r["expected"] or "") and s.output.completion == (r["raw_output"] or "")
            assert [m.text for m in s.input] == [m["content"] for m in r["messages"] or []]
        accuracy = sum(r["valid"] and r["choice"] == r["expected"] for r in mine) / len(mine)
        assert log.results.scores[0].metrics["accuracy"].value == pytest.approx(accuracy)
        assert len(read_eval_log_sample_summaries(str(path))) == len(mine)  # the viewer's sample list
        total += len(mine)
    assert total == len(lines)
    if protocol == "dds":
        (summary,) = [r for r in _csv(run / "report" / "summary.csv") if r["dataset"] == "truthfulqa"]
        numbers = read_eval_log(str(logs[0])).results.scores[1]
        dds = numbers.metrics["truthfulqa/dds"]
        if summary["meaningful"] == "False":  # the tiny model answers "1" always: no DDS, said so in the log too
            assert summary["dds"] == "" and math.isnan(dds.value) and dds.metadata["meaningful"] is False
        else:
            assert numbers.name == "dds" and dds.value == pytest.approx(float(summary["dds"]))
    # the viewer's own bundle (`inspect view bundle`) lists every log with its model and task
    bundle_log_dir(log_dir=str(out), output_dir=str(tmp_path / "bundle"))
    listing = json.loads((tmp_path / "bundle" / "logs" / "listing.json").read_text())
    assert {(v["task"], v["status"]) for v in listing.values()} == {(f"flipguard/{protocol}", "success")}
    assert sorted(listing) == sorted(p.name for p in logs)
    if protocol == "dds":  # and `inspect view` itself serves them: the list, then a whole log as the page loads it
        with InspectView(tmp_path / "view-server", out) as view:
            files = [f["name"] for f in view.get("/api/log-files")["files"]]
            assert sorted(Path(urllib.parse.urlparse(f).path).name for f in files) == sorted(p.name for p in logs)
            served = view.get("/api/logs/" + urllib.parse.quote(str(logs[0].resolve()), safe=""))
            assert (served["status"], served["eval"]["model"], len(served["samples"])) == (
                "success", read_eval_log(str(logs[0])).eval.model, len(read_eval_log(str(logs[0])).samples))
    # a second export replaces flipguard's own logs; a file of the user's where a log goes is refused
    assert cli_main(["export", "--format", "inspect", str(run), "--out", str(out)]) == 0
    (out / logs[0].name).write_text("mine")
    assert cli_main(["export", "--format", "inspect", str(run), "--out", str(out)]) == 2
    assert "changed since flipguard wrote it" in capsys.readouterr().err and (out / logs[0].name).read_text() == "mine"


def test_lm_eval_samples_missing_documents_are_refused_or_imported_marked_incomplete(tmp_path, mmlu_task,
                                                                                     tiny_model_path, capsys):
    run = lm_eval_run(tmp_path / "lm-tiny", tiny_model_path, mmlu_task)
    (samples,) = run.rglob("samples_flipguard_mmlu_*.jsonl")
    (results,) = run.rglob("results_*.json")
    effective = json.loads(results.read_text())["n-samples"]["flipguard_mmlu"]["effective"]
    lines = samples.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(lines) == effective == 6
    samples.write_text("".join(lines[:3]), encoding="utf-8")  # the file cut off after 3 of its documents
    capsys.readouterr()
    out = tmp_path / "runs" / "mmlu"
    assert cli_main(["import", "lm-eval", f"tiny={run}", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did not finish (task flipguard_mmlu: 3 of its 6 documents" in err, err
    assert str(results) in err and not out.exists()
    assert cli_main(["import", "lm-eval", f"tiny={run}", "--out", str(out), "--allow_incomplete"]) == 0
    assert "INCOMPLETE: task flipguard_mmlu: 3 of its 6 documents" in capsys.readouterr().out
    meta = json.loads((out / "run.json").read_text())
    assert meta["complete"] is False and meta["incomplete"] == {"tiny": "task flipguard_mmlu: 3 of its 6 documents "
                                                                        "in its samples file"}


def test_an_afr_run_with_a_mitigation_exports_one_log_per_system_and_round_trips(tmp_path, tiny_model_path, capsys):
    from inspect_ai.log import read_eval_log

    run, out = tmp_path / "afr", tmp_path / "exported"
    assert cli_main(["afr", "--model", f"tiny={tiny_model_path}", "--limit", "2", "--mitigations", "none", "be_honest",
                     "--n_boot", "50", "--out", str(run)]) == 0
    assert cli_main(["export", "--format", "inspect", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    records = _lines(run / "records.jsonl")
    by_system: dict[str, list[dict]] = {}
    for r in records:  # the report's systems: the model labels the run gave ('tiny', 'tiny +be_honest')
        by_system.setdefault(r["model"], []).append(r)
    assert set(by_system) == {"tiny", "tiny +be_honest"}
    assert sorted(p.name for p in out.glob("*.eval")) == ["afr_tiny-be_honest.eval", "afr_tiny.eval"]
    logs = {read_eval_log(str(p)).eval.model: read_eval_log(str(p)) for p in out.glob("*.eval")}
    assert set(logs) == set(by_system)
    accuracy = {}
    for system, recs in by_system.items():
        log = logs[system]
        assert log.status == "success" and len(log.samples) == len(recs)
        assert {s.metadata["record_key"] for s in log.samples} == {r["key"] for r in recs}
        accuracy[system] = sum(r["valid"] and r["choice"] == r["expected"] for r in recs) / len(recs)
        assert log.results.scores[0].metrics["accuracy"].value == pytest.approx(accuracy[system])

    # back in, each log a run of its own (the mitigation's system prompt makes its prompts other items): every
    # sample, its answer, the same accuracy (the `correct` score's mean)
    for system, recs in by_system.items():
        back = tmp_path / "back" / system.replace(" +", "-")
        assert cli_main(["import", "inspect", str(out / log_name("afr", system)), "--out", str(back)]) == 0
        capsys.readouterr()
        mine = _lines(back / "records.jsonl")
        assert json.loads((back / "run.json").read_text())["models"] == [system]
        right = {r["key"]: float(r["valid"] and r["choice"] == r["expected"]) for r in recs}
        assert {r["extra"]["metadata"]["record_key"]: r["extra"]["scores"]["correct"] for r in mine} == right
        assert {r["extra"]["metadata"]["record_key"]: r["raw_output"] for r in mine} == {
            r["key"]: r["raw_output"] or "" for r in recs}
        (row,) = [r for r in get_task("inspect").comparison_rows(back) if r["metric"] == "correct"]
        assert (row["system"], row["estimate"].n) == (system, len(recs))
        assert row["estimate"].value == pytest.approx(accuracy[system])

    # a run whose records.jsonl was cut in half exports as "started" (not finished), without its AFR numbers
    data = (run / "records.jsonl").read_bytes()
    (run / "records.jsonl").write_bytes(data[: data.index(b"\n", len(data) // 2) + 1])
    cut = tmp_path / "cut"
    assert cli_main(["export", "--format", "inspect", str(run), "--out", str(cut)]) == 0
    printed = capsys.readouterr().out
    assert "status started: incomplete" in printed and "records its run.json lists" in printed
    statuses = {read_eval_log(str(p)).status for p in cut.glob("*.eval")}
    assert statuses == {"started"}
    assert all(len(read_eval_log(str(p)).results.scores) == 1 for p in cut.glob("*.eval"))  # accuracy only
    assert cli_main(["import", "inspect", str(cut), "--out", str(tmp_path / "cut-back")]) == 2
    assert "did not finish (status started)" in capsys.readouterr().err
