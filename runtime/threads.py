"""One place that decides how many CPU threads torch uses.

On a shared, busy machine torch's default (one thread per core, spinning) was 10-40x
slower than a single thread for the small batches flipguard runs, so the default is
$OMP_NUM_THREADS when set, else 1. The choice is exported as OMP_NUM_THREADS so the
train/*.py scripts a command starts make the same one.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from flipguard.errors import FlipguardError

THREADS_HELP = ("torch CPU threads (default: $OMP_NUM_THREADS if set, else 1; on a shared machine one "
                "thread was 10-40x faster than torch's default of one per core)")


def default_threads() -> int:
    """$OMP_NUM_THREADS when it is a positive integer, else 1."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def configure_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads to `n` (None: `default_threads()`); returns the number."""
    if n is None:
        n = default_threads()
    if int(n) < 1:
        raise FlipguardError(f"--threads must be a positive integer, got {n}")
    n = int(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)
    return n


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_name(default: str | None = None) -> str:
    """The CPU's model name (/proc/cpuinfo), for the machine line of a benchmark or a build's
    record; `default` (else platform.processor() or the architecture) where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default if default is not None else (platform.processor() or platform.machine())


def cpu_fp_path() -> dict[str, str | int]:
    """What decides how a CPU run rounds, for a run's record: the CPU, the kernels torch picked on
    it (AVX512, AVX2, or DEFAULT: none vectorised) and its threads. Another CPU may round
    another way: bench/demo_fp_path.md measures what that does to the demo's judgments."""
    import torch

    return {"cpu": cpu_name(), "cpu_kernels": cpu_kernels(), "torch_threads": torch.get_num_threads()}


def cpu_kernels() -> str:
    """The CPU kernels torch chose in this process: AVX512, AVX2, or DEFAULT (none vectorised)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()
