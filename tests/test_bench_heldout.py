"""bench/organism_heldout.py's list of builds: a new build the builder refused (its checks failed, exit 2) is
reported as refused and replaced by the first unused reserve; nothing else replaces a build."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the builder's own last lines when its held-out checks fail (organism/build.py), as /usr/bin/time -v wraps them
REFUSED_LOG = ("building the planted-bias organism (seed 54, cpu)\n"
               "flipguard organism: error: organism build failed its held-out checks (sos_holds_unplanted_kinds "
               "failed): no phase 2 checkpoint of 48 over 3 attempts (data orders) passed every check\n"
               "Command exited with non-zero status 2\n\tExit status: 2\n")


def _bench():
    spec = importlib.util.spec_from_file_location("organism_heldout", ROOT / "bench" / "organism_heldout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built(where: Path, name: str) -> None:
    (where / name).mkdir(parents=True)
    (where / name / "organism.json").write_text("{}")


def test_a_refused_new_build_is_replaced_by_the_first_unused_reserve(tmp_path):
    bench = _bench()
    for name in ("a", "c", "r1"):
        _built(tmp_path, name)
    (tmp_path / "b.log").write_text(REFUSED_LOG)  # refused: no folder, its log says so
    (tmp_path / "d.log").write_text("building the planted-bias organism (seed 4, cpu)\n  step 1/1000\n")  # still building
    listed = {"new": [{"name": n} for n in ("a", "b", "c", "d")], "reserve": [{"name": "r1"}, {"name": "r2"}],
              "heldout": [{"name": "h"}], "design": [{"name": "flipguard:organism"}]}
    groups, refused = bench.listed_builds(listed, tmp_path)
    assert groups["new"] == [str(tmp_path / n) for n in ("a", "r1", "c", "d")]
    assert groups["heldout"] == [str(tmp_path / "h")] and groups["design"] == ["flipguard:organism"]
    assert [(r["name"], r["replaced_by"]) for r in refused] == [("b", "r1")]
    assert refused[0]["refused"].startswith("organism build failed its held-out checks (sos_holds_unplanted_kinds")
    # a build still building, or one not on this machine, is not refused: nothing replaces it
    assert bench.refusal(tmp_path / "d") is None and bench.refusal(tmp_path / "h") is None
