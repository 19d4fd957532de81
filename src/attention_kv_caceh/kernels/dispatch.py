"""Which kernel serves a weight format on this CPU, and the names of the formats, dtypes and quantizations.

vLLM keeps the `--dtype` and `--quantization` words in `vllm/config/` and picks a CPU kernel per ISA in
`csrc/cpu/`; here the words are written once, in this module, and the engine's config (its flag choices),
the model and the layers read them. Nothing here imports Numba.

- engine dtypes (`--dtype`): "float32" and "float64" keep weights, activations and KV cache in that dtype;
  "bfloat16" keeps the linear layers' weights in bfloat16 and computes in float32.
- quantizations (`--quantization`): a GGUF block format (`block_formats`) the linear layers' weights are
  kept in, a float checkpoint quantized at load; or "gguf", a GGUF file's own block tensors as stored.
- weight formats: how a linear layer's weights are stored, "float32", "bfloat16" or a block format.
- GEMM paths: "packed", the compiled kernels (`gemm` for float32 and bfloat16 panels, `block_gemm` for
  GGUF blocks); "numpy", `x @ W.T` on the floats the format decodes to, the packed path's oracle.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attention_kv_caceh.kernels.block_formats import BLOCK_FORMATS, QUANTIZED_FORMATS
from attention_kv_caceh.kernels.isa import compiled_variant

__all__ = [
    "ACTIVATION_CHOICES",
    "BLOCK_FORMATS",
    "ENGINE_DTYPES",
    "GEMM_CHOICES",
    "GEMM_PATHS",
    "GGUF",
    "QUANTIZATIONS",
    "WEIGHT_DTYPES",
    "WEIGHT_FORMATS",
    "GemmPath",
    "check_activations",
    "compute_dtype",
    "resolve_gemm_path",
    "weight_format",
]

ENGINE_DTYPES = ("float32", "float64", "bfloat16")
"""vLLM's `--dtype` words (module docstring)."""
WEIGHT_DTYPES = ("float32", "bfloat16")
"""The float weight formats the packed GEMM kernels (`gemm`) hold."""
GGUF = "gguf"
"""The quantization that keeps a GGUF file's own blocks."""
QUANTIZATIONS = (*QUANTIZED_FORMATS, GGUF)
"""`quantization` values (vLLM's `--quantization`, module docstring): the block formats the `gguf`
library can quantize a float checkpoint to, or "gguf" (every type of `block_formats`, as stored)."""
WEIGHT_FORMATS = (*WEIGHT_DTYPES, *QUANTIZED_FORMATS)
"""How a float weight can be stored at load: float32, bfloat16 (the top half of each float32), or one of
GGUF's quantized block formats. A GGUF file's tensors keep their own type (`block_formats.BLOCK_FORMATS`)."""
GEMM_PATHS = ("packed", "numpy")
"""How `layers.linear` multiplies (module docstring)."""
GEMM_CHOICES = ("auto", *GEMM_PATHS)
"""The `gemm` setting: a GEMM path, or "auto" (`resolve_gemm_path`)."""
ACTIVATION_CHOICES = ("int8", "float32")
"""The `activations` setting of a linear layer over GGUF blocks that have an integer-dot kernel:
"int8" (x quantized to 8 bits per block of 32 once per product, integer dot products:
`block_gemm_int`; llama.cpp's way), or "float32" (each weight decoded to float32 for every row of x:
`block_gemm`; the default, and the oracle). Each row of x is quantized on its own, so either way a row's result does
not depend on the other rows of its step."""


def check_activations(activations: str | None) -> str:
    """`activations` if it is one of ACTIVATION_CHOICES, "float32" for None (the default); ValueError
    naming it otherwise."""
    if activations is None:
        return "float32"
    if activations not in ACTIVATION_CHOICES:
        raise ValueError(f"activations must be one of {ACTIVATION_CHOICES}, got {activations!r}")
    return activations


def compute_dtype(dtype: str) -> np.dtype[Any]:
    """The dtype activations, sums and the KV cache have for engine `dtype` (bfloat16 -> float32).
    Raises ValueError for a dtype outside ENGINE_DTYPES."""
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"dtype must be one of {ENGINE_DTYPES}, got {dtype!r}")
    return np.dtype(np.float32 if dtype == "bfloat16" else dtype)


def weight_format(dtype: str, quantization: str | None) -> str:
    """How the linear layers store their weights: the quantization's block format, else the dtype.
    Raises ValueError for an unknown dtype or quantization, or a quantization with bfloat16."""
    compute_dtype(dtype)
    if quantization is None:
        return dtype
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    if dtype == "bfloat16":
        raise ValueError(
            f"quantization {quantization!r} keeps its own block format: use dtype float32, not bfloat16"
        )
    return quantization


class GemmPath(NamedTuple):
    """What `resolve_gemm_path` chose: the GEMM path ("packed" or "numpy"), a one-line note naming the
    kernel variant, and the weight format (`weight_format`) the linear layers keep."""

    path: str
    note: str
    weight_format: str


def resolve_gemm_path(gemm: str, dtype: str, quantization: str | None = None) -> GemmPath:
    """The GEMM path for `gemm` ("auto", "packed" or "numpy"), engine `dtype` and `quantization`, a
    one-line note naming the kernel variant (`isa.compiled_variant`), and the weight format.

    "auto" takes "packed" where a kernel variant exists for the CPU Numba compiles for and the activations
    are float32 (dtype float32 or bfloat16), "numpy" otherwise: float64, a CPU without AVX2, AVX-512
    or NEON, or asked for; the numpy path multiplies by the floats the weight format decodes to.
    Raises ValueError for a `gemm` outside GEMM_CHOICES, an unknown dtype or quantization (as
    `weight_format`), or "packed" with float64 or without a kernel variant.
    """
    if gemm not in GEMM_CHOICES:
        raise ValueError(f"gemm must be one of {GEMM_CHOICES}, got {gemm!r}")
    fmt = weight_format(dtype, quantization)
    float32 = compute_dtype(dtype) == np.float32
    if gemm == "packed" and not float32:
        raise ValueError(
            f"the packed GEMM path needs float32 activations (dtype float32 or bfloat16), got {dtype!r}"
        )
    simd = compiled_variant()
    if gemm == "packed" and simd is None:
        raise ValueError("the packed GEMM path has no kernel for this CPU (no AVX2, AVX-512 or NEON variant)")
    if gemm == "numpy" or not float32 or simd is None:
        why = (
            "asked for" if gemm == "numpy" else (dtype if not float32 else "no AVX2, AVX-512 or NEON variant")
        )
        return GemmPath(
            "numpy",
            f"GEMM path: numpy (x @ W.T on {fmt} weights decoded to {compute_dtype(dtype)}; {why})",
            fmt,
        )
    how = "GGUF blocks dequantized in registers" if fmt in BLOCK_FORMATS else f"{fmt} panels packed at load"
    if fmt == GGUF:
        how = "the file's tensors as stored, each type decoded in registers"
    if fmt == "bfloat16":
        how += ", vdpbf16ps" if simd.bf16_dot else ", widened in registers"
    return GemmPath("packed", f"GEMM path: packed {simd.isa} {fmt} ({how}; {simd.describe()})", fmt)
