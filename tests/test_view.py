"""`flipguard view`: pages opened in a real headless Chromium (the system's `chromium`, driven by
playwright through executable_path). Every test blocks and records the page's requests and asserts
none left the file; numbers in the DOM are checked against the CSVs the reports wrote.

Without a browser these tests skip, except where CI requires them (CI=true or
FLIPGUARD_REQUIRE_BROWSER=1, as .ci/run sets): then a missing browser fails them.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest
from fixture_runs import written_by_flipguard

from flipguard.eval.records import EXPECTED_CHOICE, Record, RecordStore
from flipguard.files import atomic_write_json
from flipguard.pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
# every judgment valid (the tiny model's label mass is tiny); the report is written after the edits below
TINY_FLAGS = ["--model", "flipguard:tiny", "--datasets", "truthfulqa,bbq", "--limit", "3", "--min_label_mass", "0", "--no_report"]


def _chromium() -> str | None:
    return os.environ.get("FLIPGUARD_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.fixture(scope="module")
def browser():
    required = os.environ.get("CI") == "true" or os.environ.get("FLIPGUARD_REQUIRE_BROWSER") == "1"
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "playwright is not installed (pip install -e '.[dev]')"
    path = _chromium()
    if path is None:
        missing = missing or "no chromium on PATH (apt-get install -y chromium)"
    if missing:
        (pytest.fail if required else pytest.skip)(missing)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class Page:
    """A page opened from disk with every request recorded and any that is not the file itself aborted."""

    def __init__(self, browser, path: Path, width: int = 1400):
        self.url = path.resolve().as_uri()
        self.context = browser.new_context(viewport={"width": width, "height": 900})
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.context.on("request", lambda r: self.requests.append(r.url))
        self.context.route("**/*", lambda route: route.continue_() if route.request.url == self.url else route.abort())
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.goto(self.url)
        self.page.wait_for_selector("body[data-ready='1']")

    def close(self):
        assert self.errors == [], self.errors
        assert self.dialogs == [], self.dialogs
        assert [u for u in self.requests if u != self.url] == [], "the page made network requests"
        self.context.close()

    def cell(self, table: str, row: str, col: str):
        return self.page.locator(f"#table-{table} tr[data-row=\"{row}\"] td[data-col=\"{col}\"]")

    def rows(self):
        return self.page.locator("#entries tbody tr")


def _csv(path: Path) -> list[dict]:
    import csv

    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _shown(cell) -> str:
    """A CSV cell as the page holds it: the file's text (data-value for a number it rounds, checked against it)."""
    raw = cell.get_attribute("data-value")
    if raw is not None:
        assert cell.text_content() == f"{float(raw):.4g}"
    return cell.text_content() if raw is None else raw


def _as_shown(row: dict, col: str) -> str:
    """A CSV cell's text as the page shows it: the file's text, n/m where a not-meaningful row left it empty."""
    value = row[col]
    text_columns = {"flags", "note", "kind", "system", "dataset", "stratum", "reading", "model", "condition", "cell"}
    return "n/m" if value == "" and row.get("meaningful") == "False" and col not in text_columns else value


