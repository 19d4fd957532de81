"""oracle.py: the references themselves must catch the errors they exist for."""

from __future__ import annotations

import unittest

import numpy as np

from attention_kv_caceh.oracle import (
    OracleMismatch,
    check_close,
    check_decode_batch,
    reference_attention,
    tolerance_for,
)


class OracleTest(unittest.TestCase):
    def test_tolerance_values_documented(self) -> None:
        rtol, atol = tolerance_for(np.float32, 64 + 128)
        self.assertAlmostEqual(rtol, 16 * 2.0**-23 * 192**0.5)
        self.assertEqual(rtol, atol)
        self.assertLess(tolerance_for(np.float64, 192)[0], 1e-13)

    def test_check_close_names_the_worst_element(self) -> None:
        expected = np.zeros((2, 3))
        actual = expected.copy()
        actual[1, 2] = 1e-3
        with self.assertRaisesRegex(OracleMismatch, r"index \(1, 2\)"):
            check_close(actual, expected, rtol=1e-6, atol=1e-6)
        with self.assertRaisesRegex(OracleMismatch, "shape"):
            check_close(actual[:1], expected, rtol=1e-6, atol=1e-6)
        with self.assertRaisesRegex(OracleMismatch, "NaN"):
            check_close(np.full((2, 3), np.nan), expected, rtol=1, atol=1)
        check_close(actual, expected, rtol=0, atol=1e-3)  # within tolerance: no error

    def test_reference_is_the_definition(self) -> None:
        q = np.array([[[1.0, 0.0]]])  # [1, 1, 2]
        k = np.array([[[1.0, 0.0], [0.0, 1.0]]])  # [1, 2, 2]
        v = np.array([[[1.0], [3.0]]])  # [1, 2, 1]
        out, w = reference_attention(q, k, v, scale=1.0)
        e = np.exp(1.0)
        np.testing.assert_allclose(w[0, 0], [e / (e + 1), 1 / (e + 1)])
        np.testing.assert_allclose(out[0, 0, 0], (e + 3) / (e + 1))

    def test_decode_check_catches_softmax_over_the_batch_axis(self) -> None:
        rng = np.random.default_rng(0)
        q = rng.standard_normal((3, 2, 1, 4)).astype(np.float32)
        k = rng.standard_normal((3, 2, 5, 4)).astype(np.float32)
        v = rng.standard_normal((3, 2, 5, 4)).astype(np.float32)
        scores = np.einsum("bhqd,bhtd->bhqt", q, k) / 2.0
        wrong_w = np.exp(scores) / np.exp(scores).sum(axis=0, keepdims=True)  # normalised over B
        wrong_out = np.einsum("bhqt,bhtd->bhqd", wrong_w, v)
        with self.assertRaises(OracleMismatch):
            check_decode_batch(q, k, v, wrong_out.astype(np.float32), wrong_w.astype(np.float32))
        good_w = np.exp(scores) / np.exp(scores).sum(axis=-1, keepdims=True)
        good_out = np.einsum("bhqt,bhtd->bhqd", good_w, v)
        err = check_decode_batch(q, k, v, good_out.astype(np.float32), good_w.astype(np.float32))
        self.assertLess(err, 1e-5)


if __name__ == "__main__":
    unittest.main()
