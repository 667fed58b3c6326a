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


# (group, name) -> the one line a plug-in that failed to load gets: only what uses that name is refused with it
_broken: dict[tuple[str, str], str] = {}


def package_of(ep: EntryPoint) -> str | None:
    """The installed distribution that declares the entry point (what `pip uninstall` takes), if known."""
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", None) if dist is not None else None


def load(ep: EntryPoint):
    """The entry point's object (a module or a function), a plug-in's failure named as one error that
    names its package."""
    try:
        return ep.load()
    except Exception as exc:
        if is_builtin(ep):
            raise
        package = package_of(ep)
        fix = (f"fix or update the package {package}, or remove it (pip uninstall {package})" if package else
               "fix or remove the package that declares it")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"the plug-in {ep.name!r} ('{ep.group}' entry point {ep.value}"
                        f"{f', package {package}' if package else ''}) failed to load ({type(exc).__name__}"
                        f"{': ' + first if first else ''}): {fix}") from None


def load_plugins(group: str) -> None:
    """Import every module of a group once: its classes register themselves on import. A plug-in that
    fails to load is recorded (broken), not raised: it blocks only what names it."""
    if group in _loaded:
        return
    for ep in plugins(group).values():
        try:
            load(ep)
        except UserError as exc:  # load raises a UserError for another package's plug-in only
            _broken[(group, ep.name)] = str(exc)
    _loaded.add(group)


def broken(group: str, name: str) -> str | None:
    """Why the plug-in `name` of `group` could not be loaded (the one line load gave), or None."""
    return _broken.get((group, name))


def mark_broken(group: str, name: str, why: str) -> None:
    _broken[(group, name)] = why


def broken_names(group: str) -> list[str]:
    return sorted(n for g, n in _broken if g == group)
