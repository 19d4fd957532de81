"""Linear layers over GGUF's block-quantized weights (Q8_0, Q4_0, Q4_1), kept as the file stores them.

A decode step reads every weight once, so at a batch of a few sequences its time is the weights' bytes
over the read rate. float32 weights cost 4 bytes each; GGUF's blocks cost 34 / 32 (Q8_0), 18 / 32
(Q4_0) and 20 / 32 (Q4_1) bytes: 32 weights share a float16 scale d (and, Q4_1, an offset m) and
keep 8 or 4 bits each. llama.cpp reads its GGUF files this way; here the kernel of `_block_gemm_jit`
dequantizes each block in registers inside its inner loop (activations and sums stay float32), so the
weights stay in memory exactly as the GGUF holds them: `BlockWeight.blocks` is ggml's row-major block
array as uint8 `[N, K / 32 * block bytes]`, the bytes of the file's tensor data.

Oracles. `dequantize_blocks` decodes blocks in float64, written from ggml's block definitions (table in
`_block_gemm_jit`); the tests check it against the `gguf` library's `gguf.quants.dequantize`, and the
kernel against NumPy's float64 product of x and the decoded weights (the same weights, so a float32
tolerance applies). How far a block is from the weights it was made from is bounded by the format's
step (`step_bound`): the difference between a weight and its decoded value is at most half a step
(Q8_0: d / 2 with d = max |w| / 127; Q4_1: d / 2 with d = (max - min) / 15; Q4_0: d = -w* / 8 for
the weight w* of largest magnitude, which sits at q = 0 exactly, the others within d / 2 but one of
the opposite sign and equal magnitude is clamped to q = 15, a whole step away) plus float16 rounding
of d and m, so a product x . w moves by at most sum_k |x_k| times that bound at k.

Quantizing a float weight (`quantize_weight`) uses the `gguf` library's reference quantizers (the
same round-to-nearest as ggml's `quantize_row_*_ref`), for checkpoints stored in float and for tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels import _block_gemm_jit as _jit
from attention_kv_caceh.kernels.isa import SimdVariant, compiled_variant

__all__ = [
    "BLOCK_FORMATS",
    "BlockWeight",
    "block_linear",
    "block_linear_into",
    "block_weight",
    "dequantize_blocks",
    "prepare_block_linear",
    "quantize_weight",
    "step_bound",
]

BLOCK_FORMATS: tuple[str, ...] = tuple(_jit.FORMATS)
"""llama.cpp's type names, lower case: "q8_0", "q4_0", "q4_1"."""
BLOCK = _jit.BLOCK
F32Array = npt.NDArray[np.float32]
U8Array = npt.NDArray[np.uint8]


def _check_format(fmt: str) -> int:
    if fmt not in _jit.FORMATS:
        raise ValueError(f"block format must be one of {BLOCK_FORMATS}, got {fmt!r}")
    return _jit.FORMATS[fmt]


@dataclass(frozen=True)
class BlockWeight:
    """A weight `[N, K]` as ggml blocks of one format, for the kernel variant `isa`.

    blocks: uint8 `[N, K / 32 * block bytes]`, C-contiguous (row n holds W[n]'s K / 32 blocks).
    """

    blocks: U8Array
    format: str
    isa: str

    @property
    def out_features(self) -> int:
        """N."""
        return int(self.blocks.shape[0])

    @property
    def in_features(self) -> int:
        """K."""
        return int(self.blocks.shape[1]) // _jit.FORMATS[self.format] * BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks: what one call reads from memory."""
        return int(self.blocks.nbytes)

    @property
    def path(self) -> str:
        """The kernel's name for notes, e.g. "avx2 q4_1"."""
        return f"{self.isa} {self.format}"


def block_weight(blocks: npt.NDArray[Any], fmt: str, variant: SimdVariant | None = None) -> BlockWeight:
    """Wrap ggml blocks (uint8 `[N, K / 32 * block bytes]`, or the flat bytes of N rows reshaped so)
    for the kernel `variant` (default `simd.compiled_variant()`); no copy when already C-contiguous.

    Raises ValueError for an unknown format, blocks that are not a non-empty 2-D uint8 array whose
    rows are whole blocks, or no kernel variant.
    """
    size = _check_format(fmt)
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or 0 in blocks.shape or blocks.shape[1] % size:
        raise ValueError(
            f"{fmt} blocks must be uint8 [N, K / 32 * {size}] with N, K >= 1, got {blocks.dtype} {blocks.shape}"
        )
    simd = variant if variant is not None else compiled_variant()
    if simd is None:
        raise ValueError("no block kernel for this CPU (no AVX2, AVX-512 or NEON variant)")
    return BlockWeight(np.ascontiguousarray(blocks), fmt, simd.isa)


def quantize_weight(weight: npt.NDArray[Any], fmt: str) -> U8Array:
    """W `[N, K]` (any float, K a multiple of 32) -> its ggml blocks uint8 `[N, K / 32 * bytes]`
    (`gguf.quants.quantize`). Raises ValueError for an unknown format or K not a multiple of 32."""
    _check_format(fmt)
    if weight.ndim != 2 or weight.shape[1] % BLOCK or 0 in weight.shape:
        raise ValueError(f"weight must be [N, K] with K a multiple of {BLOCK}, got shape {weight.shape}")
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = quantize(np.ascontiguousarray(weight, dtype=np.float32), GGMLQuantizationType[fmt.upper()])
    return np.ascontiguousarray(blocks, dtype=np.uint8)


