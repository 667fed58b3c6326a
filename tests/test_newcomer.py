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
from test_view import Page, browser  # noqa: F401  (the page in the system's headless chromium)

ROOT = Path(__file__).resolve().parent.parent


def _scratch(tmp_path: Path, tiny_model_path) -> tuple[Path, Path]:
    """(an empty work folder, a fresh FLIPGUARD_HOME holding the session's tiny model)."""
    from flipguard.eval.embedded.tiny_model import TINY_MODEL_VERSION

    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (home / f"tiny-chat-{TINY_MODEL_VERSION}").symlink_to(Path(tiny_model_path))
    return work, home


@pytest.fixture()
def flipguard(tmp_path, tiny_model_path):
    """`flipguard ARGS...` as a process in an empty folder, the session's tiny model in a fresh FLIPGUARD_HOME."""
    work, home = _scratch(tmp_path, tiny_model_path)
    env = {**os.environ, "FLIPGUARD_HOME": str(home), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flipguard", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=1800)

    run.work = work
    return run


def _one_line(done: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, one line on stderr holding every needle, no traceback, nothing on stdout (no note before it)."""
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert done.stdout.strip() == "", done.stdout[-2000:]
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
    # ... and a run config or a recipe goes first, as the README gives it (flipguard afr afr_tiny, flipguard pairs qwen7b)
    for command, lead in (("afr", "[RUN_CONFIG]"), ("sos", "[RUN_CONFIG]"), ("eval", "[RUN_CONFIG]"),
                          ("study", "RECIPE"), ("pairs", "RECIPE")):
        assert helps[command].startswith(f"usage: flipguard {command} {lead} "), helps[command][:200]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "flipguard view runs/m/compare --out page.html" in readme and "flipguard report runs/m/be_honest" in readme
    assert "flipguard afr afr_tiny --model" in readme and "flipguard pairs qwen7b --records" in readme


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
                 ["study", "tiny", "--model", "/nonexistent/model"],
                 ["organism", "--base", "/nonexistent/model"]):
        err = _one_line(flipguard(*args), "no such folder or file")
        assert "Repo id" not in err, err
        assert list(flipguard.work.iterdir()) == [], args  # no run folder, no runs/ parents, no study folder


def test_a_run_of_the_random_init_default_says_first_that_its_numbers_are_noise(flipguard):
    from flipguard.eval.task import SMOKE_TEST_LINE

    done = flipguard("eval", "--limit", "1", "--out", "runs/smoke")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == SMOKE_TEST_LINE
    organism = flipguard("eval", "--model", "flipguard:organism", "--datasets", "organism", "--limit", "1", "--out",
                         "runs/organism")
    assert organism.returncode == 0 and SMOKE_TEST_LINE not in organism.stdout, organism.stderr[-3000:]


# ------------------------------------------------------------------ on a terminal: short, with progress, as the files say

def on_a_terminal(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, list[str]]:
    """`flipguard ARGS` as a user runs it, on a terminal (a pseudo-terminal): (exit code, every byte it wrote,
    the screen it leaves: each line as its last carriage return and erase left it)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "flipguard", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the process closed the terminal (EIO)
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    proc.wait(timeout=60)
    raw = b"".join(chunks).decode("utf-8", "replace")
    screen = [line.split("\r")[-1].replace("\x1b[K", "") for line in raw.replace("\r\n", "\n").split("\n")]
    while screen and not screen[-1].strip():
        screen.pop()
    return proc.returncode, raw, screen


def live_states(raw: str) -> list[str]:
    """What the live line said while stages ran, in order."""
    return [seg.replace("\x1b[K", "").strip() for seg in re.split(r"[\r\n]", raw) if "running:" in seg]


def terminal_table(screen: list[str], header: str) -> dict[str, list[str]]:
    """The rows of the terminal table under the line starting `header`: condition -> its cells."""
    start = next(i for i, line in enumerate(screen) if line.startswith(header))
    rows = {}
    for line in screen[start + 1:]:
        if not line.strip():
            break
        if set(line.strip()) <= set("-─ "):  # a rule under the header, where the table has one
            continue
        rows[line[:14].strip()] = line[14:].split()
    return rows


@pytest.fixture()
def terminal_env(tmp_path, tiny_model_path):
    """A scratch folder and an environment as a user's (progress bars on), the session's tiny model in FLIPGUARD_HOME."""
    work, home = _scratch(tmp_path, tiny_model_path)
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    env.update(FLIPGUARD_HOME=str(home), OMP_NUM_THREADS="1", COLUMNS="160", LINES="50")
    return work, env


@pytest.mark.slow
def test_a_study_on_a_terminal_fits_a_screen_shows_progress_and_says_what_its_files_say(terminal_env, browser):  # noqa: F811
    
    work, env = terminal_env
    code, raw, screen = on_a_terminal(["study", "tiny", "--out", "study"], work, env)
    assert code == 0, raw[-3000:]
    out = work / "study"
    order = json.loads((out / "study.json").read_text())["order"]
    # a screen or two: a line per stage, the tables, the artefacts; each stage's output is in its log
    assert len(screen) <= 60, "\n".join(screen)
    assert "Loading weights" not in raw and "{'loss'" not in raw
    for name in order:
        assert f"--- {name}: run in " in "\n".join(screen), name
        assert (out / "logs" / f"{name}.log").is_file(), name
    assert "adapter saved to" in (out / "logs" / "sft.log").read_text()
    assert "DDS report: flipguard:tiny" in (out / "logs" / "baseline.log").read_text()  # the report's own table
    # progress while the stages ran: the live line named each running stage, its time and its bar's state
    states = live_states(raw)
    assert any(re.search(r"running: \S+ \d+s \(.*\d+% [\d.]+/[\d.]+\)", s) for s in states), states[-5:]
    before_its_end = raw[:raw.index("--- baseline: run in")]  # while the baseline ran, the live line said so
    assert re.search(r"running: [^\r\n]*\bbaseline \d+s", before_its_end), live_states(before_its_end)[-3:]

    # the terminal's table is comparison.csv's, cell for cell as the page shows it: n/m where the file says not
    # meaningful, a flag only where the file sets one, never nan
    table = terminal_table(screen, "condition      C1 true")
    rows = [r for r in csv_rows(out / "compare" / "comparison.csv") if r["dataset"] == "total_avg"]
    assert list(table) == [r["condition"] for r in rows]
    assert not re.search(r"\bnan\b", "\n".join(screen))
    page = Page(browser, out / "view.html")
    try:
        for r in rows:
            cells = table[r["condition"]]
            key = f"{r['condition']}|total_avg"
            shown = [page.cell("comparison", key, col).text_content() for col in
                     ("own_c1_true", "own_c1_false", "c2_correct", "c2_incorrect", "dds", "own_dds", "invalid_judgments")]
            assert cells[:7] == shown, (r["condition"], cells, shown)
            if r["meaningful"] == "False":
                assert cells[4] == cells[5] == "n/m" and r["dds"] == ""
            flags = " ".join(cells[7:])
            assert ("†" in flags) == (r["over_correction"] == "True") == ("†" in page.cell("comparison", key, "flags")
                                                                           .text_content())
            assert ("‡" in flags) == (r["c1_damage"] == "True")
    finally:
        page.close()


def csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


# ------------------------------------------------------------------ a grid answers per variant

def _grid_recipe(work: Path) -> Path:
    """The tiny recipe, short: SFT and DPO, two steps each, two items per dataset, Be Honest."""
    import yaml

    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw.pop("kto")
    raw["report_to"] = "none"
    raw["sft"]["max_steps"] = raw["dpo"]["max_steps"] = 2
    raw["eval"].update(limit=2, n_boot=50, mitigations=["be_honest"])
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _markdown_table(path: Path) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    split = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in lines]
    return split[0], split[1:]


@pytest.mark.slow
def test_a_grid_answers_per_variant_never_from_an_older_comparison(flipguard, browser):  # noqa: F811
    from PIL import Image

    from flipguard.eval.plots import TEXTS_KEY
    from flipguard.pipeline.grid import POINT_LABEL

    work = flipguard.work
    recipe = _grid_recipe(work)
    # a plain study first, into the folder the grid then uses: its comparison is not the grid's answer
    plain = flipguard("study", str(recipe), "--out", "study")
    assert plain.returncode == 0, plain.stderr[-3000:]
    grid = ["study", str(recipe), "--grid", "dpo.beta=0.1,0.5", "--out", "study"]
    done = flipguard(*grid)
    assert done.returncode == 0, done.stderr[-3000:]
    out = work / "study"
    printed = done.stdout
    # the terminal: one answer line per trained model, its trainer and values named; no before/after table of
    # the plain study's comparison (made before the grid retrained), no nan
    answer = printed.split("The answer, per variant", 1)[1].split("\n\n", 1)[0]
    for label in ("SFT: ", "DPO (dpo.beta=0.1): ", "DPO (dpo.beta=0.5): ", "Be Honest: "):
        assert f"\n  {label}" in answer, (label, answer)
    assert "\n  DPO: " not in answer and "Before/after (all datasets" not in printed
    assert not re.search(r"\bnan\b", printed)
    head, body = _markdown_table(out / "grid" / "variants.md")
    table = printed.split("Recipe grid (", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert len(table) == len(body) + 1 and table[0].split()[:2] == ["variant", "trainer"]
    for line, cells in zip(table[1:], body):  # variants.md's cells: removal, damage as it has them ('–', never nan)
        assert line.startswith(cells[0]) and all(f"  {c}" in line for c in (cells[1], cells[2], cells[3])), (line, cells)

    # the page: the same lines, the table as variants.md has it, the chart's labels inside its frame, apart
    page = Page(browser, out / "view.html")
    try:
        verdicts = {li.get_attribute("data-condition"): li.locator("p.verdict").text_content()
                    for li in page.page.locator("#answer-verdicts > li").all()}
        assert set(verdicts) == {"Be Honest", "SFT", "DPO (dpo.beta=0.1)", "DPO (dpo.beta=0.5)"}, verdicts
        for text in verdicts.values():
            assert f"\n  {text}" in answer  # the terminal's line is the page's
        assert [h.text_content() for h in page.page.locator("#table-grid thead th").all()] == head
        assert "dds.before" not in page.page.locator("#grid").text_content()
        for cells in body:
            row = page.page.locator(f"#table-grid tr[data-row=\"{cells[0]}|{cells[1]}\"] td")
            assert [c.text_content() for c in row.all()] == cells
    finally:
        page.close()
    meta = json.loads(Image.open(out / "grid" / "variants.png").info[TEXTS_KEY])
    (x0, y0, x1, y1), = meta["axes"]
    points = [t for t in meta["texts"] if t.get("gid") == POINT_LABEL]
    assert sorted(int(n) for t in points for n in t["text"].split(", ")) == list(range(1, len(body) + 1)), points
    labels = [t["box"] for t in points]
    for i, (a0, b0, a1, b1) in enumerate(labels):
        assert x0 < a0 and a1 < x1 and y0 < b0 and b1 < y1, (labels[i], meta["axes"])  # inside, off the frame
        for c0, d0, c1, d1 in labels[i + 1:]:
            assert a1 <= c0 or c1 <= a0 or b1 <= d0 or d1 <= b0, labels  # never on each other

    # one variant's DPO retrained alone: its comparison is now older than what it summarises; said, not shown
    again = flipguard(*grid, "--only", "dpo.beta=0.1:dpo")
    assert again.returncode == 0, again.stderr[-3000:]
    answer = again.stdout.split("The answer, per variant", 1)[1].split("\n\n", 1)[0]
    assert "\n  DPO (dpo.beta=0.1): its comparison" in answer and "older than the stages it summarises" in answer
    assert "\n  DPO (dpo.beta=0.5): " in answer
    viewed = flipguard("view", "study")
    assert viewed.returncode == 0, viewed.stderr[-3000:]
    page = Page(browser, out / "view.html")
    try:
        conditions = [li.get_attribute("data-condition") for li in page.page.locator("#answer-verdicts > li").all()]
        assert "DPO (dpo.beta=0.1)" not in conditions and "DPO (dpo.beta=0.5)" in conditions
        assert "older than the stages it summarises" in page.page.locator("#answer").text_content()
    finally:
        page.close()


@pytest.mark.parametrize("points", [
    [(0.0, 44.0), (0.0, 44.0), (0.0, 44.0)],                       # three models at one spot (the organism's DPO betas)
    [(float("nan"), float("nan")), (0.0, float("nan")), (3.0, float("nan"))],  # removal not meaningful (tiny)
    [(0.0, 0.0), (60.0, -10.0), (0.1, 44.0), (0.2, 43.5), (0.3, 43.0), (59.0, -9.0)],  # crowded corners
])
def test_the_grid_chart_fits_its_points_and_its_labels_sit_apart_inside_the_frame(tmp_path, points):
    """The removed-vs-damaged chart as the grid stage draws it (the PNG lists each text's box and the frame): every
    point inside the axes (not on the frame), every model numbered once, no label on the frame or on another."""
    import pandas as pd
    from PIL import Image

    from flipguard.eval.plots import TEXTS_KEY
    from flipguard.pipeline.grid import POINT_LABEL, plot_tradeoff

    frame = pd.DataFrame([("DPO", f"dpo.beta={k}", x, y) for k, (x, y) in enumerate(points)],
                         columns=["trainer", "variant", "damage", "removal"])
    path = tmp_path / "variants.png"
    plot_tradeoff(frame, path)
    meta = json.loads(Image.open(path).info[TEXTS_KEY])
    (x0, y0, x1, y1), = meta["axes"]
    labels = [t for t in meta["texts"] if t.get("gid") == POINT_LABEL]
    assert sorted(int(n) for t in labels for n in t["text"].split(", ")) == list(range(1, len(points) + 1))
    boxes = [t["box"] for t in labels]
    for i, (a0, b0, a1, b1) in enumerate(boxes):
        assert x0 < a0 and a1 < x1 and y0 < b0 and b1 < y1, (boxes[i], meta["axes"])
        for c0, d0, c1, d1 in boxes[i + 1:]:
            assert a1 <= c0 or c1 <= a0 or b1 <= d0 or d1 <= b0, boxes


@pytest.mark.parametrize("log, shown", [
    ("dds none/logprob:  40%|####      | 32/80 [00:01<00:02, 20.0req/s]", "dds none/logprob 40% 32/80"),
    # a trainer's steps (no name), with a warning and a loss dict written into its line: the steps only
    ("\r  0%|          | 0/8 [00:00<?, ?it/s]warnings.warn(\r 25%|##   | 2/8 [00:01<00:03, 2.0it/s]", "25% 2/8"),
    ("{'loss': '7.6', 'grad_norm': '0.9'}  0%|   | 0/8 [00:00<?, ?it/s]", "0% 0/8"),
    # the libraries' own bars are not the stage's progress
    ("Loading weights: 100%|##########| 26/26 [00:00<00:00, 300.0it/s]\n", ""),
    ("Map: 100%|####| 40/40 [00:00<00:00, 400 examples/s]", ""),
    ("Loading weights: 100%|#| 26/26 [00:00, 3it/s]\nsft: 50%|#####| 1/2 [00:01<00:01, 1.0req/s]", "sft 50% 1/2"),
])
def test_the_live_line_shows_flipguards_bars_and_a_trainers_steps_never_a_librarys(tmp_path, log, shown):
    from flipguard.pipeline.stage_workers import progress_of

    (tmp_path / "stage.log").write_text(log)
    assert progress_of(tmp_path / "stage.log") == shown
