"""Paged attention over a flattened batch: write new K/V through the slot mapping, read through block tables.

What vLLM v1 does in `v1/attention/backends/` (the FlashAttention backend's metadata and its
`reshape_and_cache_flash` + `flash_attn_varlen_func` pair) in NumPy: the KV cache of one layer is a
pool of fixed-size blocks `[num_blocks, block_size, H_kv, D]`; a request's positions live in the blocks
its block table lists, position p at row p % block_size of block block_table[p // block_size]. Each
request's attention gathers its blocks into a contiguous `[H_kv, T, D]` copy and calls the lab's
`scaled_dot_product_attention` (GQA without repeating K/V, bottom-right causal mask), so the paged
layout changes only where K/V are stored, never the arithmetic. A step whose requests are all decoding
(one query each) takes the compiled `kernels.paged_decode_attention_into` instead (vLLM's
`paged_attention_v1`), which reads the blocks in place. Nothing here checks its arguments: the model
runner builds and validates a step's metadata once (`ModelRunner.prepare_inputs`).

Shape legend: N scheduled tokens (all requests, flattened), R scheduled requests, H query heads, H_kv
KV heads, D head dim, T a request's context length, max_blocks the longest block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.attention import scaled_dot_product_attention

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]

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


def write_kv(
    k_cache: FloatArray, v_cache: FloatArray, k: FloatArray, v: FloatArray, slot_mapping: IntArray
) -> None:
    """Store the new keys and values `[N, H_kv, D]` at their slots of `[num_blocks, block_size, H_kv, D]`.

    In place (vLLM's `reshape_and_cache`): the caches are viewed as `[num_blocks * block_size, H_kv, D]`
    and row slot_mapping[i] receives token i. Unchecked: slots come from `ModelRunner.prepare_inputs`
    (a slot outside the pool raises NumPy's IndexError).
    """
    num_blocks, block_size, h_kv, d = k_cache.shape
    k_cache.reshape(num_blocks * block_size, h_kv, d)[slot_mapping] = k  # a view: writes the pool
    v_cache.reshape(num_blocks * block_size, h_kv, d)[slot_mapping] = v


def paged_attention(
    q: FloatArray, k_cache: FloatArray, v_cache: FloatArray, metadata: AttentionMetadata
) -> FloatArray:
    """Causal attention of each request's queries over its context, read through its block table.

    q `[N, H, D]` (already rotated), caches `[num_blocks, block_size, H_kv, D]` already holding this
    step's K/V (see `write_kv`) -> output `[N, H, D]`. Request r's n queries are its last n positions of
    context_lens[r]: query i sees positions 0 .. context_len - n + i, the bottom-right causal mask of
    `attention_kv_caceh.attention.causal_mask`. Scale 1/sqrt(D).
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
