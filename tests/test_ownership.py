"""Nothing foreign is ever destroyed, by any write path (docs/reliability-ownership.md).

Hostile use as a new user would do it, through the real CLI in real processes on the tiny
model (`flipguard:tiny`, recipes/tiny.yaml; no organism build): the user's files sit where
flipguard writes (a project folder given as a study's --out, a page, a comparison, a records
file with a torn last line, notes in stage folders, symbolic links inside a run folder), and
each is checked byte for byte (sha256 before and after). A refusal is one line naming the
file, exit status 2, and comes before any work. The property test drives seeded random
sequences of commands over a folder seeded with foreign files and asserts none changes.

Runs are shared across tests (module fixtures) to keep the suite's time modest.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
except ImportError:  # the dev extra installs it
    given = st = None

from flipguard.files import OWNER_FILE
from flipguard.pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
BOUND = 900  # seconds: a hang guard only


def _env() -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def fg(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a process of its own."""
    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *map(str, args)], env=_env(),
                          cwd=cwd, capture_output=True, text=True, timeout=BOUND)


def cli(capsys, *args: str | Path) -> subprocess.CompletedProcess:
    """The CLI's own main in this process (cheaper than a process of its own), as a CompletedProcess."""
    capsys.readouterr()
    code = cli_main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hashes(paths) -> dict[str, str]:
    return {str(p): sha(p) for p in paths}


def _tree(root: Path) -> dict[str, str]:
    """Every file under ROOT (its manifests too, not the writer's lock) by its sha256: a refused command changes none."""
    return {str(p.relative_to(root)): sha(p) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != ".lock"}


def refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 with one line on stderr naming what it must; no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _recipe(folder: Path, **eval_plan) -> Path:
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw["report_to"] = "none"
    raw["eval"].update(limit=1, n_boot=20, mitigations=[], trainers=[], **eval_plan)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny-recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, Path]:
    """One eval run (with its report) and one finished study (baseline + compare), made once."""
    base = tmp_path_factory.mktemp("own")
    run = base / "run"
    proc = fg("eval", "--model", "flipguard:tiny", "--datasets", "bbq", "--limit", "1", "--out", run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recipe = _recipe(base)
    study = base / "study"
    assert cli_main(["study", str(recipe), "--out", str(study)]) == 0
    return {"base": base, "run": run, "recipe": recipe, "study": study}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# ---------------------------------------------------------------------------- study --out over a project folder

def test_study_into_a_project_folder_keeps_the_users_recipe_and_page(shared, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    recipe = project / "recipe.yaml"
    recipe.write_text("# my recipe: comments and secrets that must survive\n"
                      + (shared["recipe"]).read_text() + "# api_key: sk-keep-me\n")
    page = project / "view.html"
    page.write_text("<html>my own page</html>")
    before = hashes([recipe, page])
    line = refused(fg("study", recipe, "--out", project), str(recipe), "not written by flipguard")
    assert "move it away" in line
    assert hashes([recipe, page]) == before
    assert sorted(p.name for p in project.iterdir()) == ["recipe.yaml", "view.html"]  # no stage ran


# ---------------------------------------------------------------------------- stage redo

def test_redo_removes_only_what_the_stage_wrote_and_names_what_it_kept(shared, tmp_path, capsys):
    study = _copy(shared["study"], tmp_path / "study")
    notes = [study / "dds" / "baseline" / "NOTES.md", study / "compare" / "draft.md",
             study / "dds" / "baseline" / "report" / "mine.txt"]
    for n in notes:
        n.write_text(f"the user's {n.name}")
    edited = study / "compare" / "comparison.md"  # flipguard wrote it, the user edited it: theirs now
    edited.write_text(edited.read_text() + "\nmy annotation\n")
    notes.append(edited)
    before = hashes(notes)
    keys = [json.loads(line)["key"] for line in (study / "dds" / "baseline" / "records.jsonl").read_text().splitlines()]
    tree = _tree(study)
    proc = cli(capsys, "study", shared["recipe"], "--out", study, "--from", "baseline")
    # the redo would have to write over the edited comparison.md: refused before any stage, nothing changed
    refused(proc, f"stage compare: {edited}: changed since flipguard wrote it", "nothing was changed")
    assert _tree(study) == tree
    edited.rename(tmp_path / "my-comparison.md")  # the user moves their copy away: the redo runs
    proc = cli(capsys, "study", shared["recipe"], "--out", study, "--from", "baseline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--- baseline: kept 2 file(s) flipguard did not write" in proc.stdout
    assert "--- compare: kept 1 file(s) flipguard did not write" in proc.stdout
    assert hashes(notes[:-1]) == {k: v for k, v in before.items() if k != str(edited)}
    # baseline was redone into the same folder beside the user's notes: the same requests again
    redone = [json.loads(line)["key"] for line in (study / "dds" / "baseline" / "records.jsonl").read_text().splitlines()]
    assert sorted(redone) == sorted(keys)


def test_a_resumed_stage_claims_only_what_its_own_unfinished_run_wrote(shared, tmp_path, capsys):
    """The user's notes put in a finished stage's folder are never taken for the stage's: not when its run is
    resumed because it was cut short since (the stage claims what its libraries wrote only for a run of its
    own that stopped), nor by a later redo, which keeps them."""
    # its own study, not a copy: a copied study's stages are redone whole (their fingerprints name its folder)
    study = tmp_path / "study"
    assert cli(capsys, "study", shared["recipe"], "--out", study).returncode == 0
    notes = study / "dds" / "baseline" / "NOTES.md"
    notes.write_text("the user's notes")
    records = study / "dds" / "baseline" / "records.jsonl"
    lines = records.read_text().splitlines(keepends=True)
    records.write_text("".join(lines[: len(lines) // 2]))
    proc = cli(capsys, "study", shared["recipe"], "--out", study)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "] baseline (resume, stage" in proc.stdout, proc.stdout
    assert "NOTES.md" not in json.loads((notes.parent / OWNER_FILE).read_text())["files"]
    proc = cli(capsys, "study", shared["recipe"], "--out", study, "--from", "baseline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--- baseline: kept 1 file(s) flipguard did not write or you changed: {notes}" in proc.stdout
    assert notes.read_text() == "the user's notes"


def test_a_stage_folder_that_appears_mid_run_is_refused_not_deleted(shared, tmp_path):
    """The user creates OUT/compare while the study runs its baseline: the compare stage, when it
    arrives, refuses it (one line) and removes nothing."""
    from flipguard.pipeline.study_plan import StudyPlan

    out = tmp_path / "study"
    mine = out / "compare" / "plan.md"
    original = StudyPlan.run_dds

    def run_dds(self, args):  # the stage runs for real; meanwhile the user's folder appears
        original(self, args)
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.write_text("my plan")

    StudyPlan.run_dds = run_dds
    try:  # one stage at a time: the patched stage runs in this process, not in a worker
        assert cli_main(["study", str(shared["recipe"]), "--out", str(out), "--jobs", "1"]) == 2
    finally:
        StudyPlan.run_dds = original
    assert mine.read_text() == "my plan"
    assert sorted(p.name for p in mine.parent.iterdir()) == ["plan.md"]


def test_only_marks_later_stages_stale(shared, tmp_path, capsys):
    study = _copy(shared["study"], tmp_path / "study")
    proc = cli(capsys, "study", shared["recipe"], "--out", study, "--only", "baseline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = json.loads((study / "study.json").read_text())["stages"]
    assert stages["baseline"]["status"] == "done" and stages["compare"]["status"] == "stale"
    assert "stale" in (study / "view.html").read_text()


# ---------------------------------------------------------------------------- proof by hash only

def _proven(root: Path) -> list[str]:
    """The files under ROOT that no manifest proves flipguard's by the hash of their bytes (empty: all are)."""
    from flipguard.files import LOCK_NAME, owns, read_manifest

    bad = []
    for folder, _, names in os.walk(root):
        doc = read_manifest(folder)
        for name in names:
            if name in (OWNER_FILE, LOCK_NAME):
                continue
            hashed = doc is not None and (name in doc["logs"] or name in doc["sha256"])
            if not (hashed and owns(folder, name, doc)):
                bad.append(os.path.join(folder, name))
    return bad


@pytest.mark.parametrize("name, content", [
    # the study's effective recipe with flipguard's header line, copied into a project and edited
    ("recipe.yaml", None),
    # a study.json of the user's holding the study format's string
    ("study.json", '{"format": "flipguard-study/1", "stages": {}, "my_notes": "keep"}\n'),
])
def test_a_header_line_or_a_format_string_never_makes_a_file_flipguards(shared, tmp_path, name, content):
    project = tmp_path / "proj"
    project.mkdir()
    recipe = (project if name == "recipe.yaml" else tmp_path) / "recipe.yaml"
    effective = (shared["study"] / "recipe.yaml").read_text()
    assert effective.startswith("# the effective recipe of this study")
    recipe.write_text(effective.replace("n_boot: 20", "n_boot: 30") + "# my notes\n# token: ${env:MY_TOKEN}\n")
    if content is not None:
        (project / name).write_text(content)
    before = hashes(project.iterdir())
    line = refused(fg("study", recipe, "--out", project, "--only", "baseline"), str(project / name),
                   "exists and was not written by flipguard")
    assert "move it away" in line
    assert hashes(project.iterdir()) == before and sorted(p.name for p in project.iterdir()) == [name]


@pytest.fixture(scope="module")
def trained_study(shared) -> Path:
    """A finished study with an SFT stage (trainer, merge, eval of the merged model), made by the real CLI."""
    raw = yaml.safe_load(shared["recipe"].read_text())
    raw["eval"]["trainers"] = ["sft"]
    raw["sft"]["max_steps"] = 2
    recipe = shared["base"] / "sft-recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    study = shared["base"] / "sft-study"
    proc = fg("study", recipe, "--out", study)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return study


@pytest.mark.slow
def test_every_file_a_study_writes_is_recorded_with_its_hash(trained_study):
    # the trainer's and the tokenizer's files, the merged model's, the pair set's datasets, every run and report
    assert (trained_study / "train" / "sft" / "chat_template.jinja").is_file()
    assert (trained_study / "pairs" / "sft" / "dataset_info.json").is_file()
    assert _proven(trained_study) == []


@pytest.mark.slow
def test_a_study_redo_keeps_the_users_edits_of_files_it_wrote(trained_study, tmp_path):
    """`--from sft` after the user edited the trainer's chat template and the merged model's generation config:
    the redo is refused in one line naming the edit, before anything is removed (every file of the study, its
    manifests and study.json included, byte-identical: the adapter too); once the edit is moved away, the next
    one is refused the same way; then the redo runs whole."""
    study = _copy(trained_study, tmp_path / "study")
    recipe = trained_study.parent / "sft-recipe.yaml"
    template = study / "train" / "sft" / "chat_template.jinja"
    generation = study / "models" / "sft-merged" / "generation_config.json"
    template.write_text(template.read_text() + "{# my edit #}\n")
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "my_note": "keep"}))
    before = _tree(study)
    proc = fg("study", recipe, "--out", study, "--from", "sft")
    refused(proc, f"stage sft: {template}: changed since flipguard wrote it", "nothing was changed", "move it away")
    assert _tree(study) == before  # nothing was changed, as the line says
    template.rename(tmp_path / "my-template.jinja")  # the user moves it away: the merge's edit is met next
    before = _tree(study)
    proc = fg("study", recipe, "--out", study, "--from", "sft")
    refused(proc, f"stage sft-merge: {generation}: changed since flipguard wrote it", "nothing was changed")
    assert _tree(study) == before
    generation.rename(tmp_path / "my-generation.json")
    proc = fg("study", recipe, "--out", study, "--from", "sft")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _proven(study) == []  # redone whole, every file proven again
    assert json.loads((study / "study.json").read_text())["stages"]["sft"]["status"] == "done"


# ---------------------------------------------------------------------------- view / compare --out

def test_view_and_compare_never_replace_a_users_file_or_another_runs_records(shared, tmp_path, capsys):
    run = _copy(shared["run"], tmp_path / "run")
    other = _copy(shared["run"], tmp_path / "other")
    page = run / "view.html"  # the user's own page in the run folder
    page.write_text("<html>mine</html>")
    mine = tmp_path / "mine.html"
    mine.write_text("<html>also mine</html>")
    cmp = tmp_path / "cmp"
    cmp.mkdir()
    (cmp / "comparison.md").write_text("# my comparison")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    watched = [page, mine, cmp / "comparison.md", a_file, other / "records.jsonl", other / "run.json"]
    before = hashes(watched)
    refused(cli(capsys, "view", run), f"{page}: exists and was not written by flipguard")
    refused(cli(capsys, "view", run, "--out", mine), str(mine))
    refused(cli(capsys, "view", run, "--out", other / "records.jsonl"), "is the records file of a flipguard run")
    refused(cli(capsys, "compare", "--runs", f"Baseline={run}", "--out", cmp), f"{cmp / 'comparison.md'}")
    refused(cli(capsys, "compare", "--runs", f"Baseline={run}", "--out", a_file), "names a file, not a folder")
    assert hashes(watched) == before
    assert cli(capsys, "view", other).returncode == 0  # a page of its own: written, then replaced by the next view
    assert cli(capsys, "view", other).returncode == 0
    assert hashes(watched) == before


@pytest.fixture(scope="module")
def published(shared, tiny_model_path) -> dict[str, Path]:
    """flipguard's published folders of each kind, made by the real writers: a pair set (`flipguard
    pairs`), an adapter as the trainers leave it (peft's save inside train/utils.adapter_saved, as
    train/utils.save_adapter does), and a merged model (`flipguard merge`)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from flipguard.train.utils import adapter_saved

    base = shared["base"]
    pairs = base / "pairs"
    assert cli_main(["pairs", str(ROOT / "recipes" / "tiny.yaml"), "--out", str(pairs), "--pairs_datasets", "amqa"]) == 0
    adapter = base / "adapter"
    torch.manual_seed(0)
    with adapter_saved(str(adapter), {"trainer": "sft", "base_model": tiny_model_path}, None):
        get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                       LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(adapter)
    merged = base / "merged"
    assert cli_main(["merge", str(ROOT / "recipes" / "tiny.yaml"), "--model_name_or_path", tiny_model_path,
                     "--gap_prompts", "0", "--adapter", str(adapter), "--out", str(merged)]) == 0
    return {"pairs": pairs, "adapter": adapter, "merged": merged}


def test_view_out_replaces_only_a_page_never_another_kind_of_flipguard_file(shared, published, tmp_path, capsys):
    """`view --out` naming a file flipguard wrote as something else (a run's run.json and report
    table, a study's study.json, a pair set's counts.json, an adapter's adapter_config.json, a
    merged model's config.json) would replace it with HTML. Refused, one line, before any work; a page it wrote is still replaced by the next page."""
    run = _copy(shared["run"], tmp_path / "run")
    study = _copy(shared["study"], tmp_path / "study")
    folders = {name: _copy(path, tmp_path / name) for name, path in published.items()}
    targets = [run / "run.json", run / "report" / "summary.csv", study / "study.json",
               study / "dds" / "baseline" / "run.json", folders["pairs"] / "counts.json",
               folders["adapter"] / "adapter_config.json", folders["adapter"] / "flipguard_training.json",
               folders["merged"] / "config.json", folders["merged"] / "flipguard_merge.json"]
    everything = [p for root in (run, study, *folders.values()) for p in root.rglob("*") if p.is_file()]
    before = hashes(everything)
    for target in targets:
        line = refused(cli(capsys, "view", run, "--out", target), str(target), "not a view.html",
                       "nothing was changed")
        assert f"is flipguard's {target.name}" in line
    # the other file written at a path of the user's choosing: `data --export FILE`
    for target in (run / "run.json", run / "records.jsonl", folders["pairs"] / "counts.json"):
        refused(cli(capsys, "data", "--datasets", "bbq", "--export", target), str(target), "choose another --export")
    assert hashes(everything) == before
    assert not (run / "view.html").exists()  # refused before the page was built

    page = tmp_path / "pages" / "run.html"  # a page at a name of the user's choosing: replaced by the next page
    assert cli(capsys, "view", run, "--out", page).returncode == 0
    first = sha(page)
    assert cli(capsys, "view", study, "--out", page).returncode == 0
    assert sha(page) != first and json.loads((page.parent / OWNER_FILE).read_text())["kinds"] == {"run.html": "view.html"}
    # a page written where a run log would go is a page: `eval` into its folder does not write over it
    odd = tmp_path / "odd" / "run.json"
    assert cli(capsys, "view", run, "--out", odd).returncode == 0
    kept = sha(odd)
    refused(cli(capsys, "eval", "--model", "flipguard:tiny", "--datasets", "bbq", "--limit", "1", "--out", odd.parent),
            str(odd))
    assert sha(odd) == kept


def test_merge_out_refuses_another_flipguard_output_before_loading_a_model(shared, published, tmp_path, capsys):
    """A run folder (its manifest written by eval) passed as `merge --out` has a manifest, but
    not a merge's: publishing there would lose its run.json and records to the clean-up of
    'stale' files. Refused before any model loads: only a merge's own output is replaced."""
    run = _copy(shared["run"], tmp_path / "run")
    pairs = _copy(published["pairs"], tmp_path / "pairs")
    watched = [p for root in (run, pairs) for p in root.rglob("*") if p.is_file()]
    before = hashes(watched)
    for out in (run, pairs):
        proc = cli(capsys, "merge", ROOT / "recipes" / "tiny.yaml", "--model_name_or_path", "flipguard:tiny",
                   "--gap_prompts", "0", "--adapter", published["adapter"], "--out", out)
        refused(proc, f"{out}: --out holds another flipguard output", "not train/merge.py", "nothing was changed")
    assert hashes(watched) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs", "run"]  # no staging folder was made


def test_readers_respect_a_running_writers_lock(shared, tmp_path, capsys):
    """A real second process holds the run's writer lock (as eval does): compare and view refuse,
    naming it, and write nothing."""
    run = _copy(shared["run"], tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, json, os, sys, time\n"
        f"fd = os.open({str(run / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nos.ftruncate(fd, 0)\n"
        "os.pwrite(fd, json.dumps({'pid': os.getpid(), 'command': 'flipguard eval'}).encode(), 0)\n"
        "print('held', flush=True)\ntime.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused(cli(capsys, "compare", "--runs", f"Baseline={run}", "--out", tmp_path / "cmp"), f"pid {holder.pid}")
        refused(cli(capsys, "view", run), f"pid {holder.pid}", "wait for it")
        assert not (tmp_path / "cmp").exists() and not (run / "view.html").exists()
    finally:
        holder.kill()
        holder.wait()


def test_compare_refuses_a_run_whose_last_invocation_stopped_before_the_end(shared, tmp_path, capsys):
    run = _copy(shared["run"], tmp_path / "run")
    assert json.loads((run / "run.json").read_text())["complete"] is True
    meta = json.loads((run / "run.json").read_text())
    meta["complete"] = False  # as a killed eval leaves it (task.run_task writes True only at the end)
    (run / "run.json").write_text(json.dumps(meta))
    refused(cli(capsys, "compare", "--runs", f"Baseline={run}", "--out", tmp_path / "cmp", "--n_boot", "20"),
            f"{run}: incomplete: its last run stopped before the end")
    assert not (tmp_path / "cmp").exists()


# ---------------------------------------------------------------------------- records and links

def test_a_foreign_records_file_with_a_torn_tail_is_refused_uncut(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    records = out / "records.jsonl"
    records.write_bytes(b'{"my": "data"}\n{"half a li')
    before = sha(records)
    refused(fg("eval", "--model", "flipguard:tiny", "--datasets", "bbq", "--limit", "1", "--out", out),
            f"{records}: exists and was not written by flipguard")
    assert sha(records) == before
    assert sorted(p.name for p in out.iterdir()) == ["records.jsonl"]  # no lock, no manifest left behind


@pytest.mark.parametrize("link", [".lock", "records.jsonl", "report", "run.json"])
def test_symbolic_links_inside_a_run_folder_are_refused_never_followed(shared, tmp_path, capsys, link):
    run = _copy(shared["run"], tmp_path / "run")
    target = tmp_path / ("their-folder" if link == "report" else "their-file")
    if link == "report":
        target.mkdir()
        (target / "summary.md").write_text("the user's summary")
        watched = [target / "summary.md"]
    else:
        target.write_text("the user's file\n")
        watched = [target]
    if (run / link).is_dir():
        shutil.rmtree(run / link)
    elif (run / link).exists():
        (run / link).unlink()
    (run / link).symlink_to(target)
    before = hashes(watched)
    command = (["report", run] if link == "report" else
               ["eval", "--model", "flipguard:tiny", "--datasets", "bbq", "--limit", "1", "--out", run])
    refused(cli(capsys, *command), "is a symbolic link")
    assert hashes(watched) == before
    if link == "report":
        assert sorted(p.name for p in target.iterdir()) == ["summary.md"]


# ---------------------------------------------------------------------------- property: random command sequences

def _seed_foreign(root: Path, run: Path) -> list[Path]:
    """The user's files, put where flipguard writes."""
    files = {
        root / "notes.md": "project notes",
        run / "NOTES.md": "what I saw in this run",
        run / "view.html": "<html>my page</html>",
        run / "report" / "mine.md": "my report notes",
        root / "cmp" / "comparison.md": "# my comparison",
        root / "cmp" / "view.html": "<html>my comparison page</html>",
        root / "torn" / "records.jsonl": '{"mine": 1}\n{"torn',
        root / "page.html": "<html>a page of mine</html>",
        root / "secret.txt": "linked to, never written",
        root / "recipe.yaml": "# the user's own recipe\nmodel_name_or_path: flipguard:tiny\n",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    linked = root / "linked"
    linked.mkdir()
    (linked / ".lock").symlink_to(root / "secret.txt")
    (linked / "records.jsonl").symlink_to(root / "secret.txt")
    return sorted(files)


@pytest.mark.parametrize("seed", [33, 2026])
def test_random_command_sequences_change_no_foreign_file(shared, tmp_path, capsys, seed):
    """Seeded random sequences of real commands (in process: the CLI's own main) over a folder
    seeded with foreign files: every command ends with 0 or a one-line refusal (2), and no
    foreign file changes, ever."""
    root = tmp_path / "w"
    run = _copy(shared["run"], root / "run")
    study = _copy(shared["study"], root / "study")
    foreign = _seed_foreign(root, run)
    (study / "dds" / "baseline" / "NOTES.md").write_text("a note in a stage folder")
    foreign.append(study / "dds" / "baseline" / "NOTES.md")
    before = hashes(foreign)
    imports = ROOT / "tests" / "fixtures" / "dialdefer" / "qwen-2.5-7b-instruct"
    eval_args = ["--model", "flipguard:tiny", "--datasets", "bbq", "--limit", "1", "--report", "false"]
    commands = [
        ["eval", *eval_args, "--out", str(run)],
        ["eval", *eval_args, "--out", str(root / "torn")],
        ["eval", *eval_args, "--out", str(root / "linked")],
        ["eval", *eval_args, "--out", str(root)],
        ["report", str(run)],
        ["view", str(run)],
        ["view", str(run), "--out", str(root / "page.html")],
        ["view", str(study)],
        ["view", str(run), "--out", str(run / "records.jsonl")],
        ["compare", "--runs", f"Baseline={run}", "--out", str(root / "cmp"), "--n_boot", "20"],
        ["compare", "--runs", f"Baseline={run}", "--out", str(root / "cmp2"), "--n_boot", "20"],
        ["compare", "--runs", f"Baseline={run}", "--out", str(root / "notes.md"), "--n_boot", "20"],
        ["import-records", str(imports), "--out", str(root / "torn")],
        ["import-records", str(imports), "--out", str(root / "imported")],
        ["study", str(shared["recipe"]), "--out", str(study), "--only", "compare"],
        ["study", str(shared["recipe"]), "--out", str(study), "--only", "baseline"],
        ["study", str(shared["recipe"]), "--out", str(root)],
    ]
    rng = random.Random(seed)
    t0 = time.monotonic()
    seen, codes = set(), []
    for step in range(15):
        cmd = rng.choice(commands)
        seen.add(cmd[0])
        code = cli_main(cmd)
        codes.append(code)
        out = capsys.readouterr()
        assert code in (0, 2), (step, cmd, out.err[-2000:])
        if code == 2:
            assert len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err, (cmd, out.err)
        assert hashes(foreign) == before, (step, cmd)
        assert (root / "secret.txt").read_text() == "linked to, never written"
    assert time.monotonic() - t0 < 600
    assert {"eval", "view", "compare", "study"} <= seen
    assert 0 in codes and 2 in codes  # some commands did their work, some were refused


def test_the_manifest_records_what_flipguard_wrote(shared):
    doc = json.loads((shared["run"] / OWNER_FILE).read_text())
    assert "records.jsonl" in doc["logs"] and doc["sha256"]["run.json"] == sha(shared["run"] / "run.json")
    report = json.loads((shared["run"] / "report" / OWNER_FILE).read_text())
    assert report["sha256"]["summary.md"] == sha(shared["run"] / "report" / "summary.md")


def test_a_trainer_refuses_an_output_dir_of_the_users(tmp_path, capsys):
    """The trainers write straight into output_dir (peft and the Trainer save there): a folder of
    the user's is refused before anything loads, byte for byte intact."""
    mine = tmp_path / "my-project"
    mine.mkdir()
    (mine / "README.md").write_text("my project's readme")
    (mine / "adapter_config.json").write_text('{"mine": true}')
    before = hashes(mine.iterdir())
    recipe = _recipe(tmp_path)
    proc = cli(capsys, "sft", recipe, "--output_dir", mine)
    refused(proc, f"output_dir {mine} holds files flipguard did not write")
    assert hashes(mine.iterdir()) == before and sorted(p.name for p in mine.iterdir()) == ["README.md",
                                                                                          "adapter_config.json"]


# ---------------------------------------------------------------------------- property: commands, kills and user writes

# (relative path, bytes): the user's files, where flipguard writes and beside what it builds
USER_TREE = {
    "notes.md": b"project notes\n",
    "mine.html": b"<html>my own page</html>\n",
    "run/NOTES.md": b"what I saw in this run\n",
    "run/report/mine.txt": b"my report notes\n",
    "model/NOTES.md": b"my notes on this model\n",
    ".model.20250101/x": b"b\n",  # named like the model's staging folder, and its lock
    ".model.20250101.lock": b"my lock\n",
    "project/organism.json": b'{"build": {}, "planted": {}}\n',  # an organism.json flipguard did not publish
    "project/notes.md": b"my organism notes\n",
}
EXAMPLES = 4
# files the user writes (or edits: flipguard's file becomes theirs) while the sequence runs
LATER_WRITES = ["run/later.md", "pages/mine.html", "model/later.txt", ".model.abcdefgh/weights.bin",
                "run/report/summary.md", "pages/p.html"]
VIEW_TARGETS = ["run/run.json", "run/records.jsonl", "run/report/summary.csv", "run/view.html", "model/config.json",
                "pairs/counts.json", "notes.md", "mine.html", "pages/p.html", "run/NOTES.md"]
ACTIONS = st.one_of(
    st.tuples(st.just("view"), st.sampled_from(VIEW_TARGETS)),
    st.tuples(st.just("eval"), st.sampled_from(["1", "2", "3"])),
    st.tuples(st.just("kill-eval"), st.sampled_from(["locked", "records"])),
    st.tuples(st.just("kill-build"), st.just("")),
    st.tuples(st.just("organism"), st.sampled_from(["project", "model"])),
    st.tuples(st.just("merge"), st.sampled_from(["run", "pairs", "project"])),
    st.tuples(st.just("write"), st.sampled_from(LATER_WRITES)),
) if st is not None else None


def _kill_on(argv: list[str], ready) -> int:
    """The real CLI in a process of its own, SIGKILLed once `ready()` holds (polled on files), or
    left to finish when it ends first (0, or a one-line refusal); its exit status."""
    proc = subprocess.Popen([sys.executable, "-m", "flipguard.pipeline.cli", *argv], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    def holds() -> bool:
        try:
            return ready()
        except OSError:  # a file it waits on, gone between two looks (the run's lock at its end)
            return False

    try:
        deadline = time.monotonic() + BOUND
        while proc.poll() is None and not holds():
            assert time.monotonic() < deadline, "hang guard"
            time.sleep(0.02)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        err = proc.stderr.read()
        assert code in (0, 2, -signal.SIGKILL), (argv, code, err[-3000:])
        if code == 2:  # finished before the kill, refusing (a report file the user edited): one line
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return code
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _valid(path: Path) -> bool:
    """A file flipguard wrote reads as what it is: JSON parses, a records log's whole lines parse, a
    page has the page's head."""
    from flipguard.eval.records import read_records
    from flipguard.pipeline.view.page import PAGE_HEAD

    data = path.read_bytes()
    if path.suffix == ".json":
        json.loads(data)
    elif path.name == "records.jsonl":
        list(read_records(path))  # a torn last line (a kill mid-append) is skipped, as every reader does
    elif path.suffix == ".jsonl":
        [json.loads(line) for line in data.decode("utf-8").splitlines()]
    elif path.suffix == ".html":
        assert data.startswith(PAGE_HEAD), path
    return True


def _flipguards_files(root: Path, users: set[Path]) -> list[Path]:
    """Every file a manifest under ROOT lists and that is there; each is flipguard's by its hash
    (or the user's, having edited it) and valid."""
    from flipguard.files import owns, read_manifest

    found = []
    for manifest in root.rglob(OWNER_FILE):
        folder = manifest.parent
        doc = read_manifest(folder)
        assert doc is not None, f"{manifest}: not a manifest"
        for name in doc["files"]:
            path = folder / name
            if not path.is_file() or path in users:
                continue
            assert owns(folder, name, doc), f"{path}: listed, but its bytes are not what flipguard wrote"
            if path.is_file():
                assert _valid(path)
            found.append(path)
    return found


@pytest.mark.skipif(given is None, reason="hypothesis is not installed (pip install -e '.[dev]')")
def test_commands_kills_and_user_writes_keep_every_user_file_and_leave_flipguards_valid(shared, published, tmp_path,
                                                                                         capsys, tiny_model_path):
    """Random sequences of real commands (view --out anywhere, eval, organism --path, merge --out),
    real SIGKILLs (an eval as it locks its run or writes records, a model build in its staging
    folder) and user writes (new files, edits of flipguard's) over a tree of user files: every user
    file stays byte-identical, every file a manifest lists is flipguard's and valid (or absent), and
    after a rebuild no staging folder of a killed build is left, the user's lookalikes kept."""
    recipe = ROOT / "recipes" / "tiny.yaml"
    t0 = time.monotonic()
    examples = [0]

    # each sequence mixes kinds of action (at most one of each: a kill of each kind, a command of
    # each kind), in a random order with random arguments; fixed examples, no shrinking: a failure
    # prints the sequence that failed
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(st.lists(ACTIONS, min_size=4, max_size=6, unique_by=lambda action: action[0]))
    def sequence(actions):
        examples[0] += 1
        root = Path(tempfile.mkdtemp(dir=tmp_path))
        _copy(shared["run"], root / "run")
        _copy(Path(tiny_model_path), root / "model")  # a model folder `flipguard tiny-model` published
        _copy(published["pairs"], root / "pairs")
        users: dict[Path, bytes] = {}
        for rel, data in USER_TREE.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
            users[root / rel] = data
        killed_build = False
        for action, arg in actions:
            if action == "write":
                path = root / arg
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes((path.read_bytes() if path.is_file() else b"") + b"the user's words\n")
                users[path] = path.read_bytes()
            elif action == "kill-eval":
                records, lock = root / "run" / "records.jsonl", root / "run" / ".lock"
                lines = records.read_bytes().count(b"\n")
                ready = (lambda: lock.is_file() and lock.stat().st_size > 0) if arg == "locked" else \
                    (lambda: records.read_bytes().count(b"\n") > lines)
                _kill_on(["eval", "--model", "flipguard:tiny", "--datasets", "bbq", "--limit", "4", "--out",
                          str(root / "run")], ready)
            elif action == "kill-build":
                def staged():
                    return [p for p in root.glob(".model.*") if p.is_dir() and (p / OWNER_FILE).is_file()]
                killed_build |= _kill_on(["tiny-model", "--path", str(root / "model"), "--force"], staged) == -signal.SIGKILL
            else:
                argv = {
                    "view": ["view", str(root / "run"), "--out", str(root / arg)],
                    "eval": ["eval", "--model", "flipguard:tiny", "--datasets", "bbq", "--limit", arg, "--out",
                             str(root / "run")],
                    "organism": ["organism", "--path", str(root / arg)],
                    "merge": ["merge", str(recipe), "--model_name_or_path", "flipguard:tiny", "--gap_prompts", "0",
                              "--adapter", str(published["adapter"]), "--out", str(root / arg)],
                }[action]
                proc = cli(capsys, *argv)
                assert proc.returncode in (0, 2), (actions, argv, proc.stderr[-3000:])
                if proc.returncode == 2:
                    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
                if action in ("organism", "merge"):
                    assert proc.returncode == 2  # a user's folder, another command's output: refused
            assert {p: p.read_bytes() for p in users} == users, (actions, action, arg)
            _flipguards_files(root, set(users))
        if killed_build:  # the next build removes the killed one's staging folder and lock, nothing else
            assert cli(capsys, "tiny-model", "--path", root / "model", "--force").returncode == 0
            left = sorted(p.name for p in root.glob(".model.*"))
            assert left == sorted({p.relative_to(root).parts[0] for p in users if p.relative_to(root).parts[0]
                                   .startswith(".model.")}), left
        assert {p: p.read_bytes() for p in users} == users
        assert _flipguards_files(root, set(users))

    sequence()
    assert examples[0] == EXAMPLES
    assert time.monotonic() - t0 < 600  # a hang guard; about a minute on a loaded 2-core machine
