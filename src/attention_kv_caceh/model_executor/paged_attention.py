"""Paged attention over a flattened batch: write new K/V through the slot mapping, read through block tables.

What vLLM v1 does in `v1/attention/backends/` (the attention metadata, `reshape_and_cache` and the
varlen attention call) in NumPy: the KV cache of one layer is a pool of fixed-size blocks; a request's
positions live in the blocks its block table lists, position p at offset p % block_size of block
block_table[p // block_size]. The layout is vLLM's CPU one (`allocate_kv_cache`): per block and KV
head, a K tile `[D, block_size]` (positions innermost, so a block's scores are vectors) followed by a
V tile `[block_size, D]`, and a block's heads one after another, so the decode kernel reads each block
as one contiguous stretch. Each
request's attention gathers its blocks into a contiguous `[H_kv, T, D]` copy and calls the lab's
`scaled_dot_product_attention` (GQA without repeating K/V, bottom-right causal mask), so the paged
layout changes only where K/V are stored, never the arithmetic. A step whose requests are all decoding
(one query each) takes the compiled `decode_attention.paged_decode_attention_into` instead (vLLM's
`paged_attention_v1`), which reads the blocks in place. Nothing here checks its arguments: the model
runner builds and validates a step's metadata once (`ModelRunner.prepare_inputs`).

Sliding windows (Mistral, Gemma) and soft-capped scores (Gemma 2) take `_window_attention`, the same
arithmetic written out with their mask: a sliding layer's query at position p sees the keys at
p - window < s <= p (transformers' `sliding_window_overlay`), and the gather starts at the block
holding the first query's first key, so no block that lies wholly before every query's window is read
(the KV cache manager may have freed it, and its table entry may name a block another request now uses).

Shape legend: N scheduled tokens (all requests, flattened), R scheduled requests, H query heads, H_kv
KV heads, D head dim, T a request's context length, max_blocks the longest block table.

Left out: the GPU backends (FlashAttention, FlashInfer, Triton) and a fused varlen kernel for prefill (a
prefill here gathers its blocks into a copy), cascade attention, ALiBi, an FP8 KV cache, and the
multi-partition `paged_attention_v2`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.attention import scaled_dot_product_attention

__all__ = ["AttentionMetadata", "allocate_kv_cache", "pack_kv_blocks", "paged_attention", "write_kv"]

FloatArray = npt.NDArray[np.floating[Any]]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens sit in the paged KV cache (vLLM v1's attention metadata, same names).

    slot_mapping `[N]` int64: flat cache slot of each scheduled token,
        block_id * block_size + position % block_size.
    query_start_loc `[R+1]` int64: request r's tokens are rows query_start_loc[r] : query_start_loc[r+1].
    block_tables `[R, max_blocks]` int32, padded with -1: request r's block ids in position order.
    context_lens `[R]` int64: positions request r attends to after this step (cached + scheduled).

    Built by `ModelRunner.prepare_inputs`, which checks the scheduler's requests it comes from; no
    checks here.
    """

    slot_mapping: IntArray
    query_start_loc: IntArray
    block_tables: npt.NDArray[np.int32]
    context_lens: IntArray
    block_size: int

    @property
    def is_pure_decode(self) -> bool:
        """Every request schedules exactly one token (vLLM's max_query_len == 1)."""
        return int(self.query_start_loc[-1]) == self.context_lens.shape[0]


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: npt.DTypeLike
) -> tuple[FloatArray, FloatArray]:
    """One layer's zeroed KV cache as (k_cache, v_cache), two views of one buffer
    `[num_blocks, H_kv, 2, D * block_size]`: k_cache `[num_blocks, H_kv, D, block_size]` (the K tile of
    each block and head, positions innermost) and v_cache `[num_blocks, H_kv, block_size, D]` (its V
    tile, right after it in memory)."""
    tile = head_dim * block_size
    buffer = np.zeros((num_blocks, num_kv_heads, 2, tile), dtype=dtype)  # [NB, H_kv, K | V, D * BS]
    k_cache = buffer[:, :, 0].reshape(num_blocks, num_kv_heads, head_dim, block_size, copy=False)  # a view
    v_cache = buffer[:, :, 1].reshape(num_blocks, num_kv_heads, block_size, head_dim, copy=False)
    return k_cache, v_cache


def pack_kv_blocks(k_blocks: FloatArray, v_blocks: FloatArray) -> tuple[FloatArray, FloatArray]:
    """The cache (`allocate_kv_cache`) holding blocks given position-major, `[NB, BS, H_kv, D]` each
    (block b's row t is position t of the block, as gathering positions gives them): a new cache in
    the blocks' dtype. For tests and benchmarks that build their blocks position by position."""
    num_blocks, block_size, h_kv, d = k_blocks.shape
    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, h_kv, d, k_blocks.dtype)
    k_cache[...] = k_blocks.transpose(0, 2, 3, 1)  # [NB, H_kv, D, BS]
    v_cache[...] = v_blocks.transpose(0, 2, 1, 3)  # [NB, H_kv, BS, D]
    return k_cache, v_cache


