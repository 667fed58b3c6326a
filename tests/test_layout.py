"""Dependencies point one way: root utilities <- data <- eval core <- protocols <- pairs/
train/study/compare/demo/cli (issue 11). Every module is parsed with `ast` (nothing is
imported or run), and every import counts: top-level, inside a function, and the
"module:function" strings of the lazy tables (the command table, the embedded models).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the `flipguard` package
NOT_PACKAGE = ("tests", "bench", ".ci", ".git", "build", "dist", "runs", "wandb")
ROOT_UTILITIES = {"flipguard", "flipguard.errors", "flipguard.files", "flipguard.config", "flipguard.redact"}
PROTOCOLS = ("flipguard.eval.dds", "flipguard.eval.afr", "flipguard.eval.sos")
ABOVE_PROTOCOLS = ("flipguard.train", "flipguard.eval.study", "flipguard.eval.compare", "flipguard.eval.demo",
                   "flipguard.eval.cli", "flipguard.eval.organism", "flipguard.eval.view")
CLI = "flipguard.eval.cli"
LAZY_TARGET = re.compile(r"^(flipguard(?:\.\w+)+)(?::\w+)?$")  # "flipguard.x.y" or "flipguard.x.y:function"

# Edges that stay, each with its reason. Keep this list short: a new entry needs one.
ALLOWED = {
    # The embedded tokenizer (core: every protocol runs on flipguard:tiny) is trained on
    # the DDS prompt text, pinned by EMBEDDED_TEMPLATES; moving that text into the core
    # would put DDS back in it, and changing the corpus would change the cached models.
    ("flipguard.eval.tiny_model", "flipguard.eval.dds.prompts"),
    # resolve_model's alias table names the organism's builder ("flipguard:organism"),
    # which sits above the protocols (it trains on all three protocols' prompts); it is
    # imported only when that alias is asked for.
    ("flipguard.eval.tiny_model", "flipguard.eval.organism"),
    # The runner's table of built-in tasks (eval/task.py BUILTIN_TASKS) names the module of
    # each protocol; one is imported, to register its task, only when a task is looked up.
    ("flipguard.eval.task", "flipguard.eval.dds.protocol"),
    ("flipguard.eval.task", "flipguard.eval.afr.protocol"),
    ("flipguard.eval.task", "flipguard.eval.sos.protocol"),
    # `python -m flipguard` is the console command itself (what `accelerate launch -m flipguard`
    # runs on every data-parallel rank); nothing imports __main__.
    ("flipguard.__main__", "flipguard.eval.cli"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["flipguard", *parts])


def package_modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if rel[0] in NOT_PACKAGE or any(p.startswith(".") or p == "__pycache__" for p in rel):
            continue
        out[module_name(path)] = path
    return out


MODULES = package_modules()


def is_package(name: str) -> bool:
    return name in MODULES and MODULES[name].name == "__init__.py"


def imported(name: str, path: Path) -> set[str]:
    """Every flipguard module `name` imports, at any depth of the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    base = name if is_package(name) else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                module = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.add(sub if sub in MODULES else module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = LAZY_TARGET.match(node.value)
            if m and m.group(1) in MODULES:  # a table naming a module to import later
                out.add(m.group(1))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value)
    return {m for m in out if m == "flipguard" or m.startswith("flipguard.")}


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def protocol_of(name: str) -> str | None:
    return next((p for p in PROTOCOLS if under(name, p)), None)


def is_core(name: str) -> bool:
    return under(name, "flipguard.eval") and protocol_of(name) is None and not under(name, *ABOVE_PROTOCOLS)


def violations(rule) -> list[str]:
    bad = []
    for name, targets in GRAPH.items():
        for target in sorted(targets):
            if target != name and (name, target) not in ALLOWED and rule(name, target):
                bad.append(f"{name} -> {target}")
    return bad


def test_the_graph_sees_the_tree_and_its_lazy_imports():
    # a walk that found nothing would pass every rule below
    assert {"flipguard.files", "flipguard.config", "flipguard.eval.records", "flipguard.eval.mitigations",
            "flipguard.eval.dds.protocol", "flipguard.eval.dds.analyses.taxonomy", "flipguard.train.pairs",
            "flipguard.data.registry"} <= set(MODULES)
    assert not any(under(m, "flipguard.recipes") for m in MODULES)  # recipes/ holds recipes only
    # a function-level import is counted (data/registry.py writes with the atomic writer)
    assert "flipguard.files" in GRAPH["flipguard.data.registry"]
    # so is a "module:function" string of a lazy table
    assert "flipguard.eval.dds.protocol" in GRAPH["flipguard.eval.cli"]
    assert "flipguard.eval.organism" in GRAPH["flipguard.eval.tiny_model"]
    assert "flipguard.eval.afr.protocol" in GRAPH["flipguard.eval.task"]


def test_data_imports_nothing_from_eval_or_train():
    assert violations(lambda n, t: under(n, "flipguard.data") and under(t, "flipguard.eval", "flipguard.train")) == []


def test_root_utilities_import_no_layer():
    assert violations(lambda n, t: n in ROOT_UTILITIES
                      and under(t, "flipguard.data", "flipguard.eval", "flipguard.train")) == []


def test_eval_core_imports_no_protocol_and_nothing_above():
    assert violations(lambda n, t: is_core(n) and (protocol_of(t) or under(t, *ABOVE_PROTOCOLS))) == []


def test_a_protocol_imports_no_other_protocol_and_nothing_above():
    assert violations(lambda n, t: protocol_of(n) and (
        (protocol_of(t) and protocol_of(t) != protocol_of(n)) or under(t, *ABOVE_PROTOCOLS))) == []


def test_no_module_imports_the_cli():
    assert violations(lambda n, t: n != CLI and t == CLI) == []


def test_every_allowed_exception_is_still_needed():
    assert sorted(e for e in ALLOWED if e[1] not in GRAPH[e[0]]) == []


def test_every_command_points_at_a_module_that_exists():
    commands = ast.literal_eval(next(
        node.value for node in ast.parse(MODULES[CLI].read_text(encoding="utf-8")).body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "COMMANDS"))
    missing = {name: target for name, (target, _) in commands.items() if target.split(":")[0] not in MODULES}
    assert missing == {}