def _set_choice(run: Path, edits: dict[tuple[str, str], str]) -> None:
    """Give some judgments of a tiny-model run the other label (its P("1")/P("2") swapped with it): the
    tiny model says "1" to every claim, so a run of it has no flip of its own."""
    path = run / "records.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        choice = edits.get((r["item_id"], r["case"]))
        if choice and choice != r["choice"]:
            r.update(choice=choice, raw_output=choice, p1=r["p2"], p2=r["p1"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _items(run: Path, dataset: str) -> list[str]:
    """The run's item ids of one dataset, in order (bbq's ids name their category)."""
    rows = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    return list(dict.fromkeys(r["item_id"] for r in rows if r["dataset"] == dataset))


@pytest.fixture(scope="module")
def dds_run(tmp_path_factory) -> Path:
    """A DDS run of the tiny model with deference flips on two items and skepticism on one."""
    run = tmp_path_factory.mktemp("view") / "dds"
    assert cli_main(["eval", *TINY_FLAGS, "--out", str(run)]) == 0
    bbq, tqa = _items(run, "bbq")[1], _items(run, "truthfulqa")  # --limit's seeded sample of each dataset
    _set_choice(run, {(tqa[0], "c1_false"): "2", (bbq, "c1_false"): "2", (tqa[2], "c2_correct"): "2"})
    assert cli_main(["report", str(run), "--n_boot", "50"]) == 0
    return run


def test_dds_page_shows_the_summary_and_the_flips_with_both_prompts(browser, dds_run, tmp_path):
    out = tmp_path / "page.html"
    assert cli_main(["view", str(dds_run), "--out", str(out)]) == 0
    html = out.read_text(encoding="utf-8")
    assert "http://" not in html and "https://" not in html and "<link" not in html  # nothing to fetch
    page = Page(browser, out)
    summary = _csv(dds_run / "report" / "summary.csv")
    assert [r["dataset"] for r in summary] == ["truthfulqa", "bbq", "bench_avg", "total_avg"]
    for r in summary:
        for col, signed in (("dds", True), ("c1_true", False), ("c2_incorrect", False)):
            cell = page.cell("headline", r["dataset"], col)
            assert float(cell.get_attribute("data-value")) == float(r[col])
            assert cell.text_content() == (f"{float(r[col]):+.1f}" if signed else f"{float(r[col]):.1f}")
    stats = {r["dataset"]: r for r in _csv(dds_run / "report" / "stats.csv") if r["stratum"] == "all"}
    for dataset, r in stats.items():
        assert float(page.cell("headline", dataset, "own_dds").get_attribute("data-value")) == float(r["own_dds"])
        assert page.cell("headline", dataset, "invalid_judgments").text_content() == r["invalid_judgments"]
    assert page.page.locator("#table-provenance tr[data-row='model'] td").text_content() == "flipguard:tiny"
    meta = json.loads((dds_run / "report" / "summary.json").read_text())["meta"]
    for note in (meta.get(k) for k in ("capability_note", "c1_mode_note", "c1_differs_note", "aio_note")):
        assert note is None or note in page.page.locator("#sec-headline .note").text_content()

    flips = [r for r in _csv(dds_run / "report" / "flips.csv") if r["flip"]]
    total = {r["dataset"]: r for r in _csv(dds_run / "report" / "flips_summary.csv")}["total"]
    assert len(flips) == int(total["deference"]) + int(total["skepticism"]) == 3
    page.page.select_option("#filter-type", "deference")
    rows = page.rows()
    assert rows.count() == int(total["deference"]) == 2
    bbq, tqa = _items(dds_run, "bbq")[1], _items(dds_run, "truthfulqa")
    assert sorted(rows.nth(i).locator("td").nth(4).text_content() for i in range(2)) == sorted([bbq, tqa[0]])
    page.page.select_option("#filter-type", "skepticism")
    assert page.rows().count() == 1 and page.rows().first.locator("td").nth(4).text_content() == tqa[2]
    page.page.select_option("#filter-type", "")
    page.page.select_option("#filter-dataset", "bbq")
    assert page.rows().count() == len([r for r in flips if r["dataset"] == "bbq"])  # no invalid judgment: label mass 0 allowed

    # a flip clicked: both prompts (the C1 statement, the C2 conversation) and both replies, the difference marked
    page.page.locator("#entries tbody tr[data-type='deference']").first.click()
    records = {json.loads(line)["key"]: json.loads(line) for line in (dds_run / "records.jsonl").read_text().splitlines()}
    flip = next(r for r in flips if r["item_id"] == page.page.locator("#entries tbody tr.sel td").nth(4).text_content())
    panels = page.page.locator("#detail .panel")
    assert panels.count() == 2
    for i, key in enumerate((flip["c1_key"], flip["c2_key"])):
        prompt = records[key]["messages"][-1]["content"]
        assert prompt.strip() in panels.nth(i).locator("pre.prompt").last.text_content()
        assert panels.nth(i).locator("pre.reply").text_content() == records[key]["raw_output"]
    assert panels.nth(0).locator("pre.reply").text_content() == "2" and panels.nth(1).locator("pre.reply").text_content() == "1"
    marks = [panels.nth(i).locator("mark").first.text_content() for i in range(2)]
    assert marks[0] and marks[1] and marks[0] != marks[1]
    assert page.page.locator("#detail td[data-fact='P(\"1\")']").count() == 2

    # search finds the item by its text; the screenshot is the page as a user sees it
    page.page.select_option("#filter-dataset", "")
    page.page.fill("#search", tqa[2])
    assert page.rows().count() == 1
    shot = tmp_path / "dds.png"
    page.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    page.close()


def test_compressed_page_reads_the_same(browser, dds_run, tmp_path):
    plain, packed = tmp_path / "plain.html", tmp_path / "packed.html"
    assert cli_main(["view", str(dds_run), "--out", str(plain), "--compress", "never"]) == 0
    assert cli_main(["view", str(dds_run), "--out", str(packed), "--compress", "always"]) == 0
    assert 'data-encoding="gzip-base64"' in packed.read_text() and 'data-encoding="json"' in plain.read_text()
    texts = []
    for path in (plain, packed):
        page = Page(browser, path)
        texts.append(page.page.locator("main").inner_text())
        page.close()
    assert texts[0] == texts[1] and "deference" in texts[0]


@pytest.fixture(scope="module")
def honest_run(tmp_path_factory, dds_run) -> Path:
    """The tiny model with the Be Honest prompt, C1 from dds_run: one C2 judgment fixed, one broken."""
    honest = tmp_path_factory.mktemp("view") / "honest"
    assert cli_main(["eval", *TINY_FLAGS, "--mitigations", "be_honest", "--c1_from", str(dds_run), "--out", str(honest)]) == 0
    _set_choice(honest, {(_items(honest, "truthfulqa")[0], "c2_incorrect"): "2",
                         (_items(honest, "bbq")[0], "c2_correct"): "2"})  # one fixed, one broken
    return honest


def test_comparison_page_matches_comparison_csv_and_lists_items_fixed_and_broken(browser, dds_run, honest_run, tmp_path):
    honest = honest_run
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"Baseline={dds_run},Be Honest={honest}", "--out", str(out), "--n_boot", "50"]) == 0
    page = Page(browser, out / "view.html")
    table = _csv(out / "comparison.csv")
    assert len(table) >= 4
    for r in table:
        for col in ("dds", "c2_correct", "c2_incorrect", "delta_dds"):
            cell = page.cell("comparison", f"{r['condition']}|{r['dataset']}", col)
            if r[col] == "":  # not measured, or not meaningful (the model answers one label: its DDS)
                assert cell.text_content() == ("n/m" if r["meaningful"] == "False" else "–")
            else:
                assert float(cell.get_attribute("data-value")) == float(r[col])
        flags = page.cell("comparison", f"{r['condition']}|{r['dataset']}", "flags").text_content()
        assert ("†" in flags) == (r["over_correction"] == "True")
    sig = {(r["condition"], r["dataset"]): r for r in _csv(out / "significance.csv")}["Be Honest", "total_avg"]
    page.page.select_option("#filter-type", "broken")
    assert page.rows().count() == int(sig["worse"]) >= 1
    page.page.select_option("#filter-type", "fixed")
    assert page.rows().count() == int(sig["better"]) >= 1
    page.page.select_option("#filter-dataset", "truthfulqa")
    page.page.select_option("#filter-case", "c2_incorrect")
    assert page.rows().count() == 1  # the edited judgment
    page.rows().first.click()
    titles = page.page.locator("#detail .panel h3").all_text_contents()
    assert titles == ["Baseline: c2_incorrect", "Be Honest: c2_incorrect"]
    assert page.page.locator("#detail pre.reply").all_text_contents() == ["1", "2"]
    # dds_heatmap.png, before_after.png and transfer.png (compare writes the transfer report too), inlined
    assert page.page.locator("#plots img").count() == 3 and (tmp_path / "cmp" / "transfer.png").is_file()
    assert page.page.evaluate("Array.from(document.querySelectorAll('.plots img')).every(i => i.complete && i.naturalWidth > 100)")
    page.close()


