"""A call that raises changes nothing: the caches, `multihead_decode_step` and `decode_step` validate
every input (dtypes, shapes, sizes, capacity, array-likes) before they touch any state."""

from __future__ import annotations

import unittest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.attention import decode_step, multihead_decode_step
from attention_kv_caceh.cache import DynamicKVCache, PreallocatedKVCache
from attention_kv_caceh.oracle import reference_attention, tolerance_for

Cache = DynamicKVCache | PreallocatedKVCache


def snapshot(cache: Cache) -> tuple[object, ...]:
    """Everything a cache holds, as bytes: the valid prefix, and for Preallocated the whole buffers."""
    state: tuple[object, ...] = (cache.length, cache.nbytes, cache.keys.tobytes(), cache.values.tobytes())
    if isinstance(cache, PreallocatedKVCache):
        state += (cache.k_buffer.tobytes(), cache.v_buffer.tobytes())
    return state


# Every way a decode step's input can be wrong; each must raise ValueError before the cache changes.
DECODE_ERRORS = [
    "query float64, cache float32",  # the case that used to grow the cache, then raise
    "keys float64",
    "all float64",
    "query integer",
    "query rank 3",
    "query two positions",
    "keys two positions",
    "query batch differs",
    "query head dim differs",
    "heads not a multiple of KV heads",
    "values shape differs",
    "cache KV heads differ",
    "cache head dim differs",
    "query ragged list",
    "keys as a list of Python floats",
    "cache full",
]

# The subset whose keys/values alone are wrong for the cache, so that `cache.append` must refuse them too.
CACHE_ERRORS = {
    "keys float64",
    "all float64",
    "values shape differs",
    "cache KV heads differ",
    "cache head dim differs",
    "keys as a list of Python floats",
    "cache full",
}


def corrupt(error: str, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[object, object, object]:
    """q [B, H, 1, D], k/v [B, H_kv, 1, D] made wrong in the way `error` names."""
    h, h_kv = q.shape[1], k.shape[1]
    match error:
        case "query float64, cache float32":
            return q.astype(np.float64), k, v
        case "keys float64":
            return q, k.astype(np.float64), v
        case "all float64":
            return q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)
        case "query integer":
            return q.astype(np.int64), k, v
        case "query rank 3":
            return q[:, :, 0], k, v
        case "query two positions":
            return np.concatenate([q, q], axis=2), k, v
        case "keys two positions":
            return q, np.concatenate([k, k], axis=2), np.concatenate([v, v], axis=2)
        case "query batch differs":
            return np.concatenate([q, q], axis=0), k, v
        case "query head dim differs":
            return np.concatenate([q, q], axis=3), k, v
        case "heads not a multiple of KV heads":
            if h_kv == 1:  # H_kv = 1 divides every H: one query head over two KV heads instead
                return q[:, :1], np.concatenate([k, k], axis=1), np.concatenate([v, v], axis=1)
            return np.concatenate([q, q[:, :1]], axis=1), k, v  # H + 1 heads over H_kv >= 2
        case "values shape differs":
            return q, k, np.concatenate([v, v], axis=3)
        case "cache KV heads differ":  # H = 2 * H_kv query heads over 2 * H_kv KV heads: valid alone
            return q, np.concatenate([k] * h, axis=1)[:, :h], np.concatenate([v] * h, axis=1)[:, :h]
        case "cache head dim differs":
            q2 = np.concatenate([q, q], axis=3)
            return q2, np.concatenate([k, k], axis=3), np.concatenate([v, v], axis=3)
        case "query ragged list":
            return [[[[1.0]]], [[[1.0, 2.0]]]], k, v
        case "keys as a list of Python floats":
            return q, k.tolist(), v.tolist()
        case "cache full":
            return q, k, v
    raise AssertionError(error)


