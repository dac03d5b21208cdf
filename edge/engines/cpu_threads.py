"""How many threads a CPU engine computes with when it is not told: one per physical core it may run on.

llama.cpp's library default is 4 threads whatever the machine (GGML_DEFAULT_N_THREADS): two a
core on a 2-core box, two of a 6-core Jetson Orin idle, twelve of a 16-core PC. llama.cpp's own tools (llama-server,
llama-bench) take one thread per physical core (common_cpu_get_num_math: hyperthreads do not help
matrix work), and "the same threads as llama-server" is what a user compares. We do the same, but
counting only the cores this process may run on (taskset / cgroup cpusets), so that a role pinned
to one core computes with one thread. (On a machine crowded with other work, more threads than
cores can finish sooner by taking a larger share of the CPU from the other work:
benchmarks/results/prefill_speed measured it; a device runs its roles, not a crowd.)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional

_SYS_CPU = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set:
    """The logical CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):          # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: Iterable[int], sys_cpu: Path = _SYS_CPU) -> int:
    """Physical cores among the logical `cpus`: each core's hyperthreads share one sibling list."""
    cores = set()
    for cpu in cpus:
        siblings = _siblings(sys_cpu, cpu)
        cores.add(siblings if siblings is not None else f"cpu{cpu}")
    return max(1, len(cores))


def _siblings(sys_cpu: Path, cpu: int) -> Optional[str]:
    try:
        return (sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
    except OSError:
        return None


def default_threads() -> int:
    """One thread per physical core this process may run on."""
    return physical_cores(allowed_cpus())