def test_study_page_lists_every_stage_with_its_status(browser, dds_run, tmp_path):
    """A study folder (study.json as flipguard study writes it, one stage left "running" by a process that is
    gone: the page, which reads only a study no process holds, shows it interrupted) and its compare/."""
    from flipguard.pipeline.study import STUDY_FILE, STUDY_FORMAT

    study = tmp_path / "study"
    assert cli_main(["compare", "--runs", f"Baseline={dds_run}", "--out", str(study / "compare"), "--n_boot", "20"]) == 0
    stages = {"baseline": {"status": "done", "seconds": 12.5, "last_action": "run"},
              "compare": {"status": "done", "seconds": 3.25, "last_action": "redo"},
              "sft": {"status": "running"}}
    atomic_write_json(study / STUDY_FILE, {"format": STUDY_FORMAT, "model": "flipguard:tiny", "recipe": "recipes/tiny.yaml",
                                           "order": ["baseline", "sft", "compare", "dpo"], "stages": stages})
    assert cli_main(["view", str(study)]) == 0
    page = Page(browser, study / "view.html")
    # the answer first, the tables, then provenance and the stages' times last
    assert _sections(page)[0] == "answer" and _sections(page)[-2:] == ["provenance", "sec-stages"]
    assert page.page.locator("main > section > h2").all_text_contents()[-2:] == ["Provenance", "Stages"]
    notes = " ".join(page.page.locator("#answer .answer-note").all_text_contents())
    assert "Study not finished: sft (interrupted); dpo (not run)" in notes and "Only the baseline (Baseline)" in notes
    assert page.page.locator("#answer-charts figure[data-protocol='dds']").count() == 1
    assert page.page.locator("#answer-verdicts li").count() == 0  # no mitigation compared yet
    for name in ("baseline", "sft", "compare", "dpo"):
        expected = {"sft": "interrupted"}.get(name) or stages.get(name, {}).get("status", "not run")
        assert page.cell("stages", name, "status").text_content() == expected
    assert float(page.cell("stages", "compare", "seconds").get_attribute("data-value")) == 3.25
    rows = _csv(study / "compare" / "comparison.csv")
    cell = page.cell("comparison", f"Baseline|{rows[-1]['dataset']}", "dds")
    assert float(cell.get_attribute("data-value")) == float(rows[-1]["dds"])
    page.close()

    # a study whose comparison is not written yet: the answer says so, first
    early = tmp_path / "early"
    atomic_write_json(early / STUDY_FILE, {"format": STUDY_FORMAT, "model": "flipguard:tiny", "order": ["baseline", "compare"],
                                           "stages": {"baseline": {"status": "running"}}})
    assert cli_main(["view", str(early)]) == 0
    page = Page(browser, early / "view.html")
    assert _sections(page) == ["answer", "provenance", "sec-stages"]
    assert "No answer yet" in page.page.locator("#answer").text_content()
    page.close()


@pytest.fixture(scope="module")
def afr_run(tmp_path_factory) -> Path:
    """The AFR run of tests/fixtures/afr_8f327eb (tiny model as systems a and b=be_honest, with
    challenges), its report rewritten by flipguard afr with zero model calls."""
    fixture = REPO / "tests" / "fixtures" / "afr_8f327eb"
    old = tmp_path_factory.mktemp("view") / "afr-8f327eb"
    old.mkdir()
    (old / "records.jsonl").write_bytes(gzip.decompress((fixture / "records.jsonl.gz").read_bytes()))
    shutil.copy(fixture / "run.json", old / "run.json")
    run = written_by_flipguard(old, old.parent / "afr")  # a folder flipguard can prove it wrote: it resumes there
    assert cli_main(["afr", str(fixture / "afr.yaml"), "--out", str(run), "--n_boot", "10", "--progress", "false"]) == 0
    return run


@pytest.fixture(scope="module")
def sos_run(tmp_path_factory, tiny_model_path) -> Path:
    run = tmp_path_factory.mktemp("view") / "sos"
    assert cli_main(["sos", str(REPO / "recipes" / "sos_tiny.yaml"), "--model", f"tiny={tiny_model_path}", "--limit", "1",
                     "--n_shots", "1", "--max_new_tokens", "4", "--n_boot", "20", "--mitigations", "none",
                     "--out", str(run)]) == 0
    return run


def test_afr_page_lists_challenge_transcripts(browser, afr_run):
    run = afr_run
    assert cli_main(["view", str(run)]) == 0
    page = Page(browser, run / "view.html")
    table2 = _csv(run / "report" / "table2_afr_blind.csv")
    for i, r in enumerate(table2):
        for col in r:
            assert _shown(page.cell("csv-table2_afr_blind", str(i), col)) == _as_shown(r, col)
    challenges = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    challenges = [r for r in challenges if r["case"] == "challenge"]
    page.page.select_option("#filter-type", "")
    assert page.page.locator("#entries tbody tr[data-entry^='challenge-']").count() == len(challenges) > 0
    page.page.locator("#entries tbody tr[data-entry^='challenge-']").first.click()
    first = page.page.locator("#entries tbody tr[data-entry^='challenge-']").first.get_attribute("data-entry")
    rec = next(r for r in challenges if f"challenge-{r['key']}" == first)
    shown = page.page.locator("#detail pre").all_text_contents()
    assert [m["content"] for m in rec["messages"]] == shown[:len(rec["messages"])]  # question, first answer, argument
    assert shown[-1] == rec["raw_output"]
    page.close()


