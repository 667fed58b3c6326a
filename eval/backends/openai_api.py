"""OpenAI-compatible HTTP backend: `vllm serve`, OpenAI, OpenRouter, any /v1/chat/completions.

Requests go through the official `openai` client, which retries rate limits (429),
timeouts, connection errors and 5xx with exponential backoff plus jitter and honours
Retry-After; `max_retries` bounds it. Requests run on a bounded thread pool
(`max_concurrency`) and results come back in input order. Every finished request is
handed to the runner at once (`on_result`), which stores it, so a failure after 20
requests keeps those 20. A request that still fails after its retries stops the run
with a BackendError (its text redacted: no Authorization header or key is printed);
rerunning the command resumes.

Defaults are chosen so that a hung server fails the run in minutes, not hours:
`timeout` 60 s per attempt, `max_retries` 2 (three attempts: at most ~3 minutes per
request).

Requests in flight suit the server (SERVER_CONCURRENCY; bench/serving_concurrency.md):
a batching server (vLLM) gains from many; one that generates a request at a time gains
nothing (`transformers serve`: 0.97-1.01x at 2-8 in flight vs 1) or loses (llama.cpp's single
slot: 0.76x at 8, measured by hand), and extra requests only pile up retries on it. With
`max_concurrency` unset (0) the kind comes from `server_kind`, or, when that is "auto",
from the server itself before the first request: GET /models (vLLM lists owned_by
"vllm", llama.cpp "llamacpp", llama-cpp-python "me"), then GET /systemone (a POST-only
route: `transformers serve` answers 405 with an x-request-id header; vLLM 0.32 answers
405 without one). Anything else is "other".

The API key is read only from the environment (`api_key_env`, default OPENAI_API_KEY;
e.g. OPENROUTER_API_KEY); an `api_key` in --backend_args is refused. A local server
(localhost, 127.0.0.1, ::1) may run without a key; "EMPTY" is sent then, as vLLM expects.
Credentials in `base_url` (user:pass@, ?key=) are redacted wherever the URL is shown.

Label probabilities over HTTP: servers take no token ids in general, so `choice_probs`
asks for one token with `top_logprobs` (20 is OpenAI's maximum) and matches the returned
token strings against the rule every backend counts by (the label with only whitespace
around it: "1", " 1", "\n1", "▁1"; base.token_label; their probabilities add up). A label outside the top 20
gets 0.0, so for OpenAI models P(label) is a top-20 truncation; when neither label is
in the list the judgment is invalid (the runner counts it; no choice is made up). For a
local model prefer the `hf` or `vllm` backend, which read the label tokens directly.
"""

from __future__ import annotations

import math
import os
import sys
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

from tqdm.auto import tqdm

from flipguard.eval.backends.base import (
    Backend,
    BackendError,
    Conversation,
    GenerationConfig,
    raw_prompt,
    register_backend,
    token_label,
)
from flipguard.redact import redact

DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}
LOCAL_DUMMY_KEY = "EMPTY"
OPENAI_DEFAULT_BASE_URL = "https://api.openai.com/v1"
MAX_TOP_LOGPROBS = 20  # OpenAI's limit; vLLM's default --max-logprobs is also 20
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_RETRIES = 2
# Requests in flight when max_concurrency is unset, by server kind (docs/serving.md "Requests in
# flight"): transformers and vLLM measured in bench/serving_concurrency.md (vLLM batches:
# 6.2x at 8 vs 1), llama.cpp measured by hand (0.76x at 8: one slot); "other" (OpenAI,
# OpenRouter, unknown) keeps 4, a bound on retried requests piling on a slow server.
SERVER_CONCURRENCY = {"vllm": 8, "transformers": 1, "llama.cpp": 1, "other": 4}
SERVER_KINDS = ("auto", *SERVER_CONCURRENCY)
OWNED_BY_KIND = {"vllm": "vllm", "llamacpp": "llama.cpp", "me": "llama.cpp"}
DEFAULT_MAX_CONCURRENCY = 0  # 0: by server kind (SERVER_CONCURRENCY)
PROBE_TIMEOUT_S = 10.0

