"""Shared fixtures: one tiny local chat model per test session, built offline."""

from __future__ import annotations

import os
import pathlib

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("FLIPGUARD_TEST_INSTALLED"):  # .ci/run's wheel step: these tests must read the installed wheel
    import flipguard

    assert "site-packages" in pathlib.Path(flipguard.__file__).parts, f"flipguard from {flipguard.__file__}, not the wheel"


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml's addopts): a worker per core this process may use, at most 4 (each
    worker holds torch and the session's models; many tests start processes of their own)."""
    from flipguard.runtime.threads import usable_cores

    return max(1, min(4, usable_cores()))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    from flipguard.eval.embedded.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat")


@pytest.fixture(scope="session")
def organism_path() -> "pathlib.Path":
    """The planted-bias organism with its default settings: the shipped one (package data,
    eval/embedded/organism_model), the bytes the demo and README command 1 load."""
    from pathlib import Path

    from flipguard.eval.embedded.organism import shipped_organism

    return Path(shipped_organism())


@pytest.fixture(scope="session")
def openai_server(tmp_path_factory):
    """A real OpenAI-compatible server (`transformers serve`, tests/served.py) on 127.0.0.1,
    started once per session; it serves any local model by path. Tests that kill it start
    it again before they end, so later tests find it up."""
    from served import TransformersServer

    server = TransformersServer(tmp_path_factory.mktemp("openai-server"))
    server.start()
    yield server
    server.stop()
