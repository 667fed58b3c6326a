"""`flipguard study RECIPE --grid KEY=V1,V2`: the recipe's training settings varied in one study.
The shipped tiny recipe's grid runs through a real `flipguard` process (the base model's runs, the
pairs and the trainers no key reaches once; each DPO variant trained, measured and compared), its
table's numbers are the variants' comparisons' own, a mistyped key is one line; a grid with wandb on
logs a run per variant in the recipe's group, and its study page shows the chart in a real browser."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_view import Page, browser  # noqa: F401  (the page in the system's headless chromium)

from flipguard.pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
GROUP = "grid-test-group"


def _flipguard(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "TQDM_DISABLE": "1"})


def _state(out: Path) -> dict:
    return json.loads((out / "study.json").read_text())


def _total(compare: Path, condition: str) -> dict:
    table = pd.read_csv(compare / "comparison.csv")
    return table[(table["dataset"] == "total_avg") & (table["condition"] == condition)].iloc[0].to_dict()


def _provenance(adapter: Path) -> dict:
    return json.loads((adapter / "flipguard_training.json").read_text())


def _markdown_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """(header, rows of cells) of the one table in a markdown file."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    split = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in lines]
    return split[0], split[1:]


def _same(a, b) -> bool:
    return (pd.isna(a) and pd.isna(b)) or a == pytest.approx(b, abs=1e-4)


