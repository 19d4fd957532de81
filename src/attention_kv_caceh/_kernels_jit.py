"""The Numba-compiled loops behind `kernels.py`; import `kernels`, not this module.

Everything here is `@njit` code with no Python objects in the loops and no argument checks: the
callers in `kernels.py` validate shapes, dtypes and block tables first. Shape legend as in attention.py;
G = H // H_kv query heads share one KV head, NB physical KV blocks of BS positions each.

Contiguous layout, one (sequence, KV head) work item at a time (`_contiguous_item`): the G query rows
of the group are scaled once, then the head's positions are read in chunks of at most `chunk` rows
(`_chunk`). Per chunk:
  1. scores s[g, t] = q_g . k_t for all G heads, with k_t read once for the whole group;
  2. online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; as in
     FlashAttention / Flash-Decoding): m' = max(m, max_t s), acc *= exp(m - m'), z *= exp(m - m'),
     p = exp(s - m'), z += sum_t p  (`_rescale`);
  3. acc[g] += sum_t p[g, t] v_t, with v_t read once for the whole group.
At the end out[g] = acc[g] / z[g] (`_finish`). K and V are each read once; the chunk's scores live in
a [G, chunk] scratch. Paged layout, one sequence at a time (`_paged_sequence`): the same three steps
over spans of `span` KV blocks (`_paged_span`), every block read once for all H query heads.
Why this order, chunk size and unrolling: the module docstring of kernels.py.
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

__all__: list[str] = []

# Reassociation lets LLVM vectorise the dot-product reduction over D; no nnan/ninf, because the
# running max starts at -inf and exp(-inf) = 0 must stay exact.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_JIT = {"nogil": True, "cache": True, "fastmath": _FASTMATH, "error_model": "numpy", "boundscheck": False}


@numba.njit(**_JIT)
def _chunk(qs, kc, vc, j, n, m, z, acc, s):
    """Fold rows kc/vc[:n, j] of one chunk [n, X, D] into the running (m [G], z [G], acc [G, D])."""
    g_count, d_count = qs.shape
    for t in range(n):  # scores: one K row, G dot products
        for g in range(g_count):
            dot = qs[g, 0] * kc[t, j, 0]
            for d in range(1, d_count):
                dot += qs[g, d] * kc[t, j, d]
            s[g, t] = dot
    for g in range(g_count):  # online softmax: rescale once per chunk
        m_new = m[g]
        for t in range(n):
            m_new = max(m_new, s[g, t])
        alpha = math.exp(m[g] - m_new)
        m[g] = m_new
        total = z[g] * alpha
        for t in range(n):
            p = math.exp(s[g, t] - m_new)
            s[g, t] = p
            total += p
        z[g] = total
        for d in range(d_count):
            acc[g, d] *= alpha
    n8 = n - n % 8  # acc += p V, eight V rows per pass over acc
    for t in range(0, n8, 8):
        for g in range(g_count):
            p0, p1, p2, p3 = s[g, t], s[g, t + 1], s[g, t + 2], s[g, t + 3]
            p4, p5, p6, p7 = s[g, t + 4], s[g, t + 5], s[g, t + 6], s[g, t + 7]
            for d in range(d_count):
                acc[g, d] += (
                    p0 * vc[t, j, d] + p1 * vc[t + 1, j, d] + p2 * vc[t + 2, j, d] + p3 * vc[t + 3, j, d]
                ) + (
                    p4 * vc[t + 4, j, d] + p5 * vc[t + 5, j, d] + p6 * vc[t + 6, j, d] + p7 * vc[t + 7, j, d]
                )
    for t in range(n8, n):
        for g in range(g_count):
            p = s[g, t]
            for d in range(d_count):
                acc[g, d] += p * vc[t, j, d]


@numba.njit(**_JIT)
def _rescale(n, m, z, acc, s):
    """Online softmax over scores s[:, :n]: new max, rescale z and acc once, s <- exp(s - max)."""
    h_count, d_count = acc.shape
    for g in range(h_count):
        m_new = m[g]
        for t in range(n):
            m_new = max(m_new, s[g, t])
        alpha = math.exp(m[g] - m_new)
        m[g] = m_new
        total = z[g] * alpha
        for t in range(n):
            p = math.exp(s[g, t] - m_new)
            s[g, t] = p
            total += p
        z[g] = total
        for d in range(d_count):
            acc[g, d] *= alpha


@numba.njit(**_JIT)
def _paged_span(qs, k_cache, v_cache, table_row, i0, i1, n_ctx, m, z, acc, s):
    """Fold the sequence's blocks table_row[i0:i1] into the running state of all H query heads.

    Per block [BS, H_kv, D], rows are read in memory order (row t's H_kv heads, then row t + 1's); the
    scores of all blocks of the span go to s [H, (i1 - i0) * BS] before one rescale, then V is read.
    """
    h_count, d_count = qs.shape
    block_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    g_count = h_count // h_kv
    for i in range(i0, i1):  # scores
        kb = np.ascontiguousarray(k_cache[table_row[i]])  # [BS, H_kv, D], a view of a C-contiguous cache
        base = (i - i0) * block_size
        for t in range(min(block_size, n_ctx - i * block_size)):
            for j in range(h_kv):
                for g in range(j * g_count, (j + 1) * g_count):
                    dot = qs[g, 0] * kb[t, j, 0]
                    for d in range(1, d_count):
                        dot += qs[g, d] * kb[t, j, d]
                    s[g, base + t] = dot
    _rescale(min(n_ctx - i0 * block_size, (i1 - i0) * block_size), m, z, acc, s)
    for i in range(i0, i1):  # acc += p V
        vb = np.ascontiguousarray(v_cache[table_row[i]])
        base = (i - i0) * block_size
        n = min(block_size, n_ctx - i * block_size)
        n8 = n - n % 8
        for t in range(0, n8, 8):
            for j in range(h_kv):
                for g in range(j * g_count, (j + 1) * g_count):
                    u = base + t
                    p0, p1, p2, p3 = s[g, u], s[g, u + 1], s[g, u + 2], s[g, u + 3]
                    p4, p5, p6, p7 = s[g, u + 4], s[g, u + 5], s[g, u + 6], s[g, u + 7]
                    for d in range(d_count):
                        acc[g, d] += (
                            p0 * vb[t, j, d]
                            + p1 * vb[t + 1, j, d]
                            + p2 * vb[t + 2, j, d]
                            + p3 * vb[t + 3, j, d]
                        ) + (
                            p4 * vb[t + 4, j, d]
                            + p5 * vb[t + 5, j, d]
                            + p6 * vb[t + 6, j, d]
                            + p7 * vb[t + 7, j, d]
                        )
        for t in range(n8, n):
            for j in range(h_kv):
                for g in range(j * g_count, (j + 1) * g_count):
                    p = s[g, base + t]
                    for d in range(d_count):
                        acc[g, d] += p * vb[t, j, d]


@numba.njit(**_JIT)
def _start(q_rows, scale, qs, m, z, acc):
    """Scale the group's query rows [G, D] into qs and reset the running state."""
    g_count, d_count = qs.shape
    for g in range(g_count):
        for d in range(d_count):
            qs[g, d] = q_rows[g, d] * scale
            acc[g, d] = 0.0
        m[g] = -np.inf
        z[g] = 0.0


