"""The view/copy table: which Python and NumPy operations share state with the original, which copy it.

Six experiments of a few lines each: list assignment, a shallow list copy, a NumPy basic slice, advanced
(fancy) indexing, `swapaxes` and `np.concatenate`. Each declares its prediction in code *before* it runs
(does the new name share memory with the original? does a write through it show in the original? is the
result C-contiguous?), then observes the answer: `np.shares_memory` (object identity for lists), shape,
strides, `C_CONTIGUOUS`, and whether a write propagates.

The arrays are `[B, T, D]` float32 (B = 2 sequences, T = 3 positions, D = 4), the layout of a single-head
KV cache, so each row says something about the caches: the Preallocated cache returns a basic slice of
its buffer (a view, and not C-contiguous), the Dynamic cache grows by `np.concatenate` (a fresh copy),
and attention reads K^T through `swapaxes` (a view with swapped strides, no copy).

The tests assert every observation, so a change in NumPy's view/copy behaviour is caught.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.recorder import RunRecorder

__all__ = [
    "VIEW_TABLE_COLUMNS",
    "Prediction",
    "ViewRow",
    "record_views",
    "run_views",
]


@dataclass(frozen=True)
class Prediction:
    """What we expect before running: shared memory, a propagating write, C-contiguity (None for lists)."""

    shares_memory: bool
    write_propagates: bool
    c_contiguous: bool | None


@dataclass(frozen=True)
class ViewRow:
    """One row of the view/copy table: the prediction, then what was observed.

    `shares_memory` is `np.shares_memory(original, new)` for arrays; for lists it is True when the new
    list is the same object or holds the same element objects (`is`). `shape` and `strides` are written
    as Python tuples (strides in bytes); for lists shape is `len N` and strides and contiguity are `-`.
    """

    experiment: str
    code: str
    write: str
    predicted_shares_memory: bool
    predicted_write_propagates: bool
    predicted_c_contiguous: str
    same_object: bool
    shares_memory: bool
    write_propagates: bool
    shape: str
    strides: str
    c_contiguous: str
    prediction_held: bool
    explanation: str


VIEW_TABLE_COLUMNS: tuple[str, ...] = tuple(ViewRow.__dataclass_fields__)


def _fmt_optional(flag: bool | None) -> str:
    return "-" if flag is None else str(flag)


def _row(
    experiment: str,
    code: str,
    write: str,
    prediction: Prediction,
    *,
    same_object: bool,
    shares_memory: bool,
    write_propagates: bool,
    shape: str,
    strides: str,
    c_contiguous: bool | None,
    explanation: str,
) -> ViewRow:
    held = (
        prediction.shares_memory == shares_memory
        and prediction.write_propagates == write_propagates
        and prediction.c_contiguous == c_contiguous
    )
    return ViewRow(
        experiment=experiment,
        code=code,
        write=write,
        predicted_shares_memory=prediction.shares_memory,
        predicted_write_propagates=prediction.write_propagates,
        predicted_c_contiguous=_fmt_optional(prediction.c_contiguous),
        same_object=same_object,
        shares_memory=shares_memory,
        write_propagates=write_propagates,
        shape=shape,
        strides=strides,
        c_contiguous=_fmt_optional(c_contiguous),
        prediction_held=held,
        explanation=explanation,
    )


def _kv() -> npt.NDArray[np.float32]:
    """A fresh `[B=2, T=3, D=4]` float32 array holding 0 .. 23 (strides (48, 16, 4) bytes)."""
    return np.arange(24, dtype=np.float32).reshape(2, 3, 4)  # [B, T, D]


def _array_row(
    experiment: str,
    code: str,
    prediction: Prediction,
    original: npt.NDArray[Any],
    new: npt.NDArray[Any],
    explanation: str,
) -> ViewRow:
    """Observe `new` against `original`, then write 99 at new[0, 0, 0] and look at original[0, 0, 0].

    Every experiment below places original[0, 0, 0] at new[0, 0, 0], so the write propagates exactly when
    the two share that element's memory.
    """
    shares = bool(np.shares_memory(original, new))
    shape, strides, contiguous = new.shape, new.strides, bool(new.flags["C_CONTIGUOUS"])
    before = float(original[0, 0, 0])
    new[0, 0, 0] = 99
    propagates = float(original[0, 0, 0]) == 99.0 and before != 99.0
    return _row(
        experiment,
        code,
        "new[0, 0, 0] = 99",
        prediction,
        same_object=new is original,
        shares_memory=shares,
        write_propagates=propagates,
        shape=str(shape),
        strides=str(strides),
        c_contiguous=contiguous,
        explanation=explanation,
    )


def list_assignment() -> ViewRow:
    """`b = a` binds a second name to the same list object: nothing is copied."""
    prediction = Prediction(shares_memory=True, write_propagates=True, c_contiguous=None)
    a = [[0.0, 1.0], [2.0, 3.0]]
    b = a
    same = b is a
    b[0][0] = 99.0
    return _row(
        "list assignment",
        "b = a",
        "b[0][0] = 99",
        prediction,
        same_object=same,
        shares_memory=same or any(x is y for x, y in zip(a, b, strict=True)),
        write_propagates=a[0][0] == 99.0,
        shape=f"len {len(b)}",
        strides="-",
        c_contiguous=None,
        explanation="Assignment never copies in Python; `b` and `a` are one object.",
    )


def shallow_copy() -> ViewRow:
    """`list(a)` copies the outer list only; its elements are the same inner lists."""
    prediction = Prediction(shares_memory=True, write_propagates=True, c_contiguous=None)
    a = [[0.0, 1.0], [2.0, 3.0]]
    b = list(a)
    same = b is a
    shared_elements = any(x is y for x, y in zip(a, b, strict=True))
    b[0][0] = 99.0
    return _row(
        "shallow copy",
        "b = list(a)",
        "b[0][0] = 99",
        prediction,
        same_object=same,
        shares_memory=same or shared_elements,
        write_propagates=a[0][0] == 99.0,
        shape=f"len {len(b)}",
        strides="-",
        c_contiguous=None,
        explanation=(
            "A new outer list holding the same inner lists: a write into an inner list propagates, "
            "rebinding `b[0] = [...]` would not. `copy.deepcopy` copies the inner lists too."
        ),
    )


def basic_slice() -> ViewRow:
    """A basic slice is a view: same buffer, new shape, the original's strides."""
    prediction = Prediction(shares_memory=True, write_propagates=True, c_contiguous=False)
    x = _kv()  # [B, T, D]
    new = x[:, :2]  # [B, 2, D], a view
    return _array_row(
        "basic slice",
        "new = x[:, :2]",
        prediction,
        x,
        new,
        "A view of the valid prefix, like PreallocatedKVCache.keys: it keeps x's batch stride (48 bytes "
        "for 2 x 4 x 4 bytes of data), so it is not C-contiguous although it copied nothing.",
    )


