"""Tasks by name: `@register_task`, and the lookup `flipguard run NAME`, the study and compare make.
The built-in protocols are `flipguard.tasks` entry points, found the way a user's package is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flipguard import plugins
from flipguard.config import did_you_mean
from flipguard.errors import UserError

if TYPE_CHECKING:  # annotations only: eval/task.py imports this module
    from flipguard.eval.task import Task


_TASKS: dict[str, type[Task]] = {}


ENTRY_POINT_GROUP = plugins.TASKS  # the built-in protocols are entry points too (pyproject.toml)


def register_task(name: str):
    """Class decorator: make a Task runnable by name (`flipguard run NAME`, the study)."""

    def deco(cls: type[Task]) -> type[Task]:
        builtin = plugins.plugins(plugins.TASKS).get(name)
        if builtin is not None and plugins.is_builtin(builtin) and cls.__module__ != builtin.value:
            raise UserError(f"task {name!r} is already registered (built in); choose another name")
        if name in _TASKS and _TASKS[name] is not cls:
            raise UserError(f"task {name!r} is already registered (by {_TASKS[name].__module__}); choose another name")
        cls.name = name
        _TASKS[name] = cls
        return cls

    return deco


def task_names() -> list[str]:
    plugins.load_plugins(plugins.TASKS)
    return sorted(_TASKS)


def get_task(name: str) -> type[Task]:
    plugins.load_plugins(plugins.TASKS)
    if name not in _TASKS and plugins.broken(plugins.TASKS, name):
        raise UserError(plugins.broken(plugins.TASKS, name))
    if name not in _TASKS:
        raise UserError(f"unknown task {name!r}; registered: {sorted(_TASKS)}{did_you_mean(name, _TASKS)}")
    return _TASKS[name]
