"""Compiled decode attention (Numba): one query row per head over a contiguous or a paged KV cache.

Decode attention reads every cached key and value once per step, so its speed is set by how fast the
cache can be read. The NumPy path (`attention.scaled_dot_product_attention`) makes two passes (scores,
then weights times V) with temporaries in between; these kernels make one: online softmax as in
FlashAttention / Flash-Decoding (Milakov & Gimelshein 2018; Dao et al. 2022), a running max m, a
running sum z and an accumulator acc per query head, so K and V are each read once and nothing of
size T is written. With grouped-query attention the G = H // H_kv query heads of one KV head are done
together, so each KV head is read once for its whole group.

Two layouts (shape legend as in attention.py; NB physical KV blocks, BS positions per block):
- contiguous, the lab's caches: q `[B, H, D]` (or `[B, H, 1, D]`), k and v `[B, H_kv, T, D]`, any
  strides (a PreallocatedKVCache's view of its larger buffer is read in place, never copied);
- paged, the engine's (vLLM's CPU layout, `model_executor.paged_attention.allocate_kv_cache`): k_cache
  `[NB, H_kv, D, BS]` (positions innermost) and v_cache `[NB, H_kv, BS, D]`, each (block, head) tile
  contiguous, block_tables `[B, max_blocks]` int32 padded with -1, context_lens `[B]` int32; sequence
  b's position t lives in block block_tables[b, t // BS] at offset t % BS.
float32 and float64; the tuned kernels' accumulators have the input's dtype.

Three kernels, one result. `plain_decode_attention` is the readable one: one loop nest over
(sequence, query head, position), a rescale per position, sums in float64; it is the reference the
tuned kernels are tested against. `decode_attention` is tuned for contiguous caches: positions in
chunks of `CONTIGUOUS_CHUNK` (scores of the whole chunk first, then one rescale, then V eight rows at
a time), the chunk's max tracked while the scores are computed, a vectorised float32 exp, and K
prefetched a few rows ahead (`_decode_attention_jit`). `paged_decode_attention` folds one block at a time
into the online softmax, its scores vectors across the block's positions (`_decode_attention_paged_jit`).
docs/kernels.md walks from the plain kernel to the tuned ones and gives what each step bought, measured.

Compile time: each kernel is compiled at its first call for the argument types it gets (dtype, and
C-contiguous or strided layout) and cached on disk (`cache=True`). Numba writes the cache to
`__pycache__` beside this module, or, when that directory is read-only (an installed package), to a
user-wide directory; `NUMBA_CACHE_DIR` overrides both (set it in CI to a cached folder, or accept one
compile per fresh clone). Call `prepare_*` once on the arrays a benchmark will time so compiling stays
out of the timed region; `compile_seconds()` returns what those first calls took.
"""

from __future__ import annotations

import math
import time
from typing import Any, cast

import numba
import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels import _decode_attention_jit as _jit
from attention_kv_caceh.kernels import _decode_attention_paged_jit

__all__ = [
    "CONTIGUOUS_CHUNK",
    "compile_seconds",
    "decode_attention",
    "decode_attention_into",
    "paged_decode_attention",
    "paged_decode_attention_into",
    "plain_decode_attention",
    "prepare_decode_attention",
    "prepare_paged_decode_attention",
]

FloatArray = npt.NDArray[np.floating[Any]]
IntArray = npt.NDArray[np.integer[Any]]

CONTIGUOUS_CHUNK = 1024  # positions per online-softmax rescale (docs/kernels.md)
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_COMPILE_SECONDS: dict[str, float] = {}


def _set_threads(threads: int) -> None:
    limit = int(cast(Any, numba).config.NUMBA_NUM_THREADS)  # the thread pool's size
    if not 1 <= threads <= limit:
        raise ValueError(f"threads must be in [1, {limit}] (NUMBA_NUM_THREADS), got {threads}")
    numba.set_num_threads(threads)


def decode_attention_into(
    q: FloatArray, k: FloatArray, v: FloatArray, out: FloatArray, scale: float, threads: int = 1
) -> None:
    """The hot path of `decode_attention`: no checks, no allocation. q and out `[B, H, D]`.

    Call it only with arguments `decode_attention` accepts (same dtypes, shapes as documented there);
    anything else gives undefined results.
    """
    if threads == 1:
        _jit.contiguous_serial(q, k, v, out, scale, CONTIGUOUS_CHUNK)
    else:
        _set_threads(threads)
        _jit.contiguous_parallel(q, k, v, out, scale, CONTIGUOUS_CHUNK)


