"""GGUF's tensor types the kernels multiply in registers: one row per ggml type, and its NumPy decode.

Each row is what ggml's type-traits table says of a type (`ggml.c`: `blck_size`, `type_size`), the
block's fields in file order (`ggml-common.h`'s `block_*` structs), and what this project needs around
its kernel: the float64 decode (the oracle), and for the types the `gguf` library can quantize, the
step bound (how far a decoded weight may be from the weight it was quantized from) and the reference
quantizer (the `gguf` library's, the round-to-nearest of ggml's `quantize_row_*_ref`). The GGUF reader,
the block kernels (`_block_gemm_jit`), the engine's `--quantization` choices (`dispatch.QUANTIZATIONS`)
and docs/kernels.md read this table; nothing here imports Numba.

Every type decodes as weight = a q + b over sub-blocks of `sub` weights that share a scale a and an
offset b (q a small integer): the 32-weight formats have one sub-block per block, the k-quants eight or
sixteen per super-block of 256, their scales (and minimums) 4-, 6- or 8-bit integers times the block's
float16 d (and dmin):

    format  bytes  block  fields in file order                              weight j
    Q8_0    34     32     d, qs[32] (int8)                                  d q
    Q4_0    18     32     d, qs[16]: q[j] low nibble of byte j, q[j+16]     d (q - 8)
                          its high nibble
    Q4_1    20     32     d, m, qs[16] (as Q4_0)                            d q + m
    Q5_0    22     32     d, qh[4] (bit j: q[j]'s fifth bit), qs[16]        d (q - 16)
    Q5_1    24     32     d, m, qh[4], qs[16]                               d q + m
    Q2_K    84     256    scales[16] (low nibble scale, high nibble min),   d sc q - dmin mn, 16 a scale
                          qs[64] (2 bits), d, dmin
    Q3_K    110    256    hmask[32], qs[64] (2 bits), scales[12] (6-bit),   d (sc - 32) q, q = low bits
                          d                                                 - 4 (1 - hmask bit), 16 a scale
    Q4_K    144    256    d, dmin, scales[12] (eight 6-bit scales and       d sc q - dmin mn, 32 a scale
                          mins), qs[128]
    Q5_K    176    256    d, dmin, scales[12], qh[32], qs[128]              as Q4_K, q + 16 qh bit
    Q6_K    210    256    ql[128], qh[64], scales[16] (int8), d             d sc (q - 32), 16 a scale
    F32, F16, BF16: one value each (4, 2, 2 bytes)                          the value

Where the bits of weight j of a super-block sit (the order of `dequantize_row_*` in ggml-quants.c):
Q4_K and Q5_K keep 64 weights per 32 bytes of qs, the low nibbles the first 32, the high ones the
next; Q5_K's fifth bit of sub-block s is bit s of qh[j % 32]; Q2_K and Q3_K keep 128 weights per 32
bytes of qs, weight 32 g + l at bits 2 (g % 4) of byte 32 (g // 4) + l, Q3_K's third bit bit g of
hmask[l]; Q6_K's half h (128 weights), group g (32), l: low nibbles from ql[64 h + 32 (g % 2) + l]
(the high nibble for g >= 2), the top two bits from bits 2 g of qh[32 h + l]. The 6-bit scale and
minimum of Q4_K / Q5_K's sub-block s (ggml's `get_scale_min_k4`): s < 4: scales[s] & 63,
scales[s + 4] & 63; else (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4 and
(scales[s + 4] >> 4) | (scales[s] >> 6) << 4. Q3_K's scale s: low four bits the low (s < 8) or high
nibble of scales[s % 8], high two bits bits 2 (s // 4) of scales[8 + s % 4].

The step bound (quantized types only): a weight and its decoded value differ by at most half a step
(Q8_0: d / 2 with d = max |w| / 127; Q4_1, Q5_1: d / 2 with d = (max - min) / 15 or 31; Q4_0, Q5_0:
d = -w* / 8 or / 16 for the weight w* of largest magnitude, which sits at q = 0 exactly, the others
within d / 2 but one of the opposite sign and equal magnitude is clamped to the top q, a whole step
away) plus the float16 rounding of d and m, so a product x . w moves by at most sum_k |x_k| times that
bound at k. The `gguf` library has no quantizer for the k-quants: they are read from files only.

Adding a type: one `BlockFormat` row here (with its `fields` decode) and its register decode in
`_block_gemm_jit` (docs/kernels.md, "Adding a GGUF type"). The IQ family (importance-matrix codebooks)
is refused by name.
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
    "KERNEL_CHUNK",
    "QUANTIZED_FORMATS",
    "BlockFormat",
    "block_format",
    "dequantize_blocks",
    "quantize_weight",
    "step_bound",
]

F64Array = npt.NDArray[np.float64]
U8Array = npt.NDArray[np.uint8]
Fields = tuple[F64Array, F64Array, F64Array]

KERNEL_CHUNK = 32
"""Weights the kernels decode together at least: a block, or 32 values of a float type."""


@dataclass(frozen=True)
class BlockFormat:
    """One ggml tensor type.

    name: llama.cpp's type name, lower case ("q4_k"); block: weights per block (ggml's `blck_size`);
    nbytes: bytes per block (`type_size`); layout: the block's fields in file order as (name, bytes);
    bits: bits per quant (the value's bits for a float type); sub: weights per sub-block (one scale
    and offset); fields: the NumPy decode, raw blocks uint8 `[N, B, nbytes]` -> (a, b, q) float64,
    a and b `[N, B * block / sub, 1]`, q `[N, B * block / sub, sub]`, weight = a q + b, each product
    and sum exact in float64; step: the step bound's multiple of |d|, None for a type without a
    reference quantizer (module docstring).
    """

    name: str
    block: int
    nbytes: int
    layout: tuple[tuple[str, int], ...]
    bits: int
    sub: int
    fields: Callable[[U8Array], Fields]
    step: float | None

    @property
    def scale_bytes(self) -> int:
        """Bytes of the block that are not quants (scales, minimums, their packing)."""
        return self.nbytes - self.block * self.bits // 8

    @property
    def ggml_type(self) -> str:
        """The `gguf.GGMLQuantizationType` name ("Q4_K")."""
        return self.name.upper()

    def field_offset(self, name: str) -> int:
        """Byte offset of field `name` in the block. Raises KeyError for a field the type lacks."""
        at = 0
        for field, size in self.layout:
            if field == name:
                return at
            at += size
        raise KeyError(f"{self.name} has no field {name!r}")

    @property
    def half_fields(self) -> tuple[str, ...]:
        """The float16 fields (d, m, dmin), in file order."""
        return tuple(name for name, _ in self.layout if name in ("d", "m", "dmin"))

    @property
    def chunk(self) -> int:
        """Weights per kernel step: the block, or KERNEL_CHUNK values of a float type."""
        return max(self.block, KERNEL_CHUNK)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one kernel step (`chunk` weights)."""
        return self.nbytes * self.chunk // self.block


