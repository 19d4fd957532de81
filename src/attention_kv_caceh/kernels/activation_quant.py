"""Activations quantized to 8 bits once per matmul, for integer dot products against GGUF's weight blocks.

llama.cpp multiplies a block-quantized weight by activations quantized to a matching 8-bit format
(ggml-quants.c `quantize_row_q8_0_ref`, `quantize_row_q8_1_ref`, `quantize_row_q8_K_ref`; the
weight type's `vec_dot_type` in ggml-cpu.c): the products of the quants are then integers, summed in
int32, and each block's sum is scaled once. The rows of `ACTIVATION_FORMATS` are those formats:

    format  block  per block                                 pairs with (weight formats)
    Q8_0    32     d = max |x| / 127, q = round(x / d)       Q8_0
    Q8_1    32     as Q8_0, and s = d sum(q)                  Q4_1, Q5_1, Q4_0, Q5_0
    Q8_K    256    d = -max / 127 for the x of largest        Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
                   magnitude, q = min(127, round(x / d)),
                   bsums: sum(q) per 16

round() is ggml's: `roundf` (half away from zero) for Q8_0 / Q8_1, `nearest_int` (half to even) for
Q8_K; x / d is computed as x times the float32 reciprocal id = 1 / d (Q8_K: iscale = -127 / max and
d = 1 / iscale), as ggml does, so the quants are bit-equal to ggml's. ggml stores d and s as float16
(the activations' blocks are a buffer of its own); here they stay float32 arrays beside an int8 array
of the quants (no byte layout to match, one rounding fewer). A block of zeros has d = 0 and q = 0.

Oracles: `quantize_activations_reference` (NumPy, the formulas above in float32) is the compiled
`quantize_activations`'s oracle, bit-equal (tests/test_activation_quant.py).
"""

# pyright: basic
# (Numba compiles the loops from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numba
import numpy as np
import numpy.typing as npt

__all__ = [
    "ACTIVATION_FORMATS",
    "ActivationFormat",
    "QuantizedActivations",
    "activation_format_for",
    "quantize_activations",
    "quantize_activations_reference",
]

F32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class ActivationFormat:
    """An 8-bit activation format: `block` values share one float32 scale d; `has_sum` (Q8_1) keeps
    s = d sum(q) per block; `sums_per` (Q8_K: 16) keeps sum(q) per that many values; `weights` are the
    weight formats (`block_formats.FORMATS` names) whose integer dot products use it."""

    name: str
    block: int
    has_sum: bool
    sums_per: int
    weights: tuple[str, ...]