def _check_float(name: str, x: npt.NDArray[Any], dtype: np.dtype[Any] | None = None) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32 or float64, got dtype {x.dtype} with shape {x.shape}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} has dtype {x.dtype}, expected {dtype} (the query's)")


def _as_rows(q: FloatArray, name: str) -> FloatArray:
    """`[B, H, D]` or `[B, H, 1, D]` -> a `[B, H, D]` view."""
    if q.ndim == 4 and q.shape[2] == 1:
        return q[:, :, 0]  # [B, H, D], a view
    if q.ndim != 3:
        raise ValueError(f"{name} must be [B, H, D] or [B, H, 1, D], got shape {q.shape}")
    return q


def _check_out(out: FloatArray | None, q: FloatArray) -> FloatArray:
    if out is None:
        return np.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            f"out must have the query's shape {q.shape} and dtype {q.dtype}, got {out.shape} {out.dtype}"
        )
    if not out.flags.writeable or np.shares_memory(out, q):
        raise ValueError("out must be writeable and must not overlap q")
    return out


def _scale(scale: float | None, d: int) -> float:
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(s):
        raise ValueError(f"scale must be finite, got {scale}")
    return s


def decode_attention(
    q: FloatArray,
    k: FloatArray,
    v: FloatArray,
    *,
    scale: float | None = None,
    out: FloatArray | None = None,
    threads: int = 1,
) -> FloatArray:
    """softmax(q K^T * scale) V for one query position per head, in one pass over K and V.

    q `[B, H, D]` or `[B, H, 1, D]`; k and v `[B, H_kv, T, D]` with H % H_kv == 0 (query head h reads
    KV head h // (H // H_kv)), T >= 1, any strides; all float32 or all float64. scale defaults to
    1 / sqrt(D) (Vaswani et al., 2017, eq. 1). out, when given, has q's shape and dtype and is written in
    place (no allocation). threads > 1 spreads the B * H_kv work items over Numba's threads.
    Returns out (q's shape and dtype).

    Raises ValueError for a wrong rank, mismatched B / H_kv / T / D, H not a multiple of H_kv, T = 0,
    a non-float or mixed dtype, a bad out, or threads outside [1, NUMBA_NUM_THREADS].
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    q3 = _as_rows(q, "q")
    _check_float("q", q3)
    _check_float("k", k, q3.dtype)
    _check_float("v", v, q3.dtype)
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [B, H_kv, T, D], got {k.shape} and {v.shape}")
    b, h, d = q3.shape
    _, h_kv, t, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on B or D")
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"H={h} must be a multiple of H_kv={h_kv}")
    if t == 0 or d == 0:
        raise ValueError(f"k must hold at least one position of D >= 1, got shape {k.shape}")
    result = _check_out(out, q)
    if threads != 1:
        _set_threads(threads)
    decode_attention_into(q3, k, v, _as_rows(result, "out"), _scale(scale, d), threads)
    return result


def _tiles_contiguous(k_cache: FloatArray, v_cache: FloatArray) -> bool:
    """Each (block, head) tile of both caches is contiguous (the IR kernel reads tiles by pointer)."""
    item = k_cache.itemsize
    d, bs = k_cache.shape[2], k_cache.shape[3]
    return k_cache.strides[2:] == (bs * item, item) and v_cache.strides[2:] == (d * item, item)


def paged_decode_attention_into(
    q: FloatArray,
    k_cache: FloatArray,
    v_cache: FloatArray,
    block_tables: IntArray,
    context_lens: IntArray,
    out: FloatArray,
    scale: float,
    threads: int = 1,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The hot path of `paged_decode_attention`: no checks, no allocation. q and out `[B, H, D]`.

    Only for arguments `paged_decode_attention` accepts: a block id out of range reads out of bounds.
    window / softcap (sliding-window layers, Gemma 2's soft-capped scores) take the NumPy
    `_windowed_paged_decode`, which reads only the blocks a window reaches.
    """
    if window is not None or softcap is not None:
        _windowed_paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, scale, window, softcap)
        return
    fast = _decode_attention_paged_jit.fast_shape(
        q.dtype, q.shape[2], k_cache.shape[3], _tiles_contiguous(k_cache, v_cache)
    )
    if threads == 1:
        _decode_attention_paged_jit.paged_serial(
            q, k_cache, v_cache, block_tables, context_lens, out, scale, fast
        )
    else:
        _set_threads(threads)
        _decode_attention_paged_jit.paged_parallel(
            q, k_cache, v_cache, block_tables, context_lens, out, scale, fast
        )


