"""The small layers of a Llama-family decoder in NumPy: RMSNorm, rotary position embedding, SwiGLU, linear.

What vLLM keeps in `model_executor/layers/` (layernorm.py, rotary_embedding.py, activation.py, and the
unquantised GEMM of linear.py): each function is the formula, written on one or two array expressions;
the linear layer's weights are packed once at load for the compiled kernels of `attention_kv_caceh.kernels.gemm`
(float32 or bfloat16 panels; vLLM's CPU backend likewise packs weights for oneDNN at load) or kept as
GGUF blocks for `attention_kv_caceh.kernels.block_gemm` (every type of `block_formats`: Q4_0 to Q8_0,
the k-quants, F16, BF16, F32; a fused layer's parts each in its own type). `compiled_rms_norm`,
`compiled_silu_and_mul` and `compiled_rotary` are the same formulas as one compiled pass over each row
(`kernels.fused_layers`, Numba; vLLM's fused CPU ops in `csrc/cpu/`): NumPy evaluates each formula as several
passes with temporaries, which at a decode batch costs more than the arithmetic. The NumPy functions
are their oracles.

Shape legend (as in `attention_kv_caceh.attention`): N tokens of a flattened batch, H query heads,
H_kv key/value heads, D head dim, D_model the model width, I the MLP width.

Gemma's GeGLU (`gelu_tanh_and_mul`, vLLM's `GeluAndMul(approximate="tanh")`) and logit soft-capping
(`softcap`) are NumPy only (no compiled pass).

Left out: the tensor-parallel linear classes (column / row parallel, their weight loaders), quantized linear
methods other than GGUF blocks (AWQ, GPTQ, FP8), RoPE variants other than plain, linear and llama3 (YaRN,
dynamic NTK, LongRoPE, multimodal RoPE), LayerNorm and other activations (exact GELU, ...), and the
vocabulary-parallel embedding and logits processor.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels import fused_layers
from attention_kv_caceh.kernels.activation_quant import (
    QuantizedActivations,
    quantize_activations,
)
from attention_kv_caceh.kernels.block_formats import BLOCK_FORMATS, dequantize_blocks, quantize_weight
from attention_kv_caceh.kernels.block_gemm import BlockWeight, block_linear_into, block_weight
from attention_kv_caceh.kernels.block_gemm_int import INT_PAIRS, int_linear_quantized_into
from attention_kv_caceh.kernels.dispatch import GEMM_PATHS, WEIGHT_FORMATS
from attention_kv_caceh.kernels.gemm import (
    PackedWeight,
    bfloat16_bits,
    bfloat16_to_float32,
    pack_weight,
    packed_linear_into,
    unpack_weight,
)

__all__ = [
    "LinearWeight",
    "apply_rotary",
    "compiled_rms_norm",
    "compiled_rotary",
    "compiled_silu_and_mul",
    "gelu_tanh_and_mul",
    "linear",
    "prepare_compiled_layers",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "silu_and_mul",
    "softcap",
]

FloatArray = npt.NDArray[np.floating[Any]]


def rms_norm(x: FloatArray, weight: FloatArray, eps: float) -> FloatArray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich, 2019).

    x `[..., C]`, weight `[C]`; the result has x's shape and dtype. Computed in x's dtype, as
    Hugging Face's LlamaRMSNorm does for float32 inputs. The mean of squares is a dot product
    (`np.vecdot`) divided by C, which is faster than `np.mean(x * x)` at decode sizes.
    """
    variance = np.vecdot(x, x)[..., None] / x.dtype.type(x.shape[-1])  # [..., 1], mean of squares
    return x / np.sqrt(variance + x.dtype.type(eps)) * weight