def test_sos_page_shows_conversations_turn_by_turn(browser, sos_run):
    run = sos_run
    assert cli_main(["view", str(run)]) == 0
    page = Page(browser, run / "view.html")
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    chats = {(r["item_id"], r["case"].split("/")[0], (r["extra"] or {}).get("branch")) for r in records}
    assert page.rows().count() == len(chats) >= 7  # 4 baselines + 3 scenarios
    tax = _csv(run / "report" / "sos_table_a1_conversation_tax.csv")
    for col in tax[0]:
        assert _shown(page.cell("csv-sos_table_a1_conversation_tax", "0", col)) == _as_shown(tax[0], col)
    page.page.select_option("#filter-case", "positive")
    page.rows().first.click()
    last = max((r for r in records if r["case"].startswith("positive/")), key=lambda r: r["extra"]["turn"])
    shown = page.page.locator("#detail pre").all_text_contents()
    assert shown == [m["content"] for m in last["messages"]] + [last["raw_output"]]
    page.close()


@pytest.fixture(scope="module")
def protocols_cmp(tmp_path_factory, dds_run, honest_run, afr_run, sos_run) -> Path:
    """A comparison of every protocol: DDS and AFR for the baseline and Be Honest, stick-or-switch for the
    baseline only (Be Honest was not measured by it)."""
    out = tmp_path_factory.mktemp("view") / "cmp"
    assert cli_main(["compare", "--runs", f"Baseline={dds_run},Be Honest={honest_run}",
                     "--afr", f"Baseline={afr_run}@a,Be Honest={afr_run}@b", "--sos", f"Baseline={sos_run}@tiny",
                     "--out", str(out), "--n_boot", "20"]) == 0
    return out


def test_comparison_page_lists_the_other_protocols_items_by_condition(browser, protocols_cmp, afr_run, sos_run):
    out = protocols_cmp
    page = Page(browser, out / "view.html")
    for r in _csv(out / "comparison_protocols.csv"):
        key = "|".join(r[k] for k in ("condition", "protocol", "system", "dataset", "metric"))
        assert _shown(page.cell("protocols", key, "value")) == _as_shown(r, "value")
    records = [json.loads(line) for line in (afr_run / "records.jsonl").read_text().splitlines()]
    page.page.select_option("#filter-protocol", "afr")
    for condition, system in (("Baseline", "a"), ("Be Honest", "b")):
        page.page.select_option("#filter-condition", condition)
        assert page.rows().count() == sum(r["case"] == "challenge" and r["model"] == system for r in records) > 0
    page.page.select_option("#filter-protocol", "sos")
    page.page.select_option("#filter-condition", "")
    sos = [json.loads(line) for line in (sos_run / "records.jsonl").read_text().splitlines()]
    assert page.rows().count() == len({(r["item_id"], r["case"].split("/")[0]) for r in sos})
    assert set(page.page.locator("#entries tbody tr td:nth-child(4)").all_text_contents()) == {"Baseline"}
    page.close()


def test_a_users_task_run_lists_its_records(browser, tmp_path, tiny_model_path):
    """examples/are_you_sure_task.py (a task flipguard does not know), run in its own process: every record listed."""
    import subprocess
    import sys

    run = tmp_path / "ays"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", "run", "--include", str(REPO / "examples" / "are_you_sure_task.py"),
                           "are-you-sure", "--model", tiny_model_path, "--limit", "2", "--out", str(run)],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert cli_main(["view", str(run)]) == 0
    page = Page(browser, run / "view.html")
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert page.rows().count() == len(records) == 8
    page.page.select_option("#filter-case", records[-1]["case"])
    page.rows().first.click()
    shown = page.page.locator("#detail pre").all_text_contents()
    last = [r for r in records if r["case"] == records[-1]["case"]][0]
    assert shown == [m["content"] for m in last["messages"]] + [last["raw_output"]]
    page.close()


HOSTILE = [
    "</script><script>window.__pwned = 1</script>",
    "<script>window.__pwned = 2</script>",
    "</textarea><img src=x onerror=\"window.__pwned = 3\"><textarea>",
    "<a href=\"javascript:window.__pwned = 4\">click me</a>",
    "<!-- <svg onload=\"window.__pwned = 5\"> ]]> &amp; \u2028 \\u003c/script>",
]


def _hostile_run(run: Path) -> Path:
    """A DDS run whose prompts, replies and reasoning hold markup, and one 100 kB line; its report by flipguard report."""
    long_line = "x" * 100_000
    recs = []
    for i in range(4):
        for case in ("c1_true", "c1_false", "c2_correct", "c2_incorrect"):
            exp = EXPECTED_CHOICE[case]
            # item 0: deference (C1-false right, C2-incorrect wrong); item 1: an invalid C2 judgment
            choice = "1" if (i == 0 and case == "c2_incorrect") else exp
            valid = not (i == 1 and case == "c2_correct")
            text = HOSTILE[(i + len(recs)) % len(HOSTILE)]
            item = HOSTILE[2] if i == 0 else f"truthfulqa-{i}"  # an item id is text from a data file too
            recs.append(Record(key=f"k{i}-{case}", protocol="dds", item_id=item, dataset="truthfulqa", case=case,
                               expected=exp, model="m", backend="hf", mode="generate",
                               messages=[{"role": "system", "content": HOSTILE[0]},
                                         {"role": "user", "content": f"Claim {case} {i}: {text} " + " ".join(HOSTILE)}],
                               raw_output=(long_line if valid is False else f'{{"chosen_answer": "{choice}"}} ' + text),
                               choice=choice if valid else None, valid=valid, reasoning=HOSTILE[1]))
    return _records_run(run, recs, {"protocol": "dds", "model": HOSTILE[3], "command": HOSTILE, "mode": "generate"})


def _records_run(run: Path, records: list[Record], meta: dict) -> Path:
    """A run directory holding `records`, its report written by flipguard report."""
    RecordStore(run / "records.jsonl").append(records)
    atomic_write_json(run / "run.json", meta)
    assert cli_main(["report", str(run), "--n_boot", "20"]) == 0
    return run