def write_kv(
    k_cache: FloatArray, v_cache: FloatArray, k: FloatArray, v: FloatArray, slot_mapping: IntArray
) -> None:
    """Store the new keys and values `[N, H_kv, D]` at their slots of the caches (`allocate_kv_cache`).

    In place (vLLM's `reshape_and_cache`): token i goes to block slot_mapping[i] // block_size at offset
    slot_mapping[i] % block_size, a column of every head's K tile and a row of its V tile. Unchecked:
    slots come from `ModelRunner.prepare_inputs` (a slot outside the pool raises NumPy's IndexError).
    """
    block_size = k_cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # [N] each
    k_cache[blocks, :, :, offsets] = k  # [N, H_kv, D] into [NB, H_kv, D, BS]
    v_cache[blocks, :, offsets, :] = v  # [N, H_kv, D] into [NB, H_kv, BS, D]


def paged_attention(
    q: FloatArray,
    k_cache: FloatArray,
    v_cache: FloatArray,
    metadata: AttentionMetadata,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    requests: IntArray | None = None,
) -> FloatArray:
    """Causal attention of each request's queries over its context, read through its block table.

    q `[N, H, D]` (already rotated), caches as `allocate_kv_cache` makes them, already holding this
    step's K/V (see `write_kv`) -> output `[N, H, D]`. Request r's n queries are its last n positions of
    context_lens[r]: query i sees positions 0 .. context_len - n + i, the bottom-right causal mask of
    `attention_kv_caceh.attention.causal_mask`. scale: the factor of q k^T (None: 1/sqrt(D)). window:
    a sliding layer's window W (None: full attention): query position p sees only positions > p - W, and
    the blocks before the first query's window are not read. softcap: scores become
    softcap * tanh(scores / softcap) before the mask and softmax (Gemma 2; None: off). requests: the
    indices of the requests to compute (None: all); the rows of the others are left unwritten.
    """
    _, h_kv, d, block_size = k_cache.shape
    out = np.empty_like(q)  # [N, H, D]
    for r in range(metadata.context_lens.shape[0]) if requests is None else requests.tolist():
        start, end = int(metadata.query_start_loc[r]), int(metadata.query_start_loc[r + 1])
        t = int(metadata.context_lens[r])
        first = 0 if window is None else max(0, t - (end - start) - window + 1) // block_size
        blocks = metadata.block_tables[r, first : -(-t // block_size)]  # [ceil(T / block_size) - first]
        length = t - first * block_size  # positions first * block_size .. t - 1
        keys = k_cache[blocks].transpose(1, 0, 3, 2).reshape(h_kv, -1, d)[:, :length]  # [H_kv, T', D], a copy
        values = v_cache[blocks].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :length]  # [H_kv, T', D]
        q_r = q[start:end].transpose(1, 0, 2)  # [H, n, D]
        if window is None and softcap is None:
            o_r, _ = scaled_dot_product_attention(
                q_r[None], keys[None], values[None], is_causal=True, scale=scale
            )
            o_r = o_r[0]  # [H, n, D]
        else:
            o_r = _window_attention(q_r, keys, values, t, scale, window, softcap)
        out[start:end] = o_r.transpose(1, 0, 2)  # [n, H, D]
    return out


def _window_attention(
    q: FloatArray,
    keys: FloatArray,
    values: FloatArray,
    context_len: int,
    scale: float | None,
    window: int | None,
    softcap: float | None,
) -> FloatArray:
    """softmax(mask(cap(q k^T * scale))) v for one request: q `[H, n, D]` at positions context_len - n ..
    context_len - 1, keys and values `[H_kv, T', D]` the last T' positions of its context -> `[H, n, D]`.

    The mask keeps key position s for query position p when s <= p and (no window) or s > p - window;
    each query keeps at least its own key. In q's dtype; GQA as `scaled_dot_product_attention` (the G
    query heads of a KV head as rows of one product)."""
    h, n, d = q.shape
    h_kv, length, _ = keys.shape
    dt = q.dtype.type
    s = dt(d**-0.5 if scale is None else scale)
    q_rows = q.reshape(h_kv, (h // h_kv) * n, d)  # [H_kv, G n, D]
    scores = ((q_rows * s) @ keys.transpose(0, 2, 1)).reshape(h_kv, h // h_kv, n, length)  # [H_kv, G, n, T']
    if softcap is not None:
        scores = dt(softcap) * np.tanh(scores / dt(softcap))
    q_pos: IntArray = np.arange(context_len - n, context_len, dtype=np.int64)[:, None]  # [n, 1]
    k_pos: IntArray = np.arange(context_len - length, context_len, dtype=np.int64)[None, :]  # [1, T']
    keep: npt.NDArray[np.bool_] = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    scores = np.where(keep, scores, dt(-np.inf))
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = scores / scores.sum(axis=-1, keepdims=True)  # [H_kv, G, n, T']
    return (weights.reshape(h_kv, -1, length) @ values).reshape(h, n, d)  # [H, n, D]
