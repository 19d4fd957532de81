"""From the plain decode-attention kernel to the tuned one, one change at a time, each step timed.

    OPENBLAS_NUM_THREADS=1 uv run python scripts/kernel_steps.py                 # large shape
    OPENBLAS_NUM_THREADS=1 uv run python scripts/kernel_steps.py --shape default --rounds 3

Steps (docs/kernels.md explains each):
  0 plain       decode_attention.plain_decode_attention: one loop nest, a rescale per position, float64 sums
  1 fastmath    the same source compiled with the tuned kernels' fastmath flags (reassociation lets
                LLVM vectorise the dot product over D)
  2 chunked     per (sequence, KV head): scores of 1024 positions first (each K row read once for the
                G query heads of its group), a separate max loop, one rescale per chunk, then V one row
                at a time; accumulators in the input's dtype
  3 v8          V eight rows per pass over the accumulator
  4 fast exp    the chunk max tracked while the scores are computed, a vectorised float32 exp
  5 tuned       kernels.decode_attention's loops: step 4 plus software prefetch of K 16 rows ahead

Every step is checked against the plain kernel before timing. Steps run in alternating rounds (each
round times every step `--repeats` times after `--warmup` untimed calls), with an `np.dot` read probe
over the same bytes in every round; the table gives medians of this thread's CPU time and of wall time,
the ratio to the probe (1.0 = reads K and V as fast as the probe reads a buffer) and the speedup over
the previous step. On a shared machine read the ratios, not the milliseconds. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from attention_kv_caceh.kernels import _decode_attention_jit as _jit
from attention_kv_caceh.kernels.decode_attention import (
    CONTIGUOUS_CHUNK,
    decode_attention_into,
    plain_decode_attention,
)
from attention_kv_caceh.oracle import tolerance_for

SHAPES = {  # B, H, H_kv, T, D
    "large": (4, 8, 8, 4097, 128),
    "default": (8, 1, 1, 129, 64),
    "gqa": (4, 32, 8, 2049, 128),
}
_FLAGS = {"nogil": True, "fastmath": _jit._FASTMATH, "error_model": "numpy", "boundscheck": False}
plain_fastmath = numba.njit(**_FLAGS)(_jit.plain_serial.py_func)


@numba.njit(**_FLAGS)
def _rescale_math_exp(n, m, m_new, z, acc, s):
    """The online-softmax step with `math.exp` (a scalar call per score)."""
    g_count, d_count = acc.shape
    for g in range(g_count):
        top = m_new[g]
        alpha = math.exp(m[g] - top)
        m[g] = top
        total = z[g] * alpha
        for t in range(n):
            p = math.exp(s[g, t] - top)
            s[g, t] = p
            total += p
        z[g] = total
        for d in range(d_count):
            acc[g, d] *= alpha


@numba.njit(**_FLAGS)
def _scores_then_max(qs, kc, n, m, s, top):
    g_count, d_count = qs.shape
    for t in range(n):
        for g in range(g_count):
            dot = qs[g, 0] * np.float32(0.0)
            for d in range(d_count):
                dot += qs[g, d] * kc[t, 0, d]
            s[g, t] = dot
    for g in range(g_count):  # a separate max loop (does not vectorise without nnan)
        top[g] = m[g]
        for t in range(n):
            if s[g, t] > top[g]:
                top[g] = s[g, t]


@numba.njit(**_FLAGS)
def _v_one_row(vc, n, acc, s):
    g_count, d_count = acc.shape
    for t in range(n):
        for g in range(g_count):
            p = s[g, t]
            for d in range(d_count):
                acc[g, d] += p * vc[t, 0, d]


@numba.njit(**_FLAGS)
def _v_eight_rows(vc, n, acc, s):
    g_count, d_count = acc.shape
    n8 = n - n % 8
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
    _v_one_row(vc[n8:n], n - n8, acc, s[:, n8:])


@numba.njit(**_FLAGS)
def _chunk_step2(qs, kc, vc, n, m, z, acc, s, top):
    _scores_then_max(qs, kc, n, m, s, top)
    _rescale_math_exp(n, m, top, z, acc, s)
    _v_one_row(vc, n, acc, s)


@numba.njit(**_FLAGS)
def _chunk_step3(qs, kc, vc, n, m, z, acc, s, top):
    _scores_then_max(qs, kc, n, m, s, top)
    _rescale_math_exp(n, m, top, z, acc, s)
    _v_eight_rows(vc, n, acc, s)


@numba.njit(**_FLAGS)
def _chunk_step4(qs, kc, vc, n, m, z, acc, s, top):
    g_count, d_count = qs.shape
    for g in range(g_count):
        top[g] = m[g]
    for t in range(n):  # the max on the way
        for g in range(g_count):
            dot = qs[g, 0] * np.float32(0.0)
            for d in range(d_count):
                dot += qs[g, d] * kc[t, 0, d]
            s[g, t] = dot
            if dot > top[g]:
                top[g] = dot
    _jit._softmax_update(n, m, top, z, acc, s)  # vectorised float32 exp
    _v_eight_rows(vc, n, acc, s)


def chunked_kernel(chunk_fn: Any) -> Any:
    """The tuned kernels' driver (one (sequence, KV head) item at a time) around one chunk function."""

    @numba.njit(**_FLAGS)
    def kernel(q, k, v, out, scale, chunk):
        d_count, h_kv, t_count = q.shape[2], k.shape[1], k.shape[2]
        g_count = q.shape[1] // h_kv
        qs = np.empty((g_count, d_count), q.dtype)
        acc = np.empty((g_count, d_count), q.dtype)
        m = np.empty(g_count, q.dtype)
        z = np.empty(g_count, q.dtype)
        s = np.empty((g_count, chunk), q.dtype)
        top = np.empty(g_count, q.dtype)
        for item in range(q.shape[0] * h_kv):
            b, j = item // h_kv, item % h_kv
            kh = np.ascontiguousarray(k[b, j]).reshape(t_count, 1, d_count)  # [T, 1, D]
            vh = np.ascontiguousarray(v[b, j]).reshape(t_count, 1, d_count)
            _jit._start(q[b, j * g_count : (j + 1) * g_count], scale, qs, m, z, acc)
            for t0 in range(0, t_count, chunk):
                n = min(chunk, t_count - t0)
                chunk_fn(qs, kh[t0 : t0 + n], vh[t0 : t0 + n], n, m, z, acc, s, top)
            _jit._finish(out[b, j * g_count : (j + 1) * g_count], z, acc)

    return kernel


