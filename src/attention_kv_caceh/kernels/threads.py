"""One pool of threads for a step's kernels: Numba's parallel layer, and the output-row split every GEMM shares.

The engine core computes a step on `threads` threads of Numba's pool (`set_threads` in the thread that
runs the step: Numba's count is per calling thread). The GEMMs (`gemm.packed_linear_into`,
`block_gemm.block_linear_into`, and any kernel with the same `(x, W rows, y columns)` contract) split
their output rows into chunks (`chunk_rows`: several per thread, so a core held by another process
delays a step by one chunk) that the threads take from a shared counter (`_parallel_jit.row_split`);
each output is one dot product summed by one thread in the kernel's order, so results are
bit-identical for every thread count. The paged decode attention has its own parallel loop
(`decode_attention.paged_decode_attention_into(threads=...)`) over the same pool.

Threading layer: "omp" (libgomp) where it loads, else Numba's default order. It is safe to launch
from several Python threads (Numba's "workqueue" layer aborts on concurrent launches), and its idle
threads spin briefly before sleeping, which keeps the many short regions of one step cheap (the
launch costs measured: docs/kernels.md). `NUMBA_THREADING_LAYER` set in the environment wins.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, cast

import numba
import numpy as np

from attention_kv_caceh.kernels import _parallel_jit as _jit

__all__ = [
    "CHUNKS_PER_THREAD",
    "chunk_rows",
    "current_threads",
    "launch_overhead_us",
    "row_split",
    "set_threads",
    "threading_layer",
]

CHUNKS_PER_THREAD = 8
"""Chunks of output rows per thread: enough that a stalled thread holds back one chunk of eight."""

if "NUMBA_THREADING_LAYER" not in os.environ:
    cast(Any, numba).config.THREADING_LAYER = "omp"
    try:  # libgomp missing: Numba's default order (tbb, omp, workqueue)
        import numba.np.ufunc.omppool  # pyright: ignore[reportMissingImports]
    except ImportError:
        cast(Any, numba).config.THREADING_LAYER = "default"


def set_threads(threads: int) -> None:
    """Numba's thread count for the calling thread (its parallel regions, the GEMM split, the paged
    decode attention). Raises ValueError for a count outside [1, NUMBA_NUM_THREADS]."""
    limit = int(cast(Any, numba).config.NUMBA_NUM_THREADS)
    if not 1 <= threads <= limit:
        raise ValueError(f"threads must be in [1, {limit}] (NUMBA_NUM_THREADS), got {threads}")
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


def current_threads() -> int:
    """Numba's thread count for the calling thread."""
    return int(numba.get_num_threads())


def threading_layer() -> str:
    """The threading layer Numba chose ("omp", "tbb", "workqueue"); launches one region if none ran."""
    try:
        return str(cast(Any, numba).threading_layer())
    except ValueError:  # no parallel region ran yet
        _jit.empty_region(np.zeros(1, np.int64))
        return str(cast(Any, numba).threading_layer())


def chunk_rows(rows: int, threads: int, align: int = 1) -> int:
    """Rows of W per chunk: about rows / (CHUNKS_PER_THREAD threads), rounded up to a multiple of
    `align` (a kernel's group of rows), at least `align`."""
    per = -(-rows // (CHUNKS_PER_THREAD * max(1, threads)))
    return max(align, -(-per // align) * align)


def row_split(kernel: Callable[..., None]) -> Callable[..., None]:
    """The parallel driver of `kernel(x, w, y)` (`_parallel_jit.row_split`): call it as
    `drive(x, w, y, chunk_rows, cols, workers)`, `cols` output columns per row of w (1 for a GEMM's
    weight rows, NR for packed panels), `workers` = the thread count."""
    return cast(Callable[..., None], _jit.row_split(kernel))


def launch_overhead_us(threads: int, launches: int = 2000) -> float:
    """Microseconds one empty parallel region costs on `threads` threads (median of 5 runs of
    `launches` back-to-back launches, wall clock); sets the calling thread's count to `threads`."""
    set_threads(threads)
    out = np.zeros(threads, np.int64)
    _jit.empty_region(out)  # compile or load
    samples: list[float] = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(launches):
            _jit.empty_region(out)
        samples.append((time.perf_counter() - start) / launches * 1e6)
    return float(np.median(samples))