def advanced_indexing() -> ViewRow:
    """Advanced (fancy) indexing with an integer list copies; the prediction of C-order is kept as made.

    We predicted a C-contiguous copy; NumPy returns a transposed one (see the explanation). The
    prediction is left as it was written before running, so the table shows the miss.
    """
    prediction = Prediction(shares_memory=False, write_propagates=False, c_contiguous=True)
    x = _kv()  # [B, T, D]
    new = x[:, [0, 2]]  # [B, 2, D], a copy
    return _array_row(
        "advanced indexing",
        "new = x[:, [0, 2]]",
        prediction,
        x,
        new,
        "Prediction error: a copy (writes stay in it), but not C-contiguous. NumPy gathers into a buffer "
        "laid out [index, B, D] (the indexed axis outermost) and returns it transposed to [B, 2, D], "
        "hence strides (16, 32, 4). `x[[0, 1]]` (first axis) or `np.take(x, [0, 2], axis=1)` give "
        "C-contiguous copies; check `flags`, do not assume.",
    )


def swapaxes() -> ViewRow:
    """`swapaxes` swaps two entries of shape and strides: a view, no data moved."""
    prediction = Prediction(shares_memory=True, write_propagates=True, c_contiguous=False)
    x = _kv()  # [B, T, D]
    new = np.swapaxes(x, -1, -2)  # [B, D, T], a view (K^T in attention)
    return _array_row(
        "swapaxes",
        "new = np.swapaxes(x, -1, -2)",
        prediction,
        x,
        new,
        "K^T in attention costs nothing: the strides (48, 4, 16) walk the same buffer in another "
        "order, which is why the result is not C-contiguous; matmul handles the transpose.",
    )


def concatenate() -> ViewRow:
    """`np.concatenate` allocates a new array and copies every input into it."""
    prediction = Prediction(shares_memory=False, write_propagates=False, c_contiguous=True)
    x = _kv()  # [B, T, D]
    x_new = np.full((2, 1, 4), -1.0, dtype=np.float32)  # [B, 1, D], the new position
    new = np.concatenate([x, x_new], axis=1)  # [B, T+1, D], a fresh copy
    return _array_row(
        "concatenate",
        "new = np.concatenate([x, x_new], axis=1)",
        prediction,
        x,
        new,
        "The Dynamic cache's append: all T old positions are copied into a new [B, T+1, D] buffer "
        "every step, so its cost grows with T.",
    )


EXPERIMENTS: tuple[Callable[[], ViewRow], ...] = (
    list_assignment,
    shallow_copy,
    basic_slice,
    advanced_indexing,
    swapaxes,
    concatenate,
)


def run_views() -> list[ViewRow]:
    """Run the six experiments in order and return their rows (no I/O)."""
    return [experiment() for experiment in EXPERIMENTS]


def record_views(csv_path: Path, rows: Sequence[ViewRow], environment: Mapping[str, Any]) -> None:
    """The table as one recorded run: the CSV (VIEW_TABLE_COLUMNS) and its metadata, kind
    "view-copy-table" (`recorder.RunRecorder`)."""
    with RunRecorder(
        "view-copy-table",
        csv_path,
        VIEW_TABLE_COLUMNS,
        config={"experiment": "views"},
        environment=environment,
    ) as run:
        run.add(dataclasses.asdict(r) for r in rows)
