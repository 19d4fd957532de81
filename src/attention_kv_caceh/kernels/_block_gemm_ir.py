"""Each GGUF type's decode in registers, in LLVM IR, for the block kernels of `_block_gemm_jit`.

No kernel here: `decode(builder, fmt, lanes, block, part, memo)` emits the instructions that turn
weights part * L .. part * L + L - 1 of one block (or of one chunk of 32 values of a float type) into
a `<L x float>` vector, and says where they sit in the block. The bytes are those of
`block_formats.FORMATS` (its module docstring gives each layout): quants are loaded L bytes at a time
and widened to 32-bit lanes, so nibbles, 2-bit fields and the fifth or sixth bits come out with
32-bit `and`, shifts and `or`; then one multiply, or one FMA where the type has an offset:

    weight = a q + b,   a = d (or d sc), b = m, -8 d, -16 d or -dmin mn   (`block_formats.FORMATS`)

with a and b broadcast over the lanes, computed once per block or sub-block (the k-quants' 6-bit or
8-bit scales unpacked with scalar integer operations, then converted and multiplied by the float16
d or dmin). d sc and dmin mn are exact in float32 (at most 11 + 8 bits), so each weight is the exact
a q + b rounded once, as ggml's `dequantize_row_*` computes it in float32. `memo` (a dict per block
and row of W) keeps the broadcasts of the block's scales for its later parts.

Legend: L float32 lanes per vector; a part is L consecutive weights; every sub-block holds a whole
number of parts (sub-blocks of 16 or 32 weights, L <= 16).
"""

# pyright: basic
# (llvmlite's IR builder carries no annotations; neither do these helpers.)

from __future__ import annotations

from llvmlite import ir

from attention_kv_caceh.kernels import ir as v
from attention_kv_caceh.kernels.block_formats import FORMATS

__all__: list[str] = []


def _bytes(builder, block, offset, lanes):
    """L bytes at `offset` of the block (i8*), zero-extended to `<L x i32>`."""
    return builder.zext(v.load_vec(builder, block, offset, v.vec(lanes, v.I8)), v.vec(lanes, v.I32))


def _byte(builder, block, offset):
    """The byte at `offset` of the block as an i32 (zero-extended)."""
    return builder.zext(builder.load(v.at(builder, block, offset)), v.I32)


def _half(builder, block, offset, lanes, memo):
    """The float16 at `offset` of the block, widened, as an `<L x float>` broadcast (kept in memo)."""
    key = ("half", offset)
    if key not in memo:
        memo[key] = v.half_to_floats(builder, v.at(builder, block, offset), lanes)
    return memo[key]


def _splat(lanes, value):
    return v.splat(v.vec(lanes, v.I32), value)


def _shr(builder, ints, lanes, shift):
    return builder.lshr(ints, _splat(lanes, shift)) if shift else ints


def _and(builder, ints, lanes, mask):
    return builder.and_(ints, _splat(lanes, mask))


def _to_float(builder, ints, lanes, signed=False):
    convert = builder.sitofp if signed else builder.uitofp
    return convert(ints, v.vec(lanes))


def _scalar_scale(builder, ints, d, lanes):
    """The broadcast of float(ints) * d for an i32 scalar `ints` and a broadcast d."""
    return builder.fmul(v.broadcast(builder, builder.sitofp(ints, v.F32), lanes), d)


def _nibbles(builder, block, start, lanes, part):
    """Q4_0 / Q4_1 / Q5_x: 4-bit quants part * L .. of 16 bytes of nibbles at `start` as `<L x i32>`,
    and where they sit in the block (low nibbles 0 .. 15, high ones 16 .. 31)."""
    per_half = 16 // lanes
    chunk, high = part % per_half, part // per_half
    wide = _bytes(builder, block, start + chunk * lanes, lanes)
    return (
        _shr(builder, wide, lanes, 4) if high else _and(builder, wide, lanes, 15)
    ), high * 16 + chunk * lanes


def _fifth(builder, block, start, lanes, at, memo):
    """Q5_0 / Q5_1: bits at .. at + L - 1 of the uint32 qh at `start`, each shifted to bit 4."""
    key = ("qh", start)
    if key not in memo:
        word = builder.load(builder.bitcast(v.at(builder, block, start), v.I32.as_pointer()), align=1)
        memo[key] = v.broadcast(builder, word, lanes)
    shifts = ir.Constant(v.vec(lanes, v.I32), list(range(at, at + lanes)))
    return builder.shl(_and(builder, builder.lshr(memo[key], shifts), lanes, 1), _splat(lanes, 4))


