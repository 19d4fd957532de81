"""attention.py against its oracles: float64 references, per-sequence loops, full recompute, GQA repeat."""

from __future__ import annotations

import unittest
import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.attention import (
    causal_mask,
    decode_step,
    scaled_dot_product_attention,
    softmax,
)
from attention_kv_caceh.oracle import reference_attention, repeat_kv, tolerance_for

RNG_SEED = 1234


def normal(rng: np.random.Generator, *shape: int, dtype: type = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


class SoftmaxTest(unittest.TestCase):
    def test_rows_sum_to_one_and_match_definition(self) -> None:
        x = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
        expected = np.exp(x) / np.exp(x).sum(axis=-1, keepdims=True)
        np.testing.assert_allclose(softmax(x), expected, rtol=1e-12)

    def test_large_logits_do_not_overflow(self) -> None:
        x = np.array([1e4, 1e4 - 1.0, -1e4], dtype=np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = softmax(x)
        e = 1.0 / (1.0 + np.exp(-1.0))
        np.testing.assert_allclose(y, [e, 1 - e, 0.0], rtol=1e-6, atol=1e-7)

    def test_all_neg_inf_slice_gives_zeros_without_warning(self) -> None:
        x = np.array([[-np.inf, -np.inf], [0.0, -np.inf]], dtype=np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = softmax(x)
        np.testing.assert_array_equal(y, [[0.0, 0.0], [1.0, 0.0]])
        self.assertFalse(np.isnan(y).any())

    def test_keeps_dtype(self) -> None:
        for dtype in (np.float32, np.float64):
            self.assertEqual(softmax(np.zeros((2, 3), dtype=dtype)).dtype, dtype)

    def test_axis_matters(self) -> None:
        x = np.array([[1.0, 2.0], [3.0, 5.0]])
        np.testing.assert_allclose(softmax(x, axis=0).sum(axis=0), [1.0, 1.0])
        self.assertFalse(np.allclose(softmax(x, axis=0), softmax(x, axis=-1)))

    def test_integer_input_is_rejected(self) -> None:
        with self.assertRaisesRegex(ValueError, "int64"):
            softmax(np.arange(4))

    def test_axis_out_of_range(self) -> None:
        with self.assertRaisesRegex(ValueError, "axis 2"):
            softmax(np.zeros((2, 2)), axis=2)


class SoftmaxEdgeCaseTest(unittest.TestCase):
    """What softmax returns for float16, empty slices and slices without a defined softmax."""

    def test_float16_is_computed_in_float32_and_correctly_rounded(self) -> None:
        # Within one float16 eps of the float64 softmax of the same (float16) logits; computing in
        # float16 itself is off by about 4 eps on these rows.
        eps = float(np.finfo(np.float16).eps)
        tiny = float(np.finfo(np.float16).smallest_normal)
        rng = np.random.default_rng(RNG_SEED)
        x = (rng.standard_normal((32, 2000)) * 3).astype(np.float16)
        x64 = x.astype(np.float64)
        ref = np.exp(x64 - x64.max(axis=-1, keepdims=True))
        ref /= ref.sum(axis=-1, keepdims=True)
        y = softmax(x)
        self.assertEqual(y.dtype, np.float16)
        err = np.abs(y.astype(np.float64) - ref) / (ref + tiny)
        self.assertLessEqual(float(err.max()), eps)

    def test_float16_masked_rows_are_zero_and_large_logits_finite(self) -> None:
        x = np.array([[-np.inf, -np.inf, -np.inf], [6e4, 6e4, -6e4]], dtype=np.float16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = softmax(x)
        self.assertEqual(y.dtype, np.float16)
        np.testing.assert_array_equal(y, [[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])

    def test_empty_slice_gives_empty_result(self) -> None:
        for dtype in (np.float16, np.float32, np.float64):
            y = softmax(np.zeros((3, 0), dtype=dtype))
            self.assertEqual((y.shape, y.dtype), ((3, 0), dtype))
        self.assertEqual(softmax(np.zeros((0, 4), np.float32)).shape, (0, 4))

    def test_slice_with_nan_or_pos_inf_is_all_nan_and_others_unaffected(self) -> None:
        x = np.array([[np.inf, 0.0, 1.0], [np.nan, 0.0, 1.0], [0.0, 0.0, -np.inf]], dtype=np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = softmax(x)
        self.assertTrue(np.isnan(y[:2]).all())
        np.testing.assert_array_equal(y[2], [0.5, 0.5, 0.0])

    def test_zero_dim_input_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "axis"):
            softmax(np.float32(1.0), axis=0)  # type: ignore[arg-type]


class CausalMaskTest(unittest.TestCase):
    def test_bottom_right_alignment(self) -> None:
        # Two queries at the end of four keys: query 0 sees keys 0..2, query 1 sees all four.
        np.testing.assert_array_equal(
            causal_mask(2, 4), [[True, True, True, False], [True, True, True, True]]
        )

    def test_square_is_lower_triangular(self) -> None:
        np.testing.assert_array_equal(causal_mask(3, 3), np.tril(np.ones((3, 3), dtype=bool)))


class ScaledDotProductAttentionTest(unittest.TestCase):
    def setUp(self) -> None:
        self.rng = np.random.default_rng(RNG_SEED)

    def assert_matches_reference(self, q, k, v, **kwargs) -> None:  # type: ignore[no-untyped-def]
        out, w = scaled_dot_product_attention(q, k, v, **kwargs)
        ref_out, ref_w = reference_attention(q, k, v, **kwargs)
        rtol, atol = tolerance_for(q.dtype, q.shape[-1] + k.shape[-2])
        np.testing.assert_allclose(out, ref_out, rtol=rtol, atol=atol)
        np.testing.assert_allclose(w, ref_w, rtol=rtol, atol=atol)
        self.assertEqual(out.dtype, q.dtype)
        self.assertEqual(w.dtype, q.dtype)

    def test_float32_and_float64_against_reference(self) -> None:
        for dtype in (np.float32, np.float64):
            q = normal(self.rng, 2, 3, 5, 8, dtype=dtype)
            k = normal(self.rng, 2, 3, 7, 8, dtype=dtype)
            v = normal(self.rng, 2, 3, 7, 4, dtype=dtype)
            self.assert_matches_reference(q, k, v)
            self.assert_matches_reference(q, k, v, is_causal=True)

    def test_float32_stays_float32_with_float64_scale(self) -> None:
        q = normal(self.rng, 1, 1, 4)
        out, w = scaled_dot_product_attention(q, q, q, scale=float(np.float64(0.5)))
        self.assertEqual((out.dtype, w.dtype), (np.float32, np.float32))

    def test_long_cache_streaming_path_against_reference(self) -> None:
        # Tk * D >= 2**17 switches the products to the streaming kernels (vecdot / einsum).
        q = normal(self.rng, 1, 2, 1, 64)
        k = normal(self.rng, 1, 2, 2100, 64)
        v = normal(self.rng, 1, 2, 2100, 64)
        self.assert_matches_reference(q, k, v)
        q4 = normal(self.rng, 1, 4, 1, 64)  # GQA, G = 2 rows per KV head: einsum path
        self.assert_matches_reference(q4, k, v)

    def test_gqa_equals_explicitly_repeated_kv(self) -> None:
        b, h, h_kv, tq, tk, d = 2, 8, 2, 3, 6, 16
        q = normal(self.rng, b, h, tq, d)
        k = normal(self.rng, b, h_kv, tk, d)
        v = normal(self.rng, b, h_kv, tk, d)
        out, w = scaled_dot_product_attention(q, k, v, is_causal=True)
        out_rep, w_rep = scaled_dot_product_attention(
            q, repeat_kv(k, h // h_kv), repeat_kv(v, h // h_kv), is_causal=True
        )
        np.testing.assert_allclose(out, out_rep, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(w, w_rep, rtol=1e-6, atol=1e-6)
        self.assert_matches_reference(q, k, v)
        # Head h reads KV head h // G: head 3 with G = 4 reads KV head 0, head 4 reads KV head 1.
        single, _ = scaled_dot_product_attention(q[:, 4:5], k[:, 1:2], v[:, 1:2], is_causal=True)
        np.testing.assert_allclose(out[:, 4:5], single, rtol=1e-6, atol=1e-6)

    def test_boolean_mask(self) -> None:
        q = normal(self.rng, 2, 1, 3, 4)
        k = normal(self.rng, 2, 1, 5, 4)
        v = normal(self.rng, 2, 1, 5, 4)
        mask = self.rng.random((2, 1, 3, 5)) > 0.3
        mask[..., 0] = True
        self.assert_matches_reference(q, k, v, mask=mask)
        _, w = scaled_dot_product_attention(q, k, v, mask=mask)
        self.assertTrue(np.all(w[~mask] == 0))

    def test_fully_masked_row_gives_zero_output(self) -> None:
        q = normal(self.rng, 1, 2, 4)
        k = normal(self.rng, 1, 3, 4)
        mask = np.array([[True, True, True], [False, False, False]])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, w = scaled_dot_product_attention(q, k, k, mask=mask)
        np.testing.assert_array_equal(out[0, 1], 0.0)
        np.testing.assert_array_equal(w[0, 1], 0.0)

    def test_batch_elements_do_not_mix(self) -> None:
        q = normal(self.rng, 4, 2, 1, 8)
        k = normal(self.rng, 4, 2, 9, 8)
        v = normal(self.rng, 4, 2, 9, 8)
        out, _ = scaled_dot_product_attention(q, k, v)
        for i in range(4):
            single, _ = scaled_dot_product_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1])
            np.testing.assert_allclose(out[i : i + 1], single, rtol=1e-6, atol=1e-7)

    def test_bad_inputs_raise_value_error_naming_shapes(self) -> None:
        f = np.zeros((2, 4, 3, 8), dtype=np.float32)
        cases = [
            ((f, np.zeros((2, 4, 3, 7), np.float32), f), r"head dims differ.*\(2, 4, 3, 7\)"),
            ((f, np.zeros((3, 4, 3, 8), np.float32), np.zeros((3, 4, 3, 8), np.float32)), "batch dims"),
            ((f, np.zeros((2, 3, 3, 8), np.float32), np.zeros((2, 3, 3, 8), np.float32)), "H=4.*H_kv=3"),
            ((f, f, np.zeros((2, 4, 5, 8), np.float32)), "k and v"),
            ((np.zeros((2, 4, 3, 8), np.int64), f, f), "int64"),
            ((f, f.astype(np.float64), f), "share a dtype"),
            ((np.zeros(8, np.float32), f, f), "at least 2 dims"),
        ]
        for args, pattern in cases:
            with self.subTest(pattern=pattern), self.assertRaisesRegex(ValueError, pattern):
                scaled_dot_product_attention(*args)
        with self.assertRaisesRegex(ValueError, "boolean"):
            scaled_dot_product_attention(f, f, f, mask=np.ones((3, 3)))
        with self.assertRaisesRegex(ValueError, "does not broadcast"):
            scaled_dot_product_attention(f, f, f, mask=np.ones((5, 3), dtype=bool))

    @settings(max_examples=60, deadline=None)
    @given(
        b=st.integers(1, 3),
        h_kv=st.integers(1, 3),
        g=st.integers(1, 3),
        tq=st.integers(1, 4),
        extra=st.integers(0, 6),
        d=st.integers(1, 9),
        causal=st.booleans(),
        seed=st.integers(0, 2**31 - 1),
    )
    def test_property_matches_float64_reference(
        self, b: int, h_kv: int, g: int, tq: int, extra: int, d: int, causal: bool, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        tk = tq + extra
        q = normal(rng, b, h_kv * g, tq, d)
        k = normal(rng, b, h_kv, tk, d)
        v = normal(rng, b, h_kv, tk, d)
        self.assert_matches_reference(q, k, v, is_causal=causal)


class AttentionEdgeCaseTest(unittest.TestCase):
    """No keys, a zero head dim, float16 logits past float16's range, array-like inputs."""

    def setUp(self) -> None:
        self.rng = np.random.default_rng(RNG_SEED)

    def test_no_keys_gives_zero_output_and_empty_weights(self) -> None:
        for h_kv, causal in ((3, False), (1, False), (3, True)):
            q = normal(self.rng, 2, 3, 4, 8)
            k = np.zeros((2, h_kv, 0, 8), np.float32)
            v = np.zeros((2, h_kv, 0, 5), np.float32)
            with self.subTest(h_kv=h_kv, causal=causal), warnings.catch_warnings():
                warnings.simplefilter("error")
                out, w = scaled_dot_product_attention(q, k, v, is_causal=causal)
                self.assertEqual((out.shape, w.shape), ((2, 3, 4, 5), (2, 3, 4, 0)))
                np.testing.assert_array_equal(out, 0.0)
                self.assertEqual((out.dtype, w.dtype), (np.float32, np.float32))

    def test_zero_head_dim_is_refused(self) -> None:
        q = np.zeros((1, 2, 3, 0), np.float32)
        k = np.zeros((1, 2, 4, 0), np.float32)
        v = normal(self.rng, 1, 2, 4, 5)
        with self.assertRaisesRegex(ValueError, r"D_k >= 1.*\(1, 2, 3, 0\)"):
            scaled_dot_product_attention(q, k, v)

    def test_float16_logits_beyond_float16_range_match_reference(self) -> None:
        # |q . k| / sqrt(D) reaches about 1.6e5 here, past float16's largest finite value (65504):
        # computed in float16 the scores overflow to inf and the softmax gives NaN.
        d = 16
        q = (normal(self.rng, 2, 2, 3, d) * 200).astype(np.float16)
        k = (normal(self.rng, 2, 2, 6, d) * 200).astype(np.float16)
        v = normal(self.rng, 2, 2, 6, d, dtype=np.float16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, w = scaled_dot_product_attention(q, k, v)
        self.assertEqual((out.dtype, w.dtype), (np.float16, np.float16))
        self.assertTrue(np.isfinite(out).all() and np.isfinite(w).all())
        ref_out, ref_w = reference_attention(q, k, v)
        rtol, atol = tolerance_for(np.float16, d + 6)
        np.testing.assert_allclose(out, ref_out, rtol=rtol, atol=atol)
        np.testing.assert_allclose(w, ref_w, rtol=rtol, atol=atol)

    def test_float16_matches_float32_computation_cast_to_float16(self) -> None:
        q, k, v = (normal(self.rng, 1, 4, 3, 8, dtype=np.float16) for _ in range(3))
        out16, w16 = scaled_dot_product_attention(q, k, v, is_causal=True)
        out32, w32 = scaled_dot_product_attention(
            q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), is_causal=True
        )
        np.testing.assert_array_equal(out16, out32.astype(np.float16))
        np.testing.assert_array_equal(w16, w32.astype(np.float16))

    def test_lists_are_converted(self) -> None:
        q, k, v = (normal(self.rng, 2, 3, 4, dtype=np.float64) for _ in range(3))
        want = scaled_dot_product_attention(q, k, v)
        got = scaled_dot_product_attention(q.tolist(), k.tolist(), v.tolist())  # type: ignore[arg-type]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        with self.assertRaisesRegex(ValueError, "q cannot be converted"):
            scaled_dot_product_attention([[1.0], [1.0, 2.0]], k, v)  # type: ignore[arg-type]


class DecodeStepTest(unittest.TestCase):
    """The lab's first single-head decode_step (Dynamic Cache by np.concatenate)."""

    def setUp(self) -> None:
        rng = np.random.default_rng(RNG_SEED)
        self.b, self.t, self.d_model, self.d_k, self.d_v = 3, 6, 12, 8, 5
        self.x = normal(rng, self.b, self.t, self.d_model)
        self.w_q = normal(rng, self.d_model, self.d_k)
        self.w_k = normal(rng, self.d_model, self.d_k)
        self.w_v = normal(rng, self.d_model, self.d_v)

    def run_steps(self, x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        b = x.shape[0]
        k_cache = np.zeros((b, 0, self.d_k), np.float32)
        v_cache = np.zeros((b, 0, self.d_v), np.float32)
        outputs = []
        for t in range(x.shape[1]):
            out, w, k_cache, v_cache = decode_step(
                x[:, t : t + 1, :], self.w_q, self.w_k, self.w_v, k_cache, v_cache
            )
            self.assertEqual(out.shape, (b, 1, self.d_v))
            self.assertEqual(w.shape, (b, 1, t + 1))
            self.assertEqual(k_cache.shape, (b, t + 1, self.d_k))
            outputs.append(out)
        return outputs, k_cache, v_cache

    def test_t_steps_equal_causal_attention_over_the_whole_sequence(self) -> None:
        outputs, _, _ = self.run_steps(self.x)
        q, k, v = self.x @ self.w_q, self.x @ self.w_k, self.x @ self.w_v  # [B, T, D]
        full, _ = scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, T, D_v]
        ref, _ = reference_attention(q, k, v, is_causal=True)
        rtol, atol = tolerance_for(np.float32, self.d_k + self.t)
        for t, out in enumerate(outputs):
            np.testing.assert_allclose(out[:, 0], full[:, t], rtol=rtol, atol=atol, err_msg=f"t={t}")
            np.testing.assert_allclose(out[:, 0], ref[:, t], rtol=rtol, atol=atol, err_msg=f"t={t}")

    def test_batched_equals_one_sequence_at_a_time(self) -> None:
        batched, _, _ = self.run_steps(self.x)
        for i in range(self.b):
            single, _, _ = self.run_steps(self.x[i : i + 1])
            for t in range(self.t):
                np.testing.assert_allclose(batched[t][i : i + 1], single[t], rtol=1e-6, atol=1e-6)

    def test_input_caches_are_not_modified(self) -> None:
        k_cache = np.ones((self.b, 2, self.d_k), np.float32)
        v_cache = np.ones((self.b, 2, self.d_v), np.float32)
        _, _, k2, _ = decode_step(self.x[:, :1], self.w_q, self.w_k, self.w_v, k_cache, v_cache)
        np.testing.assert_array_equal(k_cache, 1.0)
        self.assertFalse(np.shares_memory(k2, k_cache))

    def test_shape_errors_name_the_shape(self) -> None:
        x_t = self.x[:, :1]
        k0 = np.zeros((self.b, 0, self.d_k), np.float32)
        v0 = np.zeros((self.b, 0, self.d_v), np.float32)
        with self.assertRaisesRegex(ValueError, r"x_t must be \[B, 1, D_model\].*\(3, 6, 12\)"):
            decode_step(self.x, self.w_q, self.w_k, self.w_v, k0, v0)
        with self.assertRaisesRegex(ValueError, r"k_cache must be \[B=3"):
            decode_step(x_t, self.w_q, self.w_k, self.w_v, np.zeros((2, 0, self.d_k), np.float32), v0)
        with self.assertRaisesRegex(ValueError, r"w_k must be \[D_model=12"):
            decode_step(x_t, self.w_q, self.w_k.T.copy(), self.w_v, k0, v0)
        with self.assertRaisesRegex(ValueError, "share one dtype"):
            decode_step(x_t.astype(np.float64), self.w_q, self.w_k, self.w_v, k0, v0)


if __name__ == "__main__":
    unittest.main()
