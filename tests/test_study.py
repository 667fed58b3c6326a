"""`flipguard study RECIPE` end to end on recipes/tiny.yaml (tiny limits): every stage runs
once, an identical rerun skips them all, --only/--from redo what they say, a changed
recipe value redoes exactly the stages that read it, and the results reach wandb
(offline run files) in the recipe's group beside the training runs."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from flipguard.pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
GROUP = "study-test-group"
ALL_STAGES = ["baseline", "be_honest", "dehumanizing", "base-train", "pairs", "sft", "sft-merge", "sft-eval",
              "dpo", "dpo-merge", "dpo-eval", "compare", "wandb"]


def _recipe(tmp_path: Path, **dpo) -> Path:
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw["report_to"] = ["wandb"]
    raw["eval"].update(limit=2, n_boot=50)
    raw["pairs"]["datasets"] = "bbq"
    raw.pop("kto")  # sft and dpo here; a study of the third trainer: test_a_kto_section_...
    for trainer in ("sft", "dpo"):
        raw[trainer]["max_steps"] = 2
    raw["dpo"].update(dpo)
    raw["tracking"].update(run_name="tinytest", group=GROUP)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _state(out: Path) -> dict:
    return json.loads((out / "study.json").read_text())


def _finished(out: Path) -> dict[str, str]:
    return {name: s.get("finished") for name, s in _state(out)["stages"].items()}


def _redone(before: dict[str, str], out: Path) -> set[str]:
    return {name for name, t in _finished(out).items() if before.get(name) != t}


@pytest.mark.slow
def test_study_runs_skips_and_redoes_exactly_what_changed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    recipe, out = _recipe(tmp_path), tmp_path / "study"

    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    state = _state(out)
    assert state["order"] == ALL_STAGES
    assert {n: s["status"] for n, s in state["stages"].items()} == {n: "done" for n in ALL_STAGES}
    assert {s["last_action"] for s in state["stages"].values()} == {"run"}
    assert "Before/after" in printed and "Artefacts:" in printed
    table = pd.read_csv(out / "compare" / "comparison.csv")
    assert list(dict.fromkeys(table["condition"])) == ["Baseline", "Be Honest", "Dehumanizing", "SFT", "DPO"]
    for png in ("dds_heatmap.png", "before_after.png"):
        assert (out / "compare" / png).stat().st_size > 1000
    # the fine-tuned rows are the merged models, judged with the baseline's C1 (fixed C1)
    meta = json.loads((out / "dds" / "dpo-eval" / "run.json").read_text())
    assert meta["model"] == str(out / "models" / "dpo-merged") and meta["c1_from"] == str((out / "dds" / "baseline").resolve())
    assert (out / "train" / "sft" / "flipguard_training.json").is_file()
    # the trainers read the effective recipe: this study's pair folder and adapter folders
    effective = yaml.safe_load((out / "recipe.yaml").read_text())
    assert effective["pairs"]["dir"] == str(out / "pairs") and effective["dpo"]["output_dir"] == str(out / "train" / "dpo")

    # wandb (offline): the study's run in the recipe's project and group, beside the training runs
    info = json.loads((out / "wandb_run.json").read_text())
    assert info["group"] == GROUP and info["name"] == "tinytest-study" and info["project"] == "flipguard"
    assert {"dds_by_dataset", "comparison", "before_after", "dds_heatmap", "flip_sample"} <= set(info["logged"])
    run_dir = Path(info["dir"]).parent  # .../wandb/offline-run-*/files -> the run folder
    assert run_dir.name.startswith("offline-run-")
    binary = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert GROUP.encode() in binary and b"tinytest-study" in binary
    tables = {p.name.split("_")[0] for p in (run_dir / "files" / "media" / "table").glob("*.table.json")}
    assert {"dds", "comparison", "flip"} <= tables
    dds_table = next((run_dir / "files" / "media" / "table").glob("dds_by_dataset_*.table.json"))
    assert "Baseline" in dds_table.read_text() and "DPO" in dds_table.read_text()
    for trainer in ("sft", "dpo"):
        train_runs = list((out / "train" / trainer / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(train_runs) == 1 and GROUP.encode() in train_runs[0].read_bytes()
        assert f"tinytest-{trainer}".encode() in train_runs[0].read_bytes()

    # an identical rerun: every stage skipped, nothing rewritten
    before = _finished(out)
    records = (out / "dds" / "baseline" / "records.jsonl").read_bytes()
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert all(f"--- {name}: skipped (up to date)" in printed for name in ALL_STAGES)
    assert _finished(out) == before and (out / "dds" / "baseline" / "records.jsonl").read_bytes() == records
    # the same through the full path (stage by stage fingerprints, no quick path)
    from flipguard.pipeline.study import run_study

    study = run_study(str(out / "recipe.yaml"), out)
    assert [(n, s) for n, s, _ in study.statuses] == [(n, "skipped") for n in ALL_STAGES]
    assert _finished(out) == before

    # --only redoes just that stage
    assert cli_main(["study", str(recipe), "--out", str(out), "--only", "sft-eval"]) == 0
    assert _redone(before, out) == {"sft-eval"} and _state(out)["stages"]["sft-eval"]["last_action"] == "redo"
    before = _finished(out)
    # --from redoes that stage and every one after it
    last = _state(out)["stages"]["dpo-merge"]["seconds"]
    capsys.readouterr()
    assert cli_main(["study", str(recipe), "--out", str(out), "--from", "dpo-merge"]) == 0
    assert _redone(before, out) == {"dpo-merge", "dpo-eval", "compare", "wandb"}
    # each stage's header says where the study stands and how long the stage took last time
    k = ALL_STAGES.index("dpo-merge") + 1
    assert f"] dpo-merge (redo, stage {k}/{len(ALL_STAGES)}, {last:.0f}s last time): " in capsys.readouterr().out
    before = _finished(out)
    # --only sft, then a plain rerun: the merged model and its evaluation were built from the old
    # adapter, so they are redone although every fingerprint still matches
    assert cli_main(["study", str(recipe), "--out", str(out), "--only", "sft"]) == 0
    assert _redone(before, out) == {"sft"}
    before = _finished(out)
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    assert _redone(before, out) == {"sft-merge", "sft-eval", "compare", "wandb"}
    before = _finished(out)

    # a changed dpo value invalidates exactly the stages that read it, and what depends on them
    changed = _recipe(tmp_path, beta=0.2)
    assert cli_main(["study", str(changed), "--out", str(out)]) == 0
    assert _redone(before, out) == {"dpo", "dpo-merge", "dpo-eval", "compare", "wandb"}
    assert yaml.safe_load((out / "recipe.yaml").read_text())["dpo"]["beta"] == 0.2
    before = _finished(out)
    # and a changed report setting redoes the test-split evaluations and what reads them, not training
    assert cli_main(["study", str(changed), "--out", str(out), "--eval_plan_n_boot", "40"]) == 0
    assert _redone(before, out) == {"baseline", "be_honest", "dehumanizing", "sft-eval", "dpo-eval", "compare", "wandb"}


@pytest.mark.slow
def test_a_kto_section_makes_the_study_train_merge_and_measure_kto(tmp_path, monkeypatch):
    """The third registered trainer needs nothing in the study: a recipe with its section gets its
    stages (from the pair builder's pairs), its merged model measured and its row in the comparison."""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    for other in ("sft", "dpo"):
        raw.pop(other)
    raw["report_to"] = "none"
    raw["eval"].update(limit=2, n_boot=50, mitigations=[])
    raw["pairs"]["datasets"] = "bbq"
    raw["kto"]["max_steps"] = 2
    recipe, out = tmp_path / "kto.yaml", tmp_path / "study"
    recipe.write_text(yaml.safe_dump(raw))

    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    state = _state(out)
    assert state["order"] == ["baseline", "base-train", "pairs", "kto", "kto-merge", "kto-eval", "compare"]
    assert {s["status"] for s in state["stages"].values()} == {"done"}
    provenance = json.loads((out / "train" / "kto" / "flipguard_training.json").read_text())
    assert provenance["trainer"] == "kto" and provenance["pairs_rows"] >= 1
    assert json.loads((out / "dds" / "kto-eval" / "run.json").read_text())["model"] == str(out / "models" / "kto-merged")
    table = pd.read_csv(out / "compare" / "comparison.csv")
    assert list(dict.fromkeys(table["condition"])) == ["Baseline", "KTO"]


def test_study_refuses_an_unknown_stage_and_a_none_mitigation(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    assert cli_main(["study", str(recipe), "--out", str(tmp_path / "s"), "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--only nope: no such stage" in err and "baseline" in err
    raw = yaml.safe_load(recipe.read_text())
    raw["eval"]["mitigations"] = ["none", "be_honest"]
    recipe.write_text(yaml.safe_dump(raw))
    assert cli_main(["study", str(recipe), "--out", str(tmp_path / "s2")]) == 2
    assert "eval.mitigations: 'none' is the baseline" in capsys.readouterr().err
    assert not (tmp_path / "s2").exists()


def test_study_refuses_a_task_it_cannot_stage_naming_the_recipe_key(tmp_path, capsys):
    """eval.protocols takes any registered task with a study stage: a duplicate, DDS (measured in every
    study; it has no Task.study_run) and a run config key of no such task are one error each, nothing run."""
    recipe = _recipe(tmp_path)
    raw = yaml.safe_load(recipe.read_text())
    cases = [({"protocols": ["sos", "sos"]}, "eval.protocols: sos listed more than once"),
             ({"protocols": ["dds"]}, "task 'dds' has no study stage"),
             ({"protocols": ["afr"], "afrr_config": "x.yaml"}, "eval.afrr_config: no registered task with a study stage")]
    for i, (evals, message) in enumerate(cases):
        recipe.write_text(yaml.safe_dump({**raw, "eval": {**raw["eval"], **evals}}))
        assert cli_main(["study", str(recipe), "--out", str(tmp_path / f"s{i}")]) == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert not (tmp_path / f"s{i}").exists()



def test_study_keeps_a_folder_it_did_not_write(tmp_path, capsys):
    """A stage output path already holding the user's files (no study entry, no run.json, no
    owner file) is refused, not cleared: flipguard never destroys what it did not write."""
    recipe, out = _recipe(tmp_path), tmp_path / "s"
    mine = out / "dds" / "baseline" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("my notes")
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "dds/baseline exists and was not written by this study" in err
    assert mine.read_text() == "my notes"


def test_train_scripts_are_subcommands_with_the_same_main(tmp_path, capsys):
    """`flipguard merge RECIPE ...` is train/merge.py's main: same checks, same one-line error."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    assert cli_main(["merge", str(ROOT / "recipes" / "tiny.yaml"), "--adapter", str(adapter), "--out", str(adapter)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flipguard merge: error:") and str(adapter) in err


@pytest.mark.slow
def test_study_adds_afr_and_stick_or_switch_where_the_recipe_asks(tmp_path, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    raw = yaml.safe_load(_recipe(tmp_path).read_text())
    raw["report_to"] = "none"
    raw["eval"].update(trainers=[], protocols=["afr", "sos"], mitigations=["be_honest"])
    recipe, out = tmp_path / "proto.yaml", tmp_path / "proto"
    recipe.write_text(yaml.safe_dump(raw))
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    assert _state(out)["order"] == ["baseline", "be_honest", "afr", "sos", "compare"]
    md = (out / "compare" / "comparison.md").read_text()
    assert "## Answer flips (AFR" in md and "## Stick-or-switch" in md
    afr = md.split("## Answer flips (AFR")[1].split("## Stick-or-switch")[0]
    afr_rows = [line for line in afr.splitlines() if line.startswith(("| Baseline | Baseline", "| Be Honest | Be Honest"))]
    assert len(afr_rows) == 2  # both conditions measured by AFR, each as its own target
    # view.html: the multi-turn runs' items too, named by condition (the page's data, as flipguard view builds it)
    from flipguard.pipeline.view import build_view

    assert (out / "view.html").stat().st_size > 0
    shown = {(e.get("protocol"), e["condition"]) for e in build_view(out)["entries"]}
    assert {("sos", "Baseline"), ("sos", "Be Honest")} <= shown, shown
    # the transfer report: every evaluated cell of each protocol, paired against the baseline, its role in
    # study.json (no pair set: "–"; first answers and C1 judgments are untargeted whatever was trained)
    cells = _state(out)["transfer"]["cells"]
    for protocol, framing, role in (("afr", "challenge", "–"), ("afr", "first", "untargeted"),
                                    ("sos", "first", "untargeted"), ("dds", "c1", "untargeted"), ("dds", "c2", "–")):
        assert any(c.startswith(f"{protocol}:") and c.endswith(f":{framing}") and r == role for c, r in cells.items()), \
            (protocol, framing, cells)
    transfer = pd.read_csv(out / "compare" / "transfer.csv")
    honest = transfer[transfer["condition"] == "Be Honest"]
    ok = honest["meaningful"].astype(bool)  # the tiny model's unreadable replies: their cells n/m, no numbers
    assert set(honest["protocol"]) == {"dds", "afr", "sos"} and honest.loc[ok, "ci_low"].notna().all() and ok.any()
    assert honest.loc[~ok, ["change", "ci_low", "ci_high"]].isna().all().all()
    assert (honest.loc[~ok, "verdict"] == "not meaningful").all()
    assert (honest["n_units"] > 0).all() and (out / "compare" / "transfer.png").stat().st_size > 0


@pytest.mark.slow
def test_a_study_killed_mid_stage_resumes_that_stage(tmp_path):
    """SIGKILL during the SFT stage: study.json keeps it 'running' (never 'done'), the
    adapter has no provenance, and the rerun redoes that stage and what follows, nothing before."""
    import os
    import signal
    import subprocess
    import sys
    import time

    raw = yaml.safe_load(_recipe(tmp_path).read_text())
    raw["report_to"] = "none"
    raw["eval"].update(mitigations=[], trainers=["sft"])
    raw["sft"]["max_steps"] = 400  # long enough to be killed while training
    recipe, out = tmp_path / "kill.yaml", tmp_path / "kill"
    recipe.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "TQDM_DISABLE": "1"}
    # one stage at a time, so every stage before sft is finished when it is killed (two at a time:
    # tests/test_study_jobs.py)
    proc = subprocess.Popen([sys.executable, "-m", "flipguard.pipeline.cli", "study", str(recipe), "--out", str(out),
                             "--jobs", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while ((json.loads((out / "study.json").read_text())["stages"].get("sft") or {}).get("status") != "running"
               if (out / "study.json").is_file() else True):
            assert proc.poll() is None and time.monotonic() < deadline, "the study ended before reaching sft"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    stages = _state(out)["stages"]
    assert stages["sft"]["status"] == "running" and "sft-merge" not in stages
    assert not (out / "train" / "sft" / "flipguard_training.json").exists()
    before = _finished(out)

    # rerun with a shorter schedule (so the test stays short): the killed stage is redone from
    # a cleared folder, the finished ones before it are skipped
    raw["sft"]["max_steps"] = 2
    recipe.write_text(yaml.safe_dump(raw))
    assert cli_main(["study", str(recipe), "--out", str(out), "--jobs", "1"]) == 0
    state = _state(out)
    assert _redone(before, out) == {"sft", "sft-merge", "sft-eval", "compare"}
    assert state["stages"]["sft"]["last_action"] == "redo" and {s["status"] for s in state["stages"].values()} == {"done"}
    assert (out / "train" / "sft" / "flipguard_training.json").is_file()


TASK_FILE = Path(__file__).resolve().parent.parent / "examples" / "are_you_sure_task.py"


def _cli(*args: str, cwd: Path):
    """A real `flipguard` process: a user's task is registered by --include in that process only."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1200, env={**__import__("os").environ, "TQDM_DISABLE": "1"})


def _are_you_sure_counts(run_dir: Path) -> dict[str, tuple[int, int]]:
    """metric -> (count, judgments) straight from the run's records.jsonl."""
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    turn = {(r["item_id"], r["case"]): r for r in records}
    pairs = [(r, turn[(r["item_id"], r["case"].replace("/t1", "/t2"))]) for r in records if r["case"].endswith("/t1")]
    return {"kept": (sum(a["choice"] == b["choice"] for a, b in pairs), len(pairs)),
            "accuracy_t1": (sum(a["choice"] == a["expected"] for a, _ in pairs), len(pairs)),
            "accuracy_t2": (sum(b["choice"] == b["expected"] for _, b in pairs), len(pairs))}


@pytest.mark.slow
def test_a_users_task_takes_part_in_the_study_and_the_comparison(tmp_path):
    """examples/are_you_sure_task.py, named in the recipe's eval.protocols and --include'd, gets its stage in
    a real `flipguard study` and its rows and section in the comparison, as the built-in protocols do;
    `flipguard compare --include ... --are_you_sure` reads the same runs."""
    raw = yaml.safe_load(_recipe(tmp_path).read_text())
    raw["report_to"] = "none"
    raw["eval"].update(trainers=[], protocols=["are-you-sure"], mitigations=["be_honest"])
    recipe, out = tmp_path / "user.yaml", tmp_path / "user"
    recipe.write_text(yaml.safe_dump(raw))

    # without the file the task is unknown: one error naming the recipe key, nothing run
    refused = _cli("study", str(recipe), "--out", str(out), cwd=tmp_path)
    assert refused.returncode == 2 and "eval.protocols: unknown task 'are-you-sure'" in refused.stderr, refused.stderr
    assert not (out / "study.json").exists()

    done = _cli("study", "--include", str(TASK_FILE), str(recipe), "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _state(out)["order"] == ["baseline", "be_honest", "are-you-sure", "compare"]
    run_dir = out / "are-you-sure" / "Baseline"
    counts = _are_you_sure_counts(run_dir)
    assert {n for _, n in counts.values()} == {2 * 2}  # eval.limit 2 items, a correct and an incorrect claim each

    table = pd.read_csv(out / "compare" / "comparison_protocols.csv")
    mine = table[table["protocol"] == "are-you-sure"]
    # the task has no prompting mitigation: the baseline only (no trained model in this recipe)
    assert set(zip(mine["condition"], mine["system"], mine["dataset"])) == {("Baseline", "Baseline", "amqa")}
    assert sorted(mine["metric"]) == sorted(counts)
    md = (out / "compare" / "comparison.md").read_text()
    section = md.split("## Are you sure? (a user's task)")[1]
    header = next(line for line in section.splitlines() if line.startswith("| Condition"))
    row = next(line for line in section.splitlines() if line.startswith("| Baseline | Baseline | amqa |"))
    cells = dict(zip([c.strip() for c in header.split("|")[1:-1]], [c.strip() for c in row.split("|")[1:-1]]))
    for r in mine.itertuples():
        k, n = counts[r.metric]
        assert r.n == n and r.value == pytest.approx(100 * k / n, abs=1e-3), r
        assert 0 <= r.ci_low <= r.value <= r.ci_high <= 100
        assert cells[r.metric].startswith(f"{100 * k / n:.1f} ["), cells

    # its items are on the study's page, named by condition
    from flipguard.pipeline.view import build_view

    assert ("are-you-sure", "Baseline") in {(e.get("protocol"), e["condition"]) for e in build_view(out)["entries"]}
    # flipguard view of one of its runs takes --include too: the task's own rows head the page
    page = _cli("view", "--include", str(TASK_FILE), str(run_dir), "--out", str(tmp_path / "ays.html"), cwd=tmp_path)
    assert page.returncode == 0 and (tmp_path / "ays.html").stat().st_size > 0, page.stderr[-2000:]
    import subprocess
    import sys

    code = (f"from flipguard.eval.task_includes import include_tasks; include_tasks({str(TASK_FILE)!r})\n"
            f"from flipguard.pipeline.view.runs import run_view; t = run_view(__import__('pathlib').Path({str(run_dir)!r}))"
            "['tables'][0]\nprint(t['title']); print(sorted(r['cells']['metric'] for r in t['rows']))")
    head = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert head.stdout.splitlines() == ["Are you sure? (a user's task)", str(sorted(counts))], head.stderr[-2000:]

    # flipguard compare: the same rows through --are_you_sure; a run of another task under that flag is refused
    cmp = _cli("compare", "--include", str(TASK_FILE), "--runs", f"Baseline={out / 'dds' / 'baseline'}",
               "--are_you_sure", f"Baseline={run_dir}", "--n_boot", "50", "--out", str(tmp_path / "cmp"), cwd=tmp_path)
    assert cmp.returncode == 0, cmp.stderr[-3000:]
    again = pd.read_csv(tmp_path / "cmp" / "comparison_protocols.csv")
    assert again.drop(columns="condition").equals(mine.drop(columns="condition").reset_index(drop=True))
    wrong = _cli("compare", "--include", str(TASK_FILE), "--runs", f"Baseline={out / 'dds' / 'baseline'}",
                 "--are_you_sure", f"Baseline={out / 'dds' / 'baseline'}", "--out", str(tmp_path / "cmp2"), cwd=tmp_path)
    assert wrong.returncode == 2 and "is a 'dds' run, not 'are-you-sure'" in wrong.stderr, wrong.stderr
