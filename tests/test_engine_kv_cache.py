"""Block pool and KV cache manager: chained hashes, LRU free queue, eviction, prefix hits, all-or-nothing allocation.

Oracles are hand-counted block ids and ref counts on pools of a few blocks.
"""

from __future__ import annotations

import unittest

from attention_kv_caceh.engine.block_pool import BlockPool, hash_block_tokens
from attention_kv_caceh.engine.kv_cache_manager import KVCacheManager
from attention_kv_caceh.engine.request import Request, SamplingParams


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4))


def _run_prefill(kv: KVCacheManager, req: Request) -> None:
    """Admit and compute a request's whole prompt, as the scheduler + update_from_output would."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


class BlockHashTest(unittest.TestCase):
    def test_hash_is_deterministic_and_depends_on_parent_and_tokens(self) -> None:
        h0 = hash_block_tokens(None, [1, 2, 3, 4])
        self.assertEqual(h0, hash_block_tokens(None, [1, 2, 3, 4]))
        self.assertEqual(len(h0), 32)
        self.assertNotEqual(hash_block_tokens(h0, [5, 6]), hash_block_tokens(None, [5, 6]))
        self.assertNotEqual(hash_block_tokens(h0, [5, 6]), hash_block_tokens(h0, [6, 5]))
        self.assertEqual(
            hash_block_tokens(None, [1]).hex()[:16], "7c9fa136d4413fa6"
        )  # sha256 of int64 little-endian 1: stable across processes and runs


class BlockPoolTest(unittest.TestCase):
    def test_freed_blocks_join_the_back_and_are_reused_last(self) -> None:
        pool = BlockPool(4)
        a = pool.get_new_blocks(2)  # takes 0, 1
        self.assertEqual(pool.free_block_ids(), [2, 3])
        pool.free_blocks(list(reversed(a)))
        self.assertEqual(pool.free_block_ids(), [2, 3, 1, 0])
        self.assertEqual([b.block_id for b in pool.get_new_blocks(1)], [2])

    def test_free_cached_block_stays_findable_until_reused_then_is_evicted(self) -> None:
        pool = BlockPool(2)
        (b,) = pool.get_new_blocks(1)
        h = hash_block_tokens(None, [1, 2])
        pool.cache_block(b, h)
        pool.free_blocks([b])
        self.assertIs(pool.get_cached_block(h), b)
        pool.get_new_blocks(1)  # block 1, never used
        self.assertIs(pool.get_cached_block(h), b)
        pool.get_new_blocks(1)  # block 0 is reused: its hash goes
        self.assertIsNone(pool.get_cached_block(h))
        self.assertIsNone(b.block_hash)

    def test_touching_a_free_cached_block_takes_it_out_of_the_queue(self) -> None:
        pool = BlockPool(3)
        (b,) = pool.get_new_blocks(1)
        pool.free_blocks([b])
        pool.touch([b])
        self.assertEqual((b.ref_cnt, pool.free_block_ids()), (1, [1, 2]))
        pool.touch([b])
        self.assertEqual(b.ref_cnt, 2)

    def test_double_free_is_refused_without_change(self) -> None:
        pool = BlockPool(2)
        blocks = pool.get_new_blocks(2)
        pool.free_blocks(blocks[:1])
        with self.assertRaisesRegex(ValueError, "block 0 freed more times"):
            pool.free_blocks(blocks)
        self.assertEqual(blocks[1].ref_cnt, 1)

    def test_second_block_with_a_known_hash_is_not_registered(self) -> None:
        pool = BlockPool(2)
        b0, b1 = pool.get_new_blocks(2)
        h = hash_block_tokens(None, [1])
        pool.cache_block(b0, h)
        pool.cache_block(b1, h)
        self.assertIs(pool.get_cached_block(h), b0)
        self.assertIsNone(b1.block_hash)

    def test_usage_is_used_over_total(self) -> None:
        pool = BlockPool(4)
        pool.get_new_blocks(3)
        self.assertAlmostEqual(pool.usage, 0.75)


class KVCacheManagerTest(unittest.TestCase):
    def test_prefix_hit_never_covers_the_last_token(self) -> None:
        kv = KVCacheManager(10, 4)
        prompt = list(range(1, 9))  # 2 full blocks
        _run_prefill(kv, _req("a", prompt))
        hits, n = kv.get_computed_blocks(_req("b", prompt))
        self.assertEqual((len(hits[0]), n), (1, 4))
        hits, n = kv.get_computed_blocks(_req("c", [*prompt, 9]))
        self.assertEqual((len(hits[0]), n), (2, 8))

    def test_equal_blocks_after_different_prefixes_do_not_hit(self) -> None:
        kv = KVCacheManager(10, 2)
        _run_prefill(kv, _req("a", [1, 2, 3, 4, 0]))
        self.assertEqual(kv.get_computed_blocks(_req("b", [9, 9, 3, 4, 0]))[1], 0)
        self.assertEqual(kv.get_computed_blocks(_req("c", [1, 2, 9, 9, 0]))[1], 2)

    def test_shared_prefix_blocks_are_reference_counted(self) -> None:
        kv = KVCacheManager(10, 2)
        a, b = _req("a", [1, 2, 3, 4, 5]), _req("b", [1, 2, 3, 4, 6])
        _run_prefill(kv, a)
        _run_prefill(kv, b)
        self.assertEqual(a.block_ids[:2], b.block_ids[:2])
        self.assertNotEqual(a.block_ids[2], b.block_ids[2])
        pool = kv.block_pool
        self.assertEqual([pool.blocks[i].ref_cnt for i in a.block_ids], [2, 2, 1])
        kv.free(a)
        kv.free(b)
        self.assertEqual((kv.num_free_blocks, b.block_ids), (10, []))

    def test_allocation_is_all_or_nothing_counting_free_hit_blocks(self) -> None:
        kv = KVCacheManager(4, 2)
        a = _req("a", [1, 2, 3, 4, 5])  # 3 blocks, 2 of them full and cached
        _run_prefill(kv, a)
        kv.free(a)
        other = _req("o", [7, 7])
        assert kv.allocate_slots(other, 2) is not None  # 3 free left, a's two full blocks among them
        b = _req("b", [1, 2, 3, 4, 9, 9, 9])  # hits 2 free blocks, needs 2 more: 2 + 2 > 3 free
        hits, n = kv.get_computed_blocks(b)
        self.assertEqual(n, 4)
        before = (kv.block_pool.free_block_ids(), [blk.ref_cnt for blk in kv.block_pool.blocks])
        self.assertIsNone(kv.allocate_slots(b, b.num_tokens - n, hits))
        self.assertEqual(
            before, (kv.block_pool.free_block_ids(), [blk.ref_cnt for blk in kv.block_pool.blocks])
        )
        self.assertEqual(b.block_ids, [])
        c = _req("c", [1, 2, 3, 4, 9])  # hits 2, needs 1 more: fits exactly
        hits, n = kv.get_computed_blocks(c)
        self.assertEqual(
            kv.allocate_slots(c, c.num_tokens - n, hits), [kv.block_pool.blocks[c.block_ids[2]].block_id]
        )
        self.assertEqual(kv.num_free_blocks, 0)

    def test_free_puts_the_tail_block_first_in_the_eviction_order(self) -> None:
        kv = KVCacheManager(5, 2)
        a = _req("a", [1, 2, 3, 4, 5, 6])
        _run_prefill(kv, a)
        self.assertEqual(a.block_ids, [0, 1, 2])
        kv.free(a)
        self.assertEqual(kv.block_pool.free_block_ids(), [3, 4, 2, 1, 0])

    def test_prefix_caching_off_finds_nothing(self) -> None:
        kv = KVCacheManager(10, 2, enable_prefix_caching=False)
        _run_prefill(kv, _req("a", [1, 2, 3, 4, 5]))
        self.assertEqual(kv.get_computed_blocks(_req("b", [1, 2, 3, 4, 5]))[1], 0)
        self.assertEqual(kv.block_pool.cached_block_hash_to_block, {})


if __name__ == "__main__":
    unittest.main()
