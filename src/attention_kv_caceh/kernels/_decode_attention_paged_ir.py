"""The LLVM IR of the paged kernel's block fold, one emitter per phase; `_decode_attention_paged_jit._fold_block` calls them.

Shapes and layout as `_decode_attention_paged_jit.py` describes: a K tile `[D, BS]` and a V tile `[BS, D]` float32 per
(block, KV head), L float32 lanes per vector. Each `_emit_*` function appends the instructions of one
phase of the fold to `builder` (llvmlite), for `_Shape`'s compile-time D, BS and query heads.
"""

# pyright: basic
# (llvmlite's builder API carries no annotations.)

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from llvmlite import ir
from numba.core import cgutils

from attention_kv_caceh.kernels import ir as v


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
    first: Any  # the block's first position inside the window, 0 .. valid - 1 (i64)
    valid: Any  # positions of the block in the context, 1 .. BS (i64)
    cap: Any  # the softcap c (float), 0 for none


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
        context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 8, 9)
    )
    blk, head, g0, first, valid, ahead = (_i64(builder, args[i]) for i in (3, 4, 5, 6, 7, 10))
    cap = args[11] if args[11].type == v.F32 else builder.fptrunc(args[11], v.F32)
    k_tile, v_tile = _tile(builder, ka, blk, head), _tile(builder, va, blk, head)
    k_next, v_next = _tile(builder, ka, ahead, head), _tile(builder, va, ahead, head)
    rows = [builder.add(g0, v.I64(h)) for h in range(shape.heads)]
    q_rows = [v.at(builder, qa.data, builder.mul(r, v.I64(shape.d_count))) for r in rows]
    acc_rows = [v.at(builder, aa.data, builder.mul(r, v.I64(shape.d_count))) for r in rows]
    states = [v.at(builder, sa.data, builder.mul(r, v.I64(2))) for r in rows]
    return _Operands(k_tile, v_tile, k_next, v_next, q_rows, acc_rows, states, first, valid, cap)


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


def _emit_raw_scores(builder, shape, chains):
    """Head h's scores s [BS] as nv <L x float> for every folded head: its chains summed."""
    nv, splits = shape.nv, shape.splits
    heads = []
    for h in range(shape.heads):
        scores = []
        for n in range(nv):
            parts = [builder.load(chains[(h * nv + n) * splits + u]) for u in range(splits)]
            total = parts[0]
            for part in parts[1:]:
                total = builder.fadd(total, part)
            scores.append(total)
        heads.append(scores)
    return heads


def _emit_softcap(builder, shape, scores, cap):
    """Emit s -> c tanh(s / c) on every score vector when cap c (float) > 0, else s unchanged; one
    branch for all folded heads. Returns scores of the same structure (a list per head)."""
    slots = [[cgutils.alloca_once(builder, shape.fvec) for _ in row] for row in scores]
    for row, slot_row in zip(scores, slots, strict=True):
        for x, slot in zip(row, slot_row, strict=True):
            builder.store(x, slot)
    with builder.if_then(builder.fcmp_ordered(">", cap, ir.Constant(v.F32, 0.0))):
        c = v.broadcast(builder, cap, shape.lanes)
        inv = v.broadcast(builder, builder.fdiv(ir.Constant(v.F32, 1.0), cap), shape.lanes)
        for row, slot_row in zip(scores, slots, strict=True):
            for x, slot in zip(row, slot_row, strict=True):
                builder.store(builder.fmul(c, v.vtanh(builder, builder.fmul(x, inv))), slot)
    return [[builder.load(slot) for slot in slot_row] for slot_row in slots]


def _emit_state_update(builder, shape, scores, keep, state):
    """Emit the online-softmax step of one head: m' = max(m, max s), p = exp(s - m') (0 past the
    context), z = z exp(m - m') + sum p, stored to state (float* to (m, z)).

    Returns p (nv <L x float>) and alpha = exp(m - m') broadcast to an <L x float>."""
    lanes = shape.lanes
    zero = ir.Constant(shape.fvec, None)
    m_old, z_old = builder.load(state), builder.load(v.at(builder, state, 1))
    top = v.hreduce(builder, scores, "max")
    m_new = builder.select(builder.fcmp_ordered(">", top, m_old), top, m_old)
    new = v.broadcast(builder, m_new, lanes)
    alpha = builder.extract_element(
        v.vexp(builder, builder.fsub(v.broadcast(builder, m_old, lanes), new)), v.I64(0)
    )
    p = [
        builder.select(keep[n], v.vexp(builder, builder.fsub(scores[n], new)), zero) for n in range(shape.nv)
    ]
    builder.store(m_new, state)
    builder.store(
        builder.fadd(builder.fmul(z_old, alpha), v.hreduce(builder, p, "add")),
        v.at(builder, state, 1),
    )
    return p, v.broadcast(builder, alpha, lanes)


def _emit_softmax(builder, shape, chains, ops):
    """Emit the scores (softcapped when ops.cap > 0, -inf outside [ops.first, ops.valid)) and the
    state update of every folded head. Returns probs (per head, nv <L x float> of p) and alphas (per
    head, <L x float>)."""
    lanes = shape.lanes
    index = [
        ir.Constant(v.vec(lanes, v.I32), list(range(n * lanes, (n + 1) * lanes))) for n in range(shape.nv)
    ]
    low = v.broadcast(builder, builder.trunc(ops.first, v.I32), lanes)
    limit = v.broadcast(builder, builder.trunc(ops.valid, v.I32), lanes)
    keep = [
        builder.and_(builder.icmp_signed(">=", index[n], low), builder.icmp_signed("<", index[n], limit))
        for n in range(shape.nv)
    ]
    minus_inf = v.splat(shape.fvec, float("-inf"))
    capped = _emit_softcap(builder, shape, _emit_raw_scores(builder, shape, chains), ops.cap)
    probs, alphas = [], []
    for h in range(shape.heads):
        scores = [builder.select(keep[n], capped[h][n], minus_inf) for n in range(shape.nv)]
        p, alpha = _emit_state_update(builder, shape, scores, keep, ops.states[h])
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


def _emit_partial_block(builder, shape, accs, v_tile, probs, first, valid):
    """Emit the V accumulation of a block the context or the window cuts (the context's last block,
    the window's first): rows first <= t < valid (i64) only, in a loop (the rows outside may hold
    anything), p spilled to a float32 [heads, BS] alloca to be read per row."""
    block_size = shape.block_size
    spill = cgutils.alloca_once(builder, ir.ArrayType(v.F32, shape.heads * block_size))
    base = builder.bitcast(spill, v.F32.as_pointer())
    for h in range(shape.heads):
        for n in range(shape.nv):
            v.store_vec(builder, probs[h][n], base, h * block_size + n * shape.lanes)
    with v.loop(builder, builder.sub(valid, first)) as row:
        t = builder.add(row, first)
        p_t = [
            v.broadcast(
                builder, builder.load(v.at(builder, base, builder.add(t, v.I64(h * block_size)))), shape.lanes
            )
            for h in range(shape.heads)
        ]
        _emit_add_row(builder, shape, accs, v_tile, t, p_t)
