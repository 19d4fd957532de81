"""The compiled loops behind `kernels.paged_decode_attention`; import `kernels`, not this module.

No argument checks here: `kernels.py` validates first. Shape legend as in attention.py; NB physical KV
blocks of BS positions, G = H // H_kv query heads per KV head, L float32 lanes (`LANES`: 8, or 4 on NEON).

Layout (vLLM's CPU layout): per block and KV head, a K tile `[D, BS]` (positions innermost) and a V
tile `[BS, D]`; `paged_attention.allocate_kv_cache` puts the two tiles of a (block, head) next to each
other and the heads of a block after one another, so a block is one contiguous stretch of memory. With
positions innermost, the scores of a block are BS / L vectors: s[:] = sum over d of q[d] * K[d, :],
one FMA per d and vector, no horizontal sum per score (the layout `[BS, H_kv, D]` needs a sum across
lanes for every score).

One pass per block (`_fold_block`, LLVM IR), for each query head g of the KV head, folding the block
into g's running state (m, z, acc) with the online softmax (Milakov & Gimelshein 2018):
    s = q_g K_tile (positions past the context set to -inf);  m' = max(m, max s)
    p = exp(s - m');  z = z exp(m - m') + sum p;  acc = acc exp(m - m') + sum_t p[t] V_tile[t]
so each block is read once, K tile then V tile, while it is in L1. The exp is the Cephes polynomial of
`_kernels_jit._exp_f32` on vectors. While a tile is folded, the same head's tile of the table's next
block is prefetched into L2, a line every few steps: blocks lie in arbitrary places, so the CPU's own
prefetchers cannot run ahead across them, and a burst of hints for a whole block at once mostly went
unanswered (docs/kernels.md has the measurements).

The IR kernel covers float32 with (D, BS) = (64, 16) or (128, 16) (`_SHAPES`); everything else
(float64, other sizes) takes `_fold_block_plain`, the same steps as Numba loops.
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from attention_kv_caceh import _simd_ir as v
from attention_kv_caceh._kernels_jit import _exp_nonpositive
from attention_kv_caceh.simd import compiled_variant

__all__: list[str] = []

_TARGET = compiled_variant()
# float32 lanes of the IR vectors: at most 8 (256 bits), also on AVX-512, where 8 lanes read the KV
# faster than 16 (docs/kernels.md, the paged kernel in vLLM's CPU layout, has the measurement).
LANES = min(8, _TARGET.lanes) if _TARGET is not None else 4
_SHAPES = ((64, 16), (128, 16))  # (D, BS) the IR kernel is specialised for
CHUNKS = tuple(
    max(1, min(4 if d == 64 else 2, (_TARGET.registers if _TARGET else 16) // 2 // (d // LANES)))
    for d, _ in _SHAPES
)
"""Query heads folded together per shape: their accumulators (D / L vectors each) take at most half
the vector registers."""

# Cephes expf, as `_kernels_jit._exp_f32` (coefficients and range reduction there).
_LOG2E, _LN2_HI, _LN2_LO = 1.44269504088896341, 0.693359375, -2.12194440e-4
_EXP_P = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)


def _vexp(builder, x):
    """exp(x) lane by lane for x <= 0 (below -87: exp(-87) ~ 1.6e-38); float vector in, out."""
    vtype = x.type
    x = builder.select(builder.fcmp_ordered(">", x, v.splat(vtype, -87.0)), x, v.splat(vtype, -87.0))
    floor = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vtype, [vtype]), f"llvm.floor.v{vtype.count}f32"
    )
    n = builder.call(floor, [v.fma(builder, x, v.splat(vtype, _LOG2E), v.splat(vtype, 0.5))])
    r = v.fma(builder, n, v.splat(vtype, -_LN2_HI), x)
    r = v.fma(builder, n, v.splat(vtype, -_LN2_LO), r)
    p = v.splat(vtype, _EXP_P[0])
    for c in _EXP_P[1:]:
        p = v.fma(builder, p, r, v.splat(vtype, c))
    y = v.fma(builder, builder.fmul(p, r), r, builder.fadd(r, v.splat(vtype, 1.0)))
    ivec = v.vec(vtype.count, v.I32)
    bits = builder.shl(builder.add(builder.fptosi(n, ivec), v.splat(ivec, 127)), v.splat(ivec, 23))
    return builder.fmul(y, builder.bitcast(bits, vtype))


def _hreduce(builder, vectors, op):
    """max or sum (op "max" / "add") of all lanes of a list of equal float vectors."""
    total = vectors[0]
    for other in vectors[1:]:
        total = _combine(builder, total, other, op)
    lanes = total.type.count
    while lanes > 1:
        half = lanes // 2
        lo = builder.shuffle_vector(total, total, ir.Constant(v.vec(half, v.I32), list(range(half))))
        hi = builder.shuffle_vector(total, total, ir.Constant(v.vec(half, v.I32), list(range(half, lanes))))
        total, lanes = _combine(builder, lo, hi, op), half
    return builder.extract_element(total, v.I64(0))


def _combine(builder, a, b, op):
    if op == "add":
        return builder.fadd(a, b)
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


@intrinsic
def _fold_block(
    typingctx, qs, k_cache, v_cache, block, head, g0, valid, acc, state, ahead, d_lit, bs_lit, heads_lit
):
    """Fold block `block` of KV head `head` into the state of query heads g0 .. g0 + heads - 1.

    qs `[H, D]` float32 (q already times the scale), k_cache `[NB, H_kv, D, BS]` and v_cache
    `[NB, H_kv, BS, D]` float32 with contiguous tiles, valid: positions of the block in the context
    (1 .. BS), acc `[H, D]` and state `[H, 2]` (m, z) float32, updated in place. d_lit, bs_lit,
    heads_lit: D, BS and the number of query heads, compile-time constants. The heads share each load
    of the K and V tiles, and their chains of dependent steps (scores, max, exp, sums) interleave."""
    literal = (d_lit, bs_lit, heads_lit)
    if not all(isinstance(x, types.IntegerLiteral) for x in literal):
        return None
    d_count, block_size, heads = (x.literal_value for x in literal)
    lanes = LANES
    nv, dv = block_size // lanes, d_count // lanes  # score vectors per head, vectors per V row
    splits = max(1, 4 // heads)  # chains per score vector: 4 chains at least in all
    fvec = v.vec(lanes)

    def codegen(context, builder, signature, args):
        qa, ka, va, aa, sa = (
            context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 7, 8)
        )

        def i64(x):
            return builder.sext(x, v.I64) if x.type.width < 64 else x

        blk, j, g0_, valid_, ahead_ = (i64(args[i]) for i in (3, 4, 5, 6, 9))

        def stride(arr, axis):
            return builder.udiv(builder.extract_value(arr.strides, axis), v.I64(4))

        def tile(arr, block_id):
            return v.at(
                builder,
                arr.data,
                builder.add(builder.mul(block_id, stride(arr, 0)), builder.mul(j, stride(arr, 1))),
            )

        k_tile, v_tile = tile(ka, blk), tile(va, blk)
        k_next, v_next = tile(ka, ahead_), tile(va, ahead_)  # prefetched into L2 as this block is folded
        lines = d_count * block_size // 16  # 64-byte lines per tile
        rows = [builder.add(g0_, v.I64(h)) for h in range(heads)]
        q_rows = [v.at(builder, qa.data, builder.mul(r, v.I64(d_count))) for r in rows]
        acc_rows = [v.at(builder, aa.data, builder.mul(r, v.I64(d_count))) for r in rows]
        states = [v.at(builder, sa.data, builder.mul(r, v.I64(2))) for r in rows]
        # Scores: per head nv vectors, each summed over `splits` chains of d.
        chains = v.zeroed(builder, fvec, heads * nv * splits)
        steps = d_count // splits
        per_step = -(-lines // steps)  # K lines of the next tile to prefetch per step
        with v.loop(builder, v.I64(steps)) as dd:
            for c in range(per_step):
                line = builder.add(builder.mul(dd, v.I64(per_step)), v.I64(c))
                v.prefetch(builder, v.at(builder, k_next, builder.mul(line, v.I64(16))), locality=2)
            for u in range(splits):
                d = builder.add(builder.mul(dd, v.I64(splits)), v.I64(u))
                kd = [
                    v.load_vec(
                        builder,
                        k_tile,
                        builder.add(builder.mul(d, v.I64(block_size)), v.I64(n * lanes)),
                        fvec,
                    )
                    for n in range(nv)
                ]
                for h in range(heads):
                    qd = v.broadcast(builder, builder.load(v.at(builder, q_rows[h], d)), lanes)
                    for n in range(nv):
                        slot = chains[(h * nv + n) * splits + u]
                        builder.store(v.fma(builder, qd, kd[n], builder.load(slot)), slot)
        index = [ir.Constant(v.vec(lanes, v.I32), list(range(n * lanes, (n + 1) * lanes))) for n in range(nv)]
        limit = v.broadcast(builder, builder.trunc(valid_, v.I32), lanes)
        keep = [builder.icmp_signed("<", index[n], limit) for n in range(nv)]
        minus_inf, zero = v.splat(fvec, float("-inf")), ir.Constant(fvec, None)
        probs, alphas = [], []
        for h in range(heads):
            scores = []
            for n in range(nv):
                parts = [builder.load(chains[(h * nv + n) * splits + u]) for u in range(splits)]
                total = parts[0]
                for part in parts[1:]:
                    total = builder.fadd(total, part)
                scores.append(builder.select(keep[n], total, minus_inf))
            m_old, z_old = builder.load(states[h]), builder.load(v.at(builder, states[h], 1))
            top = _hreduce(builder, scores, "max")
            m_new = builder.select(builder.fcmp_ordered(">", top, m_old), top, m_old)
            new = v.broadcast(builder, m_new, lanes)
            alpha = builder.extract_element(
                _vexp(builder, builder.fsub(v.broadcast(builder, m_old, lanes), new)), v.I64(0)
            )
            p = [
                builder.select(keep[n], _vexp(builder, builder.fsub(scores[n], new)), zero) for n in range(nv)
            ]
            builder.store(m_new, states[h])
            builder.store(
                builder.fadd(builder.fmul(z_old, alpha), _hreduce(builder, p, "add")),
                v.at(builder, states[h], 1),
            )
            probs.append(p)
            alphas.append(v.broadcast(builder, alpha, lanes))
        accs = [cgutils.alloca_once(builder, fvec) for _ in range(heads * dv)]
        for h in range(heads):
            for e in range(dv):
                builder.store(
                    builder.fmul(v.load_vec(builder, acc_rows[h], e * lanes, fvec), alphas[h]),
                    accs[h * dv + e],
                )

        def add_row(t, p_t):  # p_t: one broadcast per head
            for e in range(dv):
                vt = v.load_vec(
                    builder, v_tile, builder.add(builder.mul(t, v.I64(d_count)), v.I64(e * lanes)), fvec
                )
                for h in range(heads):
                    slot = accs[h * dv + e]
                    builder.store(v.fma(builder, p_t[h], vt, builder.load(slot)), slot)

        with builder.if_else(builder.icmp_signed("==", valid_, v.I64(block_size))) as (whole, part):
            with whole:  # every row, unrolled; the next V tile's lines prefetched along the way
                for t in range(block_size):
                    for c in range(t * lines // block_size, (t + 1) * lines // block_size):
                        v.prefetch(builder, v.at(builder, v_next, c * 16), locality=2)
                    lane = ir.Constant(v.vec(lanes, v.I32), [t % lanes] * lanes)
                    add_row(
                        v.I64(t), [builder.shuffle_vector(p[t // lanes], p[t // lanes], lane) for p in probs]
                    )
            with part:  # the context's last block: rows below valid only (the rest may hold anything)
                spill = cgutils.alloca_once(builder, ir.ArrayType(v.F32, heads * block_size))
                base = builder.bitcast(spill, v.F32.as_pointer())
                for h in range(heads):
                    for n in range(nv):
                        v.store_vec(builder, probs[h][n], base, h * block_size + n * lanes)
                with v.loop(builder, valid_) as t:
                    p_t = [
                        v.broadcast(
                            builder,
                            builder.load(v.at(builder, base, builder.add(t, v.I64(h * block_size)))),
                            lanes,
                        )
                        for h in range(heads)
                    ]
                    add_row(t, p_t)
        for h in range(heads):
            for e in range(dv):
                v.store_vec(builder, builder.load(accs[h * dv + e]), acc_rows[h], e * lanes)
        return context.get_dummy_value()

    sig = types.void(
        qs, k_cache, v_cache, block, head, g0, valid, acc, state, ahead, d_lit, bs_lit, heads_lit
    )
    return sig, codegen


_JIT: dict[str, Any] = {
    "nogil": True,
    "cache": True,
    "fastmath": {"reassoc", "contract", "nsz", "arcp"},
    "error_model": "numpy",
    "boundscheck": False,
}


@numba.njit(**_JIT)
def _fold_block_plain(qs, k_cache, v_cache, block, head, g, valid, acc, state, s):
    """`_fold_block` as Numba loops, for any dtype and size; s: a scratch row `[BS]`."""
    d_count = qs.shape[1]
    top = state[g, 0]
    for t in range(valid):
        dot = qs[g, 0] * 0.0
        for d in range(d_count):
            dot += qs[g, d] * k_cache[block, head, d, t]
        s[t] = dot
        top = max(top, dot)
    alpha = math.exp(state[g, 0] - top)
    total = state[g, 1] * alpha
    for t in range(valid):
        p = _exp_nonpositive(s[t] - top)
        s[t] = p
        total += p
    state[g, 0] = top
    state[g, 1] = total
    for d in range(d_count):
        acc[g, d] *= alpha
    for t in range(valid):
        p = s[t]
        for d in range(d_count):
            acc[g, d] += p * v_cache[block, head, t, d]


def _fold(qs, k_cache, v_cache, block, head, g0, heads, valid, acc, state, s, ahead, fast):
    """Fold one block of one KV head into query heads g0 .. g0 + heads - 1: the IR kernel for the
    (D, BS) it is specialised for (fast: the index in _SHAPES; heads <= CHUNKS[fast]), else (fast -1,
    or not float32) the Numba loops, one head at a time."""
    raise NotImplementedError("compiled only")  # `_fold_impl` is what njit code calls


@numba.njit(**_JIT)
def _fold_plain(qs, k_cache, v_cache, block, head, g0, heads, valid, acc, state, s):
    """`_fold` by the Numba loops, one query head at a time."""
    for g in range(g0, g0 + heads):
        _fold_block_plain(qs, k_cache, v_cache, block, head, g, valid, acc, state, s)


@overload(_fold, inline="always")
def _fold_impl(qs, k_cache, v_cache, block, head, g0, heads, valid, acc, state, s, ahead, fast):
    if qs.dtype != types.float32:
        return lambda qs, k_cache, v_cache, block, head, g0, heads, valid, acc, state, s, ahead, fast: (
            _fold_plain(qs, k_cache, v_cache, block, head, g0, heads, valid, acc, state, s)
        )

    def impl(qs, k_cache, v_cache, block, head, g0, heads, valid, acc, state, s, ahead, fast):
        if fast == 0:  # D 64, BS 16
            if heads == 4:
                _fold_block(qs, k_cache, v_cache, block, head, g0, valid, acc, state, ahead, 64, 16, 4)  # pyright: ignore[reportCallIssue]
            elif heads == 3:
                _fold_block(qs, k_cache, v_cache, block, head, g0, valid, acc, state, ahead, 64, 16, 3)  # pyright: ignore[reportCallIssue]
            elif heads == 2:
                _fold_block(qs, k_cache, v_cache, block, head, g0, valid, acc, state, ahead, 64, 16, 2)  # pyright: ignore[reportCallIssue]
            else:
                _fold_block(qs, k_cache, v_cache, block, head, g0, valid, acc, state, ahead, 64, 16, 1)  # pyright: ignore[reportCallIssue]
        elif fast == 1:  # D 128, BS 16
            if heads == 2:
                _fold_block(qs, k_cache, v_cache, block, head, g0, valid, acc, state, ahead, 128, 16, 2)  # pyright: ignore[reportCallIssue]
            else:
                _fold_block(qs, k_cache, v_cache, block, head, g0, valid, acc, state, ahead, 128, 16, 1)  # pyright: ignore[reportCallIssue]
        else:
            _fold_plain(qs, k_cache, v_cache, block, head, g0, heads, valid, acc, state, s)

    return impl


def fast_shape(dtype, d_count, block_size, tiles_contiguous):
    """The index in _SHAPES the IR kernel takes for these arguments, or -1 (the Numba loops)."""
    if dtype != np.float32 or not tiles_contiguous or (d_count, block_size) not in _SHAPES:
        return -1
    if d_count % LANES or block_size % LANES or d_count % 4:
        return -1
    return _SHAPES.index((d_count, block_size))


@numba.njit(**_JIT)
def _sequence(q, k_cache, v_cache, block_tables, context_lens, out, scale, fast, b, qs, acc, state, s):
    """Sequence b: its blocks in table order, each folded into the H query heads' state."""
    h_count, d_count = q.shape[1], q.shape[2]
    h_kv, block_size = k_cache.shape[1], k_cache.shape[3]
    g_count = h_count // h_kv
    chunk = CHUNKS[fast] if fast >= 0 else 1
    for g in range(h_count):
        for d in range(d_count):
            qs[g, d] = q[b, g, d] * scale
            acc[g, d] = 0.0
        state[g, 0] = -np.inf
        state[g, 1] = 0.0
    n_ctx = context_lens[b]
    n_blocks = (n_ctx + block_size - 1) // block_size
    for i in range(n_blocks):
        block = block_tables[b, i]
        ahead = block_tables[b, i + 1] if i + 1 < n_blocks else block  # prefetched while block i is folded
        valid = min(block_size, n_ctx - i * block_size)
        for j in range(h_kv):
            g = j * g_count
            while g < (j + 1) * g_count:
                heads = min(chunk, (j + 1) * g_count - g)
                _fold(qs, k_cache, v_cache, block, j, g, heads, valid, acc, state, s, ahead, fast)
                g += heads
    for g in range(h_count):
        inv = 1.0 / state[g, 1] if state[g, 1] > 0 else 0.0
        for d in range(d_count):
            out[b, g, d] = acc[g, d] * inv


