"""The compiled loops behind `kernels/gemm.py` (float32 and bfloat16 panels); import `gemm`, not this module.

No argument checks here: `kernels/gemm.py` validates shapes and dtypes first. Legend: M rows of x (tokens),
K input features, N output features, NR output features per weight panel, P = ceil(N / NR) panels,
MR rows of x per register tile, L float32 lanes per vector (`isa.ISAS`).

float32 panels `[P, K, NR]`: panel p holds W[p NR : (p + 1) NR, :] transposed, so the NR weights that
one input feature k meets are contiguous (one row of the panel). One tile computes a `[MR, NR]` block
of y = x W^T:

    acc[i, :] = sum over k of x[row0 + i, k] * panel[k, :]      (i < MR; acc held in registers)

Each panel row is loaded once into NR / L vectors and multiplied by MR broadcast inputs, so one pass
over a panel serves MR rows of x: 2 MR NR flops per NR weights read. The kernel walks the panels in
memory order (weights stream from memory once per chunk of `ROW_CHUNK` rows) and, per panel, covers
the rows with tiles of the variant's heights (`PANEL_SPECS`): as many of the tallest as fit, then one
of each smaller height for the remainder.

bfloat16 panels `[P, ceil(K / 2), NR, 2]` (uint16 bit patterns): the pair (k = 2 kk, 2 kk + 1) of each
output feature is adjacent, so one 32-bit lane holds both. Two ways to multiply:
- widening (any variant): load the lanes as 32-bit integers; `lane << 16` is the float32 of the even
  k, `lane & 0xFFFF0000` that of the odd k (bfloat16 is the top half of a float32); two FMAs with
  x[i, 2 kk] and x[i, 2 kk + 1]. Activations and sums stay float32;
- `vdpbf16ps` (AVX-512 BF16): one instruction multiplies 16 pairs of bfloat16 by a broadcast pair of
  x and adds both products to float32 accumulators: 32 multiply-adds. x is rounded to bfloat16 first
  (to nearest even, once per call), as the instruction reads bfloat16 on both sides.

The tiles are LLVM IR (`ir`); `_matmul` emits the whole loop nest for the variant code it is
given, a compile-time constant of each entry point (one entry point per variant, so the call from
Python dispatches on the argument types alone).
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from attention_kv_caceh.kernels import ir as v

__all__: list[str] = []

LANES_PREFETCH = 4096  # bytes of panel prefetched ahead by the rows-in-lanes tile (1, 2, 8, 16 KiB: worse)
ROW_CHUNK = 64  # rows of x per pass over the weights (x's chunk stays in L2 while panels stream)

# (isa, kind, L, NR, tile heights, rows in lanes): kind "f32", "bf16" (widening) or "dpbf16"
# (vdpbf16ps). Registers of a tile of MR rows: MR NR / L accumulators, NR / L (bf16: 2 NR / L) weight
# vectors, a broadcast. With 16 registers (AVX2) an 8-row tile of 16 outputs does not fit, and two
# passes of 4 rows over each panel cost 1.8x one row; so AVX2 puts rows in lanes instead ("rows in
# lanes"): for 2 or more rows, x is transposed into groups of L rows and each of the NR outputs has
# one accumulator holding L rows, acc[j] += x^T[k, :] * broadcast(W[j, k]) (NR + 2 registers), so one
# pass over a panel serves 8 rows. One row takes a plain tile of one `<NR x float>` vector.
_SPECS = (
    ("avx512", "f32", 16, 32, (8, 4, 2, 1), False),  # 16 + 2 + 1 of 32
    ("avx2", "f32", 8, 12, (2, 1), True),  # lanes: 12 + 1 + 1 of 16; plain: 4 + 2 + 1
    ("neon", "f32", 4, 12, (8, 4, 2, 1), False),  # 24 + 3 + 1 of 32
    ("avx512", "bf16", 16, 32, (8, 4, 2, 1), False),  # 16 + 4 + 2 of 32
    ("avx512", "dpbf16", 16, 32, (8, 4, 2, 1), False),  # 16 + 2 + 1 of 32
    ("avx2", "bf16", 8, 12, (2, 1), True),  # lanes: 12 + 2 + 2 of 16; plain: 4 + 4 + 2
    ("neon", "bf16", 4, 12, (6, 4, 2, 1), False),  # 18 + 6 + 2 of 32
)
PANEL_SPECS = {
    (isa, kind): (lanes, nr, heights, in_lanes) for isa, kind, lanes, nr, heights, in_lanes in _SPECS
}


def _dpbf16(builder, acc, a, b):
    """acc + pairwise dot of bfloat16 pairs a, b (`<16 x i32>` each holding 32 bfloat16)."""
    name = "llvm.x86.avx512bf16.dpbf16ps.512"  # <16 x i32> operands: LLVM upgrades them to bfloat
    fnty = ir.FunctionType(acc.type, [acc.type, a.type, b.type])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), [acc, a, b])


def _widen(builder, words, fvec):
    """bfloat16 pairs in 32-bit lanes -> (floats of the low halves, floats of the high halves)."""
    ivec = words.type
    even = builder.bitcast(builder.shl(words, v.splat(ivec, 16)), fvec)
    odd = builder.bitcast(builder.and_(words, v.splat(ivec, -65536)), fvec)
    return even, odd


class _Arrays:
    """Data pointers, strides (elements) and sizes of the kernel's arguments, read once."""

    def __init__(self, context, builder, signature, args, kind):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        pa = context.make_array(signature.args[-3])(context, builder, args[-3])
        ya = context.make_array(signature.args[-2])(context, builder, args[-2])
        self.x, self.y = xa.data, ya.data
        self.x_stride = builder.udiv(builder.extract_value(xa.strides, 0), v.I64(4))
        self.y_stride = builder.udiv(builder.extract_value(ya.strides, 0), v.I64(4))
        self.m_count = builder.extract_value(xa.shape, 0)
        self.p_count = builder.extract_value(pa.shape, 0)
        self.k_steps = builder.extract_value(pa.shape, 1)  # K (f32) or ceil(K / 2) pairs (bf16)
        self.words = pa.data if kind == "f32" else builder.bitcast(pa.data, v.I32.as_pointer())
        self.ta = None
        if len(signature.args) == 5:  # rows in lanes: x^T groups [G, K (bf16: 2 K2), L]
            self.ta = context.make_array(signature.args[1])(context, builder, args[1]).data


