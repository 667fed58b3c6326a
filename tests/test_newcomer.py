"""What a newcomer can trust, each checked in real `flipguard` processes started from a scratch folder:
a run folder holds one run (another invocation's settings, or another kind of output, is one line and
nothing written); each shared word has one form in every command (comma lists, [label=], real help for
every --no_x, usage lines as the README types them, errors naming where a value came from, old words
named with the word to use in flags, recipes and run configs); a model path that is not there is one
line with no folder left behind, and a run of the random-init default says first that its numbers are
noise."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def flipguard(tmp_path, tiny_model_path):
    """`flipguard ARGS...` as a process in an empty folder, the session's tiny model in a fresh FLIPGUARD_HOME."""
    from flipguard.eval.embedded.tiny_model import TINY_MODEL_VERSION

    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (home / f"tiny-chat-{TINY_MODEL_VERSION}").symlink_to(Path(tiny_model_path))
    env = {**os.environ, "FLIPGUARD_HOME": str(home), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flipguard", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=1800)

    run.work = work
    return run


def _one_line(done: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, one line on stderr holding every needle, no traceback."""
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` but the writer's lock (which a refused writer takes and lets go), with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != ".lock"}


# ------------------------------------------------------------------ one run per folder

def test_a_run_folder_holds_one_run_and_a_folder_one_kind_of_output(flipguard):
    work = flipguard.work
    tiny = ["--min_label_mass", "0"]
    done = flipguard("eval", "--limit", "2", *tiny, "--out", "runs/m/baseline")
    assert done.returncode == 0, done.stderr[-3000:]
    run = work / "runs" / "m" / "baseline"
    before = _files(run)
    # another invocation's items into the same folder: refused, naming each setting, nothing changed
    _one_line(flipguard("eval", "--datasets", "bbq", "--limit", "1", *tiny, "--out", "runs/m/baseline"),
              f"{Path('runs/m/baseline/run.json')}: this run directory holds another condition", "limit: 2 there, 1 now",
              "datasets: ", "['bbq'] now", "use another --out, or leave it out")
    assert _files(run) == before
    # the same settings again: the same run, resumed (nothing to ask)
    again = flipguard("eval", "--limit", "2", *tiny, "--out", "runs/m/baseline")
    assert again.returncode == 0 and "0 to run" in again.stdout, again.stderr[-3000:]

    # one folder, one kind: a run's folder takes no study or comparison, a comparison's folder no run or study
    _one_line(flipguard("study", "tiny", "--out", "runs/m/baseline"),
              "--out runs/m/baseline: holds a flipguard run (run.json", "a study goes in a folder of its own")
    _one_line(flipguard("compare", "--runs", "runs/m/baseline", "--out", "runs/m/baseline"),
              "--out runs/m/baseline: holds a flipguard run (run.json", "a comparison goes in a folder of its own")
    assert _files(run) == _files(run) and sorted(p.name for p in run.iterdir() if p.name != ".lock") == sorted(
        {Path(k).parts[0] for k in before})
    compared = flipguard("compare", "--runs", "runs/m/baseline", "--n_boot", "50", "--out", "mydocs")
    assert compared.returncode == 0, compared.stderr[-3000:]
    written = _files(work / "mydocs")
    _one_line(flipguard("eval", "--limit", "1", *tiny, "--out", "mydocs"),
              "--out mydocs: holds a flipguard comparison (comparison.json", "a run goes in a folder of its own")
    _one_line(flipguard("study", "tiny", "--out", "mydocs"), "holds a flipguard comparison", "a study goes in")
    assert _files(work / "mydocs") == written


# ------------------------------------------------------------------ one form per shared word

def test_each_shared_word_has_one_form_in_every_command(flipguard):
    # a comma list of subjects, in afr as in sos (afr read it as one subject named 'anatomy,astronomy')
    done = flipguard("afr", "--subjects", "anatomy,astronomy", "--per_subject", "1", "--limit", "2", "--n_boot", "10",
                     "--k_values", "1", "--no_cross", "--coercion_max_new_tokens", "4", "--answer_mode", "logprob",
                     "--out", "runs/afr")
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((flipguard.work / "runs" / "afr" / "run.json").read_text())
    assert meta["settings"]["subjects"] == ["anatomy", "astronomy"]
    items = {json.loads(line)["item_id"] for line in (flipguard.work / "runs" / "afr" / "records.jsonl").open()}
    assert {s for s in ("anatomy", "astronomy") for i in items if f"-{s}-" in i} == {"anatomy", "astronomy"}, items

    helps = {command: flipguard(*command.split(), "--help").stdout for command in
             ("eval", "afr", "sos", "study", "compare", "view", "export", "report", "convert", "demo", "pairs")}
    for command, text in helps.items():
        assert text.startswith(f"usage: flipguard {command}"), (command, text[:200])
        # one label syntax
        assert "[name=]" not in text and "{name," not in text, command
        # every --no_x has help of its own, never --x's
        for no in re.findall(r"^  (--no_\w+)", text, re.M):
            block = text.split(f"  {no}", 1)[1].split("\n  --", 1)[0]
            assert f"Turns --{no[5:]} off: the same as --{no[5:]} false." in " ".join(block.split()), (command, no)
    assert "[label=]" in helps["afr"] and "[label=]" in helps["eval"] and "[label=]" in helps["sos"]
    # word lists are comma lists in every command that takes them
    assert "--subjects SUBJECTS[,SUBJECTS ...]" in helps["afr"] and "--mitigations MITIGATIONS[,MITIGATIONS ...]" in \
        helps["sos"]
    # the usage line is how the README types the command: the folder first, no required --path / --run
    for command, positional in (("view", "PATH"), ("export", "RUN"), ("report", "RUN_DIR")):
        usage = helps[command].split("\n\n", 1)[0]
        assert re.search(rf"\] {positional}\b", usage) and f"--{positional.lower()} {positional}" not in usage, usage
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "flipguard view runs/m/compare --out page.html" in readme and "flipguard report runs/m/be_honest" in readme


def test_errors_name_where_the_value_came_from_and_old_words_the_word_to_use(flipguard):
    work = flipguard.work
    # a mistake on the study's command line is the command line's, not the shipped recipe's
    for args, says in ((["--limt", "2"], "unknown option --limt; did you mean --limit?"),
                       (["--limit", "-2"], "command line: option --limit must be >= 1, got -2")):
        err = _one_line(flipguard("study", "tiny", *args, "--out", "s"), says)
        assert "tiny.yaml" not in err, err
    # an old word inside a recipe's eval: section, or the commands' `model` in a recipe: the key to use, file:line
    for text, says in (("eval:\n  n_items: 2\n", "recipe.yaml:4: 'n_items' is an old word, not read: the key is 'limit'"),
                       ("eval:\n  models: [a]\n", "recipe.yaml:4: 'models' is not read in section 'eval': a recipe "
                                                  "names its model at the top level as 'model_name_or_path'"),
                       ("eval:\n  dataset: bbq\n", "'dataset' is an old word, not read: the key is 'datasets'")):
        (work / "recipe.yaml").write_text("model_name_or_path: flipguard:tiny\nsft: {max_steps: 1}\n" + text)
        _one_line(flipguard("study", "recipe.yaml", "--out", "s"), says)
    # ... and in a run config: AFR's model mapping names its label as a spec does
    (work / "afr.yaml").write_text("model:\n  - {name: a, model: 'flipguard:tiny'}\n")
    _one_line(flipguard("afr", "afr.yaml"), "'name' is an old word, not read: the key is 'label'")
    assert sorted(p.name for p in work.iterdir()) == ["afr.yaml", "recipe.yaml"]  # nothing run, nothing written


# ------------------------------------------------------------------ clear failures, and the noise said first

def test_a_missing_local_model_is_one_line_and_leaves_no_folder(flipguard):
    for args in (["eval", "--model", "/nonexistent/model", "--limit", "1"],
                 ["sos", "--model", "./no-such-model", "--limit", "1"],
                 ["afr", "--model", "mine=/nonexistent/model", "--limit", "1"],
                 ["study", "tiny", "--model", "/nonexistent/model"]):
        err = _one_line(flipguard(*args), "no such folder or file")
        assert "Repo id" not in err, err
        assert list(flipguard.work.iterdir()) == [], args  # no run folder, no runs/ parents, no study folder


def test_a_run_of_the_random_init_default_says_first_that_its_numbers_are_noise(flipguard):
    from flipguard.eval.embedded.tiny_model import SMOKE_TEST_LINE

    done = flipguard("eval", "--limit", "1", "--out", "runs/smoke")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == SMOKE_TEST_LINE
    organism = flipguard("eval", "--model", "flipguard:organism", "--datasets", "organism", "--limit", "1", "--out",
                         "runs/organism")
    assert organism.returncode == 0 and SMOKE_TEST_LINE not in organism.stdout, organism.stderr[-3000:]