class FailedDecodeChangesNothingTest(unittest.TestCase):
    @settings(max_examples=150, deadline=None)
    @given(
        kind=st.sampled_from(["dynamic", "preallocated"]),
        b=st.integers(1, 2),
        h_kv=st.integers(1, 2),
        g=st.integers(1, 2),
        d=st.integers(1, 4),
        t0=st.integers(1, 4),
        error=st.sampled_from(DECODE_ERRORS),
        seed=st.integers(0, 2**31 - 1),
    )
    def test_every_failed_decode_step_leaves_the_cache_byte_identical(
        self, kind: str, b: int, h_kv: int, g: int, d: int, t0: int, error: str, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        h = h_kv * g
        if error == "cache KV heads differ" and h == h_kv:
            h = 2 * h_kv  # k/v get H heads, which the cache (H_kv heads) must refuse
        max_seq_len = t0 if error == "cache full" else t0 + 1
        cache: Cache = (
            DynamicKVCache(b, h_kv, d) if kind == "dynamic" else PreallocatedKVCache(b, h_kv, d, max_seq_len)
        )
        if error == "cache full" and kind == "dynamic":
            error = "query float64, cache float32"  # a Dynamic cache is never full
        prefill_k = rng.standard_normal((b, h_kv, t0, d)).astype(np.float32)
        prefill_v = rng.standard_normal((b, h_kv, t0, d)).astype(np.float32)
        cache.append(prefill_k, prefill_v)
        q = rng.standard_normal((b, h, 1, d)).astype(np.float32)
        k = rng.standard_normal((b, h_kv, 1, d)).astype(np.float32)
        v = rng.standard_normal((b, h_kv, 1, d)).astype(np.float32)
        before = snapshot(cache)

        bad_q, bad_k, bad_v = corrupt(error, q, k, v)
        with self.assertRaises(ValueError):
            multihead_decode_step(bad_q, bad_k, bad_v, cache)  # type: ignore[arg-type]
        self.assertEqual(snapshot(cache), before, error)
        if error in CACHE_ERRORS:
            with self.assertRaises(ValueError):  # the cache's own append refuses the same k/v
                cache.append(bad_k, bad_v)  # type: ignore[arg-type]
            self.assertEqual(snapshot(cache), before, error)

        if error == "cache full":
            return
        # The cache still works: the next valid step equals the float64 reference over every position.
        out, _ = multihead_decode_step(q, k, v, cache)
        self.assertEqual(cache.length, t0 + 1)
        keys = np.concatenate([prefill_k, k], axis=2)  # [B, H_kv, T0+1, D]
        values = np.concatenate([prefill_v, v], axis=2)
        ref, _ = reference_attention(q, keys, values)
        rtol, atol = tolerance_for(np.float32, d + t0 + 1)
        np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol)

    def test_float64_query_over_float32_cache_names_the_dtypes(self) -> None:
        cache = PreallocatedKVCache(1, 1, 4, 4)
        kv = np.zeros((1, 1, 1, 4), np.float32)
        with self.assertRaisesRegex(ValueError, "float64.*float32"):
            multihead_decode_step(np.zeros((1, 1, 1, 4)), kv, kv, cache)
        self.assertEqual(cache.length, 0)

    def test_failed_decode_step_leaves_its_input_caches_unchanged(self) -> None:
        rng = np.random.default_rng(3)
        x_t = rng.standard_normal((2, 1, 6)).astype(np.float32)
        w = rng.standard_normal((6, 4)).astype(np.float32)
        k_cache = rng.standard_normal((2, 3, 4)).astype(np.float32)
        v_cache = rng.standard_normal((2, 3, 4)).astype(np.float32)
        saved = (k_cache.tobytes(), v_cache.tobytes())
        bad_calls = [
            (x_t.astype(np.float64), w, w, w, k_cache, v_cache),
            (x_t, w, w, w, k_cache[:1], v_cache),
            (x_t, w, w, w, k_cache, v_cache[:, :2]),
            (x_t, w[:, :0], w[:, :0], w, k_cache[..., :0], v_cache),  # D_k = 0
            (x_t, w, w, w, k_cache.tolist(), v_cache),  # a list becomes float64: mixed dtypes
        ]
        for i, args in enumerate(bad_calls):
            with self.subTest(i), self.assertRaises(ValueError):
                decode_step(*args)  # type: ignore[arg-type]
            self.assertEqual((k_cache.tobytes(), v_cache.tobytes()), saved)