STEPS: list[tuple[str, str]] = [
    ("plain", "one loop nest, rescale per position"),
    ("fastmath", "same source, reassociation: dot over D vectorised"),
    ("chunked", "scores per 1024-position chunk, one rescale"),
    ("v8", "V eight rows per pass over acc"),
    ("fast exp", "max on the way, vectorised float32 exp"),
    ("tuned", "K prefetched 16 rows ahead (kernels/decode_attention.py)"),
]


def methods(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, scale: float
) -> dict[str, Callable[[], object]]:
    step2, step3, step4 = (chunked_kernel(f) for f in (_chunk_step2, _chunk_step3, _chunk_step4))
    c = CONTIGUOUS_CHUNK
    return {
        "plain": lambda: _jit.plain_serial(q, k, v, out, scale),
        "fastmath": lambda: plain_fastmath(q, k, v, out, scale),
        "chunked": lambda: step2(q, k, v, out, scale, c),
        "v8": lambda: step3(q, k, v, out, scale, c),
        "fast exp": lambda: step4(q, k, v, out, scale, c),
        "tuned": lambda: decode_attention_into(q, k, v, out, scale),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="large", help="B, H, H_kv, T, D preset")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds over all steps")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per step per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per step per round")
    args = parser.parse_args()
    b, h, h_kv, t, d = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, h, d)).astype(np.float32)  # [B, H, D]
    k = rng.standard_normal((b, h_kv, t, d)).astype(np.float32)  # [B, H_kv, T, D]
    v = rng.standard_normal((b, h_kv, t, d)).astype(np.float32)
    out = np.empty_like(q)
    scale = 1.0 / math.sqrt(d)
    nbytes = k.nbytes + v.nbytes
    probe = np.ones(nbytes // 4, np.float32)
    steps = methods(q, k, v, out, scale)
    expected = plain_decode_attention(q, k, v)
    rtol, atol = tolerance_for(np.float32, d + t)
    for name, fn in steps.items():  # compile, then check against the plain kernel before any timing
        fn()
        np.testing.assert_allclose(out, expected, rtol=rtol, atol=atol, err_msg=name)
    timed: dict[str, Callable[[], object]] = {"probe": lambda: np.dot(probe, probe), **steps}
    cpu: dict[str, list[float]] = {name: [] for name in timed}
    wall: dict[str, list[float]] = {name: [] for name in timed}
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, fn in timed.items():
            for i in range(args.warmup + args.repeats):
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                fn()
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                if i >= args.warmup:
                    cpu[name].append((c1 - c0) / 1e6)
                    wall[name].append((w1 - w0) / 1e6)
    load_after = os.getloadavg()[0]
    probe_cpu = statistics.median(cpu["probe"])
    print(
        f"shape {args.shape}: B={b} H={h} H_kv={h_kv} T={t} D={d} float32, {nbytes / 1e6:.1f} MB of K and V; "
        f"probe {nbytes / probe_cpu / 1e6:.1f} GB/s; load average {load_before:.1f} -> {load_after:.1f}; "
        f"{args.rounds} rounds x {args.repeats} repeats"
    )
    print(f"{'step':<9} {'cpu ms':>9} {'wall ms':>9} {'/probe':>7} {'vs prev':>8} {'vs plain':>9}  change")
    rows: list[dict[str, Any]] = []
    previous = plain = statistics.median(cpu["plain"])
    for name, change in STEPS:
        ms = statistics.median(cpu[name])
        row = {
            "step": name,
            "cpu_ms": ms,
            "wall_ms": statistics.median(wall[name]),
            "vs_probe": probe_cpu / ms,
            "vs_previous": previous / ms,
            "vs_plain": plain / ms,
        }
        rows.append(row)
        print(
            f"{name:<9} {ms:9.3f} {row['wall_ms']:9.3f} {row['vs_probe']:7.2f} {row['vs_previous']:7.2f}x "
            f"{row['vs_plain']:8.1f}x  {change}"
        )
        previous = ms
    print(json.dumps({"shape": args.shape, "probe_cpu_ms": probe_cpu, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
