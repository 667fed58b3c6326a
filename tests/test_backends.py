"""Backends end to end without a GPU or a network.

- openai: a real OpenAI-compatible server, `transformers serve` (tests/served.py), started
  once per session on 127.0.0.1 (conftest `openai_server`) and serving the embedded tiny
  model and the organism by path: generate mode, input order, honest invalid counts, the
  logprob mode refused when the server drops logprobs, a refused connection retried, a
  server SIGKILLed mid-run and resumed. A small stub server (FaultServer) remains only for
  what a real server cannot be made to do on demand: answer 429/500, report how many
  requests it holds at once, echo the Authorization header, name itself vLLM or llama.cpp.
- vllm: cannot run here, so a fake `vllm` module stands in for the engine; the tests check
  what our code asks of vLLM and how it reads vLLM-shaped outputs.
- hf: the tiny local model; batching with left padding must not change any answer.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import types
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from served import StubServer, send_json

from flipguard.errors import FlipguardError
from flipguard.eval.backends.base import BackendError, GenerationConfig, backend_names, get_backend
from flipguard.eval.backends.openai_api import SERVER_CONCURRENCY

# Limits below are hang guards only (never reached by a healthy run, however loaded the
# machine): tests synchronise on events, not on wall-clock guesses.
BOUND = 1800
REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------- stub for faults only


class FaultServer(StubServer):
    """A stub for faults a real server cannot be made to produce on demand.

    POST /v1/chat/completions answers "ok" (no model behind it). The first `fail_first`
    requests get `fail_status` (with retry-after-ms: 1); `gate` > 0 makes every request
    wait until `gate` are in flight at once (an event, not a delay); GET /v1/models lists
    one model owned by `owned_by` (404 when None)."""

    def __init__(self, fail_first: int = 0, fail_status: int = 429, gate: int = 0, owned_by: str | None = None):
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.gate = gate
        self.owned_by = owned_by
        self.gate_open = threading.Event()
        self.lock = threading.Lock()
        self.n_requests = 0
        self.gets: list[str] = []
        self.active = 0
        self.max_active = 0
        self.auth: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                server.gets.append(self.path)
                if self.path.rstrip("/") == "/v1/models" and server.owned_by is not None:
                    send_json(self, 200, {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": server.owned_by}]})
                else:
                    send_json(self, 404, {"error": {"message": "not found", "type": "invalid_request_error"}})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                with server.lock:
                    server.n_requests += 1
                    n = server.n_requests
                    server.active += 1
                    server.max_active = max(server.max_active, server.active)
                    if server.gate and server.active >= server.gate:
                        server.gate_open.set()
                    server.auth.append(self.headers.get("Authorization", ""))
                try:
                    if server.gate:
                        server.gate_open.wait(BOUND)
                    if n <= server.fail_first:
                        send_json(self, server.fail_status, {"error": {"message": f"fake failure {n}", "type": "server_error"}},
                                   {"retry-after-ms": "1"})
                    else:
                        send_json(self, 200, {"id": "x", "object": "chat.completion", "created": 0, "model": body.get("model"),
                                         "choices": [{"index": 0, "finish_reason": "stop",
                                                      "message": {"role": "assistant", "content": "ok"}}]})
                finally:
                    with server.lock:
                        server.active -= 1

        self._listen(Handler)


@pytest.fixture
def no_key_env(monkeypatch):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "MY_TEST_KEY"):
        monkeypatch.delenv(name, raising=False)


def _conv(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def _openai(server, model: str = "fake-model", **kw):
    kw.setdefault("show_progress", False)
    return get_backend("openai", str(model), base_url=server.base_url, **kw)


def _env(**extra) -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _eval_cmd(server, model, out, *extra, backend_args: dict | None = None) -> list[str]:
    args = {"base_url": server.base_url, "max_retries": 0, **(backend_args or {})}
    return [sys.executable, "-m", "flipguard.pipeline.cli", "eval", "--backend", "openai", "--model", str(model),
            "--out", str(out), "--report", "false", "--backend_args", json.dumps(args), *extra]


def _reply_choice(raw: str | None) -> str | None:
    """The test's own reading of a reply: a JSON object whose chosen_answer is 1 or 2."""
    try:
        value = json.loads(raw or "").get("chosen_answer")
    except (ValueError, AttributeError):
        return None
    return str(value) if str(value) in ("1", "2") else None


# ---------------------------------------------------------------------------- openai backend: real server


def test_openai_is_registered_and_takes_no_key_argument():
    assert {"hf", "openai", "vllm"} <= set(backend_names())
    from flipguard.eval.backends.openai_api import OpenAIBackend

    assert not any("key" in p and p != "api_key_env" for p in inspect.signature(OpenAIBackend).parameters)


def _organism_prompts(n: int):
    from flipguard.data.unified import load_items
    from flipguard.eval.dds.prompts import build_messages

    items = load_items(["organism"], split="test")[:n]
    return [build_messages(it, case, fmt="json") for it in items for case in ("c1_true", "c2_incorrect")]


