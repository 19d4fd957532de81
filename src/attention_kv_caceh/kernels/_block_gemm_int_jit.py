"""Integer-dot block kernels: 8-bit activations (`activation_quant`) times GGUF weight blocks; import `block_gemm_int`.

No argument checks here: `kernels/block_gemm_int.py` validates first. Legend as `_block_gemm_jit`:
M rows of x, K input features (a multiple of 32), N output features, L int32 lanes per vector
(`BLOCK_SPECS`), MR rows of x per tile.

Per block of 32 (ggml's `ggml_vec_dot_q4_1_q8_1` and its siblings, ggml-cpu/arch/x86/quants.c):
the weight's 32 quants qw (unsigned 0 .. 15 for Q4_0 / Q4_1, 0 .. 31 for Q5_0 / Q5_1 with the fifth
bit from qh, the int8 of Q8_0) and the row of x's 32 quants qx (int8) are multiplied (|qw qx| <=
128 * 127 fits in int16), the products of neighbouring lanes are added in 32 bits (`vpmaddwd`), and
the sums are folded to L lanes; those lanes, converted to float32 (exact: at most 32 * 128 * 127 in
magnitude), meet one FMA with the broadcast of d_w d_x (one float32 rounding) into the row's
accumulator. The 4- and 5-bit types add m_w s_x (s_x = d_x sum(qx), Q8_1's sum; m_w the block's m,
or -8 d_w for Q4_0 and -16 d_w for Q5_0: `_OFFSET`) into a scalar accumulator. At the end of the row
the lanes are summed. So y[m, n] is sum_b d_w d_x (qw . qx) + m_w s_x with K / 32 + log2 L + 2
float32 roundings per term, whatever tile or chunk of rows of W or x it is computed in.

The kernel walks W one row at a time (its blocks stream in file order, the next ones prefetched
`_PREFETCH` bytes ahead) against tiles of MR rows of x, one accumulator per row of x. Tried on AVX2
(Zen 3), W [49152, 576] in Q8_0 at one row of x: 2.6 ms with one row of W per tile against 4.9 with
two rows and 6.3 with four side by side. The loop over blocks is unrolled for tiles of one or two
rows of x (Q8_0 above: 2.4 against 4.3 ms rolled), not for wider ones, which then spill.
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

from typing import Any, NamedTuple

import numba
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

from attention_kv_caceh.kernels import ir as v

__all__: list[str] = []

# isa -> (L int32 lanes of the generic form, row tile heights in decreasing order)
BLOCK_SPECS = {"avx512": (16, (8, 4, 2, 1)), "avx2": (8, (8, 4, 2, 1)), "neon": (4, (4, 2, 1))}
INT_FORMATS = ("q4_1", "q4_0", "q8_0", "q5_0", "q5_1")
"""Weight formats with an integer-dot kernel, in the order of the entry points' codes."""
_BLOCK_BYTES = {"q4_1": 20, "q4_0": 18, "q8_0": 34, "q5_0": 22, "q5_1": 24}
_QS_AT = {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}  # byte offset of the 16 bytes of nibbles
_OFFSET = {"q4_1": None, "q5_1": None, "q4_0": -8.0, "q5_0": -16.0}
"""Formats multiplied as unsigned quants q (0 .. 15 or 0 .. 31) with an offset: weight = d q + m, m the
block's m (Q4_1, Q5_1; None here) or d times this constant (Q4_0: q - 8, Q5_0: q - 16). Each block then
adds m_w s_x (s_x = d_x sum(qx), Q8_1's sum) in one scalar FMA, in place of moving the weight's sign
onto x for every product."""
_KEYS = [(isa, fmt) for isa in BLOCK_SPECS for fmt in INT_FORMATS]
_PREFETCH = 768  # bytes ahead of the block being read, in the row of W (about 12 cache lines)