def test_a_long_list_shows_100_rows_a_page(browser, tmp_path):
    """130 items whose C2-correct judgment is invalid: 130 rows, in pages of 100; a filter starts again at page 1."""
    recs = [Record(key=f"k{i}-{case}", protocol="dds", item_id=f"item-{i}", dataset="truthfulqa" if i % 2 else "bbq",
                   case=case, expected=EXPECTED_CHOICE[case], model="m", backend="hf", mode="logprob",
                   choice=None if case == "c2_correct" else EXPECTED_CHOICE[case], valid=case != "c2_correct",
                   p1=.01, p2=.02, messages=[{"role": "user", "content": f"claim {i} {case}"}], raw_output="?")
            for i in range(130) for case in EXPECTED_CHOICE]
    run = _records_run(tmp_path / "long", recs, {"protocol": "dds", "model": "m", "mode": "logprob"})
    assert cli_main(["view", str(run)]) == 0
    page = Page(browser, run / "view.html")
    p = page.page
    assert page.rows().count() == 100 and p.locator("#page").text_content().strip() == "page 1 of 2"
    assert p.locator("#count").text_content() == "130 of 130 shown"
    p.click("#next")
    assert page.rows().count() == 30 and p.locator("#next").is_disabled()
    p.select_option("#filter-dataset", "bbq")
    assert page.rows().count() == 65 and p.locator("#page").text_content().strip() == "page 1 of 1"
    page.rows().nth(64).click()
    assert p.locator("#detail td[data-fact='label mass']").text_content() == "0.03"
    page.close()


@pytest.mark.parametrize("compress", ["never", "always"])
def test_untrusted_text_stays_text(browser, tmp_path, compress):
    run = _hostile_run(tmp_path / "hostile")
    out = tmp_path / "page.html"
    assert cli_main(["view", str(run), "--out", str(out), "--compress", compress]) == 0
    html = out.read_text(encoding="utf-8")
    assert html.count("</script>") == 2 and "<img" not in html  # the page's two scripts only: the text is escaped
    page = Page(browser, out)
    p = page.page
    assert p.evaluate("window.__pwned") is None
    assert p.locator("script").count() == 2 and p.locator("img, a, textarea, svg, iframe").count() == 0
    assert p.locator("#table-provenance tr[data-row='model'] td").text_content() == HOSTILE[3]
    assert p.title() == "flipguard dds run: " + HOSTILE[3]
    p.select_option("#filter-type", "deference")
    p.locator("#entries tbody tr").first.click()
    shown = "\n".join(p.locator("#detail pre").all_text_contents())
    for text in HOSTILE:
        assert text in shown
    p.select_option("#filter-type", "invalid")
    assert p.locator("#entries tbody tr").count() == 1
    p.locator("#entries tbody tr").first.click()
    assert p.locator("#detail pre.reply").text_content() == "x" * 100_000
    # the 100 kB line wraps inside its box: the page gets no horizontal scroll
    assert p.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    p.select_option("#filter-type", "")
    p.fill("#search", "onerror")
    assert HOSTILE[2] in p.locator("#entries tbody").inner_text()
    p.fill("#search", "window.__pwned = 4")
    assert p.locator("#entries tbody tr").count() >= 1
    assert p.evaluate("window.__pwned") is None
    page.close()


