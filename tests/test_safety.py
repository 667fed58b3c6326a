"""Data safety under hostile use, each fault injected for real.

- a real second process (a second `flipguard eval` while the first holds the run
  directory; every writer against a held lock; a writer racing a reader),
- a real socket server on 127.0.0.1 (top logprobs without the labels, a hung server,
  an error that echoes the Authorization header, a failure after some requests),
- a real kill -9 (a trainer killed while saving its adapter).

Nothing waits on a wall-clock guess: processes synchronise on files and events; the
timeouts below are only upper bounds that a healthy run never reaches.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from served import StubServer, send_json

from flipguard.data.schema import Item
from flipguard.errors import FlipguardError
from flipguard.eval.records import (
    OWNER_FILE,
    Record,
    RecordStore,
    load_records,
    read_records,
    run_lock,
)
from flipguard.pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
BOUND = 1800  # seconds: an upper bound only, never a synchronisation point
SECRET = "hunter2-plain-secret-value"


def _env(**extra) -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _flipguard(*args: str) -> list[str]:
    return [sys.executable, "-m", "flipguard.pipeline.cli", *args]


def _item(i: int = 0) -> Item:
    return Item(id=f"truthfulqa-{i}", dataset="truthfulqa", question=f"Is {i} even?",
                correct_answer="yes" if i % 2 == 0 else "no", incorrect_answer="maybe")


def _rec(key: str, item: str = "a", case: str = "c1_true") -> Record:
    return Record(key=key, protocol="dds", item_id=item, dataset="truthfulqa", case=case, expected="1",
                  model="m", backend="hf", mode="logprob", valid=True, choice="1", p1=0.7, p2=0.2)


# ---------------------------------------------------------------------------- a real HTTP server


class Server(StubServer):
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1 whose answer is `respond(n, body,
    headers) -> (status, payload)`; `hold` (an Event) makes every request wait until set;
    `received` is set at the first request."""

    def __init__(self, respond, hold: threading.Event | None = None):
        self.respond, self.hold = respond, hold
        self.received = threading.Event()
        self.n = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with server.lock:
                    server.n += 1
                    n = server.n
                server.received.set()
                if server.hold is not None:
                    server.hold.wait(BOUND)
                status, payload = server.respond(n, body, {k.lower(): v for k, v in self.headers.items()})
                try:
                    send_json(self, status, payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self._listen(Handler)

    def __exit__(self, *exc):
        if self.hold is not None:
            self.hold.set()
        super().__exit__(*exc)


def completion(top: list[tuple[str, float]], content: str = "1") -> tuple[int, dict]:
    entries = [{"token": t, "logprob": math.log(p), "bytes": list(t.encode())} for t, p in top]
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop",
              "logprobs": {"content": [{**entries[0], "top_logprobs": entries}]}}
    return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def labels(n, body, headers):
    return completion([("1", 0.7), (" 2", 0.2), ("zz", 0.05)])


@pytest.fixture
def no_key_env(monkeypatch):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


def _eval_args(out, base_url, **kw):
    from flipguard.eval.dds import EvalArgs

    backend_args = {"base_url": base_url, "max_retries": 0, **kw.pop("backend_args", {})}
    return EvalArgs(model="fake-model", backend="openai", out=str(out), backend_args=json.dumps(backend_args), **kw)


# ---------------------------------------------------------------------------- 2. one writer per run


def _second_writer_is_refused(cmd: list[str], server: "Server", hold: threading.Event) -> int:
    """Start `cmd`, and while it holds the lock (waiting on its first request, which the
    server holds) run it again: the second is refused naming the first's pid; the first
    then finishes. Returns the first's pid."""
    first = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.received.wait(BOUND), first.communicate()
        second = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=BOUND)
    finally:
        hold.set()
    _, err1 = first.communicate(timeout=BOUND)
    assert second.returncode == 2, second.stderr
    err = second.stderr.strip()
    assert "another flipguard process is writing this run directory" in err
    assert f"pid {first.pid}" in err and "Traceback" not in err
    assert first.returncode == 0, err1
    return first.pid


def test_second_eval_on_the_same_out_is_refused_naming_the_holder(tmp_path, no_key_env):
    out = tmp_path / "run"
    hold = threading.Event()
    with Server(labels, hold=hold) as server:
        backend_args = json.dumps({"base_url": server.base_url, "max_retries": 0})
        _second_writer_is_refused(_flipguard(
            "eval", "--model", "fake-model", "--backend", "openai", "--backend_args", backend_args,
            "--datasets", "truthfulqa", "--limit", "1", "--out", str(out), "--report", "false"), server, hold)
    recs = list(read_records(out / "records.jsonl"))
    assert len(recs) == len({r.key for r in recs}) == 4  # one item x four cases, nothing twice


