"""One KV cache group's block tables: full attention, or a sliding window that frees the blocks behind it.

Corresponds to vLLM v1's `vllm/v1/core/single_type_kv_cache_manager.py` (SingleTypeKVCacheManager,
FullAttentionManager, SlidingWindowManager: get_num_blocks_to_allocate, allocate_new_blocks,
cache_blocks, free, remove_skipped_blocks, find_longest_cache_hit) and the block counts of
`SlidingWindowSpec.max_memory_usage_bytes` in `vllm/v1/kv_cache_interface.py`. Left out: chunked local
attention, Mamba and cross-attention managers, the EAGLE lookahead block dropped from a hit, and the
block-size alignment of groups with different block sizes (every group here has the engine's block_size).

A group's block table of a request lists one entry per block_size positions: a block id of the shared
BlockPool, or NULL_BLOCK_ID (-1) where the block was freed (sliding window) or never needed (a prefix hit
that starts inside the window). Group 0's table is `request.block_ids` itself, so a model with one group
reads as before; the others live in `req_to_blocks`.

Sliding window (Beltagy et al., 2020; Mistral): a query at position p attends the keys (p - W, p]. Once
a request's num_computed_tokens is c, every later query is at >= c, so a block wholly before position
c - W + 1 is never read again: `remove_skipped_blocks` frees it and its table entry becomes -1 (vLLM's
null block; the pool keeps it hashed, so another request can still hit it until it is reused).
"""

from __future__ import annotations

from collections.abc import Sequence

from .block_pool import BlockHash, BlockPool, KVCacheBlock
from .request import Request

__all__ = [
    "NULL_BLOCK",
    "NULL_BLOCK_ID",
    "FullAttentionManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "group_hash_key",
]

NULL_BLOCK_ID = -1
NULL_BLOCK = KVCacheBlock(NULL_BLOCK_ID)
"""The placeholder of a skipped block in a prefix hit (vLLM's null_block); never in the pool's lists."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_hash_key(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The key a group's block is cached under: the block hash, with the group id appended for groups
    after the first (vLLM's BlockHashWithGroupId), since every group caches the same token blocks."""
    return block_hash if group_id == 0 else block_hash + group_id.to_bytes(4, "little")


class SingleTypeKVCacheManager:
    """Block tables of one group (full attention here; `SlidingWindowManager` overrides four methods).

    Args:
        block_pool: the pool every group allocates from (block ids are unique across groups).
        block_size: tokens per block.
        group_id: index of the group (0: its table is `request.block_ids`).
    """

    sliding_window: int | None = None

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[int]] = {}  # groups > 0
        self.num_cached_block: dict[str, int] = {}  # request_id -> leading blocks already registered

    def table(self, request: Request) -> list[int]:
        """The request's block table in this group (a live list)."""
        if self.group_id == 0:
            return request.block_ids
        return self.req_to_blocks.setdefault(request.request_id, [])

    def get_num_blocks_to_allocate(
        self, request: Request, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Blocks to take from the free queue so that the request holds num_tokens positions: fresh ones,
        plus the hit blocks that are free now (taking them removes them from the queue)."""
        table = self.table(request)
        num_new = _cdiv(num_tokens, self.block_size) - len(table) - len(new_computed_blocks)
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not NULL_BLOCK)
        return max(num_new, 0) + num_evictable

    def save_new_computed_blocks(self, request: Request, blocks: Sequence[KVCacheBlock]) -> None:
        """Take the prefix-hit blocks (a user each; NULL_BLOCK entries stay -1) into the empty table."""
        real = [b for b in blocks if b is not NULL_BLOCK]
        self.block_pool.touch(real)
        self.table(request).extend(b.block_id for b in blocks)
        if blocks:
            self.num_cached_block[request.request_id] = len(blocks)

    def allocate_new_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Append fresh blocks until the table covers num_tokens positions; their ids."""
        table = self.table(request)
        num_new = _cdiv(num_tokens, self.block_size) - len(table)
        if num_new <= 0:
            return []
        ids = [b.block_id for b in self.block_pool.get_new_blocks(num_new)]
        table.extend(ids)
        return ids

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the full, computed blocks not registered yet under their hash keys (-1 entries skipped)."""
        table = self.table(request)
        start = self.num_cached_block.get(request.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(table))
        for i in range(start, end):
            if table[i] != NULL_BLOCK_ID:
                key = group_hash_key(request.block_hashes[i], self.group_id)
                self.block_pool.cache_block(self.block_pool.blocks[table[i]], key)
        if end > start:
            self.num_cached_block[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release every block the request holds in this group, tail first, and empty its table."""
        table = self.table(request)
        self.block_pool.free_blocks(
            [self.block_pool.blocks[i] for i in reversed(table) if i != NULL_BLOCK_ID]
        )
        if self.group_id == 0:
            request.block_ids = []
        else:
            self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free the blocks no later query reads (full attention: none)."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest hit of at most max_length tokens: here the leading run of
        block hashes found in the pool (a prefix of the request)."""
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(group_hash_key(block_hash, self.group_id))
            if block is None:
                break
            hits.append(block)
        return hits


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block stays until the request ends (vLLM's FullAttentionManager)."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention of `sliding_window` keys (vLLM's SlidingWindowManager).

    Raises:
        ValueError: sliding_window < 1.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int, sliding_window: int) -> None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        super().__init__(block_pool, block_size, group_id)
        self.sliding_window = sliding_window
        self._window = sliding_window

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free the blocks wholly before position num_computed_tokens - W + 1 (the first key the next
        query reads), from the nearest backwards until an entry already freed; entries become -1."""
        table = self.table(request)
        first_useful_block = max(num_computed_tokens - self._window + 1, 0) // self.block_size
        removed: list[KVCacheBlock] = []
        for i in range(min(first_useful_block, len(table)) - 1, -1, -1):
            if table[i] == NULL_BLOCK_ID:
                break
            removed.append(self.block_pool.blocks[table[i]])
            table[i] = NULL_BLOCK_ID
        self.block_pool.free_blocks(removed)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The longest hit of at most max_length tokens whose window is cached: searching from the right,
        the first run of cdiv(W - 1, block_size) cached blocks ends the hit (the blocks before the run are
        NULL_BLOCK: no query after the hit reads them); a shorter run starting at block 0 is a hit too."""
        max_blocks = min(max_length // self.block_size, len(block_hashes))
        needed = _cdiv(self._window - 1, self.block_size)
        if needed == 0:  # a window of one key: the query reads only its own position
            return [NULL_BLOCK] * max_blocks
        hits = [NULL_BLOCK] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(group_hash_key(block_hashes[i], self.group_id))
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run == needed:
                return hits[: i + needed]
        return hits[:run]
