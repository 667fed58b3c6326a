"""Known ground truth against what a comparison measured (pipeline/ground_truth.py): a comparison of a
model with an organism.json writes ground_truth.csv/md (planted / measured / after, with 95% CIs, and
the success rule per mitigation), and its `flipguard view` page shows that table first, opened in a
real browser. Measured here on the shipped organism: DDS, AFR and stick-or-switch runs of a few items."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from test_view import Page, browser  # noqa: F401 - the module's browser fixture (a real Chromium)

from flipguard.data.organism_datasets import word_category
from flipguard.eval.embedded.organism_builder import ORGANISM_ALIAS, SHIPPED_DIR
from flipguard.pipeline.cli import main as cli_main
from flipguard.pipeline.ground_truth import GROUND_TRUTH_CSV, GROUND_TRUTH_MD

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def organism_cmp(tmp_path_factory, organism_path) -> Path:
    """The shipped organism measured as a study would: DDS (baseline and Be Honest), AFR and stick-or-switch."""
    root = tmp_path_factory.mktemp("ground-truth")
    flags = ["eval", "--model", ORGANISM_ALIAS, "--datasets", "organism", "--limit", "12"]
    assert cli_main([*flags, "--out", str(root / "baseline")]) == 0
    assert cli_main([*flags, "--mitigation", "be_honest", "--c1_from", str(root / "baseline"),
                     "--out", str(root / "honest")]) == 0
    assert cli_main(["afr", str(REPO / "recipes" / "afr_organism.yaml"), "--per_subject", "3", "--n_boot", "50",
                     "--progress", "false", "--out", str(root / "afr")]) == 0
    assert cli_main(["sos", str(REPO / "recipes" / "sos_organism.yaml"), "--limit", "8", "--n_boot", "50",
                     "--out", str(root / "sos")]) == 0
    out = root / "cmp"
    assert cli_main(["compare", "--runs", f"Baseline={root / 'baseline'},Be Honest={root / 'honest'}",
                     "--afr", f"Baseline={root / 'afr'}@organism", "--sos", f"Baseline={root / 'sos'}@flipguard:organism",
                     "--out", str(out), "--n_boot", "50"]) == 0
    return out


def test_the_comparison_of_an_organism_writes_planted_measured_after_with_the_rule(organism_cmp):
    table = pd.read_csv(organism_cmp / GROUND_TRUTH_CSV)
    info = json.loads((SHIPPED_DIR / "organism.json").read_text())
    kinds = set(info["planted"]["capitulation_kinds"])
    at = table.set_index(["metric", "condition"])
    # DDS: comparison.csv's, on the organism's claims, with its CI, and the planted value beside it
    dds = pd.read_csv(organism_cmp / "comparison.csv").set_index(["condition", "dataset"])
    for condition in ("Baseline", "Be Honest"):
        assert at.loc[("dds", condition), "value"] == pytest.approx(dds.loc[(condition, "organism"), "dds"], abs=1e-3)
        assert at.loc[("dds", condition), "planted"] == f"{info['planted']['expected_dds']:+.1f}"
    # AFR on the planted and the unplanted kinds: the run's challenges, pooled by the argued option's kind
    records = [json.loads(line) for line in (organism_cmp.parent / "afr" / "records.jsonl").read_text().splitlines()]
    sample = {q["id"]: q for q in map(json.loads, (organism_cmp.parent / "afr" / "sample.jsonl").read_text().splitlines())}
    flips: dict[bool, list[int]] = {True: [], False: []}
    for r in records:
        if r["case"] == "challenge":
            option = sample[r["item_id"]]["options"]["ABCD".index(r["extra"]["target_option"])]
            flips[word_category(option) in kinds].append(int(r["choice"] != r["expected"]))
    for metric, planted in (("afr_planted", True), ("afr_unplanted", False)):
        row = at.loc[(metric, "Baseline")]
        assert row["n"] == len(flips[planted]) > 0
        assert row["value"] == pytest.approx(100 * sum(flips[planted]) / len(flips[planted]), abs=1e-3)
        assert row["ci_low"] <= row["value"] <= row["ci_high"]
    # the shipped organism capitulates on its planted kinds and holds on the rest, as planted
    assert at.loc[("afr_planted", "Baseline"), "value"] > 50 > at.loc[("afr_unplanted", "Baseline"), "value"]
    # stick-or-switch and the first answers: comparison_protocols.csv's numbers
    proto = pd.read_csv(organism_cmp / "comparison_protocols.csv").set_index(["condition", "protocol", "metric"])
    for metric, key in (("sos_correct_switch", ("sos", "correct_switch")), ("sos_incorrect_switch", ("sos", "incorrect_switch")),
                        ("afr_first", ("afr", "accuracy")), ("sos_first", ("sos", "ss_accuracy"))):
        assert at.loc[(metric, "Baseline"), "value"] == pytest.approx(proto.loc[("Baseline", *key), "value"], abs=1e-3)
    # own C1: the level for the measured column, the paired change for a mitigation
    assert pd.isna(at.loc[("own_c1", "Baseline"), "change"]) and not pd.isna(at.loc[("own_c1", "Be Honest"), "change"])
    # the rule on Be Honest (planted to change nothing): DDS not removed, AFR and stick-or-switch not measured for it
    md = (organism_cmp / GROUND_TRUTH_MD).read_text()
    assert "- **Be Honest**: not met: dds " in md and "not read: afr_planted, sos_correct_switch, capability" in md
    assert "## Ground truth" in (organism_cmp / "comparison.md").read_text()


def test_the_page_shows_the_ground_truth_table_first(browser, organism_cmp):  # noqa: F811
    page = Page(browser, organism_cmp / "view.html")
    sections = page.page.locator("main > section").evaluate_all("(s) => s.map((x) => x.id)")
    assert sections[1] == "sec-ground_truth"  # after the answer, before every other table
    table = pd.read_csv(organism_cmp / GROUND_TRUTH_CSV)
    for r in table.itertuples():
        column = {"Baseline": "c0", "Be Honest": "c1"}[r.condition]
        shown = page.cell("ground_truth", r.metric, column).text_content()
        assert shown.startswith(f"{r.value:+.1f}" if r.metric == "dds" else f"{r.value:.1f}"), (r, shown)
        if not pd.isna(r.ci_low):
            assert f"[{r.ci_low:{'+' if r.metric == 'dds' else ''}.1f}," in shown
        assert page.cell("ground_truth", r.metric, "planted").text_content() == str(r.planted)
    note = page.page.locator("#sec-ground_truth .note").text_content()
    assert "Be Honest: not met: dds" in note
    page.close()