@numba.njit(**_JIT)
def _finish(out_rows, z, acc):
    """out[g] = acc[g] / z[g]; zeros for an empty context (z = 0)."""
    g_count, d_count = acc.shape
    for g in range(g_count):
        inv = 1.0 / z[g] if z[g] > 0 else 0.0
        for d in range(d_count):
            out_rows[g, d] = acc[g, d] * inv


@numba.njit(**_JIT)
def _contiguous_item(q, k, v, out, scale, chunk, item, qs, m, z, acc, s):
    """One (sequence b, KV head j) work item of the contiguous kernel."""
    h_kv, t_count = k.shape[1], k.shape[2]
    g_count = q.shape[1] // h_kv
    b, j = item // h_kv, item % h_kv
    h0, h1 = j * g_count, (j + 1) * g_count
    # A no-op view when the head's [T, D] rows are contiguous (also in a strided cache view), a copy
    # otherwise: C-typed arrays are what LLVM vectorises (strided typing ran 3x slower).
    kh = np.ascontiguousarray(k[b, j]).reshape(t_count, 1, k.shape[3])  # [T, 1, D]
    vh = np.ascontiguousarray(v[b, j]).reshape(t_count, 1, v.shape[3])
    _start(q[b, h0:h1], scale, qs, m, z, acc)
    for t0 in range(0, t_count, chunk):
        n = min(chunk, t_count - t0)
        _chunk(qs, kh[t0 : t0 + n], vh[t0 : t0 + n], 0, n, m, z, acc, s)
    _finish(out[b, h0:h1], z, acc)


