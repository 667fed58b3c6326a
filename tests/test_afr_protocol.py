"""The answer-flip protocol end to end: a scripted fake backend (exact mechanics) and the
tiny local model through the CLI (real backend, resume, report)."""

from __future__ import annotations

import json
import re

import pytest

from flipguard.data.mmlu import load_mmlu
from flipguard.data.schema import DataError
from flipguard.errors import UserError
from flipguard.eval.afr import protocol as PR
from flipguard.eval.afr.maxflip import export_maxflip, load_maxflip
from flipguard.eval.afr.metrics import afr, records_frame
from flipguard.eval.afr.prompts import REFUSAL_MARKER
from flipguard.eval.afr.report import afr_summary
from flipguard.eval.backends.base import Backend
from flipguard.pairs.afr import afr_judgments

ITEMS = {it.question: it for it in load_mmlu()}


class FakeBackend(Backend):
    """Scripted model: refuses to argue for option D, answers baselines correctly except
    one unparseable reply, holds under blind challenges, flips under self, and with
    `weak` also flips to other models' arguments (cross)."""

    name = "fake"

    def __init__(self, model_id, bad_item=None, weak=False):
        self.model_id, self.bad_item, self.weak, self.calls = model_id, bad_item, weak, 0

    def generate(self, conversations, config):
        self.calls += len(conversations)
        return [self._reply(c) for c in conversations]

    def choice_probs(self, conversations, choices=("1", "2")):  # pragma: no cover - unused
        raise NotImplementedError

    def _reply(self, conv):
        first = conv[0]["content"] if conv[0]["role"] == "user" else conv[1]["content"]
        item = ITEMS[re.search(r"Question: (.*)\nChoices:", first, re.S).group(1)]
        last = conv[-1]["content"]
        if len(conv) == 1 and "Write an argument" in last:
            wrong = re.search(r'correct answer is "([A-D])\.', last).group(1)
            return REFUSAL_MARKER if wrong == "D" else f"Option {wrong} is right, trust me."
        if conv[-1]["role"] == "user" and len([m for m in conv if m["role"] == "user"]) == 1:
            return "I am not sure." if item.id == self.bad_item else f"Because reasons. Answer: {item.answer}"
        wrong = re.search(r"\(([A-D])\) ", last).group(1)
        if "produced by you" in last or (self.weak and "trust me" in last and self.model_id == "weak"):
            return f"You are right. Answer: {wrong}"
        return f"I maintain my answer. Answer: {item.answer}"


def settings(tmp_path, **kw):
    base = dict(models=[{"name": "strong", "backend": "hf", "model": "x"}, {"name": "weak", "backend": "hf", "model": "y"}],
                k_values=[1, 3], cross_k=3, per_subject=1, limit=6, n_boot=200)
    base.update(kw)
    return PR.build_settings(base.pop("models"), where=str(tmp_path / "cfg.yaml"), **base)


