"""The untimed memory pass of the cache-growth experiment: N decode steps under tracemalloc.

Per step it records what the cache's append allocated at its peak, the whole step's peak (append,
then attention's temporaries), the bytes still held afterwards, the cache's `nbytes` and the theoretical
2 x B x H_kv x T x D x itemsize of its T valid positions (`presets.kv_cache_bytes`). Kept apart from the
timed passes in `cache_growth.py`: tracemalloc slows every allocation, so nothing here is timed.

Shape letters as in `attention.py`: B batch, H query heads, H_kv KV heads, T cached positions, D head
dim, and N steps.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

from attention_kv_caceh.attention import scaled_dot_product_attention
from attention_kv_caceh.experiments.cache_growth_stats import CacheMemoryRow, FloatArray
from attention_kv_caceh.presets import kv_cache_bytes

__all__ = ["trace_decode_memory"]


def trace_decode_memory(
    kind: str,
    cache: Any,
    q: FloatArray,
    k: FloatArray,
    v: FloatArray,
    params: dict[str, Any],
    rows: list[CacheMemoryRow],
) -> list[CacheMemoryRow]:
    """Decode `len(q)` steps on the empty `cache` under tracemalloc; append one CacheMemoryRow per step.

    q `[N, B, H, 1, D]`, k and v `[N, B, H_kv, 1, D]`; `params` are the run's parameters recorded on each
    row (batch_size, num_heads, num_kv_heads, head_dim, dtype, model, seed, steps). Returns `rows`.
    Raises ValueError if tracemalloc is already tracing (its numbers would mix with the caller's).
    """
    if tracemalloc.is_tracing():
        raise ValueError("tracemalloc is already tracing; stop it before measuring cache memory")
    itemsize = int(k.dtype.itemsize)
    batch_size, num_kv_heads, head_dim = k.shape[1], k.shape[2], k.shape[4]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(q.shape[0]):
            t = i + 1
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            keys, values = cache.append(k[i], v[i])  # [B, H_kv, T, D] each
            mid, append_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            out, weights = scaled_dot_product_attention(q[i], keys, values)  # [B,H,1,D], [B,H,1,T]
            attention_peak = tracemalloc.get_traced_memory()[1]
            fresh = sum(int(a.nbytes) for a in (keys, values) if a.flags.owndata)
            del keys, values, out, weights
            after = tracemalloc.get_traced_memory()[0]
            rows.append(
                CacheMemoryRow(
                    cache=kind,
                    step=i,
                    sequence_length=t,
                    new_buffer_bytes=fresh,
                    append_peak_bytes=append_peak - before,
                    step_peak_bytes=max(append_peak, attention_peak, mid) - before,
                    retained_bytes=after - before,
                    traced_bytes=after - base,
                    cache_nbytes=int(cache.nbytes),
                    theoretical_bytes=kv_cache_bytes(batch_size, num_kv_heads, t, head_dim, itemsize),
                    **params,
                )
            )
    finally:
        tracemalloc.stop()
    return rows
