"""The backend contract (eval/backends/base.py): every registered backend class follows
it, a class or an injected object that does not is refused with a message naming what it
lacks, and a backend written only from base.py's module docstring runs a DDS evaluation
end to end through `flipguard eval` (registry, runner, context check, records, run.json,
report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flipguard.eval.backends import base
from flipguard.eval.backends.base import Backend, BackendError, ContextTooLong, register_backend
from flipguard.eval.records import EXPECTED_CHOICE, load_records
from flipguard.pipeline.cli import main as cli_main


def test_every_registered_backend_class_follows_the_contract():
    names = base.backend_names()
    assert {"hf", "vllm", "openai"} <= set(names)
    for name in names:
        cls = base._REGISTRY[name]
        assert issubclass(cls, Backend) and not cls.__abstractmethods__, name
        assert cls.name == name
        assert base.check_backend_class(cls) == [], name
    # the HTTP backend stores each finished request at once; the in-process ones per chunk
    assert base._REGISTRY["openai"].supports_on_result is True
    assert base._REGISTRY["hf"].supports_on_result is False


def test_a_class_that_breaks_the_contract_is_refused_at_registration():
    class Half(Backend):  # no choice_probs
        name = "half"

        def generate(self, conversations, config):
            return []

    with pytest.raises(BackendError, match=r"register_backend\('half'\): Half is not a flipguard backend \(abstract "
                                           r"method\(s\) not implemented: \['choice_probs'\]\)"):
        register_backend("half")(Half)

    class Duck:  # the old duck-typed shape: both methods, no Backend base
        name = "duck"

        def generate(self, conversations, config):
            return []

        def choice_probs(self, conversations, choices=("1", "2")):
            return []

    with pytest.raises(BackendError, match="does not subclass flipguard.eval.backends.base.Backend"):
        register_backend("duck")(Duck)

    class WrongType(Duck, Backend):
        supports_on_result = "yes"

    with pytest.raises(BackendError, match="supports_on_result is a str, expected bool"):
        register_backend("wrong")(WrongType)
    assert not {"half", "duck", "wrong"} & set(base.backend_names())


def test_an_injected_object_that_is_not_a_backend_is_refused_before_anything_is_written(tmp_path):
    from flipguard.data.schema import Item
    from flipguard.eval.dds import EvalArgs
    from flipguard.eval.dds.protocol import DDSTask
    from flipguard.eval.task import run_task

    class Duck:
        name, model_id = "duck", "duck"

        def choice_probs(self, conversations, choices=("1", "2")):
            return [{"1": 1.0, "2": 0.0} for _ in conversations]

    items = [Item(id="truthfulqa-0", dataset="truthfulqa", question="Q?", correct_answer="A",
                  incorrect_answer="B")]
    task = DDSTask(EvalArgs(model="m", out=str(tmp_path / "run")), items=items)
    with pytest.raises(BackendError, match=r"the backend given for model 'm': Duck is not a flipguard backend "
                                           r"\(it does not subclass flipguard.eval.backends.base.Backend\); see the module docstring of "
                                           r"flipguard/eval/backends/base.py"):
        run_task(task, tmp_path / "run", backends={"m": Duck()}, progress=False)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- a backend from the docs only

AGREE = {"1": 0.75, "2": 0.125}  # the docs' choice_probs: {label: P(label)}, not renormalised


class AlwaysOneBackend(Backend):
    """Written from base.py's module docstring alone: answers "1" ("yes, correct") to
    every judgment, so a DDS run's records are known in advance from the case."""

    name = "always-one"
    supports_on_result = True
    calls: list[tuple[str, int, bool]] = []  # (method, conversations, given on_result), across instances

    def __init__(self, model: str, max_context: int = 100_000, **kwargs):
        self.model_id = model
        self.max_context = max_context
        self.max_context_source = "the test's max_context"
        self.computed = {"backend": self.name, "words_per_token": 1}

    def prompt_lengths(self, conversations):
        return [sum(len(m["content"].split()) for m in c) for c in conversations]

    def generate(self, conversations, config, on_result=None):
        type(self).calls.append(("generate", len(conversations), on_result is not None))
        out = ['{"chosen_answer": "1", "reasoning": "it reads right"}' for _ in conversations]
        for i, text in enumerate(out):
            if on_result is not None:
                on_result(i, text)
        return out

    def choice_probs(self, conversations, choices=("1", "2"), on_result=None):
        type(self).calls.append(("choice_probs", len(conversations), on_result is not None))
        out = [dict(AGREE) for _ in conversations]
        for i, p in enumerate(out):
            if on_result is not None:
                on_result(i, p)
        return out


@pytest.fixture
def always_one(monkeypatch):
    base.backend_names()  # the built-in backends registered first, then a copy to add to
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register_backend("always-one")(AlwaysOneBackend)
    monkeypatch.setattr(AlwaysOneBackend, "calls", [])
    monkeypatch.delenv("FLIPGUARD_DATA", raising=False)  # the shipped truthfulqa sample
    return AlwaysOneBackend


