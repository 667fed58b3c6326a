"""DDS data layer: loaders, converters, leakage check, shipped samples, `flipguard data`."""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from flipguard.data import unified
from flipguard.data.aio import load_aio
from flipguard.data.converters import convert_bbq, convert_halueval, convert_harp
from flipguard.data.schema import ALL_DATASETS, BENCHMARK_DATASETS, DOMAINS, DataError, Item
from flipguard.data.splits import check_no_leakage
from flipguard.data.unified import (
    build_train_split,
    load_benchmark,
    load_items,
    read_items,
    resolve_data_root,
    shared_data_root,
)

TRAINABLE = {"amqa", "gpqa", "socialiqa", "halueval_qa", "harp_mcq", "bbq"}


@pytest.fixture(autouse=True)
def _no_env_root(monkeypatch):
    monkeypatch.delenv("FLIPGUARD_DATA", raising=False)


def _write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _bench_row(i: int, dataset: str = "gpqa", question: str | None = None, **over) -> dict:
    row = {
        "id": f"{dataset}-{i}",
        "dataset": dataset,
        "question": question or f"Question number {i}?",
        "correct_answers": [f"right {i}"],
        "incorrect_answers": [f"wrong {i}"],
        "chosen_correct_answer": f"right {i}",
        "chosen_incorrect_answer": f"wrong {i}",
        "context": None,
        "meta": {"domain": "Physics"},
    }
    row.update(over)
    return row


# ---------------------------------------------------------------- shipped samples


def test_sample_test_split_loads_every_dataset_with_complete_items():
    items = load_items("all")
    counts = Counter(i.dataset for i in items)
    assert set(counts) == set(ALL_DATASETS)
    assert all(0 < n <= 30 for n in counts.values())
    for item in items:
        assert item.split == "test"
        assert item.domain == DOMAINS[item.dataset]
        for field in ("id", "question", "correct_answer", "incorrect_answer"):
            assert getattr(item, field).strip(), (item.id, field)
        assert item.correct_answer != item.incorrect_answer
        assert (item.dialogue is not None) == (item.dataset == "aio")
    # Nothing silently dropped: one item per non-empty line of every sample file.
    for dataset in BENCHMARK_DATASETS:
        path = unified.test_file(unified.SAMPLES_ROOT, dataset)
        n_lines = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
        assert counts[dataset] == n_lines


def test_sample_keeps_dataset_metadata():
    bbq = load_benchmark("test", ["bbq"])
    assert {i.meta["context_condition"] for i in bbq} <= {"ambig", "disambig"}
    assert all(i.meta["category"] for i in bbq)
    harp = load_benchmark("test", "harp_mcq")
    assert all(i.dataset == "harp_mcq" and i.meta["level"] in (1, 2, 3, 4) for i in harp)  # file says "harp_mc"
    assert all(i.meta["domain"] in ("Physics", "Chemistry", "Biology") for i in load_benchmark("test", ["gpqa"]))
    assert all(i.meta["label"] in ("safe", "unsafe") for i in load_benchmark("test", ["advisorqa"]))


def test_sample_train_split_passes_leakage_check():
    split = build_train_split()
    counts = split.counts()
    assert set(counts) == TRAINABLE
    assert all(0 < n <= 30 for n in counts.values())
    assert all(i.split == "train" for i in split.items)
    check_no_leakage(split.items, load_items("all", "test"))
    assert load_benchmark("train", "bbq") == [i for i in split.items if i.dataset == "bbq"]


def test_aio_sample_inverts_the_posters_verdict():
    items = {i.id: i for i in load_aio()}
    assert {i.meta["op_verdict"] for i in items.values()} == {"OR", "NOR"}
    # Hand-checked against the raw rows and the paper's own Qwen records
    # (records/qwen-2.5-7b-instruct/aio.jsonl: effective_ground_truth):
    # 1oh8hfn: community says the poster (Speaker B) is NOR -> Speaker A is overreacting.
    assert items["1oh8hfn"].correct_answer == "overreacting"
    assert items["1oh8hfn"].incorrect_answer == "not overreacting"
    assert items["1oh8hfn"].meta["target_verdict"] == "OR"
    # 1lki3k8: poster is OR -> Speaker A is not overreacting.
    assert items["1lki3k8"].correct_answer == "not overreacting"
    assert items["1lki3k8"].meta["op_verdict"] == "OR"
    raw = [json.loads(line) for line in (unified.SAMPLES_ROOT / "dialdefer/aio/aio.jsonl").read_text().splitlines()]
    for row in raw:
        item = items[row["id"]]
        assert item.question == row["context"] and item.dialogue == row["c1_input"]
        assert item.correct_answer == {"NOR": "overreacting", "OR": "not overreacting"}[row["ground_truth"]]


