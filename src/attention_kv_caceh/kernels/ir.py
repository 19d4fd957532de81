"""LLVM IR building blocks for the hand-written vector kernels (`_gemm_jit`, `_block_gemm_jit`,
`_decode_attention_paged_ir`); no kernel here.

The register tiles are written in LLVM IR through llvmlite (inside Numba `@intrinsic`s) with explicit
`<L x float>` vectors, L the target's float32 lanes (`isa.ISAS`): written as Numba loops over an
accumulator array, LLVM kept the accumulators in memory (docs/kernels.md). Accumulators live in
allocas of the function's entry block, which LLVM's mem2reg turns into registers. Pointers are typed
(llvmlite's view); offsets count elements of the pointer's type.
"""

# pyright: basic
# (llvmlite's IR builder carries no annotations; neither do these helpers.)

from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir
from numba.core import cgutils

from attention_kv_caceh.kernels._math_jit import EXP_COEFFS, EXP_LOWEST, LN2_HI, LN2_LO, LOG2E

__all__: list[str] = []

F32 = ir.FloatType()
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)


def vec(lanes, element=None):
    """`<lanes x element>` (float32 by default)."""
    return ir.VectorType(F32 if element is None else element, lanes)


def at(builder, base, offset):
    """Pointer to element `offset` of `base` (same element type)."""
    return builder.gep(base, [offset if isinstance(offset, ir.Value) else I64(offset)])


def load_vec(builder, base, offset, vtype):
    """The `vtype` vector that starts at element `offset` of `base` (an unaligned load)."""
    return builder.load(builder.bitcast(at(builder, base, offset), vtype.as_pointer()), align=1)


def store_vec(builder, value, base, offset):
    """Store vector `value` at element `offset` of `base` (unaligned)."""
    builder.store(value, builder.bitcast(at(builder, base, offset), value.type.as_pointer()), align=1)


def broadcast(builder, scalar, lanes):
    """A vector of `lanes` copies of `scalar`."""
    vtype = vec(lanes, scalar.type)
    one = builder.insert_element(ir.Constant(vtype, ir.Undefined), scalar, I64(0))
    return builder.shuffle_vector(
        one, ir.Constant(vtype, ir.Undefined), ir.Constant(vec(lanes, I32), [0] * lanes)
    )


def splat(vtype, value):
    """A constant vector with every lane `value`."""
    return ir.Constant(vtype, [value] * vtype.count)


def fma(builder, a, b, c):
    """a * b + c, one rounding (`llvm.fma`), for float vectors."""
    name = f"llvm.fma.v{a.type.count}f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(fn, [a, b, c])


def hsum(builder, v):
    """The sum of a float vector's lanes, by halving (log2 lanes shuffles and adds)."""
    lanes = v.type.count
    while lanes > 1:
        half = lanes // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(vec(half, I32), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(vec(half, I32), list(range(half, lanes))))
        v, lanes = builder.fadd(lo, hi), half
    return builder.extract_element(v, I64(0))


def half_to_float(builder, byte_ptr):
    """The IEEE half (little-endian, any alignment) at `byte_ptr` (an i8*), widened to float."""
    bits = builder.load(builder.bitcast(byte_ptr, I16.as_pointer()), align=1)
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)


def half_to_floats(builder, byte_ptr, lanes):
    """`<lanes x float>` copies of the IEEE half at `byte_ptr`, as `half_to_float` but widened as a
    vector (`vpbroadcastw` + `vcvtph2ps` on x86). The scalar form compiles to `vpinsrw` into an
    arbitrary register, which waits on that register's last writer: in a loop whose accumulator is
    that register, every block's scale then waits on the previous block's sum."""
    bits = builder.load(builder.bitcast(byte_ptr, I16.as_pointer()), align=1)
    return builder.fpext(
        builder.bitcast(broadcast(builder, bits, lanes), vec(lanes, ir.HalfType())), vec(lanes, F32)
    )


def prefetch(builder, address, locality=3):
    """Hint the CPU to load the cache line at `address` (any pointer; no fault past an array's end);
    locality 3 into every cache level, 2 into L2 and below."""
    i8p = I8.as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(address, i8p), I32(0), I32(locality), I32(1)])  # a read, of data


def zeroed(builder, vtype, count):
    """`count` accumulator slots (entry-block allocas), each set to zero here."""
    slots = [cgutils.alloca_once(builder, vtype) for _ in range(count)]
    for slot in slots:
        builder.store(ir.Constant(vtype, None), slot)
    return slots


@contextmanager
def loop(builder, count, unroll=True):
    """for i in range(count): the body is the with-block; yields i (i64).

    unroll=False hides the counter's step from LLVM (an empty inline-asm copy of i + 1), so that it
    cannot compute the trip count and does not unroll the loop: unrolled, a tile that fills the
    register file interleaves two iterations and spills (docs/kernels.md)."""
    if unroll:
        with cgutils.for_range(builder, count) as it:
            yield it.index
        return
    before = builder.block
    head = builder.append_basic_block("tile.head")
    body = builder.append_basic_block("tile.body")
    done = builder.append_basic_block("tile.done")
    builder.branch(head)
    builder.position_at_end(head)
    index = builder.phi(I64)
    index.add_incoming(I64(0), before)
    builder.cbranch(builder.icmp_signed("<", index, count), body, done)
    builder.position_at_end(body)
    yield index
    step = builder.asm(ir.FunctionType(I64, [I64]), "", "=r,0", [builder.add(index, I64(1))], False)
    index.add_incoming(step, builder.block)
    builder.branch(head)
    builder.position_at_end(done)


