"""A real OpenAI-compatible server (`transformers serve`) as a subprocess on 127.0.0.1.

Used by tests/conftest.py (one server per pytest session) and bench/serving_concurrency.py.
The server is unpinned, so it serves any local model directory by its path (loaded on
first use and kept loaded). Readiness is polled (GET /health), never slept on; a server
that dies or is not ready within `ready_cap_s` raises with the tail of its log. Each
start writes a new log file, so the requests a restarted server answered are counted
from that server's own access log (uvicorn writes one line per request before the
client has the body)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

READY_CAP_S = 900.0  # upper bound only: a healthy start takes 10-120 s on a loaded 2-core machine
POLL_S = 0.2
CHAT_LINE = re.compile(r'"POST /v1/chat/completions HTTP/1\.1" (\d{3})')


def send_json(handler: BaseHTTPRequestHandler, status: int, payload, headers=None) -> None:
    """One JSON response with its length (the in-process stubs answer only JSON)."""
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.end_headers()
    handler.wfile.write(data)


class StubServer:
    """An in-process stub HTTP server on a free 127.0.0.1 port, served from a daemon thread
    while the `with` block runs (for faults a real server cannot be made to produce)."""

    def _listen(self, handler_class) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """An OpenAI-compatible server as a real subprocess on 127.0.0.1:<free port> (its own
    process group); start() returns once `ready_path` answers 200 (and, when set, holds
    `ready_text`), kill() (SIGKILL), restart(). Subclasses give the command line."""

    name = "server"
    ready_path = "/health"
    ready_text: str | None = None

    def __init__(self, log_dir: str | os.PathLike, port: int | None = None, ready_cap_s: float = READY_CAP_S,
                 env: dict[str, str] | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.ready_cap_s = ready_cap_s
        self.env = env or {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log_path: Path | None = None
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> "ServerProcess":
        assert self.proc is None or self.proc.poll() is not None, "server already running"
        self.starts += 1
        self.log_path = self.log_dir / f"server-{self.starts}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env={**self.env, "PYTHONUNBUFFERED": "1"},
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.wait_ready()
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def wait_ready(self) -> float:
        """Poll `ready_path` until it answers 200; returns the seconds it took."""
        t0 = time.monotonic()
        url = f"http://127.0.0.1:{self.port}{self.ready_path}"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready; "
                                   f"its log ({self.log_path}):\n{self.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    if resp.status == 200 and (self.ready_text is None or self.ready_text in resp.read().decode()):
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - t0 > self.ready_cap_s:
                self.kill()
                raise RuntimeError(f"{self.name} not ready after {self.ready_cap_s:.0f} s; "
                                   f"its log ({self.log_path}):\n{self.log_text()[-4000:]}")
            time.sleep(POLL_S)  # a poll interval, not a synchronisation point

    def kill(self) -> None:
        """SIGKILL to the server's process group, as a crash or an OOM kill would: no
        shutdown handlers run (vLLM's engine core is a child process)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> "ServerProcess":
        self.kill()
        return self.start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def chat_requests(self, status: str | None = None) -> list[str]:
        """Status codes of the chat requests this server process answered (its access log)."""
        codes = CHAT_LINE.findall(self.log_text())
        return [c for c in codes if status is None or c == status]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class TransformersServer(ServerProcess):
    """`transformers serve`, unpinned: it serves any local model directory by its path."""

    name = "transformers serve"
    ready_path = "/health"

    def __init__(self, log_dir: str | os.PathLike, port: int | None = None, extra_args: tuple[str, ...] = (),
                 ready_cap_s: float = READY_CAP_S):
        super().__init__(log_dir, port, ready_cap_s)
        self.extra_args = tuple(extra_args)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "transformers.cli.transformers", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--device", "cpu", "--log-level", "info",
                "--model-timeout", "86400", *self.extra_args]
