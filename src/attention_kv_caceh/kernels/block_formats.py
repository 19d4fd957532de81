"""GGUF's block formats the kernels multiply in registers: one row per ggml type, and its NumPy decode.

Each row is what ggml's type-traits table says of a type (`ggml.c`: `blck_size`, `type_size`), plus what
this project needs around its kernel: the scale fields before the quants, the float64 decode (the
oracle), the step bound (how far a decoded weight may be from the weight it was quantized from) and the
reference quantizer (the `gguf` library's, the round-to-nearest of ggml's `quantize_row_*_ref`). The
GGUF reader, the block kernels (`_block_gemm_jit`), the engine's `--quantization` choices
(`dispatch.QUANTIZATIONS`) and docs/kernels.md read this table; nothing here imports Numba.

    format  bytes  block                                                    weight j
    Q8_0    34     d (float16), q[32] (int8)                                d q[j]
    Q4_0    18     d (float16), 16 bytes: q[j] = low nibble of byte j,      d (q[j] - 8)
                   q[j + 16] its high nibble
    Q4_1    20     d, m (float16), 16 bytes of nibbles as Q4_0              d q[j] + m

The step bound: a weight and its decoded value differ by at most half a step (Q8_0: d / 2 with
d = max |w| / 127; Q4_1: d / 2 with d = (max - min) / 15; Q4_0: d = -w* / 8 for the weight w* of
largest magnitude, which sits at q = 0 exactly, the others within d / 2 but one of the opposite sign
and equal magnitude is clamped to q = 15, a whole step away) plus the float16 rounding of d and m, so a
product x . w moves by at most sum_k |x_k| times that bound at k.

Adding a type: one `BlockFormat` row here (with its `fields` decode) and its register decode in
`_block_gemm_jit` (docs/kernels.md, "Adding a GGUF type").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "BLOCK_FORMATS",
    "FORMATS",
    "BlockFormat",
    "block_format",
    "dequantize_blocks",
    "quantize_weight",
    "step_bound",
]

F64Array = npt.NDArray[np.float64]
U8Array = npt.NDArray[np.uint8]
Fields = tuple[F64Array, F64Array, F64Array]


@dataclass(frozen=True)
class BlockFormat:
    """One ggml block type.

    name: llama.cpp's type name, lower case ("q4_1"); block: weights per block; nbytes: bytes per block;
    scales: the float16 fields before the quants, in file order (("d",) or ("d", "m")); bits: bits per
    quant; fields: the NumPy decode, raw blocks uint8 `[N, B, nbytes]` -> (d, m, q) float64, d and m
    `[N, B, 1]`, q `[N, B, block]`, weight = d q + m; step: the step bound's multiple of |d| (module
    docstring).
    """

    name: str
    block: int
    nbytes: int
    scales: tuple[str, ...]
    bits: int
    fields: Callable[[U8Array], Fields]
    step: float

    @property
    def scale_bytes(self) -> int:
        """Bytes of the scale fields before the quants (float16 each)."""
        return 2 * len(self.scales)

    @property
    def ggml_type(self) -> str:
        """The `gguf.GGMLQuantizationType` name ("Q4_1")."""
        return self.name.upper()


def _half(raw: U8Array, start: int) -> F64Array:
    """The float16 at bytes start, start + 1 of every block, float64 `[N, B, 1]`."""
    return raw[..., start : start + 2].copy().view("<f2").astype(np.float64)


def _nibbles(raw: U8Array, start: int) -> F64Array:
    """q `[N, B, 32]` of 16 bytes of nibbles from `start`: low nibbles are q[0:16], high ones q[16:32]."""
    packed = raw[..., start:]  # [N, B, 16]
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float64)


def _q8_0(raw: U8Array) -> Fields:
    d = _half(raw, 0)
    return d, np.zeros_like(d), raw[..., 2:].view(np.int8).astype(np.float64)


def _q4_0(raw: U8Array) -> Fields:
    d = _half(raw, 0)
    return d, -8.0 * d, _nibbles(raw, 2)


def _q4_1(raw: U8Array) -> Fields:
    return _half(raw, 0), _half(raw, 2), _nibbles(raw, 4)


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("q8_0", 32, 34, ("d",), 8, _q8_0, 0.5),
        BlockFormat("q4_0", 32, 18, ("d",), 4, _q4_0, 1.0),  # Q4_0 clamps its top at 15
        BlockFormat("q4_1", 32, 20, ("d", "m"), 4, _q4_1, 0.5),
    )
}
"""llama.cpp's type name -> its row; the order is the kernels' and the choices' order."""
BLOCK_FORMATS: tuple[str, ...] = tuple(FORMATS)
"""llama.cpp's type names, lower case: "q8_0", "q4_0", "q4_1"."""


