"""The small layers of a decoder as one compiled pass over each row: RMSNorm, SiLU-and-mul, rotary embedding.

vLLM's fused CPU ops in `csrc/cpu/` (`layernorm.cpp`, `activation.cpp`, `pos_encoding.cpp`). Each entry
writes into `out` and checks nothing: `model_executor.layers` (`compiled_rms_norm`, ...) allocates the
outputs and documents the formulas these passes compute; the loops are in `_fused_layers_jit`. Legend:
N rows (tokens), C features, I MLP width, D head dim; float32 or float64, `out` C-contiguous.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels import _fused_layers_jit as _jit

__all__ = ["rms_norm_rows", "rotary_rows", "silu_and_mul_rows"]

FloatArray = npt.NDArray[np.floating[Any]]


def rms_norm_rows(x: FloatArray, weight: FloatArray, eps: float, out: FloatArray) -> None:
    """out[n] = x[n] / sqrt(mean(x[n]^2) + eps) * weight: x, out `[N, C]`, weight `[C]`."""
    _jit.rms_norm_rows(x, weight, eps, out)


def silu_and_mul_rows(gate_up: FloatArray, out: FloatArray) -> None:
    """out = silu(gate) * up for gate_up = [gate | up] `[N, 2I]` -> out `[N, I]`."""
    _jit.silu_and_mul_rows(gate_up, out)


def rotary_rows(src: FloatArray, start: int, cos: FloatArray, sin: FloatArray, out: FloatArray) -> None:
    """The heads of src[n, start : start + heads * D] rotated by their position into out `[N, heads, D]`;
    cos, sin `[N, D]`."""
    _jit.rotary_rows(src, start, cos, sin, out)
