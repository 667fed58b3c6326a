"""Strict values everywhere a user types them: recipes, run configs (AFR, stick-or-switch),
`--backend_args` and `flipguard data --register`, each tried for real through the CLI on real
files. Every refusal is one line naming the file (and line) or option, exit status 2, before any
model loads and before anything is written; the one mechanism behind them is config/'s
(files.check_types by the dataclass field's type, config/values.py VALUE_RULES by its name, files.load_yaml
for keys given twice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from one_line import one_line

from flipguard.pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "tiny.yaml"
BOUND = 900  # seconds: a hang guard only


def _line_of(path: Path, text: str, nth: int = 1) -> int:
    """The 1-based line of the nth line of `path` that starts with `text`."""
    hits = [i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(text)]
    return hits[nth - 1]


def _unused_gpu() -> str:
    """A CUDA device this machine does not have, whatever it has."""
    import torch

    return f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 7}"


# ---------------------------------------------------------------------------- --backend_args


@pytest.mark.parametrize("backend_args, needle", [
    ({"prefix_sharing": "false"}, "key 'prefix_sharing' must be true/false, got 'false' (str)"),
    ({"prefix_sharing": "no"}, "key 'prefix_sharing' must be true/false, got 'no' (str)"),
    ({"prefix_sharing": [False]}, "key 'prefix_sharing' must be true/false, got [False] (list)"),
    ({"batch_size": "eight"}, "key 'batch_size' must be an integer, got 'eight' (str)"),
    ({"batch_size": 0}, "key 'batch_size' must be between 1 and 65,536, got 0"),
    ({"dtype": "float99"}, "key 'dtype' must be auto or a floating-point dtype of torch"),
    ({"device": "GPU"}, "key 'device' must be a device of this machine (cpu"),
])
def test_backend_args_are_checked_by_type_and_value_before_any_model_loads(tmp_path, capsys, backend_args, needle):
    """The model named does not exist: a refusal that names the setting, not the model, came first."""
    out = tmp_path / "run"
    code = cli_main(["eval", "--model", str(tmp_path / "no-such-model"), "--datasets", "truthfulqa", "--limit", "1",
                     "--out", str(out), "--backend_args", json.dumps(backend_args)])
    one_line(capsys, code, "--backend_args: ", needle, "nothing was run")
    assert not out.exists()


def test_a_key_given_twice_in_json_is_refused_as_in_yaml(tmp_path, capsys):
    """JSON keeps the last of a key given twice without a word; flipguard refuses it, as load_yaml does in a
    recipe: in --backend_args (eval and a study's --backend_args), and in a data file's row (data --register below)."""
    out = tmp_path / "run"
    twice = '{"prefix_sharing": false, "prefix_sharing": true}'
    code = cli_main(["eval", "--model", "flipguard:tiny", "--datasets", "truthfulqa", "--limit", "1", "--out", str(out),
                     "--backend_args", twice])
    one_line(capsys, code, "--backend_args: key 'prefix_sharing' is given twice", "nothing was run")
    assert not out.exists()
    code = cli_main(["study", "tiny", "--out", str(tmp_path / "study"), "--backend_args", twice])
    one_line(capsys, code, "key 'prefix_sharing' is given twice")
    assert not (tmp_path / "study").exists()


def test_a_device_this_machine_lacks_is_refused_as_a_flag_and_in_backend_args(tmp_path, capsys):
    gpu = _unused_gpu()
    base = ["eval", "--model", str(tmp_path / "no-such-model"), "--datasets", "truthfulqa", "--out", str(tmp_path / "r")]
    one_line(capsys, cli_main([*base, "--device", gpu]), "option --device must be a device of this machine", repr(gpu))
    one_line(capsys, cli_main([*base, "--backend_args", json.dumps({"device": gpu})]), "key 'device'", repr(gpu))
    assert not (tmp_path / "r").exists()


def test_prefix_sharing_false_as_a_boolean_turns_sharing_off(tmp_path, capsys, tiny_model_path):
    """The value the strings above stood for, given as JSON's false: accepted, and the run records
    that it computed without prefix sharing (run.json `computed`)."""
    out = tmp_path / "run"
    assert cli_main(["eval", "--model", tiny_model_path, "--datasets", "truthfulqa", "--limit", "1", "--out", str(out),
                     "--backend_args", '{"prefix_sharing": false}', "--report", "false"]) == 0
    computed = json.loads((out / "run.json").read_text())["computed"]
    assert [info["prefix_sharing"] for info in computed.values()] == [False]


# ---------------------------------------------------------------------------- recipes


def _tiny_text() -> str:
    return TINY.read_text()


def _write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_key_given_twice_in_a_section_is_refused_naming_both_lines(tmp_path, capsys):
    """A duplicated learning_rate trained at the value further down, silently."""
    text = _tiny_text().replace("  learning_rate: 1.0e-2          # large", "  learning_rate: 1.0e-2\n  learning_rate: 50.0  #", 1)
    recipe, out = _write(tmp_path, text), tmp_path / "study"
    first = _line_of(recipe, "  learning_rate:")
    assert _line_of(recipe, "  learning_rate:", 2) == first + 1
    err = one_line(capsys, cli_main(["study", str(recipe), "--out", str(out)]),
                    f"{recipe}:{first + 1}: key 'sft.learning_rate' is given twice (first at line {first})")
    assert not out.exists()
    # the trainer reads the recipe through the same reader: the same line
    assert one_line(capsys, cli_main(["sft", str(recipe)])).endswith(err.split("error: ", 1)[1])


def test_a_section_given_twice_is_refused_naming_both_lines(tmp_path, capsys):
    """An appended `sft:` replaced the first one whole, silently."""
    recipe, out = _write(tmp_path, _tiny_text() + "\nsft:\n  max_steps: 2\n"), tmp_path / "study"
    first, second = _line_of(recipe, "sft:"), _line_of(recipe, "sft:", 2)
    one_line(capsys, cli_main(["study", str(recipe), "--out", str(out)]),
              f"{recipe}:{second}: section 'sft' is given twice (first at line {first})")
    assert not out.exists()


@pytest.mark.parametrize("old, new, needle", [
    ("lora_r: 8", "lora_r: 100000000", "key 'lora_r' must be between 1 and 65,536, got 100000000"),
    ("  max_steps: 8\n", "  max_steps: 100000000000000000000000\n",
     "key 'sft.max_steps' must be -1 (train by epochs) or between 1 and 1,000,000,000"),
    ("dtype: float32", 'dtype: "float99"', "key 'dtype' must be auto or a floating-point dtype of torch"),
    ("  beta: 0.1\n", "  beta: .inf\n", "key 'dpo.beta' must be a finite number, got inf"),
    ("  limit: 4\n", '  limit: "four"\n', "key 'eval.limit' must be an integer or null, got 'four' (str)"),
])
def test_recipe_values_out_of_bounds_are_refused_with_their_line(tmp_path, capsys, old, new, needle):
    text = _tiny_text()
    assert old in text
    recipe, out = _write(tmp_path, text.replace(old, new, 1)), tmp_path / "study"
    line = _line_of(recipe, new.split(":")[0])
    one_line(capsys, cli_main(["study", str(recipe), "--out", str(out)]), f"{recipe}:{line}: {needle}")
    assert not out.exists()


def test_a_lora_rank_above_what_the_model_layers_hold_is_refused(tmp_path, capsys, tiny_model_path):
    """Within the table's bound but above min(in, out) of the tiny model's layers: refused on the
    meta-device model, before the first stage and before the trainer loads anything."""
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(tiny_model_path).hidden_size
    text = _tiny_text().replace("flipguard:tiny", tiny_model_path).replace("lora_r: 8", f"lora_r: {hidden * 4}")
    recipe, out = _write(tmp_path, text), tmp_path / "study"
    one_line(capsys, cli_main(["study", str(recipe), "--out", str(out)]),
              f"key 'lora_r' must be at most {hidden:,}", f"got {hidden * 4:,}")
    assert not out.exists()
    one_line(capsys, cli_main(["dpo", str(recipe), "--output_dir", str(tmp_path / "adapter")]),
              f"key 'lora_r' must be at most {hidden:,}")
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("backend_args, needle", [
    ("{prefix_sharing: 'false'}", "key 'prefix_sharing' must be true/false, got 'false' (str)"),
    ("{batch_size: eight}", "key 'batch_size' must be an integer, got 'eight' (str)"),
    ("{device: DEVICE}", "key 'device' must be a device of this machine"),
])
def test_a_recipes_eval_backend_args_are_checked_before_the_first_stage(tmp_path, capsys, backend_args, needle):
    text = _tiny_text().replace("  backend: hf\n", f"  backend: hf\n  backend_args: {backend_args.replace('DEVICE', _unused_gpu())}\n")
    recipe, out = _write(tmp_path, text), tmp_path / "study"
    one_line(capsys, cli_main(["study", str(recipe), "--out", str(out)]), f"{recipe}: eval.backend_args: {needle}")
    assert not out.exists()


def test_a_flag_out_of_bounds_is_one_line_before_the_trainer_loads_anything(tmp_path, capsys):
    one_line(capsys, cli_main(["sft", str(TINY), "--max_steps", "100000000000000000000000",
                                "--output_dir", str(tmp_path / "adapter")]),
              "option --max_steps must be -1 (train by epochs) or between 1 and 1,000,000,000")
    assert not (tmp_path / "adapter").exists()


# ---------------------------------------------------------------------------- run configs


def _afr_config(tmp_path: Path, old: str, new: str) -> Path:
    text = (ROOT / "recipes" / "afr_tiny.yaml").read_text()
    assert old in text
    return _write(tmp_path, text.replace(old, new, 1), "afr.yaml")


@pytest.mark.parametrize("old, new, needle", [
    ("coercion_temperature: 1.0", "coercion_temperature: -1.0", "key 'coercion_temperature' must be >= 0, got -1.0"),
    ("limit: 8", "limit: 0", "key 'limit' must be >= 1, got 0"),
    ("n_boot: 500", "n_boot: 500\nseed: 3", "key 'seed' is given twice"),
    ("batch_size: 16", "batch_size: 16\nbackend_args: {prefix_sharing: 'no'}",
     "--backend_args: key 'prefix_sharing' must be true/false, got 'no' (str)"),
])
def test_afr_run_config_values_are_checked_with_their_line(tmp_path, capsys, old, new, needle):
    config, out = _afr_config(tmp_path, old, new), tmp_path / "run"
    err = one_line(capsys, cli_main(["afr", str(config), "--out", str(out)]), str(config), needle)
    if "backend_args" not in needle:  # a key's line (backend settings are checked per model); a key given twice: the second's
        key = new.splitlines()[-1].split(":")[0]
        assert f"{config}:{_line_of(config, key, 2 if 'twice' in needle else 1)}:" in err
    assert not out.exists()


@pytest.mark.parametrize("extra, needle", [
    ("format_reminder: 'no'", "key 'format_reminder' must be true/false, got 'no' (str)"),
    ("top_p: 1.5", "key 'top_p' must be > 0 and <= 1, got 1.5"),
    ("batch_size: eight", "key 'batch_size' must be an integer, got 'eight' (str)"),
    ("repeats: 0", "key 'repeats' must be >= 1, got 0"),  # stick-or-switch's own rule (registered by eval/sos)
])
def test_sos_run_config_values_are_checked_with_their_line(tmp_path, capsys, extra, needle):
    text = (ROOT / "recipes" / "sos_tiny.yaml").read_text().replace("batch_size: 8\n", "").replace("repeats: 1\n", "")
    config, out = _write(tmp_path, text + extra + "\n", "sos.yaml"), tmp_path / "run"
    line = _line_of(config, extra.split(":")[0])
    one_line(capsys, cli_main(["sos", str(config), "--out", str(out)]), f"{config}:{line}: {needle}")
    assert not out.exists()


def test_a_protocols_value_rules_live_with_the_protocol():
    """config/values.py holds the rules of shared names only; AFR's and stick-or-switch's own fields
    bring theirs when their module is imported (a fresh process: nothing imported them yet), and a
    protocol cannot give a shared name a rule of its own."""
    code = ("from flipguard.config import values\n"
            "own = ['coercion_max_new_tokens', 'coercion_temperature', 'answer_max_new_tokens', 'cross_k', 'repeats']\n"
            "before = [k for k in own if k in values.VALUE_RULES]\n"
            "import flipguard.eval.afr.protocol, flipguard.eval.sos.protocol\n"
            "print(before, [k for k in own if k not in values.VALUE_RULES], "
            "values.value_problem('coercion_max_new_tokens', 0))\n"
            "try:\n    values.register_value_rules({'batch_size': values.between(0)})\n"
            "except ValueError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BOUND)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "[] [] >= 1", "'batch_size' has a shared value rule (config/values.py VALUE_RULES): use another name"]


# ---------------------------------------------------------------------------- data --register


def _register(tmp_path: Path, entry: str, files: dict[str, bytes]) -> subprocess.CompletedProcess:
    """`flipguard data --register` in a process of its own, with its own FLIPGUARD_HOME."""
    folder = tmp_path / "mine"
    folder.mkdir(exist_ok=True)
    (folder / "dataset.yaml").write_text(entry)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    env = {**os.environ, "FLIPGUARD_HOME": str(tmp_path / "home"), "TQDM_DISABLE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", "data", "--register",
                           str(folder / "dataset.yaml")], env=env, capture_output=True, text=True, timeout=BOUND)


ROW = {"id": "a-1", "question": "Is water wet?", "correct_answer": "yes", "incorrect_answer": "no"}
ENTRY = "name: mine\ndomain: Legal\nsplits:\n  test: test.jsonl\n"


def _row(**change) -> bytes:
    return (json.dumps({**ROW, **change}) + "\n").encode()


@pytest.mark.parametrize("entry, data, needle", [
    (ENTRY, _row() + b'{"id": "a-2", "question": "caf\xe9"}\n', "test.jsonl:2: not UTF-8 text (byte(s) e9"),
    (ENTRY, _row() + _row(id="a-2", correct_answer=""), "test.jsonl:2: field 'correct_answer' is missing or empty"),
    (ENTRY, _row() + b"{not json\n", "test.jsonl:2:"),
    (ENTRY, _row() + _row(id="a-2")[:-2] + b', "id": "a-3"}\n', "test.jsonl:2: key 'id' is given twice in one object"),
    (ENTRY, b"", "test.jsonl: file is empty"),
    ("name: mine\ndomain: Legal\ndomain: Law\nsplits:\n  test: test.jsonl\n", _row(),
     "dataset.yaml:3: key 'domain' is given twice (first at line 2)"),
    (ENTRY.replace("name: mine", "name: mine\nkind: multiple_choice"),
     json.dumps({"id": "q1", "question": "Which?", "options": ["a", "b"], "answer": "C"}).encode() + b"\n",
     "test.jsonl:1: 'answer' must be one of the option letters"),
])
def test_register_reads_every_row_before_it_registers(tmp_path, entry, data, needle):
    proc = _register(tmp_path, entry, {"test.jsonl": data})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "home" / "datasets").exists() or not list((tmp_path / "home" / "datasets").iterdir())


def test_register_of_good_rows_still_registers(tmp_path):
    proc = _register(tmp_path, ENTRY, {"test.jsonl": _row() + _row(id="a-2")})
    assert proc.returncode == 0, proc.stderr
    registered = yaml.safe_load((tmp_path / "home" / "datasets" / "mine.yaml").read_text())
    assert registered["name"] == "mine" and registered["splits"]["test"] == str(tmp_path / "mine" / "test.jsonl")
