"""KVCacheManager: block tables of requests, prefix-cache lookups and slot allocation.

Corresponds to vLLM v1's `vllm/v1/core/kv_cache_manager.py` (get_computed_blocks, allocate_slots, free,
usage, prefix-cache stats) over the KV cache groups of `kv_cache_coordinator.py` (full attention and
sliding window), and the pool's size as `KVCacheConfig` (`vllm/v1/kv_cache_interface.py`). Left out:
lookahead (speculative) slots, encoder caches, KV connectors, and vLLM's startup refusal of a pool
that cannot hold one max_model_len request (`check_enough_kv_cache_memory`): here a smaller pool serves,
and each request is checked against it instead.

One admission rule. `KVCacheConfig.check_request_fits` alone decides whether a request's prompt plus
max_tokens can ever fit the pool, with one message (`RequestTooLargeError`): the scheduler refuses a
request with it, the server answers a 400 with it, `generate` exits 2 with it before loading any weight.
The pool is sized once; the engine core reports its KVCacheConfig in its ready message
(`EngineCoreOutputs.kv_cache_config`), and the server checks against that.

A request's block table is `request.block_ids`: block_ids[i] holds positions [i*block_size, (i+1)*block_size)
(the slot of position p is block_ids[p // block_size] * block_size + p % block_size). Block ids only; the
model runner owns the K/V buffers. A model with several KV cache groups (sliding-window layers beside full
ones, `kv_cache_coordinator.kv_cache_groups_for`) has one table per group (`get_block_ids`), group 0's
being request.block_ids; a sliding group's entries before the window are -1 once freed.

Prefix caching. A full block is registered under its chained hash (see block_pool) once its K/V have been
computed (`cache_full_blocks`, called after each step). At admission, `get_computed_blocks` walks the
request's full-block hashes and returns the longest run found in the pool. The hashes are the request's
own (`request.block_hashes`, computed when the core built it, see block_pool.get_request_block_hasher);
this module hashes only requests built without a block hasher. The hit never covers the last
token of the request: that token must still be computed to produce the logits of the next one, so at most
(num_tokens - 1) // block_size blocks can hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .block_pool import BlockPool, KVCacheBlock, get_request_block_hasher
from .kv_cache_coordinator import KVCacheCoordinator, KVCacheGroups, KVCacheGroupSpec, max_blocks_needed
from .request import Request, max_final_num_tokens

__all__ = [
    "KVCacheConfig",
    "KVCacheGroups",
    "KVCacheManager",
    "RequestTooLargeError",
    "cdiv",
    "full_batch_blocks",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV pool as it was sized, once (vLLM's KVCacheConfig.num_blocks with CacheConfig.block_size, and
    the ModelConfig.max_model_len requests are capped by); the engine core reports it when ready.

    Attributes:
        num_kv_blocks: blocks in the pool.
        block_size: tokens per block.
        max_model_len: most tokens (prompt + output) of one request.
        kv_cache_groups: the model's KV cache groups; empty: one full-attention group.
        max_num_batched_tokens: the scheduler's token budget, which bounds what a sliding group holds
            at once (`kv_cache_coordinator.max_blocks_needed`); None: no bound assumed.
    """

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()
    max_num_batched_tokens: int | None = None

    @classmethod
    def for_engine(
        cls,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        max_num_batched_tokens: int,
    ) -> KVCacheConfig:
        """The pool of an engine with these groups (`kv_cache_coordinator.model_kv_cache_groups`); the token
        budget is kept only with groups, since it bounds only a sliding group's blocks. The scheduler
        and the CLI's check before loading build it the same way."""
        groups = tuple(kv_cache_groups)
        chunk = max_num_batched_tokens if groups else None
        return cls(num_kv_blocks, block_size, max_model_len, groups, chunk)

    @property
    def kv_capacity_tokens(self) -> int:
        """KV positions of the whole pool, num_kv_blocks * block_size: the most one request can hold."""
        return self.num_kv_blocks * self.block_size

    def num_positions_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The most KV positions a request can fill: its largest length (`max_final_num_tokens`) less one,
        since the last sampled token is never computed."""
        return max_final_num_tokens(num_prompt_tokens, max_tokens, self.max_model_len) - 1

    def num_blocks_needed(self, num_positions: int) -> int:
        """The most blocks of all groups a request of num_positions KV positions holds at once: with one
        full-attention group cdiv(num_positions, block_size); a sliding group counts only its window and
        one step's chunk (`kv_cache_coordinator.max_blocks_needed`)."""
        return max_blocks_needed(
            self.kv_cache_groups, num_positions, self.block_size, self.max_num_batched_tokens
        )

    def check_request_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request that could never run: the blocks its largest context needs, in every group,
        must fit the whole pool. The prompt's length against max_model_len is the caller's check (it names
        its own field or flag).

        Raises:
            RequestTooLargeError: `num_blocks_needed(num_positions_needed)` is more than num_kv_blocks.
        """
        positions = self.num_positions_needed(num_prompt_tokens, max_tokens)
        if self.num_blocks_needed(positions) > self.num_kv_blocks:
            raise RequestTooLargeError(num_prompt_tokens, max_tokens, positions, self)


def full_batch_blocks(
    max_num_seqs: int,
    block_size: int,
    max_model_len: int,
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    max_num_batched_tokens: int,
) -> int:
    """The blocks max_num_seqs requests of max_model_len tokens hold at once, in all KV cache groups:
    max_num_seqs * the blocks one such request needs in the pool `KVCacheConfig.for_engine` builds
    (cdiv(max_model_len, block_size) per full-attention group; a sliding group its window and one
    step's chunk, `kv_cache_coordinator.max_blocks_needed`). What the default KV pool is capped at
    (`EngineConfig.num_blocks_for`). ValueError for a count below 1."""
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("block_size", block_size),
        ("max_model_len", max_model_len),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    pool = KVCacheConfig.for_engine(1, block_size, max_model_len, kv_cache_groups, max_num_batched_tokens)
    return max_num_seqs * pool.num_blocks_needed(max_model_len)


class RequestTooLargeError(ValueError):
    """A request whose prompt plus max_tokens can never fit the whole KV pool (`check_request_fits`).

    Attributes:
        num_prompt_tokens, max_tokens: the request's.
        num_positions: KV positions it could fill.
        num_blocks_needed: those positions in blocks.
        kv_cache_config: the pool it was checked against.
    """

    def __init__(
        self, num_prompt_tokens: int, max_tokens: int, num_positions: int, kv_cache_config: KVCacheConfig
    ) -> None:
        c = kv_cache_config
        need = c.num_blocks_needed(num_positions)
        groups = len(c.kv_cache_groups)
        where = (
            f" in its {groups} KV cache groups (each group's layers hold blocks of their own)"
            if groups > 1
            else ""
        )
        super().__init__(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks of "
            f"{c.block_size} tokens ({num_positions} positions){where}, the pool has {c.num_kv_blocks} "
            f"({c.kv_capacity_tokens} positions)"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.num_positions = num_positions
        self.num_blocks_needed = need
        self.kv_cache_config = kv_cache_config

    @property
    def param(self) -> str:
        """The request field to blame: "prompt" when the prompt alone overfills the pool, else "max_tokens"."""
        c = self.kv_cache_config
        return "prompt" if c.num_blocks_needed(self.num_prompt_tokens) > c.num_kv_blocks else "max_tokens"


class KVCacheManager:
    """Allocates and frees the blocks of requests in every KV cache group; keeps the prefix-cache counters.

    Attributes:
        block_size: tokens per block.
        block_pool: the BlockPool all groups share.
        coordinator: the KVCacheCoordinator (one manager per group).
        prefix_cache_queries: prompt tokens looked up at admissions (vLLM's prefix_cache_queries).
        prefix_cache_hits: of those, tokens found in the cache.

    Args:
        kv_cache_groups: the model's groups (`kv_cache_coordinator.kv_cache_groups_for`); empty: one
            full-attention group.

    Raises:
        ValueError: num_blocks or block_size < 1.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_cache_groups: Sequence[KVCacheGroupSpec] = (),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.coordinator = KVCacheCoordinator(kv_cache_groups, self.block_pool, block_size)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._block_hasher = get_request_block_hasher(block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Used blocks / total blocks, in [0, 1]."""
        return self.block_pool.usage

    @property
    def num_groups(self) -> int:
        """KV cache groups (1 for a model of one layer type)."""
        return len(self.coordinator.managers)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens positions in one group."""
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request: Request) -> tuple[list[int], ...]:
        """The request's block table per group (live lists; group 0's is request.block_ids)."""
        return self.coordinator.get_block_ids(request)

    def _update_block_hashes(self, request: Request) -> None:
        """Make request.block_hashes cover every full block of its tokens.

        A request built with a block hasher (as EngineCore builds them) is already covered: this is a
        length check. One built without (a Request made directly) is hashed here, once per block.
        """
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            request.block_hashes.extend(self._block_hasher(request))

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether the request looks its prompt up in the prefix cache: not with prefix caching off, nor
        when it asks for prompt logprobs (they need every prompt position computed; vLLM skips the cache
        for them too)."""
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest cached prefix of the request that every group holds, per group its blocks (a
        sliding group's start with NULL_BLOCK where its window does not reach), and its length in tokens.

        Returns (([], ...), 0) when the request skips the lookup (`prefix_cache_lookup_enabled`). Never
        covers the request's last token. Does not take the blocks (allocate_slots does) and does not count
        queries (record_prefix_cache_lookup does, at admission, so a request that waits several steps is
        counted once).
        """
        if not self.prefix_cache_lookup_enabled(request):
            return tuple([] for _ in range(self.num_groups)), 0
        self._update_block_hashes(request)
        max_length = (request.num_tokens - 1) // self.block_size * self.block_size
        return self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)

    def record_prefix_cache_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup: the request's tokens queried, `num_hit_tokens` hit. A request that
        skipped the lookup (prefix caching off, prompt logprobs) is not counted, as vLLM v1's
        `record_prefix_cache_stats` leaves it out, so with caching off the counters stay at 0."""
        if not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]] = (),
    ) -> list[int] | None:
        """Give the request the blocks for its next num_new_tokens positions; return the new block ids.

        First each sliding group frees the request's blocks no query from num_computed_tokens on reads
        (vLLM's remove_skipped_blocks; this happens even when the allocation then fails, since those
        blocks are useless either way). The request will then hold positions up to num_computed_tokens +
        hit tokens + num_new_tokens - 1 in every group. `new_computed_blocks` (a prefix hit from
        get_computed_blocks, per group, only when the request has no blocks yet) are taken first, then
        fresh blocks.

        Returns:
            ids of the freshly allocated blocks of all groups (possibly []), or None when the free blocks
            do not suffice; no block is taken then.

        Raises:
            ValueError: num_new_tokens < 0, computed blocks given to a request that has blocks, or
                computed blocks for another number of groups.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        if num_hit and any(self.get_block_ids(request)):
            raise ValueError(f"request {request.request_id!r} already has blocks; no prefix hit can be added")
        coordinator = self.coordinator
        coordinator.remove_skipped_blocks(request, request.num_computed_tokens)
        num_tokens = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        need = coordinator.get_num_blocks_to_allocate(request, num_tokens, new_computed_blocks)
        if need > self.block_pool.num_free_blocks:
            return None
        if num_hit:
            coordinator.save_new_computed_blocks(request, new_computed_blocks)
        return [b for ids in coordinator.allocate_new_blocks(request, num_tokens) for b in ids]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full and computed (call after num_computed_tokens advanced)."""
        if not self.enable_prefix_caching:
            return
        self._update_block_hashes(request)
        self.coordinator.cache_blocks(request, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, tail first, and empty its block tables."""
        self.coordinator.free(request)