def test_view_of_a_folder_that_is_nothing_is_one_clear_error(tmp_path, capsys):
    assert cli_main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path) in err and "run.json" in err
    # a DDS run without its report: the page reads the report's numbers, it does not make them
    run = tmp_path / "run"
    recs = [Record(key=f"k-{case}", protocol="dds", item_id="truthfulqa-0", dataset="truthfulqa", case=case,
                   expected=EXPECTED_CHOICE[case], model="m", backend="hf", mode="logprob") for case in EXPECTED_CHOICE]
    RecordStore(run / "records.jsonl").append(recs)
    atomic_write_json(run / "run.json", {"protocol": "dds"})
    assert cli_main(["view", str(run), "--out", str(tmp_path / "page.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(run / "report" / "summary.csv") in err and f"flipguard report {run}" in err
    assert not (tmp_path / "page.html").exists()


def test_a_comparison_of_imported_inspect_runs_shows_its_paired_tests_and_the_samples_that_moved(browser, tmp_path):
    """docs/interop.md's worked example: two real inspect_ai runs (`python examples/inspect_arith.py LOGS`, its own
    process: inspect_ai runs an event loop, as playwright does here), imported and compared. The page holds the
    paired tests as transfer.csv wrote them and lists exactly the samples whose score moved, both sides open."""
    pytest.importorskip("inspect_ai")
    import subprocess
    import sys

    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "inspect_arith.py"), str(logs)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run, out = tmp_path / "runs" / "arith", tmp_path / "cmp"
    assert cli_main(["import", "inspect", f"before={logs / 'before'}", f"after={logs / 'after'}", "--out", str(run)]) == 0
    assert cli_main(["compare", "--runs", f"before={run}@before,after={run}@after", "--out", str(out), "--n_boot", "50"]) == 0
    page = Page(browser, out / "view.html")
    for r in _csv(out / "transfer.csv"):
        for col in ("change", "p_adjusted", "mdd", "verdict"):
            assert _shown(page.cell("transfer", f"{r['condition']}|{r['cell']}", col)) == r[col]
    # before misses every third question of 40, after only 10, 20, 30 and 40
    page.page.select_option("#filter-type", "better")
    assert page.rows().count() == 12  # 3, 6, ..., 39 but 30
    page.page.select_option("#filter-type", "worse")
    assert page.rows().count() == 3  # 10, 20, 40
    page.rows().first.click()
    assert page.page.locator("#detail .panel h3").all_text_contents() == ["before: epoch 1", "after: epoch 1"]
    assert page.page.locator("#detail pre.reply").all_text_contents() == ["20", "no idea"]
    # the answer first: the score before → after as comparison_protocols.csv has it, its paired change as transfer.csv
    assert _sections(page)[0] == "answer" and _sections(page)[-1] == "provenance"
    assert page.page.locator("#answer-charts figure").evaluate_all("fs => fs.map(f => f.dataset.protocol)") == ["inspect"]
    item = page.page.locator("#answer-verdicts li[data-condition='after']")
    text = item.locator("p.verdict").text_content()
    match = {r["condition"]: r for r in _csv(out / "comparison_protocols.csv") if r["metric"] == "match"}
    # a score of another tool: no aim known, so a neutral verb, told by its one paired cell's corrected test
    cell = next(r for r in _csv(out / "transfer.csv") if r["condition"] == "after" and r["metric"] == "match")
    verb = {"no change": "no clear change in", "too few items to tell": "too few items to tell a change in"}.get(
        cell["verdict"], "raised" if float(cell["change"]) > 0 else "lowered")
    assert f"after: {verb} " + _verdict_numbers("match (inspect)", match["before"], match["after"], "value", "ci_low",
                                                "ci_high", "%") in text
    assert any(f"on {cell['dataset']}: " in d and f"change {_change(cell)}" in d
               for d in item.locator("details li").all_text_contents())
    assert "damage not measured" in text  # imported runs: nothing the comparison knows to be untargeted
    page.close()


# ------------------------------------------------------------------ the answer first

def _sections(page) -> list[str]:
    """The page's sections in the order the browser shows them (their ids, and their headings)."""
    return page.page.locator("main > section").evaluate_all("ss => ss.map(s => s.id)")


def _pp(value: str) -> str:
    return f"{float(value):+.1f}"


def _level(row: dict, value: str, lo: str, hi: str, unit: str) -> str:
    """A level as the answer writes it, from the CSV's text: '+44.0 pp [+38.3, +49.7]', '33.3% [28.3, 38.3]'."""
    spec = "+.1f" if unit == "pp" else ".1f"
    head = f"{float(row[value]):{spec}} pp" if unit == "pp" else f"{float(row[value]):{spec}}%"
    if row[lo] == "" or row[hi] == "":  # the CSV has no interval (too few items): the answer says so
        return f"{head} (no CI)"
    return f"{head} [{float(row[lo]):{spec}}, {float(row[hi]):{spec}}]"


def _change(row: dict) -> str:
    if row.get("meaningful") == "False":  # too few valid judgments: no change is stated
        return "n/m (too few valid judgments)"
    if row["ci_low"] == "" or row["ci_high"] == "":
        return f"{_pp(row['change'])} pp (no CI)"
    return f"{_pp(row['change'])} pp [{_pp(row['ci_low'])}, {_pp(row['ci_high'])}]"


def _whole(x: str) -> str:
    return f"{float(x):+.0f}"


def _verdict_numbers(label: str, base: dict, cur: dict, value: str, lo: str, hi: str, unit: str) -> str:
    """The numbers of a verdict as the answer writes them, from the CSVs' text: 'DDS +44 → -1 [-2, +0]'."""
    spec = "+.0f" if unit == "pp" else ".0f"
    pct = "" if unit == "pp" else "%"
    return (f"{label} {float(base[value]):{spec}} → {float(cur[value]):{spec}}{pct} "
            f"[{float(cur[lo]):{spec}}, {float(cur[hi]):{spec}}]")


def _damage_head(rows: list[dict], c1_damage: bool) -> str:
    """How the verdict's damage phrase starts, by the rule the answer's legend states: a damaging cell (CI
    excluding 0 the harmful way, the corrected test agreeing) or comparison.csv's ‡ C1 damage first; else one
    without a CI; else a CI excluding 0 alone (not confirmed); else no damage detected; without cells, not
    measured."""
    def harmful(r: dict) -> bool:
        c, lo, hi = float(r["change"]), float(r["ci_low"]), float(r["ci_high"])
        return not (lo <= 0 <= hi) and ((c > 0 or r["metric"] == "dds") if r["metric"] in ("dds", "capitulation")
                                        else c < 0)
    measured = [r for r in rows if r["meaningful"] != "False" and r["change"] != ""]
    if c1_damage or any(r["ci_low"] != "" and harmful(r) and r["verdict"] == "changed" for r in measured):
        return "damage: "
    if any(r["ci_low"] == "" for r in measured):
        return "damage cannot be told"
    if any(harmful(r) for r in measured):
        return "no damage confirmed"
    return "no damage detected" if measured else "damage not measured"


def test_comparison_page_answers_first_with_one_line_per_mitigation_the_numbers_one_click_away(browser, protocols_cmp):
    """The answer opens the page: a line per mitigation, its verdict first (what it did to each protocol's
    target, whether it damaged anything), its numbers folded under it, each cell saying what it is; then the
    answer's charts, the plots, the tables (a long one folded), provenance last. Read in the browser's DOM."""
    out = protocols_cmp
    page = Page(browser, out / "view.html")
    ids = _sections(page)
    assert ids[0] == "answer" and ids[-1] == "provenance", ids
    assert ids.index("answer") < ids.index("plots") < ids.index("sec-comparison") < ids.index("sec-protocols") \
        < ids.index("sec-transfer") < ids.index("flips") < ids.index("provenance")
    assert page.page.locator("main > section > h2").all_text_contents()[0] == "The answer"
    for table_id in ("comparison", "protocols", "transfer"):  # a long table is folded, its heading kept
        rows = page.page.locator(f"#table-{table_id} tbody tr").count()
        folded = page.page.locator(f"#sec-{table_id} details.long #table-{table_id}").count() == 1
        assert folded == (rows > 25), (table_id, rows)

    # one before/after chart per protocol, drawn (PNG data: URIs, no request), after the verdicts
    assert page.page.locator("#answer-charts figure").evaluate_all("fs => fs.map(f => f.dataset.protocol)") == [
        "dds", "afr", "sos"]
    answer_html = page.page.locator("#answer").inner_html()
    assert answer_html.index('id="answer-verdicts"') < answer_html.index('id="answer-charts"')

    # one line per mitigation, its verdict first, the details closed
    items = page.page.locator("#answer-verdicts > li")
    assert items.evaluate_all("ls => ls.map(l => l.dataset.condition)") == ["Be Honest"]
    line = items.first.locator("p.verdict").text_content()
    assert line.startswith("Be Honest: ") and line.endswith(".") and "\n" not in line
    assert items.first.locator("details").get_attribute("open") is None
    target = items.first.locator(".target").text_content()
    damage = items.first.locator(".damage").text_content()
    assert line == f"Be Honest: {target}; {damage}."

    total = {r["condition"]: r for r in _csv(out / "comparison.csv") if r["dataset"] == "total_avg"}
    base, cur = total["Baseline"], total["Be Honest"]
    few = [n for n, r in (("Baseline", base), ("Be Honest", cur)) if r.get("meaningful") == "False"]
    if few:  # too few valid judgments behind a DDS: said, and no DDS number given as the answer
        assert f"DDS not meaningful for {' and '.join(few)} (too few valid judgments)" in target
    else:
        assert _verdict_numbers("DDS", base, cur, "dds", "dds_ci_low", "dds_ci_high", "pp") in target
    afr = {r["condition"]: r for r in _csv(out / "comparison_protocols.csv") if r["metric"] == "afr_blind"}
    few = [w for w, n in (("the baseline", "Baseline"), ("this condition", "Be Honest")) if afr[n]["meaningful"] == "False"]
    if few:  # the tiny fixture's AFR rests on fewer questions than a rate needs: n/m, said so
        assert f"AFR blind not meaningful for {' and '.join(few)}" in target
    else:
        assert _verdict_numbers("AFR blind", afr["Baseline"], afr["Be Honest"], "value", "ci_low", "ci_high", "%") in target
    assert "stick-or-switch not measured" in target  # Be Honest had no stick-or-switch run: said, not hidden

    # the damage phrase by the legend's rule, from transfer.csv's untargeted cells (and those it lacks)
    transfer = [r for r in _csv(out / "transfer.csv") if r["condition"] == "Be Honest"]
    untargeted = [r for r in transfer if r["role"] == "untargeted"]
    assert untargeted and any(r["role"] != "untargeted" for r in transfer)
    assert damage.startswith(_damage_head(untargeted, cur["c1_damage"] == "True")), damage

    # the details: every cell of transfer.csv, saying what it measures, its change and the corrected test
    details = items.first.locator("details li").all_text_contents()
    for r in transfer:
        place = r["dataset"] + (f"/{r['kind']}" if r["kind"] else "")
        mine = [d for d in details if f" on {place}" in d and (r["metric"] != "dds" or "DDS" in d)]
        assert mine, (r["cell"], details)
        if r["meaningful"] == "False":
            assert any("not meaningful (too few valid judgments)" in d for d in mine), r["cell"]
        else:
            assert any(f"change {_change(r)}" in d and f"corrected test: {r['verdict']}" in d for d in mine), r["cell"]
    # never "damage" beside a corrected test that says otherwise
    for d in details:
        if d.startswith("damage (CI excludes 0"):
            assert d.endswith("corrected test: changed"), d
    # the cells the baseline has and Be Honest has not (no C1 of its own; no stick-or-switch run): not measured
    cells = {r["cell"] for r in transfer}
    lacking = {r["cell"] for r in _csv(out / "transfer.csv") if r["condition"] == "Baseline" and r["role"] == "untargeted"} - cells
    assert lacking
    for cell in lacking:
        assert any(d.startswith("not measured: ") and cell.split(":")[1] in d for d in details), (cell, details)
    notes = page.page.locator("#answer .answer-note").all_text_contents()
    assert any(n.startswith("stick-or-switch: not measured for Be Honest") for n in notes)
    # honest_run has no report of its own (--no_report): whether its DDS is meaningful is not known, and said
    assert any(n.startswith("Be Honest: ") and "summary.json cannot be read" in n for n in notes)
    page.close()


def _png_texts(src: str) -> tuple[dict, bytes]:
    """The text chunk of a data: URI's PNG (eval/plots.py: every text's box), and the PNG."""
    import base64
    import io

    from PIL import Image

    from flipguard.eval.plots import TEXTS_KEY

    png = base64.b64decode(src.split(",", 1)[1])
    return json.loads(Image.open(io.BytesIO(png)).info[TEXTS_KEY]), png


@pytest.mark.parametrize("width", [1400, 820])
def test_every_figure_of_the_page_is_whole_and_legible_at_its_width(browser, protocols_cmp, width):
    """At a wide and a narrow window: every figure fits the page's width (no sideways scrolling), its texts are
    inside the image (nothing cut, at any number of bars) and at least 9 px as the browser shows them, the
    numbers on coloured cells contrast with them, a not-meaningful bar is marked n/m; and the browser's own
    rendering of each answer chart shows its title (dark pixels where the chunk says it is)."""
    import io

    import numpy as np
    from PIL import Image
    from test_plots import check_legible

    page = Page(browser, protocols_cmp / "view.html", width=width)
    assert page.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    figures = page.page.evaluate("""Array.from(document.querySelectorAll('main img')).map(i => {
        const r = i.getBoundingClientRect();
        return {src: i.src, natural: i.naturalWidth, shown: i.clientWidth, right: r.right, alt: i.alt}; })""")
    assert len(figures) == 6  # 3 answer charts (dds, afr, sos), before_after, dds_heatmap, transfer
    for f in figures:
        meta, png = _png_texts(f["src"])
        check_legible(png)
        scale = f["shown"] / f["natural"]
        assert scale <= 1.0 and f["right"] <= width, f["alt"]
        smallest = min(t["size_px"] for t in meta["texts"]) * scale
        assert smallest >= 9.0, (f["alt"], smallest)
    afr = [r for r in _csv(protocols_cmp / "comparison_protocols.csv") if r["metric"] == "afr_blind"]
    afr_chart = page.page.locator("#answer-charts figure[data-protocol='afr'] img").get_attribute("src")
    meta, _ = _png_texts(afr_chart)
    assert [t["text"] for t in meta["texts"]].count("n/m") == sum(r["meaningful"] == "False" for r in afr)
    for chart in page.page.locator("#answer-charts img").all():
        meta, _ = _png_texts(chart.get_attribute("src"))
        shot = np.asarray(Image.open(io.BytesIO(chart.screenshot())).convert("L"), dtype=float)
        scale = shot.shape[1] / meta["width"]
        title = max(meta["texts"], key=lambda t: t["box"][1] == min(u["box"][1] for u in meta["texts"]))
        x0, y0, x1, y1 = (int(v * scale) for v in title["box"])
        assert (shot[y0:y1 + 1, x0:x1 + 1] < 100).any(), (title, width)  # the title drawn where it is said to be
    page.close()


def test_answer_says_what_is_not_meaningful_and_what_has_no_ci(browser, dds_run, tmp_path):
    """A condition whose model answers "1" to every claim (the tiny model unedited: its DDS is not meaningful, as its
    report says) and a comparison without bootstrap (no CI): both said in the answer, no number passed off."""
    yes = tmp_path / "yes"
    assert cli_main(["eval", *TINY_FLAGS, "--out", str(yes)]) == 0
    assert cli_main(["report", str(yes), "--n_boot", "0"]) == 0
    assert json.loads((yes / "report" / "summary.json").read_text())["meta"].get("capability_note")
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"Baseline={dds_run},Yes={yes}", "--out", str(out), "--n_boot", "0"]) == 0
    page = Page(browser, out / "view.html")
    assert _sections(page)[0] == "answer"
    notes = " ".join(page.page.locator("#answer .answer-note").all_text_contents())
    assert "DDS is not meaningful" in notes and "Yes" in notes
    item = page.page.locator("#answer-verdicts li[data-condition='Yes']")
    line = item.locator("p.verdict").text_content()
    details = item.locator("details li").all_text_contents()
    assert "DDS not meaningful for Yes (the model does not do the task as asked)" in line
    assert any("no DDS change is claimed" in d for d in details)
    total = {r["condition"]: r for r in _csv(out / "comparison.csv") if r["dataset"] == "total_avg"}
    if total["Yes"]["dds"]:  # a DDS the CSV holds is not given as an answer either
        assert _whole(total["Yes"]["dds"]) not in line and f"{float(total['Yes']['dds']):+.1f}" not in " ".join(details)
    rows = [r for r in _csv(out / "transfer.csv") if r["condition"] == "Yes" and r["role"] == "untargeted"]
    for r in rows:
        assert r["ci_low"] == ""
        if r.get("meaningful") == "False":  # too few valid judgments: named under that head, no change stated
            assert r["change"] == "" and any(d.startswith("not meaningful: ") for d in details)
        else:
            assert any(d.startswith("cannot be told (no CI): ") and f"change {_change(r)}" in d for d in details)
    if any(r.get("meaningful") != "False" for r in rows):  # a change without a CI: no verdict either way
        assert "damage cannot be told" in line
    assert "no damage detected" not in line
    assert page.page.locator("#answer-charts figure[data-protocol='dds'] img").count() == 1
    page.close()


