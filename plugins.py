"""Plug-ins by entry point: tasks, backends, embedded models and trainers found by name.

flipguard's own protocols, backends, embedded models and trainers are declared in pyproject.toml
([project.entry-points."flipguard.tasks"], "flipguard.backends", "flipguard.models",
"flipguard.trainers") exactly as
a user's package declares its own, as lm-evaluation-harness and pytest find theirs. The core
that looks a name up therefore imports none of them: no import cycle runs through a registry
(tests/test_layout.py). A task or backend module registers its class when imported; a model
entry is a function that builds the model (once, cached) and returns its local path; a trainer
entry is its declaration (config/trainers.py).
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from flipguard.errors import UserError

try:
    import tomllib
except ImportError:  # Python 3.10: no TOML reader in the standard library (install flipguard there)
    tomllib = None

TASKS = "flipguard.tasks"
BACKENDS = "flipguard.backends"
MODELS = "flipguard.models"
TRAINERS = "flipguard.trainers"

_loaded: set[str] = set()


def plugins(group: str) -> dict[str, EntryPoint]:
    """name -> entry point of one group, flipguard's own and every installed package's."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:  # one would silently stand in for the other
            raise UserError(f"'{group}' entry point {ep.name!r} is declared twice ({other.value} and {ep.value}): "
                            "rename the plug-in's entry point in its package's pyproject.toml")
        found[ep.name] = ep
    if not any(is_builtin(ep) for ep in found.values()):
        found = {**source_tree_entry_points(group), **found}
    if not any(is_builtin(ep) for ep in found.values()):
        raise UserError(f"flipguard's own '{group}' entry points are not installed (an install older than them?): "
                        "reinstall flipguard in this environment (`pip install -e .` in its checkout)")
    return found


def source_tree_entry_points(group: str) -> dict[str, EntryPoint]:
    """flipguard's own entry points read from pyproject.toml beside this file, when flipguard runs
    from a checkout that was never installed (its folder on PYTHONPATH under the name flipguard,
    as on a machine without network: bench/gpu/run.sh). An install's metadata, when present, wins."""
    pyproject = Path(__file__).resolve().parent / "pyproject.toml"
    if tomllib is None or not pyproject.is_file():
        return {}
    declared = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("entry-points", {})
    return {name: EntryPoint(name, value, group) for name, value in declared.get(group, {}).items()}


def is_builtin(ep: EntryPoint) -> bool:
    return ep.value.startswith("flipguard.")


def load(ep: EntryPoint):
    """The entry point's object (a module or a function), a plug-in's failure named as one error."""
    try:
        return ep.load()
    except Exception as exc:
        if is_builtin(ep):
            raise
        raise UserError(f"entry point {ep.name!r} of '{ep.group}' ({ep.value}) failed to load: "
                        f"{type(exc).__name__}: {exc}") from None


def load_plugins(group: str) -> None:
    """Import every module of a group once: its classes register themselves on import."""
    if group in _loaded:
        return
    for ep in plugins(group).values():
        load(ep)
    _loaded.add(group)
