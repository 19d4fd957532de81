"""kernels/gemm.py against its oracle, NumPy's x @ W.T in float64: every variant, tile height and padded panel.

Every variant's loops are built from the same LLVM IR whatever CPU runs them (a 16-lane vector is two
8-lane ones to an AVX2 CPU), so each variant's tiles are checked here on any machine; which one
`compiled_variant` picks, and the AVX2 build for an AVX2 CPU, are checked in tests/test_gemm_variants.py.
"""

from __future__ import annotations

import os
import unittest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.kernels import _gemm_jit
from attention_kv_caceh.kernels.gemm import (
    bfloat16_bits,
    bfloat16_to_float32,
    fma_probe,
    pack_weight,
    packed_linear,
    packed_linear_into,
    unpack_weight,
)
from attention_kv_caceh.kernels.isa import ISAS, SimdVariant, compiled_variant
from attention_kv_caceh.oracle import tolerance_for

HOST = compiled_variant()
VARIANTS = [SimdVariant(isa, *ISAS[isa], False, "test") for isa in ISAS]  # widening bfloat16 on each
if HOST is not None and HOST.bf16_dot:
    VARIANTS.append(HOST)  # vdpbf16ps needs a CPU that has it


def _oracle(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64).T


def _assert_product(test: unittest.TestCase, got: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """got within float32 rounding of x @ w^T: a tolerance of the sum of |terms|, per element."""
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T  # [M, N]
    rtol, _ = tolerance_for(np.float32, x.shape[1])
    test.assertTrue(np.all(np.abs(got - _oracle(x, w)) <= rtol * scale + 1e-30), "outside float32 rounding")


class PackedLinearTest(unittest.TestCase):
    @settings(max_examples=40, deadline=None)
    @given(
        m=st.integers(1, 80),  # past the 64-row chunk, every remainder of every tile height
        n=st.integers(1, 70),  # past two panels of every width, with padding
        k=st.integers(1, 70),
        variant=st.sampled_from(VARIANTS),
        dtype=st.sampled_from(["float32", "bfloat16"]),
        seed=st.integers(0, 2**16),
    )
    def test_every_variant_equals_the_float64_product(
        self, m: int, n: int, k: int, variant: SimdVariant, dtype: str, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = rng.standard_normal((m, k)).astype(np.float32)
        packed = pack_weight(w, dtype, variant)
        got = packed_linear(x, packed)
        self.assertEqual((got.shape, got.dtype), ((m, n), np.dtype(np.float32)))
        self.assertTrue(got.flags.c_contiguous)
        stored = unpack_weight(packed)  # W itself, or W rounded to bfloat16
        if dtype == "bfloat16":
            np.testing.assert_array_equal(stored, bfloat16_to_float32(bfloat16_bits(w)))
        if packed.kind == "dpbf16":  # vdpbf16ps reads x as bfloat16 too
            x = bfloat16_to_float32(bfloat16_bits(x))
        _assert_product(self, got, x, stored)

    def test_each_variant_has_the_panel_width_of_its_spec(self) -> None:
        for variant in VARIANTS:
            for dtype in ("float32", "bfloat16"):
                packed = pack_weight(np.ones((40, 6), dtype=np.float32), dtype, variant)
                _, nr, _, _ = _gemm_jit.PANEL_SPECS[(variant.isa, packed.kind)]
                self.assertEqual(packed.padded_out_features, -(-40 // nr) * nr)
                self.assertEqual(packed.nbytes, packed.panels.size * packed.panels.itemsize)

    def test_pack_and_unpack_round_trip_and_padding_is_zero(self) -> None:
        w = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)
        for variant in VARIANTS:
            packed = pack_weight(w, "float32", variant)
            np.testing.assert_array_equal(unpack_weight(packed), w)
            nr = packed.panels.shape[2]
            padded = packed.panels.transpose(0, 2, 1).reshape(-1, 3)[50:]
            self.assertEqual(padded.shape[0], packed.padded_out_features - 50)
            np.testing.assert_array_equal(padded, 0.0)
            self.assertEqual((packed.out_features, packed.in_features, packed.panels.shape[1]), (50, 3, 3))
            self.assertGreater(nr, 0)

    def test_bfloat16_rounds_to_nearest_even(self) -> None:
        one = np.float32(1.0)
        halfway = np.array([one + np.float32(2.0**-8), one + np.float32(3 * 2.0**-8)], dtype=np.float32)
        self.assertEqual(bfloat16_to_float32(bfloat16_bits(halfway)).tolist(), [1.0, 1.0 + 2.0**-6])
        self.assertTrue(np.isnan(bfloat16_to_float32(bfloat16_bits(np.array([np.nan], np.float32))))[0])

    def test_strided_rows_of_x_are_read_in_place(self) -> None:
        rng = np.random.default_rng(1)
        w = rng.standard_normal((32, 16)).astype(np.float32)
        wide = rng.standard_normal((11, 40)).astype(np.float32)
        x = wide[:, 3:19]  # [11, 16], rows 40 floats apart
        for variant in VARIANTS:
            packed = pack_weight(w, "float32", variant)
            out = np.empty((11, packed.padded_out_features), dtype=np.float32)
            packed_linear_into(x, packed, out)
            np.testing.assert_allclose(out[:, :32], _oracle(x, w), rtol=1e-5, atol=1e-5)

    def test_refuses_other_dtypes_and_shapes_naming_them(self) -> None:
        packed = pack_weight(np.ones((4, 3), dtype=np.float32))
        with self.assertRaisesRegex(ValueError, "float64"):
            pack_weight(np.ones((4, 3)))
        with self.assertRaisesRegex(ValueError, r"\(0, 3\)"):
            pack_weight(np.ones((0, 3), dtype=np.float32))
        with self.assertRaisesRegex(ValueError, "float16"):
            pack_weight(np.ones((4, 3), dtype=np.float32), "float16")
        with self.assertRaisesRegex(ValueError, "float64"):
            packed_linear(np.ones((2, 3)), packed)
        with self.assertRaisesRegex(ValueError, r"\(2, 4\)"):
            packed_linear(np.ones((2, 4), dtype=np.float32), packed)


class FmaProbeTest(unittest.TestCase):
    def test_reports_a_positive_rate_for_every_variant_and_refuses_no_time(self) -> None:
        for variant in VARIANTS[:3]:
            self.assertGreater(fma_probe(0.001, variant), 0.0)
        with self.assertRaises(ValueError):
            fma_probe(0.0)


class VariantInEffectTest(unittest.TestCase):
    def test_the_variant_a_second_run_asks_for_is_the_one_compiled(self) -> None:
        """`.ci/run` repeats the variant-dependent tests under AVX2 with EXPECT_KERNEL_ISA=avx2: a
        NUMBA_CPU_NAME that Numba ignored would otherwise repeat the host's variant unnoticed."""
        wanted = os.environ.get("EXPECT_KERNEL_ISA")
        if wanted is None:
            self.skipTest("EXPECT_KERNEL_ISA is not set (only .ci/run's second run sets it)")
        self.assertEqual(None if HOST is None else HOST.isa, wanted)


if __name__ == "__main__":
    unittest.main()
