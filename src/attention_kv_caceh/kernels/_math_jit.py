"""The scalar helpers every compiled kernel shares: exp for float32, the prefetch hint, a bit cast.

One copy of each: the contiguous and paged decode-attention loops and the fused layers call these, and
`ir.vexp` (the paged kernel's vector exp, in LLVM IR) reads the same Cephes coefficients from here.
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = [
    "EXP_COEFFS",
    "EXP_LOWEST",
    "LN2_HI",
    "LN2_LO",
    "LOG2E",
    "exp_f32",
    "exp_nonpositive",
    "float32_from_bits",
    "prefetch",
]


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the CPU to load the cache line holding flat element `index` of arr's buffer (no fault)."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        address = builder.bitcast(builder.gep(data, [args[1]]), i8p)  # no inbounds: may point past the end
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [address, i32(0), i32(3), i32(1)])  # read, keep in all levels, data cache
        return context.get_dummy_value()

    return types.void(arr, index), codegen


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose IEEE-754 bit pattern is the low 32 bits of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        width = signature.args[0].bitwidth
        low = builder.trunc(args[0], ir.IntType(32)) if width > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


# Cephes expf (S. L. Moshier, Cephes Math Library): exp(x) = 2^n exp(r), r = x - n ln 2 in
# [-ln 2 / 2, ln 2 / 2] (ln 2 in two parts, Cody & Waite), exp(r) by a degree-7 polynomial; about
# 1 ulp in float32 (measured max relative error 6e-8 against float64 exp on [-87, 0]).
LOG2E = 1.44269504088896341
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4
EXP_COEFFS = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
"""exp(r) - 1 - r = r^2 (((((c0 r + c1) r + c2) r + c3) r + c4) r + c5): Cephes expf's polynomial."""
EXP_LOWEST = -87.0  # exp(-87) = 1.6e-38, the smallest 2^n kept normal below
_LOG2E = np.float32(LOG2E)
_LN2_HI, _LN2_LO = np.float32(LN2_HI), np.float32(LN2_LO)
_EXP_P = tuple(np.float32(c) for c in EXP_COEFFS[:4])
_EXP_P4, _EXP_P5 = np.float32(EXP_COEFFS[4]), np.float32(EXP_COEFFS[5])
_EXP_LOWEST = np.float32(EXP_LOWEST)
_HALF, _ONE = np.float32(0.5), np.float32(1.0)


@numba.njit(inline="always", fastmath={"contract"})
def exp_f32(x):
    """exp(x) for float32 x <= 0, vectorisable; x below -87 gives exp(-87) (< 2e-38), not 0."""
    x = max(x, _EXP_LOWEST)
    n = np.floor(x * _LOG2E + _HALF)  # float32 (math.floor gives an int, which promotes to float64)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = ((((_EXP_P[0] * r + _EXP_P[1]) * r + _EXP_P[2]) * r + _EXP_P[3]) * r + _EXP_P4) * r + _EXP_P5
    y = p * r * r + r + _ONE
    two_n = float32_from_bits((np.int64(n) + 127) << 23)  # pyright: ignore[reportCallIssue]  # 2^n, n >= -126
    return y * two_n


def exp_nonpositive(x):
    """exp(x) for x <= 0 (the shifted scores): `exp_f32` for float32, math.exp for float64."""
    return math.exp(x)


@overload(exp_nonpositive, inline="always")
def _exp_nonpositive_impl(x):
    if x == types.float32:
        return lambda x: exp_f32(x)
    return lambda x: math.exp(x)
