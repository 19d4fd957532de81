"""Integer-dot kernels for the k-quants: Q8_K activations (`activation_quant`) times Q2_K .. Q6_K blocks.

No argument checks here: the caller validates first. Legend as `_block_gemm_int_jit`: M rows of x, K
input features (a multiple of 256), N output features, L int32 lanes of the dot product (`host_dot`),
MR rows of x per tile (`BLOCK_SPECS`). Each entry point is kernel(q, d, sums, w, y): q int8 `[M, K]`,
d float32 `[M, K / 256]`, sums int32 `[M, K / 16]` (Q8_K's bsums), w uint8 `[N, K / 256 * bytes]`
(C-contiguous), y float32 `[M, N]`; q, d, sums and y with unit-stride rows.

Per super-block of 256 (ggml-cpu arch/x86/quants.c `ggml_vec_dot_q2_K_q8_K` .. `ggml_vec_dot_q6_K_q8_K`):
the weight's scales are unpacked once per super-block and row of W, shared by the rows of x of a tile;
each sub-block of 32 is one dot product of unsigned weight quants and x's int8 quants with the scale
folded in (`_scaled_dot`: `vpmaddubsw` then `vpmaddwd` by the scales, or `vpdpwssd` with AVX-512
VNNI, or int16 products), summed in int32 over the whole super-block (exact: each sum is at most
256 * 128 * 63 * 127 + 32 * 256 * 128 * 127 < 2^29 in magnitude), then one float combine per
super-block and row of x:

    Q4_K  (q 0 .. 15, sc and mn 6 bits per 32, `get_scale_min_k4`):
          acc += f(isum) * (d_w d_x);  acc += f(msum) * -(dmin_w d_x)
          isum = sum_s sc_s (q_s . x_s),  msum = sum_s mn_s (bsums[2s] + bsums[2s + 1])
    Q5_K  as Q4_K, q 0 .. 31: the nibble plus bit s of qh[l] at bit 4
    Q6_K  (q = ql nibble | qh 2 bits << 4, 0 .. 63; the weight is q - 32; sc int8 per 16):
          acc += f(isum) * (d_w d_x),  isum = sum_t sc_t (q_t . x_t) - 32 sum_t sc_t bsums[t]
    Q2_K  (q 2 bits, 0 .. 3; sc, mn the nibbles of one byte per 16): as Q4_K, msum = sum_t mn_t bsums[t]
    Q3_K  (u = 2 bits | hmask bit << 2, 0 .. 7; the weight is u - 4; sc 6 bits - 32 per 16):
          as Q6_K with 4 for 32

acc is one `<L x float>` per row of x (the lanes of isum and msum are added lane by lane; msum's
lanes are folded to L first, in int32), summed across lanes at the end of the row. So y[m, n]
carries per super-block the rounding of d_w d_x (or dmin_w d_x), of the int32-to-float conversion
(exact below 2^24) and of its FMAs (two with minimums: Q2_K, Q4_K, Q5_K; one for Q3_K, Q6_K), then
log2 L roundings of the lane sum, whatever tile of rows of W or x it is computed in: the rows of a
tile share only integer work.
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from attention_kv_caceh.kernels import ir as v
from attention_kv_caceh.kernels._block_gemm_int_jit import BLOCK_SPECS, _x86, host_dot, operands

__all__: list[str] = []

KQUANT_INT_FORMATS = ("q4_k", "q6_k", "q5_k", "q2_k", "q3_k")
"""Weight formats with an integer-dot kernel here, in the order of the entry points' codes."""
_BLOCK_BYTES = {"q4_k": 144, "q6_k": 210, "q5_k": 176, "q2_k": 84, "q3_k": 110}
_KEYS = [(isa, fmt) for isa in BLOCK_SPECS for fmt in KQUANT_INT_FORMATS]
_I32V16 = v.vec(16, v.I32)


def _shuffle(builder, src, indices):
    """`<len(indices) x T>` of src's lanes `indices` (one `vpshufb` / broadcast when constant)."""
    return builder.shuffle_vector(src, src, ir.Constant(v.vec(len(indices), v.I32), list(indices)))


