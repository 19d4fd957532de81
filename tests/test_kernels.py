"""kernels/decode_attention.py against its oracles: the float64 reference, the NumPy SDPA, and the contiguous kernel for
the paged one (shuffled, shared and padded block tables)."""

from __future__ import annotations

import unittest

import numba
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.attention import scaled_dot_product_attention
from attention_kv_caceh.kernels import _decode_attention_paged_jit
from attention_kv_caceh.kernels.decode_attention import (
    CONTIGUOUS_CHUNK,
    compile_seconds,
    decode_attention,
    paged_decode_attention,
    prepare_decode_attention,
    prepare_paged_decode_attention,
)
from attention_kv_caceh.model_executor.paged_attention import allocate_kv_cache, pack_kv_blocks
from attention_kv_caceh.oracle import reference_attention, tolerance_for

DTYPES = (np.float32, np.float64)


def normal(rng: np.random.Generator, *shape: int, dtype: type = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def reference_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """float64 reference for q [B, H, D] over k, v [B, H_kv, T, D] -> [B, H, D]."""
    out, _ = reference_attention(q[:, :, None], k, v)  # [B, H, 1, D]
    return out[:, :, 0]


def to_paged(
    k: np.ndarray, v: np.ndarray, lens: list[int], block_size: int, rng: np.random.Generator, spare: int = 3
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scatter k, v [B, H_kv, T, D] into shuffled blocks of the engine's cache; tables padded with -1."""
    b, h_kv, _, d = k.shape
    per_seq = [-(-n // block_size) for n in lens]
    max_blocks = max(max(per_seq), 1) + 1  # one more column than needed: padding must be ignored
    num_blocks = sum(per_seq) + spare
    ids = rng.permutation(num_blocks).astype(np.int32)
    k_cache = normal(rng, num_blocks, block_size, h_kv, d, dtype=k.dtype.type)  # garbage in unused slots
    v_cache = normal(rng, num_blocks, block_size, h_kv, d, dtype=k.dtype.type)
    tables = np.full((b, max_blocks), -1, dtype=np.int32)
    used = 0
    for i, n in enumerate(lens):
        for j in range(per_seq[i]):
            block = ids[used]
            used += 1
            tables[i, j] = block
            lo, hi = j * block_size, min((j + 1) * block_size, n)
            k_cache[block, : hi - lo] = np.swapaxes(k[i, :, lo:hi], 0, 1)  # [n, H_kv, D]
            v_cache[block, : hi - lo] = np.swapaxes(v[i, :, lo:hi], 0, 1)
    return *pack_kv_blocks(k_cache, v_cache), tables, np.asarray(lens, dtype=np.int32)


class ContiguousKernelTest(unittest.TestCase):
    @settings(max_examples=40, deadline=None)
    @given(
        b=st.integers(1, 3),
        h_kv=st.integers(1, 3),
        group=st.integers(1, 4),
        t=st.integers(1, 150),
        d=st.integers(1, 40),
        dtype=st.sampled_from(DTYPES),
        seed=st.integers(0, 2**16),
    )
    def test_matches_float64_reference_for_random_shapes(
        self, b: int, h_kv: int, group: int, t: int, d: int, dtype: type, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        q = normal(rng, b, h_kv * group, d, dtype=dtype)
        k, v = normal(rng, b, h_kv, t, d, dtype=dtype), normal(rng, b, h_kv, t, d, dtype=dtype)
        out = decode_attention(q, k, v)
        self.assertEqual((out.shape, out.dtype), (q.shape, q.dtype))
        rtol, atol = tolerance_for(dtype, d + t)
        np.testing.assert_allclose(out, reference_rows(q, k, v), rtol=rtol, atol=atol)

    def test_matches_numpy_sdpa_with_gqa_and_4d_query(self) -> None:
        rng = np.random.default_rng(1)
        for dtype in DTYPES:
            q = normal(rng, 2, 8, 1, 17, dtype=dtype)  # [B, H, 1, D], G = 4, odd D
            k, v = normal(rng, 2, 2, 130, 17, dtype=dtype), normal(rng, 2, 2, 130, 17, dtype=dtype)
            expected, _ = scaled_dot_product_attention(q, k, v)
            rtol, atol = tolerance_for(dtype, 17 + 130)
            np.testing.assert_allclose(decode_attention(q, k, v), expected, rtol=rtol, atol=atol)

    def test_long_cache_across_several_chunks(self) -> None:
        rng = np.random.default_rng(8)
        t = 2 * CONTIGUOUS_CHUNK + 37  # two full online-softmax chunks and a partial one
        for dtype in DTYPES:
            q = normal(rng, 1, 4, 3, dtype=dtype) * 3  # larger scores: the running max moves between chunks
            k, v = normal(rng, 1, 2, t, 3, dtype=dtype), normal(rng, 1, 2, t, 3, dtype=dtype)
            rtol, atol = tolerance_for(dtype, 3 + t)
            np.testing.assert_allclose(
                decode_attention(q, k, v), reference_rows(q, k, v), rtol=rtol, atol=atol
            )

    def test_float32_weights_far_below_the_max_match_float64(self) -> None:
        # Large scores put most weights far below the max (the float32 exp polynomial's clamped range);
        # T = one chunk + 13 leaves a partial chunk and a partial group of eight V rows; G = 3.
        rng = np.random.default_rng(10)
        t, d = CONTIGUOUS_CHUNK + 13, 64
        q = normal(rng, 2, 6, d) * 20  # scores of order +-160
        k, v = normal(rng, 2, 2, t, d), normal(rng, 2, 2, t, d)
        rtol, atol = tolerance_for(np.float32, d + t)
        np.testing.assert_allclose(decode_attention(q, k, v), reference_rows(q, k, v), rtol=rtol, atol=atol)

    def test_strided_cache_view_gives_the_contiguous_result(self) -> None:
        rng = np.random.default_rng(2)
        q = normal(rng, 3, 4, 16)
        k_buf, v_buf = normal(rng, 3, 2, 200, 16), normal(rng, 3, 2, 200, 16)  # [B, H_kv, T_max, D]
        k, v = k_buf[:, :, :77], v_buf[:, :, :77]  # the views a PreallocatedKVCache returns
        self.assertFalse(k.flags.c_contiguous)
        expected = decode_attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v))
        # Numba compiles the strided layout separately (other vector code): equal within rounding.
        rtol, atol = tolerance_for(np.float32, 16 + 77)
        np.testing.assert_allclose(decode_attention(q, k, v), expected, rtol=rtol, atol=atol)
        np.testing.assert_allclose(decode_attention(q, k, v), reference_rows(q, k, v), rtol=rtol, atol=atol)

    def test_sequences_and_heads_do_not_mix(self) -> None:
        rng = np.random.default_rng(3)
        q = normal(rng, 3, 4, 8, dtype=np.float64)
        k, v = normal(rng, 3, 2, 40, 8, dtype=np.float64), normal(rng, 3, 2, 40, 8, dtype=np.float64)
        out = decode_attention(q, k, v)
        for i in range(3):
            for h in range(4):
                alone = decode_attention(
                    q[i : i + 1, h : h + 1],
                    k[i : i + 1, h // 2 : h // 2 + 1],
                    v[i : i + 1, h // 2 : h // 2 + 1],
                )
                np.testing.assert_allclose(out[i, h], alone[0, 0], rtol=1e-13, atol=1e-13)

    def test_large_scores_do_not_overflow(self) -> None:
        q = np.full((1, 1, 4), 100.0, dtype=np.float32)
        k = np.zeros((1, 1, 3, 4), dtype=np.float32)
        k[0, 0, 1] = 100.0  # score 2e4 / sqrt(4) = 1e4 against 0: all weight on position 1
        v = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
        np.testing.assert_allclose(decode_attention(q, k, v)[0, 0], v[0, 0, 1])

    def test_writes_into_given_out_and_honours_scale(self) -> None:
        rng = np.random.default_rng(4)
        q, k, v = normal(rng, 2, 2, 8), normal(rng, 2, 1, 30, 8), normal(rng, 2, 1, 30, 8)
        out = np.empty_like(q)
        self.assertIs(decode_attention(q, k, v, out=out, scale=0.3), out)
        expected, _ = reference_attention(q[:, :, None], k, v, scale=0.3)
        rtol, atol = tolerance_for(np.float32, 38)
        np.testing.assert_allclose(out, expected[:, :, 0], rtol=rtol, atol=atol)

    @unittest.skipUnless(int(numba.config.NUMBA_NUM_THREADS) >= 2, "needs two Numba threads")  # pyright: ignore
    def test_two_threads_equal_one_thread(self) -> None:
        rng = np.random.default_rng(5)
        q, k, v = normal(rng, 3, 4, 24), normal(rng, 3, 2, 90, 24), normal(rng, 3, 2, 90, 24)
        np.testing.assert_array_equal(decode_attention(q, k, v, threads=2), decode_attention(q, k, v))

    def test_rejects_bad_input_naming_it(self) -> None:
        q, k = np.zeros((2, 4, 8), np.float32), np.zeros((2, 2, 5, 8), np.float32)
        cases = {
            "k has dtype float64": (q, k.astype(np.float64), k),
            "float32 or float64": (q.astype(np.int32), k, k),
            "multiple of H_kv": (np.zeros((2, 3, 8), np.float32), k, k),
            "disagree on B or D": (np.zeros((2, 4, 6), np.float32), k, k),
            "at least one position": (q, k[:, :, :0], k[:, :, :0]),
            "[B, H, D] or [B, H, 1, D]": (q[0], k, k),
            "both be [B, H_kv, T, D]": (q, k, k[:, :, :3]),
        }
        for message, (qq, kk, vv) in cases.items():
            with self.subTest(message), self.assertRaisesRegex(ValueError, message.replace("[", r"\[")):
                decode_attention(qq, kk, vv)
        with self.assertRaisesRegex(ValueError, "must not overlap"):
            decode_attention(q, k, k, out=q)
        with self.assertRaisesRegex(ValueError, "threads must be in"):
            decode_attention(q, k, k, threads=0)

    def test_prepare_records_the_first_call(self) -> None:
        q, k = np.zeros((1, 1, 4)), np.zeros((1, 1, 3, 4))
        out = np.empty_like(q)
        seconds = prepare_decode_attention(q, k, k, out)
        self.assertGreater(seconds, 0.0)
        self.assertEqual(compile_seconds()["contiguous/float64/C/threads=1"], seconds)
        self.assertEqual(prepare_decode_attention(q, k, k, out), seconds)  # the first call's time is kept
        np.testing.assert_array_equal(out, 0.0)  # zero values give a zero output


class PagedKernelTest(unittest.TestCase):
    @settings(max_examples=40, deadline=None)
    @given(
        lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
        h_kv=st.integers(1, 2),
        group=st.integers(1, 3),
        d=st.integers(1, 20),
        block_size=st.sampled_from((1, 3, 16)),
        dtype=st.sampled_from(DTYPES),
        seed=st.integers(0, 2**16),
    )
    def test_equals_contiguous_kernel_for_shuffled_blocks(
        self, lens: list[int], h_kv: int, group: int, d: int, block_size: int, dtype: type, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        b, t = len(lens), max(lens)
        q = normal(rng, b, h_kv * group, d, dtype=dtype)
        k, v = normal(rng, b, h_kv, t, d, dtype=dtype), normal(rng, b, h_kv, t, d, dtype=dtype)
        k_cache, v_cache, tables, context_lens = to_paged(k, v, lens, block_size, rng)
        out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens)
        rtol, atol = tolerance_for(dtype, d + t)
        for i, n in enumerate(lens):  # each sequence against its own contiguous prefix
            expected = decode_attention(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n])
            np.testing.assert_allclose(out[i], expected[0], rtol=rtol, atol=atol)
            np.testing.assert_allclose(
                out[i],
                reference_rows(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n])[0],
                rtol=rtol,
                atol=atol,
            )

    def test_long_sequences_across_several_spans(self) -> None:
        rng = np.random.default_rng(9)
        lens = [2 * CONTIGUOUS_CHUNK + 37, 5, CONTIGUOUS_CHUNK]
        k, v = normal(rng, 3, 2, max(lens), 4), normal(rng, 3, 2, max(lens), 4)
        q = normal(rng, 3, 2, 4) * 3
        for block_size in (16, 2 * CONTIGUOUS_CHUNK - 1):  # many blocks per span; one block per span
            with self.subTest(block_size=block_size):
                k_cache, v_cache, tables, context_lens = to_paged(k, v, lens, block_size, rng)
                out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens)
                for i, n in enumerate(lens):
                    expected = reference_rows(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n])
                    rtol, atol = tolerance_for(np.float32, 4 + n)
                    np.testing.assert_allclose(out[i], expected[0], rtol=rtol, atol=atol)

    def test_block_sizes_one_and_2047_with_gqa(self) -> None:
        # The K pass prefetches rows ahead, across block ends into the table's next block: with one
        # position per block every prefetch lands in a later block; with 2047 a sequence ends mid-block.
        rng = np.random.default_rng(11)
        lens = [2100, 1, 700]
        for dtype in DTYPES:
            k, v = (
                normal(rng, 3, 2, max(lens), 24, dtype=dtype),
                normal(rng, 3, 2, max(lens), 24, dtype=dtype),
            )
            q = normal(rng, 3, 6, 24, dtype=dtype) * 2  # G = 3
            for block_size in (1, 2047):
                with self.subTest(dtype=dtype, block_size=block_size):
                    k_cache, v_cache, tables, context_lens = to_paged(k, v, lens, block_size, rng)
                    out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens)
                    for i, n in enumerate(lens):
                        expected = reference_rows(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n])
                        rtol, atol = tolerance_for(dtype, 24 + n)
                        np.testing.assert_allclose(out[i], expected[0], rtol=rtol, atol=atol)

    @settings(max_examples=25, deadline=None)
    @given(
        lens=st.lists(st.integers(0, 70), min_size=1, max_size=3),
        h_kv=st.integers(1, 2),
        group=st.integers(1, 6),  # folded in chunks of up to four query heads
        d=st.sampled_from((64, 128)),
        seed=st.integers(0, 2**16),
    )
    def test_vectorised_kernel_at_the_engines_shapes_equals_the_reference(
        self, lens: list[int], h_kv: int, group: int, d: int, seed: int
    ) -> None:
        # Block size 16 and D 64 or 128 take the LLVM IR kernel (`_decode_attention_paged_jit._fold_block`); partial
        # last blocks, empty contexts and every chunk of query heads with them.
        rng = np.random.default_rng(seed)
        b, t = len(lens), max(max(lens), 1)
        q = normal(rng, b, h_kv * group, d) * 3
        k, v = normal(rng, b, h_kv, t, d), normal(rng, b, h_kv, t, d)
        k_cache, v_cache, tables, context_lens = to_paged(k, v, lens, 16, rng)
        self.assertGreaterEqual(_decode_attention_paged_jit.fast_shape(np.float32, d, 16, True), 0)
        out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens)
        for i, n in enumerate(lens):
            if n == 0:
                np.testing.assert_array_equal(out[i], 0.0)
                continue
            expected = reference_rows(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n])
            rtol, atol = tolerance_for(np.float32, d + n)
            np.testing.assert_allclose(out[i], expected[0], rtol=rtol, atol=atol)

    def test_shared_prefix_blocks_and_empty_sequence(self) -> None:
        rng = np.random.default_rng(6)
        k_cache, v_cache = normal(rng, 5, 4, 1, 8), normal(rng, 5, 4, 1, 8)
        tables = np.array([[3, 1, -1], [3, 0, 4], [-1, -1, -1]], dtype=np.int32)  # block 3 shared
        lens = np.array([6, 11, 0], dtype=np.int32)
        q = normal(rng, 3, 2, 8)
        out = paged_decode_attention(q, *pack_kv_blocks(k_cache, v_cache), tables, lens)
        for i in range(2):
            rows = [(blk, j) for blk in tables[i] if blk >= 0 for j in range(4)][: lens[i]]
            k = np.stack([k_cache[blk, j, 0] for blk, j in rows])[None, None]  # [1, 1, T, D]
            v = np.stack([v_cache[blk, j, 0] for blk, j in rows])[None, None]
            rtol, atol = tolerance_for(np.float32, 8 + int(lens[i]))
            np.testing.assert_allclose(out[i], reference_rows(q[i : i + 1], k, v)[0], rtol=rtol, atol=atol)
        np.testing.assert_array_equal(out[2], 0.0)

    @unittest.skipUnless(int(numba.config.NUMBA_NUM_THREADS) >= 2, "needs two Numba threads")  # pyright: ignore
    def test_two_threads_equal_one_thread(self) -> None:
        rng = np.random.default_rng(7)
        k, v = normal(rng, 3, 2, 50, 16), normal(rng, 3, 2, 50, 16)
        k_cache, v_cache, tables, lens = to_paged(k, v, [50, 17, 33], 16, rng)
        q = normal(rng, 3, 4, 16)
        one = paged_decode_attention(q, k_cache, v_cache, tables, lens)
        np.testing.assert_array_equal(
            paged_decode_attention(q, k_cache, v_cache, tables, lens, threads=2), one
        )

    def test_rejects_bad_tables_and_lengths(self) -> None:
        k_cache, v_cache = allocate_kv_cache(4, 2, 1, 8, np.float32)
        q = np.zeros((2, 1, 8), np.float32)
        good_tables, good_lens = np.array([[0, 1], [2, 3]], np.int32), np.array([3, 4], np.int32)
        cases = {
            "outside \\[0, NB=4\\)": (np.array([[0, 4], [2, 3]], np.int32), good_lens),
            "block id -1": (np.array([[0, -1], [2, 3]], np.int32), good_lens),
            "must be in \\[0, max_blocks": (good_tables, np.array([3, 5], np.int32)),
            "context_lens must be int32": (good_tables, good_lens.astype(np.int64)),
            "block_tables must be int32": (good_tables.astype(np.int64), good_lens),
        }
        for message, (tables, lens) in cases.items():
            with self.subTest(message), self.assertRaisesRegex(ValueError, message):
                paged_decode_attention(q, k_cache, v_cache, tables, lens)
        with self.assertRaisesRegex(ValueError, r"v_cache \(4, 1, 8, 2\)"):
            paged_decode_attention(q, k_cache, k_cache, good_tables, good_lens)
        # -1 padding past a sequence's last block is fine:
        ok = paged_decode_attention(
            q, k_cache, v_cache, np.array([[0, -1], [2, 3]], np.int32), np.array([2, 4], np.int32)
        )
        np.testing.assert_array_equal(ok, 0.0)

    def test_prepare_records_the_first_call(self) -> None:
        k_cache, v_cache = allocate_kv_cache(2, 4, 1, 8, np.float32)  # views: layout "A"
        q, out = np.zeros((1, 1, 8), np.float32), np.empty((1, 1, 8), np.float32)
        tables, lens = np.array([[1, 0]], np.int32), np.array([5], np.int32)
        seconds = prepare_paged_decode_attention(q, k_cache, v_cache, tables, lens, out)
        self.assertEqual(compile_seconds()["paged/float32/A/threads=1"], seconds)


if __name__ == "__main__":
    unittest.main()