def _q8_0(builder, lanes, block, part, memo):
    raw = v.load_vec(builder, block, 2 + part * lanes, v.vec(lanes, v.I8))
    q = builder.sitofp(builder.sext(raw, v.vec(lanes, v.I32)), v.vec(lanes))
    return builder.fmul(q, _half(builder, block, 0, lanes, memo)), part * lanes


def _q4_0(builder, lanes, block, part, memo):
    q, at = _nibbles(builder, block, 2, lanes, part)
    q = _to_float(builder, builder.sub(q, _splat(lanes, 8)), lanes, signed=True)
    return builder.fmul(q, _half(builder, block, 0, lanes, memo)), at


def _q4_1(builder, lanes, block, part, memo):
    q, at = _nibbles(builder, block, 4, lanes, part)
    d, m = _half(builder, block, 0, lanes, memo), _half(builder, block, 2, lanes, memo)
    return v.fma(builder, _to_float(builder, q, lanes), d, m), at


def _q5_0(builder, lanes, block, part, memo):
    q, at = _nibbles(builder, block, 6, lanes, part)
    q = builder.sub(builder.or_(q, _fifth(builder, block, 2, lanes, at, memo)), _splat(lanes, 16))
    return builder.fmul(_to_float(builder, q, lanes, signed=True), _half(builder, block, 0, lanes, memo)), at


def _q5_1(builder, lanes, block, part, memo):
    q, at = _nibbles(builder, block, 8, lanes, part)
    q = builder.or_(q, _fifth(builder, block, 4, lanes, at, memo))
    d, m = _half(builder, block, 0, lanes, memo), _half(builder, block, 2, lanes, memo)
    return v.fma(builder, _to_float(builder, q, lanes), d, m), at


def _k4_scale_min(builder, block, lanes, s, memo):
    """Q4_K / Q5_K: (d sc, -dmin mn) of sub-block s as broadcasts (ggml's `get_scale_min_k4` on the
    12 bytes at 4)."""
    key = ("k4", s)
    if key not in memo:
        byte = lambda j: _byte(builder, block, 4 + j)  # noqa: E731
        mask = lambda x, m: builder.and_(x, v.I32(m))  # noqa: E731
        if s < 4:
            sc, mn = mask(byte(s), 63), mask(byte(s + 4), 63)
        else:
            top = byte(s + 4)
            sc = builder.or_(mask(top, 15), builder.shl(builder.lshr(byte(s - 4), v.I32(6)), v.I32(4)))
            mn = builder.or_(
                builder.lshr(top, v.I32(4)), builder.shl(builder.lshr(byte(s), v.I32(6)), v.I32(4))
            )
        d, dmin = _half(builder, block, 0, lanes, memo), _half(builder, block, 2, lanes, memo)
        memo[key] = (
            _scalar_scale(builder, sc, d, lanes),
            builder.fneg(_scalar_scale(builder, mn, dmin, lanes)),
        )
    return memo[key]