def _fields(
    blocks: U8Array, fmt: str
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(d, m, q) of every block, float64: d and m `[N, B, 1]` (m = 0 for Q8_0, -8 d for Q4_0), q `[N, B, 32]`."""
    size = _jit.FORMATS[fmt]
    n = blocks.shape[0]
    raw = blocks.reshape(n, -1, size)  # [N, B, bytes]
    d = raw[..., 0:2].copy().view("<f2").astype(np.float64)  # [N, B, 1]
    if fmt == "q8_0":
        return d, np.zeros_like(d), raw[..., 2:].view(np.int8).astype(np.float64)
    start = 4 if fmt == "q4_1" else 2
    packed = raw[..., start:]  # [N, B, 16]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float64)  # [N, B, 32]
    if fmt == "q4_0":
        return d, -8.0 * d, q
    return d, raw[..., 2:4].copy().view("<f2").astype(np.float64), q


def dequantize_blocks(blocks: npt.NDArray[np.uint8], fmt: str) -> npt.NDArray[np.float64]:
    """The weights `[N, K]` float64 that ggml blocks `[N, K / 32 * bytes]` stand for (the oracle's decoder,
    module docstring). Raises ValueError for an unknown format or rows that are not whole blocks."""
    size = _check_format(fmt)
    if blocks.ndim != 2 or blocks.shape[1] % size:
        raise ValueError(f"{fmt} blocks must be [N, K / 32 * {size}], got shape {blocks.shape}")
    d, m, q = _fields(blocks, fmt)
    return (d * q + m).reshape(blocks.shape[0], -1)


def step_bound(blocks: npt.NDArray[np.uint8], fmt: str) -> npt.NDArray[np.float64]:
    """Per weight `[N, K]`, float64: how far the decoded weight may be from the weight it was quantized
    from: half a step d / 2 (Q4_0: one step d, since a weight at +8 d is clamped to q = 15, 7 d) plus
    the float16 rounding of d (and m): half a float16 ulp of d times |q| (and of m), an ulp being
    2^-10 of the value, or 2^-24 below float16's smallest normal 2^-14.
    Raises ValueError as `dequantize_blocks`."""
    size = _check_format(fmt)
    if blocks.ndim != 2 or blocks.shape[1] % size:
        raise ValueError(f"{fmt} blocks must be [N, K / 32 * {size}], got shape {blocks.shape}")
    d, m, q = _fields(blocks, fmt)
    step = np.abs(d) * np.ones_like(q) * (1.0 if fmt == "q4_0" else 0.5)  # Q4_0 clamps its top at 15

    def half_ulp(value: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:  # float16's, subnormals too
        return np.maximum(2.0**-11 * np.abs(value), 2.0**-25)

    rounding = np.abs(q) * half_ulp(d) + (half_ulp(m) if fmt == "q4_1" else 0.0)
    return (step + rounding).reshape(blocks.shape[0], -1)


def block_linear_into(x: F32Array, weight: BlockWeight, out: F32Array) -> None:
    """The hot path of `block_linear`: no checks, no allocation. x `[M, K]` float32 with unit-stride
    rows; out `[M, N]` float32 with unit-stride rows; anything else reads or writes out of bounds."""
    _jit.ENTRY_POINTS[(weight.isa, weight.format)](x, weight.blocks, out)


def block_linear(x: npt.NDArray[Any], weight: BlockWeight) -> F32Array:
    """y = x W^T: x `[M, K]` float32 -> `[M, N]` float32 for W the weight's blocks (dequantized in the
    kernel's registers; sums in float32). Raises ValueError for an x that is not float32 `[M, K]`."""
    if x.ndim != 2 or x.dtype != np.float32 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be float32 [M, {weight.in_features}], got {x.dtype} {x.shape}")
    out = np.empty((x.shape[0], weight.out_features), dtype=np.float32)  # [M, N]
    block_linear_into(np.ascontiguousarray(x), weight, out)
    return out


def prepare_block_linear(fmt: str, variant: SimdVariant | None = None) -> float:
    """Compile (or load from Numba's disk cache) the kernel of `fmt` now; returns the seconds it took.
    One call on a weight of one group of rows plus one, at 15 rows: every tile is compiled."""
    start = time.perf_counter()
    _, group, _ = _jit.BLOCK_SPECS[(variant or compiled_variant() or _no_variant()).isa]
    blocks = np.zeros((group + 1, _jit.FORMATS[fmt]), dtype=np.uint8)  # [N, one block]
    block_linear(np.zeros((15, BLOCK), dtype=np.float32), block_weight(blocks, fmt, variant))
    return time.perf_counter() - start


def _no_variant() -> SimdVariant:
    raise ValueError("no block kernel for this CPU (no AVX2, AVX-512 or NEON variant)")
