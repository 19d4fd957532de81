"""gemm.py against its oracle, NumPy's x @ W.T in float64: every tile height, padded panels, strided x."""

from __future__ import annotations

import unittest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.gemm import (
    PANEL_WIDTH,
    fma_probe,
    pack_weight,
    packed_linear,
    packed_linear_into,
    unpack_weight,
)
from attention_kv_caceh.oracle import tolerance_for


class PackedLinearTest(unittest.TestCase):
    @settings(max_examples=40, deadline=None)
    @given(
        m=st.integers(1, 80),  # past the 64-row chunk, every remainder of 8
        n=st.integers(1, 3 * PANEL_WIDTH + 5),
        k=st.integers(1, 70),
        seed=st.integers(0, 2**16),
    )
    def test_equals_the_float64_product(self, m: int, n: int, k: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = packed_linear(x, pack_weight(w))
        self.assertEqual((got.shape, got.dtype), ((m, n), np.dtype(np.float32)))
        self.assertTrue(got.flags.c_contiguous)
        want = x.astype(np.float64) @ w.astype(np.float64).T
        rtol, atol = tolerance_for(np.float32, k)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * np.sqrt(k))

    def test_pack_and_unpack_round_trip_and_padding_is_zero(self) -> None:
        w = np.arange(5 * PANEL_WIDTH // 2 * 3, dtype=np.float32).reshape(-1, 3)  # N = 2.5 panels
        packed = pack_weight(w)
        self.assertEqual(packed.panels.shape, (3, 3, PANEL_WIDTH))
        np.testing.assert_array_equal(unpack_weight(packed), w)
        np.testing.assert_array_equal(packed.panels[2, :, PANEL_WIDTH // 2 :], 0.0)
        self.assertEqual((packed.out_features, packed.in_features), w.shape)

    def test_strided_rows_of_x_are_read_in_place(self) -> None:
        rng = np.random.default_rng(1)
        w = rng.standard_normal((PANEL_WIDTH, 16)).astype(np.float32)
        wide = rng.standard_normal((11, 40)).astype(np.float32)
        x = wide[:, 3:19]  # [11, 16], rows 40 floats apart
        out = np.empty((11, PANEL_WIDTH), dtype=np.float32)
        packed_linear_into(x, pack_weight(w), out)
        np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)

    def test_refuses_other_dtypes_and_shapes_naming_them(self) -> None:
        packed = pack_weight(np.ones((4, 3), dtype=np.float32))
        with self.assertRaisesRegex(ValueError, "float64"):
            pack_weight(np.ones((4, 3)))
        with self.assertRaisesRegex(ValueError, r"\(0, 3\)"):
            pack_weight(np.ones((0, 3), dtype=np.float32))
        with self.assertRaisesRegex(ValueError, "float64"):
            packed_linear(np.ones((2, 3)), packed)
        with self.assertRaisesRegex(ValueError, r"\(2, 4\)"):
            packed_linear(np.ones((2, 4), dtype=np.float32), packed)


class FmaProbeTest(unittest.TestCase):
    def test_reports_a_positive_rate_and_refuses_no_time(self) -> None:
        self.assertGreater(fma_probe(0.001), 0.0)
        with self.assertRaises(ValueError):
            fma_probe(0.0)


if __name__ == "__main__":
    unittest.main()
