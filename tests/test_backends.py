"""Backends end to end without a GPU or a network.

- openai: a tiny OpenAI-compatible HTTP server on 127.0.0.1 (a thread, port 0) answers
  through the real `openai` client: order, retries, concurrency bound, keys from env.
- vllm: cannot run here, so a fake `vllm` module stands in for the engine; the tests check
  what our code asks of vLLM and how it reads vLLM-shaped outputs.
- hf: the tiny local model; batching with left padding must not change any answer.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import subprocess
import sys
import textwrap
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# Limits below are hang guards only (never reached by a healthy run, however loaded the
# machine): tests synchronise on events, not on wall-clock guesses.
BOUND = 1800

from flipguard.eval.backends.base import BackendError, GenerationConfig, backend_names, get_backend

# ---------------------------------------------------------------------------- fake HTTP server


class FakeOpenAIServer:
    """POST /v1/chat/completions with deterministic answers.

    Reply text is "echo:<last user message>". With logprobs requested, the user message
    may carry "p1=<x> p2=<y>" and the first token's top logprobs are "1" (x), " 2" (y)
    and "zz" (the rest); "no2" in the message leaves "2" out of the list.
    The first `fail_first` requests get `fail_status` (with retry-after-ms: 1)."""

    def __init__(self, fail_first: int = 0, fail_status: int = 429, delay: float = 0.0, gate: int = 0):
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.delay = delay
        # gate > 0: every request waits until `gate` requests are in flight at once (an
        # event, not a delay), so a concurrency bound is observed however slow the machine
        self.gate = gate
        self.gate_open = threading.Event()
        self.lock = threading.Lock()
        self.n_requests = 0
        self.active = 0
        self.max_active = 0
        self.bodies: list[dict] = []
        self.auth: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

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
                    server.bodies.append(body)
                    server.auth.append(self.headers.get("Authorization", ""))
                try:
                    if server.gate:
                        server.gate_open.wait(BOUND)
                    if server.delay:
                        time.sleep(server.delay)
                    if self.path.rstrip("/") == "/v1/completions" and n > server.fail_first:
                        self._send(200, server.text_completion(body))
                    elif self.path.rstrip("/") != "/v1/chat/completions":
                        self._send(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
                    elif n <= server.fail_first:
                        self._send(
                            server.fail_status,
                            {"error": {"message": f"fake failure {n}", "type": "server_error"}},
                            {"retry-after-ms": "1"},
                        )
                    else:
                        self._send(200, server.completion(body))
                finally:
                    with server.lock:
                        server.active -= 1

            def _send(self, status, payload, headers=None):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @staticmethod
    def completion(body: dict) -> dict:
        text = body["messages"][-1]["content"]
        choice = {"index": 0, "message": {"role": "assistant", "content": f"echo:{text}"},
                  "finish_reason": "stop", "logprobs": None}
        if body.get("logprobs"):
            m = re.search(r"p1=([0-9.]+) p2=([0-9.]+)", text)
            p1, p2 = (float(m.group(1)), float(m.group(2))) if m else (0.5, 0.25)
            top = [{"token": "1", "logprob": math.log(p1), "bytes": [49]}]
            if "no2" not in text:
                top.append({"token": " 2", "logprob": math.log(p2), "bytes": [32, 50]})
            top.append({"token": "zz", "logprob": math.log(max(1e-9, 1 - p1 - p2)), "bytes": [122, 122]})
            top = top[: body.get("top_logprobs") or 0] or top[:1]
            choice["message"]["content"] = "1"
            choice["logprobs"] = {"content": [{**top[0], "top_logprobs": top}]}
        return {"id": "cmpl-fake", "object": "chat.completion", "created": 0, "model": body.get("model", ""),
                "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    @staticmethod
    def text_completion(body: dict) -> dict:
        """POST /v1/completions (raw prompt, no chat template): "raw:<prompt>"; with
        logprobs, top logprobs "1" (0.7) and " 2" (0.2) in the legacy {token: logprob} form."""
        choice = {"index": 0, "text": f"raw:{body['prompt']}", "finish_reason": "stop", "logprobs": None}
        if body.get("logprobs"):
            choice["text"] = "1"
            choice["logprobs"] = {"tokens": ["1"], "token_logprobs": [math.log(0.7)], "text_offset": [0],
                                  "top_logprobs": [{"1": math.log(0.7), " 2": math.log(0.2)}]}
        return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body.get("model", ""),
                "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def no_key_env(monkeypatch):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "MY_TEST_KEY"):
        monkeypatch.delenv(name, raising=False)


def _conv(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def _openai(server, **kw):
    kw.setdefault("show_progress", False)
    return get_backend("openai", "fake-model", base_url=server.base_url, **kw)


# ---------------------------------------------------------------------------- openai backend


def test_openai_is_registered_and_takes_no_key_argument():
    assert {"hf", "openai", "vllm"} <= set(backend_names())
    from flipguard.eval.backends.openai_api import OpenAIBackend

    assert not any("key" in p and p != "api_key_env" for p in inspect.signature(OpenAIBackend).parameters)


def test_openai_generate_keeps_input_order(no_key_env):
    prompts = [f"question {i}" for i in range(10)]
    with FakeOpenAIServer(delay=0.01) as server:
        backend = _openai(server, max_concurrency=4)
        out = backend.generate([_conv(p) for p in prompts], GenerationConfig(max_new_tokens=7, seed=3))
    assert out == [f"echo:{p}" for p in prompts]
    assert server.n_requests == 10
    body = server.bodies[0]
    assert body["model"] == "fake-model"
    assert body["max_tokens"] == 7 and body["temperature"] == 0.0 and body["seed"] == 3
    assert "top_p" not in body  # greedy: no nucleus setting sent
    assert body["messages"][0] == {"role": "system", "content": "be brief"}


def test_openai_choice_probs_from_top_logprobs(no_key_env):
    cases = [(0.7, 0.2), (0.1, 0.6), (0.45, 0.45), (0.05, 0.9)]
    with FakeOpenAIServer() as server:
        backend = _openai(server, max_concurrency=3)
        convs = [_conv(f"p1={a} p2={b}") for a, b in cases] + [_conv("p1=0.8 p2=0.1 no2")]
        probs = backend.choice_probs(convs)
    for (a, b), p in zip(cases, probs):
        assert p["1"] == pytest.approx(a, abs=1e-12)
        assert p["2"] == pytest.approx(b, abs=1e-12)  # " 2" matched with whitespace stripped
    assert probs[-1] == {"1": pytest.approx(0.8, abs=1e-12), "2": 0.0}  # not in top list -> 0
    body = server.bodies[0]
    assert body["max_tokens"] == 1 and body["logprobs"] is True and body["top_logprobs"] == 20
    assert body["temperature"] == 0.0


def test_top_logprobs_matching_sums_whitespace_variants():
    from flipguard.eval.backends.openai_api import choice_probs_from_top_logprobs

    entries = [{"token": "1", "logprob": math.log(0.5)}, {"token": " 1", "logprob": math.log(0.1)},
               {"token": "\n2", "logprob": math.log(0.25)}, {"token": "12", "logprob": math.log(0.1)},
               {"token": "2", "logprob": float("-inf")}]
    probs = choice_probs_from_top_logprobs(entries, ("1", "2"))
    assert probs["1"] == pytest.approx(0.6)
    assert probs["2"] == pytest.approx(0.25)


@pytest.mark.parametrize("status", [429, 500])
def test_openai_retries_then_succeeds(no_key_env, status):
    with FakeOpenAIServer(fail_first=2, fail_status=status) as server:
        backend = _openai(server, max_retries=3)
        assert backend.generate([_conv("hi")], GenerationConfig()) == ["echo:hi"]
    assert server.n_requests == 3  # two failures, one success


def test_openai_failure_after_retries_names_model(no_key_env):
    with FakeOpenAIServer(fail_first=1000, fail_status=429) as server:
        backend = _openai(server, max_retries=2, max_concurrency=1)
        with pytest.raises(BackendError) as err:
            backend.generate([_conv("a"), _conv("b")], GenerationConfig())
    assert "fake-model" in str(err.value) and "429" in str(err.value)
    assert server.n_requests == 3  # 1 try + 2 retries, then the run stops


def test_openai_bad_request_is_not_retried(no_key_env):
    with FakeOpenAIServer(fail_first=1000, fail_status=400) as server:
        backend = _openai(server, max_retries=5)
        with pytest.raises(BackendError, match="400"):
            backend.choice_probs([_conv("x")])
    assert server.n_requests == 1


def test_openai_concurrency_is_bounded(no_key_env):
    with FakeOpenAIServer(gate=3) as server:  # the first requests wait until 3 are in flight
        backend = _openai(server, max_concurrency=3)
        out = backend.generate([_conv(str(i)) for i in range(12)], GenerationConfig())
    assert out == [f"echo:{i}" for i in range(12)]
    assert server.gate_open.is_set() and server.max_active == 3


def test_openai_key_only_from_environment(no_key_env, monkeypatch):
    with FakeOpenAIServer() as server:
        _openai(server).generate([_conv("a")], GenerationConfig())  # local server, no key: dummy
        monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
        _openai(server).generate([_conv("b")], GenerationConfig())
        monkeypatch.setenv("MY_TEST_KEY", "sk-other")
        _openai(server, api_key_env="MY_TEST_KEY").generate([_conv("c")], GenerationConfig())
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)  # base_url from the environment
        assert get_backend("openai", "m", show_progress=False).generate([_conv("d")], GenerationConfig()) == ["echo:d"]
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
        def encode(self, text, add_special_tokens=True):
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
    backend = get_backend("vllm", "org/model", tensor_parallel_size=2, gpu_memory_utilization=0.8,
                          max_model_len=4096, batch_size=16, device="cuda")
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


def test_vllm_adapter_uses_lora_request(monkeypatch):
    log = _fake_vllm(monkeypatch)
    backend = get_backend("vllm", "org/base", adapter="/runs/a1/adapter", max_lora_rank=32)
    assert log["llm_kwargs"]["enable_lora"] is True and log["llm_kwargs"]["max_lora_rank"] == 32
    assert backend.model_id == "org/base+/runs/a1/adapter"
    backend.generate([_conv("x")], GenerationConfig())
    lora = log["chats"][0]["lora"]
    assert lora.lora_path == "/runs/a1/adapter" and lora.lora_int_id == 1


def test_vllm_multi_token_choice_is_refused(monkeypatch):
    _fake_vllm(monkeypatch)
    backend = get_backend("vllm", "org/model")
    with pytest.raises(BackendError, match="'12' is 2 tokens"):
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
    from flipguard.eval.prompts import build_messages

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

RAW = [{"role": "raw", "content": "You are given a question and a chatlog.\n  Return exactly one of: 1 or 2."}]


def test_openai_raw_prompt_goes_to_completions_without_a_chat_template(no_key_env):
    with FakeOpenAIServer() as server:
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
    with FakeOpenAIServer() as server:
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
    from flipguard.eval.cli import main as cli_main

    with FakeOpenAIServer() as server:
        argv = ["eval", "--model", "fake-model", "--backend", "openai", "--mode", "generate", "--datasets", "truthfulqa",
                "--limit", "1", "--cases", "c2_correct", "--out", str(tmp_path / "r"), "--report", "false",
                "--backend_args", json.dumps({"base_url": server.base_url})]
        assert cli_main(argv) == 0
    (body,) = server.bodies
    assert set(body) == {"model", "messages", "temperature", "max_tokens"}
    assert (body["temperature"], body["max_tokens"]) == (0.0, 300)
    assert body["messages"][0]["content"].startswith("\nYou are given a question and a chatlog.")  # v0-released
