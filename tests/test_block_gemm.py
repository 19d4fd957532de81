"""kernels/block_gemm.py: every GGUF type of `block_formats`, decoded in float64 and multiplied in registers.

Blocks come from the `gguf` library's quantizers where it has one (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), and
are random bytes with finite float16 scales for every type (the k-quants are only read from files).
Four oracles: the library's own `dequantize`, bit-equal in float32 to the float64 decoder; the
block definitions written out in tests/test_engine_gguf.py, equal in float64; the format's step for
how far blocks are from the weights they were made from; and NumPy's float64 product of x and the
decoded weights for every kernel variant (their loops run on any CPU, as in tests/test_gemm.py).
"""

from __future__ import annotations

import unittest

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.kernels import _block_gemm_ir, _block_gemm_jit
from attention_kv_caceh.kernels.block_formats import (
    BLOCK_FORMATS,
    FORMATS,
    QUANTIZED_FORMATS,
    dequantize_blocks,
    quantize_weight,
    step_bound,
)
from attention_kv_caceh.kernels.block_gemm import block_linear, block_linear_into, block_weight
from attention_kv_caceh.kernels.isa import ISAS, SimdVariant
from attention_kv_caceh.oracle import tolerance_for
from tests.test_engine_gguf import reference_dequantize

VARIANTS = [SimdVariant(isa, *ISAS[isa], False, "test") for isa in ISAS]


