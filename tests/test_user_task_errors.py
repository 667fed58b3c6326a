"""A user's task that hands the runner malformed batches, or exits while being imported, gets one
line naming its file, exit 2, and nothing written: real processes, `flipguard run
--include FILE`, on a subclass of the tests' "Are you sure?" task that breaks one thing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE_TASK = ROOT / "examples" / "are_you_sure_task.py"

BROKEN = {
    "first_batches_none": "def first_batches(self):\n    return None",
    "batch_is_a_list": "def first_batches(self):\n    return [[r for b in super().first_batches() for r in b.records]]",
    "records_are_dicts": ("def first_batches(self):\n    (b,) = super().first_batches()\n"
                          "    return [Batch([r.to_dict() for r in b.records], b.model)]"),
    "messages_are_strings": ("def first_batches(self):\n    (b,) = super().first_batches()\n"
                             "    for r in b.records:\n        r.messages = r.messages[0]['content']\n    return [b]"),
    "solve_yields_none": "def solve(self):\n    yield None",
    # each of these could end in a traceback (and a left .lock), an exit 0 having run nothing, or a hang
    "messages_none": ("def first_batches(self):\n    (b,) = super().first_batches()\n"
                      "    for r in b.records:\n        r.messages = None\n    return [b]"),
    "choices_an_int": ("def first_batches(self):\n    (b,) = super().first_batches()\n"
                       "    b.choices = 5\n    return [b]"),
    "chunk_size_zero": ("def first_batches(self):\n    (b,) = super().first_batches()\n"
                        "    b.chunk_size = 0\n    return [b]"),
    "solve_returns_a_list": "def solve(self):\n    return self.first_batches()",
    "same_batch_forever": ("def solve(self):\n    (first,) = self.first_batches()\n"
                           "    while True:\n        yield first"),
    # a generate-mode batch with no parser (or a gen_config or parser of the wrong type): a traceback from the runner
    "generate_without_parser": ("def first_batches(self):\n    (b,) = super().first_batches()\n"
                                "    for r in b.records:\n        r.mode = 'generate'\n    return [b]"),
    "gen_config_a_string": ("def first_batches(self):\n    (b,) = super().first_batches()\n"
                            "    b.gen_config = 'max_new_tokens=8'\n    return [b]"),
    "parse_not_a_function": ("def first_batches(self):\n    (b,) = super().first_batches()\n"
                             "    b.parse = 'json'\n    return [b]"),
}
PROBLEM = {
    "first_batches_none": "first_batches() returned a NoneType, not a list of Batches",
    "batch_is_a_list": "first_batches() gave a list where a flipguard.eval.task.Batch belongs",
    "records_are_dicts": "first_batches() gave a dict where a Record belongs",
    "messages_are_strings": "messages must be a non-empty list, got str",
    "solve_yields_none": "solve() gave a NoneType where a flipguard.eval.task.Batch belongs",
    "messages_none": "messages must be a non-empty list, got NoneType",
    "choices_an_int": "Batch.choices 5; it must be a list of two or more answer labels",
    "chunk_size_zero": "Batch.chunk_size 0; it must be an integer >= 1",
    "solve_returns_a_list": "solve() returned a list, not a generator",
    "same_batch_forever": "solve() yielded the same batch 101 times in a row",
    "generate_without_parser": "generate-mode records with no Batch.parse; a generated reply needs a parser",
    "gen_config_a_string": "Batch.gen_config 'max_new_tokens=8' (a str); it must be a",
    "parse_not_a_function": "Batch.parse 'json', which is not a function",
}


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT.parent}{os.pathsep}{BASE_TASK.parent}", "TQDM_DISABLE": "1",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_malformed_batch_is_one_line_naming_the_task_file(tmp_path, tiny_model_path, broken):
    task_file = tmp_path / f"{broken}.py"
    task_file.write_text(textwrap.dedent("""\
        from are_you_sure_task import AreYouSure
        from flipguard.eval.task import Batch, register_task


        @register_task("broken")
        class Broken(AreYouSure):
        """) + textwrap.indent(BROKEN[broken], "    ") + "\n")
    out = tmp_path / "run"
    done = _run("--include", str(task_file), "broken", "--model", tiny_model_path, "--limit", "2", "--out", str(out),
                cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.strip().splitlines() if "req/s]" not in ln]  # progress of the turns it ran
    assert len(lines) == 1 and lines[0].startswith(f"flipguard run: error: {task_file}: task 'broken': "), done.stderr
    assert PROBLEM[broken] in lines[0]
    if broken == "same_batch_forever":  # refused once it is clear it never advances: the answers so far are kept
        assert (out / "records.jsonl").is_file()
    else:
        assert not out.exists()  # no run.json, no records, no empty folder


def test_a_task_file_that_exits_at_import_is_named(tmp_path):
    task_file = tmp_path / "exits.py"
    task_file.write_text("import sys\nsys.exit(7)\n")
    done = _run("--include", str(task_file), "are-you-sure", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == f"flipguard run: error: --include {task_file}: the file called sys.exit(7) while being imported"
    assert not (tmp_path / "run").exists()
