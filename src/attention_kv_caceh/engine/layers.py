"""The small layers of a Llama-family decoder in NumPy: RMSNorm, rotary position embedding, SwiGLU.

What vLLM keeps in `model_executor/layers/` (layernorm.py, rotary_embedding.py, activation.py), without
fused kernels: each function is the formula, written on one or two array expressions.

Shape legend (as in `attention_kv_caceh.attention`): N tokens of a flattened batch, H query heads,
H_kv key/value heads, D head dim, D_model the model width, I the MLP width.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "MATVEC_MAX_ROWS",
    "apply_rotary",
    "linear",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "silu_and_mul",
]

FloatArray = npt.NDArray[np.floating[Any]]

# Up to this many rows, `linear` computes dot products row by row of W instead of calling GEMM.
# Measured on the `small` preset's weights (all 12 layers' qkv/o/gate_up/down plus the LM head, 400 MB
# float32; OpenBLAS 0.3.31, one thread, 2 cores shared with other jobs, so each pair below was timed
# alternately in one process, median of 3-9): row-wise vs x @ W.T vs a np.dot read probe over the
# same bytes, in ms: N=1 22.5 / 27.1 / 22.1; N=2 34 / 82; N=3 27 / 89; N=4 29-32 / 39-47;
# N=5 30 / 48-53; N=6 45-69 / 51-129; N=8 96-100 / 99-121; N=10 143-177 / 119-140; N=16 169-266 /
# 81-156. GEMM with a few rows packs (copies) W before computing, so it reads the weights several
# times; the row-wise products read each weight row once but cost one short dot call per row and
# input row, which dominates past N of about 8.
MATVEC_MAX_ROWS = 6


def rms_norm(x: FloatArray, weight: FloatArray, eps: float) -> FloatArray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich, 2019).

    x `[..., C]`, weight `[C]`; the result has x's shape and dtype. Computed in x's dtype, as
    Hugging Face's LlamaRMSNorm does for float32 inputs. The mean of squares is a dot product
    (`np.vecdot`) divided by C: half the time of `np.mean(x * x)` for one decode row (11 vs 22 us).
    """
    variance = np.vecdot(x, x)[..., None] / x.dtype.type(x.shape[-1])  # [..., 1], mean of squares
    return x / np.sqrt(variance + x.dtype.type(eps)) * weight


def linear(x: FloatArray, weight: FloatArray) -> FloatArray:
    """A bias-free linear layer, x @ weight^T: x `[N, C_in]`, weight `[C_out, C_in]` -> `[N, C_out]`.

    Weight keeps the Hugging Face `[out, in]` layout. For N <= MATVEC_MAX_ROWS (the decode of a few
    sequences) each output is a dot product of a weight row with a row of x (`np.vecdot`, one pass over
    the weight at about the read-probe rate); above it, one GEMM (`x @ weight.T`), which wins once the
    arithmetic per weight byte grows (see MATVEC_MAX_ROWS for the measurements). Both compute the same
    sums in x's dtype; they may differ in the last bits (summation order).
    """
    if x.shape[0] <= MATVEC_MAX_ROWS:
        # [C_out, 1, C_in] . [1, N, C_in] -> [C_out, N]: a weight row is reused while it is in cache.
        # Both operands need unit-stride rows (a strided x makes every dot call ~3x slower).
        rows = np.ascontiguousarray(x)[None, :, :]  # [1, N, C_in]
        return np.ascontiguousarray(np.vecdot(weight[:, None, :], rows).T)  # [N, C_out]
    return x @ weight.T  # [N, C_out]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, float] | None = None) -> FloatArray:
    """Inverse frequencies of rotary embedding, float64 `[D/2]`: theta^(-2i/D) for i in 0 .. D/2-1.

    Su et al. (2021), RoFormer, eq. 15. `scaling` is None, or the "llama3" parameters (`factor`,
    `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`) of Hugging Face's
    `_compute_llama3_parameters`: wavelengths longer than original/low_freq_factor are divided by
    `factor`, those shorter than original/high_freq_factor are kept, and the band between is blended
    linearly in original/wavelength.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)  # 0 at the low-frequency edge, 1 at the high one
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, blended, scaled)  # [D/2]


def rope_cos_sin(
    positions: npt.NDArray[np.integer[Any]], inv_freq: FloatArray, dtype: Any
) -> tuple[FloatArray, FloatArray]:
    """cos and sin tables `[N, D]` for token positions `[N]`, in `dtype`.

    Angles are position * inv_freq, computed in float64 and then cast; the D/2 frequencies are repeated
    twice along the last axis (Hugging Face's `cat((freqs, freqs))` layout that `rotate_half` expects).
    """
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [N, D/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [N, D]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply_rotary(x: FloatArray, cos: FloatArray, sin: FloatArray) -> FloatArray:
    """Rotate query or key heads by their token's position: x * cos + rotate_half(x) * sin.

    x `[N, heads, D]`, cos and sin `[N, D]` -> `[N, heads, D]`. rotate_half(x) = cat(-x2, x1) for the
    halves x1 = x[..., :D/2], x2 = x[..., D/2:] (Hugging Face's convention: dimension i pairs with
    i + D/2, not with its neighbour as in the RoFormer paper; both are the same rotation up to a
    permutation of the projection's output rows).
    """
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [N, heads, D]
    return x * cos[:, None, :] + rotated * sin[:, None, :]  # [N, heads, D]


def silu_and_mul(gate_up: FloatArray) -> FloatArray:
    """SwiGLU's gating (Shazeer, 2020): silu(gate) * up, with gate_up = [gate | up] `[N, 2I]` -> `[N, I]`.

    silu(g) = g * sigmoid(g), with sigmoid(g) = (1 + tanh(g / 2)) / 2, which cannot overflow.
    """
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]  # [N, I] each
    half = gate.dtype.type(0.5)
    return gate * (half + half * np.tanh(half * gate)) * up  # [N, I]