ACTIVATION_FORMATS = {
    "q8_0": ActivationFormat("q8_0", 32, False, 0, ("q8_0",)),
    "q8_1": ActivationFormat("q8_1", 32, True, 0, ("q4_1", "q5_1", "q4_0", "q5_0")),
    "q8_k": ActivationFormat("q8_k", 256, False, 16, ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")),
}
"""Activation format -> its row; the pairing is ggml's `vec_dot_type` of each weight type, except that
Q4_0 and Q5_0 (ggml: Q8_0) take Q8_1, whose quants and scales are Q8_0's: their integer kernels
multiply the unsigned quants and add -8 d_w s_x or -16 d_w s_x per block (`_block_gemm_int_jit._OFFSET`)."""


def activation_format_for(weight_format: str) -> ActivationFormat | None:
    """The activation format whose integer dot products pair with `weight_format`, or None (the float
    types F32 / F16 / BF16 have none)."""
    for row in ACTIVATION_FORMATS.values():
        if weight_format in row.weights:
            return row
    return None


class QuantizedActivations(NamedTuple):
    """x `[M, K]` as 8-bit blocks: q int8 `[M, K]`; d float32 `[M, K / block]`; sums float32
    `[M, K / block]` (Q8_1: s = d sum(q)) or int32 `[M, K / 16]` (Q8_K: bsums), empty `[M, 0]` for Q8_0.
    (A NamedTuple: it is made once per product of a decode step, where a frozen dataclass's
    construction shows.)"""

    format: str
    q: npt.NDArray[np.int8]
    d: F32Array
    sums: npt.NDArray[Any]


_NOT_FINITE = "x holds a non-finite value (NaN or infinity); it has no 8-bit scale"


def _check(x: npt.NDArray[Any], fmt: str, finite: bool = True) -> ActivationFormat:
    if fmt not in ACTIVATION_FORMATS:
        raise ValueError(f"unknown activation format {fmt!r} (known: {', '.join(ACTIVATION_FORMATS)})")
    row = ACTIVATION_FORMATS[fmt]
    if x.ndim != 2 or x.dtype != np.float32 or x.shape[1] % row.block or 0 in x.shape:
        raise ValueError(
            f"x must be float32 [M, K] with M >= 1 and K a multiple of {row.block}, got {x.dtype} {x.shape}"
        )
    if finite and not np.isfinite(x).all():
        raise ValueError(_NOT_FINITE)
    return row


def _sums_shape(row: ActivationFormat, m: int, k: int) -> tuple[tuple[int, int], type]:
    if row.sums_per:
        return (m, k // row.sums_per), np.int32
    return (m, k // row.block if row.has_sum else 0), np.float32


def quantize_activations_reference(x: npt.NDArray[Any], fmt: str) -> QuantizedActivations:
    """NumPy oracle of `quantize_activations`: x float32 `[M, K]` -> its blocks of `fmt` (module
    docstring). Raises ValueError for an unknown format, a shape that is not whole blocks, or NaN/inf."""
    row = _check(x, fmt)
    m, k = x.shape
    blocks = x.reshape(m, k // row.block, row.block)  # [M, K / block, block]
    if row.sums_per:
        arg = np.argmax(np.abs(blocks), axis=2)[..., None]
        big = np.take_along_axis(blocks, arg, axis=2)[..., 0]  # the x of largest magnitude (first)
        with np.errstate(divide="ignore"):
            iscale = np.where(big != 0, np.float32(-127.0) / big, np.float32(0)).astype(np.float32)
        scaled = (blocks * iscale[..., None]).astype(np.float32)
        q = np.minimum(np.rint(scaled.astype(np.float64)), 127).astype(np.int8)  # half to even
        with np.errstate(divide="ignore"):
            d = np.where(iscale != 0, np.float32(1.0) / iscale, np.float32(0)).astype(np.float32)
        q2 = q.reshape(m, k)
        sums = q2.reshape(m, k // row.sums_per, row.sums_per).astype(np.int32).sum(axis=2, dtype=np.int32)
        return QuantizedActivations(fmt, q2, d, sums)
    amax = np.abs(blocks).max(axis=2)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0)).astype(np.float32)
    scaled = (blocks * inv[..., None]).astype(np.float32).astype(np.float64)
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8)  # half away from zero
    sums = np.zeros((m, 0), dtype=np.float32)
    if row.has_sum:
        sums = (d * q.astype(np.int32).sum(axis=2).astype(np.float32)).astype(np.float32)
    return QuantizedActivations(fmt, q.reshape(m, k), d, sums)


def quantize_activations(x: npt.NDArray[Any], fmt: str) -> QuantizedActivations:
    """x float32 `[M, K]` -> its 8-bit blocks of `fmt`, in one compiled pass over x (bit-equal to
    `quantize_activations_reference`). Raises ValueError as the reference does."""
    row = _check(x, fmt, finite=False)  # the compiled pass checks finiteness on its way
    m, k = x.shape
    q = np.empty((m, k), dtype=np.int8)
    d = np.empty((m, k // row.block), dtype=np.float32)
    shape, dtype = _sums_shape(row, m, k)
    sums = np.zeros(shape, dtype=dtype)
    xc = np.ascontiguousarray(x)
    if row.sums_per:
        finite = _quantize_q8_k(xc, q, d, sums)
    else:
        finite = _quantize_q8_0_1(xc, q, d, sums, row.block, row.has_sum)
    if not finite:
        raise ValueError(_NOT_FINITE)
    return QuantizedActivations(fmt, q, d, sums)


_JIT: dict[str, Any] = {"nogil": True, "cache": True, "boundscheck": False}
_FLOAT32_MAX = np.float32(np.finfo(np.float32).max)


@numba.njit(**_JIT)
def _quantize_q8_0_1(x, q, d, sums, block, has_sum):  # pragma: no cover (compiled)
    """ggml's `quantize_row_q8_0_ref` / `_q8_1_ref` over every row: float32 scale, roundf quants.
    Returns False (the quants then unspecified) where x holds a NaN or an infinity."""
    m, k = x.shape
    for i in range(m):
        for b in range(k // block):
            start = b * block
            amax = np.float32(0.0)
            for j in range(start, start + block):
                a = abs(x[i, j])
                if not a <= _FLOAT32_MAX:  # NaN or infinity
                    return False
                if a > amax:
                    amax = a
            scale = np.float32(amax / np.float32(127.0))
            inv = np.float32(np.float32(1.0) / scale) if scale != 0 else np.float32(0.0)
            total = 0
            for j in range(start, start + block):
                v = np.float32(x[i, j] * inv)
                r = math.floor(abs(v) + 0.5)
                qi = int(r) if v >= 0 else -int(r)
                q[i, j] = qi
                total += qi
            d[i, b] = scale
            if has_sum:
                sums[i, b] = np.float32(scale * np.float32(total))
    return True


@numba.njit(**_JIT)
def _quantize_q8_k(x, q, d, sums):  # pragma: no cover (compiled)
    """ggml's `quantize_row_q8_K_ref` over every row: signed max, iscale = -127 / max, rint, bsums.
    Returns False (the quants then unspecified) where x holds a NaN or an infinity."""
    m, k = x.shape
    for i in range(m):
        for b in range(k // 256):
            start = b * 256
            amax = np.float32(0.0)
            big = np.float32(0.0)
            for j in range(start, start + 256):
                a = abs(x[i, j])
                if not a <= _FLOAT32_MAX:  # NaN or infinity
                    return False
                if a > amax:
                    amax = a
                    big = x[i, j]
            if amax == 0:
                for j in range(start, start + 256):
                    q[i, j] = 0
                d[i, b] = 0
                continue
            iscale = np.float32(np.float32(-127.0) / big)
            for j in range(start, start + 256):
                qi = int(np.rint(np.float64(np.float32(iscale * x[i, j]))))
                q[i, j] = min(127, qi)
            for g in range(16):
                total = 0
                for j in range(start + g * 16, start + g * 16 + 16):
                    total += q[i, j]
                sums[i, (start // 16) + g] = total
            d[i, b] = np.float32(np.float32(1.0) / iscale)
    return True
