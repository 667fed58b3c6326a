"""The folders are the layers, and imports point down them (LAYERS, lowest first):

    root utilities (errors, files, publish, config/, redact, plugins)
    <- data/ | runtime/ (datasets; which weights a model name means, adapters, GGUF, CPU threads)
    <- eval core (eval/: task, records, runner, backends/, bootstrap, estimate, ...)
    <- protocols (eval/dds, eval/afr, eval/sos, and eval/interop for runs other tools made: none imports another)
    <- embedded models (eval/embedded: the tiny model, the shipped organism and its alias)
    <- trainers (train/) | the pair builder (pairs/) | the organism's builder (organism/)
    <- the pipeline (pipeline/: study, compare, view, demo, cli; and `python -m flipguard`)

Every module is parsed with `ast` (nothing is imported or run), and every import counts:
module level, inside a function, and the "module:function" strings of lazy tables (the
command table). The built-in tasks, backends, embedded models and trainers are entry points
(pyproject.toml), looked up by name at run time; they are checked against the layers too.
There are no cycles, between modules or between packages, and imports sit at module level
except the heavy third-party ones below.
"""

from __future__ import annotations

import ast
import graphlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the `flipguard` package
# what setup.py leaves out of the wheel (tests, benchmarks, docs, examples) and build output
NOT_PACKAGE = ("tests", "bench", "docs", "examples", ".ci", ".git", "build", "dist", "runs", "wandb")
ROOT_UTILITIES = {"flipguard", "flipguard.errors", "flipguard.files", "flipguard.publish", "flipguard.redact",
                  "flipguard.plugins"}
ROOT_PACKAGES = ("flipguard.config",)  # a root utility split into modules: config/ (recipes, flags, values ...)
PROTOCOLS = ("flipguard.eval.dds", "flipguard.eval.afr", "flipguard.eval.sos", "flipguard.eval.interop")
EMBEDDED = "flipguard.eval.embedded"
PIPELINE = ("flipguard.pipeline", "flipguard.__main__")
CLI = "flipguard.pipeline.cli"
# (rank, group, the modules or packages in it), lowest first: a module may import a lower rank
# or its own group. Groups of one rank import neither each other.
LAYERS = (
    (0, "root", (*sorted(ROOT_UTILITIES), *ROOT_PACKAGES)),
    (1, "data", ("flipguard.data",)),
    (1, "runtime", ("flipguard.runtime",)),
    *((3, protocol, (protocol,)) for protocol in PROTOCOLS),
    (4, "embedded", (EMBEDDED,)),
    (5, "train", ("flipguard.train",)),
    (5, "pairs", ("flipguard.pairs",)),  # the pair builder: the trainers read its pair sets, never import it
    (5, "organism", ("flipguard.organism",)),  # builds and plants the organism; eval/embedded serves the shipped one
    (6, "pipeline", PIPELINE),
    (2, "eval core", ("flipguard.eval",)),  # last: what no protocol or embedded package above claimed
)
LAZY_TARGET = re.compile(r"^(flipguard(?:\.\w+)+)(?::\w+(?:\.\w+)*)?$")  # "flipguard.x.y", "...:function", "...:Class.method"