@numba.njit(**_JIT)
def contiguous_serial(q, k, v, out, scale, chunk):
    """q [B, H, D], k/v [B, H_kv, T, D] -> out [B, H, D] (written in place), one thread."""
    d_count = q.shape[2]
    g_count = q.shape[1] // k.shape[1]
    qs = np.empty((g_count, d_count), q.dtype)
    acc = np.empty((g_count, d_count), q.dtype)
    m = np.empty(g_count, q.dtype)
    z = np.empty(g_count, q.dtype)
    s = np.empty((g_count, chunk), q.dtype)
    for item in range(q.shape[0] * k.shape[1]):
        _contiguous_item(q, k, v, out, scale, chunk, item, qs, m, z, acc, s)


@numba.njit(parallel=True, **_JIT)
def contiguous_parallel(q, k, v, out, scale, chunk):
    """As `contiguous_serial`, the B * H_kv work items spread over Numba's threads."""
    d_count = q.shape[2]
    g_count = q.shape[1] // k.shape[1]
    for item in prange(q.shape[0] * k.shape[1]):
        qs = np.empty((g_count, d_count), q.dtype)
        acc = np.empty((g_count, d_count), q.dtype)
        m = np.empty(g_count, q.dtype)
        z = np.empty(g_count, q.dtype)
        s = np.empty((g_count, chunk), q.dtype)
        _contiguous_item(q, k, v, out, scale, chunk, item, qs, m, z, acc, s)


@numba.njit(**_JIT)
def _paged_sequence(q, k_cache, v_cache, block_tables, context_lens, out, scale, span, b, qs, m, z, acc, s):
    """Sequence b of the paged kernel: each of its KV blocks is read once, for all H_kv heads."""
    block_size = k_cache.shape[1]
    n_ctx = context_lens[b]
    _start(q[b], scale, qs, m, z, acc)
    n_blocks = (n_ctx + block_size - 1) // block_size
    for i0 in range(0, n_blocks, span):
        _paged_span(qs, k_cache, v_cache, block_tables[b], i0, min(i0 + span, n_blocks), n_ctx, m, z, acc, s)
    _finish(out[b], z, acc)


@numba.njit(**_JIT)
def paged_serial(q, k_cache, v_cache, block_tables, context_lens, out, scale, span):
    """q [B, H, D], k/v_cache [NB, BS, H_kv, D], block_tables [B, max_blocks], context_lens [B] -> out.

    span: KV blocks whose scores are gathered before each online-softmax rescale.
    """
    h_count, d_count = q.shape[1], q.shape[2]
    qs = np.empty((h_count, d_count), q.dtype)
    acc = np.empty((h_count, d_count), q.dtype)
    m = np.empty(h_count, q.dtype)
    z = np.empty(h_count, q.dtype)
    s = np.empty((h_count, span * k_cache.shape[1]), q.dtype)
    for b in range(q.shape[0]):
        _paged_sequence(
            q, k_cache, v_cache, block_tables, context_lens, out, scale, span, b, qs, m, z, acc, s
        )


@numba.njit(parallel=True, **_JIT)
def paged_parallel(q, k_cache, v_cache, block_tables, context_lens, out, scale, span):
    """As `paged_serial`, the B sequences spread over Numba's threads."""
    h_count, d_count = q.shape[1], q.shape[2]
    for b in prange(q.shape[0]):
        qs = np.empty((h_count, d_count), q.dtype)
        acc = np.empty((h_count, d_count), q.dtype)
        m = np.empty(h_count, q.dtype)
        z = np.empty(h_count, q.dtype)
        s = np.empty((h_count, span * k_cache.shape[1]), q.dtype)
        _paged_sequence(
            q, k_cache, v_cache, block_tables, context_lens, out, scale, span, b, qs, m, z, acc, s
        )
