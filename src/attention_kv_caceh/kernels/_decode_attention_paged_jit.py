"""The compiled loops behind `decode_attention.paged_decode_attention`; import `decode_attention`, not this module.

No argument checks here: `kernels/decode_attention.py` validates first. Shape legend as in attention.py; NB physical KV
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
`_math_jit.exp_f32` on vectors. While a tile is folded, the same head's tile of the table's next
block is prefetched into L2, a line every few steps: blocks lie in arbitrary places, so the CPU's own
prefetchers cannot run ahead across them, and a burst of hints for a whole block at once mostly went
unanswered (docs/kernels.md has the measurements).

A sliding window starts the loop at the block of the window's first position (earlier blocks are
never read) and masks below it in that block; a softcap c maps the scores to c tanh(s / c) before the
mask (`ir.vtanh`; docs/kernels.md, "Sliding window and softcap").

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
from numba import types
from numba.extending import intrinsic, overload

from attention_kv_caceh.kernels import ir as v
from attention_kv_caceh.kernels._decode_attention_paged_ir import (
    _emit_operands,
    _emit_partial_block,
    _emit_rescaled_acc,
    _emit_score_chains,
    _emit_softmax,
    _emit_whole_block,
    _Shape,
)
from attention_kv_caceh.kernels._math_jit import exp_nonpositive
from attention_kv_caceh.kernels.isa import compiled_variant

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


@intrinsic
def _fold_block(
    typingctx,
    qs,
    k_cache,
    v_cache,
    block,
    head,
    g0,
    first,
    valid,
    acc,
    state,
    ahead,
    cap,
    d_lit,
    bs_lit,
    heads_lit,
):
    """Fold block `block` of KV head `head` into the state of query heads g0 .. g0 + heads - 1.

    qs `[H, D]` float32 (q already times the scale), k_cache `[NB, H_kv, D, BS]` and v_cache
    `[NB, H_kv, BS, D]` float32 with contiguous tiles; the block's positions first .. valid - 1 are
    attended (0 <= first < valid <= BS: valid ends the context, first starts the window), acc `[H, D]` and state `[H, 2]` (m, z) float32, updated in place; ahead: the block
    whose tiles are prefetched; cap: the softcap c (scores s -> c tanh(s / c)), 0 for none. d_lit, bs_lit, heads_lit: D, BS and the number of query heads,
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
        probs, alphas = _emit_softmax(builder, shape, chains, ops)
        accs = _emit_rescaled_acc(builder, shape, ops.acc_rows, alphas)
        whole_block = builder.and_(
            builder.icmp_signed("==", ops.valid, v.I64(block_size)),
            builder.icmp_signed("==", ops.first, v.I64(0)),
        )
        with builder.if_else(whole_block) as (whole, part):
            with whole:
                _emit_whole_block(builder, shape, accs, ops.v_tile, ops.v_next, probs)
            with part:
                _emit_partial_block(builder, shape, accs, ops.v_tile, probs, ops.first, ops.valid)
        for h in range(heads):
            for e in range(shape.dv):
                v.store_vec(builder, builder.load(accs[h * shape.dv + e]), ops.acc_rows[h], e * LANES)
        return context.get_dummy_value()

    sig = types.void(
        qs, k_cache, v_cache, block, head, g0, first, valid, acc, state, ahead, cap, d_lit, bs_lit, heads_lit
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
def _fold_block_plain(qs, k_cache, v_cache, block, head, g, first, valid, acc, state, s, cap):
    """`_fold_block` as Numba loops, for any dtype and size; s: a scratch row `[BS]`."""
    d_count = qs.shape[1]
    top = state[g, 0]
    for t in range(first, valid):
        dot = qs[g, 0] * 0.0
        for d in range(d_count):
            dot += qs[g, d] * k_cache[block, head, d, t]
        if cap > 0:
            dot = cap * math.tanh(dot / cap)
        s[t] = dot
        top = max(top, dot)
    alpha = math.exp(state[g, 0] - top)
    total = state[g, 1] * alpha
    for t in range(first, valid):
        p = exp_nonpositive(s[t] - top)
        s[t] = p
        total += p
    state[g, 0] = top
    state[g, 1] = total
    for d in range(d_count):
        acc[g, d] *= alpha
    for t in range(first, valid):
        p = s[t]
        for d in range(d_count):
            acc[g, d] += p * v_cache[block, head, t, d]


def _fold(qs, k_cache, v_cache, block, head, g0, heads, first, valid, acc, state, s, ahead, cap, fast):
    """Fold one block of one KV head into query heads g0 .. g0 + heads - 1: the IR kernel for the
    (D, BS) it is specialised for (fast: the index in _SHAPES; heads <= CHUNKS[fast]), else (fast -1,
    or not float32) the Numba loops, one head at a time."""
    raise NotImplementedError("compiled only")  # `_fold_impl` is what njit code calls


@numba.njit(**_JIT)
def _fold_plain(qs, k_cache, v_cache, block, head, g0, heads, first, valid, acc, state, s, cap):
    """`_fold` by the Numba loops, one query head at a time."""
    for g in range(g0, g0 + heads):
        _fold_block_plain(qs, k_cache, v_cache, block, head, g, first, valid, acc, state, s, cap)


@overload(_fold, inline="always")
def _fold_impl(qs, k_cache, v_cache, block, head, g0, heads, first, valid, acc, state, s, ahead, cap, fast):
    if qs.dtype != types.float32:
        return (
            lambda qs, k_cache, v_cache, block, head, g0, heads, first, valid, acc, state, s, ahead, cap, fast: (
                _fold_plain(qs, k_cache, v_cache, block, head, g0, heads, first, valid, acc, state, s, cap)
            )
        )

    def impl(qs, k_cache, v_cache, block, head, g0, heads, first, valid, acc, state, s, ahead, cap, fast):
        if fast == 0:  # D 64, BS 16
            if heads == 4:
                _fold_block(
                    qs, k_cache, v_cache, block, head, g0, first, valid, acc, state, ahead, cap, 64, 16, 4
                )  # pyright: ignore[reportCallIssue]
            elif heads == 3:
                _fold_block(
                    qs, k_cache, v_cache, block, head, g0, first, valid, acc, state, ahead, cap, 64, 16, 3
                )  # pyright: ignore[reportCallIssue]
            elif heads == 2:
                _fold_block(
                    qs, k_cache, v_cache, block, head, g0, first, valid, acc, state, ahead, cap, 64, 16, 2
                )  # pyright: ignore[reportCallIssue]
            else:
                _fold_block(
                    qs, k_cache, v_cache, block, head, g0, first, valid, acc, state, ahead, cap, 64, 16, 1
                )  # pyright: ignore[reportCallIssue]
        elif fast == 1:  # D 128, BS 16
            if heads == 2:
                _fold_block(
                    qs, k_cache, v_cache, block, head, g0, first, valid, acc, state, ahead, cap, 128, 16, 2
                )  # pyright: ignore[reportCallIssue]
            else:
                _fold_block(
                    qs, k_cache, v_cache, block, head, g0, first, valid, acc, state, ahead, cap, 128, 16, 1
                )  # pyright: ignore[reportCallIssue]
        else:
            _fold_plain(qs, k_cache, v_cache, block, head, g0, heads, first, valid, acc, state, s, cap)

    return impl


def fast_shape(dtype, d_count, block_size, tiles_contiguous):
    """The index in _SHAPES the IR kernel takes for these arguments, or -1 (the Numba loops)."""
    if dtype != np.float32 or not tiles_contiguous or (d_count, block_size) not in _SHAPES:
        return -1
    if d_count % LANES or block_size % LANES or d_count % 4:
        return -1
    return _SHAPES.index((d_count, block_size))


@numba.njit(**_JIT)
def _sequence(
    q, k_cache, v_cache, block_tables, context_lens, out, scale, window, cap, fast, b, qs, acc, state, s
):
    """Sequence b: the blocks of its window (all of them for window 0) in table order, each folded
    into the H query heads' state; the blocks wholly before the window are never read."""
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
    start = max(0, n_ctx - window) if window > 0 else 0  # the window's first position
    for i in range(start // block_size, n_blocks):
        block = block_tables[b, i]
        ahead = block_tables[b, i + 1] if i + 1 < n_blocks else block  # prefetched while block i is folded
        valid = min(block_size, n_ctx - i * block_size)
        first = max(0, start - i * block_size)
        for j in range(h_kv):
            g = j * g_count
            while g < (j + 1) * g_count:
                heads = min(chunk, (j + 1) * g_count - g)
                _fold(qs, k_cache, v_cache, block, j, g, heads, first, valid, acc, state, s, ahead, cap, fast)
                g += heads
    for g in range(h_count):
        inv = 1.0 / state[g, 1] if state[g, 1] > 0 else 0.0
        for d in range(d_count):
            out[b, g, d] = acc[g, d] * inv


@numba.njit(**_JIT)
def paged_serial(q, k_cache, v_cache, block_tables, context_lens, out, scale, window, cap, fast):
    """q [B, H, D], k_cache [NB, H_kv, D, BS], v_cache [NB, H_kv, BS, D], block_tables [B, max_blocks],
    context_lens [B] -> out [B, H, D]; window: the positions attended (the last ones), 0 for all; cap:
    the softcap in q's dtype, 0 for none; fast: `fast_shape` of the arguments."""
    h_count, d_count = q.shape[1], q.shape[2]
    qs = np.empty((h_count, d_count), q.dtype)
    acc = np.empty((h_count, d_count), q.dtype)
    state = np.empty((h_count, 2), q.dtype)
    s = np.empty(k_cache.shape[3], q.dtype)
    for b in range(q.shape[0]):
        _sequence(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            out,
            scale,
            window,
            cap,
            fast,
            b,
            qs,
            acc,
            state,
            s,
        )


@numba.njit(parallel=True, **_JIT)
def paged_parallel(q, k_cache, v_cache, block_tables, context_lens, out, scale, window, cap, fast):
    """As `paged_serial`, the B sequences spread over Numba's threads."""
    h_count, d_count = q.shape[1], q.shape[2]
    for b in numba.prange(q.shape[0]):
        qs = np.empty((h_count, d_count), q.dtype)
        acc = np.empty((h_count, d_count), q.dtype)
        state = np.empty((h_count, 2), q.dtype)
        s = np.empty(k_cache.shape[3], q.dtype)
        _sequence(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            out,
            scale,
            window,
            cap,
            fast,
            b,
            qs,
            acc,
            state,
            s,
        )