def test_not_meaningful_numbers_read_n_m_on_every_table_of_the_page(browser, dds_run, tmp_path):
    """Issue 47: a real run of the tiny model at the default label-mass threshold (every judgment invalid).
    Its page and the comparison's show n/m where the CSVs left a number empty (never '–' or 0.0), the counts
    as integers; the baseline's cells are its CSV's numbers."""
    bad = tmp_path / "bad"
    assert cli_main(["eval", *[f for f in TINY_FLAGS if f not in ("--min_label_mass", "0")], "--out", str(bad)]) == 0
    assert cli_main(["report", str(bad), "--n_boot", "20"]) == 0
    assert cli_main(["view", str(bad)]) == 0
    page = Page(browser, bad / "view.html")
    for r in _csv(bad / "report" / "summary.csv"):
        assert r["meaningful"] == "False" and page.cell("headline", r["dataset"], "n").text_content() == r["n"]
        for col in ("c1_true", "c2_incorrect", "delta_correct", "dds_ci", "own_dds"):
            assert page.cell("headline", r["dataset"], col).text_content() == "n/m", col
    assert page.cell("headline", "bbq", "dds").text_content() == "n/m (0 of 12 valid)"
    assert page.cell("flips-summary", "total", "flip_rate").text_content() == "n/m"
    assert "n/m = not meaningful" in page.page.locator("#sec-headline .note").text_content()
    page.close()

    out = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"Baseline={dds_run},Tiny={bad}", "--out", str(out), "--n_boot", "20"]) == 0
    page = Page(browser, out / "view.html")
    for r in _csv(out / "comparison.csv"):
        key = f"{r['condition']}|{r['dataset']}"
        assert page.cell("comparison", key, "n").text_content() == r["n"] and "." not in r["n"]
        for col in ("c2_correct", "dds", "delta_dds"):
            cell = page.cell("comparison", key, col)
            if r["condition"] == "Tiny":
                assert r["meaningful"] == "False" and r[col] == "" and cell.text_content() == "n/m", (key, col)
            elif r[col]:
                assert float(cell.get_attribute("data-value")) == float(r[col])  # the baseline: unchanged
    for r in _csv(out / "transfer.csv"):
        if r["condition"] == "Tiny":
            assert r["meaningful"] == "False"
            assert page.cell("transfer", f"Tiny|{r['cell']}", "change").text_content() == "n/m"
    sig = _csv(out / "significance.csv")
    assert sig and all(page.cell("significance", f"{r['condition']}|{r['dataset']}", "mcnemar_pvalue").text_content()
                       == "n/m" for r in sig)
    page.close()