def _q4_k(builder, lanes, block, part, memo, qh=None):
    at = part * lanes
    s, l0 = at // 32, at % 32  # sub-block of 32, place in it
    q = _bytes(builder, block, (48 if qh else 16) + (s // 2) * 32 + l0, lanes)
    q = _shr(builder, q, lanes, 4) if s % 2 else _and(builder, q, lanes, 15)
    if qh:  # Q5_K: bit s of qh[l], at bit 4
        high = _and(builder, _shr(builder, _bytes(builder, block, 16 + l0, lanes), lanes, s), lanes, 1)
        q = builder.or_(q, builder.shl(high, _splat(lanes, 4)))
    a, b = _k4_scale_min(builder, block, lanes, s, memo)
    return v.fma(builder, _to_float(builder, q, lanes), a, b), at


def _q5_k(builder, lanes, block, part, memo):
    return _q4_k(builder, lanes, block, part, memo, qh=True)


def _q6_k(builder, lanes, block, part, memo):
    at = part * lanes
    h, g, l0 = at // 128, (at % 128) // 32, at % 32
    low = _bytes(builder, block, h * 64 + (g % 2) * 32 + l0, lanes)
    low = _shr(builder, low, lanes, 4) if g >= 2 else _and(builder, low, lanes, 15)
    high = _and(
        builder, _shr(builder, _bytes(builder, block, 128 + h * 32 + l0, lanes), lanes, 2 * g), lanes, 3
    )
    q = builder.sub(builder.or_(low, builder.shl(high, _splat(lanes, 4))), _splat(lanes, 32))
    s = at // 16
    key = ("q6", s)
    if key not in memo:
        sc = builder.sext(builder.load(v.at(builder, block, 192 + s)), v.I32)
        memo[key] = _scalar_scale(builder, sc, _half(builder, block, 208, lanes, memo), lanes)
    return builder.fmul(_to_float(builder, q, lanes, signed=True), memo[key]), at


def _two_bits(builder, block, start, lanes, at):
    """Q2_K / Q3_K: 2-bit quants at .. at + L - 1 of the 64 bytes at `start`."""
    g, l0 = at // 32, at % 32
    return _and(
        builder,
        _shr(builder, _bytes(builder, block, start + (g // 4) * 32 + l0, lanes), lanes, 2 * (g % 4)),
        lanes,
        3,
    )


def _q2_k(builder, lanes, block, part, memo):
    at = part * lanes
    q = _two_bits(builder, block, 16, lanes, at)
    s = at // 16
    key = ("q2", s)
    if key not in memo:
        sc = _byte(builder, block, s)
        d, dmin = _half(builder, block, 80, lanes, memo), _half(builder, block, 82, lanes, memo)
        a = _scalar_scale(builder, builder.and_(sc, v.I32(15)), d, lanes)
        memo[key] = a, builder.fneg(_scalar_scale(builder, builder.lshr(sc, v.I32(4)), dmin, lanes))
    a, b = memo[key]
    return v.fma(builder, _to_float(builder, q, lanes), a, b), at


def _q3_k(builder, lanes, block, part, memo):
    at = part * lanes
    g, l0 = at // 32, at % 32
    bit = _and(builder, _shr(builder, _bytes(builder, block, l0, lanes), lanes, g), lanes, 1)
    q = builder.sub(
        builder.or_(_two_bits(builder, block, 32, lanes, at), builder.shl(bit, _splat(lanes, 2))),
        _splat(lanes, 4),
    )
    s = at // 16
    key = ("q3", s)
    if key not in memo:
        low = _byte(builder, block, 96 + s % 8)
        low = builder.lshr(low, v.I32(4)) if s >= 8 else builder.and_(low, v.I32(15))
        high = builder.and_(builder.lshr(_byte(builder, block, 104 + s % 4), v.I32(2 * (s // 4))), v.I32(3))
        sc = builder.sub(builder.or_(low, builder.shl(high, v.I32(4))), v.I32(32))
        memo[key] = _scalar_scale(builder, sc, _half(builder, block, 108, lanes, memo), lanes)
    return builder.fmul(_to_float(builder, q, lanes, signed=True), memo[key]), at


def _f32(builder, lanes, block, part, memo):
    return v.load_vec(builder, block, part * lanes * 4, v.vec(lanes)), part * lanes


def _f16(builder, lanes, block, part, memo):
    bits = v.load_vec(builder, block, part * lanes * 2, v.vec(lanes, v.I16))
    return builder.fpext(builder.bitcast(bits, v.vec(lanes, ir.HalfType())), v.vec(lanes)), part * lanes


def _bf16(builder, lanes, block, part, memo):
    bits = builder.zext(
        v.load_vec(builder, block, part * lanes * 2, v.vec(lanes, v.I16)), v.vec(lanes, v.I32)
    )
    return builder.bitcast(builder.shl(bits, _splat(lanes, 16)), v.vec(lanes)), part * lanes


DECODERS = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q5_0": _q5_0,
    "q5_1": _q5_1,
    "q2_k": _q2_k,
    "q3_k": _q3_k,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
    "f32": _f32,
    "f16": _f16,
    "bf16": _bf16,
}
"""Format -> its register decode: (builder, L, block (i8*), part, memo) -> (`<L x float>` weights
part * L .., their first index in the block). One entry per row of `block_formats.FORMATS`."""
assert list(DECODERS) == list(FORMATS)