def test_real_server_generate_in_input_order_equals_hf(openai_server, organism_path, no_key_env):
    """Greedy replies of the served organism come back in input order at 4 in flight, equal to
    one at a time and to `--backend hf` on the same weights (the organism's replies differ by
    prompt, so an order mix-up would show)."""
    convs = _organism_prompts(4)
    config = GenerationConfig(max_new_tokens=40, seed=3)
    before = len(openai_server.chat_requests())
    backend = _openai(openai_server, organism_path, max_concurrency=4)
    sent = []
    create = backend._create
    backend._create = lambda conv, **params: (sent.append(params), create(conv, **params))[1]
    wide = backend.generate(convs, config)
    narrow = _openai(openai_server, organism_path, max_concurrency=1).generate(convs, config)
    hf = get_backend("hf", str(organism_path), device="cpu", show_progress=False).generate(convs, config)
    assert wide == narrow == [h.strip() for h in hf]
    assert len(set(wide)) > 1 and all(_reply_choice(w) for w in wide)
    assert openai_server.chat_requests()[before:] == ["200"] * (2 * len(convs))
    assert sent[0] == {"temperature": 0.0, "max_tokens": 40, "seed": 3}  # greedy: no top_p sent


def test_real_server_generate_eval_counts_invalid_replies(openai_server, tiny_model_path, organism_path, tmp_path,
                                                          no_key_env):
    """`flipguard eval --backend openai --mode generate` on the tiny model (noise: its replies
    are empty) and on the organism (JSON replies): every reply is recorded, and a record is
    valid exactly when the reply names an answer (the test's own JSON reading)."""
    from flipguard.eval.dds.report import report_run
    from flipguard.eval.records import read_records

    before = len(openai_server.chat_requests())
    runs = {"tiny": (tiny_model_path, "truthfulqa"), "organism": (organism_path, "organism")}
    counts = {}
    for name, (model, dataset) in runs.items():
        out = tmp_path / name
        proc = subprocess.run(_eval_cmd(openai_server, model, out, "--mode", "generate", "--max_new_tokens", "48",
                                        "--datasets", dataset, "--limit", "3"),
                              env=_env(), capture_output=True, text=True, timeout=BOUND)
        assert proc.returncode == 0, proc.stderr
        recs = list(read_records(out / "records.jsonl"))
        assert len(recs) == len({r.key for r in recs}) == 12  # 3 items x 4 cases
        for r in recs:
            assert r.raw_output is not None and r.mode == "generate" and r.backend == "openai"
            assert r.choice == _reply_choice(r.raw_output) and r.valid == (r.choice is not None)
        invalid = sum(_reply_choice(r.raw_output) is None for r in recs)
        stats = report_run(out, n_boot=0).stats
        assert int(stats.loc[stats["dataset"] == dataset, "invalid_judgments"].iloc[0]) == invalid
        counts[name] = invalid
    assert counts == {"tiny": 12, "organism": 0}
    assert openai_server.chat_requests()[before:] == ["200"] * 24


def test_logprob_mode_is_refused_by_a_server_that_drops_logprobs(openai_server, tiny_model_path, tmp_path,
                                                                  no_key_env):
    """transformers serve answers a logprobs request with text only (a warning in its own log):
    the run stops with a one-line error and records nothing rather than making P("1") up."""
    before = len(openai_server.chat_requests())
    backend = _openai(openai_server, tiny_model_path, max_concurrency=1)
    with pytest.raises(BackendError, match="returned no logprobs"):
        backend.choice_probs([_conv("Return exactly one of: 1 or 2.")])
    proc = subprocess.run(_eval_cmd(openai_server, tiny_model_path, tmp_path / "run", "--datasets", "truthfulqa",
                                    "--limit", "2", "--mode", "logprob"),
                          env=_env(), capture_output=True, text=True, timeout=BOUND)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "returned no logprobs" in err[-1] and "Traceback" not in proc.stderr
    records = tmp_path / "run" / "records.jsonl"
    assert not records.exists() or records.read_text() == ""
    assert "200" in openai_server.chat_requests()[before:]  # the server did answer, without logprobs


def test_server_error_is_retried_then_fails_naming_the_model(openai_server, no_key_env):
    """A model directory the server cannot load: transformers serve answers 500, which the
    client retries (max_retries 2: three requests in the server's log), then the run stops."""
    before = len(openai_server.chat_requests())
    backend = _openai(openai_server, "/nonexistent/model-dir", max_retries=2, max_concurrency=1)
    with pytest.raises(BackendError, match="request failed after retries") as err:
        backend.generate([_conv("x")], GenerationConfig(max_new_tokens=2))
    assert openai_server.chat_requests()[before:] == ["500"] * 3
    assert "/nonexistent/model-dir" in str(err.value) and "HTTP 500" in str(err.value)


