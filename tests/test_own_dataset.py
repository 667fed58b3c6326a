"""The own-dataset instructions of docs/datasets.md, followed literally: its entry file
and its row example, then its two commands, typed as written, in real processes. A second folder
registering a taken name is refused, and `--replace` takes it over."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_section() -> str:
    text = (ROOT / "docs" / "datasets.md").read_text(encoding="utf-8")
    start = text.index("- **Your own dataset**")
    return text[start:text.index("- **Your own multiple-choice dataset**", start)]


def _run(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "FLIPGUARD_HOME": str(home), "TQDM_DISABLE": "1",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flipguard.pipeline.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def test_the_readme_own_dataset_example_runs_as_written(tmp_path, tiny_model_path):
    section = _readme_section()
    entry = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    example = json.loads(re.search(r"e\.g\. `(\{.*?\})`", section.replace("\n  ", " "), re.S).group(1))
    commands = [shlex.split(line.strip()) for line in re.search(r"```bash\n(.*?)```", section, re.S).group(1)
                .strip().splitlines()]
    assert set(example) == {"id", "question", "correct_answer", "incorrect_answer"}

    folder = tmp_path / "my_claims"
    folder.mkdir()
    (folder / "dataset.yaml").write_text("\n".join(line[2:] if line.startswith("  ") else line
                                                   for line in entry.splitlines()) + "\n")
    for split, n in (("test", 6), ("train", 4)):  # rows exactly of the documented shape
        with (folder / f"{split}.jsonl").open("w") as fh:
            for i in range(n):
                fh.write(json.dumps({**example, "id": f"{split}-{i}", "question": f"{example['question']} ({i})"}) + "\n")
    home = tmp_path / "home"
    home.mkdir()
    from flipguard.eval.embedded.tiny_model import TINY_MODEL_VERSION

    (home / f"tiny-chat-{TINY_MODEL_VERSION}").symlink_to(Path(tiny_model_path))  # the session's, not rebuilt
    for argv in commands:
        assert argv[0] == "flipguard"
        done = _run(argv[1:], tmp_path, home)
        assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "runs" / "my_claims" / "records.jsonl").read_text().splitlines()]
    assert {r["dataset"] for r in records} == {"my_claims"} and len({r["item_id"] for r in records}) == 5

    # another folder under the same name: refused, the first registration kept; --replace takes it over
    other = tmp_path / "elsewhere" / "my_claims"
    other.mkdir(parents=True)
    for name in ("dataset.yaml", "test.jsonl", "train.jsonl"):
        (other / name).write_bytes((folder / name).read_bytes())
    registered = (home / "datasets" / "my_claims.yaml").read_text()
    refused = _run(["data", "--register", str(other / "dataset.yaml")], tmp_path, home)
    assert refused.returncode == 2 and "is already registered from" in refused.stderr
    assert "--replace" in refused.stderr and (home / "datasets" / "my_claims.yaml").read_text() == registered
    assert _run(["data", "--register", str(other / "dataset.yaml"), "--replace", "true"], tmp_path, home).returncode == 0
    assert str(other / "test.jsonl") in (home / "datasets" / "my_claims.yaml").read_text()