@dataclass(frozen=True)
class LinearWeight:
    """The weight W `[C_out, C_in]` of a bias-free linear layer, stored for one of `dispatch.GEMM_PATHS`.

    Exactly one of four is set; build with `LinearWeight.of`, `LinearWeight.from_blocks` or
    `LinearWeight.from_parts`: `weight`, the "numpy" path: W itself as floats, Hugging Face's `[out, in]`
    layout (for a compact format, the values that format decodes to); `packed`, the "packed" path for
    float32 or bfloat16 (`gemm.PackedWeight`); `blocks`, the "packed" path for a GGUF block format
    (`block_gemm.BlockWeight`); `stacked`, the "packed" path for a fused layer whose row-stacked parts
    a GGUF file stores in different types (one `BlockWeight` each, rows in order).
    format: one of `dispatch.WEIGHT_FORMATS` (float64 when a float64 numpy weight is kept as it is), or
    the parts' formats joined by "+" ("q4_k+q6_k") for a stacked or decoded mixed weight.
    """

    weight: FloatArray | None
    packed: PackedWeight | None
    blocks: BlockWeight | None = None
    format: str = "float32"
    stacked: tuple[BlockWeight, ...] = ()

    @classmethod
    def of(cls, weight: FloatArray, path: str, fmt: str = "float32") -> LinearWeight:
        """W `[C_out, C_in]` (floats) for `path`, stored as `fmt` (bfloat16 rounds to nearest even, a
        block format quantizes with `block_formats.quantize_weight`). "packed" copies W into the kernel's
        layout; "numpy" keeps W (float32 format) or the floats `fmt` decodes to, in W's dtype.

        Raises ValueError for a path outside GEMM_PATHS, a format outside WEIGHT_FORMATS, (packed) a
        float32 weight that is not float32, or (block formats) C_in not a multiple of 32.
        """
        if path not in GEMM_PATHS:
            raise ValueError(f"GEMM path must be one of {GEMM_PATHS}, got {path!r}")
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
        if fmt in BLOCK_FORMATS:
            return cls.from_blocks(quantize_weight(weight, fmt), fmt, path, weight.dtype)
        if path == "packed":
            return cls(None, pack_weight(weight, fmt), None, fmt)
        if fmt == "bfloat16":
            return cls(bfloat16_to_float32(bfloat16_bits(weight)).astype(weight.dtype), None, None, fmt)
        return cls(weight, None, None, "float64" if weight.dtype == np.float64 else fmt)

    @classmethod
    def from_blocks(
        cls, blocks: npt.NDArray[np.uint8], fmt: str, path: str, dtype: npt.DTypeLike = np.float32
    ) -> LinearWeight:
        """W from its GGUF blocks uint8 `[C_out, C_in / 32 * block bytes]` (as a GGUF file stores them):
        kept as they are for "packed", decoded (`block_formats.dequantize_blocks`) to `dtype` for "numpy".
        Raises ValueError as `block_gemm.block_weight` does, or for a path outside GEMM_PATHS."""
        if path == "packed":
            return cls(None, None, block_weight(blocks, fmt), fmt)
        if path != "numpy":
            raise ValueError(f"GEMM path must be one of {GEMM_PATHS}, got {path!r}")
        return cls(dequantize_blocks(blocks, fmt).astype(dtype), None, None, fmt)

    @classmethod
    def from_parts(
        cls, parts: list[tuple[npt.NDArray[np.uint8], str]], path: str, dtype: npt.DTypeLike = np.float32
    ) -> LinearWeight:
        """W the row-stacked parts, each GGUF blocks uint8 `[C_out_i, C_in / block * bytes]` of its own
        format (as a GGUF file stores a fused layer's tensors): one `BlockWeight` per run of
        consecutive parts of one format for "packed", the parts decoded and stacked for "numpy".
        Raises ValueError as `from_blocks`, or for parts of different input widths."""
        formats = "+".join(dict.fromkeys(fmt for _, fmt in parts))
        runs: list[tuple[list[npt.NDArray[np.uint8]], str]] = []
        for blocks, fmt in parts:
            if runs and runs[-1][1] == fmt:
                runs[-1][0].append(blocks)
            else:
                runs.append(([blocks], fmt))
        weights = [cls.from_blocks(np.concatenate(run), fmt, path, dtype) for run, fmt in runs]
        if len({w.shape[1] for w in weights}) != 1:
            raise ValueError(f"parts of a stacked weight must share C_in, got {[w.shape for w in weights]}")
        if path == "numpy":
            return cls(np.concatenate([w.dense() for w in weights]).astype(dtype), None, None, formats)
        return cls(None, None, None, formats, tuple(w.blocks for w in weights if w.blocks is not None))

    @property
    def shape(self) -> tuple[int, int]:
        """(C_out, C_in)."""
        if self.stacked:
            return sum(p.out_features for p in self.stacked), self.stacked[0].in_features
        if self.packed is not None:
            return self.packed.out_features, self.packed.in_features
        if self.blocks is not None:
            return self.blocks.out_features, self.blocks.in_features
        assert self.weight is not None
        return self.weight.shape[0], self.weight.shape[1]

    @property
    def size(self) -> int:
        """C_out * C_in: the parameters (packed padding not counted)."""
        c_out, c_in = self.shape
        return c_out * c_in

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: the stored weights (panels with their padding, or blocks)."""
        if self.stacked:
            return sum(p.nbytes for p in self.stacked)
        for stored in (self.packed, self.blocks, self.weight):
            if stored is not None:
                return int(stored.nbytes)
        raise AssertionError("LinearWeight holds no weight")

    @property
    def kernel(self) -> str:
        """What multiplies by it, e.g. "avx2 float32", "avx512 q4_1", "avx2 q4_k + avx2 q6_k", "numpy float64"."""
        if self.stacked:
            return " + ".join(dict.fromkeys(p.path for p in self.stacked))
        if self.packed is not None:
            return self.packed.path
        if self.blocks is not None:
            return self.blocks.path
        return f"numpy {self.format}"

    def dense(self) -> FloatArray:
        """W `[C_out, C_in]` as floats (a decoded copy for the packed path, for oracles)."""
        if self.stacked:
            return np.concatenate([dequantize_blocks(p.blocks, p.format) for p in self.stacked])
        if self.packed is not None:
            return unpack_weight(self.packed)
        if self.blocks is not None:
            return dequantize_blocks(self.blocks.blocks, self.blocks.format)
        assert self.weight is not None
        return self.weight


def linear(x: FloatArray, weight: LinearWeight, threads: int = 1, activations: str = "float32") -> FloatArray:
    """A bias-free linear layer, x @ W^T: x `[N, C_in]` -> `[N, C_out]` in x's dtype.

    The packed path (`gemm.packed_linear_into` or `block_gemm.block_linear_into`, no checks: x must be
    float32 `[N, C_in]`) reads each weight once for all N rows; the numpy path is `x @ W.T`. Both
    compute the same sums over the same weights and may differ in the last bits (summation order;
    bfloat16 panels on a CPU with `vdpbf16ps` also round x to bfloat16). threads: the packed path's
    output rows split over that many of Numba's threads (`kernels.threads`; bit-identical results).
    activations (`dispatch.ACTIVATION_CHOICES`): "int8": GGUF blocks with an integer kernel
    (`block_gemm_int.INT_PAIRS`) take x quantized to 8 bits once per call and activation format
    (`block_gemm_int.int_linear_quantized_into`), which adds x's rounding to 8 bits (half a step of
    max |x| / 127 per block of 32) to the result.
    """
    packed, blocks = weight.packed, weight.blocks
    if blocks is not None or weight.stacked:  # each part's kernel into its own buffer (C-contiguous)
        x = np.ascontiguousarray(x)
        parts = weight.stacked or ((blocks,) if blocks is not None else ())
        outs = [np.empty((x.shape[0], part.out_features), dtype=np.float32) for part in parts]  # [N, C_out_i]
        quantized: dict[str, QuantizedActivations] = {}  # x's 8-bit blocks per activation format, made once
        for part, part_out in zip(parts, outs, strict=True):
            pair = INT_PAIRS.get(part.format) if activations == "int8" else None
            if pair is None:
                block_linear_into(x, part, part_out, threads)
                continue
            if pair not in quantized:
                quantized[pair] = quantize_activations(x, pair)
            int_linear_quantized_into(quantized[pair], part, part_out, threads)
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)  # [N, C_out]
    if packed is None:
        assert weight.weight is not None
        return x @ weight.weight.T  # [N, C_out]
    out = np.empty((x.shape[0], packed.padded_out_features), dtype=np.float32)  # [N, C_out padded]
    packed_linear_into(np.ascontiguousarray(x), packed, out, threads)
    return out if packed.padded_out_features == packed.out_features else out[:, : packed.out_features]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, float] | None = None) -> FloatArray:
    """Inverse frequencies of rotary embedding, float64 `[D/2]`: theta^(-2i/D) for i in 0 .. D/2-1.

    Su et al. (2021), RoFormer, eq. 15. `scaling` is None, {"factor": f} (linear scaling, Hugging Face's
    `_compute_linear_scaling_rope_parameters`: every frequency divided by f), or the "llama3" parameters (`factor`,
    `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`) of Hugging Face's
    `_compute_llama3_parameters`: wavelengths longer than original/low_freq_factor are divided by
    `factor`, those shorter than original/high_freq_factor are kept, and the band between is blended
    linearly in original/wavelength.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    if scaling is None:
        return inv_freq
    if set(scaling) == {"factor"}:  # linear
        return inv_freq / scaling["factor"]
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