def test_bad_request_is_not_retried(openai_server, tiny_model_path, no_key_env):
    """A field the server does not know: 422 from transformers serve, sent once, not retried."""
    before = len(openai_server.chat_requests())
    backend = _openai(openai_server, tiny_model_path, max_retries=5, max_concurrency=1,
                      extra_body={"flipguard_unknown_field": 1})
    with pytest.raises(BackendError, match="HTTP 422"):
        backend.generate([_conv("x")], GenerationConfig(max_new_tokens=2))
    assert openai_server.chat_requests()[before:] == ["422"]


def test_server_kind_is_detected_from_the_real_server(openai_server, tiny_model_path, no_key_env, capsys):
    backend = _openai(openai_server, tiny_model_path)  # max_concurrency unset: by server kind
    assert backend.max_concurrency == SERVER_CONCURRENCY["transformers"]
    assert backend.server_kind == "transformers"
    assert "is 'transformers'" in capsys.readouterr().err


class _OnRetry(logging.Handler):
    """Sets `event` when the openai client logs that it will retry a request."""

    def __init__(self, event: threading.Event):
        super().__init__(logging.INFO)
        self.event = event

    def emit(self, record):
        if record.getMessage().startswith("Retrying request"):
            self.event.set()


def test_refused_connection_is_retried_until_the_server_is_back(openai_server, tiny_model_path, no_key_env):
    """A real outage: the server is SIGKILLed, a request is refused and retried with backoff
    (the client's own retry log line is the event), the server is started again and the
    same request then succeeds: one chat request reaches the new server."""
    retried = threading.Event()
    logger = logging.getLogger("openai._base_client")
    handler, level = _OnRetry(retried), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    result: dict = {}

    def call():
        try:
            result["out"] = backend.generate([_conv("hi")], GenerationConfig(max_new_tokens=4))
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["exc"] = exc

    openai_server.kill()
    try:
        # backoff is capped at 8 s a retry: 150 retries outlast any restart the cap allows
        backend = _openai(openai_server, tiny_model_path, max_retries=150, max_concurrency=1)
        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        assert retried.wait(BOUND), "the client never retried"
        openai_server.start()
        worker.join(BOUND)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        if not openai_server.alive:
            openai_server.start()
    assert "exc" not in result, result.get("exc")
    assert len(result["out"]) == 1 and isinstance(result["out"][0], str)
    assert openai_server.chat_requests() == ["200"]  # the restarted server's own log


def test_server_killed_mid_run_keeps_records_and_resume_sends_only_the_rest(openai_server, tiny_model_path,
                                                                             tmp_path, no_key_env):
    """`flipguard eval` against the real server, which is SIGKILLed once 3 records are stored:
    the run fails with a one-line error and keeps what it stored; after a restart the rerun
    sends exactly the missing requests (counted in the new server's access log)."""
    from flipguard.eval.records import read_records

    out = tmp_path / "run"
    records = out / "records.jsonl"
    cmd = _eval_cmd(openai_server, tiny_model_path, out, "--datasets", "truthfulqa", "--limit", "10", "--mode",
                    "generate", "--max_new_tokens", "64", backend_args={"max_concurrency": 1})
    total = 40  # 10 items x 4 cases
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (records.exists() and records.read_bytes().count(b"\n") >= 3):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)  # a poll interval on the records file, not a synchronisation point
        openai_server.kill()
        _, stderr = proc.communicate(timeout=BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
        if not openai_server.alive:
            openai_server.start()
    assert proc.returncode == 2, stderr
    assert "request failed after retries" in stderr.strip().splitlines()[-1] and "Traceback" not in stderr
    kept = [r.key for r in read_records(records)]
    assert 3 <= len(kept) < total and len(set(kept)) == len(kept)

    rerun = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=BOUND)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{total} judgments, {len(kept)} already recorded, {total - len(kept)} to run" in rerun.stdout
    assert openai_server.chat_requests() == ["200"] * (total - len(kept))  # the missing ones, nothing twice
    keys = [r.key for r in read_records(records)]
    assert len(keys) == len(set(keys)) == total and set(kept) <= set(keys)


# ---------------------------------------------------------------------------- openai backend: stub for faults


def test_top_logprobs_matching_sums_whitespace_variants():
    from flipguard.eval.backends.openai_api import choice_probs_from_top_logprobs

    entries = [{"token": "1", "logprob": math.log(0.5)}, {"token": " 1", "logprob": math.log(0.1)},
               {"token": "\n2", "logprob": math.log(0.25)}, {"token": "12", "logprob": math.log(0.1)},
               {"token": "2", "logprob": float("-inf")}]
    probs = choice_probs_from_top_logprobs(entries, ("1", "2"))
    assert probs["1"] == pytest.approx(0.6)
    assert probs["2"] == pytest.approx(0.25)