def _windowed_paged_decode(
    q: FloatArray,
    k_cache: FloatArray,
    v_cache: FloatArray,
    block_tables: IntArray,
    context_lens: IntArray,
    out: FloatArray,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> None:
    """Decode attention with a sliding window and/or soft-capped scores, in NumPy, into out `[B, H, D]`.

    Sequence b's query sits at position L - 1 (L = context_lens[b]) and attends to positions
    max(0, L - window) .. L - 1 (all of them without a window): transformers' `sliding_window_overlay`,
    keys s with s > p - window. Only the blocks holding those positions are read, from block
    (L - window) // BS on; the table entries before it are never looked at (the KV cache manager may
    have freed those blocks). Scores s * (q . k) become softcap * tanh(scores / softcap) when softcap
    is set (Gemma 2), then a softmax over the window. In q's dtype; a sequence with L = 0 gets zeros.
    """
    _, h_kv, d, block_size = k_cache.shape
    h = q.shape[1]
    g = h // h_kv
    dt = q.dtype.type
    for b in range(q.shape[0]):
        length = int(context_lens[b])
        if length == 0:
            out[b] = 0
            continue
        begin = 0 if window is None else max(0, length - window)  # the first position the query sees
        first, last = begin // block_size, -(-length // block_size)
        blocks = block_tables[b, first:last]
        lo, hi = begin - first * block_size, length - first * block_size
        keys = k_cache[blocks].transpose(1, 0, 3, 2).reshape(h_kv, -1, d)[:, lo:hi]  # [H_kv, T', D]
        values = v_cache[blocks].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, lo:hi]  # [H_kv, T', D]
        rows = q[b].reshape(h_kv, g, d) * dt(scale)  # [H_kv, G, D]
        scores = rows @ keys.transpose(0, 2, 1)  # [H_kv, G, T']
        if softcap is not None:
            scores = dt(softcap) * np.tanh(scores / dt(softcap))
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[b] = (weights @ values).reshape(h, d)  # [H, D]


def paged_decode_attention(
    q: FloatArray,
    k_cache: FloatArray,
    v_cache: FloatArray,
    block_tables: IntArray,
    context_lens: IntArray,
    *,
    scale: float | None = None,
    out: FloatArray | None = None,
    threads: int = 1,
    window: int | None = None,
    softcap: float | None = None,
) -> FloatArray:
    """Decode attention over a paged KV cache (vLLM's CPU layout), one pass over each sequence's blocks.

    q `[B, H, D]` (or `[B, H, 1, D]`); k_cache `[NB, H_kv, D, BS]` and v_cache `[NB, H_kv, BS, D]` (any
    strides; `model_executor.paged_attention.allocate_kv_cache` makes them, with each block one contiguous
    stretch); block_tables `[B, max_blocks]` int32, row b listing sequence b's blocks in position order
    (entries past its last block are ignored, -1 by convention); context_lens `[B]` int32,
    0 <= context_lens[b] <= max_blocks * BS. A sequence with context length 0 gets a zero output.
    Every block id a sequence uses must be in [0, NB); blocks may be shared between sequences and
    appear in any order. scale, out and threads as in `decode_attention`. window: sequence b attends
    only to its last `window` positions (a sliding-window layer; the blocks before them are neither
    read nor checked); softcap: scores become softcap * tanh(scores / softcap) (Gemma 2). Returns out
    `[B, H, D]` (q's shape and dtype).

    Raises ValueError for wrong shapes or dtypes (block_tables and context_lens must be int32), a
    context length outside its range, a used block id outside [0, NB), a window below 1 or a softcap
    that is not > 0.
    """
    q, k_cache, v_cache = np.asarray(q), np.asarray(k_cache), np.asarray(v_cache)
    block_tables, context_lens = np.asarray(block_tables), np.asarray(context_lens)
    q3 = _as_rows(q, "q")
    _check_float("q", q3)
    _check_float("k_cache", k_cache, q3.dtype)
    _check_float("v_cache", v_cache, q3.dtype)
    if k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(
            f"k_cache must be [NB, H_kv, D, BS] and v_cache [NB, H_kv, BS, D], got {k_cache.shape} and {v_cache.shape}"
        )
    b, h, d = q3.shape
    num_blocks, h_kv, _, block_size = k_cache.shape
    if v_cache.shape != (num_blocks, h_kv, block_size, k_cache.shape[2]):
        raise ValueError(f"v_cache {v_cache.shape} must be [NB, H_kv, BS, D] for k_cache {k_cache.shape}")
    if k_cache.shape[2] != d or h_kv == 0 or h % h_kv or block_size == 0:
        raise ValueError(f"q {q.shape} and k_cache {k_cache.shape}: need equal D, BS >= 1, H % H_kv == 0")
    if block_tables.dtype != np.int32 or block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(
            f"block_tables must be int32 [B={b}, max_blocks], got {block_tables.dtype} {block_tables.shape}"
        )
    if context_lens.dtype != np.int32 or context_lens.shape != (b,):
        raise ValueError(f"context_lens must be int32 [B={b}], got {context_lens.dtype} {context_lens.shape}")
    capacity = block_tables.shape[1] * block_size
    if np.any(context_lens < 0) or np.any(context_lens > capacity):
        raise ValueError(f"context_lens {context_lens.tolist()} must be in [0, max_blocks * BS = {capacity}]")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    blocks_used: npt.NDArray[np.int64] = (context_lens.astype(np.int64) + block_size - 1) // block_size  # [B]
    slots: npt.NDArray[np.int64] = np.arange(block_tables.shape[1], dtype=np.int64)  # [max_blocks]
    used = slots[None, :] < blocks_used[:, None]  # [B, max_blocks]
    if window is not None:  # the blocks wholly before the window are not read
        first_used = np.maximum(context_lens.astype(np.int64) - window, 0) // block_size  # [B]
        used &= slots[None, :] >= first_used[:, None]
    ids = block_tables[used]
    if np.any(ids < 0) or np.any(ids >= num_blocks):
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise ValueError(f"block_tables uses block id {bad}, outside [0, NB={num_blocks})")
    result = _check_out(out, q)
    if threads != 1:
        _set_threads(threads)
    paged_decode_attention_into(
        q3,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        _as_rows(result, "out"),
        _scale(scale, d),
        threads,
        window=window,
        softcap=softcap,
    )
    return result