def gelu_tanh_and_mul(gate_up: FloatArray) -> FloatArray:
    """GeGLU's gating (Shazeer, 2020) with the tanh GELU (Hendrycks & Gimpel, 2016; PyTorch's
    `gelu(approximate="tanh")`, transformers' "gelu_pytorch_tanh"): gelu(gate) * up, gate_up = [gate | up]
    `[N, 2I]` -> `[N, I]`, with gelu(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))).
    """
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]  # [N, I] each
    t = gate.dtype.type
    inner = t(math.sqrt(2.0 / math.pi)) * (gate + t(0.044715) * gate * gate * gate)
    return t(0.5) * gate * (t(1.0) + np.tanh(inner)) * up  # [N, I]


def softcap(x: FloatArray, cap: float) -> FloatArray:
    """Logit soft-capping (Gemma 2): cap * tanh(x / cap), in x's dtype, bounded by +-cap."""
    c = x.dtype.type(cap)
    return c * np.tanh(x / c)


def compiled_rms_norm(x: FloatArray, weight: FloatArray, eps: float) -> FloatArray:
    """`rms_norm` for x `[N, C]` (float32 or float64; any strides, C-contiguous rows vectorise), one
    compiled pass per row.

    The mean of squares and the reciprocal square root are taken in float64, then each output is
    rounded once to x's dtype, so it agrees with `rms_norm` to about one unit in the last place.
    """
    out = np.empty_like(x)  # [N, C]
    fused_layers.rms_norm_rows(x, weight, eps, out)
    return out