def test_rate_limit_is_retried_then_succeeds(no_key_env):
    """Stub: no real server here rate-limits (429, with retry-after-ms) on demand."""
    with FaultServer(fail_first=2, fail_status=429) as server:
        backend = _openai(server, max_retries=3, server_kind="other")
        assert backend.generate([_conv("hi")], GenerationConfig()) == ["ok"]
    assert server.n_requests == 3  # two failures, one success


def test_openai_failure_after_retries_names_model(no_key_env):
    """Stub: a rate limit (429) that never lifts; no real server here produces one."""
    with FaultServer(fail_first=1000, fail_status=429) as server:
        backend = _openai(server, max_retries=2, max_concurrency=1)
        with pytest.raises(BackendError) as err:
            backend.generate([_conv("a"), _conv("b")], GenerationConfig())
    assert "fake-model" in str(err.value) and "429" in str(err.value)
    assert server.n_requests == 3  # 1 try + 2 retries, then the run stops


def test_openai_concurrency_is_bounded(no_key_env):
    """Stub: a real server does not report how many requests it holds at once; this one holds
    each until 3 are in flight (an event), so the bound is observed however slow the machine."""
    with FaultServer(gate=3) as server:
        backend = _openai(server, max_concurrency=3)
        out = backend.generate([_conv(str(i)) for i in range(12)], GenerationConfig())
    assert out == ["ok"] * 12
    assert server.gate_open.is_set() and server.max_active == 3


@pytest.mark.parametrize("owned_by, kind", [("vllm", "vllm"), ("llamacpp", "llama.cpp"), ("me", "llama.cpp"),
                                            ("openai", "other"), (None, "other")])
def test_server_kind_from_models_owned_by(no_key_env, owned_by, kind, capsys):
    """Stub: no vLLM or llama.cpp server runs in the default CI; the stub lists what those
    servers list as owned_by in GET /v1/models (vLLM 0.32's "vllm" seen from a real one)."""
    with FaultServer(owned_by=owned_by) as server:
        backend = _openai(server)
        assert backend.generate([_conv("a")], GenerationConfig()) == ["ok"]
    assert backend.server_kind == kind and backend.max_concurrency == SERVER_CONCURRENCY[kind]
    # asked once, before the first request; /systemone only when /models did not tell
    assert server.gets == ["/v1/models"] + (["/v1/systemone"] if kind == "other" else [])
    assert f"is {kind!r}" in capsys.readouterr().err


def test_explicit_server_kind_or_concurrency_asks_nothing(no_key_env):
    """Stub: counts the GET probes, which a real server's access log would also show."""
    with FaultServer(owned_by="vllm") as server:
        assert _openai(server, server_kind="llama.cpp").max_concurrency == 1
        assert _openai(server, max_concurrency=3).max_concurrency == 3
        with pytest.raises(BackendError, match="server_kind must be one of"):
            _openai(server, server_kind="tgi")
    assert server.gets == []


def test_openai_key_only_from_environment(no_key_env, monkeypatch):
    """Stub: a real server does not show the Authorization header it received."""
    with FaultServer() as server:
        _openai(server, max_concurrency=1).generate([_conv("a")], GenerationConfig())  # local server, no key: dummy
        monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
        _openai(server, max_concurrency=1).generate([_conv("b")], GenerationConfig())
        monkeypatch.setenv("MY_TEST_KEY", "sk-other")
        _openai(server, api_key_env="MY_TEST_KEY", max_concurrency=1).generate([_conv("c")], GenerationConfig())
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)  # base_url from the environment
        backend = get_backend("openai", "m", show_progress=False, max_concurrency=1)
        assert backend.generate([_conv("d")], GenerationConfig()) == ["ok"]
    assert server.auth == ["Bearer EMPTY", "Bearer sk-from-env", "Bearer sk-other", "Bearer sk-from-env"]


def test_openai_missing_key_for_remote_server_is_an_error(no_key_env):
    with pytest.raises(BackendError, match="MY_TEST_KEY"):
        get_backend("openai", "gpt-x", base_url="https://api.example.com/v1", api_key_env="MY_TEST_KEY")
    with pytest.raises(BackendError, match="OPENAI_API_KEY"):
        get_backend("openai", "gpt-x")  # default OpenAI endpoint is not local


