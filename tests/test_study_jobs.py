"""`flipguard study --jobs 2`: independent stages in worker processes write what one stage at a
time writes, and a real kill of a worker or of the study itself leaves a study that resumes, with
no worker left writing into it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flipguard.pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 900  # a loaded 2-core machine; the conditions below are events, this only stops a hang


def _recipe(tmp_path: Path, name: str = "recipe.yaml", sft_steps: int = 2) -> Path:
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw["report_to"] = "none"
    raw["eval"].update(limit=2, n_boot=50, mitigations=["be_honest"])
    raw["pairs"]["datasets"] = "bbq"
    raw.pop("kto")
    raw["sft"]["max_steps"] = sft_steps
    raw["dpo"]["max_steps"] = 2
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def _records(study: Path, rel: Path) -> list[dict]:
    """A records file without its clock fields (when a record was written, how long it took) and
    the study's folder (a merged model's path, and the record key hashed from it)."""
    rows = [json.loads(line) for line in (study / rel).read_text().replace(str(study), "STUDY").splitlines()]
    for row in rows:
        for clock_or_key in ("time", "latency_s", "key"):
            row.pop(clock_or_key, None)
    return rows


@pytest.mark.slow
def test_stages_side_by_side_write_what_one_at_a_time_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    recipe = _recipe(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli_main(["study", str(recipe), "--out", str(one), "--jobs", "1"]) == 0
    capsys.readouterr()
    assert cli_main(["study", str(recipe), "--out", str(two), "--jobs", "2"]) == 0
    printed = capsys.readouterr().out

    # SFT and DPO read only the pairs: the second starts while the first runs, in another process
    assert "] dpo (run, stage" in printed and "[beside sft" in printed
    # each stage's own output goes to its log, kept as a terminal would have left it; the terminal has a line
    # for its start and one for its end
    sft_log = (two / "logs" / "sft.log").read_text()
    assert "adapter saved to" in sft_log and "adapter saved to" not in printed and "--- sft: run in" in printed
    assert not (two / ".stage-logs").exists()  # the live logs and the workers' temp folders go when the study ends
    state_one, state_two = (json.loads((d / "study.json").read_text()) for d in (one, two))
    assert state_two["order"] == state_one["order"]
    assert {n: s["status"] for n, s in state_two["stages"].items()} == {n: "done" for n in state_one["order"]}

    records = sorted(p.relative_to(one) for p in one.rglob("records.jsonl"))
    assert len(records) >= 5  # baseline, be_honest, base-train, sft-eval, dpo-eval
    for rel in records:
        assert _records(two, rel) == _records(one, rel), rel
    for rel in ("compare/comparison.csv", "train/sft/adapter_model.safetensors", "train/dpo/adapter_model.safetensors",
                "pairs/dpo.jsonl", "pairs/sft.jsonl"):
        assert (two / rel).read_bytes() == (one / rel).read_bytes(), rel


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:  # the field after the state is the parent's pid
            found.append(int(stat.parent.name))
    return found


def _stage_of(worker: int) -> str | None:
    """The stage a worker is running: its stdout is that stage's log file (stage_workers.py)."""
    try:
        target = os.readlink(f"/proc/{worker}/fd/1")
    except OSError:
        return None
    return Path(target).stem if target.endswith(".log") else None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_for(condition, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + DEADLINE_S
    while not (value := condition()):
        assert proc is None or proc.poll() is None, f"the study ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def _start(recipe: Path, out: Path, log: Path, tmpdir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmpdir)}
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "flipguard.pipeline.cli", "study", str(recipe),
                                 "--out", str(out), "--jobs", "2"], env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads worker processes from /proc (Linux)")