# ---------------------------------------------------------------- validation


def test_malformed_rows_name_file_and_line(tmp_path):
    path = tmp_path / "dialdefer/benchmark/test/gpqa.jsonl"
    cases = {
        "missing question": [_bench_row(1), {k: v for k, v in _bench_row(2).items() if k != "question"}],
        "empty answer": [_bench_row(1), _bench_row(2, chosen_incorrect_answer="  ")],
        "bad json": [_bench_row(1), '{"id": "gpqa-2", "question": '],
        "wrong dataset": [_bench_row(1), _bench_row(2, dataset="amqa")],
        "same answers": [_bench_row(1), _bench_row(2, chosen_incorrect_answer="right 2")],
        "duplicate id": [_bench_row(1), _bench_row(1)],
    }
    for rows in cases.values():
        _write_jsonl(path, rows)
        with pytest.raises(DataError, match="gpqa.jsonl:2"):
            load_benchmark("test", ["gpqa"], tmp_path)


def test_empty_file_and_unknown_names(tmp_path):
    path = _write_jsonl(tmp_path / "dialdefer/benchmark/test/gpqa.jsonl", [])
    with pytest.raises(DataError, match="empty"):
        load_benchmark("test", ["gpqa"], tmp_path)
    path.unlink()
    with pytest.raises(DataError, match="not found"):
        load_benchmark("test", ["gpqa"], tmp_path)
    with pytest.raises(DataError, match="valid datasets: .*truthfulqa.*aio"):
        load_benchmark("test", ["nosuchqa"])
    with pytest.raises(DataError, match="unknown split"):
        load_items("all", "validation")
    with pytest.raises(DataError, match="evaluation-only"):
        load_benchmark("train", ["truthfulqa"])
    with pytest.raises(DataError, match="evaluation-only"):
        load_items("aio", "train")
    with pytest.raises(DataError, match="no train split"):
        load_benchmark("train", "plausibleqa")


def test_aio_bad_verdict_is_reported(tmp_path):
    row = json.loads((unified.SAMPLES_ROOT / "dialdefer/aio/aio.jsonl").read_text().splitlines()[0])
    _write_jsonl(tmp_path / "dialdefer/aio/aio.jsonl", [row, {**row, "id": "x2", "ground_truth": "maybe"}])
    with pytest.raises(DataError, match=r"aio.jsonl:2: ground_truth"):
        load_aio(tmp_path)
    _write_jsonl(tmp_path / "dialdefer/aio/aio.jsonl", [{**row, "chosen_correct_answer": "overreacting"}])
    with pytest.raises(DataError, match=r"aio.jsonl:1: .*contradicts"):
        load_aio(tmp_path)


def test_data_root_resolution(tmp_path, monkeypatch):
    assert resolve_data_root(None) == unified.SAMPLES_ROOT
    monkeypatch.setenv("FLIPGUARD_DATA", str(tmp_path))
    assert unified.default_data_root() == tmp_path
    assert resolve_data_root(None) == tmp_path
    assert resolve_data_root(unified.SAMPLES_ROOT) == unified.SAMPLES_ROOT  # explicit wins
    monkeypatch.setenv("FLIPGUARD_DATA", str(tmp_path / "missing"))
    with pytest.raises(DataError, match="FLIPGUARD_DATA"):
        resolve_data_root(None)


# ---------------------------------------------------------------- leakage


def _item(id_: str, question: str, dataset: str = "socialiqa", split: str = "test") -> Item:
    return Item(id=id_, dataset=dataset, question=question, correct_answer="a", incorrect_answer="b", split=split)


def test_leakage_by_id_and_by_reformatted_question():
    test = [_item("socialiqa-1", "How would Sasha feel afterwards?"), _item("socialiqa-2", "What will Kai do?")]
    check_no_leakage([_item("socialiqa-3", "What does Robin need?", split="train")], test)
    with pytest.raises(DataError, match=r"1 train item.*1 by id, 0 by question.*'socialiqa-2'"):
        check_no_leakage([_item("socialiqa-2", "Totally different?", split="train")], test)
    reformatted = _item("socialiqa-9", "  how WOULD sasha feel   afterwards ", split="train")
    with pytest.raises(DataError, match=r"0 by id, 1 by question text.*socialiqa 'socialiqa-9'.*'socialiqa-1'"):
        check_no_leakage([reformatted], test)