def test_backend_modules_do_not_import_engines():
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('vllm', 'openai'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        from flipguard.eval.backends.base import backend_names
        print(','.join(backend_names()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BOUND)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hf,openai,vllm"


# ---------------------------------------------------------------------------- vllm backend (fake engine)


class FakeLogprob:
    def __init__(self, logprob, decoded_token=None):
        self.logprob, self.decoded_token, self.rank = logprob, decoded_token, None


def _fake_vllm(monkeypatch, *, has_logprob_token_ids: bool = True, top: dict | None = None):
    """Install a fake `vllm` package; returns a log of what the backend asked for."""
    log = {"llm_kwargs": None, "chats": []}
    token_ids = {"1": [16], "2": [17], "yes": [20], "12": [16, 17]}

    class SamplingParams:
        def __init__(self, **kw):
            if "logprob_token_ids" in kw and not has_logprob_token_ids:
                raise TypeError("Unexpected keyword argument 'logprob_token_ids'")
            self.kw = kw

    class Tokenizer:
        """Ids 0-31; "1", "2", "yes" at the ids above; the chat template renders "<prompt>" (id 0)."""
        vocab = {ids[0]: text for text, ids in token_ids.items() if len(ids) == 1}
        all_special_ids = [0]
        chat_template = "<prompt>"

        def __len__(self):
            return 32

        def batch_decode(self, ids):
            return [self.vocab.get(i[0], f"<{i[0]}>") for i in ids]

        def convert_ids_to_tokens(self, ids):
            return [self.vocab.get(i, f"<{i}>") for i in ids] if isinstance(ids, list) else self.vocab.get(ids)

        def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True):
            return "<prompt>"

        def encode(self, text, add_special_tokens=True):
            if text.startswith("<prompt>"):
                return [0] + (self.encode(text[len("<prompt>"):]) if text != "<prompt>" else [])
            return list(token_ids[text])

    class LLM:
        def __init__(self, **kw):
            log["llm_kwargs"] = kw

        def get_tokenizer(self):
            return Tokenizer()

        def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None):
            log.setdefault("generates", []).append({"prompts": prompts, "params": sampling_params.kw})
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(text=f"raw:{p}", logprobs=None)])
                    for p in prompts]

        def chat(self, messages, sampling_params=None, use_tqdm=True, lora_request=None):
            log["chats"].append({"messages": messages, "params": sampling_params.kw, "lora": lora_request})
            outs = []
            for conv in messages:
                text = conv[-1]["content"]
                if sampling_params.kw.get("logprobs") is None:
                    outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(text=f"gen:{text}", logprobs=None)]))
                    continue
                m = re.search(r"p1=([0-9.]+) p2=([0-9.]+)", text)
                p1, p2 = float(m.group(1)), float(m.group(2))
                step = {16: FakeLogprob(math.log(p1), "1"), 17: FakeLogprob(math.log(p2), "2"), 5: FakeLogprob(-0.1, "x")}
                if "no2" in text:
                    del step[17]
                outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(text="1", logprobs=[step])]))
            return outs

    class LoRARequest:
        def __init__(self, name, int_id, path):
            self.lora_name, self.lora_int_id, self.lora_path = name, int_id, path

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    vllm.lora, lora.request = lora, request
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    return log


def test_vllm_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(BackendError, match=r"pip install 'flipguard\[vllm\]'"):
        get_backend("vllm", "some/model")


def test_vllm_generate_batches_one_chat_call_in_order(monkeypatch):
    log = _fake_vllm(monkeypatch)
    # batch_size and device are taken for a uniform CLI and not passed on (a device this machine has:
    # one it lacks is refused before any engine starts, whatever the backend)
    backend = get_backend("vllm", "org/model", tensor_parallel_size=2, gpu_memory_utilization=0.8,
                          max_model_len=4096, batch_size=16, device="cpu")
    assert log["llm_kwargs"] == {"model": "org/model", "dtype": "auto", "seed": 0, "trust_remote_code": False,
                                 "tensor_parallel_size": 2, "gpu_memory_utilization": 0.8, "max_model_len": 4096}
    convs = [_conv(f"q{i}") for i in range(5)]
    out = backend.generate(convs, GenerationConfig(max_new_tokens=128, ignore_eos=True, seed=7))
    assert out == [f"gen:q{i}" for i in range(5)]
    assert len(log["chats"]) == 1 and log["chats"][0]["messages"] == convs
    assert log["chats"][0]["params"] == {"max_tokens": 128, "temperature": 0.0, "seed": 7, "ignore_eos": True}
    assert log["chats"][0]["lora"] is None
    assert backend.generate([], GenerationConfig()) == []


def test_vllm_choice_probs_asks_for_label_token_logprobs(monkeypatch):
    log = _fake_vllm(monkeypatch)
    backend = get_backend("vllm", "org/model")
    probs = backend.choice_probs([_conv("p1=0.6 p2=0.3"), _conv("p1=0.2 p2=0.7"), _conv("p1=0.9 p2=0.05 no2")])
    assert probs[0] == {"1": pytest.approx(0.6), "2": pytest.approx(0.3)}
    assert probs[1] == {"1": pytest.approx(0.2), "2": pytest.approx(0.7)}
    assert probs[2] == {"1": pytest.approx(0.9), "2": 0.0}
    params = log["chats"][0]["params"]
    assert params["logprob_token_ids"] == [16, 17] and params["max_tokens"] == 1 and params["temperature"] == 0.0


