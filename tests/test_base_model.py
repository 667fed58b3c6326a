"""A base model (no chat template): raw-text templates (ft-released) run on it; chat
templates are refused in one line that names --template ft-released, before anything is
written. The served path (/v1/completions) is covered in test_backends (raw prompts)."""

from __future__ import annotations

import json
import shutil

import pytest

from flipguard.pipeline.cli import main as cli_main


@pytest.fixture(scope="module")
def base_model(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model with its chat template removed, as a base checkpoint ships."""
    folder = tmp_path_factory.mktemp("base") / "tiny-base"
    shutil.copytree(tiny_model_path, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder).chat_template is None
    return str(folder)


@pytest.mark.parametrize("mode", ["logprob", "generate"])
def test_ft_released_runs_on_a_base_model(base_model, tmp_path, mode):
    out = tmp_path / mode
    assert cli_main(["eval", "--model", base_model, "--template", "ft-released", "--mode", mode,
                     "--datasets", "truthfulqa", "--limit", "2", "--min_label_mass", "0", "--max_new_tokens", "4",
                     "--out", str(out), "--threads", "1"]) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(r["messages"][0]["role"] == "raw" for r in records)
    if mode == "logprob":
        assert all(r["valid"] and r["p1"] > 0 and r["p2"] > 0 for r in records)
    else:
        assert all(r["raw_output"] is not None for r in records)


def test_a_chat_template_on_a_base_model_is_refused_naming_ft_released(base_model, tmp_path, capsys):
    out = tmp_path / "chat"
    assert cli_main(["eval", "--model", base_model, "--datasets", "truthfulqa", "--limit", "2",
                     "--out", str(out), "--threads", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not transformers' load bar
    assert len(err) == 1 and err[0].startswith("flipguard eval: error: ") and base_model in err[0], err
    assert "has no chat template" in err[0] and "--template ft-released" in err[0], err
    assert not (out / "run.json").exists() and not (out / "records.jsonl").exists()
