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
from dataclasses import dataclass
from typing import Any, NamedTuple

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


@dataclass(frozen=True)
class _Shape:
    """What one `_fold_block` is compiled for: D, BS, the query heads folded together, L lanes."""

    d_count: int
    block_size: int
    heads: int
    lanes: int

    @property
    def fvec(self):
        return v.vec(self.lanes)  # <L x float>

    @property
    def nv(self):
        return self.block_size // self.lanes  # score vectors per head

    @property
    def dv(self):
        return self.d_count // self.lanes  # vectors per V row and per accumulator row

    @property
    def splits(self):
        return max(1, 4 // self.heads)  # chains per score vector: 4 chains at least in all

    @property
    def lines(self):
        return self.d_count * self.block_size // 16  # 64-byte lines per tile


class _Operands(NamedTuple):
    """Pointers (float*) and the valid count (i64) one `_fold_block` works on."""

    k_tile: Any  # K tile [D, BS] of the block and KV head
    v_tile: Any  # V tile [BS, D]
    k_next: Any  # the same head's tiles of the table's next block, prefetched into L2
    v_next: Any
    q_rows: list[Any]  # per folded head h: row g0 + h of qs [H, D]
    acc_rows: list[Any]  # ... of acc [H, D]
    states: list[Any]  # ... of state [H, 2], (m, z)
    valid: Any  # positions of the block in the context, 1 .. BS


def _i64(builder, x):
    """Integer x sign-extended to i64 (unchanged if it is one)."""
    return builder.sext(x, v.I64) if x.type.width < 64 else x


def _tile(builder, arr, block, head):
    """float* to the (block, head) tile of a cache array `[NB, H_kv, ...]` (i64 indices)."""

    def stride(axis):  # in float32 elements
        return builder.udiv(builder.extract_value(arr.strides, axis), v.I64(4))

    return v.at(builder, arr.data, builder.add(builder.mul(block, stride(0)), builder.mul(head, stride(1))))


def _emit_operands(context, builder, signature, args, shape):
    """Emit the address arithmetic of `_fold_block`'s arguments: the tiles of this block and of the
    next one, the rows of the folded heads in qs, acc and state; an `_Operands`."""
    qa, ka, va, aa, sa = (
        context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 7, 8)
    )
    blk, head, g0, valid, ahead = (_i64(builder, args[i]) for i in (3, 4, 5, 6, 9))
    k_tile, v_tile = _tile(builder, ka, blk, head), _tile(builder, va, blk, head)
    k_next, v_next = _tile(builder, ka, ahead, head), _tile(builder, va, ahead, head)
    rows = [builder.add(g0, v.I64(h)) for h in range(shape.heads)]
    q_rows = [v.at(builder, qa.data, builder.mul(r, v.I64(shape.d_count))) for r in rows]
    acc_rows = [v.at(builder, aa.data, builder.mul(r, v.I64(shape.d_count))) for r in rows]
    states = [v.at(builder, sa.data, builder.mul(r, v.I64(2))) for r in rows]
    return _Operands(k_tile, v_tile, k_next, v_next, q_rows, acc_rows, states, valid)


def _emit_score_chains(builder, shape, k_tile, k_next, q_rows):
    """Emit the dot products of the folded heads' q (float32 [D] each) with the K tile's columns.

    Returns heads * nv * splits allocas of <L x float>; slot (h * nv + n) * splits + u holds
    sum over d = u (mod splits) of q_h[d] * K[d, n L : (n + 1) L], so each score vector is summed
    over `splits` independent FMA chains. A loop of D / splits steps; each step loads the nv K
    vectors of a row d once for all heads, and prefetches the next K tile's 64-byte lines into L2,
    a few per step so that the last step has covered the tile."""
    lanes, nv, splits, fvec = shape.lanes, shape.nv, shape.splits, shape.fvec
    chains = v.zeroed(builder, fvec, shape.heads * nv * splits)
    steps = shape.d_count // splits
    per_step = -(-shape.lines // steps)  # K lines of the next tile to prefetch per step
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
                    builder.add(builder.mul(d, v.I64(shape.block_size)), v.I64(n * lanes)),
                    fvec,
                )
                for n in range(nv)
            ]
            for h in range(shape.heads):
                qd = v.broadcast(builder, builder.load(v.at(builder, q_rows[h], d)), lanes)
                for n in range(nv):
                    slot = chains[(h * nv + n) * splits + u]
                    builder.store(v.fma(builder, qd, kd[n], builder.load(slot)), slot)
    return chains


