"""References that every computed result is checked against (by the tests, and by the benchmark before
it times anything).

- `reference_attention`: float64, one query row at a time, explicit head mapping for GQA; shares no code
  with `attention.py` beyond NumPy itself.
- `check_close`: compares a result to a reference with a tolerance chosen from the dtype
  (`tolerance_for`), and raises `OracleMismatch` naming the worst element.
- `check_decode_batch`: batched decode output == the reference computed one sequence at a time.
- `reference_paged_decode_attention`: NumPy decode attention over a paged KV cache (gathered blocks,
  two-pass softmax), the reference of the compiled paged kernel in the engine's tests.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, cast

import numpy as np
import numpy.typing as npt

__all__ = [
    "OracleMismatch",
    "check_close",
    "check_decode_batch",
    "reference_attention",
    "reference_paged_decode_attention",
    "repeat_kv",
    "tolerance_for",
]

FloatArray = npt.NDArray[np.floating[Any]]


class OracleMismatch(AssertionError):
    """A computed result disagrees with its reference beyond the tolerance."""


def tolerance_for(dtype: npt.DTypeLike, reduction_length: int = 1) -> tuple[float, float]:
    """(rtol, atol) for comparing a result of `dtype` against a float64 reference.

    Attention outputs are convex combinations of values of order 1, computed through a dot product of
    length D and a sum of length T. Rounding errors of a float with unit roundoff u = eps / 2 grow at
    worst like n * u and in practice like sqrt(n) * u (Higham, "Accuracy and Stability of Numerical
    Algorithms", 2nd ed., ch. 3), so we allow
        rtol = atol = 16 * eps * sqrt(max(n, 1))
    with n = `reduction_length` (pass D + T). float32: eps = 1.19e-7, so n = 192 gives about 2.6e-5;
    float64: about 4.9e-14 at the same n. The factor 16 covers exp and the division in softmax.
    """
    eps = float(np.finfo(cast("np.dtype[np.floating[Any]]", np.dtype(dtype))).eps)
    tol = 16.0 * eps * math.sqrt(max(reduction_length, 1))
    return tol, tol


def check_close(
    actual: FloatArray,
    expected: FloatArray,
    *,
    rtol: float,
    atol: float,
    what: str = "result",
) -> None:
    """Raise OracleMismatch unless `actual` matches `expected` in shape and within rtol/atol.

    Test: |actual - expected| <= atol + rtol * |expected| elementwise (as `np.testing.assert_allclose`).
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise OracleMismatch(f"{what}: shape {actual.shape} != reference shape {expected.shape}")
    if not np.all(np.isfinite(actual)):
        raise OracleMismatch(f"{what}: contains NaN or inf")
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    allowed = atol + rtol * np.abs(expected.astype(np.float64))
    if np.any(diff > allowed):
        worst = np.unravel_index(int(np.argmax(diff - allowed)), diff.shape)
        raise OracleMismatch(
            f"{what}: max |error| {float(diff.max()):.3e} exceeds tolerance (rtol={rtol:.1e}, "
            f"atol={atol:.1e}); worst at index {tuple(int(i) for i in worst)}: "
            f"{float(actual[worst]):.6g} vs reference {float(expected[worst]):.6g}"
        )


def repeat_kv(x: FloatArray, num_groups: int) -> FloatArray:
    """Materialise GQA: `[B, H_kv, T, D]` -> `[B, H_kv * G, T, D]` with head h a copy of head h // G.

    This is the explicit form (`repeat_kv` in Llama's reference code) the lab's attention avoids.
    """
    return np.repeat(x, num_groups, axis=-3)  # [B, H, T, D]


def reference_attention(
    q: FloatArray,
    k: FloatArray,
    v: FloatArray,
    *,
    mask: npt.NDArray[np.bool_] | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """float64 attention, one query row at a time: `(output [..., Tq, D_v], weights [..., Tq, Tk])`.

    Same contract as `attention.scaled_dot_product_attention` (bottom-right causal alignment, GQA by
    head index h -> h // (H // H_kv) for 4-D and higher inputs, fully masked rows give zeros), written
    as the definition: for each row, scores_j = scale * sum_d q_d k_jd, w = exp(s - max s) / sum,
    out = sum_j w_j v_j. Slow on purpose; meant for small shapes.
    """
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    *lead, tq, dk = q64.shape
    tk, dv = k64.shape[-2], v64.shape[-1]
    h, h_kv = (lead[-1], k64.shape[-3]) if q64.ndim >= 4 else (1, 1)
    group = h // h_kv
    s = 1.0 / math.sqrt(dk) if scale is None else float(scale)
    keep = np.ones((*lead, tq, tk), dtype=bool)
    if mask is not None:
        keep &= np.broadcast_to(np.asarray(mask, dtype=bool), keep.shape)
    out = np.zeros((*lead, tq, dv))
    weights = np.zeros((*lead, tq, tk))
    for idx in itertools.product(*(range(n) for n in lead)):
        kv_idx = (*idx[:-1], idx[-1] // group) if q64.ndim >= 4 else idx
        k_rows, v_rows = k64[kv_idx], v64[kv_idx]  # [Tk, D_k], [Tk, D_v]
        for i in range(tq):
            allowed = keep[idx][i].copy()
            if is_causal:
                allowed[tk - tq + i + 1 :] = False
            if not allowed.any():
                continue
            scores = np.array([s * float(np.dot(q64[idx][i], k_rows[j])) for j in range(tk)])
            scores[~allowed] = -np.inf
            e = np.exp(scores - scores[allowed].max())
            w = e / e.sum()
            weights[idx][i] = w
            out[idx][i] = w @ v_rows
    return out, weights


def check_decode_batch(
    q_t: FloatArray,
    keys: FloatArray,
    values: FloatArray,
    output: FloatArray,
    weights: FloatArray,
) -> float:
    """Check a batched decode step against the float64 reference run one sequence at a time.

    q_t `[B, H, 1, D]`, keys/values `[B, H_kv, T, D]` (what the cache held after the append), output
    `[B, H, 1, D]`, weights `[B, H, 1, T]`. Every sequence is recomputed alone (batch of one), so a
    softmax over the wrong axis or any mixing across the batch fails. Returns the largest absolute
    error of the output; raises OracleMismatch.
    """
    b, h, _, d = q_t.shape
    t = keys.shape[2]
    if output.shape != (b, h, 1, d) or weights.shape != (b, h, 1, t):
        raise OracleMismatch(
            f"decode shapes: output {output.shape} (want {(b, h, 1, d)}), "
            f"weights {weights.shape} (want {(b, h, 1, t)})"
        )
    rtol, atol = tolerance_for(output.dtype, d + t)
    max_err = 0.0
    for i in range(b):
        ref_out, ref_w = reference_attention(q_t[i : i + 1], keys[i : i + 1], values[i : i + 1])
        check_close(output[i : i + 1], ref_out, rtol=rtol, atol=atol, what=f"output of sequence {i}")
        check_close(weights[i : i + 1], ref_w, rtol=rtol, atol=atol, what=f"weights of sequence {i}")
        max_err = max(max_err, float(np.max(np.abs(output[i : i + 1].astype(np.float64) - ref_out))))
    return max_err


def reference_paged_decode_attention(
    q: FloatArray,
    k_cache: FloatArray,
    v_cache: FloatArray,
    block_tables: npt.NDArray[np.integer[Any]],
    context_lens: npt.NDArray[np.integer[Any]],
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> FloatArray:
    """Decode attention over a paged cache in NumPy: request b's one query attends to its positions
    0 .. context_lens[b] - 1 (context_lens >= 1), read through block_tables (vLLM's CPU layout).

    window W: only positions t > context_lens[b] - 1 - W (the last W) are attended, and the table's
    entries of blocks wholly before them are not looked at (they may be -1, or blocks of anything,
    NaN included). softcap c: scores s (after the scale) become c tanh(s / c) before the softmax
    (Gemma 2).

    q `[B, H, D]`, k_cache `[num_blocks, H_kv, D, block_size]` (positions innermost), v_cache
    `[num_blocks, H_kv, block_size, D]`, block_tables `[B, max_blocks]` (padded with -1), context_lens
    `[B]` -> `[B, H, D]` in q's dtype; scale 1/sqrt(D). The blocks of all B requests are gathered into
    one `[B, T, H_kv, D]` copy of K and of V (T = the longest context), positions >= context_lens[b]
    are masked out, and the softmax is written out in two passes: an implementation that shares nothing
    with the compiled `decode_attention.paged_decode_attention` (online softmax, blocks read in place), which the
    tests hold to it. No argument checks (a test oracle).
    """
    b, h, d = q.shape
    _, h_kv, _, block_size = k_cache.shape
    lens = context_lens.astype(np.int64)  # [B]
    starts = np.zeros_like(lens) if window is None else np.maximum(lens - window, 0)  # [B], first attended
    max_blocks = -(-int(lens.max()) // block_size)
    block_starts = np.arange(max_blocks, dtype=np.int64)[None, :] * block_size  # [1, max_blocks]
    needed = (lens[:, None] > block_starts) & (starts[:, None] < block_starts + block_size)  # [B, max_blocks]
    safe = np.where(needed, block_tables[:, :max_blocks], 0)  # padding reads block 0, never attended below
    t = int(lens.max())
    g = h // h_kv
    keys = k_cache[safe].transpose(0, 1, 4, 2, 3).reshape(b, -1, h_kv, d)[:, :t]  # [B, T, H_kv, D], a copy
    values = v_cache[safe].transpose(0, 1, 3, 2, 4).reshape(b, -1, h_kv, d)[:, :t]  # [B, T, H_kv, D]
    q_g = q.reshape(b, h_kv, g, d) * q.dtype.type(1 / math.sqrt(d))  # [B, H_kv, G, D], scaled
    positions = np.arange(t, dtype=np.int64)[None, :]  # [1, T]
    keep = (lens[:, None] > positions) & (starts[:, None] <= positions)  # [B, T]
    keys = np.where(keep[:, :, None, None], keys, 0.0)  # what is not attended may be NaN
    values = np.where(keep[:, :, None, None], values, 0.0)
    scores = q_g @ keys.transpose(0, 2, 3, 1)  # [B, H_kv, G, T]
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    scores = np.where(keep[:, None, None, :], scores, -np.inf)  # each row keeps one position at least
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)  # [B, H_kv, G, T], unnormalised weights
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ values.transpose(0, 2, 1, 3)  # [B, H_kv, G, D]
    return out.reshape(b, h, d)  # [B, H, D]