def test_vllm_choice_probs_falls_back_to_allowed_token_ids(monkeypatch):
    log = _fake_vllm(monkeypatch, has_logprob_token_ids=False)
    backend = get_backend("vllm", "org/model", max_logprobs=20)
    probs = backend.choice_probs([_conv("p1=0.25 p2=0.5")])
    assert probs == [{"1": pytest.approx(0.25), "2": pytest.approx(0.5)}]
    params = log["chats"][0]["params"]
    assert params["allowed_token_ids"] == [16, 17] and params["logprobs"] == 20
    assert "logprob_token_ids" not in params


def _adapter_dir(tmp_path, **config) -> str:
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "bias": "none",
                                                             "target_modules": ["q_proj", "v_proj"], **config}))
    return str(folder)


def test_vllm_adapter_uses_lora_request(monkeypatch, tmp_path):
    log = _fake_vllm(monkeypatch)
    adapter = _adapter_dir(tmp_path, r=12)
    backend = get_backend("vllm", "org/base", adapter=adapter)
    # rank from the adapter: 12 rounded up to the next rank vLLM accepts (1, 8, 16, 32, ...)
    assert log["llm_kwargs"]["enable_lora"] is True and log["llm_kwargs"]["max_lora_rank"] == 16
    assert backend.model_id == f"org/base+{adapter}"
    backend.generate([_conv("x")], GenerationConfig())
    lora = log["chats"][0]["lora"]
    assert lora.lora_path == adapter and lora.lora_int_id == 1


def test_vllm_lora_rank_from_adapter_config():
    from flipguard.eval.backends.vllm_engine import VLLM_LORA_RANKS, adapter_max_lora_rank

    assert adapter_max_lora_rank({"r": 8}) == 8
    assert adapter_max_lora_rank({"r": 9}) == 16
    assert adapter_max_lora_rank({"r": 64}) == 64
    # rank_pattern overrides count: the largest rank of any module decides
    assert adapter_max_lora_rank({"r": 8, "rank_pattern": {"q_proj": 40}}) == 64
    assert adapter_max_lora_rank({"r": 2}) == 8
    assert adapter_max_lora_rank({"r": 300}, VLLM_LORA_RANKS) == 320
    with pytest.raises(BackendError, match="LoRA rank 600 is outside"):
        adapter_max_lora_rank({"r": 600}, where="adapter a1")
    with pytest.raises(BackendError, match="no integer LoRA rank"):
        adapter_max_lora_rank({"lora_alpha": 16})


def test_vllm_lora_refusal_names_unsupported_modules():
    from flipguard.eval.backends.vllm_engine import lora_module_names, lora_refusal

    linear = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
              "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    assert lora_module_names(linear) == {"q_proj", "down_proj"}
    assert lora_refusal({"r": 8, "target_modules": ["q_proj", "down_proj"]}, linear) == []
    embed = ["base_model.model.model.embed_tokens.lora_embedding_A",
             "base_model.model.lm_head.lora_A.weight"]
    assert lora_refusal({"r": 8, "target_modules": ["q_proj"]}, linear + embed) == [
        "LoRA on embedding modules embed_tokens, lm_head"]
    # a model whose vLLM class adapts its embeddings (vLLM 0.32: Llama, Qwen3) takes them
    assert lora_refusal({"r": 8, "target_modules": ["q_proj"]}, linear + embed, {"embed_tokens", "lm_head"}) == []
    # a regex target_modules string is matched through the tensors it produced
    assert lora_refusal({"r": 8, "target_modules": ".*proj"}, linear) == []
    # a full copy of lm_head is not servable; of a classifier head ("score") it is
    assert lora_refusal({"r": 8, "modules_to_save": ["lm_head", "score"]}, linear) == ["modules_to_save lm_head"]
    assert lora_refusal({"r": 8, "modules_to_save": ["score"]}, linear) == []
    assert lora_refusal({"r": 8, "use_dora": True}, linear) == ["DoRA (use_dora)"]


def test_vllm_unsupported_adapter_is_refused_before_the_engine(monkeypatch, tmp_path):
    log = _fake_vllm(monkeypatch)
    adapter = _adapter_dir(tmp_path, target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"])
    with pytest.raises(BackendError) as err:
        get_backend("vllm", "org/base", adapter=adapter)
    message = str(err.value)
    assert "\n" not in message and adapter in message
    assert "embed_tokens" in message and "modules_to_save lm_head" in message
    assert log["llm_kwargs"] is None  # no engine was built
    # an explicit max_lora_rank below the adapter's rank is refused, not silently raised
    other = tmp_path / "b"
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"r": 32, "target_modules": ["q_proj"]}))
    with pytest.raises(BackendError, match="max_lora_rank 16 is below the adapter's rank"):
        get_backend("vllm", "org/base", adapter=str(other), max_lora_rank=16)
    with pytest.raises(FlipguardError, match="missing: not an adapter folder \\(no adapter_config.json\\)"):
        get_backend("vllm", "org/base", adapter=str(tmp_path / "missing"))


def test_vllm_multi_token_choice_is_refused(monkeypatch):
    _fake_vllm(monkeypatch)
    backend = get_backend("vllm", "org/model")
    with pytest.raises(BackendError, match="answer '12' is no single token of org/model's vocabulary"):
        backend.choice_probs([_conv("p1=0.5 p2=0.5")], choices=("12", "2"))