@pytest.mark.parametrize("mode", ["logprob", "generate"])
def test_a_backend_written_from_the_docs_runs_a_dds_eval_end_to_end(always_one, tmp_path, mode):
    out = tmp_path / mode
    argv = ["eval", "--model", "always-one:judge-7", "--datasets", "truthfulqa", "--limit", "3", "--mode", mode,
            "--out", str(out)]
    assert cli_main(argv) == 0
    records = load_records(out)
    assert len(records) == 12  # 3 items x 4 cases
    assert sorted(r.case for r in records) == sorted(list(EXPECTED_CHOICE) * 3)
    for r in records:
        assert (r.model, r.backend, r.mode, r.valid, r.choice) == ("judge-7", "always-one", mode, True, "1")
        assert r.correct == (r.case in ("c1_true", "c2_correct"))
        if mode == "logprob":
            assert (r.p1, r.p2) == (AGREE["1"], AGREE["2"]) and r.raw_output == "1"
        else:
            assert r.reasoning == "it reads right" and r.p1 is None
    method = "choice_probs" if mode == "logprob" else "generate"
    assert sum(n for m, n, _ in always_one.calls if m == method) == 12
    assert all(given for *_, given in always_one.calls)  # supports_on_result: the runner stores each at once
    meta = json.loads((out / "run.json").read_text())
    assert meta["protocol"] == "dds" and meta["backend"] == "always-one"
    assert meta["computed"] == {"judge-7": {"backend": "always-one", "words_per_token": 1}}
    assert meta["invocations"][-1]["calls_total"] == 12
    # the report reads the records: the model always says "correct", so C1 accuracy is
    # 100% on true statements and 0% on false ones
    import csv

    with open(out / "report" / "summary.csv", newline="") as fh:
        row = next(r for r in csv.DictReader(fh) if r["dataset"] == "truthfulqa")
    assert {k: float(row[k]) for k in ("n", "c1_true", "c1_false", "c2_correct", "c2_incorrect")} == {
        "n": 3, "c1_true": 100.0, "c1_false": 0.0, "c2_correct": 100.0, "c2_incorrect": 0.0}
    summary = json.loads((out / "report" / "summary.json").read_text())["meta"]
    assert (summary["model"], summary["judgments"], summary["invalid_judgments"]) == ("judge-7", 12, 0)

    # a rerun asks the backend nothing
    always_one.calls.clear()
    assert cli_main(argv) == 0
    assert always_one.calls == [] and len(load_records(out)) == 12


def test_the_declared_context_limit_refuses_an_oversized_item_before_anything_is_written(always_one, tmp_path):
    out = tmp_path / "run"
    argv = ["eval", "--model", "always-one:judge-7", "--datasets", "truthfulqa", "--limit", "2",
            "--backend_args", '{"max_context": 20}', "--out", str(out)]
    with pytest.raises(ContextTooLong, match=r"item 'truthfulqa-\S+' \(truthfulqa, c\d_\w+\): the prompt is [\d,]+ "
                                             r"tokens, more than judge-7 takes \(20 tokens, the test's "
                                             r"max_context\)"):
        from flipguard.eval.dds.protocol import DDSTask

        DDSTask.main(argv[1:])
    assert always_one.calls == [] and not out.exists()


# ---------------------------------------------------------------- a backend from an installed package

ECHO_BACKEND = '''
from flipguard.eval.backends.base import Backend, register_backend


@register_backend("echo")
class EchoBackend(Backend):
    name = "echo"

    def __init__(self, model, **kwargs):
        self.model_id = model

    def generate(self, conversations, config):
        return ['{"chosen_answer": "1", "reasoning": "..."}' for _ in conversations]

    def choice_probs(self, conversations, choices=("1", "2")):
        return [{c: 1.0 / len(choices) for c in choices} for _ in conversations]
'''


def test_an_installed_packages_backend_is_found_through_its_entry_point(tmp_path):
    """A package declares `echo = "echo_backend"` in the 'flipguard.backends' group, as
    pyproject.toml declares hf, vllm and openai: a fresh `python -m flipguard` finds it with no
    --include (the distribution's metadata on sys.path is how pip installs one)."""
    site = tmp_path / "site"
    (site / "echo_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "echo_plugin-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-plugin\nVersion: 0.1\n")
    (site / "echo_plugin-0.1.dist-info" / "entry_points.txt").write_text("[flipguard.backends]\necho = echo_backend\n")
    (site / "echo_backend.py").write_text(ECHO_BACKEND)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    env.pop("FLIPGUARD_DATA", None)
    proc = subprocess.run([sys.executable, "-m", "flipguard", "eval", "--model", "echo:echo-7", "--datasets", "truthfulqa",
                           "--limit", "2", "--mode", "generate", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = load_records(out)
    assert len(records) == 8 and {(r.backend, r.model, r.choice, r.valid) for r in records} == {("echo", "echo-7", "1", True)}
    assert json.loads((out / "run.json").read_text())["backend"] == "echo"


def test_a_stale_install_without_flipguards_entry_points_says_to_reinstall():
    from flipguard import plugins
    from flipguard.errors import UserError

    with pytest.raises(UserError, match=r"'flipguard.no-such-group' entry points are not installed.*pip install -e \."):
        plugins.plugins("flipguard.no-such-group")
