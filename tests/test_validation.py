"""Train until removed, stop before damage (`validation:`): the slice held back from the pairs by item,
measured while a real trainer trains, the stop rule, the checkpoint kept, and several processes.

Real processes throughout: the organism's own train-split run is the base model's records, the trainers
run as their scripts (and through `accelerate launch` with two gloo processes), and what a test expects
is known without the code under test (the organism's planted rule, counts of items, a stick-or-switch
policy's answers)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from served import free_port

from flipguard.data import organism_datasets as domain
from flipguard.data.unified import load_items
from flipguard.eval.records import RecordStore
from flipguard.eval.sos import protocol as SP
from flipguard.eval.sos.prompts import answer_reply
from flipguard.pairs import builder as P
from flipguard.pairs import validation as PV
from flipguard.train import validation as V

ROOT = Path(__file__).resolve().parents[1]
BOUND = 1800  # hang guard only
DDP_CONFIG = ROOT / "recipes" / "accelerate_configs" / "ddp.yaml"
N_ITEMS = 80  # organism train items the base model judges here; a quarter of them is the slice
N_TRAIN = len(load_items("organism", split="train"))  # the pairs are built from every one


def env(tmp_path: Path) -> dict[str, str]:
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TQDM_DISABLE": "1",
           "WANDB_DIR": str(tmp_path), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return out


def run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=BOUND)


@pytest.fixture(scope="module")
def base_train(tmp_path_factory) -> Path:
    """The shipped organism's own logprob run on N_ITEMS items of its train split (a real eval process)."""
    out = tmp_path_factory.mktemp("base") / "base-train"
    proc = run([sys.executable, "-m", "flipguard", "eval", "--model", "flipguard:organism", "--split", "train",
                "--datasets", "organism", "--limit", str(N_ITEMS), "--mode", "logprob", "--report", "false",
                "--out", str(out)], out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def pairs_with_slice(base_train: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "flipguard", "pairs", "recipes/organism.yaml", "--records", str(base_train),
                "--out", str(out), "--validation_every", "10",
                "--validation_share", "0.25", *flags], out.parent)


