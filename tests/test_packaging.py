"""The wheel holds the whole package: a package list that misses a folder (pipeline/,
eval/embedded/) gives `pip install .` a `flipguard` command that cannot import its own module. The expected contents come from the source tree itself (every
folder holding .py files, the data folders), not from setup.py's discovery. `.ci/run` then
installs the wheel, without -e, in a fresh virtual environment and runs it."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import flipguard
from flipguard.data.registry import SHIPPED_ENTRIES

ROOT = Path(__file__).resolve().parent.parent
# what the source tree holds but the wheel must not (tests, benchmarks, docs, examples) and build
# output; anything else under the root is the package
NOT_PACKAGED = {"tests", "bench", "docs", "examples", "build", "dist", "runs", "wandb"}
# folders of data files (no .py) that the commands read from the installed package
DATA_FOLDERS = ["recipes", "data/organism", "data/organism_mc", "data/samples", "eval/embedded/organism_model"]


def _source_files() -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__" and not d.endswith(".egg-info")
                       and not (rel == Path(".") and d in NOT_PACKAGED)]
        files += [rel / f for f in filenames if not f.startswith(".") and not f.endswith(".pyc")]
    return files


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """`python -m build` (sdist, then the wheel from the sdist, as an index user gets it) of a copy
    of this checkout, so the build leaves nothing in it. No isolation: offline, with the dev extra's
    setuptools and build."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "runs",
                                                               "wandb", ".pytest_cache", ".ruff_cache"))
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("flipguard-*.whl")
    (sdist,) = (tmp / "dist").glob("flipguard-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_every_module_of_the_source_tree_is_in_the_wheel(built):
    names = _wheel_names(built["wheel"])
    modules = [f for f in _source_files() if f.suffix == ".py"]
    folders = {f.parent for f in modules}
    # folders a hand-written package list is known to miss, so a broken walk above cannot pass this test vacuously
    assert {Path("pipeline"), Path("eval/embedded"), Path("pipeline/view"), Path("train")} <= folders
    missing = sorted(str(f) for f in modules if f"flipguard/{f.as_posix()}" not in names)
    assert not missing, f"modules not in the wheel: {missing}"
    assert not [n for n in names if n.startswith(tuple(f"flipguard/{d}/" for d in NOT_PACKAGED))]


def test_the_data_the_commands_read_is_in_the_wheel(built):
    names = _wheel_names(built["wheel"])
    # and every shipped dataset's folder (a dataset added without its glob works in the checkout only)
    folders = DATA_FOLDERS + [entry.parent.relative_to(ROOT).as_posix() for entry in SHIPPED_ENTRIES]
    data = [f for f in _source_files() if f.suffix != ".py" and any(f.as_posix().startswith(d + "/") for d in folders)]
    assert any(f.as_posix().startswith("recipes/accelerate_configs/") for f in data)
    assert any(f.as_posix() == "data/organism_mc/arguments.jsonl" for f in data)
    missing = sorted(str(f) for f in data if f"flipguard/{f.as_posix()}" not in names)
    assert not missing, f"data files not in the wheel: {missing}"


def test_console_script_and_entry_points_name_modules_in_the_wheel(built):
    names = _wheel_names(built["wheel"])
    with zipfile.ZipFile(built["wheel"]) as zf:
        (ep_file,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        entry_points, metadata = zf.read(ep_file).decode(), zf.read(meta).decode()
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read_string(entry_points)
    assert parser["console_scripts"]["flipguard"].strip() == "flipguard.pipeline.cli:main"
    targets = [value.strip().split(":")[0] for section in parser.sections() for value in parser[section].values()]
    assert len(targets) >= 8  # the console script, 3 tasks, 3 backends, the embedded models
    for module in targets:
        path = module.replace(".", "/")
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, f"{module} (an entry point) is not in the wheel"
    # one version string: flipguard.__version__ is the wheel's version
    assert f"\nVersion: {flipguard.__version__}\n" in metadata


def test_the_sdist_carries_what_the_wheel_is_built_from(built):
    with tarfile.open(built["sdist"]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "README.md", "pipeline/cli.py", "recipes/organism.yaml"} <= names


def _unpacked_wheel(built, tmp_path: Path, tiny_model_path) -> tuple[Path, Path, Path]:
    """(the wheel's files unpacked, an empty folder outside the clone, a FLIPGUARD_HOME with the session's tiny model)."""
    from flipguard.eval.embedded.tiny_model import TINY_MODEL_VERSION

    site, work, home = tmp_path / "site", tmp_path / "elsewhere", tmp_path / "home"
    for folder in (work, home):
        folder.mkdir()
    with zipfile.ZipFile(built["wheel"]) as zf:
        zf.extractall(site)
    (home / f"tiny-chat-{TINY_MODEL_VERSION}").symlink_to(Path(tiny_model_path))
    return site, work, home


def test_the_installed_package_runs_recipes_by_name_from_any_folder(built, tmp_path, tiny_model_path):
    """The wheel's files (no clone, no editable install) on the path of a process started in an
    empty folder: the shipped recipes are listed and shown, a run config is named, a protocol runs
    from it, and a mistyped flag is one line."""
    site, work, home = _unpacked_wheel(built, tmp_path, tiny_model_path)
    env = {**os.environ, "PYTHONPATH": str(site), "FLIPGUARD_HOME": str(home), "TQDM_DISABLE": "1"}

    def flipguard(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flipguard", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=1800)

    where = subprocess.run([sys.executable, "-c", "import flipguard; print(flipguard.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=300)
    assert Path(where.stdout.strip()).parent == site / "flipguard", where.stdout + where.stderr
    listed = flipguard("recipes")
    assert listed.returncode == 0 and "afr_tiny" in listed.stdout and str(site / "flipguard" / "recipes") in listed.stdout
    shown = flipguard("recipes", "show", "sos_tiny")
    assert shown.stdout == (site / "flipguard" / "recipes" / "sos_tiny.yaml").read_text()
    run = flipguard("sos", "sos_tiny", "--limit", "1", "--n_shots", "1", "--max_new_tokens", "2", "--n_boot", "10",
                    "--out", "runs/sos")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (work / "runs" / "sos" / "report" / "summary.md").is_file()
    typo = flipguard("sos", "recipes/sos_tiny.yaml", "--lmit", "2")
    assert typo.returncode == 2 and typo.stderr.strip().splitlines() == [
        "flipguard sos: error: unknown option --lmit; did you mean --limit? (flipguard sos --help lists the options)"]


# the marker before a ```bash block of the docs that an installed wheel runs verbatim, from a folder outside the clone
WHEEL_RUNNABLE = "<!-- test: runs from an installed wheel -->"
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_docs_name_no_script_a_wheel_lacks():
    """A wheel has no train/*.py to run and no source tree to install with -e: every command the README, the docs
    pages, the recipes' comments and the trainers' docstrings give is one an installed package runs
    (`flipguard sft RECIPE`, `python -m flipguard.train.dpo`, `accelerate launch -m flipguard.train.sft`)."""
    import re

    sources = [*DOC_PAGES, *sorted((ROOT / "recipes").rglob("*.yaml")), *sorted((ROOT / "train").glob("*.py"))]
    bad = []
    for path in sources:
        if path.name == "cli.md":  # generated from the parsers' help
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"(python\s+|launch\b[^`\n]*\s|^[#\s]*)(\./)?train/\w+\.py\b", line) or \
                    re.search(r"pip install -e \"?\.\[interop\]", line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_documented_commands_run_from_an_installed_wheel(built, tmp_path, tiny_model_path):
    """The docs' blocks marked WHEEL_RUNNABLE, each line as written, in a shell in an empty folder outside the
    clone, with the wheel's files (not the checkout) as the flipguard every command imports: the trainers as
    subcommands, as `python -m` modules and under `accelerate launch -m`, the shipped accelerate config copied out,
    the merge."""
    import re


    blocks = [(page, block) for page in DOC_PAGES for block in
              re.findall(re.escape(WHEEL_RUNNABLE) + r"\n```bash\n(.*?)\n```", page.read_text(encoding="utf-8"), re.S)]
    lines = [(page, line.split("  #")[0].strip()) for page, block in blocks for line in block.splitlines() if line.strip()]
    assert any("python -m flipguard.train." in line for _, line in lines)
    assert any(line.startswith("accelerate launch") and " -m flipguard.train." in line for _, line in lines)
    site, work, home = _unpacked_wheel(built, tmp_path, tiny_model_path)
    env = {**os.environ, "PYTHONPATH": str(site), "FLIPGUARD_HOME": str(home), "TQDM_DISABLE": "1",
           "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    where = subprocess.run([sys.executable, "-c", "import flipguard; print(flipguard.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=300)
    assert Path(where.stdout.strip()).parent == site / "flipguard", where.stdout + where.stderr
    for page, line in lines:
        done = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"{page.relative_to(ROOT)}: {line}\n{done.stderr[-3000:]}"
    for trained in ("sft", "dpo", "kto"):
        assert (work / "runs" / "tiny" / trained / "adapter_model.safetensors").is_file(), trained
    for merged in ("dpo-merged", "sft-merged"):
        assert (work / "runs" / "tiny" / merged / "config.json").is_file(), merged
    # every module that ran came from the wheel: the provenance names the installed package's files
    meta = (work / "runs" / "tiny" / "base-train" / "run.json").read_text()
    assert str(ROOT) not in meta.replace(str(site), "")