def _half(raw: U8Array, start: int) -> F64Array:
    """The float16 at bytes start, start + 1 of every block, float64 `[N, B, 1]`."""
    return raw[..., start : start + 2].copy().view("<f2").astype(np.float64)


def _nibbles(packed: U8Array) -> F64Array:
    """q `[N, B, 2 P]` of P bytes `[N, B, P]` of nibbles: low nibbles are q[0:P], high ones q[P:2P]."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float64)


def _fifth_bits(raw: U8Array, start: int) -> F64Array:
    """Bit j of the little-endian uint32 at `start` for j in 0 .. 31, float64 `[N, B, 32]`."""
    qh = raw[..., start : start + 4].copy().view("<u4")  # [N, B, 1]
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.float64)


def _subs(values: npt.NDArray[Any], per: int) -> F64Array:
    """[N, B, X] -> [N, B * X / per, per] float64: consecutive runs of `per`."""
    return values.astype(np.float64).reshape(values.shape[0], -1, per)


def _q8_0(raw: U8Array) -> Fields:
    d = _half(raw, 0)
    return d, np.zeros_like(d), raw[..., 2:].view(np.int8).astype(np.float64)


def _q4_0(raw: U8Array) -> Fields:
    d = _half(raw, 0)
    return d, -8.0 * d, _nibbles(raw[..., 2:])


def _q4_1(raw: U8Array) -> Fields:
    return _half(raw, 0), _half(raw, 2), _nibbles(raw[..., 4:])


def _q5_0(raw: U8Array) -> Fields:
    d = _half(raw, 0)
    return d, -16.0 * d, _nibbles(raw[..., 6:]) + 16.0 * _fifth_bits(raw, 2)


def _q5_1(raw: U8Array) -> Fields:
    return _half(raw, 0), _half(raw, 2), _nibbles(raw[..., 8:]) + 16.0 * _fifth_bits(raw, 4)


def _scale_min_k4(scales: U8Array) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Q4_K / Q5_K's eight 6-bit scales and minimums `[N, B, 8]` of 12 packed bytes `[N, B, 12]`."""
    s = scales.astype(np.int64)
    low, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([low & 63, (top & 15) | (low >> 6) << 4], axis=-1)
    mn = np.concatenate([mid & 63, (top >> 4) | (mid >> 6) << 4], axis=-1)
    return sc, mn


