"""The plain decode-attention kernel against the float64 oracle, and the tuned kernels against it."""

from __future__ import annotations

import unittest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.kernels.decode_attention import (
    decode_attention,
    paged_decode_attention,
    plain_decode_attention,
)
from attention_kv_caceh.model_executor.paged_attention import pack_kv_blocks
from attention_kv_caceh.oracle import reference_attention, tolerance_for

DTYPES = (np.float32, np.float64)


def inputs(
    seed: int, b: int, h: int, h_kv: int, t: int, d: int, dtype: type
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, d)).astype(dtype)  # [B, H, D]
    k = rng.standard_normal((b, h_kv, t, d)).astype(dtype)  # [B, H_kv, T, D]
    v = rng.standard_normal((b, h_kv, t, d)).astype(dtype)
    return q, k, v


class PlainKernelTest(unittest.TestCase):
    @settings(max_examples=25, deadline=None)
    @given(
        seed=st.integers(0, 2**31),
        b=st.integers(1, 3),
        h_kv=st.integers(1, 3),
        group=st.integers(1, 3),
        t=st.integers(1, 40),
        d=st.integers(1, 24),
        dtype=st.sampled_from(DTYPES),
    )
    def test_matches_float64_reference(
        self, seed: int, b: int, h_kv: int, group: int, t: int, d: int, dtype: type
    ) -> None:
        q, k, v = inputs(seed, b, h_kv * group, h_kv, t, d, dtype)
        expected, _ = reference_attention(q[:, :, None], k, v)  # [B, H, 1, D] float64
        got = plain_decode_attention(q, k, v)
        self.assertEqual(got.dtype, np.dtype(dtype))
        rtol, atol = tolerance_for(dtype, d + t)
        np.testing.assert_allclose(got, expected[:, :, 0], rtol=rtol, atol=atol)

    def test_large_scores_rescale_without_overflow(self) -> None:
        q, k, v = inputs(1, 1, 2, 1, 50, 8, np.float32)
        k[0, 0, 30] = q[0, 0] * 40.0  # one score far above the rest, late in the sequence
        expected, _ = reference_attention(q[:, :, None], k, v)
        got = plain_decode_attention(q, k, v)
        self.assertTrue(np.all(np.isfinite(got)))
        np.testing.assert_allclose(got, expected[:, :, 0], rtol=1e-4, atol=1e-5)

    def test_four_dim_query_and_scale(self) -> None:
        q, k, v = inputs(2, 2, 4, 2, 9, 6, np.float64)
        got = plain_decode_attention(q[:, :, None], k, v, scale=0.5)  # [B, H, 1, D]
        expected, _ = reference_attention(q[:, :, None], k, v, scale=0.5)
        self.assertEqual(got.shape, (2, 4, 1, 6))
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)

    def test_rejects_bad_shapes(self) -> None:
        q, k, v = inputs(3, 1, 3, 2, 4, 4, np.float32)  # H = 3 is not a multiple of H_kv = 2
        with self.assertRaises(ValueError):
            plain_decode_attention(q, k, v)
        q, k, v = inputs(3, 1, 2, 1, 4, 4, np.float32)
        with self.assertRaises(ValueError):
            plain_decode_attention(q, k[:, :, :0], v[:, :, :0])  # T = 0
        with self.assertRaises(ValueError):
            plain_decode_attention(q, k.astype(np.float64), v)


class TunedAgainstPlainTest(unittest.TestCase):
    """The tuned kernels (chunked, unrolled, prefetching, fast exp) give the plain kernel's result."""

    def test_contiguous_across_chunks_with_gqa(self) -> None:
        for dtype in DTYPES:
            q, k, v = inputs(4, 2, 8, 2, 2500, 64, dtype)  # T spans three 1024-position chunks
            plain = plain_decode_attention(q, k, v)
            rtol, atol = tolerance_for(dtype, 64 + 2500)
            np.testing.assert_allclose(decode_attention(q, k, v), plain, rtol=rtol, atol=atol)

    def test_paged_in_shuffled_blocks(self) -> None:
        q, k, v = inputs(5, 2, 4, 2, 100, 16, np.float32)
        block_size, per_seq = 16, 7  # 7 blocks of 16 hold 100 positions
        rng = np.random.default_rng(6)
        ids = rng.permutation(2 * per_seq).astype(np.int32)
        tables = ids.reshape(2, per_seq)  # [B, max_blocks]
        padded = np.zeros((2, 2, per_seq * block_size, 16), np.float32)
        caches = []
        for x in (k, v):
            padded[:, :, :100] = x
            blocks = padded.reshape(2, 2, per_seq, block_size, 16).transpose(
                0, 2, 3, 1, 4
            )  # [B, nb, BS, H_kv, D]
            cache = np.zeros((2 * per_seq, block_size, 2, 16), np.float32)  # [NB, BS, H_kv, D]
            cache[tables.reshape(-1)] = blocks.reshape(-1, block_size, 2, 16)
            caches.append(cache)
        lens = np.full(2, 100, np.int32)
        got = paged_decode_attention(q, *pack_kv_blocks(caches[0], caches[1]), tables, lens)
        rtol, atol = tolerance_for(np.float32, 16 + 100)
        np.testing.assert_allclose(got, plain_decode_attention(q, k, v), rtol=rtol, atol=atol)


if __name__ == "__main__":
    unittest.main()
