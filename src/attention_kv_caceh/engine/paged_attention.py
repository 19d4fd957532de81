"""Paged attention over a flattened batch: write new K/V through the slot mapping, read through block tables.

What vLLM v1 does in `v1/attention/backends/` (the FlashAttention backend's metadata and its
`reshape_and_cache_flash` + `flash_attn_varlen_func` pair) in NumPy: the KV cache of one layer is a
pool of fixed-size blocks `[num_blocks, block_size, H_kv, D]`; a request's positions live in the blocks
its block table lists, position p at row p % block_size of block block_table[p // block_size]. Each
request's attention gathers its blocks into a contiguous `[H_kv, T, D]` copy and calls the lab's
`scaled_dot_product_attention` (GQA without repeating K/V, bottom-right causal mask), so the paged
layout changes only where K/V are stored, never the arithmetic. A step whose requests are all decoding
(one query each) takes `paged_decode_attention` instead: vLLM's `paged_attention_v1` signature, done as
one gather of every request's blocks and one batched attention call with a length mask, so a decode step
costs one NumPy call per layer rather than one per request. Left out: a fused kernel that reads blocks
in place (the gathers copy T x H_kv x D per request per layer).

Shape legend: N scheduled tokens (all requests, flattened), R scheduled requests, H query heads, H_kv
KV heads, D head dim, T a request's context length, max_blocks the longest block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.attention import scaled_dot_product_attention

__all__ = ["AttentionMetadata", "paged_attention", "paged_decode_attention", "write_kv"]

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

    Raises ValueError when the arrays disagree on R or N, or a request has no scheduled token, more
    scheduled tokens than its context, or too few blocks for its context.
    """

    slot_mapping: IntArray
    query_start_loc: IntArray
    block_tables: npt.NDArray[np.int32]
    context_lens: IntArray
    block_size: int

    def __post_init__(self) -> None:
        r = self.context_lens.shape[0]
        if (
            self.query_start_loc.shape != (r + 1,)
            or self.block_tables.ndim != 2
            or self.block_tables.shape[0] != r
        ):
            raise ValueError(
                f"query_start_loc {self.query_start_loc.shape}, block_tables {self.block_tables.shape} and "
                f"context_lens {self.context_lens.shape} disagree on R={r}"
            )
        if self.slot_mapping.shape != (int(self.query_start_loc[-1]),) or self.query_start_loc[0] != 0:
            raise ValueError(
                f"slot_mapping {self.slot_mapping.shape} does not match query_start_loc {self.query_start_loc}"
            )
        num_query = np.diff(self.query_start_loc)  # [R]
        if np.any(num_query < 1) or np.any(num_query > self.context_lens):
            raise ValueError(
                f"each request needs 1 <= scheduled tokens <= context_len, got {num_query} and {self.context_lens}"
            )
        blocks_needed = -(-self.context_lens // self.block_size)  # [R], ceil division
        blocks_held = np.sum(self.block_tables >= 0, axis=1)  # [R]
        if np.any(blocks_held < blocks_needed):
            raise ValueError(
                f"block tables hold {blocks_held} blocks, context lens {self.context_lens} need {blocks_needed} "
                f"(block_size {self.block_size})"
            )

    @property
    def is_pure_decode(self) -> bool:
        """Every request schedules exactly one token (vLLM's max_query_len == 1)."""
        return int(self.query_start_loc[-1]) == self.context_lens.shape[0]


def write_kv(
    k_cache: FloatArray, v_cache: FloatArray, k: FloatArray, v: FloatArray, slot_mapping: IntArray
) -> None:
    """Store the new keys and values `[N, H_kv, D]` at their slots of `[num_blocks, block_size, H_kv, D]`.

    In place (vLLM's `reshape_and_cache`): the caches are viewed as `[num_blocks * block_size, H_kv, D]`
    and row slot_mapping[i] receives token i. Raises ValueError for mismatched shapes or a slot
    outside the pool.
    """
    num_blocks, block_size, h_kv, d = k_cache.shape
    if v_cache.shape != k_cache.shape or k.shape != v.shape or k.shape[1:] != (h_kv, d):
        raise ValueError(f"caches {k_cache.shape}/{v_cache.shape} and new K/V {k.shape}/{v.shape} disagree")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {slot_mapping.shape} does not match {k.shape[0]} tokens")
    if slot_mapping.size and (slot_mapping.min() < 0 or slot_mapping.max() >= num_blocks * block_size):
        raise ValueError(f"slot_mapping has slots outside 0 .. {num_blocks * block_size - 1}: {slot_mapping}")
    k_cache.reshape(num_blocks * block_size, h_kv, d)[slot_mapping] = k  # a view: writes the pool
    v_cache.reshape(num_blocks * block_size, h_kv, d)[slot_mapping] = v


def paged_attention(
    q: FloatArray, k_cache: FloatArray, v_cache: FloatArray, metadata: AttentionMetadata
) -> FloatArray:
    """Causal attention of each request's queries over its context, read through its block table.

    q `[N, H, D]` (already rotated), caches `[num_blocks, block_size, H_kv, D]` already holding this
    step's K/V (see `write_kv`) -> output `[N, H, D]`. Request r's n queries are its last n positions of
    context_lens[r]: query i sees positions 0 .. context_len - n + i, the bottom-right causal mask of
    `attention_kv_caceh.attention.causal_mask`. Scale 1/sqrt(D). Raises ValueError (from the
    attention) for mismatched dtypes or heads not divisible by H_kv.
    """
    _, block_size, h_kv, d = k_cache.shape
    out = np.empty_like(q)  # [N, H, D]
    for r in range(metadata.context_lens.shape[0]):
        start, end = int(metadata.query_start_loc[r]), int(metadata.query_start_loc[r + 1])
        t = int(metadata.context_lens[r])
        blocks = metadata.block_tables[r, : -(-t // block_size)]  # [ceil(T / block_size)]
        keys = k_cache[blocks].reshape(-1, h_kv, d)[:t]  # [T, H_kv, D], a gathered copy
        values = v_cache[blocks].reshape(-1, h_kv, d)[:t]  # [T, H_kv, D]
        q_r = q[start:end].transpose(1, 0, 2)[None]  # [1, H, n, D]
        k_r = keys.transpose(1, 0, 2)[None]  # [1, H_kv, T, D]
        v_r = values.transpose(1, 0, 2)[None]  # [1, H_kv, T, D]
        o_r, _ = scaled_dot_product_attention(q_r, k_r, v_r, is_causal=True)  # [1, H, n, D]
        out[start:end] = o_r[0].transpose(1, 0, 2)  # [n, H, D]
    return out


def paged_decode_attention(
    q: FloatArray,
    k_cache: FloatArray,
    v_cache: FloatArray,
    block_tables: npt.NDArray[np.integer[Any]],
    context_lens: npt.NDArray[np.integer[Any]],
) -> FloatArray:
    """Decode attention: request b's one query attends to its positions 0 .. context_lens[b] - 1.

    q `[B, H, D]` (rotated), caches `[num_blocks, block_size, H_kv, D]` already holding this step's K/V,
    block_tables `[B, max_blocks]` (padded with -1), context_lens `[B]` -> output `[B, H, D]` in q's
    dtype; the same values as `paged_attention` for a step of one token per request (the query is the
    last position, so the causal mask keeps the whole context). Scale 1/sqrt(D). The blocks of all B
    requests are gathered into one `[B, T, H_kv, D]` copy (T = the longest context) and positions
    >= context_lens[b] are masked out; the softmax is written out here (the lab's `scaled_dot_product_attention` validates
    its inputs per call, which cost more than the arithmetic at decode sizes) and the tests hold it to
    that function. Raises ValueError for mismatched shapes or dtypes, H not a multiple of H_kv, a
    context length < 1, or a block table with too few blocks (or a block id outside the pool) for its
    context.
    """
    if q.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(
            f"q must be [B, H, D] and caches [num_blocks, block_size, H_kv, D], got {q.shape}, {k_cache.shape}"
        )
    b, h, d = q.shape
    num_blocks, block_size, h_kv, d_kv = k_cache.shape
    if v_cache.shape != k_cache.shape or d_kv != d or h % h_kv != 0 or q.dtype != k_cache.dtype:
        raise ValueError(f"q {q.shape} and caches {k_cache.shape}/{v_cache.shape} disagree")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(
            f"block_tables {block_tables.shape} and context_lens {context_lens.shape} must be [{b}, *] and [{b}]"
        )
    if b == 0:
        return np.empty_like(q)
    if np.any(context_lens < 1):
        raise ValueError(f"context_lens must be >= 1, got {context_lens}")
    max_blocks = -(-int(context_lens.max()) // block_size)
    if block_tables.shape[1] < max_blocks:
        raise ValueError(f"block_tables {block_tables.shape} has fewer than {max_blocks} columns")
    tables = block_tables[:, :max_blocks]  # [B, max_blocks]
    lens = context_lens.astype(np.int64)  # [B]
    block_starts = np.arange(max_blocks, dtype=np.int64) * block_size  # [max_blocks]
    needed = lens[:, None] > block_starts[None, :]  # [B, max_blocks]
    if np.any(needed & ((tables < 0) | (tables >= num_blocks))):
        raise ValueError(f"block_tables {block_tables} lack valid blocks for context_lens {context_lens}")
    safe = np.where(needed, tables, 0)  # padding reads block 0, never attended below
    t = int(lens.max())
    g = h // h_kv
    keys = k_cache[safe].reshape(b, -1, h_kv, d)[:, :t]  # [B, T, H_kv, D], a gathered copy
    values = v_cache[safe].reshape(b, -1, h_kv, d)[:, :t]  # [B, T, H_kv, D]
    q_g = q.reshape(b, h_kv, g, d) * q.dtype.type(1 / math.sqrt(d))  # [B, H_kv, G, D], scaled
    scores = q_g @ keys.transpose(0, 2, 3, 1)  # [B, H_kv, G, T]
    if int(lens.min()) < t:  # requests of different lengths: hide each one's positions >= its length
        keep = lens[:, None] > np.arange(t, dtype=np.int64)[None, :]  # [B, T]
        scores = np.where(keep[:, None, None, :], scores, -np.inf)  # position 0 is always kept
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)  # [B, H_kv, G, T], unnormalised weights
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ values.transpose(0, 2, 1, 3)  # [B, H_kv, G, D]
    return out.reshape(b, h, d)  # [B, H, D]