_KIND_DEFAULTS = ", ".join(f"{k} {v}" for k, v in SERVER_CONCURRENCY.items())
BACKEND_ARGS_HELP = (
    'Extra backend keyword arguments as JSON, e.g. \'{"base_url": "http://localhost:8000/v1"}\'. '
    f"openai: base_url, api_key_env (default {DEFAULT_API_KEY_ENV}; keys come from the environment only, "
    f"an api_key here is refused), timeout (s per attempt, default {DEFAULT_TIMEOUT_S:g}), max_retries "
    f"(default {DEFAULT_MAX_RETRIES}), max_concurrency (requests in flight; default by server_kind: "
    f"{_KIND_DEFAULTS}), server_kind (default auto: asked of the server; or one of those), top_logprobs "
    f"(default {MAX_TOP_LOGPROBS}), extra_body. hf: batch_size, device, dtype."
)


def is_local_url(url: str) -> bool:
    return (urlparse(url).hostname or "").lower() in LOCAL_HOSTS


def detect_server_kind(client, timeout: float = PROBE_TIMEOUT_S) -> tuple[str, str]:
    """(kind, evidence) from what the server says about itself; ("other", why) when it
    says nothing we know. Two GETs, each bounded by `timeout` and tried again once only
    when the connection drops (a server may close it after an error)."""
    import openai

    probe = client.with_options(max_retries=0, timeout=min(timeout, PROBE_TIMEOUT_S))

    def ask(fn):
        try:
            return fn()
        except openai.APIConnectionError:
            return fn()

    try:
        owners = sorted({str(getattr(m, "owned_by", "") or "") for m in ask(probe.models.list).data})
        why = f"GET /models owned_by {owners}"
    except Exception as exc:  # noqa: BLE001 - any failure only means "not told"
        owners, why = [], f"GET /models failed ({type(exc).__name__})"
    for owner in owners:
        if owner.lower() in OWNED_BY_KIND:
            return OWNED_BY_KIND[owner.lower()], f"owned_by {owner!r} in GET /models"
    try:
        ask(lambda: probe.get("/systemone", cast_to=object))
    except openai.APIStatusError as exc:
        # vLLM has this POST-only route too; only transformers serve stamps an x-request-id
        if exc.status_code == 405 and exc.response.headers.get("x-request-id"):
            return "transformers", "GET /systemone answered 405 with an x-request-id, as transformers serve does"
    except Exception:  # noqa: BLE001
        pass
    return "other", why


def resolve_api_key(api_key_env: str, base_url: str) -> str:
    """The key from the environment; a dummy one for a local server; else a clear error."""
    key = os.environ.get(api_key_env, "").strip()
    if key:
        return key
    if is_local_url(base_url):
        return LOCAL_DUMMY_KEY
    raise BackendError(
        f"no API key for {redact(base_url)}: set the environment variable {api_key_env} "
        "(keys are read from the environment only; pick another variable with api_key_env, "
        "e.g. OPENROUTER_API_KEY)"
    )


def choice_probs_from_top_logprobs(top_logprobs: Sequence[Any], choices: Sequence[str]) -> dict[str, float]:
    """P(choice) from one position's top logprobs (objects or dicts with token/logprob).

    A token counts for a choice when its text is the choice with only whitespace around
    it ("1", " 1", "\n1", "▁1": base.token_label, the rule every backend follows); they add up. A
    choice that is not among them gets 0.0 (its probability is below the last one
    listed); when no choice is listed every value is 0.0 and the runner marks the
    judgment invalid."""
    probs = {c: 0.0 for c in choices}
    for entry in top_logprobs or ():
        token = entry["token"] if isinstance(entry, dict) else entry.token
        logprob = entry["logprob"] if isinstance(entry, dict) else entry.logprob
        key = token_label(token, choices)
        if key is not None and logprob is not None and math.isfinite(logprob):
            probs[key] += math.exp(logprob)
    return {c: min(1.0, p) for c, p in probs.items()}