def _timed_first_call(name: str, call: Any, *args: Any) -> float:
    """Run `call(*args)`; record its time under `name` if no earlier call did."""
    start = time.perf_counter()
    call(*args)
    seconds = time.perf_counter() - start
    _COMPILE_SECONDS.setdefault(name, seconds)
    return _COMPILE_SECONDS[name]


def _layout(*arrays: npt.NDArray[Any]) -> str:
    return "C" if all(a.flags.c_contiguous for a in arrays) else "A"


def prepare_decode_attention(
    q: FloatArray, k: FloatArray, v: FloatArray, out: FloatArray, threads: int = 1
) -> float:
    """Compile (or load from Numba's disk cache) the contiguous kernel for these exact argument types.

    Same arguments as `decode_attention_into` (q and out `[B, H, D]`); runs the kernel once on them
    (out is overwritten). Returns the seconds the first such call in this process took, recorded in
    `compile_seconds()` under "contiguous/<dtype>/<layout>/threads=<n>".
    """
    name = f"contiguous/{q.dtype}/{_layout(q, k, v, out)}/threads={threads}"
    return _timed_first_call(name, decode_attention_into, q, k, v, out, 1.0, threads)


def prepare_paged_decode_attention(
    q: FloatArray,
    k_cache: FloatArray,
    v_cache: FloatArray,
    block_tables: IntArray,
    context_lens: IntArray,
    out: FloatArray,
    threads: int = 1,
) -> float:
    """As `prepare_decode_attention`, for the paged kernel ("paged/<dtype>/<layout>/threads=<n>")."""
    name = f"paged/{q.dtype}/{_layout(q, k_cache, v_cache, out)}/threads={threads}"  # layout A: the views
    args = (q, k_cache, v_cache, block_tables, context_lens, out, 1.0, threads)
    return _timed_first_call(name, paged_decode_attention_into, *args)


def compile_seconds() -> dict[str, float]:
    """Seconds each first `prepare_*` call took in this process (compile, or a disk-cache load), by name."""
    return dict(_COMPILE_SECONDS)


def plain_decode_attention(
    q: FloatArray, k: FloatArray, v: FloatArray, *, scale: float | None = None
) -> FloatArray:
    """The readable kernel (`_decode_attention_jit.plain_serial`): the same result as `decode_attention`.

    One loop nest over (sequence, query head, position) with an online softmax, no tuning; kept as the
    reference the tuned kernels are tested against and as the first step of docs/kernels.md.
    q `[B, H, D]` or `[B, H, 1, D]`; k and v `[B, H_kv, T, D]`, T >= 1, H % H_kv == 0; all float32 or all
    float64. scale defaults to 1 / sqrt(D). Returns a new array of q's shape and dtype (sums in float64).

    Raises ValueError for a wrong rank or dtype, mismatched shapes, H not a multiple of H_kv, or T = 0.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    q3 = _as_rows(q, "q")
    _check_float("q", q3)
    _check_float("k", k, q3.dtype)
    _check_float("v", v, q3.dtype)
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != q3.shape[0] or k.shape[3] != q3.shape[2]:
        raise ValueError(f"k and v must be [B, H_kv, T, D] matching q {q.shape}, got {k.shape} and {v.shape}")
    h, h_kv, t, d = q3.shape[1], k.shape[1], k.shape[2], q3.shape[2]
    if h_kv == 0 or h % h_kv or t == 0 or d == 0:
        raise ValueError(f"need H % H_kv == 0, T >= 1 and D >= 1; got q {q.shape} and k {k.shape}")
    out = np.empty_like(q)
    _jit.plain_serial(q3, k, v, _as_rows(out, "out"), _scale(scale, d))
    return out
