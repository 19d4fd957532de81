"""kernels/activation_quant.py: 8-bit activation blocks (Q8_0, Q8_1, Q8_K) for integer dot products.

Oracles: the NumPy reference (ggml's formulas in float32) bit-equal to the compiled pass, and the
reference against first principles: every quant within half a step of x / d and at most 127 in
magnitude, the block's largest |x| at q = +-127, s = d sum(q) and bsums the sums of 16 quants.
"""

from __future__ import annotations

import unittest

import numpy as np

from attention_kv_caceh.kernels.activation_quant import (
    ACTIVATION_FORMATS,
    activation_format_for,
    quantize_activations,
    quantize_activations_reference,
)
from attention_kv_caceh.kernels.block_formats import FORMATS


def _activations(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """Rows of different scales, a zero block, and exact halves (ties of the rounding)."""
    x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 40.0], size=(m, 1))).astype(np.float32)
    x[0, :32] = 0.0
    if m > 1:
        x[1, :32] = np.arange(32, dtype=np.float32) - 16.0  # d = 16 / 127: many ties near .5 steps
        x[1, 32:64] = np.float32(127.0) * (np.arange(32) % 5 - 2) / 4  # q = +-63.5 ties at d = 1
    return x


class ActivationQuantTest(unittest.TestCase):
    def test_compiled_pass_is_bit_equal_to_the_reference(self) -> None:
        rng = np.random.default_rng(0)
        for fmt, row in ACTIVATION_FORMATS.items():
            for m, blocks in ((1, 1), (3, 2), (7, 3)):
                k = row.block * blocks
                x = _activations(rng, m, max(k, 64)) if row.block == 32 else _activations(rng, m, k)
                got, want = quantize_activations(x, fmt), quantize_activations_reference(x, fmt)
                with self.subTest(fmt=fmt, m=m, k=x.shape[1]):
                    np.testing.assert_array_equal(got.q, want.q)
                    np.testing.assert_array_equal(got.d.view(np.uint32), want.d.view(np.uint32))
                    np.testing.assert_array_equal(got.sums, want.sums)
                    self.assertEqual(got.sums.dtype, want.sums.dtype)

    def test_reference_quants_are_round_to_nearest_of_x_over_d(self) -> None:
        rng = np.random.default_rng(1)
        for fmt, row in ACTIVATION_FORMATS.items():
            x = _activations(rng, 4, 512)
            got = quantize_activations_reference(x, fmt)
            blocks = x.reshape(4, -1, row.block).astype(np.float64)
            q = got.q.reshape(blocks.shape).astype(np.float64)
            d = got.d.astype(np.float64)[..., None]
            with self.subTest(fmt=fmt):
                self.assertLessEqual(int(np.abs(got.q.astype(np.int32)).max()), 127)
                live = d[..., 0] != 0
                self.assertTrue((q[~live] == 0).all())
                # |x - d q| <= d / 2 plus the float32 roundings of 1 / d and x / d
                err = np.abs(blocks - d * q)[live]
                self.assertTrue((err <= np.abs(d[live]) * (0.5 + 1e-5) + 1e-30).all())
                self.assertTrue((np.abs(q).max(axis=2)[live] == 127).all())
                if row.has_sum:
                    want = (got.d * got.q.reshape(blocks.shape).astype(np.int32).sum(axis=2)).astype(
                        np.float32
                    )
                    np.testing.assert_array_equal(got.sums, want)
                if row.sums_per:
                    want16 = got.q.reshape(4, -1, 16).astype(np.int32).sum(axis=2)
                    np.testing.assert_array_equal(got.sums, want16)

    def test_ties_round_as_ggml_does(self) -> None:
        x = np.zeros((1, 256), dtype=np.float32)
        x[0, 0] = 127.0  # d = 1 (Q8_0 / Q8_1), d = -1 (Q8_K: iscale = -1)
        x[0, 1:4] = [2.5, -2.5, 3.5]
        self.assertEqual(quantize_activations(x, "q8_0").q[0, 1:4].tolist(), [3, -3, 4])  # roundf
        self.assertEqual(quantize_activations(x, "q8_k").q[0, 1:4].tolist(), [-2, 2, -4])  # half to even

    def test_every_quantized_weight_format_pairs_with_one_activation_format(self) -> None:
        for fmt in FORMATS:
            row = activation_format_for(fmt)
            with self.subTest(fmt=fmt):
                if fmt in ("f32", "f16", "bf16"):
                    self.assertIsNone(row)
                else:
                    self.assertIsNotNone(row)
                    assert row is not None
                    self.assertEqual(FORMATS[fmt].chunk % row.block, 0)

    def test_bad_input_is_refused(self) -> None:
        with self.assertRaises(ValueError):
            quantize_activations(np.zeros((2, 33), dtype=np.float32), "q8_0")
        with self.assertRaises(ValueError):
            quantize_activations(np.zeros((2, 32), dtype=np.float64), "q8_0")
        with self.assertRaises(ValueError):
            quantize_activations(np.zeros((2, 32), dtype=np.float32), "q8_2")
        bad = np.zeros((1, 32), dtype=np.float32)
        bad[0, 3] = np.nan
        with self.assertRaises(ValueError):
            quantize_activations(bad, "q8_1")


if __name__ == "__main__":
    unittest.main()