def test_a_killed_worker_fails_its_stage_and_a_killed_study_takes_its_workers_along(tmp_path):
    long = _recipe(tmp_path, "long.yaml", sft_steps=400)  # long enough to be killed while training
    out = tmp_path / "study"
    tmpdir = tmp_path / "tmpdir"  # the study's $TMPDIR: a killed worker must leave nothing in it
    tmpdir.mkdir()

    def media_folders() -> list[Path]:  # what importing TRL's trainers makes (wandb), in a worker's temp folder
        return [p for p in [*tmpdir.glob("*wandb-media"), *out.glob(".stage-logs/.worker-tmp.*/*wandb-media")]]

    # 1. SIGKILL to the worker running sft (once its trainer's imports have made their temp folders):
    #    the study says which stage died and how, exits non-zero, and records sft as unfinished
    proc = _start(long, out, tmp_path / "first.log", tmpdir)
    try:
        worker = _wait_for(lambda: next((w for w in _children(proc.pid) if _stage_of(w) == "sft"), None),
                           "a worker runs sft", proc)
        _wait_for(media_folders, "the sft worker's imports to make their temp folders", proc)
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(timeout=DEADLINE_S) == 2
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the killed worker's temp folder went with it: no tempfile folder (tmp*) left in $TMPDIR (torch's
    # compile cache, torchinductor_<user>, is a cache kept on purpose)
    assert not media_folders() and not list(tmpdir.glob("tmp*"))
    assert not (out / ".stage-logs").exists()
    printed = (tmp_path / "first.log").read_text()
    assert (f"flipguard study: error: stage sft: its worker process (pid {worker}) died during the stage (killed by "
            "signal 9); rerun the same command to resume") in printed
    stages = json.loads((out / "study.json").read_text())["stages"]
    assert stages["sft"]["status"] == "failed" and "sft-merge" not in stages  # never left "running"
    assert "died during the stage (killed by signal 9)" in stages["sft"]["error"]
    assert stages["pairs"]["status"] == "done"

    # 2. SIGKILL to the study alone (not its process group): its workers die with it
    proc = _start(long, out, tmp_path / "second.log", tmpdir)
    try:
        _wait_for(lambda: any(_stage_of(w) == "sft" for w in _children(proc.pid)), "sft runs again", proc)
        _wait_for(media_folders, "the sft worker's imports to make their temp folders", proc)
        workers = _children(proc.pid)  # the two workers (and multiprocessing's resource tracker)
        assert len(workers) >= 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _wait_for(lambda: not any(_alive(w) for w in workers), "the workers to exit after the study was killed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    # the killed study's stage logs and its workers' temp folders stay in its folder (nothing of it in
    # the system's temp folder)
    logs = out / ".stage-logs"
    assert (logs / "sft.log").is_file()
    assert not list(tmpdir.glob("tmp*")) and media_folders()
    (logs / "notes.txt").write_text("the user's own file")

    # 3. the rerun (a short schedule, so the test stays short) finishes every stage and removes the
    #    logs it and the killed run wrote, not the user's file beside them
    assert cli_main(["study", str(_recipe(tmp_path, "long.yaml")), "--out", str(out), "--jobs", "2"]) == 0
    state = json.loads((out / "study.json").read_text())
    assert {s["status"] for s in state["stages"].values()} == {"done"}
    assert (out / "train" / "sft" / "flipguard_training.json").is_file()
    assert [p.name for p in logs.iterdir()] == ["notes.txt"]  # the killed run's workers' temp folders too


def test_a_stage_log_is_printed_as_a_terminal_would_have_left_it():
    from flipguard.pipeline.stage_workers import last_of_each_line

    on_a_terminal = "Tokenizing:   0%|   | 0/3803\rTokenizing:  50%|#  | 1901/3803\rTokenizing: 100%|##| 3803/3803\n"
    assert last_of_each_line("start\r\n" + on_a_terminal + "done\n") == "start\nTokenizing: 100%|##| 3803/3803\ndone\n"
    to_a_file = "Tokenizing:   0%|   | 0/3803\nTokenizing:  50%|#  | 1901/3803\nTokenizing: 100%|##| 3803/3803\n"
    two_bars = to_a_file + "Loading weights:  50%|#  | 13/26\nLoading weights: 100%|##| 26/26\n"
    assert last_of_each_line("start\n" + two_bars + "done") == ("start\nTokenizing: 100%|##| 3803/3803\n"
                                                               "Loading weights: 100%|##| 26/26\ndone")


def test_two_at_a_time_is_the_default_only_where_it_is_safe(monkeypatch, tmp_path):
    from flipguard.pipeline import stage_workers

    small = tmp_path / "small"
    small.mkdir()
    (small / "model.safetensors").write_bytes(b"0" * 1000)
    big = tmp_path / "big.gguf"
    with open(big, "wb") as f:  # sparse: 3 GiB of weights on paper
        f.truncate(3 * 2**30)
    monkeypatch.setattr(stage_workers, "usable_cores", lambda: 2)
    common = {"threads": 1, "on_gpu": False, "launches": False, "backend": "hf", "model_path": str(small)}
    assert stage_workers.auto_jobs(**common)[0] == 2
    assert stage_workers.auto_jobs(**{**common, "threads": 2})[0] == 1  # 2 cores, 2 threads per stage
    assert stage_workers.auto_jobs(**{**common, "on_gpu": True})[0] == 1
    assert stage_workers.auto_jobs(**{**common, "launches": True})[0] == 1
    assert stage_workers.auto_jobs(**{**common, "backend": "vllm"})[0] == 1
    assert stage_workers.auto_jobs(**{**common, "model_path": str(big)})[0] == 1
    assert stage_workers.auto_jobs(**{**common, "model_path": "Qwen/Qwen2.5-7B-Instruct"})[0] == 1  # not local
    monkeypatch.setattr(stage_workers, "usable_cores", lambda: 16)
    assert stage_workers.auto_jobs(**common)[0] == stage_workers.AUTO_JOBS_MAX


def _short_recipe(tmp_path: Path) -> Path:
    """Stages side by side without a trainer (baseline | be_honest, then compare): seconds."""
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw["report_to"] = "none"
    raw["eval"].update(limit=1, n_boot=20, mitigations=["be_honest"], trainers=[])
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _one_error_line(capsys) -> str:
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in out.err + out.out, out.err[-3000:]
    return lines[0]


def test_a_users_file_in_the_stage_log_folder_is_never_replaced_or_removed(tmp_path, capsys):
    """A file of the user's named like a stage log (`OUT/.stage-logs/baseline.log`) must survive
    `study --jobs 2`, and a regular file named `.stage-logs` must not end in a FileExistsError
    traceback. Both are refused before any work (one line naming the file); a file of another
    name there is kept, beside the logs the study writes and removes."""
    recipe = _short_recipe(tmp_path)
    out = tmp_path / "study"
    logs = out / ".stage-logs"
    logs.mkdir(parents=True)
    (logs / "baseline.log").write_text("my log of the baseline\n")
    (logs / "notes.txt").write_text("my notes\n")
    assert cli_main(["study", str(recipe), "--out", str(out), "--jobs", "2"]) == 2
    assert f"{logs / 'baseline.log'}: exists and was not written by flipguard" in _one_error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == [".stage-logs"]  # nothing run, nothing written
    assert {p.name: p.read_text() for p in logs.iterdir()} == {"baseline.log": "my log of the baseline\n",
                                                                 "notes.txt": "my notes\n"}

    (logs / "baseline.log").rename(tmp_path / "baseline.log")  # the user moves it away: the study runs
    assert cli_main(["study", str(recipe), "--out", str(out), "--jobs", "2"]) == 0
    capsys.readouterr()
    assert {p.name: p.read_text() for p in logs.iterdir()} == {"notes.txt": "my notes\n"}

    other = tmp_path / "other"
    other.mkdir()
    (other / ".stage-logs").write_text("a file, not a folder\n")
    assert cli_main(["study", str(recipe), "--out", str(other), "--jobs", "2"]) == 2
    line = _one_error_line(capsys)
    assert f"{other / '.stage-logs'}: is a file" in line and "move it away" in line
    assert sorted(p.name for p in other.iterdir()) == [".stage-logs"]
    assert (other / ".stage-logs").read_text() == "a file, not a folder\n"


def _mount_tmpfs(where: Path, size_kb: int) -> None:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a full disk needs a small tmpfs, and this machine cannot mount one ({done.stderr.strip()})")


@pytest.mark.skipif(os.geteuid() != 0, reason="a full disk is a small tmpfs, and only root can mount one")
def test_a_full_disk_during_jobs_2_is_one_line_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    """`study --jobs 2` on a real full filesystem (a tmpfs half the size the study needs): one line,
    not the workers' tracebacks ("worker process ... died"), naming the file that could
    not be written, exit 2; once there is room, the same command resumes and writes what a study with
    room wrote."""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    recipe = _short_recipe(tmp_path)
    roomy = tmp_path / "roomy"
    assert cli_main(["study", str(recipe), "--out", str(roomy), "--jobs", "2"]) == 0
    capsys.readouterr()
    needed_kb = sum(-(-p.stat().st_size // 4096) * 4 for p in roomy.rglob("*") if p.is_file())  # in 4 KiB pages
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, needed_kb // 2)
    try:
        out = disk / "study"
        assert cli_main(["study", str(recipe), "--out", str(out), "--jobs", "2"]) == 2
        line = _one_error_line(capsys)
        assert line.startswith("flipguard study: error: ") and "No space left on device" in line
        assert str(out) in line and "died" not in line
        subprocess.run(["mount", "-o", f"remount,size={needed_kb * 4}k", str(disk)], check=True)
        assert cli_main(["study", str(recipe), "--out", str(out), "--jobs", "2"]) == 0
        capsys.readouterr()
        for rel in ("compare/comparison.csv", "compare/significance.csv"):
            assert (out / rel).read_bytes() == (roomy / rel).read_bytes(), rel
        assert not (out / ".stage-logs").exists()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