def _weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Rows of different scales, one constant row and one all-zero row (d = 0) when there is room."""
    w = rng.standard_normal((n, k)) * rng.choice([1e-3, 1.0, 30.0], size=(n, 1))
    if n > 2:
        w[1] = 0.25
        w[2] = 0.0
    return w.astype(np.float32)


def random_blocks(rng: np.random.Generator, fmt: str, n: int, chunks: int) -> np.ndarray:
    """Blocks uint8 `[N, chunks * chunk bytes]` of random bytes whose float16 fields (d, m, dmin) are
    finite, of magnitudes from 1e-5 to 10 (a float type: random finite values)."""
    row = FORMATS[fmt]
    k = row.chunk * chunks
    if row.block == 1:
        values = (rng.standard_normal((n, k)) * rng.choice([1e-3, 1.0, 30.0], size=(n, 1))).astype("<f4")
        if fmt == "f16":
            return values.astype("<f2").view(np.uint8)
        if fmt == "bf16":
            return (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
        return values.view(np.uint8)
    raw = rng.integers(0, 256, size=(n, k // row.block, row.nbytes), dtype=np.uint8)  # [N, B, bytes]
    for field in row.half_fields:
        at = row.field_offset(field)
        scale = rng.standard_normal(raw.shape[:2]) * rng.choice([1e-5, 1e-2, 10.0], size=raw.shape[:2])
        raw[..., at : at + 2] = scale.astype("<f2").view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


class DecoderTest(unittest.TestCase):
    def test_every_row_matches_ggml_and_has_a_kernel_on_every_isa(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, row in FORMATS.items():
            with self.subTest(format=name):
                self.assertEqual(
                    GGML_QUANT_SIZES[GGMLQuantizationType[row.ggml_type]], (row.block, row.nbytes)
                )
                quants = sum(
                    size for field, size in row.layout if field in ("qs", "ql", "qh", "hmask", "value")
                )
                self.assertEqual(quants, row.block * row.bits // 8)
                self.assertEqual(row.block % row.sub, 0)
                self.assertIn(name, _block_gemm_ir.DECODERS)
                for isa in ISAS:
                    self.assertIn((isa, name), _block_gemm_jit.ENTRY_POINTS)
        self.assertEqual(
            set(BLOCK_FORMATS),
            {
                "q8_0",
                "q4_0",
                "q4_1",
                "q5_0",
                "q5_1",
                "q2_k",
                "q3_k",
                "q4_k",
                "q5_k",
                "q6_k",
                "f32",
                "f16",
                "bf16",
            },
        )

    def test_random_blocks_decode_bit_equal_to_the_gguf_library_and_the_definitions(self) -> None:
        rng = np.random.default_rng(7)
        for name, row in FORMATS.items():
            with self.subTest(format=name):
                raw = random_blocks(rng, name, 6, 3)
                decoded = dequantize_blocks(raw, name)
                self.assertEqual(decoded.shape, (6, 3 * row.chunk))
                library = dequantize(raw, GGMLQuantizationType[row.ggml_type])
                np.testing.assert_array_equal(decoded.astype(np.float32), library.astype(np.float32))
                if row.block == 256 or name in ("q5_0", "q5_1"):  # the layouts written out by hand
                    want = reference_dequantize(
                        raw.reshape(-1, row.nbytes), GGMLQuantizationType[name.upper()]
                    )
                    np.testing.assert_array_equal(decoded, want.reshape(decoded.shape))

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
        fmt=st.sampled_from(QUANTIZED_FORMATS),
        n=st.integers(1, 9),
        blocks=st.integers(1, 4),
        seed=st.integers(0, 2**16),
    )
    def test_agrees_with_the_gguf_library_and_stays_within_the_step(
        self, fmt: str, n: int, blocks: int, seed: int
    ) -> None:
        w = _weights(np.random.default_rng(seed), n, 32 * blocks)
        raw = quantize_weight(w, fmt)
        self.assertEqual(
            raw.shape, (n, blocks * {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}[fmt])
        )
        decoded = dequantize_blocks(raw, fmt)
        library = dequantize(raw, GGMLQuantizationType[fmt.upper()]).astype(np.float64)
        np.testing.assert_allclose(decoded, library, rtol=2**-23, atol=0)
        self.assertTrue(np.all(np.abs(decoded - w) <= step_bound(raw, fmt)))

    def test_refuses_what_is_not_whole_blocks_naming_it(self) -> None:
        with self.assertRaisesRegex(ValueError, "q5_0"):
            dequantize_blocks(np.zeros((1, 34), np.uint8), "q5_0")
        with self.assertRaisesRegex(ValueError, "IQ type"):
            dequantize_blocks(np.zeros((1, 136), np.uint8), "iq4_xs")
        with self.assertRaisesRegex(ValueError, "q4_k has no reference quantizer"):
            quantize_weight(np.zeros((1, 256), np.float32), "q4_k")
        with self.assertRaisesRegex(ValueError, r"\(1, 64\)"):
            block_weight(np.zeros((1, 64), np.uint8), "f32")  # 16 values: not a chunk of 32
        with self.assertRaisesRegex(ValueError, r"\(1, 33\)"):
            block_weight(np.zeros((1, 33), np.uint8), "q8_0")
        with self.assertRaisesRegex(ValueError, "float32"):
            block_weight(np.zeros((1, 34), np.float32), "q8_0")
        with self.assertRaisesRegex(ValueError, r"\(2, 48\)"):
            quantize_weight(np.zeros((2, 48), np.float32), "q4_0")


class BlockLinearTest(unittest.TestCase):
    @settings(max_examples=40, deadline=None)
    @given(
        fmt=st.sampled_from(QUANTIZED_FORMATS),
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

    def test_every_type_on_every_variant_equals_the_float64_product(self) -> None:
        """Random blocks of every type (the k-quants' every scale and bit), every tile height and the
        rows past a group, on each variant."""
        rng = np.random.default_rng(11)
        for fmt in BLOCK_FORMATS:
            raw = random_blocks(rng, fmt, 9, 2)
            decoded = dequantize_blocks(raw, fmt)  # [N, K]
            k = decoded.shape[1]
            for variant in VARIANTS:
                with self.subTest(format=fmt, isa=variant.isa):
                    weight = block_weight(raw, fmt, variant)
                    self.assertEqual((weight.out_features, weight.in_features), (9, k))
                    x = rng.standard_normal((15, k)).astype(np.float32)  # tiles of 8, 4, 2, 1
                    got = block_linear(x, weight)
                    terms = np.abs(x.astype(np.float64)) @ np.abs(decoded).T  # [M, N]
                    rtol, _ = tolerance_for(np.float32, k)
                    error = np.abs(got - x.astype(np.float64) @ decoded.T)
                    self.assertTrue(np.all(error <= rtol * terms + 1e-30), f"{error.max():.2e}")

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
