"""cache.py: Dynamic and Preallocated caches agree, own their memory as documented, and fail cleanly."""

from __future__ import annotations

import tracemalloc
import unittest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh import attention as attention_module
from attention_kv_caceh import cache as cache_module
from attention_kv_caceh.attention import multihead_decode_step, scaled_dot_product_attention
from attention_kv_caceh.cache import (
    CacheCapacityError,
    DynamicKVCache,
    PreallocatedKVCache,
    make_cache,
)
from attention_kv_caceh.oracle import reference_attention, tolerance_for


def normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def decode_all(cache, q, k, v):  # type: ignore[no-untyped-def]
    """Decode every position of q [B, H, T, D], k/v [B, H_kv, T, D] one at a time; outputs [B, H, T, D]."""
    outs = []
    for t in range(q.shape[2]):
        out, w = multihead_decode_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], cache)
        assert w.shape == (q.shape[0], q.shape[1], 1, cache.length), (w.shape, cache.length)
        outs.append(out)
    return np.concatenate(outs, axis=2)


class CacheEquivalenceTest(unittest.TestCase):
    def setUp(self) -> None:
        rng = np.random.default_rng(7)
        self.b, self.h, self.h_kv, self.t, self.d = 3, 4, 2, 9, 8
        self.q = normal(rng, self.b, self.h, self.t, self.d)
        self.k = normal(rng, self.b, self.h_kv, self.t, self.d)
        self.v = normal(rng, self.b, self.h_kv, self.t, self.d)

    def test_dynamic_equals_preallocated_equals_full_recompute(self) -> None:
        dyn = decode_all(DynamicKVCache(self.b, self.h_kv, self.d), self.q, self.k, self.v)
        pre = decode_all(PreallocatedKVCache(self.b, self.h_kv, self.d, self.t), self.q, self.k, self.v)
        np.testing.assert_array_equal(dyn, pre)  # the same arithmetic on the same values
        full, _ = scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True)
        ref, _ = reference_attention(self.q, self.k, self.v, is_causal=True)
        rtol, atol = tolerance_for(np.float32, self.d + self.t)
        np.testing.assert_allclose(dyn, full, rtol=rtol, atol=atol)
        np.testing.assert_allclose(dyn, ref, rtol=rtol, atol=atol)

    def test_batched_decode_equals_per_sequence_decode(self) -> None:
        batched = decode_all(PreallocatedKVCache(self.b, self.h_kv, self.d, self.t), self.q, self.k, self.v)
        for i in range(self.b):
            s = slice(i, i + 1)
            single = decode_all(
                PreallocatedKVCache(1, self.h_kv, self.d, self.t), self.q[s], self.k[s], self.v[s]
            )
            np.testing.assert_allclose(batched[s], single, rtol=1e-6, atol=1e-7)

    @settings(max_examples=40, deadline=None)
    @given(
        b=st.integers(1, 3),
        h_kv=st.integers(1, 2),
        g=st.integers(1, 3),
        d=st.integers(1, 6),
        prefill=st.integers(0, 5),
        steps=st.integers(1, 4),
        seed=st.integers(0, 2**31 - 1),
    )
    def test_property_prefill_then_decode(
        self, b: int, h_kv: int, g: int, d: int, prefill: int, steps: int, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        total = prefill + steps
        q = normal(rng, b, h_kv * g, total, d)
        k = normal(rng, b, h_kv, total, d)
        v = normal(rng, b, h_kv, total, d)
        caches = [DynamicKVCache(b, h_kv, d), PreallocatedKVCache(b, h_kv, d, total)]
        results = []
        for cache in caches:
            if prefill:  # T = 0 is covered when prefill == 0
                cache.append(k[:, :, :prefill], v[:, :, :prefill])
            self.assertEqual(cache.length, prefill)
            results.append(decode_all(cache, q[:, :, prefill:], k[:, :, prefill:], v[:, :, prefill:]))
            self.assertEqual(cache.length, total)
        np.testing.assert_array_equal(results[0], results[1])
        ref, _ = reference_attention(q, k, v, is_causal=True)
        rtol, atol = tolerance_for(np.float32, d + total)
        np.testing.assert_allclose(results[0], ref[:, :, prefill:], rtol=rtol, atol=atol)


class CacheMemoryTest(unittest.TestCase):
    def setUp(self) -> None:
        self.rng = np.random.default_rng(3)
        self.kv = normal(self.rng, 2, 2, 1, 4)

    def test_preallocated_returns_views_of_one_buffer(self) -> None:
        cache = PreallocatedKVCache(2, 2, 4, max_seq_len=8)
        k1, v1 = cache.append(self.kv, self.kv)
        k2, _ = cache.append(self.kv, self.kv)
        self.assertTrue(np.shares_memory(k1, cache.k_buffer))
        self.assertTrue(np.shares_memory(v1, cache.v_buffer))
        self.assertTrue(np.shares_memory(k1, k2))
        self.assertEqual(k2.shape, (2, 2, 2, 4))

    def test_dynamic_returns_new_memory_every_step(self) -> None:
        cache = DynamicKVCache(2, 2, 4)
        k1, _ = cache.append(self.kv, self.kv)
        k2, _ = cache.append(self.kv, self.kv)
        self.assertFalse(np.shares_memory(k1, k2))
        self.assertFalse(np.shares_memory(k2, self.kv))

    def test_length_is_a_counter_not_inferred_from_contents(self) -> None:
        zeros = np.zeros((2, 2, 1, 4), np.float32)
        for cache in (DynamicKVCache(2, 2, 4), PreallocatedKVCache(2, 2, 4, 4)):
            cache.append(zeros, zeros)
            cache.append(zeros, zeros)
            self.assertEqual(cache.length, 2)
            self.assertEqual(cache.keys.shape, (2, 2, 2, 4))

    def test_nbytes_and_capacity(self) -> None:
        pre = PreallocatedKVCache(2, 3, 4, max_seq_len=10, dtype=np.float64)
        self.assertEqual(pre.nbytes, 2 * 2 * 3 * 10 * 4 * 8)
        self.assertEqual(pre.capacity, 10)
        dyn = DynamicKVCache(2, 2, 4)
        dyn.append(self.kv, self.kv)
        self.assertEqual(dyn.nbytes, 2 * 2 * 2 * 1 * 4 * 4)
        self.assertIsNone(dyn.capacity)

    @staticmethod
    def traced_append_bytes(cache, kv: np.ndarray) -> int:  # type: ignore[no-untyped-def]
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            cache.append(kv, kv)
            return tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()

    def test_preallocated_append_allocation_does_not_grow_with_t(self) -> None:
        b, h_kv, d = 2, 2, 16
        kv = normal(self.rng, b, h_kv, 1, d)
        per_position = 2 * b * h_kv * d * 4  # K and V bytes of one position
        pre = PreallocatedKVCache(b, h_kv, d, max_seq_len=4096)
        dyn = DynamicKVCache(b, h_kv, d)
        sizes = {}
        for t in (16, 4000):
            for cache in (pre, dyn):
                cache.append(*(normal(self.rng, b, h_kv, t - cache.length, d),) * 2)
            sizes[t] = (self.traced_append_bytes(pre, kv), self.traced_append_bytes(dyn, kv))
            pre.truncate(pre.length - 1)
            dyn.truncate(dyn.length - 1)
        # Preallocated: a few hundred bytes of views at any T. Dynamic: a copy of all T positions.
        self.assertLess(sizes[4000][0], per_position * 4)
        self.assertLess(abs(sizes[4000][0] - sizes[16][0]), 256)
        self.assertGreaterEqual(sizes[4000][1], 4000 * per_position)
        self.assertGreater(sizes[4000][1], 100 * sizes[16][1] / 2)

    def test_preallocated_decode_loop_retains_no_memory(self) -> None:
        b, h, d, steps = 2, 2, 8, 200
        q = normal(self.rng, b, h, 1, d)
        kv = normal(self.rng, b, h, 1, d)
        pre = PreallocatedKVCache(b, h, d, max_seq_len=steps + 1)
        multihead_decode_step(q, kv, kv, pre)
        # only what the lab's own lines allocate: a thread left by another test (an event loop, a
        # compile pool) allocates too, and tracemalloc traces every thread
        own = [tracemalloc.Filter(True, lab.__file__) for lab in (attention_module, cache_module)]
        tracemalloc.start()
        try:
            start = tracemalloc.take_snapshot().filter_traces(own)
            for _ in range(steps):
                multihead_decode_step(q, kv, kv, pre)
            end = tracemalloc.take_snapshot().filter_traces(own)
        finally:
            tracemalloc.stop()
        retained = sum(stat.size_diff for stat in end.compare_to(start, "filename"))
        self.assertLess(retained, 2048)  # nothing grows with T: the step's temporaries are freed


class CacheErrorTest(unittest.TestCase):
    def test_capacity_error_is_value_error_and_leaves_cache_unchanged(self) -> None:
        cache = PreallocatedKVCache(1, 1, 2, max_seq_len=2)
        kv = np.ones((1, 1, 1, 2), np.float32)
        cache.append(kv, kv)
        cache.append(2 * kv, 2 * kv)
        before = cache.keys.copy()
        with self.assertRaises(ValueError) as ctx:
            cache.append(3 * kv, 3 * kv)
        self.assertIsInstance(ctx.exception, CacheCapacityError)
        self.assertIn("max_seq_len=2", str(ctx.exception))
        self.assertEqual(cache.length, 2)
        np.testing.assert_array_equal(cache.keys, before)

    def test_shape_and_dtype_errors(self) -> None:
        for cache in (DynamicKVCache(2, 2, 4), PreallocatedKVCache(2, 2, 4, 8)):
            with self.assertRaisesRegex(ValueError, r"k_t must be \[B=2, H_kv=2, S, D=4\].*\(2, 3, 1, 4\)"):
                bad = np.zeros((2, 3, 1, 4), np.float32)
                cache.append(bad, bad)
            with self.assertRaisesRegex(ValueError, "float64.*float32"):
                bad = np.zeros((2, 2, 1, 4), np.float64)
                cache.append(bad, bad)
            with self.assertRaisesRegex(ValueError, "same shape"):
                cache.append(np.zeros((2, 2, 1, 4), np.float32), np.zeros((2, 2, 2, 4), np.float32))
            self.assertEqual(cache.length, 0)
            with self.assertRaisesRegex(ValueError, r"truncate length must be in \[0, 0\]"):
                cache.truncate(1)

    def test_constructor_validation(self) -> None:
        with self.assertRaisesRegex(ValueError, "batch_size must be a positive integer, got 0"):
            DynamicKVCache(0, 1, 4)
        with self.assertRaisesRegex(ValueError, "max_seq_len"):
            PreallocatedKVCache(1, 1, 4, max_seq_len=0)
        with self.assertRaisesRegex(ValueError, "floating"):
            DynamicKVCache(1, 1, 4, dtype=np.int32)
        with self.assertRaisesRegex(ValueError, "unknown cache kind 'paged'"):
            make_cache("paged", 1, 1, 4)
        with self.assertRaisesRegex(ValueError, "needs max_seq_len"):
            make_cache("preallocated", 1, 1, 4)

    def test_decode_step_rejects_bad_query(self) -> None:
        cache = DynamicKVCache(1, 1, 4)
        kv = np.zeros((1, 1, 1, 4), np.float32)
        with self.assertRaisesRegex(ValueError, r"q_t must be \[B, H, 1, D\]"):
            multihead_decode_step(np.zeros((1, 1, 2, 4), np.float32), kv, kv, cache)
        with self.assertRaisesRegex(ValueError, "H=3 must be a multiple of KV heads H_kv=2"):
            cache2 = DynamicKVCache(1, 2, 4)
            kv2 = np.zeros((1, 2, 1, 4), np.float32)
            multihead_decode_step(np.zeros((1, 3, 1, 4), np.float32), kv2, kv2, cache2)


if __name__ == "__main__":
    unittest.main()
