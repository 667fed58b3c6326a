"""AFR as a registered task on the one runner (eval/task.py): its first batches have the keys of a
run directory written before it (commit 8f327eb, tests/fixtures/afr_8f327eb), which, having no
manifest, is never written into; a rerun with another condition is refused by the runner with
nothing written, and `flipguard run afr` is `flipguard afr`."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fixture_runs import written_by_flipguard

from flipguard.eval.afr import protocol as PR
from flipguard.pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "afr_8f327eb"
BOUND = 1800  # seconds: an upper bound only, never a synchronisation point


def _settings(**kw) -> PR.AFRSettings:
    config = yaml.safe_load((FIXTURE / "afr.yaml").read_text())
    config.pop("progress")
    config.update(kw)
    # a run config's mappings name their label `label`; build_settings takes the entries as model_entries makes them
    models = [{("name" if k == "label" else k): v for k, v in m.items()} for m in config.pop("model")]
    return PR.build_settings(models, **config)


def _old_run(tmp_path: Path) -> Path:
    """The 8f327eb run directory as it was left (records, run.json)."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "records.jsonl").write_bytes(gzip.decompress((FIXTURE / "records.jsonl.gz").read_bytes()))
    shutil.copy(FIXTURE / "run.json", run / "run.json")
    return run


def _old_run_rewritten(tmp_path: Path) -> Path:
    """The 8f327eb run's records and run.json, written into a new folder by flipguard's own writers."""
    return written_by_flipguard(_old_run(tmp_path / "old"), tmp_path / "run")


