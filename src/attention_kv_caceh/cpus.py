"""How many threads the engine core computes on: the CPUs this process may use, bounded by its cgroup's quota.

`usable_cpus()` is the CPU set of `os.sched_getaffinity(0)` (what `taskset` or a container's cpuset
leaves), cut to the cgroup's CPU quota when there is one: cgroup v2 `cpu.max` ("max PERIOD" is no
quota, "QUOTA PERIOD" allows ceil(QUOTA / PERIOD) CPUs' worth), or cgroup v1 `cpu.cfs_quota_us`
(-1: none) over `cpu.cfs_period_us`. `default_threads(serving)` is that count, less one for the API
process when serving on four or more (vLLM's CPU worker reserves one core for it the same way,
`vllm/v1/worker/cpu_worker.py`). `check_threads` refuses a count below 1 or above the usable CPUs or
the thread pool Numba was started with (`NUMBA_NUM_THREADS`), naming the value.

Nothing here imports Numba at import time (the pool's size is read when a count is checked).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CGROUP_ROOT",
    "CpuSet",
    "cgroup_cpu_quota",
    "check_threads",
    "default_threads",
    "numba_pool_size",
    "parse_cfs_quota",
    "parse_cpu_max",
    "threads_note",
    "usable_cpus",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("QUOTA PERIOD", QUOTA "max" for none) -> CPUs' worth of quota, or None.

    Raises ValueError for text that is not two fields of a quota ("max" or an int >= 0) and a period
    (an int >= 1)."""
    fields = text.split()
    if len(fields) != 2:
        raise ValueError(f"cpu.max must be 'QUOTA PERIOD', got {text!r}")
    quota, period = fields
    try:
        period_us = int(period)
        quota_us = None if quota == "max" else int(quota)
    except ValueError:
        raise ValueError(f"cpu.max must be 'QUOTA PERIOD' of ints (QUOTA may be max), got {text!r}") from None
    if period_us < 1 or (quota_us is not None and quota_us < 0):
        raise ValueError(f"cpu.max needs QUOTA >= 0 and PERIOD >= 1, got {text!r}")
    return None if quota_us is None else quota_us / period_us


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` (-1: none) and `cpu.cfs_period_us` -> CPUs' worth, or None.

    Raises ValueError for a quota that is not an int >= -1 or a period that is not an int >= 1."""
    try:
        quota, period = int(quota_text.strip()), int(period_text.strip())
    except ValueError:
        raise ValueError(f"cfs quota and period must be ints, got {quota_text!r}, {period_text!r}") from None
    if quota < -1 or period < 1:
        raise ValueError(f"cfs quota must be >= -1 and period >= 1, got {quota}, {period}")
    return None if quota == -1 else quota / period


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in CPUs' worth (cgroup v2 `root/cpu.max`, else v1
    `root/cpu/cpu.cfs_quota_us` or `root/cpu,cpuacct/...`), None when there is none or no file to read.
    A file that does not parse counts as no quota (the CPU set still bounds the count)."""
    try:
        return parse_cpu_max((root / "cpu.max").read_text())
    except (OSError, ValueError):
        pass
    for folder in ("cpu", "cpu,cpuacct", "."):
        try:
            quota = (root / folder / "cpu.cfs_quota_us").read_text()
            period = (root / folder / "cpu.cfs_period_us").read_text()
        except OSError:
            continue
        try:
            return parse_cfs_quota(quota, period)
        except ValueError:
            return None
    return None


@dataclass(frozen=True)
class CpuSet:
    """The CPUs this process may run on (`ids`, sorted) and the cgroup quota (CPUs' worth, None: none);
    `count` is how many threads may compute at once: len(ids), or ceil(quota) when that is smaller (at
    least 1)."""

    ids: tuple[int, ...]
    quota: float | None

    @property
    def count(self) -> int:
        """len(ids) bounded by ceil(quota), at least 1."""
        if self.quota is None:
            return max(1, len(self.ids))
        return max(1, min(len(self.ids), math.ceil(self.quota)))

    def describe(self) -> str:
        """e.g. "CPUs 0-1 (2 usable)" or "CPUs 0-7, quota 2.5 (3 usable)"."""
        quota = "" if self.quota is None else f", quota {self.quota:g}"
        return f"CPUs {_ranges(self.ids)}{quota} ({self.count} usable)"


def _ranges(ids: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    parts: list[str] = []
    start = prev = None
    for i in ids:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = i
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def usable_cpus(root: Path = CGROUP_ROOT) -> CpuSet:
    """This process's CPU set (`os.sched_getaffinity(0)`; `os.cpu_count()` where there is none) and
    its cgroup quota under `root`."""
    try:
        ids = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        ids = tuple(range(os.cpu_count() or 1))
    return CpuSet(ids, cgroup_cpu_quota(root))


def default_threads(serving: bool = False, cpus: CpuSet | None = None) -> int:
    """The engine core's threads when none are given: the usable CPUs (`CpuSet.count`), less one for
    the API process when `serving` on four or more."""
    count = (cpus or usable_cpus()).count
    return count - 1 if serving and count >= 4 else count


def numba_pool_size() -> int:
    """The size of Numba's thread pool (`NUMBA_NUM_THREADS`, fixed when Numba starts)."""
    from numba.core import config

    return int(getattr(config, "NUMBA_NUM_THREADS"))  # noqa: B009  (set by Numba at import)


def check_threads(threads: object, cpus: CpuSet | None = None) -> int:
    """`threads` as an int, or ValueError naming it: not an int >= 1, more than the usable CPUs, or
    more than Numba's pool (`numba_pool_size`)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"must be an int >= 1, got {threads!r}")
    found = cpus or usable_cpus()
    if threads > found.count:
        raise ValueError(f"{threads} exceeds the {found.describe()}")
    pool = numba_pool_size()
    if threads > pool:
        raise ValueError(f"{threads} exceeds Numba's thread pool of {pool} (NUMBA_NUM_THREADS)")
    return threads


def threads_note(threads: int, cpus: CpuSet | None = None) -> str:
    """The line a command prints at startup, e.g. "engine core: 2 threads on CPUs 0-1 (2 usable)"."""
    return (
        f"engine core: {threads} thread{'s' if threads != 1 else ''} on {(cpus or usable_cpus()).describe()}"
    )
