"""BlockPool: KV block ids, their reference counts, the free queue and the prefix-cache hash map.

Corresponds to vLLM v1's `vllm/v1/core/block_pool.py` (BlockPool, FreeKVCacheBlockQueue, KVCacheBlock) and
`hash_block_tokens` and `get_request_block_hasher` in `vllm/v1/core/kv_cache_utils.py`. Only ids live here: the K/V buffers themselves,
one per layer with `num_blocks` blocks (`paged_attention.allocate_kv_cache`), are allocated by the model runner, as vLLM's worker does;
block i of this pool is block i of those buffers.

Free queue. Blocks with ref_cnt 0 wait in a queue ordered by when they were freed; allocation takes from the
front (least recently freed first). A freed block keeps its hash and stays findable by a prefix-cache lookup
until it is taken for new tokens; only then is its hash evicted. vLLM keeps a doubly linked list for O(1)
removal from the middle (a prefix hit on a free block); an insertion-ordered dict does the same here.

Block hash. hash(block) = sha256(hash(previous block) || token ids of the block as int64), over FULL blocks
only. The chain makes a block's hash depend on the whole prefix, so equal token blocks after different
prefixes do not match; sha256 makes it deterministic across processes (Python's `hash` is salted).
Left out: vLLM's choice of hash function and the extra keys (LoRA, multimodal, cache salt) mixed into it.

Who hashes. A request's hashes are computed when the request is built, by the block hasher it is given
(`get_request_block_hasher`), and extended as its output tokens fill blocks, as vLLM's Request does.
The multiprocess core builds requests in its input thread, so a long prompt is hashed off the busy loop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .request import BlockHasher, Request

__all__ = [
    "BlockHash",
    "BlockPool",
    "KVCacheBlock",
    "get_request_block_hasher",
    "hash_block_bytes",
    "hash_block_tokens",
]

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """sha256 digest (32 bytes) of the parent block's hash (empty for the first block) and the token ids."""
    return hash_block_bytes(parent_hash, np.asarray(token_ids, dtype=np.int64).tobytes())


def hash_block_bytes(parent_hash: BlockHash | None, token_bytes: bytes | memoryview) -> BlockHash:
    """hash_block_tokens over the block's token ids already laid out as int64 bytes (native order)."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(token_bytes)
    return h.digest()


def get_request_block_hasher(block_size: int) -> BlockHasher:
    """A BlockHasher for blocks of `block_size` tokens (vLLM's get_request_block_hasher).

    The returned function takes a Request and returns the hashes of the full blocks of its
    all_token_ids after the request.block_hashes it already has (chained to the last of them), so
    calling it after every appended token hashes each block once, when it fills; [] when no new block
    is full.

    Raises:
        ValueError: block_size < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes)
        num_full = request.num_tokens // block_size
        if num_full <= start:
            return []
        prompt, output = request.prompt_token_ids, request.output_token_ids
        # Only the tokens of the new blocks, without copying the whole sequence each time a block fills.
        lo, hi = start * block_size, num_full * block_size
        n = len(prompt)
        tokens = prompt[lo:hi] if hi <= n else prompt[lo:] + output[max(lo - n, 0) : hi - n]
        # One int64 conversion for all new blocks, then one sha256 per block over its slice of the bytes
        # (a conversion per block costs more than its hash, and a long prompt has tens of thousands).
        data = memoryview(np.asarray(tokens, dtype=np.int64).tobytes())
        stride = block_size * 8
        parent = request.block_hashes[-1] if start > 0 else None
        hashes: list[BlockHash] = []
        for offset in range(0, len(data), stride):
            parent = hash_block_bytes(parent, data[offset : offset + stride])
            hashes.append(parent)
        return hashes

    return request_block_hasher


@dataclass(eq=False)
class KVCacheBlock:
    """One block's bookkeeping: its id (row of the model runner's K/V buffers), users and prefix hash."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """`num_blocks` blocks, a free queue and a hash -> block map for prefix caching.

    Raises:
        ValueError: num_blocks < 1.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: dict[int, KVCacheBlock] = {b.block_id: b for b in self.blocks}  # insertion order = queue
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (some may still hold a cached hash)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), vLLM's kv_cache_usage."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Ids of the free queue, front (next to be allocated) first."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding this hash's tokens, or None (also when caching is off)."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the front of the free queue, evicting their hashes; ref_cnt becomes 1.

        Raises:
            ValueError: fewer than n free blocks (callers check first; nothing is taken then).
        """
        if n > len(self._free):
            raise ValueError(f"cannot get {n} blocks: only {len(self._free)} are free")
        out: list[KVCacheBlock] = []
        for _ in range(n):
            block_id = next(iter(self._free))
            block = self._free.pop(block_id)
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add a user to each block (a prefix-cache hit); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop a user from each block, in the order given; blocks reaching 0 join the back of the queue.

        Callers pass a request's blocks tail first, so that the tail (least likely to be shared) is
        evicted before the head, as vLLM does.

        Raises:
            ValueError: a block is already free (a double free; checked before changing anything).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more times than it was taken")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its hash.

        If another block already holds the same hash (two requests computed the same prefix at the same
        time) the first one stays registered and this one remains unhashed; it is freed like any block.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents and ref counts)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
