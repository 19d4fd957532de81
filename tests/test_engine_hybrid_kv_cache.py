"""Hybrid KV cache: groups per layer type, sliding-window blocks freed behind the window, prefix hits all
groups agree on, admission counting each group's peak, and preemption returning every block.

Oracles: hand-counted groups; per-position counts of the blocks a window still needs; a brute-force
search over every hit length of which blocks each group has cached; num_free_blocks == num_blocks after
every request ends.
"""

from __future__ import annotations

import random
import unittest

import numpy as np

from attention_kv_caceh.engine.block_pool import BlockPool, hash_block_tokens
from attention_kv_caceh.engine.block_table import MultiGroupBlockTable
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.kv_cache_coordinator import (
    KVCacheCoordinator,
    KVCacheGroupSpec,
    kv_cache_groups_for,
    layer_buffer_index,
)
from attention_kv_caceh.engine.kv_cache_manager import (
    KVCacheConfig,
    KVCacheManager,
    RequestTooLargeError,
    full_batch_blocks,
)
from attention_kv_caceh.engine.outputs import ModelRunnerOutput
from attention_kv_caceh.engine.request import Request, SamplingParams
from attention_kv_caceh.engine.scheduler import Scheduler
from attention_kv_caceh.engine.single_type_kv_cache_manager import NULL_BLOCK_ID, group_hash_key
from tests.test_engine_model import FakeRequest, FakeSchedulerOutput

S, F = "sliding_attention", "full_attention"
HYBRID = (KVCacheGroupSpec((1,)), KVCacheGroupSpec((0,), sliding_window=5))


def _req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


class GroupingTest(unittest.TestCase):
    def test_layers_are_cut_into_groups_of_the_rarest_types_count(self) -> None:
        groups = kv_cache_groups_for(6, (S, S, F, S, S, F), 8)
        self.assertEqual(
            [(g.layer_indices, g.sliding_window) for g in groups],
            [((2, 5), None), ((0, 1), 8), ((3, 4), 8)],
        )
        self.assertEqual(layer_buffer_index(groups, 6), ((1, 0), (1, 1), (0, 0), (2, 0), (2, 1), (0, 1)))
        self.assertEqual(kv_cache_groups_for(3), (KVCacheGroupSpec((0, 1, 2)),))
        self.assertEqual(kv_cache_groups_for(2, (S, S), 4), (KVCacheGroupSpec((0, 1), 4),))
        # 5 sliding and 6 full: under 1.25x, so one group of 6 and one of 5 rather than groups of 5
        groups = kv_cache_groups_for(11, (S, F) * 5 + (F,), 4)
        self.assertEqual([len(g.layer_indices) for g in groups], [6, 5])
        groups = kv_cache_groups_for(9, (S, F) * 4 + (F,), 4)  # 5 = 1.25 x 4: groups of 4
        self.assertEqual([len(g.layer_indices) for g in groups], [4, 1, 4])

    def test_bad_layer_types_are_refused_by_value(self) -> None:
        with self.assertRaisesRegex(ValueError, "local"):
            kv_cache_groups_for(2, (S, "local"), 4)
        with self.assertRaisesRegex(ValueError, "sliding_window"):
            kv_cache_groups_for(2, (S, F), None)


