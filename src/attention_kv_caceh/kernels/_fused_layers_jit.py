"""The Numba-compiled loops behind `fused_layers` (the model's compiled small layers); import `fused_layers`.

Each loop is one of `model_executor.layers`' NumPy formulas, fused into one pass over its rows so that no
temporary array is written (NumPy evaluates `x / sqrt(mean(x^2) + eps) * w` as five passes with four
temporaries). No argument checks: `model_executor.layers` documents the shapes and the model passes them
right. Legend as there: N rows (tokens), C features, I MLP width, D head dim.
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

import math

import numba
import numpy as np

from attention_kv_caceh.kernels._math_jit import exp_nonpositive

__all__: list[str] = []

# Reassociation lets LLVM vectorise the sums over a row; no nnan/ninf (inputs may hold either).
_JIT = {
    "nogil": True,
    "cache": True,
    "fastmath": {"reassoc", "contract", "nsz", "arcp"},
    "error_model": "numpy",
    "boundscheck": False,
}


@numba.njit(**_JIT)
def rms_norm_rows(x, weight, eps, out):
    """out[n] = x[n] / sqrt(mean(x[n]^2) + eps) * weight: x, out `[N, C]`, weight `[C]`.

    The mean of squares and 1 / sqrt are float64 (rounded once into out's dtype).
    """
    n_rows, c_count = x.shape
    for n in range(n_rows):
        row = x[n]
        total = 0.0  # the mean of squares in float64
        for c in range(c_count):
            total += row[c] * row[c]
        inv = 1 / math.sqrt(total / c_count + eps)
        dst = out[n]
        for c in range(c_count):
            dst[c] = row[c] * inv * weight[c]


@numba.njit(**_JIT)
def silu_and_mul_rows(gate_up, out):
    """out = silu(gate) * up for gate_up = [gate | up] `[N, 2I]` -> out `[N, I]`.

    silu(g) = g * sigmoid(g) with sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, where
    e = exp(-|g|) <= 1, so no exp overflows (float32: `_math_jit.exp_f32`, about 1 ulp).
    """
    n_rows, inter = out.shape
    for n in range(n_rows):
        gate = gate_up[n, :inter]
        up = gate_up[n, inter:]
        dst = out[n]
        one = np.float32(1.0)  # stays float32 with float32 inputs (an int literal would promote to float64)
        for i in range(inter):
            g = gate[i]
            e = exp_nonpositive(-abs(g))
            dst[i] = g * (one if g >= 0 else e) / (one + e) * up[i]


@numba.njit(**_JIT)
def rotary_rows(src, start, cos, sin, out):
    """Rotate heads of rows src[n, start : start + heads * D] by their position into out `[N, heads, D]`.

    out[n, h] = x * cos[n] + rotate_half(x) * sin[n] for x = src[n, start + h D : start + (h + 1) D],
    rotate_half(x) = cat(-x[D/2:], x[:D/2]) (Hugging Face's layout). src `[N, W]`, cos and sin `[N, D]`,
    out C-contiguous.
    """
    n_rows, heads, d_count = out.shape
    half = d_count // 2
    for n in range(n_rows):
        c_row = cos[n]
        s_row = sin[n]
        for h in range(heads):
            lo = src[n, start + h * d_count : start + h * d_count + half]  # x[:D/2]
            hi = src[n, start + h * d_count + half : start + (h + 1) * d_count]  # x[D/2:]
            dst_lo = out[n, h, :half]
            dst_hi = out[n, h, half:]
            for i in range(half):
                dst_lo[i] = lo[i] * c_row[i] - hi[i] * s_row[i]
                dst_hi[i] = hi[i] * c_row[half + i] + lo[i] * s_row[half + i]