@numba.njit(**_JIT)
def paged_serial(q, k_cache, v_cache, block_tables, context_lens, out, scale, fast):
    """q [B, H, D], k_cache [NB, H_kv, D, BS], v_cache [NB, H_kv, BS, D], block_tables [B, max_blocks],
    context_lens [B] -> out [B, H, D]; fast: `fast_shape` of the arguments."""
    h_count, d_count = q.shape[1], q.shape[2]
    qs = np.empty((h_count, d_count), q.dtype)
    acc = np.empty((h_count, d_count), q.dtype)
    state = np.empty((h_count, 2), q.dtype)
    s = np.empty(k_cache.shape[3], q.dtype)
    for b in range(q.shape[0]):
        _sequence(q, k_cache, v_cache, block_tables, context_lens, out, scale, fast, b, qs, acc, state, s)


@numba.njit(parallel=True, **_JIT)
def paged_parallel(q, k_cache, v_cache, block_tables, context_lens, out, scale, fast):
    """As `paged_serial`, the B sequences spread over Numba's threads."""
    h_count, d_count = q.shape[1], q.shape[2]
    for b in numba.prange(q.shape[0]):
        qs = np.empty((h_count, d_count), q.dtype)
        acc = np.empty((h_count, d_count), q.dtype)
        state = np.empty((h_count, 2), q.dtype)
        s = np.empty(k_cache.shape[3], q.dtype)
        _sequence(q, k_cache, v_cache, block_tables, context_lens, out, scale, fast, b, qs, acc, state, s)
