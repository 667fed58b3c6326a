"""Write docs/cli.md, the command reference, from the parsers themselves: every command's
`--help`, exactly as a user sees it, so the reference cannot drift from the code
(tests/test_docs.py regenerates it in memory and compares). A script beside the page, not a
module of the package: nothing in flipguard imports the CLI (tests/test_layout.py).

    python docs/gen_cli.py            # rewrite docs/cli.md
    python docs/gen_cli.py --check    # exit 1 when docs/cli.md is stale

The text does not depend on the machine: a fixed terminal width (COLUMNS), and the
install's own paths (the package folder, $FLIPGUARD_HOME, the home folder) written as
placeholders before argparse wraps the lines.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import sys
import unittest.mock
from pathlib import Path

from flipguard.config import trainers
from flipguard.eval.interop.importer import TOOLS as IMPORT_TOOLS
from flipguard.files import PACKAGE_ROOT, flipguard_home
from flipguard.pipeline import cli

COLUMNS = 100
THIRD_PARTY = ("trl", "transformers", "peft", "accelerate")
DEFAULT_OUT = Path(__file__).resolve().parent / "cli.md"
HEADER = """# Command reference

Generated from the parsers by `python docs/gen_cli.py` (do not edit by hand;
`tests/test_docs.py` fails when this file and the parsers disagree). Paths in
defaults are written as `<flipguard>` (the installed package's folder), `<FLIPGUARD_HOME>`
(the cache, default `~/.cache/flipguard`) and `~`. Runs of inspect_ai and lm-evaluation-harness
(`flipguard import`, `flipguard export`) on a worked example: [interop.md](interop.md).
"""


def _own_options_help(parser: argparse.ArgumentParser, file=None) -> None:
    """print_help, less the options of third-party dataclasses (TRL's SFTConfig, ModelConfig...):
    their list follows the installed TRL and transformers, so it is named, not copied."""
    classes = getattr(parser, "dataclass_types", None) or []
    other = [cls for cls in classes if cls.__module__.split(".")[0] in THIRD_PARTY]
    own = {f.name for cls in classes if cls not in other for f in dataclasses.fields(cls)}
    theirs = {f.name for cls in other for f in dataclasses.fields(cls)} - own
    if theirs:
        dropped = [a for a in parser._actions if a.dest in theirs]
        parser._actions = [a for a in parser._actions if a not in dropped]
        for group in parser._action_groups:
            group._group_actions = [a for a in group._group_actions if a not in dropped]
        names = ", ".join(f"{cls.__module__.split('.')[0]}.{cls.__name__}" for cls in other)
        parser.epilog = ((parser.epilog or "") + f"\n\nAlso every field of {names} as --field value (not listed here: "
                         "they follow the installed TRL and transformers; `--help` lists them).").strip()
    _print_help(parser, file)


_print_help = argparse.ArgumentParser.print_help
_split_lines, _fill_text = argparse.HelpFormatter._split_lines, argparse.HelpFormatter._fill_text


def _short_paths(wrap):
    """argparse's line wrapper, given the text with its paths already as placeholders: wrapped after
    the substitution, a default such as <flipguard>/recipes/organism.yaml broke its line or not by
    the length of the checkout's path (a clone in a longer folder failed tests/test_docs.py)."""
    return lambda self, text, *args: wrap(self, _placeholders(text), *args)


def _help(argv: list[str]) -> str:
    """What `flipguard ARGV` prints (stdout and stderr), whatever exit it takes."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
            unittest.mock.patch.object(argparse.ArgumentParser, "print_help", _own_options_help), \
            unittest.mock.patch.object(argparse.HelpFormatter, "_split_lines", _short_paths(_split_lines)), \
            unittest.mock.patch.object(argparse.HelpFormatter, "_fill_text", _short_paths(_fill_text)):
        try:
            cli.main(argv)
        except SystemExit:  # argparse's --help exits 0 after printing
            pass
    # a library's own notice on import depends on the environment (WANDB_MODE), not on the parser
    return "".join(line for line in out.getvalue().splitlines(keepends=True)
                   if not line.startswith("[INFO] Running in WANDB"))


def _placeholders(text: str) -> str:
    for path, name in ((PACKAGE_ROOT, "<flipguard>"), (flipguard_home(), "<FLIPGUARD_HOME>"), (Path.home(), "~")):
        text = text.replace(str(path), name)
    return text


def render() -> str:
    """docs/cli.md's text: `flipguard --help`, then each command's `--help` in the table's order."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(COLUMNS)  # argparse wraps to the terminal: fix the width
    try:
        sections = [HEADER, "## flipguard\n\n```text\n" + _help(["--help"]).rstrip() + "\n```\n"]
        # `flipguard import TOOL`: each tool's form has options of its own
        forms = {"import": [[tool] for tool in IMPORT_TOOLS]}
        # the command table, then flipguard's own trainers (a plug-in installed here documents itself)
        own_trainers = [name for name, t in trainers().items() if t.main.__module__.startswith("flipguard.")]
        for name in [*cli.COMMANDS, *own_trainers]:
            for form in [[], *forms.get(name, [])]:
                sections.append(f"## flipguard {' '.join([name, *form])}\n\n```text\n"
                                + _help([name, *form, "--help"]).rstrip() + "\n```\n")
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return _placeholders("\n".join(sections))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/gen_cli.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="where to write (default: docs/cli.md beside this script)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when --out differs from the parsers")
    args = ap.parse_args(argv)
    text, out = render(), Path(args.out)
    if args.check:
        current = out.read_text(encoding="utf-8") if out.is_file() else ""
        if current != text:
            print(f"{out} is stale: run python docs/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    out.write_text(text, encoding="utf-8")  # a tracked page of the repository, not a run's output
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