class SlidingFreeTest(unittest.TestCase):
    def test_blocks_behind_the_window_are_freed_as_the_request_decodes(self) -> None:
        bs, w = 4, 5
        kv = KVCacheManager(40, bs, True, HYBRID)
        req = _req("a", list(range(1, 9)), max_tokens=40)
        self.assertIsNotNone(kv.allocate_slots(req, 8))
        req.num_computed_tokens = 8
        for c in range(8, 40):
            req.append_output_token(7)
            self.assertIsNotNone(kv.allocate_slots(req, 1))
            full, sliding = kv.get_block_ids(req)
            # oracle: position p's query reads (p - w, p]; c's query is the first still to come
            first_needed = max(c - w + 1, 0) // bs
            self.assertEqual(len(full), c // bs + 1)
            self.assertEqual(sliding[:first_needed], [NULL_BLOCK_ID] * first_needed)
            self.assertNotIn(NULL_BLOCK_ID, sliding[first_needed:])
            held = len(full) + len(sliding) - first_needed
            self.assertEqual(kv.num_free_blocks, 40 - held)
            freed = set(kv.block_pool.free_block_ids())
            self.assertTrue(freed.isdisjoint(full + sliding[first_needed:]))
            req.num_computed_tokens = c + 1
        kv.free(req)
        self.assertEqual(kv.num_free_blocks, 40)
        self.assertEqual(kv.get_block_ids(req), ([], []))

    def test_admission_counts_each_groups_peak(self) -> None:
        # 99 positions: the full group needs 25 blocks; the sliding one (w 5, chunks of 8) at most
        # cdiv(5 - 1 + 8, 4) + 1 = 4
        config = KVCacheConfig(29, 4, 200, HYBRID, max_num_batched_tokens=8)
        config.check_request_fits(50, 50)
        with self.assertRaises(RequestTooLargeError) as ctx:
            KVCacheConfig(28, 4, 200, HYBRID, max_num_batched_tokens=8).check_request_fits(50, 50)
        self.assertEqual(ctx.exception.num_blocks_needed, 29)
        # without a chunk bound, and with one full group, the sliding group counts every block
        self.assertEqual(KVCacheConfig(1, 4, 200, HYBRID).num_blocks_needed(99), 50)
        self.assertEqual(KVCacheConfig(1, 4, 200).num_blocks_needed(99), 25)


class FullBatchBlocksTest(unittest.TestCase):
    """What the default pool is capped at: max_num_seqs requests of max_model_len, in every group."""

    def test_one_full_group_needs_cdiv_of_max_model_len_per_sequence(self) -> None:
        self.assertEqual(full_batch_blocks(8, 16, 2048, (), 512), 8 * 128)
        self.assertEqual(full_batch_blocks(3, 16, 100, (), 512), 3 * 7)
        self.assertEqual(full_batch_blocks(1, 4, 4, (), 4), 1)

    def test_each_group_counts_its_own_peak(self) -> None:
        # 200 positions in blocks of 4: the full group 50; the sliding one (w 5, chunks of 8) 4
        self.assertEqual(full_batch_blocks(2, 4, 200, HYBRID, 8), 2 * (50 + 4))
        two_full = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,)))
        self.assertEqual(full_batch_blocks(2, 4, 200, two_full, 8), 2 * 100)
        with self.assertRaisesRegex(ValueError, "max_num_seqs"):
            full_batch_blocks(0, 4, 200, (), 8)


class MultiGroupBlockTableTest(unittest.TestCase):
    """Each group's slots from its own table; a sliding group's freed entries only before its window."""

    def test_slots_per_group_and_the_window_check(self) -> None:
        table = MultiGroupBlockTable((None, 5), block_size=4, num_blocks=8)
        req = FakeRequest("a", list(range(10)), 8, [0, 1, 2])
        out = FakeSchedulerOutput([req], {"a": 2}, block_ids={"a": ([0, 1, 2], [-1, 6, 7])})
        tables = table.check_request(out, req, 10)  # type: ignore[arg-type]
        pos = np.array([8, 9], dtype=np.int64)
        meta = table.attention_metadata(
            [tables], pos, np.zeros(2, dtype=np.int64), np.array([0, 2]), np.array([10]), row_per_token=False
        )
        self.assertEqual(meta[0].slot_mapping.tolist(), [2 * 4, 2 * 4 + 1])  # full group: block 2
        self.assertEqual(meta[1].slot_mapping.tolist(), [7 * 4, 7 * 4 + 1])  # sliding group: block 7
        self.assertEqual(meta[1].block_tables.tolist(), [[-1, 6, 7]])
        per_row = table.attention_metadata(
            [tables], pos, np.zeros(2, dtype=np.int64), np.array([0, 2]), np.array([10]), row_per_token=True
        )
        self.assertEqual(per_row[0].context_lens.tolist(), [9, 10])
        self.assertEqual(per_row[0].block_tables.shape, (2, 3))
        early = FakeRequest("b", list(range(10)), 3, [0, 1, 2])  # its window reaches back into block 0
        bad = FakeSchedulerOutput([early], {"b": 7}, block_ids={"b": ([0, 1, 2], [-1, 6, 7])})
        with self.assertRaisesRegex(ValueError, "KV cache group 1"):
            table.check_request(bad, early, 10)  # type: ignore[arg-type]
        with self.assertRaisesRegex(ValueError, "block tables of 1 KV cache groups"):
            table.check_request(FakeSchedulerOutput([req], {"a": 2}), req, 10)  # type: ignore[arg-type]


def _brute_force_hit(cached: list[set[int]], windows: list[int | None], max_blocks: int, bs: int) -> int:
    """The longest L (a multiple of bs, at most max_blocks * bs) at which every full group has blocks
    0 .. L/bs - 1 cached and every sliding group those holding positions [L - w + 1, L)."""
    for num in range(max_blocks, -1, -1):
        length = num * bs
        ok = True
        for blocks, w in zip(cached, windows, strict=True):
            first = 0 if w is None else max(length - w + 1, 0) // bs
            ok = ok and all(i in blocks for i in range(first, num))
        if ok:
            return length
    return 0