def _fold(builder, ints, lanes):
    """An int vector folded to `lanes` lanes by adding neighbouring pairs (lane k: lanes 2k, 2k + 1),
    so that each half of the result sums only the matching half of the input; widened with zero
    lanes when shorter."""
    width = ints.type.count
    while width > lanes:
        half = width // 2
        even, odd = _shuffle(builder, ints, range(0, width, 2)), _shuffle(builder, ints, range(1, width, 2))
        ints, width = builder.add(even, odd), half
    if width < lanes:
        zero = ir.Constant(ints.type, None)
        pad = list(range(width)) + [width] * (lanes - width)
        ints = builder.shuffle_vector(ints, zero, ir.Constant(v.vec(lanes, v.I32), pad))
    return ints


def _scaled_dot(builder, wq, xq, scales, lo, hi, how, lanes, acc):
    """acc (`<L x i32>`, or None for zero) plus a `<L x i32>` whose lanes sum to sum_l sc(l) wq[l]
    xq[l] over the 32 lanes of wq (unsigned `<32 x i8>`, at most 63) and xq (int8), sc(l) =
    scales[lo] for l < 16 and scales[hi] from 16. `scales` as `_scale_source` makes them; on x86 lo
    and hi in the same eight.

    pmadd: `vpmaddubsw` (u8 x s8 pairs into int16: at most 2 * 63 * 128, no saturation), then
    `vpmaddwd` by the scales (int16 pairs times int16 into int32; the scales spread by one
    `vpshufb`) and an add. vnni: the same `vpmaddubsw`, then `vpdpwssd` (AVX-512 VNNI: `vpmaddwd`
    and the add in one instruction; `vpdpbusd` would need an int32 multiply by the scale after it).
    generic: int16 products, neighbouring pairs added in int32 and folded to L (`_fold`), times the
    scales. In every form the first half of the lanes holds l < 16, so one scale vector [lo] * (L /
    2) + [hi] * (L / 2) applies."""
    if how in ("pmadd", "vnni"):
        pairs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", v.vec(16, v.I16), [wq, xq])
        assert lo // 8 == hi // 8
        mask = [b for at in (lo % 8, hi % 8) for b in [2 * at, 2 * at + 1] * 8]
        bytes32 = v.vec(32, v.I8)
        sv = _x86(builder, "llvm.x86.avx2.pshuf.b", bytes32, [scales[lo // 8], ir.Constant(bytes32, mask)])
        ints = v.vec(8, v.I32)
        if how == "vnni":
            start = ir.Constant(ints, None) if acc is None else acc
            return _x86(
                builder,
                "llvm.x86.avx512.vpdpwssd.256",
                ints,
                [start, builder.bitcast(pairs, ints), builder.bitcast(sv, ints)],
            )
        dot = _x86(builder, "llvm.x86.avx2.pmadd.wd", ints, [pairs, builder.bitcast(sv, v.vec(16, v.I16))])
        return dot if acc is None else builder.add(acc, dot)
    wide = v.vec(32, v.I16)
    prod = builder.mul(builder.zext(wq, wide), builder.sext(xq, wide))
    even = builder.sext(_shuffle(builder, prod, range(0, 32, 2)), _I32V16)
    odd = builder.sext(_shuffle(builder, prod, range(1, 32, 2)), _I32V16)
    dot = _fold(builder, builder.add(even, odd), lanes)
    dot = builder.mul(dot, _shuffle(builder, scales, [lo] * (lanes // 2) + [hi] * (lanes // 2)))
    return dot if acc is None else builder.add(acc, dot)


def _weighted_bsums(builder, bsums, weights16, how, lanes):
    """`<L x i32>` whose lanes sum to sum_j weights16[j] bsums[j] (bsums `<16 x i32>`, each at most
    16 * 127 in magnitude, so exact in int16; weights16 `<16 x i16>`). x86: the bsums narrowed to
    int16 and one `vpmaddwd` (lane k: pairs 2 k, 2 k + 1); generic: int32 products, folded."""
    if how != "generic":
        narrow = builder.trunc(bsums, v.vec(16, v.I16))
        return _fold(
            builder, _x86(builder, "llvm.x86.avx2.pmadd.wd", v.vec(8, v.I32), [narrow, weights16]), lanes
        )
    return _fold(builder, builder.mul(bsums, builder.sext(weights16, _I32V16)), lanes)


def _scale_source(builder, scales16, how, signed):
    """The 16 scales `<16 x i8>` as `_scaled_dot` reads them: widened to `<16 x i32>`, or on x86
    to int16 in two `<32 x i8>` vectors, scales 0 .. 7 in both 128-bit halves and 8 .. 15 in both
    (so that one in-lane `vpshufb` spreads a scale over a half)."""
    widen = builder.sext if signed else builder.zext
    if how == "generic":
        return widen(scales16, _I32V16)
    words = widen(scales16, v.vec(16, v.I16))
    return [
        builder.bitcast(_shuffle(builder, words, list(range(h, h + 8)) * 2), v.vec(32, v.I8)) for h in (0, 8)
    ]


def _k4_scales_mins(builder, block):
    """Q4_K's 12 scale bytes at 4 unpacked as ggml's x86 kernel does (three uint32 words and the masks
    0x3f3f3f3f, 0x0f0f0f0f, 0x03030303): `<16 x i8>` sc0 .. sc7, mn0 .. mn7 (`get_scale_min_k4`)."""
    word = lambda j: builder.load(  # noqa: E731
        builder.bitcast(v.at(builder, block, 4 + 4 * j), v.I32.as_pointer()), align=1
    )
    u0, u1, u2 = word(0), word(1), word(2)
    k1, k2, k3 = v.I32(0x3F3F3F3F), v.I32(0x0F0F0F0F), v.I32(0x03030303)

    def top_bits(u):  # bits 6, 7 of each byte, moved to bits 4, 5
        return builder.shl(builder.and_(builder.lshr(u, v.I32(6)), k3), v.I32(4))

    sc_lo = builder.and_(u0, k1)
    sc_hi = builder.or_(builder.and_(u2, k2), top_bits(u0))
    mn_lo = builder.and_(u1, k1)
    mn_hi = builder.or_(builder.and_(builder.lshr(u2, v.I32(4)), k2), top_bits(u1))
    words = ir.Constant(v.vec(4, v.I32), None)
    for i, value in enumerate((sc_lo, sc_hi, mn_lo, mn_hi)):
        words = builder.insert_element(words, value, v.I64(i))
    return builder.bitcast(words, v.vec(16, v.I8))


def _q4_k_block(builder, here, how, lanes, fifth=False):
    """Per super-block of a Q4_K row (Q5_K with `fifth`): (8 weight vectors `<32 x i8>`, one per
    sub-block s: 0 .. 15, Q5_K's 0 .. 31 with bit s of qh[l] at bit 4; the scale source for
    `_scaled_dot`, the mins `<8 x i32>`, d_w, dmin_w as `<L x float>`)."""
    ms = _k4_scales_mins(builder, here)
    byte = v.vec(32, v.I8)
    qh = v.load_vec(builder, here, 16, byte) if fifth else None
    quants = []
    for pair in range(4):  # 32 bytes: sub-block 2 pair in the low nibbles, 2 pair + 1 in the high
        raw = v.load_vec(builder, here, (48 if fifth else 16) + 32 * pair, byte)
        low, high = builder.and_(raw, v.splat(byte, 15)), builder.lshr(raw, v.splat(byte, 4))
        for s, q in ((2 * pair, low), (2 * pair + 1, high)):
            if qh is not None:
                bit = builder.and_(builder.lshr(qh, v.splat(byte, s)), v.splat(byte, 1))
                q = builder.or_(q, builder.shl(bit, v.splat(byte, 4)))
            quants.append(q)
    mins = builder.zext(_shuffle(builder, ms, range(8, 16)), v.vec(8, v.I32))
    dw, dmin = (
        v.half_to_floats(builder, here, lanes),
        v.half_to_floats(builder, v.at(builder, here, 2), lanes),
    )
    return quants, _scale_source(builder, ms, how, False), mins, dw, dmin


def _q6_k_block(builder, here, how, lanes):
    """Per super-block of a Q6_K row: (8 weight vectors `<32 x i8>` 0 .. 63, one per 32 weights t =
    4 h + g, the scale source, the 16 int8 scales as `<16 x i16>`, d_w as `<L x float>`)."""
    quants = []
    for h in range(2):
        qh = v.load_vec(builder, here, 128 + 32 * h, v.vec(32, v.I8))
        for g in range(4):
            low = v.load_vec(builder, here, 64 * h + 32 * (g % 2), v.vec(32, v.I8))
            low = (
                builder.lshr(low, v.splat(v.vec(32, v.I8), 4))
                if g >= 2
                else builder.and_(low, v.splat(v.vec(32, v.I8), 15))
            )
            high = builder.and_(
                builder.lshr(qh, v.splat(v.vec(32, v.I8), 2 * g)), v.splat(v.vec(32, v.I8), 3)
            )
            quants.append(builder.or_(low, builder.shl(high, v.splat(v.vec(32, v.I8), 4))))
    sc = v.load_vec(builder, here, 192, v.vec(16, v.I8))
    dw = v.half_to_floats(builder, v.at(builder, here, 208), lanes)
    return quants, _scale_source(builder, sc, how, True), builder.sext(sc, v.vec(16, v.I16)), dw


def _two_bit_runs(builder, here, start):
    """Q2_K / Q3_K: the 2-bit quants of the 64 bytes at `start` as 8 runs `<32 x i8>` (run g: bits
    2 (g % 4) of bytes 32 (g // 4) + l)."""
    byte = v.vec(32, v.I8)
    runs = []
    for half in range(2):
        raw = v.load_vec(builder, here, start + 32 * half, byte)
        for shift in range(4):
            runs.append(builder.and_(builder.lshr(raw, v.splat(byte, 2 * shift)), v.splat(byte, 3)))
    return runs


def _q2_k_block(builder, here, how, lanes):
    """Per super-block of a Q2_K row: (8 runs `<32 x i8>` 0 .. 3, the scale source of the 16
    sc = scales[j] & 15, the 16 mn = scales[j] >> 4 as `<16 x i16>`, d_w, dmin_w as `<L x float>`)."""
    scales = v.load_vec(builder, here, 0, v.vec(16, v.I8))
    sc = builder.and_(scales, v.splat(v.vec(16, v.I8), 15))
    mn = builder.zext(builder.lshr(scales, v.splat(v.vec(16, v.I8), 4)), v.vec(16, v.I16))
    dw, dmin = (
        v.half_to_floats(builder, v.at(builder, here, 80), lanes),
        v.half_to_floats(builder, v.at(builder, here, 82), lanes),
    )
    return _two_bit_runs(builder, here, 16), _scale_source(builder, sc, how, False), mn, dw, dmin


def _k3_scales(builder, here):
    """Q3_K's 16 six-bit scales minus 32, `<16 x i8>` (-32 .. 31), from the 12 bytes at 96 as ggml's
    x86 kernel unpacks them (three uint32 words, masks 0x0f0f0f0f and 0x03030303)."""
    word = lambda j: builder.load(  # noqa: E731
        builder.bitcast(v.at(builder, here, 96 + 4 * j), v.I32.as_pointer()), align=1
    )
    a0, a1, tmp = word(0), word(1), word(2)
    k1, k2 = v.I32(0x03030303), v.I32(0x0F0F0F0F)

    def high(shift):  # two bits of each byte of tmp, at bits 4, 5
        return builder.shl(builder.and_(builder.lshr(tmp, v.I32(shift)), k1), v.I32(4))

    parts = (
        builder.or_(builder.and_(a0, k2), high(0)),
        builder.or_(builder.and_(a1, k2), high(2)),
        builder.or_(builder.and_(builder.lshr(a0, v.I32(4)), k2), high(4)),
        builder.or_(builder.and_(builder.lshr(a1, v.I32(4)), k2), high(6)),
    )
    words = ir.Constant(v.vec(4, v.I32), None)
    for i, value in enumerate(parts):
        words = builder.insert_element(words, value, v.I64(i))
    return builder.sub(builder.bitcast(words, v.vec(16, v.I8)), v.splat(v.vec(16, v.I8), 32))


def _q3_k_block(builder, here, how, lanes):
    """Per super-block of a Q3_K row: (8 runs `<32 x i8>` u = q2 | hbit << 2, 0 .. 7 (the weight is
    u - 4: ggml subtracts 4 where bit g of hmask[l] is clear), the scale source, the 16 scales as
    `<16 x i16>`, d_w as `<L x float>`)."""
    byte = v.vec(32, v.I8)
    hmask = v.load_vec(builder, here, 0, byte)
    runs = []
    for g, q in enumerate(_two_bit_runs(builder, here, 32)):
        bit = builder.and_(builder.lshr(hmask, v.splat(byte, g)), v.splat(byte, 1))
        runs.append(builder.or_(q, builder.shl(bit, v.splat(byte, 2))))
    sc = _k3_scales(builder, here)
    dw = v.half_to_floats(builder, v.at(builder, here, 108), lanes)
    return runs, _scale_source(builder, sc, how, True), builder.sext(sc, v.vec(16, v.I16)), dw


def _codegen(isa, fmt):
    heights = BLOCK_SPECS[isa][1]
    how, lanes = host_dot(isa)
    block_bytes = _BLOCK_BYTES[fmt]

    def codegen(context, builder, signature, args):
        op = operands(context, builder, signature, args, block_bytes)
        da, sa, ya, row_bytes, q_data, w_data = op.d, op.s, op.y, op.row_bytes, op.q_data, op.w_data
        q_stride, d_stride, s_stride, y_stride, blocks = (
            op.q_stride,
            op.d_stride,
            op.s_stride,
            op.y_stride,
            op.blocks,
        )
        m_count, n_count = op.m_count, op.n_count

        def scaled(d_w, dx):
            """d_w dx as `<L x float>`, d_w a vector (`half_to_floats`) or a scalar."""
            if isinstance(d_w.type, ir.VectorType):
                return builder.fmul(d_w, v.broadcast(builder, dx, lanes))
            return v.broadcast(builder, builder.fmul(d_w, dx), lanes)

        def tile(rows, row0, n):
            acc = v.zeroed(builder, v.vec(lanes), rows)
            w_row = v.at(builder, w_data, builder.mul(n, row_bytes))
            r = [builder.add(row0, v.I64(i)) for i in range(rows)]
            q_rows = [v.at(builder, q_data, builder.mul(ri, q_stride)) for ri in r]
            d_rows = [v.at(builder, da.data, builder.mul(ri, d_stride)) for ri in r]
            s_rows = [v.at(builder, sa.data, builder.mul(ri, s_stride)) for ri in r]
            with v.loop(builder, blocks) as b:
                here = v.at(builder, w_row, builder.mul(b, v.I64(block_bytes)))
                dmin = mins = sc16 = None
                if fmt in ("q4_k", "q5_k"):
                    quants, scales, mins, dw, dmin = _q4_k_block(builder, here, how, lanes, fmt == "q5_k")
                    subs = [(s, s) for s in range(8)]
                elif fmt == "q2_k":
                    quants, scales, mins, dw, dmin = _q2_k_block(builder, here, how, lanes)
                    subs = [(2 * t, 2 * t + 1) for t in range(8)]
                else:
                    block = _q6_k_block if fmt == "q6_k" else _q3_k_block
                    quants, scales, sc16, dw = block(builder, here, how, lanes)
                    subs = [(2 * t, 2 * t + 1) for t in range(8)]
                if rows > 2:  # scalar scales: in wide tiles the vectors' registers spill (measured)
                    dw = builder.extract_element(dw, v.I32(0))
                    dmin = None if dmin is None else builder.extract_element(dmin, v.I32(0))
                k0 = builder.mul(b, v.I64(256))
                isum = [None] * rows
                for t, (lo, hi) in enumerate(subs):
                    for i in range(rows):
                        xq = v.load_vec(builder, q_rows[i], builder.add(k0, v.I64(32 * t)), v.vec(32, v.I8))
                        isum[i] = _scaled_dot(builder, quants[t], xq, scales, lo, hi, how, lanes, isum[i])
                for i in range(rows):
                    bsums = v.load_vec(builder, s_rows[i], builder.mul(b, v.I64(16)), _I32V16)
                    dx = builder.load(v.at(builder, d_rows[i], b))
                    total = builder.load(acc[i])
                    ints = isum[i]
                    if sc16 is not None:  # Q6_K: q - 32, Q3_K: u - 4, as sc (q . x) - 32 (or 4) sc bsums
                        corr = _weighted_bsums(builder, bsums, sc16, how, lanes)
                        shift = 5 if fmt == "q6_k" else 2
                        ints = builder.sub(ints, builder.shl(corr, v.splat(v.vec(lanes, v.I32), shift)))
                    total = v.fma(
                        builder,
                        builder.sitofp(ints, v.vec(lanes)),
                        scaled(dw, dx),
                        total,
                    )
                    if dmin is not None:
                        if fmt == "q2_k":  # a min per 16: mn_j bsums[j]
                            msum = _weighted_bsums(builder, bsums, mins, how, lanes)
                        else:
                            # lane s: mn_s (bsums[2s] + bsums[2s + 1]); narrowing to int16 and vpmaddwd
                            # (as Q6_K's correction) measured slower at one row of x
                            msum = _fold(builder, builder.mul(_fold(builder, bsums, 8), mins), lanes)
                        scale = builder.fneg(scaled(dmin, dx))
                        total = v.fma(builder, builder.sitofp(msum, v.vec(lanes)), scale, total)
                    builder.store(total, acc[i])
            for i in range(rows):
                out = builder.add(builder.mul(r[i], y_stride), n)
                builder.store(v.hsum(builder, builder.load(acc[i])), v.at(builder, ya.data, out))

        with v.loop(builder, n_count) as n:
            v.row_tiles(builder, v.I64(0), m_count, heights, lambda rows, row0: tile(rows, row0, n))
        return context.get_dummy_value()

    return codegen


@intrinsic
def _kquant_matmul(typingctx, q, d, s, w, y, code):
    """y `[M, N]` = x W^T for x's Q8_K quants q int8 `[M, K]`, scales d float32 `[M, K / 256]`, bsums
    s int32 `[M, K / 16]` and W the blocks uint8 `[N, K / 256 * bytes]` of `_KEYS[code]`; q, d, s and
    y with unit-stride rows, W C-contiguous."""
    if not isinstance(code, types.IntegerLiteral):
        return None
    return types.void(q, d, s, w, y, code), _codegen(*_KEYS[code.literal_value])


_JIT: dict[str, Any] = {"nogil": True, "cache": True, "boundscheck": False}


@numba.njit(**_JIT)
def avx512_q4_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 0)  # pyright: ignore[reportCallIssue]  (typingctx is Numba's)


@numba.njit(**_JIT)
def avx512_q6_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 1)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q5_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 2)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q2_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 3)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q3_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 4)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q4_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 5)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q6_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 6)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q5_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 7)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q2_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 8)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q3_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 9)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q4_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 10)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q6_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 11)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q5_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 12)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q2_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 13)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q3_k(x, w, y):
    _kquant_matmul(x[0], x[1], x[2], w, y, 14)  # pyright: ignore[reportCallIssue]


ENTRY_POINTS = {key: globals()[f"{key[0]}_{key[1]}"] for key in _KEYS}
"""(isa, weight format) -> its compiled kernel `(x, w, y)`, x the tuple (q, d, sums) of `_kquant_matmul`
(the contract of `_block_gemm_int_jit.ENTRY_POINTS` and `threads.row_split`)."""
