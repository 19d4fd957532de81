"""The Numba-compiled loops behind `gemm.py`; import `gemm`, not this module.

No argument checks here: `gemm.py` validates shapes and dtypes first. Legend: M rows of x (tokens),
K input features, N output features, NR = `PANEL_WIDTH` output features per weight panel, P = N / NR
panels, MR rows of x per register tile (8, 4, 2 or 1).

The weight W `[N, K]` is stored as panels `[P, K, NR]`: panel p holds W[p NR : (p + 1) NR, :]
transposed, so the NR weights that one input feature k meets are contiguous (one row of the panel).
`_tile` computes one `[MR, NR]` block of y = x W^T:

    acc[i, :] = sum over k of x[row0 + i, k] * panel[k, :]      (i < MR; acc held in registers)

Each panel row is loaded once into NR / 16 vector registers and multiplied by MR broadcast inputs, so
one pass over a panel serves MR rows of x: 2 MR NR flops per NR weights read. With MR = 8 and NR = 32
the tile keeps 16 accumulators, 2 weight vectors and one broadcast in AVX-512's 32 vector registers.
`packed_matmul` walks the panels in memory order (weights stream from memory once per chunk of
`ROW_CHUNK` rows) and, per panel, covers the rows in tiles of 8, then 4, 2 and 1 for the remainder.

`_tile` is written in LLVM IR (llvmlite) with explicit `<16 x float>` vectors: written as Numba loops
over a `[MR, NR]` accumulator array, LLVM kept the accumulators in memory and emitted scalar or
partial-width FMAs, some 30 times slower (the steps and their measurements: docs/kernels.md).
The IR is the loop above, unrolled over i and over the NR / 16 vectors; LLVM's mem2reg turns the
accumulator slots (allocas) into registers.
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__: list[str] = []

LANES = 16  # float32 lanes of one 512-bit vector
PANEL_WIDTH = 32  # NR: output features per panel, two vectors
ROW_CHUNK = 64  # rows of x per pass over the weights (x's chunk stays in L2 while panels stream)

_VEC = ir.VectorType(ir.FloatType(), LANES)
_I64 = ir.IntType(64)


def _vector_at(builder, base, offset):
    """Pointer to the `<16 x float>` that starts at float element `offset` of `base`."""
    return builder.bitcast(builder.gep(base, [offset]), _VEC.as_pointer())


def _broadcast(builder, scalar):
    """A `<16 x float>` with every lane equal to `scalar`."""
    one = builder.insert_element(ir.Constant(_VEC, ir.Undefined), scalar, _I64(0))
    return builder.shuffle_vector(
        one, ir.Constant(_VEC, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
    )


@intrinsic
def _tile(typingctx, x, panel, y, row0, col0, mr, nr):
    """y[row0 : row0 + MR, col0 : col0 + NR] = x[row0 : row0 + MR, :] @ panel (module docstring).

    x `[M, K]` and y `[M, N_pad]` float32 with unit-stride rows, panel `[K, NR]` C-contiguous float32;
    mr and nr are compile-time constants (NR a multiple of 16)."""
    if not (isinstance(mr, types.IntegerLiteral) and isinstance(nr, types.IntegerLiteral)):
        return None
    rows, width = mr.literal_value, nr.literal_value
    vectors = width // LANES

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        pa = context.make_array(signature.args[1])(context, builder, args[1])
        ya = context.make_array(signature.args[2])(context, builder, args[2])
        row0_, col0_ = args[3], args[4]
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]), "llvm.fma.v16f32"
        )
        zero = ir.Constant(_VEC, [0.0] * LANES)
        acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(vectors)] for _ in range(rows)]
        x_stride = builder.udiv(builder.extract_value(xa.strides, 0), _I64(4))  # floats per row of x
        y_stride = builder.udiv(builder.extract_value(ya.strides, 0), _I64(4))
        x_rows = [
            builder.gep(xa.data, [builder.mul(builder.add(row0_, _I64(i)), x_stride)]) for i in range(rows)
        ]
        k_count = builder.extract_value(pa.shape, 0)
        with cgutils.for_range(builder, k_count) as loop:
            k = loop.index
            panel_row = builder.mul(k, _I64(width))
            w = [
                builder.load(_vector_at(builder, pa.data, builder.add(panel_row, _I64(LANES * j))), align=4)
                for j in range(vectors)
            ]
            for i in range(rows):
                xi = _broadcast(builder, builder.load(builder.gep(x_rows[i], [k])))
                for j in range(vectors):
                    builder.store(builder.call(fma, [xi, w[j], builder.load(acc[i][j])]), acc[i][j])
        for i in range(rows):
            out = builder.add(builder.mul(builder.add(row0_, _I64(i)), y_stride), col0_)
            for j in range(vectors):
                target = _vector_at(builder, ya.data, builder.add(out, _I64(LANES * j)))
                builder.store(builder.load(acc[i][j]), target, align=4)
        return context.get_dummy_value()

    return types.void(x, panel, y, row0, col0, mr, nr), codegen


@numba.njit(nogil=True, cache=True, boundscheck=False)
def packed_matmul(x, panels, y):
    """y `[M, P NR]` = x `[M, K]` @ W^T for W packed as panels `[P, K, NR]` (float32)."""
    m_count = x.shape[0]
    for chunk in range(0, m_count, ROW_CHUNK):
        end = min(chunk + ROW_CHUNK, m_count)
        for p in range(panels.shape[0]):
            panel = panels[p]  # [K, NR]
            col = p * PANEL_WIDTH
            m = chunk
            while m + 8 <= end:
                _tile(x, panel, y, m, col, 8, PANEL_WIDTH)  # pyright: ignore[reportCallIssue]
                m += 8
            if m + 4 <= end:
                _tile(x, panel, y, m, col, 4, PANEL_WIDTH)  # pyright: ignore[reportCallIssue]
                m += 4
            if m + 2 <= end:
                _tile(x, panel, y, m, col, 2, PANEL_WIDTH)  # pyright: ignore[reportCallIssue]
                m += 2
            if m < end:
                _tile(x, panel, y, m, col, 1, PANEL_WIDTH)  # pyright: ignore[reportCallIssue]


_CHAINS = 16  # independent accumulators: FMA latency (4 cycles) x 2 pipes, twice over


@intrinsic
def _fma_chains(typingctx, iterations, seed):
    """Run `iterations` rounds of 16 independent `<16 x float>` FMAs (acc = acc * a + b); return a lane
    sum so the work cannot be removed. 512 flops per round."""

    def codegen(context, builder, signature, args):
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]), "llvm.fma.v16f32"
        )
        start = _broadcast(builder, args[1])
        a = ir.Constant(_VEC, [0.999] * LANES)
        b = ir.Constant(_VEC, [0.001] * LANES)
        acc = [cgutils.alloca_once_value(builder, start) for _ in range(_CHAINS)]
        with cgutils.for_range(builder, args[0]):
            for slot in acc:
                builder.store(builder.call(fma, [builder.load(slot), a, b]), slot)
        total = builder.load(acc[0])
        for slot in acc[1:]:
            total = builder.fadd(total, builder.load(slot))
        return builder.extract_element(total, _I64(0))

    return types.float32(iterations, seed), codegen


@numba.njit(nogil=True, cache=True, boundscheck=False)
def fma_rounds(iterations, seed):
    """`iterations` * 512 float32 flops in registers (the FMA probe); returns a checksum."""
    return _fma_chains(iterations, seed)  # pyright: ignore[reportCallIssue]  (typingctx is Numba's)