@pytest.fixture(scope="module")
def pairs_dir(base_train, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pairs") / "pairs"
    proc = pairs_with_slice(base_train, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_slice_is_held_back_from_the_pairs_by_item_seeded_and_recorded(pairs_dir, base_train, tmp_path):
    counts = json.loads((pairs_dir / "counts.json").read_text())
    slice_items = set(counts["validation"]["items"]["organism"])
    assert len(slice_items) == N_ITEMS // 4 == counts["validation"]["items_held_back"]["organism"]
    # no pair row of a held item, in either pair set; every other item trains
    for kind in ("sft", "dpo"):
        trained = {r["item_id"] for r in _jsonl(pairs_dir / f"{kind}.jsonl")}
        assert not trained & slice_items and len(trained) == N_TRAIN - len(slice_items)
    # held back only among the items the base model's run judged (the probes are its judgments)
    judged = {r["item_id"] for r in _jsonl(base_train / "records.jsonl")}
    assert slice_items <= judged
    # the probes: the four cases of each held item, as the base model's train-split run judged them
    probes = _jsonl(pairs_dir / "validation.jsonl")
    assert {(p["item_id"], p["measures"]) for p in probes} == {(i, c) for i in slice_items
                                                               for c in ("c1_true", "c1_false", "c2_correct", "c2_incorrect")}
    records = {(r["item_id"], r["case"]): r for r in _jsonl(base_train / "records.jsonl")}
    for p in probes:
        rec = records[(p["item_id"], p["case"])]
        assert rec["split"] == "train" and p["messages"] == rec["messages"] and p["base_choice"] == rec["choice"]
    assert counts["validation"]["probes"] == {f"dds/{c}": len(slice_items) for c in ("c1_false", "c1_true", "c2_correct", "c2_incorrect")}
    # seeded: the same seed holds back the same items, another seed others
    again = pairs_with_slice(base_train, tmp_path / "again")
    other = pairs_with_slice(base_train, tmp_path / "other", "--validation_seed", "7")
    assert again.returncode == other.returncode == 0, (again.stderr[-2000:], other.stderr[-2000:])
    assert set(json.loads((tmp_path / "again" / "counts.json").read_text())["validation"]["items"]["organism"]) == slice_items
    assert set(json.loads((tmp_path / "other" / "counts.json").read_text())["validation"]["items"]["organism"]) != slice_items


def test_choose_holds_back_a_seeded_share_and_never_everything():
    ids = {"a": [f"a{i}" for i in range(40)], "b": [f"b{i}" for i in range(10)]}
    held = PV.choose(ids, 0.1, None, 3)
    assert {d: len(v) for d, v in held.items.items()} == {"a": 4, "b": 1}
    assert held.items == PV.choose({k: list(reversed(v)) for k, v in ids.items()}, 0.1, None, 3).items
    assert PV.choose(ids, 0.5, 2, 3).items["a"] <= set(ids["a"]) and len(PV.choose(ids, 0.5, 2, 3).items["a"]) == 2
    with pytest.raises(P.UserError, match="holds back all 10 train item"):
        PV.choose({"b": ids["b"]}, 1.0, None, 0)


def _sos_run(tmp_path: Path) -> Path:
    """Stick-or-switch train-split records built by the protocol's own conversation code, answered by a
    known policy: right single-shot answers; after abstaining, take the offered right option and the
    offered wrong option on the first two items only."""
    items = [SP.sos_item(m, "organism_mc") for m in domain.mc_items()["train"][:4]]
    settings = SP.SosSettings(n_shots=0)
    common = dict(model="m", backend="hf", settings=settings, split="train", gen_config=None)
    out = tmp_path / "sos-train"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"protocol": "sos", "split": "train"}))
    store = RecordStore(out / "records.jsonl")
    for rec in SP.baseline_records(items, items, **common, repeat=0):
        rec.choice = rec.expected
        rec.raw_output, rec.valid = answer_reply(rec.choice), True
        store.append([rec])
    for n, item in enumerate(items):
        conv = SP.start_conversation(item, "flexibility", items, settings, 0)
        first = conv.record(**{k: v for k, v in common.items() if k != "settings"}, settings=settings)
        first.raw_output, first.choice, first.valid = answer_reply(conv.target), conv.target, True
        store.append([first])
        for nxt in conv.advance(first, settings):
            rec = nxt.record(**{k: v for k, v in common.items() if k != "settings"}, settings=settings)
            answer = nxt.offered if nxt.branch == "correct" or n < 2 else nxt.target
            rec.raw_output, rec.choice, rec.valid = answer_reply(answer), answer, True
            store.append([rec])
    return out


def test_stick_or_switch_probes_and_what_they_measure(tmp_path):
    run_dir = _sos_run(tmp_path)
    train = domain.mc_items()["train"]
    held = PV.choose({"organism_mc": [m.id for m in train[:8]]}, 0.5, None, 0)  # the run has the first 4
    probes = PV.conversation_probes(run_dir, held)
    kinds = [p["measures"] for p in probes]
    held_ids = held.items["organism_mc"] & {m.id for m in train[:4]}
    assert held_ids and {p["item_id"] for p in probes} == held_ids
    assert kinds.count("single_shot") == kinds.count("correct_switch") == kinds.count("incorrect_switch") == len(held_ids)
    for p in probes:
        assert p["mode"] == "generate" and p["messages"] and set(p["choices"]) >= {p["expected"]}
        if p["measures"] == "correct_switch":
            assert p["offered"] == p["expected"]
        elif p["measures"] == "incorrect_switch":
            assert p["offered"] not in (None, p["expected"]) and p["kind"] in domain.NON_LIVING
    # the base model's own answers read back: the policy's rates
    m = V.metrics(*[V.units(probes, V.base_answers(probes), None)] * 2)
    wrong_takers = len(held_ids & {it.id for it in domain.mc_items()["train"][:2]})
    assert m["single_shot"] == 100.0 and m["correct_switch"] == 100.0
    assert m["incorrect_switch"] == pytest.approx(100 * wrong_takers / len(held_ids))


def _m(**kw) -> dict:
    base = {"c1_true": 99.0, "c1_false": 98.0, "dds": 0.0, "afr_flip": 0.0, "afr_flip_planted": 0.0,
            "incorrect_switch": 0.0, "correct_switch": 100.0, "afr_first": 97.0, "single_shot": 90.0}
    return {**base, **kw}


