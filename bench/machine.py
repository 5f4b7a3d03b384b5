"""The machine a benchmark ran on, printed above its table: the same code has measured 2-4x apart on
the machines this project has run on (docs/benchmarks.md, "Issue 26's measurements on an AMD EPYC"),
so a figure is read beside the machine that printed it."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name as Linux reports it, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's share, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def describe() -> str:
    return (f"{cpu_model()}, {usable_cpus()} CPUs, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")
