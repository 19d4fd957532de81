"""The compiled loops behind `kernels/block_gemm.py` (every GGUF type of `block_formats`); import `block_gemm`.

No argument checks here: `kernels/block_gemm.py` validates first. Legend: M rows of x, K input features
(a multiple of the block C: 32, or 256 for the k-quants; 32 values for a float type), N output
features, L float32 lanes per vector (`isa.ISAS`), V = C / L vectors per block, MR rows of x and NR
rows of W per register tile.

The weight stays as the GGUF file stores it (ggml's block layout): W `[N, K]` is N rows of K / C
blocks, each block C consecutive weights of one row, with its own scales; the formats' bytes, scale
fields and decode are the rows of `block_formats` (its table), and `_block_gemm_ir.DECODERS` holds
each one's decode in registers.

A tile computes y[m, n] = sum over k of x[m, k] W[n, k] for MR rows and NR weight rows. Per block:
each of the NR rows' block is dequantized in registers (bytes widened to 32-bit lanes, the bits of
each quant picked out, converted to float, times its scale (plus its offset), one multiply or FMA
per vector; `_block_gemm_ir`) into V vectors of L weights, and each of the
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
from numba import types
from numba.extending import intrinsic

from attention_kv_caceh.kernels import ir as v
from attention_kv_caceh.kernels._block_gemm_ir import DECODERS
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


def _codegen(isa, fmt):
    lanes, group, tiles = BLOCK_SPECS[isa]
    block_bytes, block_size = FORMATS[fmt].chunk_bytes, FORMATS[fmt].chunk
    decode = DECODERS[fmt]
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
                memos = [{} for _ in here]  # each row's scales, decoded at their first part
                k0 = builder.mul(b, v.I64(block_size))
                for part in range(parts):
                    w = [decode(builder, lanes, here[j], part, memos[j]) for j in range(nr)]
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
def avx512_q5_0(x, w, y):
    _block_matmul(x, w, y, 3)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q5_1(x, w, y):
    _block_matmul(x, w, y, 4)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q2_k(x, w, y):
    _block_matmul(x, w, y, 5)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q3_k(x, w, y):
    _block_matmul(x, w, y, 6)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q4_k(x, w, y):
    _block_matmul(x, w, y, 7)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q5_k(x, w, y):
    _block_matmul(x, w, y, 8)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_q6_k(x, w, y):
    _block_matmul(x, w, y, 9)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_f32(x, w, y):
    _block_matmul(x, w, y, 10)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_f16(x, w, y):
    _block_matmul(x, w, y, 11)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx512_bf16(x, w, y):
    _block_matmul(x, w, y, 12)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q8_0(x, w, y):
    _block_matmul(x, w, y, 13)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q4_0(x, w, y):
    _block_matmul(x, w, y, 14)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q4_1(x, w, y):
    _block_matmul(x, w, y, 15)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q5_0(x, w, y):
    _block_matmul(x, w, y, 16)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q5_1(x, w, y):
    _block_matmul(x, w, y, 17)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q2_k(x, w, y):
    _block_matmul(x, w, y, 18)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q3_k(x, w, y):
    _block_matmul(x, w, y, 19)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q4_k(x, w, y):
    _block_matmul(x, w, y, 20)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q5_k(x, w, y):
    _block_matmul(x, w, y, 21)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_q6_k(x, w, y):
    _block_matmul(x, w, y, 22)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_f32(x, w, y):
    _block_matmul(x, w, y, 23)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_f16(x, w, y):
    _block_matmul(x, w, y, 24)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def avx2_bf16(x, w, y):
    _block_matmul(x, w, y, 25)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q8_0(x, w, y):
    _block_matmul(x, w, y, 26)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q4_0(x, w, y):
    _block_matmul(x, w, y, 27)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q4_1(x, w, y):
    _block_matmul(x, w, y, 28)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q5_0(x, w, y):
    _block_matmul(x, w, y, 29)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q5_1(x, w, y):
    _block_matmul(x, w, y, 30)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q2_k(x, w, y):
    _block_matmul(x, w, y, 31)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q3_k(x, w, y):
    _block_matmul(x, w, y, 32)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q4_k(x, w, y):
    _block_matmul(x, w, y, 33)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q5_k(x, w, y):
    _block_matmul(x, w, y, 34)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_q6_k(x, w, y):
    _block_matmul(x, w, y, 35)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_f32(x, w, y):
    _block_matmul(x, w, y, 36)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_f16(x, w, y):
    _block_matmul(x, w, y, 37)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def neon_bf16(x, w, y):
    _block_matmul(x, w, y, 38)  # pyright: ignore[reportCallIssue]


ENTRY_POINTS = {
    ("avx512", "q8_0"): avx512_q8_0,
    ("avx512", "q4_0"): avx512_q4_0,
    ("avx512", "q4_1"): avx512_q4_1,
    ("avx512", "q5_0"): avx512_q5_0,
    ("avx512", "q5_1"): avx512_q5_1,
    ("avx512", "q2_k"): avx512_q2_k,
    ("avx512", "q3_k"): avx512_q3_k,
    ("avx512", "q4_k"): avx512_q4_k,
    ("avx512", "q5_k"): avx512_q5_k,
    ("avx512", "q6_k"): avx512_q6_k,
    ("avx512", "f32"): avx512_f32,
    ("avx512", "f16"): avx512_f16,
    ("avx512", "bf16"): avx512_bf16,
    ("avx2", "q8_0"): avx2_q8_0,
    ("avx2", "q4_0"): avx2_q4_0,
    ("avx2", "q4_1"): avx2_q4_1,
    ("avx2", "q5_0"): avx2_q5_0,
    ("avx2", "q5_1"): avx2_q5_1,
    ("avx2", "q2_k"): avx2_q2_k,
    ("avx2", "q3_k"): avx2_q3_k,
    ("avx2", "q4_k"): avx2_q4_k,
    ("avx2", "q5_k"): avx2_q5_k,
    ("avx2", "q6_k"): avx2_q6_k,
    ("avx2", "f32"): avx2_f32,
    ("avx2", "f16"): avx2_f16,
    ("avx2", "bf16"): avx2_bf16,
    ("neon", "q8_0"): neon_q8_0,
    ("neon", "q4_0"): neon_q4_0,
    ("neon", "q4_1"): neon_q4_1,
    ("neon", "q5_0"): neon_q5_0,
    ("neon", "q5_1"): neon_q5_1,
    ("neon", "q2_k"): neon_q2_k,
    ("neon", "q3_k"): neon_q3_k,
    ("neon", "q4_k"): neon_q4_k,
    ("neon", "q5_k"): neon_q5_k,
    ("neon", "q6_k"): neon_q6_k,
    ("neon", "f32"): neon_f32,
    ("neon", "f16"): neon_f16,
    ("neon", "bf16"): neon_bf16,
}
assert list(ENTRY_POINTS) == _KEYS  # entry i passes code i