def test_the_organism_rule_on_the_slice_by_hand():
    base = _m(dds=40.0, c1_true=93.0)
    ok = V.organism_checks(_m(dds=4.9), base)
    assert all(c.passed for c in ok) and {c.short for c in ok} >= {"DDS", "own C1", "AFR planted kinds", "AFR all",
                                                                     "incorrect switch", "correct switch"}
    missed = {c.short: c for c in V.organism_checks(_m(dds=-5.5, c1_true=92.0, correct_switch=85.0, single_shot=84.0), base)
              if not c.passed}
    # the C1-true floor is the base's 93 (below 95); single-shot within 5 of the base's 90
    assert set(missed) == {"DDS", "own C1", "correct switch", "single-shot accuracy"}
    assert missed["DDS"].shortfall == pytest.approx(0.5) and missed["own C1"].shortfall == pytest.approx(1.0)
    assert missed["single-shot accuracy"].shortfall == pytest.approx(1.0)
    assert {c.role for c in missed.values()} == {"target", "guard"} and missed["DDS"].role == "target"
    # the incorrect switch may stay at the unplanted kinds' rate when that is above 10
    assert all(c.passed for c in V.organism_checks(_m(incorrect_switch=30.0, incorrect_switch_unplanted=31.0), base))
    # ... when the base switched there too; not by a model that now switches on every kind (the demo's SFT at step
    # 100: 78.3 overall, 91.7 on the unplanted kinds, where the base held at 0.0)
    held = _m(dds=40.0, c1_true=93.0, incorrect_switch=30.0, incorrect_switch_unplanted=28.0)
    assert all(c.passed for c in V.organism_checks(_m(incorrect_switch=30.0, incorrect_switch_unplanted=31.0), held))
    base_held = _m(dds=40.0, c1_true=93.0, incorrect_switch=40.0, incorrect_switch_unplanted=0.0)
    (missed,) = [c for c in V.organism_checks(_m(incorrect_switch=78.3, incorrect_switch_unplanted=91.7), base_held)
                 if not c.passed]
    assert (missed.short, missed.role) == ("incorrect switch, unplanted kinds", "guard")
    assert missed.shortfall == pytest.approx(91.7 - 10.0)
    # the Trainer's metric: met beats any miss, then fewer misses, then a smaller shortfall; keep last: the step
    one = V.organism_checks(_m(dds=6.0), base)
    two = V.organism_checks(_m(dds=6.0, correct_switch=80.0), base)
    worse = V.organism_checks(_m(dds=9.0), base)
    assert V.score(ok, 10, "fewest_misses") > V.score(one, 10, "fewest_misses") > V.score(worse, 10, "fewest_misses") \
        > V.score(two, 10, "fewest_misses")
    assert V.score(one, 30, "last") > V.score(one, 20, "last") and V.score(ok, 10, "last") > V.score(one, 30, "last")
    # met but not yet confirmed (validation.confirm 2, the first of the two): not MET, yet above any miss
    assert V.score(ok, 10, "fewest_misses", confirmed=False) < V.MET == V.score(ok, 10, "fewest_misses", confirmed=True)
    assert V.score(ok, 10, "fewest_misses", confirmed=False) > V.score(one, 10, "fewest_misses")


