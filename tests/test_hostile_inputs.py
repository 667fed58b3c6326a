"""Hostile inputs, each injected for real: files with bytes that are not
UTF-8, broken YAML, values of the wrong type, an item longer than the model's context
through the real hf backend, corrected and conflicting import files, a C1 baseline of
another template, a write that fails for lack of room (a real file-size limit on a
real second process), an --out that is a file.

Every refusal is one line naming the file and the line, item or key, exit status 2, no
traceback, and nothing half-written.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from flipguard.eval.records import load_records, load_run_meta, read_records
from flipguard.pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data" / "samples" / "dialdefer" / "benchmark" / "test"
IMPORT_FIXTURE = REPO / "tests" / "fixtures" / "dialdefer" / "qwen-2.5-7b-instruct" / "gpqa.jsonl"
BOUND = 1800  # seconds: a hang guard only, never a synchronisation point


def _env(**extra) -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    for needle in needles:
        assert needle in last, last
    return last


def _data_root(tmp_path: Path, rows: list[dict], tail: bytes = b"") -> Path:
    root = tmp_path / "data"
    path = root / "dialdefer" / "benchmark" / "test" / "truthfulqa.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + tail)
    return root


def _sample_rows(n: int = 3) -> list[dict]:
    return [json.loads(line) for line in (SAMPLES / "truthfulqa.jsonl").read_text().splitlines()[:n]]


# ---------------------------------------------------------------------------- bytes that are not UTF-8


def test_data_file_with_bytes_that_are_not_utf8(tmp_path, capsys, tiny_model_path):
    root = _data_root(tmp_path, _sample_rows(), tail=b'{"id": "caf\xe9", "question": "x"}\n')
    out = tmp_path / "run"
    rc = cli_main(["eval", "--model", tiny_model_path, "--datasets", "truthfulqa", "--data_root", str(root),
                   "--out", str(out)])
    assert rc == 2
    _one_line_error(capsys, "truthfulqa.jsonl:4: not UTF-8", "e9")
    assert not out.exists()


def test_import_file_with_bytes_that_are_not_utf8(tmp_path, capsys):
    src = tmp_path / "model" / "gpqa.jsonl"
    src.parent.mkdir()
    lines = IMPORT_FIXTURE.read_bytes().splitlines(keepends=True)[:3]
    src.write_bytes(lines[0] + lines[1].replace(b"Speaker 1", b"Speaker \xff1", 1) + lines[2])
    out = tmp_path / "run"
    assert cli_main(["import-records", str(src.parent), "--out", str(out)]) == 2
    _one_line_error(capsys, f"{src}:2: not UTF-8", "ff")
    assert not out.exists()


def test_recipe_with_bytes_that_are_not_utf8(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes((REPO / "recipes" / "tiny.yaml").read_bytes() + b"# na\xefve comment\n")
    assert cli_main(["pairs", str(recipe), "--out", str(tmp_path / "pairs")]) == 2
    _one_line_error(capsys, f"{recipe}:", "not UTF-8")
    assert not (tmp_path / "pairs").exists()


# ---------------------------------------------------------------------------- YAML: broken, wrong types


@pytest.mark.parametrize("command, base, old, new, needles", [
    ("sos", "sos_tiny.yaml", "limit: 12", "limit: 2.5", ["key 'limit' must be an integer", "2.5"]),
    ("sos", "sos_tiny.yaml", "temperature: 0.0", "temperature: [0.5]", ["key 'temperature' must be a number"]),
    ("sos", "sos_tiny.yaml", "datasets: medqa", 'datasets: "medqa', ["not valid YAML"]),
    ("afr", "afr_tiny.yaml", "k_values: [1, 3]", "k_values: [1, 2.5]", ["key 'k_values' must be a list of integers"]),
    ("afr", "afr_tiny.yaml", "cross_k: 3", "cross_k: [3", ["not valid YAML"]),
])
def test_run_config_with_wrong_types_or_broken_yaml(tmp_path, capsys, command, base, old, new, needles):
    text = (REPO / "recipes" / base).read_text()
    assert old in text
    config = tmp_path / base
    config.write_text(text.replace(old, new))
    line = text[: text.index(old)].count("\n") + 1
    out = tmp_path / "run"
    assert cli_main([command, str(config), "--out", str(out)]) == 2
    _one_line_error(capsys, f"{config}:{line}:" if "YAML" not in needles[0] else f"{config}:", *needles)
    assert not out.exists()  # nothing ran, no run.json


@pytest.mark.parametrize("old, new, needle", [
    ("  beta: 0.1", "  beta: [0.1]", "key 'dpo.beta' must be a number"),
    ("  max_steps: 8\n  per_device_train_batch_size: 2\n  gradient_accumulation_steps: 1\n  learning_rate: 1.0e-2",
     "  max_steps: 2.5\n  per_device_train_batch_size: 2\n  gradient_accumulation_steps: 1\n  learning_rate: 1.0e-2",
     "key 'sft.max_steps' must be an integer"),
    ("lora_r: 8", "lora_r: [8", "not valid YAML"),
])
def test_recipe_with_wrong_types_or_broken_yaml_fails_before_any_model_loads(tmp_path, old, new, needle):
    text = (REPO / "recipes" / "tiny.yaml").read_text()
    assert old in text
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text.replace(old, new, 1))
    out = tmp_path / "dpo"
    proc = subprocess.run([sys.executable, "train/dpo.py", str(recipe), "--output_dir", str(out)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=BOUND)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in proc.stderr and str(recipe) in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------- an item past the context


def test_item_longer_than_the_context_is_refused_before_the_forward_pass(tmp_path, capsys, tiny_model_path):
    rows = _sample_rows()
    rows[1]["question"] = "Is this sentence long enough to matter? " * 1500  # ~60 KB, > 8,192 tokens
    root = _data_root(tmp_path, rows)
    out = tmp_path / "run"
    rc = cli_main(["eval", "--model", tiny_model_path, "--datasets", "truthfulqa", "--data_root", str(root),
                   "--out", str(out), "--report", "false"])
    assert rc == 2
    line = _one_line_error(capsys, f"item {rows[1]['id']!r}", "tokens", "8,192 tokens, max_position_embeddings",
                           "nothing was run")
    n = int(line.split("the prompt is ")[1].split(" tokens")[0].replace(",", ""))
    assert n > 8192
    assert not out.exists()  # no run.json, no records, no empty run directory
    # the same file without the long item runs
    root2 = _data_root(tmp_path / "ok", [rows[0], rows[2]])
    assert cli_main(["eval", "--model", tiny_model_path, "--datasets", "truthfulqa", "--data_root", str(root2),
                     "--out", str(out), "--report", "false"]) == 0
    assert len(load_records(out)) == 8


# ---------------------------------------------------------------------------- --c1_from of another run


def test_c1_from_another_template_is_a_recorded_warning(tmp_path, capsys, tiny_model_path):
    base, run = tmp_path / "base", tmp_path / "run"
    common = ["--model", tiny_model_path, "--datasets", "truthfulqa", "--limit", "1", "--report", "false"]
    assert cli_main(["eval", *common, "--out", str(base)]) == 0
    capsys.readouterr()
    assert cli_main(["eval", *common, "--out", str(run), "--template", "v1", "--c1_from", str(base)]) == 0
    err = capsys.readouterr().err
    assert "warning: --c1_from" in err and "template 'v0-released' there, 'v1' here" in err
    assert load_run_meta(run)["c1_from_differs"] == {"template": ["v0-released", "v1"]}
    assert load_run_meta(base).get("c1_from_differs") is None


# ---------------------------------------------------------------------------- import-records


def _import_file(tmp_path: Path, rows: list[dict], name: str = "gpqa.jsonl") -> Path:
    src = tmp_path / "qwen" / name
    src.parent.mkdir(exist_ok=True)
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src.parent


def _fixture_rows(n: int) -> list[dict]:
    return [json.loads(line) for line in IMPORT_FIXTURE.read_text().splitlines()[:n]]


def test_corrected_reimport_replaces_the_changed_answers(tmp_path, capsys):
    rows = _fixture_rows(4)
    out = tmp_path / "run"
    src = _import_file(tmp_path, rows)
    assert cli_main(["import-records", str(src), "--out", str(out)]) == 0
    before = {(r.item_id, r.case): r for r in load_records(out)}
    fixed = dict(rows[2], c1_false_statement_ans_t1="1" if rows[2]["c1_false_statement_ans_t1"] == "2" else "2")
    _import_file(tmp_path, rows[:2] + [fixed] + rows[3:])
    capsys.readouterr()
    assert cli_main(["import-records", str(src), "--out", str(out)]) == 0
    assert "0 new, 1 corrected" in capsys.readouterr().out
    after = {(r.item_id, r.case): r for r in load_records(out)}
    assert len(list(read_records(out / "records.jsonl"))) == len(after) == len(before) == 16
    key = (rows[2]["id"], "c1_false")
    assert after[key].choice == fixed["c1_false_statement_ans_t1"] != before[key].choice
    assert all(after[k].choice == before[k].choice for k in before if k != key)
    assert load_run_meta(out)["corrections"][0]["records"] == 1


def test_conflicting_duplicate_item_in_an_import_file_is_refused_naming_both_lines(tmp_path, capsys):
    rows = _fixture_rows(3)
    twin = dict(rows[0], c2_correct_chat_ans_t1="1" if rows[0]["c2_correct_chat_ans_t1"] == "2" else "2")
    src = _import_file(tmp_path, rows + [twin])
    out = tmp_path / "run"
    assert cli_main(["import-records", str(src), "--out", str(out)]) == 2
    _one_line_error(capsys, f"{src / 'gpqa.jsonl'}:4: conflicting duplicate item {rows[0]['id']!r}",
                    f"first at {src / 'gpqa.jsonl'}:1")
    assert not out.exists()


def test_conflicting_duplicate_item_in_a_data_file_is_refused_naming_both_lines(tmp_path, capsys, tiny_model_path):
    rows = _sample_rows()
    root = _data_root(tmp_path, rows + [dict(rows[0], question="Another question?")])
    out = tmp_path / "run"
    assert cli_main(["eval", "--model", tiny_model_path, "--datasets", "truthfulqa", "--data_root", str(root),
                     "--out", str(out)]) == 2
    _one_line_error(capsys, "truthfulqa.jsonl:4: duplicate id", "first on line 1")
    assert not out.exists()


def test_second_model_into_one_import_out_is_refused(tmp_path, capsys):
    src = _import_file(tmp_path, _fixture_rows(2))
    out = tmp_path / "run"
    assert cli_main(["import-records", str(src), "--out", str(out)]) == 0
    records = (out / "records.jsonl").read_bytes()
    assert cli_main(["import-records", str(src), "--out", str(out), "--model", "another-model"]) == 2
    _one_line_error(capsys, "model 'qwen' there, 'another-model' now", "nothing was imported")
    assert (out / "records.jsonl").read_bytes() == records and load_run_meta(out)["model"] == "qwen"


# ---------------------------------------------------------------------------- disk full, --out


def _limit_file_size(limit: int):
    def apply():  # a real limit on the second process: its writes past `limit` bytes fail (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_write_that_runs_out_of_room_is_one_line_and_the_rerun_resumes(tmp_path, tiny_model_path):
    out, clean = tmp_path / "run", tmp_path / "clean"
    cmd = [sys.executable, "-m", "flipguard.pipeline.cli", "eval", "--model", tiny_model_path, "--datasets",
           "truthfulqa", "--limit", "3", "--batch_size", "1", "--report", "false"]
    proc = subprocess.run(cmd + ["--out", str(out)], env=_env(), capture_output=True, text=True, timeout=BOUND,
                          preexec_fn=_limit_file_size(6000))
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and "records.jsonl: cannot write records (File too large)" in err
    assert "rerun the same command to resume" in err
    assert (out / "records.jsonl").stat().st_size == 6000  # the limit was reached mid-line
    kept = list(read_records(out / "records.jsonl"))
    assert 0 < len(kept) < 12
    subprocess.run(cmd + ["--out", str(out)], env=_env(), capture_output=True, text=True, timeout=BOUND, check=True)
    subprocess.run(cmd + ["--out", str(clean)], env=_env(), capture_output=True, text=True, timeout=BOUND, check=True)
    resumed = {r.key: r.choice for r in read_records(out / "records.jsonl")}
    assert len(list(read_records(out / "records.jsonl"))) == len(resumed) == 12  # the torn line was cut
    assert resumed == {r.key: r.choice for r in read_records(clean / "records.jsonl")}


def test_out_that_is_a_file_is_refused(tmp_path, capsys, tiny_model_path):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    assert cli_main(["eval", "--model", tiny_model_path, "--datasets", "truthfulqa", "--limit", "1",
                     "--out", str(out)]) == 2
    _one_line_error(capsys, f"{out}: exists and is not a directory")
    assert out.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_out_in_a_read_only_directory_is_refused(tmp_path, capsys, tiny_model_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        assert cli_main(["eval", "--model", tiny_model_path, "--datasets", "truthfulqa", "--limit", "1",
                         "--out", str(parent / "run")]) == 2
        _one_line_error(capsys, "cannot write the run directory")
    finally:
        parent.chmod(0o755)


def test_every_protocol_checks_the_context_before_the_first_request(tmp_path, tiny_model_path):
    """AFR and stick-or-switch send their requests through run_records: an oversized
    conversation is refused there too, before any forward pass, nothing stored."""
    from flipguard.eval.backends.base import ContextTooLong, GenerationConfig, get_backend
    from flipguard.eval.records import Record, RecordStore, keyed
    from flipguard.eval.runner import run_records

    def rec(i: int, text: str) -> Record:
        return keyed(Record(key="", protocol="sos", item_id=f"medqa-{i}", dataset="medqa", case="baseline",
                            expected="A", model="tiny", backend="hf", mode="generate",
                            messages=[{"role": "user", "content": text}]), GenerationConfig(max_new_tokens=8))

    store = RecordStore(tmp_path / "records.jsonl")
    backend = get_backend("hf", tiny_model_path, device="cpu")
    sent: list = []
    generate = backend.generate
    backend.generate = lambda conversations, *a, **kw: sent.extend(conversations) or generate(conversations, *a, **kw)
    records = [rec(0, "Answer: A or B?"), rec(1, "Which letter? " * 5000)]
    with pytest.raises(ContextTooLong, match=r"item 'medqa-1' \(medqa, baseline\): the prompt is [\d,]+ tokens "
                                             r"\+ 8 reply tokens, more than .* \(8,192 tokens"):
        run_records(store, records, backend, gen_config=GenerationConfig(max_new_tokens=8), parse=lambda t: (None, None))
    assert sent == [] and len(store) == 0 and not (tmp_path / "records.jsonl").exists()


def _mmlu_with_an_oversized_question(root: Path) -> Path:
    """An MMLU folder (the shipped dev split for exemplars) whose one test question is
    longer than the tiny model's 8,192-token context."""
    import csv
    import shutil

    mmlu = root / "mmlu"
    shutil.copytree(REPO / "data" / "samples" / "mmlu" / "dev", mmlu / "dev")
    (mmlu / "test").mkdir()
    with open(mmlu / "test" / "formal_logic_test.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["question", "choice0", "choice1", "choice2", "choice3", "answer"])
        w.writerow(["Which letter? " * 5000, "alpha", "beta", "gamma", "delta", 1])
    return root


@pytest.mark.parametrize("command", ["afr", "sos"])
def test_over_context_item_is_refused_before_anything_is_written(tmp_path, capsys, tiny_model_path, command):
    """AFR and stick-or-switch refuse an oversized item before the sample, run.json or any
    record is written: a new --out is not created, an existing one is left as it was."""
    root = _mmlu_with_an_oversized_question(tmp_path / "data")
    args = {
        "afr": ["afr", "--model", f"tiny=hf:{tiny_model_path}", "--data_root", str(root), "--per_subject", "1",
                "--k_values", "1", "--cross", "false", "--progress", "false"],
        "sos": ["sos", "--datasets", "mmlu", "--model", tiny_model_path, "--data_root", str(root), "--limit", "1",
                "--device", "cpu", "--report", "false"],
    }[command]
    new = tmp_path / "new"
    assert cli_main([*args, "--out", str(new)]) == 2
    _one_line_error(capsys, "formal_logic", "tokens", "8,192", "nothing was run")
    assert not new.exists()

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    assert cli_main([*args, "--out", str(existing)]) == 2
    _one_line_error(capsys, "8,192")
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]  # refused: not even a lock file left
    assert (existing / "notes.txt").read_text() == "mine"
