"""Timing primitives: raw samples, one statistics function, the saturation rule, and the environment
that produced them.

Every figure this project reports is computed by `summarize_samples` from raw samples that are also
written to disk, so any number in a table can be recomputed from the raw file. `measure` follows one
order: warm-up calls that are not recorded, then `repeats` timed calls with only
the call itself between the two `perf_counter_ns` reads.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter_ns
from typing import Any, cast

import numpy as np
from threadpoolctl import threadpool_info  # pyright: ignore[reportMissingTypeStubs]

__all__ = [
    "SATURATION_GAIN",
    "THREAD_ENV_VARS",
    "Sample",
    "blas_threads_pinned",
    "capture_environment",
    "doubling_gains_xy",
    "measure",
    "memory_limit_bytes",
    "summarize_samples",
]

# Variables that fix BLAS/OpenMP thread pools; they only take effect if set before the process starts.
THREAD_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed call of the batch-size scan: one row of the raw CSV.

    `elapsed_ms` is wall time in milliseconds from `perf_counter_ns`; `impl` names the decode step that
    was timed (`experiments.scan_impls.IMPLS`; files written before the column existed are all numpy). Frozen is shallow
    (it only forbids rebinding a field): every field here is an immutable scalar, so a Sample really cannot change.
    """

    batch_size: int
    sequence_length: int
    elapsed_ms: float
    repeat: int = 0
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64
    dtype: str = "float32"
    cache: str = "dynamic"
    model: str = ""
    seed: int = 42
    warmup: int = 3
    impl: str = "numpy"


def measure(
    fn: Callable[..., object],
    *args: object,
    warmup: int = 3,
    repeats: int = 30,
    setup: Callable[[], object] | None = None,
    out: list[float] | None = None,
) -> list[float]:
    """Time `fn(*args)`: `warmup` unrecorded calls, then `repeats` timed calls; returns milliseconds.

    Only the call sits between the two `perf_counter_ns` reads. `setup`, if given, runs before every
    call (warm-up and timed) outside the timed region, e.g. to rewind a KV cache to the same length so
    that every sample times the same step. Wall time includes Python dispatch, allocation and BLAS.
    `out`, if given, receives each sample as it is taken and is the list returned, so a caller keeps
    the samples taken before a KeyboardInterrupt cut the calls short.

    Raises ValueError if `warmup < 0` or `repeats < 1`.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn(*args)
    samples_ms: list[float] = [] if out is None else out
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = perf_counter_ns()
        fn(*args)
        elapsed_ns = perf_counter_ns() - start
        samples_ms.append(elapsed_ns / 1_000_000)
    return samples_ms


def summarize_samples(samples_ms: Sequence[float]) -> dict[str, float]:
    """Statistics of raw samples (any unit; keys say `_ms` because every caller passes milliseconds).

    Returns `count`, `mean_ms`, `stdev_ms` (population standard deviation, `np.std`, as vLLM's
    `bench serve` reports `std_*_ms`), `min_ms`, `p50_ms`, `p90_ms`, `p95_ms`, `p99_ms`, `max_ms`.
    Percentiles use NumPy's default linear interpolation (`np.percentile`, method "linear"), so
    P50 of [1, 1, 10] is 1 and of [1, 2] is 1.5. This is the one statistics function of the project.

    Raises ValueError for an empty sequence, a non-finite sample, or samples so large that a
    statistic overflows (a file's 1e308 ms).
    """
    values = np.asarray(samples_ms, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"need a non-empty 1-D sequence of samples, got shape {values.shape}")
    if not np.all(np.isfinite(values)):
        bad = values[~np.isfinite(values)][:3].tolist()
        raise ValueError(f"samples must be finite, got {bad}")
    try:
        with np.errstate(over="raise"):
            p50, p90, p95, p99 = np.percentile(values, [50, 90, 95, 99]).tolist()
            mean, stdev = float(values.mean()), float(values.std())
    except FloatingPointError:
        raise ValueError(f"samples too large for statistics (largest {values.max():g})") from None
    return {
        "count": float(values.size),
        "mean_ms": mean,
        "stdev_ms": stdev,
        "min_ms": float(values.min()),
        "p50_ms": float(p50),
        "p90_ms": float(p90),
        "p95_ms": float(p95),
        "p99_ms": float(p99),
        "max_ms": float(values.max()),
    }


def blas_threads_pinned() -> bool:
    """True when a BLAS/OpenMP thread count was fixed in the environment before this process began."""
    return any(os.environ.get(name) for name in THREAD_ENV_VARS)


def memory_limit_bytes() -> int | None:
    """Bytes this process may use: physical memory, or a lower address-space limit (`ulimit -v`,
    RLIMIT_AS) when one is set; None when neither is known. Every command's up-front memory check
    compares its estimate with this."""
    import resource

    limits: list[int] = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    with contextlib.suppress(ValueError, OSError):
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    limits = [n for n in limits if n > 0]
    return min(limits) if limits else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def capture_environment() -> dict[str, Any]:
    """What produced a measurement: versions, CPU, BLAS library and threads, thread variables, commit.

    The BLAS section comes from threadpoolctl (`threadpool_info()`), i.e. the pools actually loaded
    and the thread count in effect now, not what an environment variable asked for.
    """
    pools = [
        {
            "user_api": str(info.get("user_api")),
            "internal_api": str(info.get("internal_api")),
            "num_threads": int(info.get("num_threads", 0)),
            "version": str(info.get("version")),
            "architecture": str(info.get("architecture")),
            "filepath": str(info.get("filepath")),
        }
        for info in cast("list[dict[str, Any]]", threadpool_info())
    ]
    env_vars = {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(("OPENBLAS_", "OMP_", "MKL_", "GOTO", "BLIS_"))
    }
    return {
        "start_time_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "blas": pools,
        "blas_threads": max((p["num_threads"] for p in pools), default=None),
        "blas_threads_pinned_by_env": blas_threads_pinned(),
        "thread_env": env_vars,
        "git_commit": _git_commit(),
        "perf_counter_resolution_s": _clock_resolution(),
    }


def _clock_resolution() -> float:
    import time

    res = time.get_clock_info("perf_counter").resolution
    return float(res) if math.isfinite(res) else float("nan")


SATURATION_GAIN = 0.10
"""Doubling the load must raise throughput by at least this much, or it has saturated: the batch-size
scan's rule (`experiments.scan_stats.saturation_point`) and a sweep's knee (`harness.sweep.find_knee`)."""


def doubling_gains_xy(points: Sequence[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """(x1, x2, gain per doubling) for consecutive (x, y) points sorted by x (x > 0, y > 0): the
    saturation rule for any load axis (batch size, client concurrency, request rate) and any
    throughput. gain = (y2 / y1) ** (1 / log2(x2 / x1)) - 1."""
    rows = sorted(points)
    return [
        (x1, x2, (y2 / y1) ** (1 / math.log2(x2 / x1)) - 1) for (x1, y1), (x2, y2) in itertools.pairwise(rows)
    ]