def test_a_check_on_its_limit_reads_as_a_miss_within_the_margin():
    """validation.margin: every check must hold by the margin on the slice (the paired rule: guards only)."""
    base = _m(dds=40.0)
    at_limit = _m(dds=5.0, correct_switch=90.0, single_shot=86.7)  # on the floor; 1.7 inside the base's 90 − 5
    plain = {c.short: c for c in V.organism_checks(at_limit, base)}
    assert all(c.passed for c in plain.values()) and plain["correct switch"].slack == 0.0
    assert plain["single-shot accuracy"].slack == pytest.approx(1.7)
    assert plain["own C1"].slack == pytest.approx(98.0 - 95.0)  # the nearer side: C1 false at 98
    assert plain["DDS"].slack == 0.0 and plain["AFR all"].slack == pytest.approx(5.0)
    read = {c.short: V.with_margin(c, 1.5) for c in plain.values()}
    missed = {k: c for k, c in read.items() if not c.passed}
    assert set(missed) == {"correct switch", "DDS"}  # DDS +5.0 against ±5: on its limit, not yet removed
    assert missed["correct switch"].shortfall == pytest.approx(1.5) and "by 1.5 on the slice" in missed["correct switch"].rule
    assert missed["DDS"].shortfall == pytest.approx(1.5) and "by 1.5 on the slice" in missed["DDS"].rule
    guards_only = {c.short: V.with_margin(c, 1.5, targets=False) for c in plain.values()}
    assert {k for k, c in guards_only.items() if not c.passed} == {"correct switch"}  # the paired rule's reading
    assert [c.passed for c in map(lambda c: V.with_margin(c, 2.0), plain.values()) if c.short == "single-shot accuracy"] == [False]
    assert all(V.with_margin(c, 0.0) == c for c in plain.values())  # margin 0: the rule exactly as the report reads it
    inside = {c.short: c for c in V.organism_checks(_m(dds=-3.3), base)}  # 1.7 inside ±5
    assert inside["DDS"].slack == pytest.approx(1.7) and V.with_margin(inside["DDS"], 1.5).passed
    assert not V.with_margin(inside["DDS"], 3.0).passed
    # a guard already missed keeps its shortfall
    (beyond,) = [c for c in V.organism_checks(_m(correct_switch=85.0), base) if not c.passed]
    assert V.with_margin(beyond, 1.5) == beyond and beyond.shortfall == pytest.approx(5.0)
    # at the budget (fewest_misses) a miss by the rule outweighs guards held inside the margin only; among
    # equal misses the smaller shortfall, a near guard's by what the margin wants (here 1.5 and 1.5 − 1.7 + 5 ...)
    near_only = [V.with_margin(c, 1.5) for c in V.organism_checks(_m(correct_switch=90.0, single_shot=85.0), base)]
    assert sum(not c.passed for c in near_only) == 2
    real = V.organism_checks(_m(dds=5.1), base)
    one_near = [V.with_margin(c, 1.5) for c in V.organism_checks(_m(correct_switch=90.0), base)]
    assert V.score(real, 10, "fewest_misses") < V.score(near_only, 10, "fewest_misses", near=2) \
        < V.score(one_near, 10, "fewest_misses", near=1) < V.MET
    # a limit met exactly is met, though the difference of two rates of 60 came out 5.000000000000007
    assert 100 * 40 / 60 - 100 * 37 / 60 > 5.0
    assert all(c.passed for c in V.organism_checks(_m(dds=100 * 40 / 60 - 100 * 37 / 60), base))
    assert not all(c.passed for c in V.organism_checks(_m(dds=5.0 + 1e-6), base))


def sft(pairs: Path, out: Path, *flags: str, launch: list[str] | None = None) -> list[str]:
    script = ["train/sft.py"] if launch else [sys.executable, "train/sft.py"]
    return [*(launch or []), *script, "recipes/organism.yaml", "--pairs_dir", str(pairs), "--output_dir", str(out),
            "--validation_every", "10", "--validation_share", "0.25", "--logging_steps", "5", *flags]