def compiled_silu_and_mul(gate_up: FloatArray) -> FloatArray:
    """`silu_and_mul` for gate_up `[N, 2I]` (any strides, as `linear` may return a view) -> `[N, I]`,
    one compiled pass per row.

    sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (never overflows); float32
    uses a vectorised exp of about one ulp (`kernels._math_jit.exp_f32`), so it agrees with `silu_and_mul`
    (which uses tanh) to a few units in the last place.
    """
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)  # [N, I]
    fused_layers.silu_and_mul_rows(gate_up, out)
    return out


def compiled_rotary(src: FloatArray, start: int, heads: int, cos: FloatArray, sin: FloatArray) -> FloatArray:
    """`apply_rotary` of the heads stored in columns start .. start + heads D of src `[N, W]` (q or k
    inside the fused qkv projection's output; any strides), into a new C-contiguous `[N, heads, D]`.

    cos and sin `[N, D]` as `rope_cos_sin` gives them. The same products and sums as `apply_rotary`.
    """
    d = cos.shape[1]
    out = np.empty((src.shape[0], heads, d), dtype=src.dtype)  # [N, heads, D]
    fused_layers.rotary_rows(src, start, cos, sin, out)
    return out


def prepare_compiled_layers(dtype: np.dtype[Any]) -> float:
    """Compile (or load from Numba's disk cache) the compiled layers for `dtype` now; returns seconds."""
    start = time.perf_counter()
    x = cast(FloatArray, np.ones((1, 4), dtype=dtype))  # [1, C]
    compiled_rms_norm(x, x[0], 1e-6)
    compiled_silu_and_mul(x)
    compiled_rotary(x, 0, 1, x, x)
    return time.perf_counter() - start