def test_second_afr_on_the_same_out_is_refused_naming_the_holder(tmp_path, no_key_env):
    """AFR opens its run directory like eval: a real second `flipguard afr` is refused; the
    first's run.json carries the common header and one invocation (the refused one wrote nothing)."""
    out = tmp_path / "run"
    hold = threading.Event()
    with Server(lambda n, body, headers: completion([("A", 0.9)], content="A"), hold=hold) as server:
        config = tmp_path / "afr.yaml"
        config.write_text(json.dumps({  # JSON is YAML
            "model": [{"label": "fake", "backend": "openai", "model": "fake-model",
                        "kwargs": {"base_url": server.base_url, "max_retries": 0}}],
            "limit": 1, "k_values": [1], "cross": False, "maxflip": False, "n_boot": 10, "progress": False,
        }))
        _second_writer_is_refused(_flipguard("afr", str(config), "--out", str(out)), server, hold)
    recs = list(read_records(out / "records.jsonl"))
    assert len(recs) == len({r.key for r in recs}) > 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["protocol"] == "afr" and meta["flipguard_version"] and meta["created"]
    assert len(meta["invocations"]) == 1


@pytest.mark.parametrize("command", ["eval", "afr", "sos", "import-records"])
def test_every_writer_refuses_a_held_run_dir(tmp_path, command):
    out = tmp_path / "run"
    fixture = REPO / "tests" / "fixtures"
    args = {
        "eval": ["eval", "--model", "flipguard:tiny", "--datasets", "truthfulqa", "--limit", "1", "--out", str(out)],
        "afr": ["afr", "--model", "tiny=hf:flipguard:tiny", "--limit", "1", "--out", str(out)],
        "sos": ["sos", "--limit", "1", "--out", str(out)],
        "import-records": ["import-records", str(next(fixture.rglob("*.jsonl"))), "--out", str(out)],
    }[command]
    with run_lock(out, command="the test holding the lock"):
        proc = subprocess.run(_flipguard(*args), env=_env(), capture_output=True, text=True, timeout=BOUND)
    assert proc.returncode == 2, proc.stderr
    assert f"pid {os.getpid()}" in proc.stderr and "the test holding the lock" in proc.stderr
    assert not (out / "records.jsonl").exists() and not (out / "run.json").exists()


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    out = tmp_path / "run"
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""
        import sys, pathlib
        from flipguard.eval.records import run_lock
        with run_lock({str(out)!r}, command="holder"):
            pathlib.Path({str(ready)!r}).write_text("x")
            sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=_env(), stdin=subprocess.PIPE)
    try:
        while not ready.exists():
            assert proc.poll() is None, "lock holder died"
            time.sleep(0.02)
        with pytest.raises(FlipguardError, match=f"pid {proc.pid}"):
            with run_lock(out):
                pass
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with run_lock(out):  # the kernel dropped the dead holder's lock
        pass


def test_afr_and_sos_refuse_another_protocols_run(tmp_path):
    from flipguard.eval.dds import evaluate

    run = tmp_path / "dds"
    evaluate(_tiny_args(run), items=[_item(0)])
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert cli_main(["afr", "--model", "tiny=hf:flipguard:tiny", "--limit", "1", "--out", str(run)]) == 2
    assert cli_main(["sos", "--limit", "1", "--out", str(run)]) == 2
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert {k: v for k, v in after.items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}


def _tiny_args(out, **kw):
    from flipguard.eval.dds import EvalArgs

    return EvalArgs(model="flipguard:tiny", out=str(out), min_label_mass=0.0, **kw)


def test_reports_count_each_record_once(tmp_path):
    from flipguard.eval.dds import evaluate
    from flipguard.eval.dds.report import report_run

    run = evaluate(_tiny_args(tmp_path / "run"), items=[_item(i) for i in range(2)])
    once = report_run(run, n_boot=0).summary
    path = run / "records.jsonl"
    path.write_bytes(path.read_bytes() * 2)  # two writers' worth of the same records
    assert len(load_records(run)) == 8
    twice = report_run(run, n_boot=0).summary
    assert twice.equals(once)


# ---------------------------------------------------------------------------- 3. readers are read-only