class ArrayLikeInputTest(unittest.TestCase):
    """Lists are converted with np.asarray (Python floats become float64) and then checked as arrays."""

    def test_lists_equal_arrays_in_every_decode_entry_point(self) -> None:
        rng = np.random.default_rng(5)
        q = rng.standard_normal((1, 2, 1, 3))
        k = rng.standard_normal((1, 1, 1, 3))
        v = rng.standard_normal((1, 1, 1, 3))
        from_arrays, _ = multihead_decode_step(q, k, v, DynamicKVCache(1, 1, 3, np.float64))
        from_lists, _ = multihead_decode_step(
            q.tolist(), k.tolist(), v.tolist(), DynamicKVCache(1, 1, 3, np.float64)
        )  # type: ignore[arg-type]
        np.testing.assert_array_equal(from_lists, from_arrays)
        cache = PreallocatedKVCache(1, 1, 3, 2, np.float64)
        keys, _ = cache.append(k.tolist(), v.tolist())  # type: ignore[arg-type]
        np.testing.assert_array_equal(keys, k)
        x = rng.standard_normal((1, 1, 4))
        w = rng.standard_normal((4, 3))
        kc = rng.standard_normal((1, 2, 3))  # T = 2 (an empty list would lose its D axis)
        want = decode_step(x, w, w, w, kc, kc)
        got = decode_step(x.tolist(), w.tolist(), w.tolist(), w.tolist(), kc.tolist(), kc.tolist())  # type: ignore[arg-type]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)

    def test_list_into_float32_cache_is_refused_with_the_dtypes_named(self) -> None:
        cache = DynamicKVCache(1, 1, 2)
        with self.assertRaisesRegex(ValueError, "k_t dtype float64 does not match the cache dtype float32"):
            cache.append([[[[1.0, 2.0]]]], [[[[1.0, 2.0]]]])  # type: ignore[arg-type]
        with self.assertRaisesRegex(ValueError, "k_t cannot be converted"):
            cache.append([[[[1.0]], [[1.0, 2.0]]]], [[[[1.0, 2.0]]]])  # type: ignore[arg-type]
        self.assertEqual(cache.length, 0)


class IntegerSizeTest(unittest.TestCase):
    NOT_SIZES = (1.5, 2.0, float("inf"), float("nan"), None, True, "3", np.float64(2.0))

    def test_constructor_sizes_must_be_integers(self) -> None:
        builders = {
            "batch_size": lambda n: DynamicKVCache(n, 1, 4),
            "num_kv_heads": lambda n: PreallocatedKVCache(1, n, 4, 8),
            "head_dim": lambda n: DynamicKVCache(1, 1, n),
            "max_seq_len": lambda n: PreallocatedKVCache(1, 1, 4, n),
        }
        for name, build in builders.items():
            for value in self.NOT_SIZES:
                with self.subTest(name=name, value=value), self.assertRaisesRegex(ValueError, name):
                    build(value)
            cache = build(np.int64(2))  # NumPy integers are integers
            self.assertIs(type(cache.batch_size), int)

    def test_truncate_length_must_be_an_integer_in_range(self) -> None:
        for cache in (DynamicKVCache(1, 1, 2), PreallocatedKVCache(1, 1, 2, 4)):
            kv = np.ones((1, 1, 3, 2), np.float32)
            cache.append(kv, kv)
            before = snapshot(cache)
            for value in (*self.NOT_SIZES, -1, 4):
                with self.subTest(cache=type(cache).__name__, value=value):
                    with self.assertRaisesRegex(ValueError, "truncate length"):
                        cache.truncate(value)  # type: ignore[arg-type]
                    self.assertEqual(snapshot(cache), before)
            cache.truncate(np.int64(1))  # type: ignore[arg-type]
            self.assertEqual(cache.length, 1)
            self.assertIs(type(cache.length), int)
            self.assertEqual(cache.keys.shape, (1, 1, 1, 2))


if __name__ == "__main__":
    unittest.main()
