"""Linear layers over GGUF blocks with integer dot products: x quantized to 8 bits once per call.

`block_gemm.block_linear` decodes each weight block to float32 in registers for every row of x; here
x is quantized once per call to the 8-bit format paired with the weight's type (`activation_quant`:
Q8_0 beside Q8_0, Q8_1 beside Q4_0 / Q4_1 / Q5_0 / Q5_1, Q8_K beside the k-quants), and each block's
products are integers summed in int32, scaled once by d_w d_x (plus an offset term m_w s_x;
`_block_gemm_int_jit`, after ggml-cpu's `ggml_vec_dot_q4_1_q8_1`), or for the k-quants once per
super-block of 256 (`_block_gemm_kquant_int_jit`, after `ggml_vec_dot_q4_K_q8_K` and its siblings).
The result differs from the float32-activation product by the
quantization of x (half a step of d_x = max |x| / 127 per value and block); against exact int64
arithmetic on the same quants it differs only by the float32 roundings of the per-block combine.

Weight types without an integer kernel (`INT_FORMATS`' complement) keep the float32-activation path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels import _block_gemm_int_jit as _jit
from attention_kv_caceh.kernels import _block_gemm_kquant_int_jit as _kquant_jit
from attention_kv_caceh.kernels.activation_quant import (
    QuantizedActivations,
    activation_format_for,
    quantize_activations,
)
from attention_kv_caceh.kernels.block_gemm import BlockWeight
from attention_kv_caceh.kernels.threads import chunk_rows, row_split

__all__ = [
    "INT_FORMATS",
    "INT_PAIRS",
    "dot_form",
    "has_int_kernel",
    "int_linear",
    "int_linear_into",
    "int_linear_quantized",
    "int_linear_quantized_into",
]

INT_FORMATS = (*_jit.INT_FORMATS, *_kquant_jit.KQUANT_INT_FORMATS)
"""Weight formats with an integer-dot kernel: the 32-weight types (`_block_gemm_int_jit`) and the
k-quants against Q8_K (`_block_gemm_kquant_int_jit`)."""
ENTRY_POINTS = {**_jit.ENTRY_POINTS, **_kquant_jit.ENTRY_POINTS}
"""(isa, weight format) -> its compiled kernel `(x, w, y)`, x the tuple (q, d, sums)."""
INT_PAIRS = {fmt: row.name for fmt in INT_FORMATS if (row := activation_format_for(fmt)) is not None}
"""Weight format with an integer-dot kernel -> the activation format it pairs with (`activation_quant`)."""
F32Array = npt.NDArray[np.float32]
_ROW_GROUP = 4  # rows of W per chunk of the thread split, at least


def dot_form(isa: str) -> tuple[str, int]:
    """(the integer dot product compiled for `isa`: "vnni", "pmadd" or "generic"; its int32 lanes L)."""
    return _jit.host_dot(isa)


def has_int_kernel(weight: BlockWeight) -> bool:
    """Whether the weight's format and kernel variant have an integer-dot kernel."""
    return (weight.isa, weight.format) in ENTRY_POINTS


def int_linear_quantized(
    xq: QuantizedActivations, weight: BlockWeight, out: F32Array, threads: int = 1
) -> None:
    """out `[M, N]` (float32, unit-stride rows; a column slice of a wider array is fine) = x W^T from
    x's 8-bit blocks `xq` (of the format `activation_format_for(weight.format)`). threads > 1: W's
    rows split into chunks over that many of Numba's threads (`threads.row_split`); the result is
    bit-identical for every count.

    Raises ValueError for a weight without an integer kernel, or shapes that do not match."""
    if not has_int_kernel(weight):
        raise ValueError(f"no integer-dot kernel for {weight.path}")
    pair = activation_format_for(weight.format)
    m, k = xq.q.shape
    if pair is None or xq.format != pair.name or k != weight.in_features:
        raise ValueError(
            f"{weight.format} needs {pair and pair.name} activations [M, {weight.in_features}], got {xq.format} [{m}, {k}]"
        )
    if out.dtype != np.float32 or out.shape != (m, weight.out_features) or out.strides[1] != 4:
        raise ValueError(
            f"out must be float32 [{m}, {weight.out_features}] with unit-stride rows, got {out.dtype} {out.shape}"
        )
    int_linear_quantized_into(xq, weight, out, threads)


def int_linear_quantized_into(
    xq: QuantizedActivations, weight: BlockWeight, out: F32Array, threads: int = 1
) -> None:
    """The hot path of `int_linear_quantized`: no checks (a mismatch reads or writes out of bounds)."""
    sums = xq.sums if xq.sums.shape[1] else xq.d  # Q8_0: s is never read
    kernel = ENTRY_POINTS[(weight.isa, weight.format)]
    rows = weight.blocks.shape[0]
    if threads == 1 or rows <= _ROW_GROUP:
        kernel((xq.q, xq.d, sums), weight.blocks, out)
        return
    row_split(kernel)(
        (xq.q, xq.d, sums), weight.blocks, out, chunk_rows(rows, threads, _ROW_GROUP), 1, threads
    )


def int_linear_into(x: F32Array, weight: BlockWeight, out: F32Array, threads: int = 1) -> None:
    """out = x W^T with x (float32 `[M, K]`) quantized to 8 bits first; raises as the above and as
    `activation_quant.quantize_activations`."""
    pair = activation_format_for(weight.format)
    if pair is None:
        raise ValueError(f"no integer-dot kernel for {weight.path}")
    int_linear_quantized(quantize_activations(x, pair.name), weight, out, threads)


def int_linear(x: npt.NDArray[Any], weight: BlockWeight) -> F32Array:
    """y = x W^T: x `[M, K]` float32 -> `[M, N]` float32 by integer dot products (module docstring)."""
    out = np.empty((x.shape[0], weight.out_features), dtype=np.float32)
    int_linear_into(x, weight, out)
    return out