def _emit_masked_scores(builder, shape, chains, h, keep):
    """Emit head h's scores s [BS] as nv <L x float>: its chains summed, -inf past the context
    (keep: per score vector an <L x i1>, true for positions below valid)."""
    nv, splits = shape.nv, shape.splits
    minus_inf = v.splat(shape.fvec, float("-inf"))
    scores = []
    for n in range(nv):
        parts = [builder.load(chains[(h * nv + n) * splits + u]) for u in range(splits)]
        total = parts[0]
        for part in parts[1:]:
            total = builder.fadd(total, part)
        scores.append(builder.select(keep[n], total, minus_inf))
    return scores


def _emit_state_update(builder, shape, scores, keep, state):
    """Emit the online-softmax step of one head: m' = max(m, max s), p = exp(s - m') (0 past the
    context), z = z exp(m - m') + sum p, stored to state (float* to (m, z)).

    Returns p (nv <L x float>) and alpha = exp(m - m') broadcast to an <L x float>."""
    lanes = shape.lanes
    zero = ir.Constant(shape.fvec, None)
    m_old, z_old = builder.load(state), builder.load(v.at(builder, state, 1))
    top = _hreduce(builder, scores, "max")
    m_new = builder.select(builder.fcmp_ordered(">", top, m_old), top, m_old)
    new = v.broadcast(builder, m_new, lanes)
    alpha = builder.extract_element(
        _vexp(builder, builder.fsub(v.broadcast(builder, m_old, lanes), new)), v.I64(0)
    )
    p = [builder.select(keep[n], _vexp(builder, builder.fsub(scores[n], new)), zero) for n in range(shape.nv)]
    builder.store(m_new, state)
    builder.store(
        builder.fadd(builder.fmul(z_old, alpha), _hreduce(builder, p, "add")),
        v.at(builder, state, 1),
    )
    return p, v.broadcast(builder, alpha, lanes)


def _emit_softmax(builder, shape, chains, states, valid):
    """Emit the scores and the state update of every folded head (states: float* per head, valid:
    i64). Returns probs (per head, nv <L x float> of p) and alphas (per head, <L x float>)."""
    lanes = shape.lanes
    index = [
        ir.Constant(v.vec(lanes, v.I32), list(range(n * lanes, (n + 1) * lanes))) for n in range(shape.nv)
    ]
    limit = v.broadcast(builder, builder.trunc(valid, v.I32), lanes)
    keep = [builder.icmp_signed("<", index[n], limit) for n in range(shape.nv)]
    probs, alphas = [], []
    for h in range(shape.heads):
        scores = _emit_masked_scores(builder, shape, chains, h, keep)
        p, alpha = _emit_state_update(builder, shape, scores, keep, states[h])
        probs.append(p)
        alphas.append(alpha)
    return probs, alphas


def _emit_rescaled_acc(builder, shape, acc_rows, alphas):
    """Emit acc * alpha for every folded head into heads * dv allocas of <L x float> (slot
    h * dv + e: lanes e L .. (e + 1) L of head h), which the V rows are then added to."""
    lanes, dv = shape.lanes, shape.dv
    accs = [cgutils.alloca_once(builder, shape.fvec) for _ in range(shape.heads * dv)]
    for h in range(shape.heads):
        for e in range(dv):
            builder.store(
                builder.fmul(v.load_vec(builder, acc_rows[h], e * lanes, shape.fvec), alphas[h]),
                accs[h * dv + e],
            )
    return accs


def _emit_add_row(builder, shape, accs, v_tile, t, p_t):
    """Emit acc_h += p_h[t] * V[t, :] for every folded head: row t (i64) of the V tile loaded once,
    p_t one <L x float> broadcast of p_h[t] per head."""
    lanes, dv = shape.lanes, shape.dv
    for e in range(dv):
        offset = builder.add(builder.mul(t, v.I64(shape.d_count)), v.I64(e * lanes))
        vt = v.load_vec(builder, v_tile, offset, shape.fvec)
        for h in range(shape.heads):
            slot = accs[h * dv + e]
            builder.store(v.fma(builder, p_t[h], vt, builder.load(slot)), slot)