def _files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: a resumed run must not need one."""
    from flipguard.eval.backends.base import ModelRef

    def load(self):
        raise AssertionError(f"model {self.label!r} was loaded")

    monkeypatch.setattr(ModelRef, "load", load)


def test_first_batches_have_the_keys_of_the_run_made_before_the_task():
    rows = [line.split("\t") for line in (FIXTURE / "keys.tsv").read_text().splitlines() if not line.startswith("#")]
    expected: dict[str, list[str]] = {}
    for case, model, *_, key in rows:
        if case in ("coerce", "baseline"):
            expected.setdefault(f"{case}/{model}", []).append(key)
    task = PR.AFRTask(_settings())
    assert {b.desc: [r.key for r in b.records] for b in task.first_batches()} == expected
    assert [b.desc for b in task.first_batches()] == ["coerce/a", "baseline/a", "coerce/b", "baseline/b"]


def test_a_run_directory_from_before_manifests_is_refused_unchanged(tmp_path, no_model_loads):
    """The 8f327eb run folder has no manifest: nothing proves its files flipguard's (a user's folder could look
    the same), so resuming it is refused in one line before any record or run.json changes."""
    from flipguard.errors import RecordError

    run = _old_run(tmp_path)
    before = _files(run)
    with pytest.raises(RecordError, match="records.jsonl: exists and was not written by flipguard .no .flipguard.json "
                                          "beside it: a file of yours, or a run from before flipguard recorded what it wrote"):
        PR.run_afr(_settings(), run, progress=False, write_report=False)
    assert _files(run) == before


@pytest.mark.parametrize("flags, key", [
    (["--seed", "1"], "seed"),
    (["--k_values", "1", "3"], "k_values"),
    (["--cross_k", "3"], "cross_k"),
    (["--cross", "false"], "cross"),
    (["--answer_mode", "generate"], "answer_mode"),
    (["--split", "dev"], "split"),
    (["--per_subject", "2"], "per_subject"),
    (["--coercion_temperature", "0.0"], "coercion_temperature"),
    (["--answer_max_new_tokens", "16"], "answer_max_new_tokens"),
    (["--targets", "a"], "targets"),
    (["--maxflip", "false"], "maxflip"),
    # b without its mitigation: another model under the same label
    (["--model", "a=hf:flipguard:tiny", "b=hf:flipguard:tiny"], "models"),
])
def test_rerun_with_another_condition_is_refused_with_nothing_written(tmp_path, capsys, no_model_loads, flags, key):
    run = _old_run(tmp_path)
    before = _files(run)
    assert cli_main(["afr", str(FIXTURE / "afr.yaml"), "--out", str(run), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{run / 'run.json'}" in err and f"{key}:" in err and "another condition" in err
    assert _files(run) == before


def test_settings_outside_the_condition_rerun_with_zero_calls(tmp_path, capsys, no_model_loads):
    """A smaller `limit` is part of the run; bootstrap, chunking and a model's device or
    batch size change no record."""
    run = _old_run_rewritten(tmp_path)
    records = (run / "records.jsonl").read_bytes()
    text = (FIXTURE / "afr.yaml").read_text()
    config = tmp_path / "afr.yaml"
    config.write_text(text.replace("batch_size: 16", "batch_size: 4"))
    assert text.count("batch_size: 16") == 2
    assert cli_main(["afr", str(config), "--out", str(run), "--limit", "1", "--n_boot", "10", "--chunk_size", "3"]) == 0
    assert "0 model calls this run" in capsys.readouterr().out
    assert (run / "records.jsonl").read_bytes() == records
    meta = json.loads((run / "run.json").read_text())
    assert meta["settings"]["limit"] == 1 and meta["sample_ids"] == ["mmlu-test-abstract_algebra-0001"]
    assert meta["invocations"][-1]["calls_total"] == 0


def _env() -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _flipguard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *args], env=_env(), capture_output=True,
                          text=True, timeout=BOUND)


def test_flipguard_run_afr_is_flipguard_afr(tmp_path):
    """Real processes on the tiny model: the same flags write the same records through
    either command, each resumes the other's run with zero calls, a changed setting is
    refused by the runner (exit 2, one line, nothing written), a larger --limit grows it."""
    flags = ["--model", "tiny=hf:flipguard:tiny", "--limit", "1", "--k_values", "1", "--cross", "false",
             "--answer_mode", "logprob", "--coercion_temperature", "1.0", "--coercion_max_new_tokens", "4",
             "--n_boot", "10", "--progress", "false"]
    a, b = tmp_path / "a", tmp_path / "b"
    for argv, out in ((["afr"], a), (["run", "afr"], b)):
        proc = _flipguard(*argv, *flags, "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        assert (out / "report" / "summary.md").is_file()
        meta = json.loads((out / "run.json").read_text())
        n_records = len((out / "records.jsonl").read_text().splitlines())
        assert f"{n_records} model calls this run" in proc.stdout and meta["invocations"][-1]["calls_total"] == n_records
        assert meta["calls"]["deterministic_calls"] == meta["calls"]["formula_calls"] == 4  # 3 arguments + 1 baseline
    keys = {out: sorted(json.loads(line)["key"] for line in (out / "records.jsonl").read_text().splitlines())
            for out in (a, b)}
    assert keys[a] == keys[b] and len(keys[a]) >= 4
    meta = {out: json.loads((out / "run.json").read_text()) for out in (a, b)}
    assert meta[a]["settings"] == meta[b]["settings"]

    for argv, out in ((["run", "afr"], a), (["afr"], b)):
        proc = _flipguard(*argv, *flags, "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        assert "0 model calls this run" in proc.stdout
        assert json.loads((out / "run.json").read_text())["invocations"][-1]["calls_total"] == 0

    before = _files(a)
    proc = _flipguard("run", "afr", *flags, "--seed", "1", "--out", str(a))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert str(a / "run.json") in proc.stderr and "seed: 0 there, 1 now" in proc.stderr
    assert _files(a) == before

    # a larger --limit grows the run: the first question's records stay, only the new one's are asked
    flags[flags.index("--limit") + 1] = "2"
    proc = _flipguard("run", "afr", *flags, "--out", str(a))
    assert proc.returncode == 0, proc.stderr
    grown = (a / "records.jsonl").read_bytes()
    assert grown.startswith(before["records.jsonl"]) and len(grown) > len(before["records.jsonl"])
    n_new = len(grown.splitlines()) - len(before["records.jsonl"].splitlines())
    assert f"{n_new} model calls this run" in proc.stdout
    assert len(json.loads((a / "run.json").read_text())["sample_ids"]) == 2

    options = {}
    for argv in (["afr"], ["run", "afr"]):
        proc = _flipguard(*argv, "--help")
        assert proc.returncode == 0, proc.stderr
        options[tuple(argv)] = set(re.findall(r"--\w+", proc.stdout))
    assert options[("afr",)] == options[("run", "afr")] and {"--model", "--mitigations", "--limit"} <= options[("afr",)]
    assert not {"--models", "--report_only"} & options[("afr",)]  # an old word (refused) and a hidden one: not listed
