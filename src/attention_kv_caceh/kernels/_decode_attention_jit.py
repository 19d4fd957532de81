"""The Numba-compiled loops behind `kernels/decode_attention.py`; import `decode_attention`, not this module.

Everything here is `@njit` code with no Python objects in the loops and no argument checks: the
callers in `kernels/decode_attention.py` validate shapes, dtypes and block tables first. Shape legend as in attention.py;
G = H // H_kv query heads share one KV head.

Contiguous layout, one (sequence, KV head) work item at a time (`_contiguous_item`): the G query rows
of the group are scaled once, then the head's positions are read in chunks of at most `chunk` rows
(`_chunk`). Per chunk:
  1. scores s[g, t] = q_g . k_t for all G heads, with k_t read once for the whole group;
  2. online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; as in
     FlashAttention / Flash-Decoding): m' = max(m, max_t s), acc *= exp(m - m'), z *= exp(m - m'),
     p = exp(s - m'), z += sum_t p  (`_softmax_update`);
  3. acc[g] += sum_t p[g, t] v_t, with v_t read once for the whole group.
At the end out[g] = acc[g] / z[g] (`_finish`). K and V are each read once; the chunk's scores live in
a [G, chunk] scratch. The chunk's max is tracked while the scores are computed (a separate max loop
does not vectorise without `nnan`), exp(s - max) for float32 is `_math_jit.exp_f32` (a polynomial LLVM
vectorises, where `math.exp` is a scalar call per score), and the K pass prefetches `_PREFETCH_ROWS`
rows ahead (`_math_jit.prefetch`, LLVM's prefetch intrinsic). Why this order, chunk size and unrolling:
docs/kernels.md. `plain_serial` is the same attention as one readable loop nest, the reference the
tuned kernels are tested against. The paged kernel's loops are in `_decode_attention_paged_jit`.
"""

# pyright: basic
# (Numba compiles these from their argument types at the first call; they carry no annotations.)

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from attention_kv_caceh.kernels._math_jit import exp_nonpositive, prefetch

__all__: list[str] = []

_PREFETCH_ROWS = 16  # K rows [D] prefetched ahead of the one being read (docs/kernels.md)
_LINE_BYTES = 64  # one prefetch per cache line


# Reassociation lets LLVM vectorise the dot-product reduction over D; no nnan/ninf, because the
# running max starts at -inf and exp(-inf) = 0 must stay exact.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_JIT = {"nogil": True, "cache": True, "fastmath": _FASTMATH, "error_model": "numpy", "boundscheck": False}


@numba.njit(cache=True)
def plain_serial(q, k, v, out, scale):
    """The readable kernel: q [B, H, D], k/v [B, H_kv, T >= 1, D] -> out [B, H, D] (written in place).

    One loop nest, one position at a time, online softmax (Milakov & Gimelshein 2018): m is the
    largest score so far, z the sum of exp(score - m), acc the sum of exp(score - m) * v. When a new
    score raises m, z and acc are rescaled by exp(m_old - m_new). Sums in float64. The tuned kernels
    of this module compute the same thing; docs/kernels.md walks from this one to them.
    """
    b_count, h_count, d_count = q.shape
    h_kv, t_count = k.shape[1], k.shape[2]
    group = h_count // h_kv  # query heads per KV head (GQA)
    acc = np.zeros(d_count)  # [D] float64
    for b in range(b_count):
        for h in range(h_count):
            j = h // group  # the KV head query head h reads
            m = -np.inf
            z = 0.0
            acc[:] = 0.0
            for t in range(t_count):
                score = 0.0
                for d in range(d_count):
                    score += q[b, h, d] * k[b, j, t, d]
                score *= scale
                m_new = max(m, score)
                alpha = math.exp(m - m_new)  # rescales what was summed under the old max
                p = math.exp(score - m_new)
                z = z * alpha + p
                for d in range(d_count):
                    acc[d] = acc[d] * alpha + p * v[b, j, t, d]
                m = m_new
            for d in range(d_count):
                out[b, h, d] = acc[d] / z


@numba.njit(**_JIT)
def _prefetch_row(a, row, d_count):
    """Prefetch row `row` ([D] elements) of a C-contiguous [rows, ..., D] buffer, past its end too."""
    for c in range(0, d_count, _LINE_BYTES // a.itemsize):
        prefetch(a, row * d_count + c)  # pyright: ignore[reportCallIssue]  (typingctx is Numba's)


@numba.njit(**_JIT)
def _softmax_update(n, m, m_new, z, acc, s):
    """Online softmax over scores s[:, :n] whose row maxima (with the old m) are m_new [rows].

    z and acc are rescaled once by exp(m - m_new), m <- m_new, and s <- exp(s - m_new), z += sum.
    """
    h_count, d_count = acc.shape
    for g in range(h_count):
        top = m_new[g]
        alpha = math.exp(m[g] - top)
        m[g] = top
        total = z[g] * alpha
        for t in range(n):
            p = exp_nonpositive(s[g, t] - top)
            s[g, t] = p
            total += p
        z[g] = total
        for d in range(d_count):
            acc[g, d] *= alpha


@numba.njit(**_JIT)
def _chunk(qs, kc, vc, n, m, z, acc, s, top):
    """Fold rows kc/vc[:n, 0] of one chunk [n, 1, D] into the running (m [G], z [G], acc [G, D])."""
    g_count, d_count = qs.shape
    for g in range(g_count):
        top[g] = m[g]
    for t in range(n):  # scores: one K row, G dot products; the row maxima on the way
        _prefetch_row(kc, t + _PREFETCH_ROWS, d_count)  # rows past the chunk are the next chunk's
        for g in range(g_count):
            dot = qs[g, 0] * np.float32(0.0)  # a zero of the input's dtype
            for d in range(d_count):  # D iterations, not D - 1: no scalar remainder when 64 | D
                dot += qs[g, d] * kc[t, 0, d]
            s[g, t] = dot
            if dot > top[g]:
                top[g] = dot
    _softmax_update(n, m, top, z, acc, s)
    n8 = n - n % 8  # acc += p V, eight V rows per pass over acc
    for t in range(0, n8, 8):
        for g in range(g_count):
            p0, p1, p2, p3 = s[g, t], s[g, t + 1], s[g, t + 2], s[g, t + 3]
            p4, p5, p6, p7 = s[g, t + 4], s[g, t + 5], s[g, t + 6], s[g, t + 7]
            for d in range(d_count):
                acc[g, d] += (
                    p0 * vc[t, 0, d] + p1 * vc[t + 1, 0, d] + p2 * vc[t + 2, 0, d] + p3 * vc[t + 3, 0, d]
                ) + (
                    p4 * vc[t + 4, 0, d] + p5 * vc[t + 5, 0, d] + p6 * vc[t + 6, 0, d] + p7 * vc[t + 7, 0, d]
                )
    for t in range(n8, n):
        for g in range(g_count):
            p = s[g, t]
            for d in range(d_count):
                acc[g, d] += p * vc[t, 0, d]


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
def _contiguous_item(q, k, v, out, scale, chunk, item, qs, m, z, acc, s, top):
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
        _chunk(qs, kh[t0 : t0 + n], vh[t0 : t0 + n], n, m, z, acc, s, top)
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
    top = np.empty(g_count, q.dtype)
    for item in range(q.shape[0] * k.shape[1]):
        _contiguous_item(q, k, v, out, scale, chunk, item, qs, m, z, acc, s, top)


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
        top = np.empty(g_count, q.dtype)
        _contiguous_item(q, k, v, out, scale, chunk, item, qs, m, z, acc, s, top)