def _emit_whole_block(builder, shape, accs, v_tile, v_next, probs):
    """Emit the V accumulation of a full block (valid = BS): all BS rows unrolled, p[t] taken from its
    score vector by a lane shuffle, and the next V tile's 64-byte lines prefetched along the way."""
    lanes, block_size = shape.lanes, shape.block_size
    for t in range(block_size):
        for c in range(t * shape.lines // block_size, (t + 1) * shape.lines // block_size):
            v.prefetch(builder, v.at(builder, v_next, c * 16), locality=2)
        lane = ir.Constant(v.vec(lanes, v.I32), [t % lanes] * lanes)
        p_t = [builder.shuffle_vector(p[t // lanes], p[t // lanes], lane) for p in probs]
        _emit_add_row(builder, shape, accs, v_tile, v.I64(t), p_t)


def _emit_partial_block(builder, shape, accs, v_tile, probs, valid):
    """Emit the V accumulation of the context's last block: rows t < valid (i64) only, in a loop (the
    rows past it may hold anything), p spilled to a float32 [heads, BS] alloca to be read per row."""
    block_size = shape.block_size
    spill = cgutils.alloca_once(builder, ir.ArrayType(v.F32, shape.heads * block_size))
    base = builder.bitcast(spill, v.F32.as_pointer())
    for h in range(shape.heads):
        for n in range(shape.nv):
            v.store_vec(builder, probs[h][n], base, h * block_size + n * shape.lanes)
    with v.loop(builder, valid) as t:
        p_t = [
            v.broadcast(
                builder, builder.load(v.at(builder, base, builder.add(t, v.I64(h * block_size)))), shape.lanes
            )
            for h in range(shape.heads)
        ]
        _emit_add_row(builder, shape, accs, v_tile, t, p_t)


@intrinsic
def _fold_block(
    typingctx, qs, k_cache, v_cache, block, head, g0, valid, acc, state, ahead, d_lit, bs_lit, heads_lit
):
    """Fold block `block` of KV head `head` into the state of query heads g0 .. g0 + heads - 1.

    qs `[H, D]` float32 (q already times the scale), k_cache `[NB, H_kv, D, BS]` and v_cache
    `[NB, H_kv, BS, D]` float32 with contiguous tiles, valid: positions of the block in the context
    (1 .. BS), acc `[H, D]` and state `[H, 2]` (m, z) float32, updated in place; ahead: the block
    whose tiles are prefetched. d_lit, bs_lit, heads_lit: D, BS and the number of query heads,
    compile-time constants. The heads share each load of the K and V tiles, and their chains of
    dependent steps (scores, max, exp, sums) interleave. The phases, one emitter each: scores
    (`_emit_score_chains`), online softmax (`_emit_softmax`), acc rescaled (`_emit_rescaled_acc`),
    V rows added (`_emit_whole_block`, or `_emit_partial_block` for the last block)."""
    literal = (d_lit, bs_lit, heads_lit)
    if not all(isinstance(x, types.IntegerLiteral) for x in literal):
        return None
    d_count, block_size, heads = (x.literal_value for x in literal)
    shape = _Shape(d_count, block_size, heads, LANES)

    def codegen(context, builder, signature, args):
        ops = _emit_operands(context, builder, signature, args, shape)
        chains = _emit_score_chains(builder, shape, ops.k_tile, ops.k_next, ops.q_rows)
        probs, alphas = _emit_softmax(builder, shape, chains, ops.states, ops.valid)
        accs = _emit_rescaled_acc(builder, shape, ops.acc_rows, alphas)
        with builder.if_else(builder.icmp_signed("==", ops.valid, v.I64(block_size))) as (whole, part):
            with whole:
                _emit_whole_block(builder, shape, accs, ops.v_tile, ops.v_next, probs)
            with part:
                _emit_partial_block(builder, shape, accs, ops.v_tile, probs, ops.valid)
        for h in range(heads):
            for e in range(shape.dv):
                v.store_vec(builder, builder.load(accs[h * shape.dv + e]), ops.acc_rows[h], e * LANES)
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
