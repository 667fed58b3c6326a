"""Mistakes that could end in a traceback, silence or a late failure: each is one line naming
the file, item or key and what to do, exit status 2, before any work where
it can be known before (in process, through the CLI's own main, on the tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flipguard.errors import FlipguardError
from flipguard.pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples" / "dialdefer" / "benchmark" / "test"


def one_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _eval(out: Path, *extra: str, model: str = "flipguard:tiny") -> int:
    return cli_main(["eval", "--model", model, "--datasets", "bbq", "--limit", "1", "--report", "false",
                     "--out", str(out), *extra])


@pytest.mark.parametrize("content, needle", [
    (b"GGUF", "cannot read this GGUF file: truncated (4 bytes"),
    (b"GGUF\x03\x00\x00\x00\x01", "cannot read this GGUF file: truncated (9 bytes"),
    (b"PK\x03\x04 a zip file, not a model", "it starts with b'PK\\x03\\x04', not b'GGUF' (not a GGUF file)"),
    (None, "model.gguf: no such folder or file (a model is a local folder or .gguf file"),
])
def test_a_bad_or_missing_gguf_file(tmp_path, capsys, content, needle):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    assert _eval(tmp_path / "run", model=str(path)) == 2
    one_line(capsys, str(path), needle)
    assert not (tmp_path / "run").exists()
    if content is not None:
        assert cli_main(["convert", str(path), "--out", str(tmp_path / "plain")]) == 2
        one_line(capsys, needle)


def test_an_adapter_folder_without_weights(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (adapter / "flipguard_training.json").write_text("{}")
    assert _eval(tmp_path / "run", model=f"flipguard:tiny|{adapter}") == 2
    one_line(capsys, f"{adapter}: has adapter_config.json but no weights (adapter_model.safetensors)")


def test_an_unknown_backend_args_key(tmp_path, capsys):
    assert _eval(tmp_path / "run", "--backend_args", '{"batch_sise": 4}') == 2
    one_line(capsys, "--backend_args: the hf backend takes no 'batch_sise'", "batch_size")


def test_a_backend_name_registered_twice_is_refused():
    from flipguard.eval.backends.base import _REGISTRY, backend_names, register_backend
    from flipguard.eval.backends.hf import HFBackend

    backend_names()  # the built-in backends, registered

    class Mine(HFBackend):
        pass

    with pytest.raises(FlipguardError, match=r"register_backend\('hf'\): .*Mine takes a name already registered by "
                                             r"flipguard.eval.backends.hf.HFBackend"):
        register_backend("hf")(Mine)
    assert _REGISTRY["hf"] is HFBackend
    register_backend("hf-mine")(Mine)  # under a name of its own: fine
    del _REGISTRY["hf-mine"]


def test_a_lone_surrogate_in_a_data_row(tmp_path, capsys):
    root = tmp_path / "data"
    path = root / "dialdefer" / "benchmark" / "test" / "truthfulqa.jsonl"
    path.parent.mkdir(parents=True)
    rows = [json.loads(line) for line in (SAMPLES / "truthfulqa.jsonl").read_text().splitlines()[:3]]
    rows[1]["question"] = rows[1]["question"] + "\ud800"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # ensure_ascii: written as the escape \ud800
    assert cli_main(["eval", "--model", "flipguard:tiny", "--datasets", "truthfulqa", "--data_root", str(root),
                     "--out", str(tmp_path / "run")]) == 2
    one_line(capsys, f"{path}:2: holds a lone surrogate")
    assert not (tmp_path / "run").exists()


def _study_recipe(tmp_path: Path, drop_pairs_datasets: bool = False, **top) -> Path:
    raw = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    raw.update(report_to="none", **top)
    raw["eval"].update(limit=1, mitigations=[], trainers=["sft"])
    if drop_pairs_datasets:
        del raw["pairs"]["datasets"]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_recipe_without_pairs_datasets_is_refused_at_plan_time(tmp_path, capsys):
    recipe = _study_recipe(tmp_path, drop_pairs_datasets=True)
    assert cli_main(["study", str(recipe), "--out", str(tmp_path / "study")]) == 2
    one_line(capsys, f"{recipe}: pairs.datasets is not set")
    assert not (tmp_path / "study").exists()  # before the first stage


def test_bad_lora_target_modules_are_refused_at_plan_time(tmp_path, capsys):
    recipe = _study_recipe(tmp_path, lora_target_modules=["q_proj", "qkv_proj"])
    assert cli_main(["study", str(recipe), "--out", str(tmp_path / "study")]) == 2
    one_line(capsys, f"{recipe}: lora_target_modules: 'qkv_proj' names no module", "q_proj")
    assert not (tmp_path / "study").exists()


def test_an_installed_entry_point_named_like_a_builtin_backend_is_refused(tmp_path, monkeypatch):
    """A package installing a 'flipguard.backends' entry point named hf must not stand in for
    flipguard's own hf backend silently (its records would say backend "hf")."""
    info = tmp_path / "imposter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: imposter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[flipguard.backends]\nhf = imposter_backend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from flipguard import plugins

    with pytest.raises(FlipguardError, match=r"'flipguard.backends' entry point 'hf' is declared twice "
                                             r"\(flipguard.eval.backends.hf and imposter_backend\)|"
                                             r"\(imposter_backend and flipguard.eval.backends.hf\)"):
        plugins.plugins(plugins.BACKENDS)


@pytest.mark.parametrize("group, name, command", [
    ("flipguard.tasks", "dds", "eval"),
    ("flipguard.backends", "hf", "eval"),
    ("flipguard.tasks", "afr", "afr"),
])
def test_a_duplicate_entry_point_at_eval_time_is_one_line(tmp_path, group, name, command):
    """An installed package declaring one of flipguard's own entry points again: the real CLI in a
    process of its own (the duplicate found while the command's module registers its task) used to
    print a 19-line traceback; now one line naming both, exit 2, and no run folder."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    info = site / "imposter-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: imposter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = imposter_plugin\n")
    (site / "imposter_plugin.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT.parent)]), "TQDM_DISABLE": "1"}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", command, "--model", "flipguard:tiny",
                           "--limit", "1", "--out", str(out)], env=env, capture_output=True, text=True, timeout=1800)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"'{group}' entry point '{name}' is declared twice" in lines[0] and "imposter_plugin" in lines[0]
    assert not out.exists()
