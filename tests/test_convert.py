"""GGUF input: which path denotes a GGUF model, and the refusals (no model needed).
The conversion itself runs on real weights in tests/test_real_smollm2.py (`bash .ci/real`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flipguard.errors import UserError
from flipguard.runtime.convert import gguf_file
from flipguard.runtime.resolve import resolve_model


def test_gguf_file_names_a_file_or_a_folder_holding_one(tmp_path):
    f = tmp_path / "one" / "Model.Q4_1.GGUF"
    f.parent.mkdir()
    f.write_bytes(b"GGUF")
    assert gguf_file(f) == f
    assert gguf_file(f.parent) == f
    # a checkpoint folder (config.json) is a checkpoint even with a GGUF beside it
    (f.parent / "config.json").write_text("{}")
    assert gguf_file(f.parent) is None
    assert gguf_file(tmp_path / "missing.gguf") is None
    # a plain hub id or alias is never taken for a GGUF
    assert resolve_model("org/model") == "org/model"


def test_a_folder_with_two_gguf_files_is_refused_naming_both(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(UserError, match=r"2 GGUF files \(a\.gguf, b\.gguf\); name the one"):
        resolve_model(str(tmp_path))


def test_convert_refuses_a_file_that_is_not_gguf_in_one_line(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"not a gguf file at all")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", "convert", str(bad), "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "cannot read this GGUF file" in lines[0], proc.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["weights.gguf"]
