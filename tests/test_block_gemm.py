"""kernels/block_gemm.py: GGUF's Q8_0 / Q4_0 / Q4_1 blocks, decoded in float64 and multiplied in registers.

Blocks come from the `gguf` library's quantizers (what a GGUF file holds). Three oracles: the library's
own `dequantize` for the float64 decoder, the format's step for how far blocks are from the weights
they were made from, and NumPy's float64 product of x and the decoded weights for every kernel
variant (their loops run on any CPU, as in tests/test_gemm.py).
"""

from __future__ import annotations

import unittest

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.kernels import _block_gemm_jit
from attention_kv_caceh.kernels.block_formats import (
    BLOCK_FORMATS,
    FORMATS,
    dequantize_blocks,
    quantize_weight,
    step_bound,
)
from attention_kv_caceh.kernels.block_gemm import block_linear, block_linear_into, block_weight
from attention_kv_caceh.kernels.isa import ISAS, SimdVariant
from attention_kv_caceh.oracle import tolerance_for

VARIANTS = [SimdVariant(isa, *ISAS[isa], False, "test") for isa in ISAS]


def _weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Rows of different scales, one constant row and one all-zero row (d = 0) when there is room."""
    w = rng.standard_normal((n, k)) * rng.choice([1e-3, 1.0, 30.0], size=(n, 1))
    if n > 2:
        w[1] = 0.25
        w[2] = 0.0
    return w.astype(np.float32)


class DecoderTest(unittest.TestCase):
    def test_every_row_matches_ggml_and_has_a_kernel_on_every_isa(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, row in FORMATS.items():
            with self.subTest(format=name):
                self.assertEqual(
                    GGML_QUANT_SIZES[GGMLQuantizationType[row.ggml_type]], (row.block, row.nbytes)
                )
                self.assertEqual(row.block * row.bits // 8 + row.scale_bytes, row.nbytes)
                self.assertIn(name, _block_gemm_jit._DECODERS)  # pyright: ignore[reportPrivateUsage]
                for isa in ISAS:
                    self.assertIn((isa, name), _block_gemm_jit.ENTRY_POINTS)

    def test_hand_made_blocks_decode_as_ggml_defines_them(self) -> None:
        half = np.array([0.5, -2.0], dtype="<f2").view(np.uint8)  # d = 0.5, m = -2
        q8 = np.concatenate([half[:2], np.arange(-16, 16, dtype=np.int8).view(np.uint8)])[None]
        np.testing.assert_array_equal(dequantize_blocks(q8, "q8_0")[0], 0.5 * np.arange(-16, 16))
        nibbles = (np.arange(16) | (15 - np.arange(16)) << 4).astype(np.uint8)  # low j, high 15 - j
        q4_0 = np.concatenate([half[:2], nibbles])[None]
        want = np.concatenate([np.arange(16), 15 - np.arange(16)])  # element j, then element j + 16
        np.testing.assert_array_equal(dequantize_blocks(q4_0, "q4_0")[0], 0.5 * (want - 8))
        q4_1 = np.concatenate([half, nibbles])[None]
        np.testing.assert_array_equal(dequantize_blocks(q4_1, "q4_1")[0], 0.5 * want - 2.0)

    @settings(max_examples=15, deadline=None)
    @given(
        fmt=st.sampled_from(BLOCK_FORMATS),
        n=st.integers(1, 9),
        blocks=st.integers(1, 4),
        seed=st.integers(0, 2**16),
    )
    def test_agrees_with_the_gguf_library_and_stays_within_the_step(
        self, fmt: str, n: int, blocks: int, seed: int
    ) -> None:
        w = _weights(np.random.default_rng(seed), n, 32 * blocks)
        raw = quantize_weight(w, fmt)
        self.assertEqual(raw.shape, (n, blocks * {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]))
        decoded = dequantize_blocks(raw, fmt)
        library = dequantize(raw, GGMLQuantizationType[fmt.upper()]).astype(np.float64)
        np.testing.assert_allclose(decoded, library, rtol=2**-23, atol=0)
        self.assertTrue(np.all(np.abs(decoded - w) <= step_bound(raw, fmt)))

    def test_refuses_what_is_not_whole_blocks_naming_it(self) -> None:
        with self.assertRaisesRegex(ValueError, "q5_0"):
            dequantize_blocks(np.zeros((1, 34), np.uint8), "q5_0")
        with self.assertRaisesRegex(ValueError, r"\(1, 33\)"):
            block_weight(np.zeros((1, 33), np.uint8), "q8_0")
        with self.assertRaisesRegex(ValueError, "float32"):
            block_weight(np.zeros((1, 34), np.float32), "q8_0")
        with self.assertRaisesRegex(ValueError, r"\(2, 48\)"):
            quantize_weight(np.zeros((2, 48), np.float32), "q4_0")


class BlockLinearTest(unittest.TestCase):
    @settings(max_examples=40, deadline=None)
    @given(
        fmt=st.sampled_from(BLOCK_FORMATS),
        variant=st.sampled_from(VARIANTS),
        m=st.integers(1, 70),  # every tile height and remainder, past the 64-row chunk
        n=st.integers(1, 20),  # whole groups of rows of W and rows past them
        blocks=st.integers(1, 3),
        seed=st.integers(0, 2**16),
    )
    def test_every_variant_equals_the_float64_product_of_the_decoded_weights(
        self, fmt: str, variant: SimdVariant, m: int, n: int, blocks: int, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        k = 32 * blocks
        w = _weights(rng, n, k)
        raw = quantize_weight(w, fmt)
        weight = block_weight(raw, fmt, variant)
        self.assertEqual((weight.out_features, weight.in_features, weight.nbytes), (n, k, raw.nbytes))
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = block_linear(x, weight)
        self.assertEqual((got.shape, got.dtype), ((m, n), np.dtype(np.float32)))
        decoded = dequantize_blocks(raw, fmt)
        terms = np.abs(x.astype(np.float64)) @ np.abs(decoded).T  # [M, N]
        rtol, _ = tolerance_for(np.float32, k)
        error = np.abs(got - x.astype(np.float64) @ decoded.T)
        self.assertTrue(np.all(error <= rtol * terms + 1e-30), f"{fmt} {variant.isa}: {error.max():.2e}")
        # Against the weights the blocks were made from: within sum |x| times the format's step.
        step = np.abs(x.astype(np.float64)) @ step_bound(raw, fmt).T
        original = np.abs(got - x.astype(np.float64) @ w.astype(np.float64).T)
        self.assertTrue(np.all(original <= step + rtol * terms + 1e-30))

    def test_strided_rows_of_x_are_read_in_place(self) -> None:
        rng = np.random.default_rng(3)
        raw = quantize_weight(rng.standard_normal((9, 64)).astype(np.float32), "q4_1")
        wide = rng.standard_normal((5, 100)).astype(np.float32)
        x = wide[:, 7:71]  # [5, 64], rows 100 floats apart
        out = np.empty((5, 9), np.float32)
        block_linear_into(x, block_weight(raw, "q4_1"), out)
        want = x.astype(np.float64) @ dequantize_blocks(raw, "q4_1").T
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)

    def test_refuses_an_x_of_another_width_naming_it(self) -> None:
        weight = block_weight(np.zeros((2, 34), np.uint8), "q8_0")
        with self.assertRaisesRegex(ValueError, r"\(1, 31\)"):
            block_linear(np.zeros((1, 31), np.float32), weight)


if __name__ == "__main__":
    unittest.main()