def _weight_quants(builder, fmt, block):
    """The block's 32 weight quants as `<32 x i8>` (ggml's order: low nibbles, then high ones, Q5's
    fifth bit j of the little-endian 32-bit qh on lane j), and whether they are signed (Q8_0) or not
    (the 4- and 5-bit types: 0 .. 15 or 0 .. 31, their offset in `_OFFSET`)."""
    bytes32 = v.vec(32, v.I8)
    if fmt == "q8_0":
        return v.load_vec(builder, block, 2, bytes32), True
    raw = v.load_vec(builder, block, _QS_AT[fmt], v.vec(16, v.I8))
    low = builder.and_(raw, v.splat(v.vec(16, v.I8), 15))
    high = builder.lshr(raw, v.splat(v.vec(16, v.I8), 4))
    q = builder.shuffle_vector(low, high, ir.Constant(v.vec(32, v.I32), list(range(32))))
    if fmt in ("q5_0", "q5_1"):
        qh = v.load_vec(builder, block, _QS_AT[fmt] - 4, v.vec(4, v.I8))
        spread = builder.shuffle_vector(qh, qh, ir.Constant(v.vec(32, v.I32), [j // 8 for j in range(32)]))
        bit = builder.and_(spread, ir.Constant(bytes32, [1 << (j % 8) for j in range(32)]))
        fifth = builder.select(
            builder.icmp_unsigned("!=", bit, ir.Constant(bytes32, None)),
            v.splat(bytes32, 16),
            ir.Constant(bytes32, None),
        )
        q = builder.or_(q, fifth)
    return q, False


def _x86(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _dot(builder, wq, signed, xq, lanes, how):
    """`<L x i32>` whose lanes sum to wq . xq (two `<32 x i8>`), each lane the sum of 4 or more
    neighbouring products. how: "vnni" (`vpdpbusd`: u8 x s8, four products summed into each int32
    lane), "pmadd" (`vpmaddubsw`: u8 x s8 pairs -> int16, saturating, not reached as |2 w x| <= 2 * 128
    * 127; then `vpmaddwd` by ones: int16 pairs -> int32), or "generic" (int16 products, pairs in 32
    bits, halving). The x86 forms need the unsigned operand: signed weights go as |w| with the sign
    moved onto x (`vpsignb`)."""
    if how == "generic":
        wide = v.vec(32, v.I16)
        prod = builder.mul((builder.sext if signed else builder.zext)(wq, wide), builder.sext(xq, wide))
        even = builder.shuffle_vector(prod, prod, ir.Constant(v.vec(16, v.I32), list(range(0, 32, 2))))
        odd = builder.shuffle_vector(prod, prod, ir.Constant(v.vec(16, v.I32), list(range(1, 32, 2))))
        acc = builder.add(builder.sext(even, v.vec(16, v.I32)), builder.sext(odd, v.vec(16, v.I32)))
        width = 16
        while width > lanes:
            half = width // 2
            lo = builder.shuffle_vector(acc, acc, ir.Constant(v.vec(half, v.I32), list(range(half))))
            hi = builder.shuffle_vector(acc, acc, ir.Constant(v.vec(half, v.I32), list(range(half, width))))
            acc, width = builder.add(lo, hi), half
        return acc
    bytes32 = v.vec(32, v.I8)
    if signed:
        xq = _x86(builder, "llvm.x86.avx2.psign.b", bytes32, [xq, wq])
        wq = _x86(builder, "llvm.abs.v32i8", bytes32, [wq, ir.Constant(ir.IntType(1), 0)])
    if how == "vnni":
        ints = v.vec(8, v.I32)
        a, b = builder.bitcast(wq, ints), builder.bitcast(xq, ints)
        return _x86(builder, "llvm.x86.avx512.vpdpbusd.256", ints, [ir.Constant(ints, None), a, b])
    pairs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", v.vec(16, v.I16), [wq, xq])
    ones = v.splat(v.vec(16, v.I16), 1)
    return _x86(builder, "llvm.x86.avx2.pmadd.wd", v.vec(8, v.I32), [pairs, ones])


def host_dot(isa: str) -> tuple[str, int]:
    """The integer dot product compiled for `isa`'s kernel (`_dot`'s how) and its int32 lanes, from
    the CPU Numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set, else this host)."""
    if getattr(config, "CPU_NAME", None):
        features = {f[1:]: f[0] == "+" for f in (getattr(config, "CPU_FEATURES", None) or "").split(",") if f}
    else:
        features = dict(llvm.get_host_cpu_features())
    if isa != "neon" and features.get("avx2", False):
        vnni = isa == "avx512" and features.get("avx512vnni", False) and features.get("avx512vl", False)
        return ("vnni" if vnni else "pmadd"), 8
    return "generic", BLOCK_SPECS[isa][0]


class Operands(NamedTuple):
    """What an integer-dot kernel's codegen reads of its five arrays (q, d, s, w, y): the arrays,
    their row strides (q's in bytes, d's, s's and y's in elements of 4 bytes), M, N, the bytes of a
    row of W and its blocks of `block_bytes`, and q's and W's data as i8 pointers."""

    q: Any
    d: Any
    s: Any
    w: Any
    y: Any
    q_stride: Any
    d_stride: Any
    s_stride: Any
    y_stride: Any
    m_count: Any
    n_count: Any
    row_bytes: Any
    blocks: Any
    q_data: Any
    w_data: Any


def operands(context, builder, signature, args, block_bytes):
    """The `Operands` of a call `(q, d, s, w, y)` (`_int_matmul`, `_kquant_matmul`)."""
    qa, da, sa, wa, ya = (context.make_array(signature.args[i])(context, builder, args[i]) for i in range(5))
    four = v.I64(4)
    row_bytes = builder.extract_value(wa.shape, 1)
    return Operands(
        qa, da, sa, wa, ya,
        builder.extract_value(qa.strides, 0),
        builder.udiv(builder.extract_value(da.strides, 0), four),
        builder.udiv(builder.extract_value(sa.strides, 0), four),
        builder.udiv(builder.extract_value(ya.strides, 0), four),
        builder.extract_value(qa.shape, 0),
        builder.extract_value(wa.shape, 0),
        row_bytes,
        builder.udiv(row_bytes, v.I64(block_bytes)),
        builder.bitcast(qa.data, v.I8.as_pointer()),
        builder.bitcast(wa.data, v.I8.as_pointer()),
    )  # fmt: skip


def _codegen(isa, fmt):
    heights = BLOCK_SPECS[isa][1]
    how, lanes = host_dot(isa)
    block_bytes = _BLOCK_BYTES[fmt]
    with_offset = fmt in _OFFSET

    def codegen(context, builder, signature, args):
        op = operands(context, builder, signature, args, block_bytes)
        da, sa, ya, row_bytes, q_data, w_data = op.d, op.s, op.y, op.row_bytes, op.q_data, op.w_data
        q_stride, d_stride, y_stride, blocks = op.q_stride, op.d_stride, op.y_stride, op.blocks
        m_count, n_count = op.m_count, op.n_count

        def tile(rows, row0, n):
            """y[row0 .. row0 + rows, n]: one accumulator per row of x."""
            acc = v.zeroed(builder, v.vec(lanes), rows)
            offsets = (v.zeroed(builder, v.vec(lanes) if rows <= 2 else v.F32, rows)) if with_offset else []
            w_row = v.at(builder, w_data, builder.mul(n, row_bytes))
            r = [builder.add(row0, v.I64(i)) for i in range(rows)]
            q_rows = [v.at(builder, q_data, builder.mul(ri, q_stride)) for ri in r]
            d_rows = [v.at(builder, da.data, builder.mul(ri, d_stride)) for ri in r]
            s_rows = [v.at(builder, sa.data, builder.mul(ri, d_stride)) for ri in r]
            with v.loop(builder, blocks, unroll=rows <= 2) as b:  # wider tiles spill when unrolled
                here = v.at(builder, w_row, builder.mul(b, v.I64(block_bytes)))
                v.prefetch(builder, v.at(builder, here, _PREFETCH))
                wq, signed = _weight_quants(builder, fmt, here)
                dw = v.half_to_floats(builder, here, lanes)
                mw = None
                if with_offset:
                    m = _OFFSET[fmt]
                    mw = (
                        v.half_to_floats(builder, v.at(builder, here, 2), lanes)
                        if m is None
                        else builder.fmul(dw, v.splat(v.vec(lanes), m))
                    )
                k0 = builder.mul(b, v.I64(32))
                for i in range(rows):
                    xq = v.load_vec(builder, q_rows[i], k0, v.vec(32, v.I8))
                    dot = builder.sitofp(_dot(builder, wq, signed, xq, lanes, how), v.vec(lanes))
                    dx = v.broadcast(builder, builder.load(v.at(builder, d_rows[i], b)), lanes)
                    builder.store(v.fma(builder, dot, builder.fmul(dw, dx), builder.load(acc[i])), acc[i])
                    if mw is not None and rows <= 2:
                        sx = v.broadcast(builder, builder.load(v.at(builder, s_rows[i], b)), lanes)
                        builder.store(v.fma(builder, mw, sx, builder.load(offsets[i])), offsets[i])
                    elif mw is not None:
                        sx = builder.load(v.at(builder, s_rows[i], b))
                        m0 = builder.extract_element(mw, v.I32(0))
                        total = _x86(builder, "llvm.fma.f32", v.F32, [m0, sx, builder.load(offsets[i])])
                        builder.store(total, offsets[i])
            for i in range(rows):
                total = v.hsum(builder, builder.load(acc[i]))
                if offsets:
                    offset = builder.load(offsets[i])
                    if rows <= 2:
                        offset = builder.extract_element(offset, v.I32(0))
                    total = builder.fadd(total, offset)
                out = builder.add(builder.mul(r[i], y_stride), n)
                builder.store(total, v.at(builder, ya.data, out))

        with v.loop(builder, n_count) as n:  # one row of W at a time: the blocks stream in file order
            v.row_tiles(builder, v.I64(0), m_count, heights, lambda rows, row0: tile(rows, row0, n))
        return context.get_dummy_value()

    return codegen


@intrinsic
def _int_matmul(typingctx, q, d, s, w, y, code):
    """y `[M, N]` = x W^T for x's quants q int8 `[M, K]`, scales d and sums s float32 `[M, K / 32]`
    (`activation_quant`) and W the blocks uint8 `[N, K / 32 * bytes]` of `_KEYS[code]`; q, d, s and y
    with unit-stride rows, W C-contiguous."""
    if not isinstance(code, types.IntegerLiteral):
        return None
    return types.void(q, d, s, w, y, code), _codegen(*_KEYS[code.literal_value])


_JIT: dict[str, Any] = {"nogil": True, "cache": True, "boundscheck": False}


@numba.njit(**_JIT)
def avx512_q4_1(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 0)  # pyright: ignore[reportCallIssue]  (typingctx is Numba's)


@numba.njit(**_JIT)
def avx512_q4_0(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 1)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q8_0(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 2)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q5_0(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 3)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q5_1(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 4)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q4_1(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 5)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q4_0(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 6)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q8_0(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 7)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q5_0(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 8)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q5_1(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 9)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q4_1(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 10)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q4_0(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 11)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q8_0(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 12)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q5_0(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 13)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q5_1(x, w, y):
    _int_matmul(x[0], x[1], x[2], w, y, 14)  # pyright: ignore[reportCallIssue]


ENTRY_POINTS = {key: globals()[f"{key[0]}_{key[1]}"] for key in _KEYS}
"""(isa, weight format) -> its compiled kernel `(x, w, y)`, x the tuple (q, d, s) of `_int_matmul`
(the `(x, W rows, y columns)` contract of `threads.row_split`)."""
