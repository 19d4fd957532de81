"""Linear layers over GGUF's block-quantized weights (every type of `block_formats`), kept as the file stores them.

A decode step reads every weight once, so at a batch of a few sequences its time is the weights' bytes
over the read rate. float32 weights cost 4 bytes each; GGUF's blocks cost 34 / 32 (Q8_0), 18 / 32
(Q4_0) and 20 / 32 (Q4_1) bytes: 32 weights share a float16 scale d (and, Q4_1, an offset m) and
keep 8 or 4 bits each; the k-quants keep super-blocks of 256 weights with a 4- to 8-bit scale per
16 or 32 (Q4_K: 144 / 256 bytes, Q6_K: 210 / 256); F16 and BF16 two bytes a weight. llama.cpp reads its GGUF files this way; here the kernel of `_block_gemm_jit`
dequantizes each block in registers inside its inner loop (activations and sums stay float32), so the
weights stay in memory exactly as the GGUF holds them: `BlockWeight.blocks` is ggml's row-major block
array as uint8 `[N, K / block * block bytes]`, the bytes of the file's tensor data (a float type's
rows must be whole chunks of 32 values, `block_formats.KERNEL_CHUNK`).

Oracles. The formats, their float64 decode (`block_formats.dequantize_blocks`), the bound on how far a
block is from the weights it was made from (`block_formats.step_bound`) and the reference quantizer
(`block_formats.quantize_weight`) are the rows of `block_formats`; the tests check the decode against the
`gguf` library's `gguf.quants.dequantize` (bit-equal in float32), and the kernel against NumPy's float64
product of x and the decoded weights: the kernel decodes each weight to its float32 rounding (one
rounding of the exact a q + b, `_block_gemm_ir`), then sums in float32, so the error is bounded by
K float32 roundings of sum |x| |w| (`oracle.tolerance_for`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels import _block_gemm_jit as _jit
from attention_kv_caceh.kernels.block_formats import FORMATS, block_format
from attention_kv_caceh.kernels.isa import SimdVariant, compiled_variant
from attention_kv_caceh.kernels.threads import chunk_rows, row_split

__all__ = ["BlockWeight", "block_linear", "block_linear_into", "block_weight", "prepare_block_linear"]

F32Array = npt.NDArray[np.float32]
U8Array = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class BlockWeight:
    """A weight `[N, K]` as ggml blocks of one format, for the kernel variant `isa`.

    blocks: uint8 `[N, K / block * block bytes]`, C-contiguous (row n holds W[n]'s blocks).
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
        row = FORMATS[self.format]
        return int(self.blocks.shape[1]) // row.chunk_bytes * row.chunk

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks: what one call reads from memory."""
        return int(self.blocks.nbytes)

    @property
    def path(self) -> str:
        """The kernel's name for notes, e.g. "avx2 q4_1"."""
        return f"{self.isa} {self.format}"


def block_weight(blocks: npt.NDArray[Any], fmt: str, variant: SimdVariant | None = None) -> BlockWeight:
    """Wrap ggml blocks (uint8 `[N, K / block * block bytes]`, or the flat bytes of N rows reshaped so)
    for the kernel `variant` (default `isa.compiled_variant()`); no copy when already C-contiguous.

    Raises ValueError for an unknown format, blocks that are not a non-empty 2-D uint8 array whose
    rows are whole blocks (whole chunks of 32 values for a float type), or no kernel variant.
    """
    row = block_format(fmt)
    size = row.chunk_bytes
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or 0 in blocks.shape or blocks.shape[1] % size:
        raise ValueError(
            f"{fmt} blocks must be uint8 [N, K / {row.chunk} * {size}] with N, K >= 1, got "
            f"{blocks.dtype} {blocks.shape}"
        )
    simd = variant if variant is not None else compiled_variant()
    if simd is None:
        raise ValueError("no block kernel for this CPU (no AVX2, AVX-512 or NEON variant)")
    return BlockWeight(np.ascontiguousarray(blocks), fmt, simd.isa)


def block_linear_into(x: F32Array, weight: BlockWeight, out: F32Array, threads: int = 1) -> None:
    """The hot path of `block_linear`: no checks, no allocation. x `[M, K]` float32 with unit-stride
    rows; out `[M, N]` float32 with unit-stride rows; anything else reads or writes out of bounds.
    threads > 1: W's rows split into chunks (whole groups of the kernel's tiles) over that many of
    Numba's threads (`threads.row_split`; the calling thread's count must be at least `threads`); the
    result is bit-identical."""
    kernel = cast(Callable[..., None], _jit.ENTRY_POINTS[(weight.isa, weight.format)])
    _, group, _ = _jit.BLOCK_SPECS[weight.isa]
    rows = weight.blocks.shape[0]
    if threads == 1 or rows <= group:
        kernel(x, weight.blocks, out)
        return
    row_split(kernel)(x, weight.blocks, out, chunk_rows(rows, threads, group), 1, threads)


def block_linear(x: npt.NDArray[Any], weight: BlockWeight, threads: int = 1) -> F32Array:
    """y = x W^T: x `[M, K]` float32 -> `[M, N]` float32 for W the weight's blocks (dequantized in the
    kernel's registers; sums in float32); threads as `block_linear_into` (the same result for every
    count). Raises ValueError for an x that is not float32 `[M, K]`."""
    if x.ndim != 2 or x.dtype != np.float32 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be float32 [M, {weight.in_features}], got {x.dtype} {x.shape}")
    out = np.empty((x.shape[0], weight.out_features), dtype=np.float32)  # [M, N]
    block_linear_into(np.ascontiguousarray(x), weight, out, threads)
    return out


def prepare_block_linear(fmt: str, variant: SimdVariant | None = None) -> float:
    """Compile (or load from Numba's disk cache) the kernel of `fmt` now; returns the seconds it took.
    One call on a weight of one group of rows plus one, at 15 rows: every tile is compiled."""
    start = time.perf_counter()
    _, group, _ = _jit.BLOCK_SPECS[(variant or compiled_variant() or _no_variant()).isa]
    row = block_format(fmt)
    blocks = np.zeros((group + 1, row.chunk_bytes), dtype=np.uint8)  # [N, one block]
    block_linear(np.zeros((15, row.chunk), dtype=np.float32), block_weight(blocks, fmt, variant))
    return time.perf_counter() - start


def _no_variant() -> SimdVariant:
    raise ValueError("no block kernel for this CPU (no AVX2, AVX-512 or NEON variant)")