# Imports that stay inside functions, each with its reason: third-party packages that take
# seconds to import or are optional. Everything else, flipguard's own modules first, is
# imported at module level.
HEAVY = {
    **dict.fromkeys(("torch", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes", "tokenizers"),
                    "the model stack takes seconds to import; commands that only read run directories "
                    "(report, compare, view, data) never load it"),
    "vllm": "an optional extra ([vllm], GPU engines); imported only by --backend vllm",
    "openai": "the client of --backend openai (and the taxonomy judge) only",
    "wandb": "tracking only when a recipe asks for it; a slow import",
    "matplotlib": "plots only; the Agg backend must be chosen before pyplot loads (eval/plots.py)",
    "lm_eval": "an optional extra ([capability], [interop]); imported only by the study's capability stage and "
               "`flipguard import lm-eval` (its file-name helpers)",
    "inspect_ai": "an optional extra ([interop]); imported only by `flipguard import inspect` and "
                  "`flipguard export --format inspect` (its log reader, writer and types)",
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


def type_only(tree: ast.AST) -> set[int]:
    """The nodes under `if TYPE_CHECKING:`: imports for annotations, never run."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
            for stmt in node.body for inner in ast.walk(stmt)}


def imported(name: str, path: Path, at_run_time: bool = False) -> set[str]:
    """Every flipguard module `name` imports, at any depth of the file (`at_run_time`: less the
    imports under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    base = name if is_package(name) else name.rpartition(".")[0]
    skip = type_only(tree) if at_run_time else set()
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
# what importing a module runs: a cycle is a cycle of these. An annotation's import under
# `if TYPE_CHECKING:` (a runner's parameter typed as the Task that calls it) still may not point
# up a layer (GRAPH), but closes no cycle.
RUN_TIME_GRAPH = {name: imported(name, path, at_run_time=True) for name, path in MODULES.items()}


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_of(name: str) -> tuple[int, str]:
    """(rank, group): a module may import a lower rank, or its own group."""
    if name in ROOT_UTILITIES or under(name, *ROOT_PACKAGES):
        return 0, "root"
    for rank, group, prefixes in LAYERS[1:]:
        if under(name, *prefixes):
            return rank, group
    raise AssertionError(f"{name}: in no layer")


def violations(rule) -> list[str]:
    return [f"{name} -> {target}" for name, targets in GRAPH.items() for target in sorted(targets)
            if target != name and rule(name, target)]


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import inside a function or class body."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module_level = set()
    stack = list(tree.body)
    while stack:  # module level: the body and the blocks of its if/try statements
        node = stack.pop()
        module_level.add(id(node))
        if isinstance(node, (ast.If, ast.Try)):
            stack += node.body + node.orelse + getattr(node, "finalbody", []) + [
                s for h in getattr(node, "handlers", []) for s in h.body]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in module_level:
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            out.append((node.lineno, "flipguard" if getattr(node, "level", 0) else (module or "").split(".")[0]))
    return out


def entry_points_declared() -> dict[str, dict[str, str]]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["entry-points"]


def test_the_graph_sees_the_tree_and_its_lazy_imports():
    # a walk that found nothing would pass every rule below
    assert {"flipguard.files", "flipguard.config", "flipguard.config.parsers", "flipguard.eval.records", "flipguard.eval.mitigations",
            "flipguard.eval.dds.protocol", "flipguard.eval.dds.analyses.taxonomy", "flipguard.pairs.builder",
            "flipguard.data.registry", "flipguard.pipeline.study", "flipguard.eval.embedded.organism", "flipguard.organism.build",
            "flipguard.runtime.resolve", "flipguard.publish"} <= set(MODULES)
    assert not any(under(m, "flipguard.recipes") for m in MODULES)  # recipes/ holds recipes only
    assert "flipguard.files" in GRAPH["flipguard.data.registry"]
    # a "module:function" string of a lazy table counts (the command table)
    assert "flipguard.eval.dds.protocol" in GRAPH[CLI]
    # an import for annotations only counts against the layers, not as a cycle
    assert "flipguard.eval.task" in GRAPH["flipguard.eval.task_runner"]
    assert "flipguard.eval.task" not in RUN_TIME_GRAPH["flipguard.eval.task_runner"]


def test_every_package_folder_has_an_init():
    """A folder of modules without __init__.py is a namespace package: pkgutil walks past it
    and a reader cannot tell a package from a stray folder."""
    folders = {path.parent for path in MODULES.values()}
    assert len(folders) > 10  # the walk found the tree
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []


def test_every_module_sits_in_a_layer_and_the_pipeline_in_its_folder():
    assert {name: layer_of(name)[1] for name in MODULES if name.rpartition(".")[2] in
            ("study", "compare", "demo", "cli", "view", "organism_datasets", "build", "ground_truth", "tiny_model")} == {
        "flipguard.pipeline.study": "pipeline", "flipguard.pipeline.compare": "pipeline",
        "flipguard.pipeline.demo": "pipeline", "flipguard.pipeline.cli": "pipeline",
        "flipguard.pipeline.view": "pipeline", "flipguard.organism.build": "organism",
        "flipguard.organism.ground_truth": "organism",
        "flipguard.eval.embedded.tiny_model": "embedded", "flipguard.data.organism_datasets": "data",
        "flipguard.data.cli": "data"}


def test_imports_point_down_the_layers():
    """Nothing imports a layer above its own; protocols import no other protocol; the trainers, the
    pair builder and the organism's builder import none of each other."""
    def upward(name: str, target: str) -> bool:
        (rank, group), (t_rank, t_group) = layer_of(name), layer_of(target)
        return t_rank > rank or (t_rank == rank and t_group != group)

    assert violations(upward) == []


def test_there_is_no_import_cycle():
    graph = {name: {t for t in targets if t != name and t in MODULES} for name, targets in RUN_TIME_GRAPH.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(reversed(exc.args[1]))}")  # the list runs dependency-first


def test_there_is_no_package_cycle():
    """Package by package too (each group of LAYERS: a folder with its subfolders, such as
    pipeline/ with view/): eval/ -> train/ -> eval/ through different modules is a cycle of the
    folders even when no module imports itself back."""
    graph: dict[str, set[str]] = {}
    for name, targets in RUN_TIME_GRAPH.items():
        if targets:  # setup.py, the build's own file, imports nothing of flipguard and is in no layer
            group = layer_of(name)[1]
            graph.setdefault(group, set()).update({layer_of(t)[1] for t in targets if t in MODULES} - {group})
    assert {"pipeline", "train", "eval core", "runtime", "data", "root"} <= set(graph)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"package cycle: {' -> '.join(reversed(exc.args[1]))}")


def test_the_top_level_folders_stack():
    """pipeline/ over train/ and pairs/ over eval/ over runtime/, data/ and the root utilities: eval/
    imports neither train/, pairs/ nor pipeline/, train/ neither pipeline/ nor the pair builder, and runtime/ (what both sides share: model
    resolution, adapters, threads) none of the three."""
    above = {"flipguard.eval": ("flipguard.train", "flipguard.pairs", "flipguard.pipeline"),
             "flipguard.train": ("flipguard.pipeline", "flipguard.pairs"),  # a trainer reads a pair set, built elsewhere
             "flipguard.runtime": ("flipguard.eval", "flipguard.train", "flipguard.pipeline", "flipguard.data"),
             "flipguard.data": ("flipguard.eval", "flipguard.train", "flipguard.pipeline", "flipguard.runtime")}
    assert violations(lambda n, t: any(under(n, low) and under(t, *high) for low, high in above.items())) == []
    assert {layer_of(m)[1] for m in ("flipguard.runtime.resolve", "flipguard.runtime.threads",
                                     "flipguard.runtime.adapters", "flipguard.runtime.convert")} == {"runtime"}
    assert layer_of("flipguard.publish") == (0, "root")


def test_imports_sit_at_module_level_except_the_heavy_ones():
    inside = {f"{path.relative_to(ROOT)}:{line} imports {package}"
              for path in MODULES.values() for line, package in function_level_imports(path) if package not in HEAVY}
    assert sorted(inside) == []


def test_every_heavy_exception_is_still_used():
    used = {package for path in MODULES.values() for _, package in function_level_imports(path)}
    assert sorted(set(HEAVY) - used) == []


def test_every_builtin_entry_point_names_a_module_of_its_layer():
    expected = {"flipguard.tasks": lambda m: layer_of(m)[1] in PROTOCOLS,
                "flipguard.backends": lambda m: under(m, "flipguard.eval.backends"),
                "flipguard.models": lambda m: under(m, EMBEDDED),
                "flipguard.trainers": lambda m: under(m, "flipguard.train")}
    declared = entry_points_declared()
    assert set(expected) <= set(declared)
    for group, check in expected.items():
        for name, value in declared[group].items():
            module = value.split(":")[0]
            assert module in MODULES and check(module), f"{group} {name} = {value}"
    assert set(declared["flipguard.tasks"]) == {"dds", "afr", "sos", "inspect", "lm-eval"}
    assert set(declared["flipguard.backends"]) == {"hf", "vllm", "openai"}
    assert set(declared["flipguard.trainers"]) == {"sft", "dpo", "kto"}


def test_the_installed_entry_points_are_the_declared_ones():
    """An install older than pyproject.toml's entry points looks up stale names: reinstall."""
    from importlib.metadata import entry_points

    for group, declared in entry_points_declared().items():
        installed = {ep.name: ep.value for ep in entry_points(group=group) if ep.value.startswith("flipguard.")}
        assert installed == declared, f"{group}: reinstall flipguard (pip install -e .)"


def test_no_module_imports_the_cli():
    assert violations(lambda n, t: n not in (CLI, "flipguard.__main__") and t == CLI) == []


def test_every_command_points_at_a_module_that_exists():
    commands = ast.literal_eval(next(
        node.value for node in ast.parse(MODULES[CLI].read_text(encoding="utf-8")).body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "COMMANDS"))
    missing = {name: target for name, (target, _) in commands.items() if target.split(":")[0] not in MODULES}
    assert missing == {}
    # a protocol's command is its task's one command method (Task.main, eval/task.py), not a function of its own
    assert {name: commands[name][0] for name in ("eval", "afr", "sos")} == {
        "eval": "flipguard.eval.dds.protocol:DDSTask.main", "afr": "flipguard.eval.afr.protocol:AFRTask.main",
        "sos": "flipguard.eval.sos.protocol:SosTask.main"}


def test_commands_that_read_run_directories_load_no_model_stack():
    """HEAVY's reason, checked: report, compare, view and data import none of it (one fresh process)."""
    readers = ["flipguard.eval.dds.report", "flipguard.eval.afr.report", "flipguard.eval.sos.report",
               "flipguard.pipeline.compare", "flipguard.pipeline.view", "flipguard.data.cli"]
    code = ("import importlib, sys\n"
            f"for m in {readers!r}: importlib.import_module(m)\n"
            f"print(sorted(p for p in {sorted(HEAVY)!r} if p in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