def test_report_keeps_a_last_record_without_newline(tmp_path, capsys):
    from flipguard.eval.dds import evaluate

    run = evaluate(_tiny_args(tmp_path / "run"), items=[_item(i) for i in range(3)])
    path = run / "records.jsonl"
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    before = path.read_bytes()
    assert cli_main(["report", str(run)]) == 0
    assert cli_main(["compare", "--runs", f"A={run}", "--out", str(tmp_path / "cmp")]) == 0
    assert path.read_bytes() == before  # readers never write
    assert len(load_records(run)) == 12
    store = RecordStore(path)  # the writer repairs: the complete record stays, newline added
    assert len(store) == 12 and path.read_bytes() == before + b"\n"


def test_writer_cuts_only_a_tail_that_does_not_parse(tmp_path):
    path = tmp_path / "records.jsonl"
    RecordStore(path).append([_rec("k1")])
    with open(path, "a") as fh:
        fh.write('{"key": "k2", "protoc')  # torn by a crash
    assert [r.key for r in read_records(path)] == ["k1"]  # the reader skips it, leaves it
    assert path.read_text().endswith('"protoc')
    assert len(RecordStore(path)) == 1 and path.read_text().endswith("\n")


WRITER = textwrap.dedent("""
    import sys
    from flipguard.eval.records import Record, RecordStore
    store = RecordStore(sys.argv[1])
    for i in range(int(sys.argv[2])):
        store.append([Record(key=f"k{i}", protocol="dds", item_id=str(i), dataset="d", case="c1_true",
                             expected="1", model="m", backend="hf", mode="logprob", raw_output="x" * 2000)])
""")


def test_a_reader_racing_a_writer_loses_no_record(tmp_path):
    path, n = tmp_path / "records.jsonl", 1500
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(n)], env=_env())
    reads, last = 0, 0
    while writer.poll() is None:  # read for as long as the writer writes
        if path.exists():
            got = len(load_records(path))
            assert got >= last  # a reader never takes a record away
            last, reads = got, reads + 1
    assert writer.returncode == 0
    assert reads > 0
    keys = [r.key for r in read_records(path)]
    assert len(keys) == len(set(keys)) == n


# ---------------------------------------------------------------------------- 4. openai backend


def test_labels_missing_from_top_logprobs_are_invalid_not_made_up(tmp_path, no_key_env):
    from flipguard.eval.dds import evaluate
    from flipguard.eval.dds.report import report_run

    def no_labels(n, body, headers):
        return completion([("The", 0.6), ("I", 0.3)], content="The")

    with Server(no_labels) as server:
        run = evaluate(_eval_args(tmp_path / "run", server.base_url, min_label_mass=0.0, report=False),
                       items=[_item(0)])
    recs = load_records(run)
    assert len(recs) == 4
    for r in recs:
        assert r.valid is False and r.choice is None and r.raw_output is None
        assert r.p1 == 0.0 and r.p2 == 0.0 and r.extra["no_label_in_top_logprobs"] is True
    stats = report_run(run, n_boot=0).stats
    assert int(stats.loc[stats["dataset"] == "truthfulqa", "invalid_judgments"].iloc[0]) == 4


def test_each_completed_request_is_kept_when_a_later_one_fails(tmp_path, no_key_env):
    from flipguard.eval.dds import evaluate

    def three_then_fail(n, body, headers):
        if n <= 3:
            return labels(n, body, headers)
        return 400, {"error": {"message": "request 4 refused", "type": "invalid_request_error"}}

    with Server(three_then_fail) as server:
        with pytest.raises(FlipguardError, match="request 4 refused"):
            evaluate(_eval_args(tmp_path / "run", server.base_url, report=False,
                                backend_args={"max_concurrency": 1}), items=[_item(i) for i in range(10)])
    assert len(list(read_records(tmp_path / "run" / "records.jsonl"))) == 3


def test_hung_server_fails_the_request_instead_of_hanging(no_key_env):
    from flipguard.eval.backends.base import get_backend

    hold = threading.Event()  # never set while the client waits: the server hangs
    with Server(labels, hold=hold) as server:
        backend = get_backend("openai", "fake-model", base_url=server.base_url, timeout=0.5, max_retries=1,
                              show_progress=False)
        with pytest.raises(FlipguardError, match="request failed after retries"):
            backend.choice_probs([[{"role": "user", "content": "q"}]])
        assert server.n == 2  # one attempt + one retry, nothing piled on


