"""KV cache groups of a model and the coordinator that drives one manager per group over one BlockPool.

Corresponds to vLLM v1's `vllm/v1/core/kv_cache_coordinator.py` (UnitaryKVCacheCoordinator,
HybridKVCacheCoordinator: the prefix hit all groups agree on), the grouping of
`_get_kv_cache_groups_uniform_page_size` in `vllm/v1/core/kv_cache_utils.py` and `KVCacheGroupSpec` /
`SlidingWindowSpec` of `vllm/v1/kv_cache_interface.py`. Left out: specs other than full and sliding-window
attention (chunked local, Mamba, cross-attention, encoder-only), groups of different page sizes or
dtypes, and KV connectors.

Grouping. Layers of one type (full, or sliding with the model's window) are cut into groups of
`group_size` layers, group_size the layer count of the rarest type (vLLM's rule, including its choice
of the largest count when that is under 1.25 times the smallest, to avoid a short group). Every group
has its own block table per request, and all groups allocate from one BlockPool, so a block id is used
by one group at a time. The model runner then needs only group_size K/V buffers of num_blocks blocks:
the j-th layer of every group writes buffer j (`layer_buffer_index`), and one block costs group_size
layers of memory whatever group holds it. With a 5:1 local:global model the sliding groups hold about
W / block_size blocks per request each, the full group the whole context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .block_pool import BlockHash, BlockPool, KVCacheBlock
from .request import Request
from .single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager, SlidingWindowManager

__all__ = [
    "KVCacheCoordinator",
    "KVCacheGroupSpec",
    "KVCacheGroups",
    "kv_cache_groups_for",
    "layer_buffer_index",
    "max_blocks_needed",
    "model_kv_cache_groups",
    "num_kv_buffers",
]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group (vLLM's KVCacheGroupSpec with its FullAttentionSpec / SlidingWindowSpec).

    Attributes:
        layer_indices: the model's layers in the group, in order.
        sliding_window: W of a sliding-window group (keys (p - W, p]), None for full attention.
    """

    layer_indices: tuple[int, ...]
    sliding_window: int | None = None


KVCacheGroups = tuple[KVCacheGroupSpec, ...]
"""A model's KV cache groups, in order (group 0's block table is request.block_ids)."""


def kv_cache_groups_for(
    num_layers: int, layer_types: Sequence[str] = (), sliding_window: int | None = None
) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of a model (ModelConfig's num_hidden_layers, layer_types, sliding_window): full-attention
    groups first, then sliding ones, each of group_size layers (the module docstring); one group of every
    layer when all layers have one type.

    Raises:
        ValueError: layer_types is neither empty nor one entry per layer, an entry is unknown, or a
            sliding layer has no sliding_window.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    types = tuple(layer_types) or ("full_attention",) * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    by_type: dict[str, list[int]] = {"full_attention": [], "sliding_attention": []}
    for i, t in enumerate(types):
        if t not in by_type:
            raise ValueError(f"layer_types[{i}] is {t!r}, not 'full_attention' or 'sliding_attention'")
        by_type[t].append(i)
    if by_type["sliding_attention"] and sliding_window is None:
        raise ValueError("sliding_attention layers need a sliding_window")
    counts = [len(v) for v in by_type.values() if v]
    group_size = min(counts)
    if max(counts) < 1.25 * min(counts):
        group_size = max(counts)
    groups: list[KVCacheGroupSpec] = []
    for t, layers in by_type.items():
        window = sliding_window if t == "sliding_attention" else None
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(tuple(layers[start : start + group_size]), window))
    return tuple(groups)


def model_kv_cache_groups(
    num_layers: int, layer_types: Sequence[str] = (), sliding_window: int | None = None
) -> KVCacheGroups:
    """The groups the engine runs a model with: () (one full-attention group of every layer, the
    engine's layout before groups) when no layer is a sliding one, else `kv_cache_groups_for`.

    Raises:
        ValueError: as `kv_cache_groups_for`.
    """
    if "sliding_attention" not in layer_types:
        kv_cache_groups_for(num_layers, layer_types, sliding_window)  # checks the types
        return ()
    return kv_cache_groups_for(num_layers, layer_types, sliding_window)


def num_kv_buffers(groups: Sequence[KVCacheGroupSpec], num_layers: int) -> int:
    """K/V buffers the model runner allocates: the largest group's layer count (group_size), or
    num_layers for no groups. One pool block costs that many layers of K and V."""
    return max((len(g.layer_indices) for g in groups), default=num_layers)