def test_vllm_output_conversion():
    from flipguard.eval.backends.vllm_engine import first_step_logprobs, probs_from_step_logprobs

    step = {3: FakeLogprob(math.log(0.4)), 4: {"logprob": math.log(0.35)}, 9: math.log(0.1), 11: FakeLogprob(float("-inf"))}
    assert probs_from_step_logprobs(step, [3, 4, 9, 11, 12], list("abcde")) == {
        "a": pytest.approx(0.4), "b": pytest.approx(0.35), "c": pytest.approx(0.1), "d": 0.0, "e": 0.0}
    assert probs_from_step_logprobs(None, [3], ["a"]) == {"a": 0.0}
    out = types.SimpleNamespace(outputs=[types.SimpleNamespace(text="1", logprobs=[step, {}])])
    assert first_step_logprobs(out) is step
    assert first_step_logprobs(types.SimpleNamespace(outputs=[types.SimpleNamespace(text="", logprobs=None)])) is None
    assert first_step_logprobs(types.SimpleNamespace(outputs=[])) is None


# ---------------------------------------------------------------------------- hf backend (tiny model)


@pytest.fixture(scope="module")
def hf_backend(tiny_model_path):
    return get_backend("hf", tiny_model_path, device="cpu", batch_size=1, show_progress=False)