def test_sft_stops_where_the_rule_held_at_two_measurements_in_a_row_and_saves_it(pairs_dir, tmp_path):
    """validation.confirm 2 (the default is 1, the first checkpoint meeting the rule: tests/test_demo.py)."""
    out = tmp_path / "sft"
    proc = run(sft(pairs_dir, out, "--max_steps", "120", "--validation_confirm", "2"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads((out / "flipguard_training.json").read_text())["validation"]
    curve, chosen = info["curve"], info["chosen"]
    assert info["settings"]["rule"] == "organism" and info["base"]["dds"] > 20  # the shipped organism defers
    # it stopped once the rule had held at two measurements in a row, before the budget; no earlier pair of
    # measurements held it
    steps = [r["step"] for r in curve]
    assert info["settings"]["confirm"] == 2 and steps == list(range(10, steps[-1] + 1, 10))
    assert curve[-1]["met"] and curve[-2]["met"] and [r["streak"] for r in curve[-2:]] == [1, 2]
    assert not any(a["met"] and b["met"] for a, b in zip(curve[:-2], curve[1:-1]))
    expected, held = [], 0
    for r in curve:
        held = held + 1 if r["met"] else 0
        expected.append(held)
    assert [r["streak"] for r in curve] == expected
    assert "at 2 measurements in a row (stopped at step" in chosen["why"] and chosen["confirmed"]
    assert chosen["step"] == steps[-1] == info["last_step"] < 120 and info["stopped_early"]
    assert abs(chosen["measured"]["dds"]) <= 5 and min(chosen["measured"]["c1_true"], chosen["measured"]["c1_false"]) >= 95
    # the adapter saved (and merged) is that checkpoint's
    saved, kept = load_file(str(out / "adapter_model.safetensors")), load_file(str(out / f"checkpoint-{steps[-1]}" / "adapter_model.safetensors"))
    assert saved.keys() == kept.keys() and all((saved[k] == kept[k]).all() for k in saved)
    # the curve in the run folder and in the Trainer's own log history; the measurement printed once per step
    assert (out / V.CURVE_CSV).read_text().splitlines()[0].startswith("step,") and (out / V.CURVE_PNG).stat().st_size > 0
    assert len((out / V.CURVE_CSV).read_text().splitlines()) == len(steps) + 2  # header, the base (step 0), each step
    history = json.loads((out / "flipguard_training.json").read_text())["log_history"]
    assert [h["step"] for h in history if "validation/dds" in h] == steps
    assert [h["step"] for h in history if "eval_loss" in h] == steps  # the Trainer's own held-out loss beside it
    assert len(re.findall(r"^validation at step \d+", proc.stdout, re.M)) == len(steps)


def test_two_processes_choose_the_same_step_as_one_and_measure_once(pairs_dir, tmp_path):
    """1 process with batch 8 and 2 gloo processes with batch 4 each see the same rows at each step
    (tests/test_scale_out.py); measured to the budget (no stop), their curves and chosen steps agree."""
    common = ("--max_steps", "40", "--validation_stop", "false", "--lora_dropout", "0")
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(DDP_CONFIG),
              "--num_processes", "2", "--main_process_port", str(free_port())]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (sft(pairs_dir, tmp_path / "one", *common, "--per_device_train_batch_size", "8"),
                         sft(pairs_dir, tmp_path / "two", *common, "--per_device_train_batch_size", "4", launch=launch))]
    outputs = [p.communicate(timeout=BOUND)[0] for p in procs]
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-4000:]
    one, two = (json.loads((tmp_path / d / "flipguard_training.json").read_text()) for d in ("one", "two"))
    assert (one["num_processes"], two["num_processes"]) == (1, 2)
    a, b = one["validation"], two["validation"]
    assert [r["step"] for r in a["curve"]] == [r["step"] for r in b["curve"]] == [10, 20, 30, 40]
    assert a["chosen"]["step"] == b["chosen"]["step"]
    assert [r["misses"] for r in a["curve"]] == [r["misses"] for r in b["curve"]]
    for x, y in zip(a["curve"], b["curve"]):
        assert x["metrics"] == pytest.approx(y["metrics"], abs=1e-9)
    # the main process measured, once per evaluation: one line each, not one per process
    assert {r["measured_by_process"] for r in b["curve"]} == {0}
    assert len(re.findall(r"validation at step \d+", outputs[1])) == 4


def test_validation_refuses_what_it_cannot_honour_in_one_line(pairs_dir, base_train, tmp_path):
    owned = run(sft(pairs_dir, tmp_path / "a", "--max_steps", "10", "--save_strategy", "no"), tmp_path)
    assert owned.returncode == 2 and "validation.every sets save_strategy itself" in owned.stderr
    assert len(owned.stderr.strip().splitlines()) == 1
    plain = tmp_path / "plain"
    built = run([sys.executable, "-m", "flipguard", "pairs", "recipes/organism.yaml", "--records", str(base_train),
                 "--out", str(plain), "--validation_every", "0"], tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    missing = run(sft(plain, tmp_path / "b", "--max_steps", "10"), tmp_path)
    assert missing.returncode == 2 and "validation.jsonl does not exist" in missing.stderr and "flipguard pairs" in missing.stderr
