"""Every subcommand's --help renders (argparse expands '%' in help texts: a stray one
turns --help into a traceback)."""

from __future__ import annotations

import pytest

from flipguard.pipeline.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_renders(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"flipguard {command}" in capsys.readouterr().out


def test_commands_parse_where_trl_is_not_installed(tmp_path):
    """vLLM's own environment takes flipguard with --no-deps and has no trl (docs/serving.md,
    .ci/vllm): every command but the trainers must still parse its options there. A real
    process in which `import trl` fails."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['trl'] = None\n"  # `import trl` now raises ImportError
            "from flipguard.config import parse_dataclasses\n"
            "from flipguard.eval.dds import EvalArgs\n"
            "args = parse_dataclasses(['--backend', 'vllm', '--limit', '3'], EvalArgs, prog='flipguard eval', description='')\n"
            "print(args.backend, args.limit)\n"
            "import trl\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.stdout.splitlines()[0] == "vllm 3"
    assert "ModuleNotFoundError: import of trl halted" in proc.stderr  # trl really was unavailable


def test_the_protocols_commands_are_the_task_base_command(capsys):
    """DDS, AFR and stick-or-switch declare their flags and defaults; the command itself is
    Task.main, whether reached as `flipguard eval|afr|sos` or `flipguard run dds|afr|sos`."""
    from flipguard.eval.task import Task
    from flipguard.eval.task_registry import get_task

    for name, command in (("dds", "eval"), ("afr", "afr"), ("sos", "sos")):
        task = get_task(name)
        assert task.main.__func__ is Task.main.__func__, name
        assert COMMANDS[command][0] == f"{task.__module__}:{task.__name__}.main"
        for argv in ([command, "--help"], ["run", name, "--help"]):
            with pytest.raises(SystemExit):
                main(argv)
            usage = capsys.readouterr().out
            assert usage.startswith(f"usage: flipguard {' '.join(argv[:-1])} ") and "--out" in usage


def test_output_into_a_closed_pipe_stops_quietly():
    """`flipguard --help | head -1`: the reader has gone; flipguard exits as a command killed by
    SIGPIPE would (141), without a traceback. A real process writing into a pipe whose read end
    is closed (long and short outputs: the usage, the version)."""
    import os
    import subprocess
    import sys

    for args in (["--help"], ["--version"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            proc = subprocess.run([sys.executable, "-m", "flipguard", *args], stdout=write_end, stderr=subprocess.PIPE,
                                  text=True, timeout=300)
        finally:
            os.close(write_end)
        assert proc.returncode == 141, (args, proc.returncode, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-2000:]