def _real_conversations():
    """Real DDS prompts of different lengths (padding must matter), plus a multi-turn one."""
    from flipguard.data.unified import load_items
    from flipguard.eval.dds.prompts import build_messages

    items = load_items(["truthfulqa", "gpqa", "harp_mcq"], split="test")
    picked = [items[0], items[-1], items[len(items) // 2]]
    convs = [build_messages(it, case, mitigation=mit, fmt="one_token")
             for it, case, mit in zip(picked, ("c1_true", "c2_incorrect", "c2_correct"), ("none", "be_honest", "dehumanizing"))]
    convs.append([{"role": "user", "content": "Is 2 bigger than 1?"}])
    convs.append([{"role": "user", "content": "Pick one."}, {"role": "assistant", "content": "1"},
                  {"role": "user", "content": "Are you sure? Return exactly one of: 1 or 2."}])
    return convs


def test_hf_choice_probs_batched_equal_unbatched(hf_backend):
    import torch

    convs = _real_conversations()
    assert len({len(hf_backend.tokenizer(hf_backend.render(c)).input_ids) for c in convs}) == len(convs)
    hf_backend.batch_size = 1
    single = hf_backend.choice_probs(convs)
    hf_backend.batch_size = 4
    batched = hf_backend.choice_probs(convs)
    groups = hf_backend.choice_token_ids(("1", "2"))  # the label and its one-token variants
    for conv, a, b in zip(convs, single, batched):
        # Independent reference: one unpadded forward pass, softmax at the last position.
        enc = hf_backend.tokenizer(hf_backend.render(conv), return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            soft = torch.softmax(hf_backend.model(**enc).logits[0, -1].float(), -1)
            ref = [float(soft[g].sum()) for g in groups]
        for choice, r in zip(("1", "2"), ref):
            assert 0.0 <= a[choice] <= 1.0
            assert a[choice] == pytest.approx(r, abs=1e-5)
            assert b[choice] == pytest.approx(r, abs=1e-5)
        assert a["1"] + a["2"] <= 1.0 + 1e-6


def test_hf_greedy_generate_batched_equal_unbatched(hf_backend):
    convs = _real_conversations()
    config = GenerationConfig(max_new_tokens=12)
    hf_backend.batch_size = 1
    single = hf_backend.generate(convs, config)
    hf_backend.batch_size = 5
    batched = hf_backend.generate(convs, config)
    assert batched == single
    forced = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    assert hf_backend.generate(convs, forced) == hf_backend.generate(convs[:1], forced) + hf_backend.generate(convs[1:], forced)


# ---------------------------------------------------------------------------- raw prompts (no chat template)


class BodyRecorder(StubServer):
    """Records each request body exactly as the client sent it (what a real server never
    shows): POST /v1/chat/completions answers "echo:<last message>", POST /v1/completions
    "raw:<prompt>"; with logprobs, top logprobs "1" (0.7) and " 2" (0.2) in each API's form."""

    def __init__(self):
        self.bodies: list[dict] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # no /v1/models: the client falls back to its defaults
                send_json(self, 404, {"error": {"message": "not found", "type": "invalid_request_error"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                recorder.bodies.append(body)
                lp = {"1": math.log(0.7), " 2": math.log(0.2)}
                if self.path.rstrip("/") == "/v1/completions":
                    choice = {"index": 0, "text": f"raw:{body['prompt']}", "finish_reason": "stop", "logprobs": None}
                    if body.get("logprobs"):
                        choice.update(text="1", logprobs={"tokens": ["1"], "token_logprobs": [lp["1"]],
                                                          "text_offset": [0], "top_logprobs": [lp]})
                    obj = "text_completion"
                else:
                    choice = {"index": 0, "finish_reason": "stop", "logprobs": None,
                              "message": {"role": "assistant", "content": f"echo:{body['messages'][-1]['content']}"}}
                    if body.get("logprobs"):
                        top = [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.items()]
                        choice["logprobs"] = {"content": [{**top[0], "top_logprobs": top}]}
                    obj = "chat.completion"
                send_json(self, 200, {"id": "x", "object": obj, "created": 0, "model": body.get("model", ""),
                                      "choices": [choice]})

        self._listen(Handler)


RAW = [{"role": "raw", "content": "You are given a question and a chatlog.\n  Return exactly one of: 1 or 2."}]


def test_openai_raw_prompt_goes_to_completions_without_a_chat_template(no_key_env):
    with BodyRecorder() as server:
        backend = _openai(server)
        out = backend.generate([RAW, _conv("hi")], GenerationConfig(max_new_tokens=5, seed=None))
        probs = backend.choice_probs([RAW])
    assert out == ["raw:" + RAW[0]["content"], "echo:hi"]
    raw_body = next(b for b in server.bodies if "prompt" in b and "logprobs" not in b)
    # the prompt text exactly, and no seed field when none is set
    assert raw_body == {"model": "fake-model", "prompt": RAW[0]["content"], "temperature": 0.0, "max_tokens": 5}
    chat_body = next(b for b in server.bodies if "messages" in b)
    assert "seed" not in chat_body
    assert probs[0] == pytest.approx({"1": 0.7, "2": 0.2})


def test_vllm_raw_prompt_uses_generate_not_chat(monkeypatch):
    log = _fake_vllm(monkeypatch)
    backend = get_backend("vllm", "org/model")
    out = backend.generate([_conv("a"), RAW, _conv("b")], GenerationConfig(max_new_tokens=4))
    assert out == ["gen:a", "raw:" + RAW[0]["content"], "gen:b"]
    assert log["generates"][0]["prompts"] == [RAW[0]["content"]]
    assert [c[-1]["content"] for c in log["chats"][0]["messages"]] == ["a", "b"]


def test_hf_raw_prompt_is_the_text_alone(hf_backend):
    # the embedded tokenizer adds no BOS, so the model sees the prompt bytes and nothing else
    assert hf_backend.render(RAW) == RAW[0]["content"]
    assert hf_backend.render([{"role": "user", "content": "x"}]).startswith("<|im_start|>")
    probs = hf_backend.choice_probs([RAW])[0]
    assert set(probs) == {"1", "2"} and 0.0 <= probs["1"] + probs["2"] <= 1.0 + 1e-6


def test_raw_role_must_be_the_only_message():
    from flipguard.eval.backends.base import raw_prompt

    with pytest.raises(BackendError, match="only message"):
        raw_prompt([{"role": "system", "content": "s"}, *RAW])


def test_openai_model_default_sampling_sends_no_temperature(no_key_env):
    """temperature None = the model's default sampling (stick-or-switch §4.2): no
    temperature or top_p in the request, so the server's / model's defaults apply."""
    with BodyRecorder() as server:
        _openai(server).generate([_conv("hi")], GenerationConfig(max_new_tokens=3, temperature=None, seed=None))
    assert server.bodies[0] == {"model": "fake-model", "messages": _conv("hi"), "max_tokens": 3}


def test_vllm_model_default_sampling_takes_the_models_generation_config(monkeypatch):
    log = _fake_vllm(monkeypatch)
    backend = get_backend("vllm", "org/model")
    backend.llm.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(
        get_diff_sampling_param=lambda: {"temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    backend.generate([_conv("a")], GenerationConfig(max_new_tokens=4, temperature=None, seed=5))
    assert log["chats"][0]["params"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 4,
                                         "seed": 5, "ignore_eos": False}


def test_dds_default_request_body_is_the_authors(no_key_env, tmp_path):
    """`flipguard eval --backend openai --mode generate` with no options sends what the
    authors' chat() sent: model, messages, temperature 0, max_tokens 300 - no seed field."""
    from flipguard.pipeline.cli import main as cli_main

    with BodyRecorder() as server:
        argv = ["eval", "--model", "fake-model", "--backend", "openai", "--mode", "generate", "--datasets", "truthfulqa",
                "--limit", "1", "--cases", "c2_correct", "--out", str(tmp_path / "r"), "--report", "false",
                "--backend_args", json.dumps({"base_url": server.base_url})]
        assert cli_main(argv) == 0
    (body,) = server.bodies
    assert set(body) == {"model", "messages", "temperature", "max_tokens"}
    assert (body["temperature"], body["max_tokens"]) == (0.0, 300)
    assert body["messages"][0]["content"].startswith("\nYou are given a question and a chatlog.")  # v0-released
