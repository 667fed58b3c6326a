"""The documentation says what the code does: the README stays a short door with
the set-up commands CI runs, every link and cited file exists, docs/cli.md is what the parsers
print today, and the commands the pages mark as runnable run."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
COMMAND_1 = "pip install torch==2.13.0 -e . && flipguard demo"
COMMAND_2 = 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest'
# put on the line before a ```bash block whose every command runs in seconds on the embedded tiny model
RUNNABLE = "<!-- test: runs on flipguard:tiny -->"


def test_readme_is_a_short_door_with_the_two_set_up_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode("utf-8")) <= 15_000
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert blocks[:2] == [COMMAND_1, COMMAND_2]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert COMMAND_1 in ci and COMMAND_2 in ci  # CI runs what the README says, verbatim
    # the three papers, each with its arXiv id
    for paper, arxiv in (("DialDefer:", "2601.10896"), ("Who Flips?", "2606.16011"), ("Stop Listening to Me!", "2603.11394")):
        (line,) = [line for line in readme.splitlines() if re.match(r"\d\. ", line) and f"*{paper}" in line]
        assert f"[arXiv:{arxiv}](https://arxiv.org/" in line, line


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_cited_files_exist(page):
    text = page.read_text(encoding="utf-8")
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    # files cited in prose: bench results and scripts, docs pages, tests, recipes
    for cited in re.findall(r"`((?:bench|docs|tests|recipes)/[\w./-]+\.(?:md|json|py|yaml))`", text):
        if not (ROOT / cited).exists():
            bad.append(cited)
    assert not bad, f"{page.relative_to(ROOT)}: links or files that do not exist: {bad}"


def test_cli_reference_is_what_the_parsers_print():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    expected = gen_cli.render()
    current = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert current == expected, "docs/cli.md is stale: run python docs/gen_cli.py"
    assert "## flipguard eval" in current and "--min_label_mass" in current


def _runnable_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in re.findall(re.escape(RUNNABLE) + r"\n```bash\n(.*?)\n```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line:
                    found.append((f"{page.relative_to(ROOT)}: {line}", shlex.split(line)))
    return found


def test_the_commands_marked_runnable_run(tmp_path, monkeypatch, tiny_model_path):
    """In one process (the imports are paid once), from a scratch folder with the recipes beside it,
    the session's tiny model in a fresh FLIPGUARD_HOME: each exits 0."""
    from flipguard.eval.embedded.tiny_model import TINY_MODEL_VERSION
    from flipguard.pipeline import cli

    commands = _runnable_commands()
    assert len(commands) >= 3, commands
    home = tmp_path / "home"
    home.mkdir()
    (home / f"tiny-chat-{TINY_MODEL_VERSION}").symlink_to(Path(tiny_model_path))
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    monkeypatch.setenv("FLIPGUARD_HOME", str(home))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.chdir(tmp_path)
    for where, argv in commands:
        assert argv[0] == "flipguard", where
        try:
            code = cli.main(argv[1:])
        except SystemExit as exc:  # --help
            code = exc.code or 0
        assert code == 0, where