@pytest.mark.slow
def test_the_tiny_recipes_grid_trains_each_variant_and_shares_the_rest(tmp_path):
    out = tmp_path / "study"
    done = _flipguard("study", "recipes/tiny.yaml", "--grid", "dpo.beta=0.1,0.5", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Recipe grid" in done.stdout

    state = _state(out)
    order = state["order"]
    # the base model's runs, the pairs and the trainers no grid key reaches: once, in the study folder
    shared = ["baseline", "be_honest", "dehumanizing", "base-train", "pairs", "sft", "sft-merge", "sft-eval",
              "kto", "kto-merge", "kto-eval"]
    per_variant = [f"dpo.beta={b}:{s}" for b in ("0.1", "0.5") for s in ("dpo", "dpo-merge", "dpo-eval", "compare")]
    assert sorted(order) == sorted([*shared, *per_variant, "grid"])
    assert {n: (s["status"], s["last_action"]) for n, s in state["stages"].items()} == {n: ("done", "run") for n in order}
    assert not list((out / "grid").glob("*/dds/baseline")) and not list((out / "grid").glob("*/pairs"))
    # each DPO variant is trained with its own beta on the shared pairs and measured against the one baseline
    for beta in (0.1, 0.5):
        variant = out / "grid" / f"dpo.beta={beta}"
        provenance = _provenance(variant / "train" / "dpo")
        assert provenance["resolved"]["DPOConfig"]["beta"] == beta
        assert provenance["resolved"]["PairsArguments"]["pairs_dir"] == str(out / "pairs")
        meta = json.loads((variant / "dds" / "dpo-eval" / "run.json").read_text())
        assert meta["model"] == str(variant / "models" / "dpo-merged")
        assert meta["c1_from"] == str((out / "dds" / "baseline").resolve())
        recipe = yaml.safe_load((variant / "recipe.yaml").read_text())
        assert recipe["dpo"]["beta"] == beta and recipe["sft"]["output_dir"] == str(out / "train" / "sft")
        compared = pd.read_csv(variant / "compare" / "comparison.csv")
        assert list(dict.fromkeys(compared["condition"])) == ["Baseline", "Be Honest", "Dehumanizing", "SFT", "DPO", "KTO"]

    # the table: a row per trained model, its numbers its variant's comparison's
    table = pd.read_csv(out / "grid" / "variants.csv", dtype={"dpo.beta": str}, keep_default_na=False, na_values=[""])
    assert list(zip(table["trainer"], table["variant"])) == [("SFT", "(every variant)"), ("DPO", "dpo.beta=0.1"),
                                                            ("DPO", "dpo.beta=0.5"), ("KTO", "(every variant)")]
    assert list(table["dpo.beta"].fillna("")) == ["", "0.1", "0.5", ""]
    for r in table.to_dict("records"):
        compare = Path(r["compare"])
        want = _total(compare, r["trainer"])
        for col in ("own_c1_true", "own_c1_false", "c1_true_change", "c1_false_change"):
            assert _same(r[col], want[col]), (r["variant"], col)
        assert r["invalid_after"] == want["invalid_judgments"]
        assert ("‡" in str(r["flags"])) == (want["c1_damage"] is True or str(want["c1_damage"]) == "True")
        adapter = (compare.parent if r["trainer"] == "DPO" else out) / "train" / r["trainer"].lower()
        assert r["train_loss"] == pytest.approx(_provenance(adapter)["log_history"][-1]["train_loss"], abs=1e-4)
    dpo = table[table["trainer"] == "DPO"]
    assert dpo["compare"].nunique() == 2 and dpo["train_loss"].nunique() == 2  # another beta, another DPO loss
    assert "| dpo.beta=0.5 | DPO |" in (out / "grid" / "variants.md").read_text()
    assert (out / "grid" / "variants.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # an identical rerun: every stage up to date, the table printed again
    again = _flipguard("study", "recipes/tiny.yaml", "--grid", "dpo.beta=0.1,0.5", "--out", str(out), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"--- {n}: skipped (up to date)" in again.stdout for n in order) and "Recipe grid" in again.stdout
    assert {n: s["finished"] for n, s in _state(out)["stages"].items()} == {n: s["finished"] for n, s in state["stages"].items()}

    # a mistyped key: one line naming the key meant, exit 2, nothing written
    typo = _flipguard("study", "recipes/tiny.yaml", "--grid", "dpo.bta=0.1,0.5", "--out", str(tmp_path / "typo"), cwd=tmp_path)
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr.strip().splitlines() == [
        "flipguard study: error: --grid dpo.bta=0.1,0.5: 'dpo.bta' is not a recipe key; did you mean 'dpo.beta'?"]
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("spec, says", [
    ("dpo.bta=0.1,0.5", "'dpo.bta' is not a recipe key; did you mean 'dpo.beta'?"),
    ("beta=0.1", "'beta' is not a recipe key; did you mean 'dpo.beta'?"),
    ("dpo.beta", "give KEY=V1,V2,..."),
    ("dpo.beta=0.1,", "an empty value"),
    ("dpo.beta=0.1,0.1", "a value is given twice"),
    ("dpo.beta=high", "key 'dpo.beta' must be a number, got 'high'"),
    ("dpo.max_steps=-2", "key 'dpo.max_steps' must be"),
    ("kto.beta=0.1", "this study trains no kto (it trains sft, dpo)"),
    ("eval.limit=2,4", "not eval:"),
    ("pairs.dir=a,b", "pairs.dir names a folder, which the study sets itself"),
    ("dpo.output_dir=X1,X2", "dpo.output_dir names a folder, which the study sets itself"),
    ("sft.resume_from_checkpoint=c1,c2", "sft.resume_from_checkpoint names a folder"),
    ("model_name_or_path=flipguard:tiny,flipguard:organism", "changes the stage baseline, which the variants share"),
])
def test_a_grid_key_or_value_the_recipe_would_refuse_is_one_line(tmp_path, capsys, spec, says):
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw.pop("kto")
    recipe, out = tmp_path / "recipe.yaml", tmp_path / "study"
    recipe.write_text(yaml.safe_dump(raw))
    assert cli_main(["study", str(recipe), "--grid", spec, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("flipguard study: error: --grid ") and says in err, err
    assert not out.exists()


@pytest.mark.slow
def test_a_grid_with_wandb_logs_each_variant_in_one_group_and_its_page_shows_the_chart(tmp_path, monkeypatch, browser):  # noqa: F811
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    for other in ("sft", "kto"):
        raw.pop(other)
    raw["report_to"] = ["wandb"]
    raw["dpo"]["max_steps"] = 2
    raw["eval"].update(limit=2, n_boot=50, mitigations=[])
    raw["pairs"]["datasets"] = "bbq"
    raw["tracking"].update(run_name="gridtest", group=GROUP)
    recipe, out = tmp_path / "recipe.yaml", tmp_path / "study"
    recipe.write_text(yaml.safe_dump(raw))
    done = _flipguard("study", str(recipe), "--grid", "dpo.learning_rate=1.0e-2,1.0e-3", "--jobs", "2", "--out", str(out),
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "up to 2 independent stages at once" not in done.stdout  # --jobs given: no auto line
    state = _state(out)
    assert [n for n in state["order"] if n.endswith(":wandb")] == ["dpo.learning_rate=0.01:wandb",
                                                                 "dpo.learning_rate=0.001:wandb"]

    # wandb (offline): a study run per variant, named and configured by its values, in the recipe's group
    names = []
    for lr in ("0.01", "0.001"):
        info = json.loads((out / "grid" / f"dpo.learning_rate={lr}" / "wandb_run.json").read_text())
        assert info["group"] == GROUP and info["project"] == "flipguard"
        assert info["name"] == f"gridtest-study-dpo.learning_rate={lr}"
        binary = next(Path(info["dir"]).parent.glob("run-*.wandb")).read_bytes()  # the offline run's record
        assert GROUP.encode() in binary and info["name"].encode() in binary
        assert f'"grid_variant":{{"dpo.learning_rate":{lr}}}'.encode() in binary  # its values, in the run's config
        names.append(info["name"])
    assert len(set(names)) == 2

    # the study's page: the grid section, its chart (the PNG the grid stage wrote) and its table (the CSV's cells)
    page = Page(browser, out / "view.html")
    try:
        img = page.page.locator("#grid-chart img")
        assert img.count() == 1
        png = (out / "grid" / "variants.png").read_bytes()
        assert img.get_attribute("src") == "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        assert img.evaluate("i => i.complete && i.naturalWidth") > 300  # decoded and drawn by the browser
        assert "A recipe grid" in page.page.locator("#answer").text_content()
        # the table under the chart is variants.md's, cell for cell (not the CSV's raw columns)
        head, body = _markdown_table(out / "grid" / "variants.md")
        assert [h.text_content() for h in page.page.locator("#table-grid thead th").all()] == head
        assert page.page.locator("#table-grid tbody tr").count() == len(body) == 2
        for cells in body:
            row = page.page.locator(f"#table-grid tr[data-row=\"{cells[0]}|{cells[1]}\"] td")
            assert [c.text_content() for c in row.all()] == cells
    finally:
        page.close()


def test_a_pairs_key_gives_a_pairs_stage_per_setting_shared_by_the_variants_with_it(tmp_path):
    """The plan of a two-key grid (no stage run): the baseline once; a pairs stage per pairs.accept_weight, read by
    that setting's trainers only; SFT (no dpo key reaches it) per pairs setting; DPO and the comparison per variant."""
    from flipguard.pipeline.grid import GridPlan

    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw.pop("kto")
    out = tmp_path / "study"
    plan = GridPlan(str(ROOT / "recipes" / "tiny.yaml"), raw, out, grid=["pairs.accept_weight=1,3", "dpo.beta=0.1,0.5"])
    stages = {s.name: s for s in plan.stages}
    assert [n for n in stages if ":" not in n] == ["baseline", "be_honest", "dehumanizing", "base-train", "grid"]
    for w in (1, 3):
        pairs = stages[f"pairs.accept_weight={w}:pairs"]
        assert pairs.params["pairs"]["accept_weight"] == w and pairs.inputs == ("base-train",)
        assert pairs.clear == (out / "grid" / f"pairs.accept_weight={w}" / "pairs",)
        assert stages[f"pairs.accept_weight={w}:sft"].inputs == (f"pairs.accept_weight={w}:pairs",)
        for beta in (0.1, 0.5):
            variant = f"pairs.accept_weight={w},dpo.beta={beta}"
            assert stages[f"{variant}:dpo"].inputs == (f"pairs.accept_weight={w}:pairs",)
            assert stages[f"{variant}:dpo"].params["dpo"]["beta"] == beta
            assert set(stages[f"{variant}:compare"].inputs) == {"baseline", "be_honest", "dehumanizing",
                                                                f"pairs.accept_weight={w}:sft-eval", f"{variant}:dpo-eval"}
    assert len([n for n in stages if n.endswith(":compare")]) == 4 and len([n for n in stages if n.endswith(":sft")]) == 2
    assert set(stages["grid"].inputs) == {n for n in stages if n.endswith(":compare")}
    # each variant's effective recipe: its values, the pairs and adapters of its settings
    recipes = {str(path.relative_to(out)): r for path, r in plan.effective_recipes()}
    mine = recipes["grid/pairs.accept_weight=3,dpo.beta=0.5/recipe.yaml"]
    assert mine["pairs"]["accept_weight"] == 3 and mine["dpo"]["beta"] == 0.5
    assert mine["pairs"]["dir"] == str(out / "grid" / "pairs.accept_weight=3" / "pairs")
    assert mine["sft"]["output_dir"] == str(out / "grid" / "pairs.accept_weight=3" / "train" / "sft")
    assert mine["pairs"]["records"] == str(out / "dds" / "base-train")