def var(builder, value):
    """A mutable i64 slot (entry-block alloca) holding `value`."""
    slot = cgutils.alloca_once(builder, value.type)
    builder.store(value, slot)
    return slot


def row_tiles(builder, start, end, heights, emit):
    """Cover rows start .. end - 1 with tiles: as many of heights[0] as fit, then at most one of each
    smaller height (heights decreasing, each remainder below heights[0] a sum of distinct later ones);
    `emit(height, row0)` builds one tile."""
    first = heights[0]
    full = builder.udiv(builder.sub(end, start), I64(first))
    with loop(builder, full) as t:
        emit(first, builder.add(start, builder.mul(t, I64(first))))
    row = var(builder, builder.add(start, builder.mul(full, I64(first))))
    for h in heights[1:]:
        here = builder.load(row)
        with builder.if_then(builder.icmp_signed("<=", builder.add(here, I64(h)), end)):
            emit(h, here)
            builder.store(builder.add(here, I64(h)), row)


def vexp(builder, x):
    """exp(x) lane by lane for x <= 0 (below -87: exp(-87) ~ 1.6e-38); float vector in, out. Cephes expf,
    the coefficients and range reduction of `_math_jit.exp_f32`."""
    vtype = x.type
    x = builder.select(builder.fcmp_ordered(">", x, splat(vtype, EXP_LOWEST)), x, splat(vtype, EXP_LOWEST))
    floor = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vtype, [vtype]), f"llvm.floor.v{vtype.count}f32"
    )
    n = builder.call(floor, [fma(builder, x, splat(vtype, LOG2E), splat(vtype, 0.5))])
    r = fma(builder, n, splat(vtype, -LN2_HI), x)
    r = fma(builder, n, splat(vtype, -LN2_LO), r)
    p = splat(vtype, EXP_COEFFS[0])
    for c in EXP_COEFFS[1:]:
        p = fma(builder, p, r, splat(vtype, c))
    y = fma(builder, builder.fmul(p, r), r, builder.fadd(r, splat(vtype, 1.0)))
    ivec = vec(vtype.count, I32)
    bits = builder.shl(builder.add(builder.fptosi(n, ivec), splat(ivec, 127)), splat(ivec, 23))
    return builder.fmul(y, builder.bitcast(bits, vtype))


def hreduce(builder, vectors, op):
    """max or sum (op "max" / "add") of all lanes of a list of equal float vectors."""
    total = vectors[0]
    for other in vectors[1:]:
        total = _combine(builder, total, other, op)
    lanes = total.type.count
    while lanes > 1:
        half = lanes // 2
        lo = builder.shuffle_vector(total, total, ir.Constant(vec(half, I32), list(range(half))))
        hi = builder.shuffle_vector(total, total, ir.Constant(vec(half, I32), list(range(half, lanes))))
        total, lanes = _combine(builder, lo, hi, op), half
    return builder.extract_element(total, I64(0))


def _combine(builder, a, b, op):
    if op == "add":
        return builder.fadd(a, b)
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


TANH_SMALL = 0.625  # below it the odd polynomial, from it (1 - e) / (1 + e), e = exp(-2|x|) <= 0.287
TANH_COEFFS = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1)
"""Cephes tanhf: tanh(x) = x + x z P(z), z = x^2, for |x| < 0.625 (relative error 1.3e-7 there)."""


def vtanh(builder, x):
    """tanh(x) lane by lane, float vector in, out; Cephes tanhf's split (`TANH_SMALL`, `TANH_COEFFS`).

    |x| < 0.625: x + x z P(z), relative error <= 1.3e-7 (Cephes). |x| >= 0.625: e = exp(-2|x|) by
    `vexp` (relative error about 1.2e-7; clamped below -87, so tanh is 1 from |x| = 43.5), then
    sign(x) (1 - e) / (1 + e): with e <= 0.287 no cancellation, e's error enters damped by
    2e / (1 - e^2) <= 0.63, and the three operations after it add 3 u (u = 6e-8): <= 3e-7 relative. So both
    branches are within 3e-7 relative (2.5 float32 eps) of tanh(x); NaN in, NaN out."""
    vtype = x.type
    fabs = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vtype, [vtype]), f"llvm.fabs.v{vtype.count}f32"
    )
    copysign = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vtype, [vtype, vtype]), f"llvm.copysign.v{vtype.count}f32"
    )
    ax = builder.call(fabs, [x])
    z = builder.fmul(x, x)
    p = splat(vtype, TANH_COEFFS[0])
    for c in TANH_COEFFS[1:]:
        p = fma(builder, p, z, splat(vtype, c))
    small = fma(builder, builder.fmul(p, z), x, x)
    e = vexp(builder, builder.fmul(ax, splat(vtype, -2.0)))
    one = splat(vtype, 1.0)
    large = builder.call(copysign, [builder.fdiv(builder.fsub(one, e), builder.fadd(one, e)), x])
    return builder.select(builder.fcmp_unordered("<", ax, splat(vtype, TANH_SMALL)), small, large)