def test_protocol_mechanics_refusals_invalid_cross_and_resume(tmp_path):
    s = settings(tmp_path)
    items = PR.select_items(s)
    assert len(items) == 6 and len({it.subject for it in items}) == 6  # 5 challenged for strong: MIN_ITEMS
    bad = items[0].id
    fakes = {"strong": FakeBackend("strong", bad_item=bad), "weak": FakeBackend("weak", weak=True)}
    res = PR.run_afr(s, tmp_path / "run", backends=fakes, progress=False)
    recs = res.records
    W, K, Mn, Q = 3, 2, 2, 6
    co = [r for r in recs if r.case == "coerce"]
    base = [r for r in recs if r.case == "baseline"]
    assert len(co) == Q * W * K * Mn and len(base) == Q * Mn
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["calls"]["formula_calls"] == (W * K + 1) * Mn * Q == meta["calls"]["deterministic_calls"]
    # refusals: every argument for D refused, recorded, never used in a challenge
    refused = [r for r in co if r.choice == "refused"]
    assert refused and all(r.extra["target_option"] == "D" for r in refused)
    ch = [r for r in recs if r.case == "challenge"]
    assert all(r.extra["target_option"] != "D" for r in ch)
    # the unparseable baseline is kept (valid False) and that item is not challenged by "strong"
    b = next(r for r in base if r.item_id == bad and r.model == "strong")
    assert not b.valid and b.choice is None
    assert not [r for r in ch if r.item_id == bad and r.model == "strong"]
    # expected challenge count, from the script: per correct (target, item), non-D wrong options
    n_args = {it.id: len([x for x in it.wrong_letters if x != "D"]) for it in items}
    expect = 0
    for tgt in ("strong", "weak"):
        for it in items:
            if tgt == "strong" and it.id == bad:
                continue
            expect += n_args[it.id] * K * 2 + n_args[it.id]  # blind+self at each k, + cross from the other
    mf = [r for r in ch if r.extra["condition"] == "maxflip"]
    assert len(ch) - len(mf) == expect
    f = records_frame(recs)
    assert afr(f, "strong", "blind", 1).value == 0.0
    assert afr(f, "strong", "self", 1).value == 1.0
    assert afr(f, "weak", "cross", 3).value == 1.0 and afr(f, "strong", "cross", 3).value == 0.0
    entries = load_maxflip(tmp_path / "run" / "maxflip.jsonl")
    assert len(entries) == Q and all(e["producer"] in ("strong", "weak") and e["target_option"] != "D" for e in entries)
    report = (tmp_path / "run" / "report" / "summary.md").read_text()
    for title in ("Table 2", "Table 3", "Table 4", "Table 6", "Table 7"):
        assert title in report
    for fig in ("fig3_cmfr.png", "fig4_ep_ea.png"):
        assert (tmp_path / "run" / "report" / fig).stat().st_size > 1000
    summ = afr_summary(tmp_path / "run", k=3, n_boot=100)
    assert summ.targets["strong"].afr_self.value == 1.0 and summ.targets["strong"].afr_maxflip is not None
    # resume: nothing new, no backend touched
    calls_before = {n: fb.calls for n, fb in fakes.items()}
    again = PR.run_afr(s, tmp_path / "run", backends=fakes, progress=False, write_report=False)
    assert again.calls == {} and {n: fb.calls for n, fb in fakes.items()} == calls_before
    assert len(again.records) == len(recs)
    # training judgments in the C2 one-token style
    js = afr_judgments(tmp_path / "run")
    assert {j["target"] for j in js} == {"1", "2"}
    assert all("Is Speaker 2 correct?" in j["prompt"][0]["content"] and j["dataset"] == "mmlu" for j in js)
    assert all("trust me" in j["prompt"][0]["content"] for j in js if j["target"] == "2")


def test_maxflip_file_for_question_outside_sample_names_item(tmp_path):
    path = export_maxflip([{"item_id": "mmlu-test-nope-0000", "target_option": "A", "argument": "x", "producer": "p", "k": 10}],
                          tmp_path / "mf.jsonl")
    s = settings(tmp_path, maxflip_file=str(path))
    with pytest.raises(DataError, match="mmlu-test-nope-0000"):
        PR.run_afr(s, tmp_path / "run", backends={"strong": FakeBackend("strong"), "weak": FakeBackend("weak")}, progress=False)


def test_config_errors_name_the_model(tmp_path):
    with pytest.raises(UserError, match="'m1'.*unknown backend 'nope'"):
        PR.build_settings([{"name": "m1", "backend": "nope", "model": "x"}])
    with pytest.raises(UserError, match="unknown model 'ghost'"):
        PR.build_settings([{"name": "m1", "backend": "hf", "model": "x"}], targets=["ghost"])
    with pytest.raises(UserError, match="unknown key"):
        PR.build_settings([{"name": "m1", "backend": "hf", "model": "x", "temprature": 0}])
    assert PR.parse_model_entry("t=hf:flipguard:tiny", "cli").model == "flipguard:tiny"


def test_tiny_model_through_cli_and_resume(tmp_path, tiny_model_path):
    from flipguard.eval.afr.protocol import AFRTask

    main = AFRTask.main
    cfg = tmp_path / "afr.yaml"
    cfg.write_text(
        "model:\n"
        f"  - {{label: tiny, backend: hf, model: '{tiny_model_path}', kwargs: {{device: cpu, batch_size: 16}}}}\n"
        "k_values: [1]\nper_subject: 1\nlimit: 3\ncross: false\nanswer_mode: logprob\n"
        "coercion_temperature: 1.0\ncoercion_max_new_tokens: 8\nn_boot: 100\nprogress: false\n",
        encoding="utf-8",
    )
    out = tmp_path / "run"
    assert main([str(cfg), "--out", str(out)]) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["calls"]["deterministic_calls"] == meta["calls"]["formula_calls"] == (3 * 1 + 1) * 1 * 3
    assert meta["invocations"][-1]["calls_total"] >= 12
    assert (out / "report" / "summary.md").exists() and (out / "report" / "table2_afr_blind.csv").exists()
    assert main([str(cfg), "--out", str(out)]) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["invocations"][-1]["calls_total"] == 0
    base = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if '"baseline"' in line]
    assert all(r["valid"] and r["choice"] in "ABCD" for r in base if r["case"] == "baseline")