def _tiny_root(tmp_path: Path) -> Path:
    test = [_bench_row(i, "amqa") for i in (1, 2)]
    full = test + [_bench_row(3, "amqa"), _bench_row(4, "amqa", question="  QUESTION number 1 ")]
    _write_jsonl(tmp_path / "dialdefer/benchmark/test/amqa.jsonl", test)
    _write_jsonl(tmp_path / "dialdefer/benchmark/full/amqa.jsonl", full)
    return tmp_path


def test_train_builder_excludes_test_ids_and_same_question_items(tmp_path):
    split = build_train_split(["amqa"], _tiny_root(tmp_path))
    assert [i.id for i in split.items] == ["amqa-3"]
    assert sorted(split.excluded) == [
        ("amqa", "id", "amqa-1", "amqa-1"),
        ("amqa", "id", "amqa-2", "amqa-2"),
        ("amqa", "question", "amqa-4", "amqa-1"),
    ]
    assert split.excluded_counts() == {"amqa": {"id": 2, "question": 1}}


def test_train_builder_refuses_if_leakage_survives(tmp_path, monkeypatch):
    monkeypatch.setattr(unified, "exclude_test_overlap", lambda train, test: (train, []))
    with pytest.raises(DataError, match="leakage: 3 train item"):
        load_benchmark("train", ["amqa"], _tiny_root(tmp_path))


# ---------------------------------------------------------------- converters


def test_convert_halueval_fixture(tmp_path):
    rows = [
        {"knowledge": "K0", "question": "Q zero? ", "right_answer": "A0", "hallucinated_answer": "H0"},
        {"knowledge": "K1", "question": " Q one?", "right_answer": "A1", "hallucinated_answer": "H1 is wrong."},
    ]
    items = convert_halueval(_write_jsonl(tmp_path / "qa_data.json", rows))
    assert [(i.id, i.question, i.correct_answer, i.incorrect_answer) for i in items] == [
        ("halueval-qa-0", "Q zero?", "A0", "H0"),
        ("halueval-qa-1", "Q one?", "A1", "H1 is wrong."),
    ]
    assert items[1].meta["context"] == "K1" and items[0].split == "train"
    _write_jsonl(tmp_path / "bad.json", [rows[0], {**rows[1], "right_answer": ""}])
    with pytest.raises(DataError, match=r"bad.json:2: field 'right_answer'"):
        convert_halueval(tmp_path / "bad.json")


def _harp_row(number: int, answer: str = "C") -> dict:
    return {"year": "1999", "contest": "AMC_12B", "number": number, "level": 2, "subject": "algebra",
            "multiple_choice_only": False, "choices": {k: f"${k.lower()}{number}$" for k in "ABCDE"},
            "problem": f"Compute {number}.", "answer_choice": answer, "answer": f"$c{number}$",
            "solution_1": "Easy.", "num_solutions": 1}


def test_convert_harp_reads_the_zip(tmp_path):
    archive = tmp_path / "HARP_mcq.jsonl.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("HARD-Math_mcq.jsonl", "\n".join(json.dumps(_harp_row(n)) for n in (7, 8)))
    items = convert_harp(archive)
    assert [i.id for i in items] == ["harp_mc-1999-AMC_12B-7", "harp_mc-1999-AMC_12B-8"]
    assert items[0].correct_answer == "$c7$" and items[0].question == "Compute 7."
    assert items[0].incorrect_answer in {"$a7$", "$b7$", "$d7$", "$e7$"}
    assert items[0].meta["incorrect_answers"] == ["$a7$", "$b7$", "$d7$", "$e7$"]
    assert [i.incorrect_answer for i in convert_harp(archive)] == [i.incorrect_answer for i in items]  # seeded
    plain = _write_jsonl(tmp_path / "h.jsonl", [_harp_row(7), _harp_row(8, answer="F")])
    with pytest.raises(DataError, match=r"h.jsonl:2: answer_choice 'F'"):
        convert_harp(plain)