def test_openai_defaults_fail_a_hung_server_in_minutes_and_are_documented(capsys):
    import inspect

    from flipguard.eval.backends.openai_api import OpenAIBackend

    params = inspect.signature(OpenAIBackend.__init__).parameters
    timeout, retries = params["timeout"].default, params["max_retries"].default
    assert timeout * (retries + 1) <= 300 and params["max_concurrency"].default <= 4
    with pytest.raises(SystemExit):
        cli_main(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"timeout (s per attempt, default {timeout:g})" in help_text
    assert f"max_retries (default {retries})" in help_text and "api_key here is refused" in help_text


# ---------------------------------------------------------------------------- 5. secrets


def test_api_key_in_backend_args_is_refused_and_not_saved(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    argv = ["eval", "--backend", "openai", "--model", "m", "--out", str(out), "--datasets", "truthfulqa",
            "--limit", "1", "--backend_args", json.dumps({"base_url": "http://127.0.0.1:9/v1", "api_key": SECRET})]
    monkeypatch.setattr(sys, "argv", ["flipguard", *argv])
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "'api_key' is not accepted" in err and "environment" in err
    assert SECRET not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (out / "run.json").exists()


def test_error_echoing_the_authorization_header_is_redacted(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MY_FLIPGUARD_KEY", SECRET)

    def echo_auth(n, body, headers):
        auth = headers.get("authorization", "")
        return 401, {"error": {"message": f"invalid credentials: {auth} (key {SECRET})", "type": "auth"}}

    with Server(echo_auth) as server:
        rc = cli_main(["eval", "--backend", "openai", "--model", "m", "--out", str(tmp_path / "run"),
                       "--datasets", "truthfulqa", "--limit", "1", "--report", "false", "--backend_args",
                       json.dumps({"base_url": server.base_url, "api_key_env": "MY_FLIPGUARD_KEY", "max_retries": 0})])
    err = capsys.readouterr().err
    assert rc == 2 and "HTTP 401" in err
    assert SECRET not in err and "Bearer ***" in err


def test_credentials_in_base_url_are_not_saved(tmp_path, no_key_env, monkeypatch):
    from flipguard.eval.records import load_run_meta

    with Server(labels) as server:
        url = f"http://user:{SECRET}@127.0.0.1:{server.port}/v1?api_key={SECRET}"
        argv = ["eval", "--backend", "openai", "--model", "m", "--out", str(tmp_path / "run"), "--datasets",
                "truthfulqa", "--limit", "1", "--report", "false", "--backend_args", json.dumps({"base_url": url})]
        monkeypatch.setattr(sys, "argv", ["flipguard", *argv])
        assert cli_main(argv) == 0
    text = (tmp_path / "run" / "run.json").read_text()
    assert SECRET not in text and "***@127.0.0.1" in text
    assert load_run_meta(tmp_path / "run")["command"][0] == "flipguard"


def test_recipe_env_values_never_reach_cards_provenance_or_tracking(tmp_path):
    import yaml

    from flipguard.config import PairsArguments, parse_recipe
    from flipguard.train import utils

    raw = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())
    raw["env"] = {"FLIPGUARD_TEST_TOKEN": SECRET}
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    (pairs,), path, recipe = parse_recipe([str(recipe_path)], (PairsArguments,))
    try:
        assert os.environ["FLIPGUARD_TEST_TOKEN"] == SECRET  # the script itself still gets it
    finally:
        os.environ.pop("FLIPGUARD_TEST_TOKEN", None)
    assert recipe["env"] == {"FLIPGUARD_TEST_TOKEN": "<redacted>"}
    config = {"recipe_path": path, "recipe": recipe, "trainer": "sft"}  # what run_config / wandb get
    utils.write_training_info(str(tmp_path / "adapter"), config, None)
    for name in ("README.md", "flipguard_training.json"):
        text = (tmp_path / "adapter" / name).read_text()
        assert SECRET not in text and "FLIPGUARD_TEST_TOKEN" in text


# ---------------------------------------------------------------------------- 1. never destroy what flipguard did not write


def test_pairs_out_refuses_foreign_data_and_keeps_notes_in_its_own(tmp_path, capsys):
    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "records.jsonl").write_text("judgments\n")
    (foreign / "notes.md").write_text("notes\n")
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep me\n")
    for out in (foreign, a_file):
        assert cli_main(["pairs", "recipes/tiny.yaml", "--out", str(out), "--pairs_datasets", "amqa"]) == 2
    err = capsys.readouterr().err
    assert "was not written by flipguard" in err and "is not a directory" in err
    assert (foreign / "records.jsonl").read_text() == "judgments\n" and a_file.read_text() == "keep me\n"
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.md", "records.jsonl"]

    own = tmp_path / "pairs"
    assert cli_main(["pairs", "recipes/tiny.yaml", "--out", str(own), "--pairs_datasets", "amqa"]) == 0
    assert (own / OWNER_FILE).is_file()
    (own / "notes.md").write_text("mine\n")
    assert cli_main(["pairs", "recipes/tiny.yaml", "--out", str(own), "--pairs_datasets", "amqa,gpqa"]) == 0
    assert (own / "notes.md").read_text() == "mine\n"
    assert set(json.loads((own / "counts.json").read_text())["per_dataset"]) == {"amqa", "gpqa"}


def _adapter(tiny_model_path, where: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                   LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(where)
    return where


def test_merge_never_replaces_the_adapter_or_foreign_files(tiny_model_path, tmp_path, capsys):
    from flipguard.train.merge import main as merge_main

    adapter = _adapter(tiny_model_path, tmp_path / "adapter")
    adapter_files = {p.name: p.read_bytes() for p in adapter.iterdir()}
    base = ["recipes/tiny.yaml", "--model_name_or_path", tiny_model_path, "--gap_prompts", "0", "--adapter", str(adapter),
            "--foreign_adapter", "true"]  # a peft adapter without flipguard provenance
    with pytest.raises(FlipguardError, match="holds\\) the adapter folder"):
        merge_main(base + ["--out", str(adapter)])
    assert {p.name: p.read_bytes() for p in adapter.iterdir()} == adapter_files

    target = tmp_path / "served"
    target.mkdir()
    (target / "notes.md").write_text("notes\n")
    with pytest.raises(FlipguardError, match="was not written by flipguard.*--overwrite"):
        merge_main(base + ["--out", str(target)])
    assert [p.name for p in target.iterdir()] == ["notes.md"]

    assert merge_main(base + ["--out", str(target), "--overwrite", "true"]) == 0
    assert (target / "notes.md").read_text() == "notes\n" and (target / "model.safetensors").is_file()
    assert merge_main(base + ["--out", str(target)]) == 0  # its own output: no --overwrite needed
    owner = json.loads((target / OWNER_FILE).read_text())
    assert "model.safetensors" in owner["files"] and "notes.md" not in owner["files"]
    assert (target / "notes.md").read_text() == "notes\n"


SAVE_AND_DIE = textwrap.dedent("""
    import pathlib, sys, types
    from flipguard.train.utils import save_adapter
    out = pathlib.Path(sys.argv[1])

    class Trainer:
        accelerator = types.SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
        def save_model(self, path):
            (out / "adapter_model.safetensors").write_text("new weights")
            (out / "saving").write_text("x")
            sys.stdin.read()  # killed here, mid-save

    tok = types.SimpleNamespace(save_pretrained=lambda p: None)
    save_adapter(Trainer(), tok, types.SimpleNamespace(output_dir=str(out)), {"trainer": "sft"}, None, None)
""")


def test_killed_while_saving_an_adapter_leaves_no_stale_provenance(tmp_path):
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_model.safetensors").write_text("old weights")
    (out / "flipguard_training.json").write_text('{"trainer": "old"}')
    proc = subprocess.Popen([sys.executable, "-c", SAVE_AND_DIE, str(out)], env=_env(), stdin=subprocess.PIPE)
    try:
        while not (out / "saving").exists():
            assert proc.poll() is None, "save_adapter died before saving"
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (out / "adapter_model.safetensors").read_text() == "new weights"
    assert not (out / "flipguard_training.json").exists()  # the old provenance does not vouch for it


def test_a_merged_model_folder_without_a_manifest_is_refused_unchanged(tmp_path):
    """Ownership is proven by the manifest's hashes only: a folder holding a `flipguard_merge.json` (a merged model
    from before manifests, or the user's folder named alike) proves nothing, so nothing in it is replaced."""
    from flipguard.errors import RecordError
    from flipguard.publish import publish_dir

    out = tmp_path / "merged"
    out.mkdir()
    for name, text in (("flipguard_merge.json", "{}"), ("model.safetensors", "old"), ("notes.md", "mine")):
        (out / name).write_text(text)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    tmp = tmp_path / ".merged.new"
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("new")
    (tmp / "flipguard_merge.json").write_text('{"new": 1}')
    with pytest.raises(RecordError, match="was not written by flipguard"):
        publish_dir(tmp, out, writer="test", last=("flipguard_merge.json",))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not tmp.exists()


def test_c1_from_is_checked_before_any_judgment(tmp_path, capsys):
    rc = cli_main(["eval", "--model", "flipguard:tiny", "--datasets", "truthfulqa", "--limit", "1", "--out",
                   str(tmp_path / "run"), "--c1_from", str(tmp_path / "nope")])
    assert rc == 2 and "no records.jsonl there" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