def layer_buffer_index(groups: Sequence[KVCacheGroupSpec], num_layers: int) -> tuple[tuple[int, int], ...]:
    """(group, K/V buffer) of each layer: layer groups[g].layer_indices[j] is (g, j); no groups: every
    layer is in group 0 with a buffer of its own.

    Raises:
        ValueError: a layer is in no group.
    """
    out: list[tuple[int, int] | None] = [None] * num_layers
    for g, group in enumerate(groups or (KVCacheGroupSpec(tuple(range(num_layers))),)):
        for j, layer in enumerate(group.layer_indices):
            out[layer] = (g, j)
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise ValueError(f"layers {missing} are in no KV cache group")
    return tuple(v for v in out if v is not None)


def max_blocks_needed(
    groups: Sequence[KVCacheGroupSpec],
    num_positions: int,
    block_size: int,
    max_num_batched_tokens: int | None,
) -> int:
    """The most blocks of all groups one request of num_positions KV positions holds at once.

    A full group holds cdiv(P, block_size); a sliding group min(that, cdiv(W - 1 + chunk, block_size) + 1),
    since one step's chunk of at most max_num_batched_tokens queries reads the W - 1 positions before it
    and older blocks are freed (vLLM's SlidingWindowSpec.max_memory_usage_bytes); chunk None: unbounded.
    Empty groups: one full group. A sum of per-group peaks, so never below the true peak.
    """
    total = 0
    for group in groups or (KVCacheGroupSpec((0,)),):
        full = -(-num_positions // block_size)
        w = group.sliding_window
        if w is None or max_num_batched_tokens is None:
            total += full
        else:
            span = min(w - 1 + max_num_batched_tokens, num_positions)
            total += min(full, -(-span // block_size) + 1)
    return total


class KVCacheCoordinator:
    """One SingleTypeKVCacheManager per group over one BlockPool; allocation is all groups or none.

    Args:
        groups: the groups (`kv_cache_groups_for`); empty means one full-attention group.
        block_pool: the shared pool.
        block_size: tokens per block.
    """

    def __init__(self, groups: Sequence[KVCacheGroupSpec], block_pool: BlockPool, block_size: int) -> None:
        specs = tuple(groups) or (KVCacheGroupSpec((0,)),)
        self.groups = specs
        self.block_pool = block_pool
        self.block_size = block_size
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            FullAttentionManager(block_pool, block_size, g)
            if s.sliding_window is None
            else SlidingWindowManager(block_pool, block_size, g, s.sliding_window)
            for g, s in enumerate(specs)
        )

    def get_block_ids(self, request: Request) -> tuple[list[int], ...]:
        """The request's block table in each group (live lists; -1 marks a freed or skipped block)."""
        return tuple(m.table(request) for m in self.managers)

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free, in every sliding group, the blocks no query after num_computed_tokens reads."""
        for m in self.managers:
            m.remove_skipped_blocks(request, num_computed_tokens)

    def get_num_blocks_to_allocate(
        self, request: Request, num_tokens: int, new_computed_blocks: Sequence[Sequence[KVCacheBlock]]
    ) -> int:
        """Free-queue blocks all groups need together for num_tokens positions (with the hit's blocks)."""
        return sum(
            m.get_num_blocks_to_allocate(request, num_tokens, hit)
            for m, hit in zip(self.managers, self._per_group(new_computed_blocks), strict=True)
        )

    def save_new_computed_blocks(
        self, request: Request, new_computed_blocks: Sequence[Sequence[KVCacheBlock]]
    ) -> None:
        """Take each group's prefix-hit blocks into its (empty) table."""
        for m, hit in zip(self.managers, self._per_group(new_computed_blocks), strict=True):
            m.save_new_computed_blocks(request, hit)

    def allocate_new_blocks(self, request: Request, num_tokens: int) -> list[list[int]]:
        """Fresh blocks in every group up to num_tokens positions; the new ids per group."""
        return [m.allocate_new_blocks(request, num_tokens) for m in self.managers]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register every group's newly full, computed blocks."""
        for m in self.managers:
            m.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group."""
        for m in self.managers:
            m.free(request)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix of at most max_length tokens that every group has cached, with each group's
        blocks for it, and its length in tokens.

        vLLM's HybridKVCacheCoordinator: each group's hit is searched below the length the others
        allow, until no group shortens it (a full group's hit shrinks with the bound; a sliding group's
        must be searched again, since a shorter prefix needs a different window of blocks)."""
        length = max_length - max_length % self.block_size
        while True:
            hits = tuple(m.find_longest_cache_hit(block_hashes, length) for m in self.managers)
            shortest = min(len(h) for h in hits) * self.block_size
            if shortest == length:
                return hits, length
            length = shortest

    def _per_group(self, blocks: Sequence[Sequence[KVCacheBlock]]) -> Sequence[Sequence[KVCacheBlock]]:
        if not blocks:
            return [()] * len(self.managers)
        if len(blocks) != len(self.managers):
            raise ValueError(
                f"{len(blocks)} groups of computed blocks for {len(self.managers)} KV cache groups"
            )
        return blocks
