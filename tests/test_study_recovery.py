"""A study always redoes and resumes its own stages, and ends as an uninterrupted study would.

What the libraries a stage drives write (TRL's dataset preparation, peft's card and adapter files, a
write cut short by a full disk or a kill) is the stage's: never in a pair set, claimed by the stage
that caused it, so a redo removes it and a resume writes over it. Tried for real on a tiny study
(recipes/tiny.yaml with DPO and KTO, which reads the DPO pairs: its preparation used to leave
`cache-*.arrow` files in the pair set), through the real CLI in processes of its own: a copied study
redone whole, `--from` stages in random order, real SIGKILLs of the study at random stages, a real
small filesystem (a tmpfs: root only) filled at random stages, Ctrl-C (SIGINT) of a `--jobs 2` study.
Every end state is compared with an uninterrupted study: the pair sets, adapters, merged models, every
judgment and the comparison, byte for byte or value for value, and every file proven flipguard's.
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
import time
from pathlib import Path

import pytest
import yaml

from flipguard.files import LOCK_NAME, OWNER_FILE, owns, read_manifest

ROOT = Path(__file__).resolve().parent.parent
BOUND = 5400  # seconds: a hang guard only (a loaded shared machine); every wait below is on a file or a process
STAGES = ["baseline", "base-train", "pairs", "dpo", "dpo-merge", "dpo-eval", "kto", "kto-merge", "kto-eval", "compare"]
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a full disk is a small tmpfs, and only root can mount one")


def _env() -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _command(recipe: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "flipguard.pipeline.cli", "study", str(recipe), "--out", str(out), *flags]


def study(recipe: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    """`flipguard study` in a process of its own."""
    return subprocess.run(_command(recipe, out, *flags), env=_env(), capture_output=True, text=True, timeout=BOUND)


def one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 and one line on stderr holding every needle: no traceback, no warning."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _recipe(folder: Path) -> Path:
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw.pop("sft")
    raw["report_to"] = "none"
    raw["pairs"]["datasets"] = "bbq"
    raw["eval"].update(limit=1, n_boot=20, mitigations=[])
    for trainer in ("dpo", "kto"):
        raw[trainer]["max_steps"] = 2
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, an uninterrupted study of it), one stage at a time."""
    folder = tmp_path_factory.mktemp("recovery")
    recipe = _recipe(folder)
    out = folder / "reference"
    proc = study(recipe, out, "--jobs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "study.json").read_text())["order"] == STAGES
    return recipe, out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def results(out: Path) -> dict[str, object]:
    """What a study computed, free of where and when it ran: the pair sets (their datasets and JSONL), the
    adapters and merged models' weights, every judgment (item, case, choice, P("1"), P("2")) and the
    comparison's tables."""
    found: dict[str, object] = {}
    for pattern in ("pairs/*.jsonl", "pairs/counts.json", "pairs/*/data-*.arrow", "train/*/adapter_model.safetensors",
                    "models/*/model.safetensors", "dds/*/report/summary.csv", "compare/comparison.csv",
                    "compare/significance.csv", "compare/transfer.csv"):
        for path in sorted(out.glob(pattern)):
            found[str(path.relative_to(out))] = _sha(path)
    for path in sorted(out.glob("dds/*/records.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        found[str(path.relative_to(out))] = sorted((r["item_id"], r["case"], r["choice"], r["p1"], r["p2"]) for r in rows)
    return found


def assert_sound(out: Path) -> None:
    """The study is finished and tidy: every stage done (none left running), every file under it proven
    flipguard's by its folder's manifest, no staging folder, stage log or temp file left behind, and no
    library cache inside a pair set."""
    stages = json.loads((out / "study.json").read_text())["stages"]
    assert {n: s["status"] for n, s in stages.items()} == dict.fromkeys(STAGES, "done")
    unproven = []
    for folder, dirs, names in os.walk(out):
        doc = read_manifest(folder)
        for name in names:
            if name not in (OWNER_FILE, LOCK_NAME) and not (doc is not None and owns(folder, name, doc)):
                unproven.append(os.path.join(folder, name))
        leftovers = [d for d in dirs if d.startswith(".")] + [n for n in names if n.startswith(".")
                                                              and n not in (OWNER_FILE, LOCK_NAME)]
        assert not leftovers, f"{folder}: {leftovers}"
    assert unproven == []
    assert not list(out.glob("pairs/*/cache-*.arrow"))


@pytest.mark.slow
def test_a_copied_study_redoes_every_stage_and_from_any_stage_in_any_order(reference, tmp_path):
    """A copy of a finished study is redone whole (its folder is part of every stage's settings): every stage
    removes what it wrote and runs again, KTO and DPO over the one pair set; then `--from` stages in a random
    order (the pairs among them: it used to be refused as "changed since flipguard wrote it" once KTO had
    trained, every time, until the user deleted the folder). Each ends as the uninterrupted study did."""
    recipe, ref = reference
    expected = results(ref)
    copy = tmp_path / "copy"
    shutil.copytree(ref, copy, symlinks=True)
    proc = study(recipe, copy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(f"] {name} (redo, stage" in proc.stdout for name in STAGES), proc.stdout[-3000:]
    assert results(copy) == expected
    assert_sound(copy)
    order = random.Random(58).sample(["pairs", "kto", "compare"], 3)
    for name in order:
        proc = study(recipe, copy, "--from", name)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        assert f"] {name} (redo, stage" in proc.stdout
        assert results(copy) == expected, name
        assert_sound(copy)


def _mount(where: Path, size_kb: int) -> None:
    where.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a full disk needs a small tmpfs, and this machine cannot mount one ({done.stderr.strip()})")


def _resize(where: Path, size_kb: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_kb}k", str(where)], check=True, capture_output=True)


def _size_kb(folder: Path) -> int:
    """What FOLDER takes on a tmpfs, in KiB (whole 4 KiB pages per file)."""
    return sum(-(-p.stat().st_size // 4096) * 4 for p in folder.rglob("*") if p.is_file())


def _fill(path: Path, size: int) -> None:
    """A file of `size` bytes (none when `size` is not positive): the disk filled by someone else."""
    with open(path, "wb") as fh:
        while size > 0:
            size -= fh.write(b"\0" * min(size, 1 << 20))


def assert_full_disk_line(proc: subprocess.CompletedProcess, out: Path) -> str:
    """One line naming the stage, the path and the room: free there, and about how much is needed."""
    line = one_line(proc, "flipguard study: error: stage ", f"{out}", "cannot write (No space left on device; ",
                    " free there, about ", " needed (", "rerun the same command to resume")
    assert "died" not in line and "Errno" not in line
    state = out / "study.json"
    if state.is_file():  # never "running" once the process has ended: the stage that met the full disk says so
        stages = json.loads(state.read_text())["stages"]
        assert "running" not in {s["status"] for s in stages.values()}
        failed = [n for n, s in stages.items() if s["status"] == "failed"]
        assert failed and line.startswith(f"flipguard study: error: stage {failed[0]}: "), (failed, line)
    return line


@pytest.mark.slow
@ROOT_ONLY
@pytest.mark.parametrize("fraction, jobs", [(0.45, "2"), (0.75, "1")])
def test_a_full_disk_at_any_stage_is_one_line_and_the_rerun_ends_as_an_uninterrupted_study(
        reference, tmp_path, fraction, jobs):
    """The study on a real tmpfs that holds a fraction of what it needs: one line naming the stage, the path,
    the room left and the room needed, exit 2, the stage recorded "failed" (it used to be a 19-line
    traceback and a study.json saying "running"); with room made, the same command resumes (the trainer's
    own half-written files are its own: it used to refuse them) and ends as the uninterrupted study."""
    recipe, ref = reference
    needed = _size_kb(ref)
    disk = tmp_path / "disk"
    _mount(disk, int(needed * fraction))
    try:
        out = disk / "study"
        assert_full_disk_line(study(recipe, out, "--jobs", jobs), out)
        _resize(disk, needed * 4)
        proc = study(recipe, out, "--jobs", jobs)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert results(out) == results(ref)
        assert_sound(out)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _wait_running(state: Path, stage: str, proc: subprocess.Popen) -> bool:
    """Until study.json says `stage` runs (True), or the study ended first (False)."""
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        try:
            if (json.loads(state.read_text())["stages"].get(stage) or {}).get("status") == "running":
                return True
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    raise AssertionError(f"{stage} never ran")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])
def test_redos_kills_and_a_full_disk_in_random_order_end_as_an_uninterrupted_study(reference, tmp_path, seed):
    """A property over seeded random sequences: a finished study, then steps drawn at random (a `--from` redo of a
    random stage; a SIGKILL of the study, its workers with it, once a random stage runs; the filesystem (a real
    tmpfs) filled by another file to a random margin, a redo that does not fit ending in one line, then the
    room freed; one or two stages at once), then the plain command. Every end state equals the uninterrupted
    study's."""
    recipe, ref = reference
    expected = results(ref)
    rng = random.Random(seed)
    disk = tmp_path / "disk"
    room = _size_kb(ref) * 4
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}k", "tmpfs", str(disk)],
                                                   capture_output=True).returncode == 0
    out = disk / "study"
    shutil.copytree(ref, out, symlinks=True)
    try:
        assert study(recipe, out).returncode == 0  # the copy redone whole: the finished study of this folder
        steps = ["kill", "from", "kill"] + (["fill"] if mounted else [])
        rng.shuffle(steps)
        for step in steps:
            start = rng.choice(STAGES[:-1])
            jobs = rng.choice(["1", "2"])
            if step == "from":
                proc = study(recipe, out, "--from", start, "--jobs", jobs)
                assert proc.returncode == 0, (start, proc.stderr[-3000:])
            elif step == "fill":  # another program fills the disk, to a random margin; then frees it
                filler = disk / "filler.bin"
                st = os.statvfs(disk)
                _fill(filler, st.f_bavail * st.f_frsize - rng.randrange(0, 256 * 1024))
                proc = study(recipe, out, "--from", start, "--jobs", jobs)
                if proc.returncode != 0:  # it may fit: a redo removes what it rewrites first
                    one_line(proc, f"{out}", "cannot write (No space left on device")
                filler.unlink()
            else:
                target = rng.choice(STAGES[STAGES.index(start):])
                proc = subprocess.Popen(_command(recipe, out, "--from", start, "--jobs", jobs), env=_env(),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                try:
                    if _wait_running(out / "study.json", target, proc):
                        time.sleep(rng.uniform(0, 2))  # a random point in the stage; correctness waits on nothing
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=BOUND)
                finally:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
        proc = study(recipe, out)
        assert proc.returncode == 0, (steps, proc.stderr[-3000:])
        assert results(out) == expected, steps
        assert_sound(out)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_ctrl_c_of_a_jobs_2_study_is_one_line_and_the_rerun_resumes(reference, tmp_path):
    """SIGINT (Ctrl-C: the terminal sends it to the whole foreground group) while two stages run in workers:
    one line on stderr (it used to end in multi-line "leaked semaphore" warnings), exit 130, the stages
    recorded "interrupted", never "running"; the rerun resumes them and ends as the uninterrupted study."""
    recipe, ref = reference
    out = tmp_path / "study"
    # SIGINT at its default in the study, as from a terminal: a test run started in the background (`pytest &`,
    # `.ci/run &`) ignores SIGINT, and a child inherits that, so its Ctrl-C would never arrive
    proc = subprocess.Popen(_command(recipe, out, "--jobs", "2"), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert _wait_running(out / "study.json", "base-train", proc)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=BOUND)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == ["flipguard study: interrupted: what was written so far is kept; rerun the same "
                                        "command to resume"], err[-3000:]
    stages = json.loads((out / "study.json").read_text())["stages"]
    assert stages["base-train"]["status"] == "interrupted" and "running" not in {s["status"] for s in stages.values()}
    proc = study(recipe, out, "--jobs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert results(out) == results(ref)
    assert_sound(out)
