"""The compiled loops behind `kernels/block_gemm.py` (GGUF's Q8_0, Q4_0 and Q4_1 blocks); import `block_gemm`.

No argument checks here: `kernels/block_gemm.py` validates first. Legend: M rows of x, K input features
(a multiple of 32), N output features, L float32 lanes per vector (`isa.ISAS`), V = 32 / L vectors
per block, MR rows of x and NR rows of W per register tile.

The weight stays as the GGUF file stores it (ggml's block layout): W `[N, K]` is N rows of K / 32
blocks, each block 32 consecutive weights of one row, with its own scale; the formats' bytes, scale
fields and decode are the rows of `block_formats` (its table), and `_DECODERS` holds each one's decode
in registers.

A tile computes y[m, n] = sum over k of x[m, k] W[n, k] for MR rows and NR weight rows. Per block:
each of the NR rows' block is dequantized in registers (bytes widened to 32-bit lanes, converted to
float, times d (plus m, or minus 8 d), one FMA per vector) into V vectors of L weights, and each of the
MR rows of x meets them with V FMAs into its accumulators (L partial sums each, split over S chains
so that consecutive FMAs do not wait on one another); at the end of the row each accumulator is
summed across its lanes. The NR dequantized vectors serve MR rows: the dequantizing costs 1 / MR of
the multiply-adds. Rows of W are walked in groups of GROUP (read from memory once, then from L1 for
the tiles of the other rows of x), and each height of row tiles covers a group with its own NR.
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
from attention_kv_caceh.kernels.block_formats import FORMATS

__all__: list[str] = []

ROW_CHUNK = 64  # rows of x per pass over the weights

# isa -> (L, GROUP, {MR: (NR, S)}), tile heights in decreasing order. Registers of a tile: MR NR S
# accumulators, NR dequantized vectors and NR (Q4_1: 2 NR) scales, one vector of x. Up to four rows of x,
# one row of W at a time (NR = 1): the blocks then stream from memory in file order, which ran 1.4-2.4x
# faster at one to four rows than four rows of W side by side; eight rows of x take two rows of W, so
# the dequantizing costs 1 / 8 of the multiply-adds (docs/kernels.md).
BLOCK_SPECS = {
    "avx512": (16, 8, {8: (2, 1), 4: (1, 2), 2: (1, 2), 1: (1, 2)}),  # 16 + 2 + 4 + 1 of 32 at most
    "avx2": (8, 4, {4: (2, 1), 2: (1, 4), 1: (1, 4)}),  # 8 + 2 + 4 + 1 of 16 at most
    "neon": (4, 8, {8: (2, 1), 4: (1, 2), 2: (1, 4), 1: (1, 4)}),  # 16 + 2 + 4 + 1 of 32 at most
}
_KEYS = [(isa, fmt) for isa in BLOCK_SPECS for fmt in FORMATS]  # the literal each entry point passes


def _q8_0(builder, lanes, quants, part, d, m):
    raw = v.load_vec(builder, quants, part * lanes, v.vec(lanes, v.I8))
    return builder.fmul(builder.sitofp(builder.sext(raw, v.vec(lanes, v.I32)), v.vec(lanes)), d), part * lanes


def _nibbles(builder, lanes, quants, part):
    """The 4-bit quants part * L .. of a block as `<L x i32>`, and where they sit in the block."""
    ivec = v.vec(lanes, v.I32)
    per_half = 16 // lanes  # vectors of nibbles in one half (16 weights) of the block
    chunk, high = part % per_half, part // per_half
    wide = builder.zext(v.load_vec(builder, quants, chunk * lanes, v.vec(lanes, v.I8)), ivec)
    nibbles = builder.lshr(wide, v.splat(ivec, 4)) if high else builder.and_(wide, v.splat(ivec, 15))
    return nibbles, high * 16 + chunk * lanes


def _q4_0(builder, lanes, quants, part, d, m):
    nibbles, at = _nibbles(builder, lanes, quants, part)
    ivec, fvec = v.vec(lanes, v.I32), v.vec(lanes)
    return builder.fmul(builder.sitofp(builder.sub(nibbles, v.splat(ivec, 8)), fvec), d), at


def _q4_1(builder, lanes, quants, part, d, m):
    nibbles, at = _nibbles(builder, lanes, quants, part)
    return v.fma(builder, builder.sitofp(nibbles, v.vec(lanes)), d, m), at


_DECODERS = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1}
"""Format -> its register decode: (builder, L, quants (i8*), part, d, m) -> (`<L x float>` weights
part * L .., their first index in the block). One entry per row of `block_formats.FORMATS`."""
assert list(_DECODERS) == list(FORMATS)


def _dequantize(builder, fmt, lanes, block, part, scales):
    """Weights part * L .. of the block at `block` (i8*), `<L x float>`, and where they sit in the block.

    The bytes are widened to 32-bit lanes first, so the nibbles come out with 32-bit `and` and shift.
    scales: (d, m) broadcasts, m None for Q8_0 and Q4_0."""
    d, m = scales
    quants = v.at(builder, block, FORMATS[fmt].scale_bytes)
    return _DECODERS[fmt](builder, lanes, quants, part, d, m)


def _scales(builder, fmt, lanes, block):
    """(d, m) of the block at `block` as broadcasts (m None unless Q4_1); Q4_1's two halves are read
    and widened together."""
    if FORMATS[fmt].scales == ("d",):
        return v.broadcast(builder, v.half_to_float(builder, block), lanes), None
    pair = builder.load(builder.bitcast(block, v.vec(2, v.I16).as_pointer()), align=1)
    both = builder.fpext(builder.bitcast(pair, v.vec(2, ir.HalfType())), v.vec(2))
    d, m = (v.broadcast(builder, builder.extract_element(both, v.I64(i)), lanes) for i in (0, 1))
    return d, m


def _codegen(isa, fmt):
    lanes, group, tiles = BLOCK_SPECS[isa]
    block_bytes, block_size = FORMATS[fmt].nbytes, FORMATS[fmt].block
    parts = block_size // lanes  # V
    heights = tuple(sorted(tiles, reverse=True))

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        wa = context.make_array(signature.args[1])(context, builder, args[1])
        ya = context.make_array(signature.args[2])(context, builder, args[2])
        x_stride = builder.udiv(builder.extract_value(xa.strides, 0), v.I64(4))
        y_stride = builder.udiv(builder.extract_value(ya.strides, 0), v.I64(4))
        m_count = builder.extract_value(xa.shape, 0)
        n_count = builder.extract_value(wa.shape, 0)
        row_bytes = builder.extract_value(wa.shape, 1)
        blocks = builder.udiv(row_bytes, v.I64(block_bytes))
        w_data = builder.bitcast(wa.data, v.I8.as_pointer())

        def tile(rows, row0, n0, nr, splits):
            acc = v.zeroed(builder, v.vec(lanes), rows * nr * splits)
            x_rows = [
                v.at(builder, xa.data, builder.mul(builder.add(row0, v.I64(i)), x_stride))
                for i in range(rows)
            ]
            w_rows = [
                v.at(builder, w_data, builder.mul(builder.add(n0, v.I64(j)), row_bytes)) for j in range(nr)
            ]
            with v.loop(builder, blocks) as b:
                here = [v.at(builder, w_row, builder.mul(b, v.I64(block_bytes))) for w_row in w_rows]
                scales = [_scales(builder, fmt, lanes, blk) for blk in here]
                k0 = builder.mul(b, v.I64(block_size))
                for part in range(parts):
                    w = [_dequantize(builder, fmt, lanes, here[j], part, scales[j]) for j in range(nr)]
                    offset = builder.add(k0, v.I64(w[0][1]))
                    for i in range(rows):
                        xv = v.load_vec(builder, x_rows[i], offset, v.vec(lanes))
                        for j in range(nr):
                            slot = acc[(i * nr + j) * splits + part % splits]
                            builder.store(v.fma(builder, xv, w[j][0], builder.load(slot)), slot)
            for i in range(rows):
                out = builder.mul(builder.add(row0, v.I64(i)), y_stride)
                for j in range(nr):
                    chains = [builder.load(acc[(i * nr + j) * splits + s]) for s in range(splits)]
                    total = chains[0]
                    for chain in chains[1:]:
                        total = builder.fadd(total, chain)
                    target = v.at(builder, ya.data, builder.add(out, builder.add(n0, v.I64(j))))
                    builder.store(v.hsum(builder, total), target)

        full = builder.udiv(n_count, v.I64(group))
        chunks = builder.udiv(builder.add(m_count, v.I64(ROW_CHUNK - 1)), v.I64(ROW_CHUNK))
        with v.loop(builder, chunks) as c:
            m0 = builder.mul(c, v.I64(ROW_CHUNK))
            end = builder.add(m0, v.I64(ROW_CHUNK))
            m1 = builder.select(builder.icmp_signed("<", end, m_count), end, m_count)

            def group_tiles(rows, row0, n0):
                nr, splits = tiles[rows]
                for sub in range(group // nr):
                    tile(rows, row0, builder.add(n0, v.I64(sub * nr)), nr, splits)

            with v.loop(builder, full) as g:
                n0 = builder.mul(g, v.I64(group))
                v.row_tiles(builder, m0, m1, heights, lambda rows, row0: group_tiles(rows, row0, n0))
            with v.loop(
                builder, builder.sub(n_count, builder.mul(full, v.I64(group)))
            ) as r:  # rows past the groups
                n = builder.add(builder.mul(full, v.I64(group)), r)
                v.row_tiles(
                    builder, m0, m1, heights, lambda rows, row0: tile(rows, row0, n, 1, tiles[rows][1])
                )
        return context.get_dummy_value()

    return codegen


@intrinsic
def _block_matmul(typingctx, x, w, y, code):
    """y `[M, N]` = x `[M, K]` @ W^T for W the blocks `[N, K / 32 * bytes]` (uint8) of format and
    variant `_KEYS[code]`; x and y float32 with unit-stride rows, W C-contiguous."""
    if not isinstance(code, types.IntegerLiteral):
        return None
    return types.void(x, w, y, code), _codegen(*_KEYS[code.literal_value])


_JIT: dict[str, Any] = {"nogil": True, "cache": True, "boundscheck": False}


@numba.njit(**_JIT)
def avx512_q8_0(x, w, y):
    _block_matmul(x, w, y, 0)  # pyright: ignore[reportCallIssue]  (typingctx is Numba's)


@numba.njit(**_JIT)
def avx512_q4_0(x, w, y):
    _block_matmul(x, w, y, 1)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q4_1(x, w, y):
    _block_matmul(x, w, y, 2)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q8_0(x, w, y):
    _block_matmul(x, w, y, 3)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q4_0(x, w, y):
    _block_matmul(x, w, y, 4)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q4_1(x, w, y):
    _block_matmul(x, w, y, 5)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q8_0(x, w, y):
    _block_matmul(x, w, y, 6)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q4_0(x, w, y):
    _block_matmul(x, w, y, 7)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q4_1(x, w, y):
    _block_matmul(x, w, y, 8)  # pyright: ignore[reportCallIssue]


ENTRY_POINTS = {
    ("avx512", "q8_0"): avx512_q8_0,
    ("avx512", "q4_0"): avx512_q4_0,
    ("avx512", "q4_1"): avx512_q4_1,
    ("avx2", "q8_0"): avx2_q8_0,
    ("avx2", "q4_0"): avx2_q4_0,
    ("avx2", "q4_1"): avx2_q4_1,
    ("neon", "q8_0"): neon_q8_0,
    ("neon", "q4_0"): neon_q4_0,
    ("neon", "q4_1"): neon_q4_1,
}
assert list(ENTRY_POINTS) == _KEYS  # entry i passes code i
