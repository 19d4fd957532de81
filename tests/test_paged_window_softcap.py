"""Paged decode attention with a sliding window and with softcapping, against the float64 oracle
(`oracle.reference_paged_decode_attention`): the LLVM IR kernel (block size 16, D 64 / 128, float32)
and the Numba loops (float64, other sizes), blocks before the window never read."""

from __future__ import annotations

import unittest

import numpy as np

from attention_kv_caceh.kernels import _decode_attention_paged_jit
from attention_kv_caceh.kernels.decode_attention import paged_decode_attention
from attention_kv_caceh.model_executor.paged_attention import allocate_kv_cache
from attention_kv_caceh.oracle import reference_paged_decode_attention, tolerance_for

TANH_RTOL_F32 = 3e-7  # `kernels.ir.vtanh`'s documented relative error bound


def make_case(
    rng: np.random.Generator, lens: list[int], h_kv: int, group: int, d: int, block_size: int, dtype: type
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q [B, H, D] (scores of order 10), caches in the engine's layout with every block's data random,
    and a shuffled block table padded with -1; block 0 is never used (a garbage block for the tests)."""
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(per_seq) + 2
    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, h_kv, d, dtype)
    k_cache[...] = rng.standard_normal(k_cache.shape)
    v_cache[...] = rng.standard_normal(v_cache.shape)
    ids = 1 + rng.permutation(num_blocks - 1)
    tables = np.full((len(lens), max([*per_seq, 1]) + 1), -1, np.int32)
    at = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = ids[at : at + n]
        at += n
    q: np.ndarray = np.asarray(rng.standard_normal((len(lens), h_kv * group, d)) * 3, dtype=np.dtype(dtype))
    return q, k_cache, v_cache, tables, np.array(lens, np.int32)


def poison_before_window(
    k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray, lens: np.ndarray, window: int, bs: int
) -> np.ndarray:
    """A copy of tables whose entries for blocks wholly before the window alternate between -1 and
    block 0, which is filled with NaN: any read of them would turn the output into NaN."""
    k_cache[0], v_cache[0] = np.nan, np.nan
    poisoned = tables.copy()
    for b, n in enumerate(lens.tolist()):
        for i in range(max(0, n - window) // bs):
            poisoned[b, i] = -1 if i % 2 else 0
    return poisoned


def reference(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    window: int | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """The float64 oracle on float64 copies of the inputs."""
    f64 = np.float64
    return reference_paged_decode_attention(
        q.astype(f64), k_cache.astype(f64), v_cache.astype(f64), tables, lens, window=window, softcap=softcap
    )


class WindowTest(unittest.TestCase):
    def check(self, d: int, block_size: int, dtype: type, group: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        lens = [70, 16, 1, 33, 0, 48]
        q, k_cache, v_cache, tables, context_lens = make_case(rng, lens, 2, group, d, block_size, dtype)
        for window in (1, 5, 16, 17, 31, 64, 100):
            with self.subTest(window=window):
                poisoned = poison_before_window(k_cache, v_cache, tables, context_lens, window, block_size)
                out = paged_decode_attention(q, k_cache, v_cache, poisoned, context_lens, window=window)
                lens_used = [n for n in lens if n > 0]
                want = reference(q, k_cache, v_cache, poisoned, np.maximum(context_lens, 1), window=window)
                rtol, atol = tolerance_for(dtype, d + min(window, max(lens_used)))
                for b, n in enumerate(lens):
                    if n == 0:
                        np.testing.assert_array_equal(out[b], 0.0)
                    else:
                        np.testing.assert_allclose(out[b], want[b], rtol=rtol, atol=atol)

    def test_ir_kernel_float32_every_group_chunk(self) -> None:
        for d in (64, 128):
            self.assertGreaterEqual(_decode_attention_paged_jit.fast_shape(np.float32, d, 16, True), 0)
            for group in (1, 2, 3, 5):
                with self.subTest(d=d, group=group):
                    self.check(d, 16, np.float32, group, seed=d + group)

    def test_loops_float64_and_other_block_sizes(self) -> None:
        for dtype, d, block_size in ((np.float64, 64, 16), (np.float32, 24, 5), (np.float64, 8, 1)):
            with self.subTest(dtype=dtype, d=d, block_size=block_size):
                self.check(d, block_size, dtype, 3, seed=block_size)

    def test_window_covering_the_context_equals_no_window(self) -> None:
        rng = np.random.default_rng(3)
        q, k_cache, v_cache, tables, lens = make_case(rng, [40, 7], 2, 3, 64, 16, np.float32)
        full = paged_decode_attention(q, k_cache, v_cache, tables, lens)
        for window in (40, 41, 10**30):
            got = paged_decode_attention(q, k_cache, v_cache, tables, lens, window=window)
            np.testing.assert_array_equal(got, full)

    def test_out_of_window_entries_pass_the_checks_and_in_window_ones_do_not(self) -> None:
        k_cache, v_cache = allocate_kv_cache(3, 4, 1, 8, np.float32)
        q = np.ones((1, 1, 8), np.float32)
        tables, lens = np.array([[-1, -1, 2]], np.int32), np.array([10], np.int32)
        paged_decode_attention(q, k_cache, v_cache, tables, lens, window=2)  # positions 8, 9: block 2
        with self.assertRaisesRegex(ValueError, "block id -1"):
            paged_decode_attention(q, k_cache, v_cache, tables, lens, window=3)  # position 7: block 1


class SoftcapTest(unittest.TestCase):
    def check(self, d: int, block_size: int, dtype: type, window: int | None, seed: int) -> None:
        rng = np.random.default_rng(seed)
        lens = [70, 16, 1, 45]
        q, k_cache, v_cache, tables, context_lens = make_case(rng, lens, 2, 3, d, block_size, dtype)
        # scores reach about +-30 (q * 3, unit K): both branches of tanh, caps below and above that
        for cap in (0.5, 5.0, 50.0):
            with self.subTest(cap=cap):
                out = paged_decode_attention(
                    q, k_cache, v_cache, tables, context_lens, softcap=cap, window=window
                )
                want = reference(q, k_cache, v_cache, tables, context_lens, window, cap)
                rtol, atol = tolerance_for(dtype, d + max(lens))
                # a capped score off by at most cap * r (r: tanh's relative error) moves each weight by
                # a factor within exp(+-2 cap r), so the output by at most 4 cap r max|v| (for small cap r)
                r = TANH_RTOL_F32 if dtype == np.float32 else 16 * np.finfo(np.float64).eps
                atol += 4 * cap * r * float(np.abs(v_cache[1:]).max())
                np.testing.assert_allclose(out, want, rtol=rtol, atol=atol)
                plain = reference(q, k_cache, v_cache, tables, context_lens)
                self.assertGreater(float(np.abs(want - plain).max()), 10 * atol)  # the cap matters here

    def test_ir_kernel_float32(self) -> None:
        for d in (64, 128):
            with self.subTest(d=d):
                self.check(d, 16, np.float32, None, seed=d)

    def test_loops_float64_and_another_block_size(self) -> None:
        self.check(64, 16, np.float64, None, seed=1)
        self.check(24, 5, np.float32, None, seed=2)

    def test_with_a_window(self) -> None:
        self.check(64, 16, np.float32, 20, seed=4)
        self.check(64, 16, np.float64, 20, seed=5)

    def test_rejects_bad_window_and_softcap(self) -> None:
        k_cache, v_cache = allocate_kv_cache(2, 4, 1, 8, np.float32)
        q = np.zeros((1, 1, 8), np.float32)
        tables, lens = np.array([[0, 1]], np.int32), np.array([5], np.int32)
        for kwargs in ({"window": 0}, {"window": -3}, {"window": 2.5}, {"window": True}):
            with self.subTest(**kwargs), self.assertRaisesRegex(ValueError, "window must be"):
                paged_decode_attention(q, k_cache, v_cache, tables, lens, **kwargs)  # pyright: ignore[reportArgumentType]
        for cap in (0.0, -1.0, float("nan"), float("inf"), "5"):
            with self.subTest(softcap=cap), self.assertRaisesRegex(ValueError, "softcap must be"):
                paged_decode_attention(q, k_cache, v_cache, tables, lens, softcap=cap)  # pyright: ignore[reportArgumentType]


if __name__ == "__main__":
    unittest.main()
