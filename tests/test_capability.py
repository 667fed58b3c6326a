"""The capability guard (pipeline/capability.py): lm-evaluation-harness's Python API on a local
MMLU task built from the shipped samples, offline, on the embedded tiny model; its per-question
results paired in the transfer report."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from flipguard.data.mmlu import load_mmlu
from flipguard.files import PACKAGE_ROOT
from flipguard.pipeline import capability as C
from flipguard.pipeline import transfer as T
from flipguard.pipeline.cli import main as cli_main

pytest.importorskip("lm_eval")


def test_the_local_task_holds_the_shipped_questions(tmp_path):
    folder = C.write_task(tmp_path / "task", per_subject=1, data_root=None)
    rows = [json.loads(line) for line in (folder / f"{C.TASK}.jsonl").read_text().splitlines()]
    subjects = {it.subject for it in load_mmlu("test")}
    assert len(rows) == len(subjects) and {r["subject"] for r in rows} == subjects
    first = rows[0]
    item = next(it for it in load_mmlu("test") if it.id == first["id"])
    assert first["choices"] == list(item.options) and "ABCD"[first["answer"]] == item.answer
    config = yaml.safe_load((folder / f"{C.TASK}.yaml").read_text())
    assert config["dataset_path"] == "json" and config["output_type"] == "multiple_choice"


def test_lm_eval_runs_offline_on_the_tiny_model_and_pairs_per_question(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    units_csv = C.run_capability({"Baseline": "flipguard:tiny", "Same": "flipguard:tiny"}, tmp_path / "cap",
                                 per_subject=1, device="cpu", batch_size=16, limit=12)
    frame = pd.read_csv(units_csv)
    n = 12  # one question per subject, the first 12 subjects
    assert frame.groupby("condition").size().to_dict() == {"Baseline": n, "Same": n}
    assert set(frame["value"]) <= {0.0, 1.0}
    # the same model twice answers every question the same: change 0, a zero-width CI, McNemar p 1
    units = pd.DataFrame(C.capability_units(units_csv, ["Baseline", "Same"]))
    table = T.transfer_table(units, {C.PROTOCOL: (C.FRAMING,)}, T.Roles(None), n_boot=200)
    row = table[table["condition"] == "Same"].iloc[0]
    assert row["cell"] == "capability:mmlu:lm-eval" and row["role"] == "untargeted"
    assert (row["change"], row["ci_low"], row["ci_high"], row["mcnemar_p"]) == (0.0, 0.0, 0.0, 1.0)
    assert row["baseline"] == pytest.approx(100 * frame[frame["condition"] == "Baseline"]["value"].mean())


def test_the_study_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    raw = yaml.safe_load((PACKAGE_ROOT / "recipes" / "tiny.yaml").read_text())
    raw["report_to"] = "none"
    raw["eval"].update(trainers=[], mitigations=["be_honest"], capability=True, capability_per_subject=1, limit=4)
    recipe, out = tmp_path / "cap.yaml", tmp_path / "study"
    recipe.write_text(yaml.safe_dump(raw))
    assert cli_main(["study", str(recipe), "--out", str(out)]) == 0
    state = json.loads((out / "study.json").read_text())
    assert state["order"] == ["baseline", "be_honest", "capability", "compare"]
    assert state["transfer"]["cells"]["capability:mmlu:lm-eval"] == "untargeted"
    transfer = pd.read_csv(out / "compare" / "transfer.csv")
    assert "capability:mmlu:lm-eval" in set(transfer[transfer["condition"] == "Baseline"]["cell"])
