"""Package discovery: the repository root is the `flipguard` package, so every folder under it
that is not listed in NOT_PACKAGED is a subpackage, found rather than listed: a hand-written list
misses a new folder, and the wheel's console script then fails on import.
Everything else about the build is in pyproject.toml; tests/test_packaging.py checks the wheel."""

from setuptools import find_namespace_packages, setup

# top-level folders that are not part of the installed package (the tests, benchmarks, docs and
# examples ship in the sdist's source tree only through git, not in the wheel), and build output
NOT_PACKAGED = ("tests", "bench", "docs", "examples", "build", "dist", "runs", "wandb", "venv", "env")
EXCLUDE = [pattern for name in NOT_PACKAGED for pattern in (name, f"{name}.*")] + ["*__pycache__*"]

setup(packages=["flipguard"] + [f"flipguard.{name}" for name in find_namespace_packages(".", exclude=EXCLUDE)])