def _k4_scales(raw: U8Array) -> tuple[F64Array, F64Array]:
    """(d sc, -dmin mn) `[N, B * 8, 1]` of Q4_K / Q5_K blocks."""
    n = raw.shape[0]
    sc, mn = _scale_min_k4(raw[..., 4:16])
    a = (_half(raw, 0) * sc).reshape(n, -1, 1)
    b = (-_half(raw, 2) * mn).reshape(n, -1, 1)
    return a, b


def _q4_k(raw: U8Array) -> Fields:
    n, blocks = raw.shape[:2]
    qs = raw[..., 16:144].reshape(n, blocks, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    a, b = _k4_scales(raw)
    return a, b, _subs(qs & 0x0F, 32)  # [N, B * 8, 32]: per 32 bytes, low nibbles then high


def _q5_k(raw: U8Array) -> Fields:
    n, blocks = raw.shape[:2]
    qs = raw[..., 48:176].reshape(n, blocks, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = raw[..., 16:48].reshape(n, blocks, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    a, b = _k4_scales(raw)
    return a, b, _subs(qs & 0x0F, 32) + 16.0 * _subs(qh & 1, 32)


def _q6_k(raw: U8Array) -> Fields:
    n, blocks = raw.shape[:2]
    ql = raw[..., 0:128].reshape(n, blocks, 2, 1, 2, 32)  # [h, nibble, half of 64 bytes, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(n, blocks, 2, 4, 32)  # g = 2 nibble + half
    qh = raw[..., 128:192].reshape(n, blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = _subs(low | (qh & 3) << 4, 16) - 32.0  # [N, B * 16, 16]
    a = (_half(raw, 208) * raw[..., 192:208].view(np.int8)).reshape(n, -1, 1)
    return a, np.zeros_like(a), q


def _two_bits(qs: U8Array) -> npt.NDArray[np.uint8]:
    """q `[N, B, 256]` of 64 bytes `[N, B, 64]` of 2-bit quants: weight 32 g + l at bits 2 (g % 4) of
    byte 32 (g // 4) + l."""
    n, blocks = qs.shape[:2]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    return ((qs.reshape(n, blocks, 2, 1, 32) >> shifts) & np.uint8(3)).reshape(n, blocks, 256)


def _q2_k(raw: U8Array) -> Fields:
    n = raw.shape[0]
    scales = raw[..., 0:16]
    a = (_half(raw, 80) * (scales & 15)).reshape(n, -1, 1)
    b = (-_half(raw, 82) * (scales >> 4)).reshape(n, -1, 1)
    return a, b, _subs(_two_bits(raw[..., 16:80]), 16)


def _q3_k(raw: U8Array) -> Fields:
    n, blocks = raw.shape[:2]
    s = raw[..., 96:108].astype(np.int64)
    low = np.concatenate([s[..., 0:8] & 15, s[..., 0:8] >> 4], axis=-1)  # [N, B, 16]
    high = (s[..., 8:12].reshape(n, blocks, 1, 4) >> np.array([0, 2, 4, 6]).reshape(4, 1)) & 3
    sc = (low | high.reshape(n, blocks, 16) << 4) - 32
    hmask = raw[..., 0:32].reshape(n, blocks, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    q = _two_bits(raw[..., 32:96]).astype(np.float64) - 4.0 * (1 - (hmask & 1).reshape(n, blocks, 256))
    a = (_half(raw, 108) * sc).reshape(n, -1, 1)
    return a, np.zeros_like(a), _subs(q, 16)


def _plain(dtype: str) -> Callable[[U8Array], Fields]:
    def fields(raw: U8Array) -> Fields:
        if dtype == "bf16":
            values = (raw.copy().view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.copy().view("<f4" if dtype == "f32" else "<f2")
        q = values.astype(np.float64)  # [N, B, 1]
        return np.ones_like(q), np.zeros_like(q), q

    return fields


def _row(
    name: str,
    block: int,
    layout: tuple[tuple[str, int], ...],
    bits: int,
    sub: int,
    fields: Callable[[U8Array], Fields],
    step: float | None,
) -> BlockFormat:
    """A row whose bytes per block are the sum of its fields'."""
    return BlockFormat(name, block, sum(size for _, size in layout), layout, bits, sub, fields, step)


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        _row("q8_0", 32, (("d", 2), ("qs", 32)), 8, 32, _q8_0, 0.5),
        _row("q4_0", 32, (("d", 2), ("qs", 16)), 4, 32, _q4_0, 1.0),  # Q4_0 clamps its top at 15
        _row("q4_1", 32, (("d", 2), ("m", 2), ("qs", 16)), 4, 32, _q4_1, 0.5),
        _row("q5_0", 32, (("d", 2), ("qh", 4), ("qs", 16)), 5, 32, _q5_0, 1.0),  # clamps at 31
        _row("q5_1", 32, (("d", 2), ("m", 2), ("qh", 4), ("qs", 16)), 5, 32, _q5_1, 0.5),
        _row("q2_k", 256, (("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)), 2, 16, _q2_k, None),
        _row("q3_k", 256, (("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)), 3, 16, _q3_k, None),
        _row("q4_k", 256, (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)), 4, 32, _q4_k, None),
        _row(
            "q5_k", 256, (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)), 5, 32, _q5_k, None
        ),
        _row("q6_k", 256, (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)), 6, 16, _q6_k, None),
        _row("f32", 1, (("value", 4),), 32, 1, _plain("f32"), None),
        _row("f16", 1, (("value", 2),), 16, 1, _plain("f16"), None),
        _row("bf16", 1, (("value", 2),), 16, 1, _plain("bf16"), None),
    )
}
"""llama.cpp's type name -> its row; the order is the kernels' order."""
BLOCK_FORMATS: tuple[str, ...] = tuple(FORMATS)
"""llama.cpp's type names, lower case, of every type the block kernels multiply."""
QUANTIZED_FORMATS: tuple[str, ...] = tuple(name for name, row in FORMATS.items() if row.step is not None)
"""The types a float checkpoint can be quantized to at load (the `gguf` library's quantizers):
"q8_0", "q4_0", "q4_1", "q5_0", "q5_1"."""


def block_format(name: str) -> BlockFormat:
    """The row of `name`. Raises ValueError for a name outside BLOCK_FORMATS, naming the IQ family for
    its types (codebook formats these kernels do not decode)."""
    if name not in FORMATS:
        if name.lower().startswith("iq"):
            raise ValueError(
                f"block format {name!r} is an IQ type (importance-matrix codebooks), which the block "
                f"kernels do not decode; supported: {BLOCK_FORMATS}"
            )
        raise ValueError(f"block format must be one of {BLOCK_FORMATS}, got {name!r}")
    return FORMATS[name]


def _checked_fields(blocks: npt.NDArray[np.uint8], name: str) -> Fields:
    fmt = block_format(name)
    if blocks.ndim != 2 or blocks.shape[1] % fmt.nbytes:
        block, size = fmt.block, fmt.nbytes
        raise ValueError(f"{name} blocks must be [N, K / {block} * {size}], got shape {blocks.shape}")
    return fmt.fields(blocks.reshape(blocks.shape[0], -1, fmt.nbytes))  # [N, B, bytes]


def dequantize_blocks(blocks: npt.NDArray[np.uint8], fmt: str) -> F64Array:
    """The weights `[N, K]` float64 that ggml blocks `[N, K / block * bytes]` stand for (the oracle's
    decoder, module docstring; exact: every float32 weight ggml's `dequantize_row_*` computes is this
    value rounded once). Raises ValueError for an unknown format or rows that are not whole blocks."""
    a, b, q = _checked_fields(blocks, fmt)
    return (a * q + b).reshape(blocks.shape[0], -1)


def step_bound(blocks: npt.NDArray[np.uint8], fmt: str) -> F64Array:
    """Per weight `[N, K]`, float64: how far the decoded weight may be from the weight it was quantized
    from: half a step d / 2 (Q4_0, Q5_0: one step d, since a weight at +8 d or +16 d is clamped to the
    top q) plus the float16 rounding of d (and m): half a float16 ulp of d times |q| (and of m), an
    ulp being 2^-10 of the value, or 2^-24 below float16's smallest normal 2^-14.
    Raises ValueError as `dequantize_blocks`, or for a type without a reference quantizer."""
    d, m, q = _checked_fields(blocks, fmt)
    row = FORMATS[fmt]
    if row.step is None:
        raise ValueError(
            f"{fmt} has no reference quantizer, so no step bound; quantized: {QUANTIZED_FORMATS}"
        )
    step = np.abs(d) * np.ones_like(q) * row.step

    def half_ulp(value: F64Array) -> F64Array:  # float16's, subnormals too
        return np.maximum(2.0**-11 * np.abs(value), 2.0**-25)

    rounding = np.abs(q) * half_ulp(d) + (half_ulp(m) if "m" in row.half_fields else 0.0)
    return (step + rounding).reshape(blocks.shape[0], -1)


def quantize_weight(weight: npt.NDArray[Any], fmt: str) -> U8Array:
    """W `[N, K]` (any float, K a multiple of the block) -> its ggml blocks uint8 `[N, K / 32 * bytes]`
    (`gguf.quants.quantize`). Raises ValueError for a format outside QUANTIZED_FORMATS or K not a
    multiple of the block."""
    row = block_format(fmt)
    if row.step is None:
        raise ValueError(f"{fmt} has no reference quantizer; quantized formats: {QUANTIZED_FORMATS}")
    if weight.ndim != 2 or weight.shape[1] % row.block or 0 in weight.shape:
        raise ValueError(f"weight must be [N, K] with K a multiple of {row.block}, got shape {weight.shape}")
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = quantize(np.ascontiguousarray(weight, dtype=np.float32), GGMLQuantizationType[row.ggml_type])
    return np.ascontiguousarray(blocks, dtype=np.uint8)