def _plain_tile(builder, a, kind, lanes, nr, rows, row0, panel, col):
    """y[row0 : row0 + rows, col : col + NR] = x rows @ panel (acc in registers: NR / L vectors per
    row, and one narrower vector for the rest when L does not divide NR)."""
    widths = [lanes] * (nr // lanes) + ([nr % lanes] if nr % lanes else [])  # e.g. 12 = 8 + 4
    starts = [sum(widths[:j]) for j in range(len(widths))]
    nvec = len(widths)
    outs = [builder.add(builder.mul(builder.add(row0, v.I64(i)), a.y_stride), col) for i in range(rows)]
    acc = [v.zeroed(builder, v.vec(wd), 1)[0] for _ in range(rows) for wd in widths]
    x_rows = [v.at(builder, a.x, builder.mul(builder.add(row0, v.I64(i)), a.x_stride)) for i in range(rows)]
    with v.loop(builder, a.k_steps) as k:
        base = builder.mul(k, v.I64(nr))  # words of one panel row: NR floats or NR pairs
        word = v.F32 if kind == "f32" else v.I32
        w = [
            v.load_vec(builder, panel, builder.add(base, v.I64(s0)), v.vec(wd, word))
            for s0, wd in zip(starts, widths, strict=True)
        ]
        for i in range(rows):
            slots = acc[i * nvec : (i + 1) * nvec]
            if kind == "f32":
                xs = builder.load(v.at(builder, x_rows[i], k))
                for j, slot in enumerate(slots):
                    xi = v.broadcast(builder, xs, widths[j])
                    builder.store(v.fma(builder, xi, w[j], builder.load(slot)), slot)
            elif kind == "bf16":
                k2 = builder.mul(k, v.I64(2))
                x0s = builder.load(v.at(builder, x_rows[i], k2))
                x1s = builder.load(v.at(builder, x_rows[i], builder.add(k2, v.I64(1))))
                for j, slot in enumerate(slots):
                    x0, x1 = v.broadcast(builder, x0s, widths[j]), v.broadcast(builder, x1s, widths[j])
                    even, odd = _widen(builder, w[j], v.vec(widths[j]))
                    builder.store(v.fma(builder, x1, odd, v.fma(builder, x0, even, builder.load(slot))), slot)
            else:  # dpbf16: x rows hold uint32 bfloat16 pairs
                xs = builder.bitcast(builder.load(v.at(builder, x_rows[i], k)), v.I32)
                for j, slot in enumerate(slots):
                    builder.store(
                        _dpbf16(builder, builder.load(slot), v.broadcast(builder, xs, widths[j]), w[j]), slot
                    )
    for i in range(rows):
        for j in range(nvec):
            v.store_vec(builder, builder.load(acc[i * nvec + j]), a.y, builder.add(outs[i], v.I64(starts[j])))


def _lanes_tile(builder, a, kind, lanes, nr, group, panel, col):
    """Rows group * L .. + L - 1 (x^T group `group`) times the panel. The K pass prefetches the panel
    LANES_PREFETCH bytes ahead: without it, a tile this busy keeps too few of the panel's cache
    lines in flight, and from memory it ran at half its in-cache speed."""
    fvec = v.vec(lanes)
    acc = v.zeroed(builder, fvec, nr)
    k_len = a.k_steps if kind == "f32" else builder.mul(a.k_steps, v.I64(2))
    xt = v.at(builder, a.ta, builder.mul(group, builder.mul(k_len, v.I64(lanes))))
    with v.loop(builder, a.k_steps, unroll=False) as k:
        base = builder.mul(k, v.I64(nr))
        v.prefetch(builder, v.at(builder, panel, builder.add(base, v.I64(LANES_PREFETCH // 4))))
        if kind == "f32":
            xk = v.load_vec(builder, xt, builder.mul(k, v.I64(lanes)), fvec)
            for j, slot in enumerate(acc):
                wj = v.broadcast(
                    builder, builder.load(v.at(builder, panel, builder.add(base, v.I64(j)))), lanes
                )
                builder.store(v.fma(builder, xk, wj, builder.load(slot)), slot)
        else:  # bf16 pairs
            k2 = builder.mul(k, v.I64(2 * lanes))
            x0 = v.load_vec(builder, xt, k2, fvec)
            x1 = v.load_vec(builder, xt, builder.add(k2, v.I64(lanes)), fvec)
            for j, slot in enumerate(acc):
                pair = v.broadcast(
                    builder, builder.load(v.at(builder, panel, builder.add(base, v.I64(j)))), lanes
                )
                even, odd = _widen(builder, pair, fvec)
                builder.store(v.fma(builder, x1, odd, v.fma(builder, x0, even, builder.load(slot))), slot)
    row0 = builder.mul(group, v.I64(lanes))
    for i in range(lanes):  # acc[j][i] is y[row0 + i, col + j]; a partial group's lanes past M are not
        row = builder.add(row0, v.I64(i))
        with builder.if_then(builder.icmp_signed("<", row, a.m_count)):
            out = builder.add(builder.mul(row, a.y_stride), col)
            for j, slot in enumerate(acc):
                builder.store(
                    builder.extract_element(builder.load(slot), v.I64(i)),
                    v.at(builder, a.y, builder.add(out, v.I64(j))),
                )


def _lanes_panel(builder, a, kind, lanes, nr, heights, m0, m1, panel, col):
    """Rows m0 .. m1 - 1 of a rows-in-lanes spec: groups of L rows in lanes, the last one partial when
    at least L / 2 rows remain (it costs what a full group costs); fewer remaining rows in plain tiles.
    ROW_CHUNK is a multiple of L, so the chunk's groups start at group m0 / L."""
    span = builder.sub(m1, m0)
    half = v.I64(lanes // 2)
    g_count = builder.udiv(builder.add(span, half), v.I64(lanes))  # rounds up from L / 2 rows
    g0 = builder.udiv(m0, v.I64(lanes))
    with v.loop(builder, g_count) as g:
        _lanes_tile(builder, a, kind, lanes, nr, builder.add(g0, g), panel, col)
    rest = builder.add(m0, builder.mul(g_count, v.I64(lanes)))
    start = builder.select(builder.icmp_signed("<", rest, m1), rest, m1)
    v.row_tiles(
        builder,
        start,
        m1,
        heights,
        lambda rows, row0: _plain_tile(builder, a, kind, lanes, nr, rows, row0, panel, col),
    )


def _matmul_codegen(spec):
    _, kind, lanes, nr, heights, in_lanes = spec

    def codegen(context, builder, signature, args):
        a = _Arrays(context, builder, signature, args, kind)
        per_panel = builder.mul(a.k_steps, v.I64(nr))  # words of one panel
        chunks = builder.udiv(builder.add(a.m_count, v.I64(ROW_CHUNK - 1)), v.I64(ROW_CHUNK))
        with v.loop(builder, chunks) as c:
            m0 = builder.mul(c, v.I64(ROW_CHUNK))
            end = builder.add(m0, v.I64(ROW_CHUNK))
            m1 = builder.select(builder.icmp_signed("<", end, a.m_count), end, a.m_count)
            with v.loop(builder, a.p_count) as p:
                panel = v.at(builder, a.words, builder.mul(p, per_panel))
                col = builder.mul(p, v.I64(nr))
                if not in_lanes:
                    v.row_tiles(
                        builder,
                        m0,
                        m1,
                        heights,
                        lambda rows, row0: _plain_tile(builder, a, kind, lanes, nr, rows, row0, panel, col),
                    )
                else:
                    _lanes_panel(builder, a, kind, lanes, nr, heights, m0, m1, panel, col)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _matmul(typingctx, x, panels, y, code):
    """y `[M, P NR]` = x @ W^T over panels (module docstring) for the spec `_SPECS[code]`.

    x `[M, K]` float32 (dpbf16: `[M, ceil(K / 2)]` uint32 bfloat16 pairs; bf16: K even) with
    unit-stride rows, panels C-contiguous, y with unit-stride rows."""
    if not isinstance(code, types.IntegerLiteral) or _SPECS[code.literal_value][5]:
        return None
    return types.void(x, panels, y, code), _matmul_codegen(_SPECS[code.literal_value])


@intrinsic
def _matmul_lanes(typingctx, x, xt, panels, y, code):
    """As `_matmul` for a rows-in-lanes spec, with x^T `[ceil(M / L), K, L]` (`_lane_groups`)."""
    if not isinstance(code, types.IntegerLiteral) or not _SPECS[code.literal_value][5]:
        return None
    return types.void(x, xt, panels, y, code), _matmul_codegen(_SPECS[code.literal_value])


_JIT: dict[str, Any] = {"nogil": True, "cache": True, "boundscheck": False}


@numba.njit(**_JIT)
def _lane_groups(x, lanes, k_len):
    """x `[M, K]` -> x^T in groups of L rows `[G, k_len, L]` float32 (G as `_lanes_panel` counts
    them), zero past M and K."""
    m_count, k_count = x.shape
    groups = (m_count + lanes // 2) // lanes  # as `_lanes_panel` rounds: a partial group from L / 2 rows
    xt = np.zeros((groups, k_len, lanes), np.float32)
    for m in range(min(m_count, groups * lanes)):
        for k in range(k_count):
            xt[m // lanes, k, m % lanes] = x[m, k]
    return xt


@numba.njit(**_JIT)
def f32_avx512(x, panels, y):
    _matmul(x, panels, y, 0)  # pyright: ignore[reportCallIssue]  (typingctx is Numba's)


@numba.njit(**_JIT)
def f32_avx2(x, panels, y):
    _matmul_lanes(x, _lane_groups(x, 8, panels.shape[1]), panels, y, 1)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def f32_neon(x, panels, y):
    _matmul(x, panels, y, 2)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def bf16_avx512(x, panels, y):
    _matmul(x, panels, y, 3)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def _bf16_pairs(x, k_pairs):
    """x `[M, K]` float32 -> `[M, k_pairs]` uint32: (x[2 kk], x[2 kk + 1]) as bfloat16, low half first,
    rounded to nearest even (K odd: the last pair's high half is zero)."""
    m_count, k_count = x.shape
    out = np.zeros((m_count, k_pairs), np.uint32)
    for m in range(m_count):
        for k in range(k_count):
            b = np.uint32(np.float32(x[m, k]).view(np.uint32))
            r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            out[m, k // 2] |= r << np.uint32(16 * (k % 2))
    return out


@numba.njit(**_JIT)
def dpbf16_avx512(x, panels, y):
    _matmul(_bf16_pairs(x, panels.shape[1]), panels, y, 4)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def bf16_avx2(x, panels, y):
    _matmul_lanes(x, _lane_groups(x, 8, 2 * panels.shape[1]), panels, y, 5)  # pyright: ignore[reportCallIssue]


@numba.njit(**_JIT)
def bf16_neon(x, panels, y):
    _matmul(x, panels, y, 6)  # pyright: ignore[reportCallIssue]


ENTRY_POINTS = {
    ("avx512", "f32"): f32_avx512,
    ("avx2", "f32"): f32_avx2,
    ("neon", "f32"): f32_neon,
    ("avx512", "bf16"): bf16_avx512,
    ("avx512", "dpbf16"): dpbf16_avx512,
    ("avx2", "bf16"): bf16_avx2,
    ("neon", "bf16"): bf16_neon,
}
assert list(ENTRY_POINTS) == list(PANEL_SPECS)  # entry i passes code i


FMA_PROBES = {"avx512": (16, 16), "avx2": (8, 12), "neon": (4, 24)}
"""Variant -> (lanes, independent accumulator chains) of the FMA probe: enough chains to cover the FMA
latency on every pipe (4 cycles x 2 pipes on Zen, twice over), few enough to stay in registers."""


@intrinsic
def _fma_chains(typingctx, iterations, seed, lanes, chains):
    """Run `iterations` rounds of `chains` independent `<lanes x float>` FMAs (acc = acc * a + b); return a
    lane sum so the work cannot be removed. 2 * lanes * chains flops per round."""
    if not (isinstance(lanes, types.IntegerLiteral) and isinstance(chains, types.IntegerLiteral)):
        return None
    width, count = lanes.literal_value, chains.literal_value
    vtype = v.vec(width)

    def codegen(context, builder, signature, args):
        start = v.broadcast(builder, args[1], width)
        a, b = v.splat(vtype, 0.999), v.splat(vtype, 0.001)
        acc = [cgutils.alloca_once_value(builder, start) for _ in range(count)]
        with v.loop(builder, args[0]):
            for slot in acc:
                builder.store(v.fma(builder, builder.load(slot), a, b), slot)
        total = builder.load(acc[0])
        for slot in acc[1:]:
            total = builder.fadd(total, builder.load(slot))
        return builder.extract_element(total, v.I64(0))

    return types.float32(iterations, seed, lanes, chains), codegen


@numba.njit(nogil=True, cache=True, boundscheck=False)
def fma_rounds_avx512(iterations, seed):
    """`iterations` rounds of the FMA probe (FMA_PROBES) in registers; returns a checksum."""
    return _fma_chains(iterations, seed, 16, 16)  # pyright: ignore[reportCallIssue]  (typingctx is Numba's)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def fma_rounds_avx2(iterations, seed):
    """As fma_rounds_avx512, 8 lanes."""
    return _fma_chains(iterations, seed, 8, 12)  # pyright: ignore[reportCallIssue]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def fma_rounds_neon(iterations, seed):
    """As fma_rounds_avx512, 4 lanes."""
    return _fma_chains(iterations, seed, 4, 24)  # pyright: ignore[reportCallIssue]


FMA_ENTRY_POINTS = {"avx512": fma_rounds_avx512, "avx2": fma_rounds_avx2, "neon": fma_rounds_neon}