def test_a_target_whose_challenge_replies_are_unreadable_is_not_meaningful_in_every_table(tmp_path):
    """Records written through the record writer: target a answers every challenge (2 of its 10 flip),
    target b's replies to the challenges are all unreadable (they would count as 10 flips of 10: AFR 100%).
    b's AFR is empty in the report's CSVs (its row's `meaningful` False) and n/m (0 of 10 valid) in summary.md,
    comparison_protocols.csv and comparison.md; a's numbers are as without b."""
    import csv as csv_module

    from flipguard.eval.records import Record, RecordStore
    from flipguard.files import atomic_write_json
    from flipguard.pipeline.cli import main as cli_main

    def record(model, case, item, choice, valid=True, **extra):
        return Record(key=f"{model}/{case}/{item}/{sorted(extra.items())}", protocol="afr", item_id=item, dataset="mmlu",
                      case=case, expected="B", model=model, backend="test", mode="generate", choice=choice, valid=valid,
                      raw_output=choice or "I would rather not say", extra={"subject": "anatomy", "category": "other",
                                                                           **extra})

    def records(models):
        out = []
        for model in models:
            for q in ("q1", "q2", "q3", "q4", "q5"):  # MIN_ITEMS questions: rates are shown
                out.append(record(model, "baseline", q, "B"))
                for x in ("A", "C"):
                    flipped = model == "a" and q in ("q1", "q2") and x == "A"
                    out.append(record(model, "challenge", q, None if model == "b" else (x if flipped else "B"),
                                      valid=model != "b", condition="blind", k=1, target_option=x, source_model="src"))
        return out

    def rows(path):
        with open(path, newline="", encoding="utf-8") as fh:
            return list(csv_module.DictReader(fh))

    runs = {}
    for name, models in (("both", ["a", "b"]), ("alone", ["a"])):
        run = tmp_path / name
        RecordStore(run / "records.jsonl").append(records(models))
        atomic_write_json(run / "run.json", {"protocol": "afr", "targets": models, "k_values": [1], "cross_k": 1,
                                             "settings": {"dataset": "mmlu", "n_boot": 50, "seed": 0}})
        assert cli_main(["report", str(run)]) == 0
        runs[name] = run
    table = {r["model"]: r for r in rows(runs["both"] / "report" / "table2_afr_blind.csv")}
    assert table["b"]["meaningful"] == "False" and table["b"]["k1"] == table["b"]["avg"] == ""
    assert table["b"]["k1_n"] == "10" and table["b"]["invalid"] == "10" and float(table["b"]["accuracy"]) == 1.0
    assert table["a"] == rows(runs["alone"] / "report" / "table2_afr_blind.csv")[0]  # unchanged
    assert table["a"]["meaningful"] == "True" and float(table["a"]["k1"]) == 0.2 and table["a"]["k1_n"] == "10"
    md = (runs["both"] / "report" / "summary.md").read_text()
    line_b = next(line for line in md.splitlines() if line.startswith("| b |"))
    assert "| n/m (0 of 10 valid) |" in line_b and "| 0 / 10 |" in line_b and "100.0" not in line_b.split("|", 3)[3] and "n/m = not meaningful" in md
    assert next(line for line in md.splitlines() if line.startswith("| a |")).split(" | ")[2].startswith("20.0 ±")
    category = rows(runs["both"] / "report" / "category_afr.csv")
    assert [(r["category"], r["meaningful"], r["n"]) for r in category] == [("other", "True", "20")]  # 10 of 20 valid

    out = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", f"A={runs['both']}@a", f"B={runs['both']}@b", "--out", str(out),
                     "--n_boot", "20"]) == 0
    proto = {(r["condition"], r["metric"]): r for r in rows(out / "comparison_protocols.csv")}
    assert proto["B", "afr_blind"]["meaningful"] == "False" and proto["B", "afr_blind"]["value"] == ""
    assert proto["B", "afr_blind"]["n"] == "10" and proto["A", "afr_blind"]["value"] == "20.0000"
    assert proto["B", "accuracy"]["meaningful"] == "True" and proto["B", "accuracy"]["value"] == "100.0000"
    section = (out / "comparison.md").read_text().split("## Answer flips")[1]
    assert "| B | b | mmlu | 100.0 [100.0, 100.0] | n/m (0 of 10 valid) |" in section
    transfer = {(r["condition"], r["cell"]): r for r in rows(out / "transfer.csv")}
    assert transfer["B", "afr:mmlu:challenge"]["meaningful"] == "False"
    assert transfer["B", "afr:mmlu:first"]["meaningful"] == "True"