def block_format(name: str) -> BlockFormat:
    """The row of `name`. Raises ValueError for a name outside BLOCK_FORMATS."""
    if name not in FORMATS:
        raise ValueError(f"block format must be one of {BLOCK_FORMATS}, got {name!r}")
    return FORMATS[name]


def _checked_fields(blocks: npt.NDArray[np.uint8], name: str) -> Fields:
    fmt = block_format(name)
    if blocks.ndim != 2 or blocks.shape[1] % fmt.nbytes:
        block, size = fmt.block, fmt.nbytes
        raise ValueError(f"{name} blocks must be [N, K / {block} * {size}], got shape {blocks.shape}")
    return fmt.fields(blocks.reshape(blocks.shape[0], -1, fmt.nbytes))  # [N, B, bytes]


def dequantize_blocks(blocks: npt.NDArray[np.uint8], fmt: str) -> F64Array:
    """The weights `[N, K]` float64 that ggml blocks `[N, K / 32 * bytes]` stand for (the oracle's decoder,
    module docstring). Raises ValueError for an unknown format or rows that are not whole blocks."""
    d, m, q = _checked_fields(blocks, fmt)
    return (d * q + m).reshape(blocks.shape[0], -1)


def step_bound(blocks: npt.NDArray[np.uint8], fmt: str) -> F64Array:
    """Per weight `[N, K]`, float64: how far the decoded weight may be from the weight it was quantized
    from: half a step d / 2 (Q4_0: one step d, since a weight at +8 d is clamped to q = 15, 7 d) plus
    the float16 rounding of d (and m): half a float16 ulp of d times |q| (and of m), an ulp being
    2^-10 of the value, or 2^-24 below float16's smallest normal 2^-14.
    Raises ValueError as `dequantize_blocks`."""
    d, m, q = _checked_fields(blocks, fmt)
    row = FORMATS[fmt]
    step = np.abs(d) * np.ones_like(q) * row.step

    def half_ulp(value: F64Array) -> F64Array:  # float16's, subnormals too
        return np.maximum(2.0**-11 * np.abs(value), 2.0**-25)

    rounding = np.abs(q) * half_ulp(d) + (half_ulp(m) if "m" in row.scales else 0.0)
    return (step + rounding).reshape(blocks.shape[0], -1)


def quantize_weight(weight: npt.NDArray[Any], fmt: str) -> U8Array:
    """W `[N, K]` (any float, K a multiple of the block) -> its ggml blocks uint8 `[N, K / 32 * bytes]`
    (`gguf.quants.quantize`). Raises ValueError for an unknown format or K not a multiple of the block."""
    row = block_format(fmt)
    if weight.ndim != 2 or weight.shape[1] % row.block or 0 in weight.shape:
        raise ValueError(f"weight must be [N, K] with K a multiple of {row.block}, got shape {weight.shape}")
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = quantize(np.ascontiguousarray(weight, dtype=np.float32), GGMLQuantizationType[row.ggml_type])
    return np.ascontiguousarray(blocks, dtype=np.uint8)