def _progress(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="req", leave=False, disable=not enabled or total < 2)


@register_backend("openai")
class OpenAIBackend(Backend):
    name = "openai"

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key_env: str = DEFAULT_API_KEY_ENV,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        server_kind: str = "auto",
        max_retries: int = DEFAULT_MAX_RETRIES,
        timeout: float = DEFAULT_TIMEOUT_S,
        top_logprobs: int = MAX_TOP_LOGPROBS,
        extra_body: dict | None = None,
        show_progress: bool = True,
        batch_size: int | None = None,  # accepted for a uniform CLI; concurrency is what bounds load here
    ):
        try:
            import openai
        except ImportError:  # pragma: no cover - openai is a core dependency
            raise BackendError("the openai backend needs the openai client: pip install openai") from None
        self.model_id = model
        # for run.json: a server does not report the dtype it computes in (vLLM: its --dtype)
        self.computed: dict = {"backend": self.name, "dtype": "the server's (not reported over HTTP)"}
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or OPENAI_DEFAULT_BASE_URL
        self.shown_url = redact(self.base_url)  # what messages print: no credentials
        if server_kind not in SERVER_KINDS:
            raise BackendError(f"server_kind must be one of {SERVER_KINDS}, got {server_kind!r}")
        if int(max_concurrency) < 0:
            raise BackendError(f"max_concurrency must be >= 1 (or 0: by server kind), got {max_concurrency}")
        self.server_kind = server_kind
        self.timeout = float(timeout)
        self._max_concurrency = int(max_concurrency)
        self.top_logprobs = max(1, int(top_logprobs))
        self.extra_body = dict(extra_body or {})
        self.show_progress = show_progress
        self._api_key = resolve_api_key(api_key_env, self.base_url)
        self.client = openai.OpenAI(
            base_url=self.base_url,
            api_key=self._api_key,
            max_retries=max(0, int(max_retries)),
            timeout=timeout,
        )

    @property
    def max_concurrency(self) -> int:
        """Requests in flight: as set, else by server kind (asked of the server once, when
        `server_kind` is "auto", and said on stderr)."""
        if not self._max_concurrency:
            kind, why = self.server_kind, "server_kind"
            if kind == "auto":
                kind, why = detect_server_kind(self.client, self.timeout)
                self.server_kind = kind
            self._max_concurrency = SERVER_CONCURRENCY[kind]
            print(f"openai backend: {self.shown_url} is {kind!r} ({why}): {self._max_concurrency} request(s) in "
                  "flight (set max_concurrency or server_kind in --backend_args to change)", file=sys.stderr)
        return self._max_concurrency

    # ------------------------------------------------------------------ requests

    def _create(self, conversation: Conversation, **params):
        """A chat completion; a raw prompt (base.raw_prompt) goes to /completions as text."""
        text = raw_prompt(conversation)
        kwargs: dict[str, Any] = {"model": self.model_id, **params}
        if self.extra_body:
            kwargs.setdefault("extra_body", self.extra_body)
        if text is not None:
            if kwargs.pop("logprobs", False):  # /completions: logprobs = how many top tokens
                kwargs["logprobs"] = kwargs.pop("top_logprobs", 1)
            return self.client.completions.create(prompt=text, **kwargs)
        return self.client.chat.completions.create(messages=conversation, **kwargs)

    def _map(self, fn: Callable[[Conversation], Any], conversations: Sequence[Conversation], desc: str,
             on_result: Callable[[int, Any], None] | None = None) -> list:
        """fn over conversations on at most max_concurrency threads, results in input order;
        `on_result(index, result)` is called in this thread as each request finishes."""
        results: list[Any] = [None] * len(conversations)
        if not conversations:
            return results
        width = min(self.max_concurrency, len(conversations))
        todo = iter(enumerate(conversations))
        pool = ThreadPoolExecutor(max_workers=width)
        futures: dict[Any, int] = {}

        def submit_next() -> None:
            # Submitted one by one as others finish: after a failure nothing new starts.
            nxt = next(todo, None)
            if nxt is not None:
                futures[pool.submit(fn, nxt[1])] = nxt[0]

        try:
            for _ in range(width):
                submit_next()
            with _progress(len(conversations), desc, self.show_progress) as bar:
                while futures:
                    done, _ = wait(list(futures), return_when=FIRST_EXCEPTION)
                    for fut in done:
                        idx = futures.pop(fut)
                        exc = fut.exception()
                        if exc is not None:
                            raise self._error(exc) from exc
                        results[idx] = fut.result()
                        if on_result is not None:
                            on_result(idx, results[idx])
                        bar.update(1)
                        submit_next()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return results

    def _error(self, exc: BaseException) -> BackendError:
        if isinstance(exc, BackendError):
            return exc
        status = getattr(exc, "status_code", None)
        what = f"HTTP {status}: " if status else ""
        text = f"({type(exc).__name__}: {what}{exc})"
        return BackendError(
            f"model {self.model_id!r} at {self.shown_url}: request failed after retries "
            + redact(text, secrets=[self._api_key if self._api_key != LOCAL_DUMMY_KEY else None])
        )

    # ------------------------------------------------------------------ protocol

    supports_on_result = True  # the runner stores each finished request at once

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig,
                 on_result: Callable[[int, str], None] | None = None) -> list[str]:
        params: dict[str, Any] = {"max_tokens": config.max_new_tokens}
        if config.temperature is not None:  # None: the server's / model's default sampling
            params["temperature"] = config.temperature
            if config.temperature > 0:
                params["top_p"] = config.top_p
        if config.seed is not None:
            params["seed"] = config.seed
        if config.ignore_eos:
            # Honoured by vLLM servers (benchmarks); OpenAI itself has no such switch.
            params["extra_body"] = {**self.extra_body, "ignore_eos": True}

        def one(conv: Conversation) -> str:
            resp = self._create(conv, **params)
            if not resp.choices:
                raise BackendError(f"model {self.model_id!r} returned no choices")
            first = resp.choices[0]
            return (first.text if raw_prompt(conv) is not None else first.message.content) or ""

        return self._map(one, conversations, "generate", on_result)

    def choice_probs(self, conversations: Sequence[Conversation], choices: Sequence[str] = ("1", "2"),
                     on_result: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        top = min(self.top_logprobs, MAX_TOP_LOGPROBS)

        def one(conv: Conversation) -> dict[str, float]:
            resp = self._create(conv, temperature=0.0, max_tokens=1, logprobs=True, top_logprobs=top)
            choice = resp.choices[0] if resp.choices else None
            logprobs = getattr(choice, "logprobs", None) if choice else None
            legacy = getattr(logprobs, "top_logprobs", None) if logprobs is not None else None
            if raw_prompt(conv) is not None and legacy:  # /completions: [{token: logprob}] per position
                return choice_probs_from_top_logprobs(
                    [{"token": t, "logprob": lp} for t, lp in (legacy[0] or {}).items()], choices)
            content = getattr(logprobs, "content", None)
            if not content:
                raise BackendError(
                    f"model {self.model_id!r} at {self.shown_url} returned no logprobs; "
                    "logprob mode needs a server/model that supports logprobs (use --mode generate)"
                )
            first = content[0]
            entries = list(first.top_logprobs or [])
            if not entries:  # some servers list only the sampled token
                entries = [first]
            return choice_probs_from_top_logprobs(entries, choices)

        return self._map(one, conversations, "score", on_result)