class PrefixHitTest(unittest.TestCase):
    def test_hit_lengths_equal_a_brute_force_search(self) -> None:
        rng = random.Random(0)
        bs, n = 2, 10
        for trial in range(300):
            windows: list[int | None] = [None, rng.randint(1, 9)] if trial % 3 else [rng.randint(1, 9)]
            if trial % 5 == 0:
                windows.append(rng.randint(1, 9))
            groups = [KVCacheGroupSpec((g,), w) for g, w in enumerate(windows)]
            pool = BlockPool(64)
            coordinator = KVCacheCoordinator(groups, pool, bs)
            hashes = [hash_block_tokens(None, [trial, i]) for i in range(n)]
            cached = [{i for i in range(n) if rng.random() < 0.7} for _ in groups]
            next_block = 0
            for g, blocks in enumerate(cached):
                for i in sorted(blocks):
                    pool.cache_block(pool.blocks[next_block], group_hash_key(hashes[i], g))
                    next_block += 1
            max_blocks = rng.randint(0, n)
            hits, length = coordinator.find_longest_cache_hit(hashes, max_blocks * bs)
            with self.subTest(trial=trial, windows=windows, cached=cached, max_blocks=max_blocks):
                self.assertEqual(length, _brute_force_hit(cached, windows, max_blocks, bs))
                for g, (hit, w) in enumerate(zip(hits, windows, strict=True)):
                    self.assertEqual(len(hit), length // bs)
                    first = 0 if w is None else max(length - w + 1, 0) // bs
                    for i in range(first, length // bs):  # the blocks read after the hit are the cached ones
                        self.assertEqual(hit[i].block_hash, group_hash_key(hashes[i], g))

    def test_a_second_request_hits_the_window_and_skips_the_rest(self) -> None:
        bs = 4
        kv = KVCacheManager(40, bs, True, HYBRID)
        prompt = list(range(1, 22))  # 21 tokens: 5 full blocks
        a = _req("a", prompt)
        self.assertIsNotNone(kv.allocate_slots(a, len(prompt)))
        a.num_computed_tokens = len(prompt)
        kv.cache_full_blocks(a)
        b = _req("b", prompt)
        (full_hit, sliding_hit), length = kv.get_computed_blocks(b)
        self.assertEqual(length, 20)
        self.assertEqual([blk.block_id for blk in full_hit], a.block_ids[:5])
        # w 5: the query at 20 reads 16 .. 20, so only block 4 of the sliding group is needed
        self.assertEqual(
            [blk.block_id for blk in sliding_hit], [NULL_BLOCK_ID] * 4 + [kv.get_block_ids(a)[1][4]]
        )
        free_before = kv.num_free_blocks
        self.assertIsNotNone(kv.allocate_slots(b, 1, (full_hit, sliding_hit)))
        self.assertEqual(kv.get_block_ids(b)[1][:4], [NULL_BLOCK_ID] * 4)
        self.assertEqual(free_before - kv.num_free_blocks, 2)  # one fresh block per group; hits were in use
        kv.free(a)
        kv.free(b)
        self.assertEqual(kv.num_free_blocks, 40)


class SchedulerHybridTest(unittest.TestCase):
    def test_preemption_and_finishing_return_every_block(self) -> None:
        config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, num_kv_blocks=16)
        sched = Scheduler(config, 16, 64, HYBRID)
        rng = random.Random(1)
        for i in range(6):
            sched.add_request(_req(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randint(3, 20))], 16))
        saw_null = False
        for _ in range(500):
            if not sched.has_unfinished_requests():
                break
            out = sched.schedule()
            for r in sched.running:
                saw_null = saw_null or NULL_BLOCK_ID in sched.kv_cache_manager.get_block_ids(r)[1]
            tokens = [[3] if out.samples_token(r) else [] for r in out.scheduled_requests]
            ids = [r.request_id for r in out.scheduled_requests]
            sched.update_from_output(out, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, tokens))
        self.assertFalse(sched.has_unfinished_requests())
        self.assertGreater(sched.num_preemptions, 0)
        self.assertTrue(saw_null)
        self.assertEqual(sched.kv_cache_manager.num_free_blocks, 16)
        self.assertEqual(sched.kv_cache_manager.coordinator.managers[1].req_to_blocks, {})


if __name__ == "__main__":
    unittest.main()