def test_convert_bbq_fixture(tmp_path):
    base = {"question_index": "1", "question_polarity": "neg", "category": "Age",
            "answer_info": {"ans0": ["grandfather", "old"], "ans1": ["grandson", "nonOld"], "ans2": ["Can't be determined", "unknown"]},
            "context": "I saw a grandson and his grandfather.", "question": "Who was struggling?",
            "ans0": "The grandfather", "ans1": "The grandson", "ans2": "Can't be determined"}
    rows = [{**base, "example_id": 0, "context_condition": "ambig", "label": 2},
            {**base, "example_id": 1, "context_condition": "disambig", "label": 1,
             "context": "I saw a grandson and his grandfather. The grandson was struggling."}]
    items = convert_bbq(_write_jsonl(tmp_path / "bbq" / "Age.jsonl", rows).parent)
    assert items[0].id == "bbq-Age-0"
    assert items[0].question == "I saw a grandson and his grandfather. Who was struggling?"
    assert (items[0].correct_answer, items[0].incorrect_answer) == ("Can't be determined", "The grandfather")
    assert (items[1].correct_answer, items[1].incorrect_answer) == ("The grandson", "The grandfather")
    assert items[1].meta["context_condition"] == "disambig"


def test_read_items_roundtrip_and_cli_export(tmp_path, capsys):
    from flipguard.data.cli import main

    out = tmp_path / "exported.jsonl"
    assert main(["--split", "train", "--datasets", "gpqa,bbq", "--export", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gpqa" in printed and "bbq" in printed and "total" in printed
    exported = read_items(out)
    assert exported == load_benchmark("train", ["gpqa", "bbq"])
    assert [i.meta for i in exported] == [i.meta for i in load_benchmark("train", ["gpqa", "bbq"])]


# ---------------------------------------------------------------- full data (skipped without it)

SHARED = shared_data_root()
needs_shared = pytest.mark.skipif(SHARED is None, reason="full shared data not present")


@pytest.fixture(scope="module")
def full_train():
    return build_train_split(None, SHARED)


@needs_shared
def test_full_test_split_sizes_match_paper_table_8():
    counts = Counter(i.dataset for i in load_items("all", "test", SHARED))
    assert counts == {"advisorqa": 300, "amqa": 240, "bbq": 300, "gpqa": 134, "halueval_qa": 300,
                      "harp_mcq": 300, "plausibleqa": 300, "socialiqa": 300, "truthfulqa": 790, "aio": 280}
    aio = Counter((i.meta["op_verdict"], i.correct_answer) for i in load_aio(SHARED))
    # 250 NOR / 30 OR posters (paper's published_aio_summary: N_OR=30, N_NOR=250).
    assert aio == {("NOR", "overreacting"): 250, ("OR", "not overreacting"): 30}


@needs_shared
def test_full_train_split_counts_and_no_leakage(full_train):
    counts = full_train.counts()
    # Table 8 Train column: AMQA 561, GPQA 314, HaluEval 9,700, HARP 3,810 (= total - test).
    assert counts["amqa"] == 561 and counts["gpqa"] == 314
    assert counts["halueval_qa"] == 9700 and counts["harp_mcq"] == 3810
    # SocialIQA: Table 8 says 1,924 = 2,224 - 300, but 5 further full-file items repeat a
    # test question verbatim (found by an independent scan), so they are left out.
    assert counts["socialiqa"] == 1919
    # BBQ: only 6 of 11 category files (11,956 rows) are available; 67 test items come
    # from them, and 1 more row repeats a test item's context+question.
    assert counts["bbq"] == 11956 - 67 - 1
    assert full_train.excluded_counts()["socialiqa"] == {"id": 300, "question": 5}
    check_no_leakage(full_train.items, load_items("all", "test", SHARED))


@needs_shared
def test_converters_reproduce_released_test_items():
    test = {i.id: i for i in load_benchmark("test", ["halueval_qa", "harp_mcq", "bbq"], SHARED)}
    converted = (convert_halueval(SHARED / "halueval/qa_data.json") + convert_harp(SHARED / "harp/HARP_mcq.jsonl.zip")
                 + convert_bbq(SHARED / "bbq"))
    matched = Counter()
    for item in converted:
        ref = test.get(item.id)
        if ref is None:
            continue
        assert item.question == ref.question.strip()
        assert item.correct_answer == ref.correct_answer.strip()
        wrong = [w.strip() for w in ref.meta["incorrect_answers"]]
        assert item.incorrect_answer in wrong
        if item.dataset != "harp_mcq":  # HARP's released pick came from a reshuffled upstream file
            assert item.incorrect_answer == ref.incorrect_answer.strip()
        matched[item.dataset] += 1
    assert matched == {"halueval_qa": 300, "harp_mcq": 300, "bbq": 67}
