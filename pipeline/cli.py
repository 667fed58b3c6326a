"""`flipguard` console entry point: one subcommand per job.

Each subcommand is a `main(argv) -> int` (a module's function; for a protocol, its
registered task's `Task.main`, the one command shape of eval/task.py) that parses its own
dataclasses with flipguard.config.parse_dataclasses (TRL's TrlParser, the parser of TRL's scripts), so
every option has a type, a default and help text, and `--help` explains it. Modules are
imported only when their subcommand runs, keeping `flipguard --help` fast (it loads the trainers'
declarations only: their commands are theirs, flipguard's or a plug-in's). Nothing imports this
module: it holds only the command table and `main`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import signal
import sys
from typing import Callable

from flipguard import __version__
from flipguard.config import did_you_mean, trainers
from flipguard.config.trainers import broken_trainers
from flipguard.errors import FlipguardError, UserError, disk_error
from flipguard.redact import redact

# name -> ("module:function" or "module:Class.method", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("flipguard.pipeline.demo:main", "the whole loop end to end on the planted-bias organism: detect, mitigate, re-measure"),
    "eval": ("flipguard.eval.dds.protocol:DDSTask.main", "DDS evaluation: C1/C2 judgments for a model, written as records"),
    "report": ("flipguard.eval.task_commands:report_main", "rebuild a run's report (any protocol) from its records: RUN/report/"),
    "import-records": ("flipguard.eval.dds.importer:main", "read DialDefer-format per-item records into a run directory"),
    "import": ("flipguard.eval.interop.importer:main", "read inspect_ai eval logs or lm-evaluation-harness --log_samples output into a run folder"),
    "export": ("flipguard.eval.interop.export:main", "write a run as inspect_ai eval logs (inspect view, read_eval_log)"),
    "data": ("flipguard.data.cli:main", "inspect, validate and export dataset splits; register your own dataset"),
    "organism": ("flipguard.pipeline.organism:main", "the planted-bias judge organism: the shipped one, your own build, or planted into your model (--base)"),
    "convert": ("flipguard.runtime.convert:main", "write a plain checkpoint from a GGUF file (every --model also takes a .gguf)"),
    "tiny-model": ("flipguard.eval.embedded.tiny_model:main", "create (once, cached) the tiny random-init local chat model"),
    "pairs": ("flipguard.pairs.builder:main", "build the trainers' pair datasets from flip records (recipe strategy)"),
    "compare": ("flipguard.pipeline.compare:main", "before/after comparison report across baseline, prompting and fine-tuned runs"),
    "view": ("flipguard.pipeline.view:main", "one self-contained HTML page (no network) for a run, comparison or study folder"),
    "afr": ("flipguard.eval.afr.protocol:AFRTask.main", "answer-flip protocol on MMLU (coercion, blind/self/cross challenges)"),
    "sos": ("flipguard.eval.sos.protocol:SosTask.main", "stick-or-switch multi-turn evaluation (conviction, flexibility)"),
    # the DialDefer paper's analyses (eval/dds/analyses/)
    "taxonomy": ("flipguard.eval.dds.analyses.taxonomy:main", "LLM-judge reasoning-failure codes of a run's flips (paper App. F/J)"),
    "label-ablation": ("flipguard.eval.dds.analyses.labels:main", "speaker-label ablation: DDS per label set and the human-vs-LLM swing (§5.2)"),
    "perspective-reversal": ("flipguard.eval.dds.analyses.perspective:main", "r/AIO 2->1 vs 1->2 judger/judgee DDS (paper Table 14)"),
    "cross-model": ("flipguard.eval.dds.analyses.cross_model:main", "cross-model flip agreement and per-item DDS mean/std (Tables 25/27/29)"),
    "run": ("flipguard.eval.task_commands:run_main", "any registered task (dds, afr, sos, or your own with --include FILE)"),
    "study": ("flipguard.pipeline.study:main", "a recipe's whole before/after plan in one resumable command (eval: section)"),
    "merge": ("flipguard.train.merge:main", "merge a LoRA adapter into its base (same as flipguard merge RECIPE)"),
    "recipes": ("flipguard.config.recipes_command:recipes_main", "the shipped recipes and run configs; `recipes show NAME` prints one to copy"),
}


def _trainer_commands() -> dict[str, tuple[Callable[..., int], str]]:
    """One command per registered trainer (a `flipguard.trainers` entry point, flipguard's own or a
    plug-in's): `flipguard dpo RECIPE` = python -m flipguard.train.dpo RECIPE. A plug-in that fails to load is
    listed too: its command says why, in one line naming its package; nothing else is blocked."""
    commands = {name: (t.main, t.help) for name, t in trainers().items() if name not in COMMANDS}
    for name, why in broken_trainers().items():
        if name not in COMMANDS:
            commands[name] = (functools.partial(_refuse, why), "a trainer plug-in that failed to load (run it to see why)")
    return commands


def _refuse(why: str, argv: list[str]) -> int:
    raise UserError(why)


def _usage() -> str:
    helps = {name: help_ for name, (_, help_) in {**COMMANDS, **_trainer_commands()}.items()}
    width = max(map(len, helps))
    lines = [
        "usage: flipguard <command> [options]   (flipguard <command> --help for its options)",
        "",
        "Measure and train away sycophantic deference in LLMs.",
        "",
        "commands:",
    ]
    lines += [f"  {name.ljust(width)}  {help_}" for name, help_ in helps.items()]
    return "\n".join(lines)


def _command(name: str) -> Callable[..., int] | None:
    """The function `flipguard NAME` runs; None for no command of that name."""
    if name in COMMANDS:
        module_name, attr = COMMANDS[name][0].split(":")
        return functools.reduce(getattr, attr.split("."), importlib.import_module(module_name))
    trainer = _trainer_commands().get(name)
    return trainer[0] if trainer else None


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
        sys.stdout.flush()  # a short output is still in the buffer: a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        # the reader went away (`flipguard --help | head`): stop quietly, as a command killed by SIGPIPE
        # would, rather than print a traceback; stdout goes to devnull so exit's flush cannot raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-V"], ["--version"]):
        print(__version__)
        return 0
    name, rest = (argv[0], argv[1:]) if argv else ("help", [])
    try:
        if name in ("-h", "--help", "help"):
            print(_usage())
            return 0
        # importing the command (or loading the trainers) registers the plug-ins it names: a broken
        # install (an entry point declared twice) is a FlipguardError here, one line like any other
        func = _command(name)
        if func is None:
            known = [*COMMANDS, *_trainer_commands()]
            print(f"flipguard: error: unknown command {name!r}{did_you_mean(name, known)} (flipguard --help lists them)",
                  file=sys.stderr)
            return 2
        # the train/ scripts' main also serves `flipguard <trainer>|merge`: their usage line names the subcommand
        kwargs = {"prog": f"flipguard {name}"} if "prog" in inspect.signature(func).parameters else {}
        return int(func(rest, **kwargs) or 0)
    except KeyboardInterrupt as exc:  # a command that knows better says what a rerun does (an organism build)
        print(f"flipguard {name}: " + (str(exc) or "interrupted: what was written so far is kept; rerun the same command to resume"),
              file=sys.stderr)
        return 130
    except FlipguardError as exc:
        print(f"flipguard {name}: error: {redact(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        error = disk_error(exc)
        if error is None:
            raise
        print(f"flipguard {name}: error: {redact(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
