"""The parallel driver behind `kernels/threads.py`: a kernel's output rows split over Numba's threads; import `threads`.

Contract of a kernel it drives: `kernel(x, w, y)` computes y = x W^T where W's leading axis is the
output rows (a GEMM's weight rows `[N, ...]`, or packed panels `[P, ...]` of `cols` output columns
each), and computing the slice `kernel(x, w[r0:r1], y[:, r0 cols : r1 cols])` gives exactly the
columns the whole call would (each output is one dot product, summed by one thread in the kernel's
fixed order; the row slice only changes which thread runs it). So the result is bit-identical for
every thread count and every chunk size.

Scheduling is dynamic: the prange runs one worker per thread, and each worker takes the next chunk
from a shared counter (an atomic fetch-and-add, `_take`) until none is left, so a thread whose core
another process holds delays the step by one chunk, not by a fixed share of the rows.
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__: list[str] = []


@intrinsic
def _take(typingctx, counter):
    """Atomically add 1 to counter[0] (int64 array) and return the value before (sequentially
    consistent fetch-and-add)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", arr.data, ir.IntType(64)(1), "seq_cst")

    return types.int64(counter), codegen


_DRIVERS: dict[Any, Any] = {}


def row_split(kernel):
    """The parallel driver of `kernel` (module docstring), compiled once per kernel:
    `drive(x, w, y, chunk_rows, cols, workers)` runs chunks of `chunk_rows` rows of w (the last one
    shorter) on `workers` workers of Numba's pool (at most its current thread count)."""
    found = _DRIVERS.get(kernel)
    if found is not None:
        return found

    @numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
    def drive(x, w, y, chunk_rows, cols, workers):
        rows = w.shape[0]
        chunks = (rows + chunk_rows - 1) // chunk_rows
        counter = np.zeros(1, np.int64)
        for _ in numba.prange(workers):
            c = _take(counter)  # pyright: ignore[reportCallIssue]  (typingctx is Numba's)
            while c < chunks:
                r0 = c * chunk_rows
                r1 = min(rows, r0 + chunk_rows)
                kernel(x, w[r0:r1], y[:, r0 * cols : r1 * cols])
                c = _take(counter)  # pyright: ignore[reportCallIssue]

    _DRIVERS[kernel] = drive
    return drive


@numba.njit(parallel=True, nogil=True, cache=True)
def empty_region(out):
    """One parallel region that does nothing but write its worker's index: what a launch costs."""
    for i in numba.prange(out.shape[0]):
        out[i] = i
