"""kernels/block_gemm_int.py: integer dot products of 8-bit activations and GGUF weight blocks.

Oracle: exact NumPy int64 arithmetic on the same quants (the activations' from `activation_quant`,
the weights' picked out of the blocks here from the layouts of `block_formats`), combined in float64;
the kernel may differ only by the float32 roundings of its per-block combine (K / 32 FMAs, the lane
sum, the product d_w d_x). Also: a y column slice with a row stride and any slice of W's rows or of
x's rows give bit-equal values, on every kernel variant (their loops run on any CPU).
"""

from __future__ import annotations

import math
import unittest

import numpy as np

from attention_kv_caceh.kernels import _block_gemm_int_jit
from attention_kv_caceh.kernels.activation_quant import activation_format_for, quantize_activations
from attention_kv_caceh.kernels.block_formats import quantize_weight
from attention_kv_caceh.kernels.block_gemm import block_weight
from attention_kv_caceh.kernels.block_gemm_int import dot_form, int_linear, int_linear_quantized
from attention_kv_caceh.kernels.isa import ISAS, SimdVariant
from attention_kv_caceh.kernels.threads import set_threads

INT_FORMATS = (
    _block_gemm_int_jit.INT_FORMATS
)  # the 32-weight types (the k-quants: test_block_gemm_kquant_int)
VARIANTS = [SimdVariant(isa, *ISAS[isa], False, "test") for isa in _block_gemm_int_jit.BLOCK_SPECS]
EPS32 = float(np.finfo(np.float32).eps)


def weight_quants(blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qw int64 [N, B, 32], d float64 [N, B], m float64 [N, B]) of Q4_1 / Q4_0 / Q8_0 / Q5_0 / Q5_1
    blocks, each weight d qw + m: the 4- and 5-bit quants unsigned as the kernels multiply them (Q4_0's
    and Q5_0's offset -8 d and -16 d in m), Q8_0's signed with m = 0."""
    size = {"q4_1": 20, "q4_0": 18, "q8_0": 34, "q5_0": 22, "q5_1": 24}[fmt]
    b = blocks.reshape(blocks.shape[0], -1, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = np.zeros_like(d)
    if fmt == "q8_0":
        return b[..., 2:34].view(np.int8).astype(np.int64), d, m
    start = {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}[fmt]
    qs = b[..., start : start + 16].astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], axis=2)
    if fmt in ("q5_0", "q5_1"):  # bit j of the little-endian 32-bit qh is weight j's fifth bit
        qh = b[..., start - 4 : start].copy().view("<u4")[..., 0].astype(np.int64)
        q = q | (((qh[..., None] >> np.arange(32)) & 1) << 4)
    if fmt in ("q4_1", "q5_1"):
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        return q, d, m
    return q, d, -(16.0 if fmt == "q5_0" else 8.0) * d  # weight = d (q - 8) = d q + m


def exact_and_bound(x: np.ndarray, blocks: np.ndarray, fmt: str, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact float64 combine of the int64 block dots, and the float32 rounding bound around it."""
    pair = activation_format_for(fmt)
    assert pair is not None
    xq = quantize_activations(x, pair.name)
    qx = xq.q.reshape(x.shape[0], -1, 32).astype(np.int64)  # [M, B, 32]
    qw, dw, mw = weight_quants(blocks, fmt)
    dots = np.einsum("mbj,nbj->mnb", qx, qw)  # int64, exact
    mags = np.einsum("mbj,nbj->mnb", np.abs(qx), np.abs(qw)).astype(np.float64)
    dx = xq.d.astype(np.float64)[:, None, :]
    sx = (
        dx * qx.sum(axis=2)[:, None, :]
    )  # d_x sum(qx), exact (the kernel reads Q8_1's float32 rounding of it)
    terms = dw[None] * dx * dots + mw[None] * sx
    sizes = dw[None] * np.abs(dx) * mags + np.abs(mw[None] * sx)
    roundings = x.shape[1] // 32 + math.log2(lanes) + 4
    return terms.sum(axis=2), roundings * EPS32 * np.abs(sizes).sum(axis=2)


def _case(rng: np.random.Generator, m: int, n: int, k: int, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    w = (rng.standard_normal((n, k)) * rng.choice([1e-2, 1.0, 5.0], size=(n, 1))).astype(np.float32)
    x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 40.0], size=(m, 1))).astype(np.float32)
    x[0, :32] = 0.0  # a zero block (d_x = 0)
    return x, quantize_weight(w, fmt)


class IntBlockGemmTest(unittest.TestCase):
    def test_every_variant_matches_exact_integer_arithmetic(self) -> None:
        rng = np.random.default_rng(0)
        for variant in VARIANTS:
            lanes = dot_form(variant.isa)[1]
            for fmt in INT_FORMATS:
                for m, n, k in ((1, 1, 32), (7, 5, 96), (9, 13, 160)):
                    x, blocks = _case(rng, m, n, k, fmt)
                    got = int_linear(x, block_weight(blocks, fmt, variant)).astype(np.float64)
                    want, bound = exact_and_bound(x, blocks, fmt, lanes)
                    with self.subTest(isa=variant.isa, fmt=fmt, shape=(m, n, k)):
                        self.assertTrue((np.abs(got - want) <= bound).all(), np.abs(got - want).max())

    def test_slices_of_rows_and_a_strided_output_give_the_same_bits(self) -> None:
        rng = np.random.default_rng(1)
        for variant in VARIANTS:
            for fmt in INT_FORMATS:
                x, blocks = _case(rng, 11, 9, 64, fmt)
                pair = activation_format_for(fmt)
                assert pair is not None
                xq = quantize_activations(x, pair.name)
                full = np.empty((11, 9), dtype=np.float32)
                int_linear_quantized(xq, block_weight(blocks, fmt, variant), full)
                wide = np.full((11, 20), np.nan, dtype=np.float32)
                part = wide[:, 4:8]  # W rows 2 .. 5 into columns 4 .. 7 of a wider y
                int_linear_quantized(xq, block_weight(blocks[2:6], fmt, variant), part)
                weight = block_weight(blocks, fmt, variant)
                rows = int_linear(x[3:6], weight)
                with self.subTest(isa=variant.isa, fmt=fmt):
                    np.testing.assert_array_equal(part, full[:, 2:6])
                    self.assertTrue(np.isnan(wide[:, :4]).all() and np.isnan(wide[:, 8:]).all())
                    np.testing.assert_array_equal(rows, full[3:6])
                    for lo, hi in ((3, 4), (3, 5), (0, 11)):  # the tiles of one or two rows of x, and of many
                        np.testing.assert_array_equal(int_linear(x[lo:hi], weight), full[lo:hi])

    def test_every_thread_count_gives_the_same_bits(self) -> None:
        rng = np.random.default_rng(3)
        set_threads(2)
        try:
            for fmt in INT_FORMATS:
                x, blocks = _case(rng, 3, 37, 64, fmt)
                weight = block_weight(blocks, fmt, VARIANTS[0])
                pair = activation_format_for(fmt)
                assert pair is not None
                xq = quantize_activations(x, pair.name)
                one, two = (np.empty((3, 37), np.float32) for _ in range(2))
                int_linear_quantized(xq, weight, one, threads=1)
                int_linear_quantized(xq, weight, two, threads=2)
                with self.subTest(fmt=fmt):
                    np.testing.assert_array_equal(one, two)
        finally:
            set_threads(1)

    def test_mismatched_input_is_refused(self) -> None:
        rng = np.random.default_rng(2)
        x, blocks = _case(rng, 2, 3, 64, "q4_1")
        weight = block_weight(blocks, "q4_1", VARIANTS[0])
        with self.assertRaises(ValueError):
            int_linear_quantized(quantize_activations(x, "q8_0"), weight, np.empty((2, 3), np.float32))
        with self.assertRaises(ValueError):
            int_linear_quantized(quantize_activations(x, "q8_1"), weight, np.empty((2, 4), np.float32))
        with self.assertRaises(ValueError):
            int_linear(x[:, :32], weight)
        with self.assertRaises(ValueError):
            int_linear(x, block_weight(np.zeros((3, 128), np.uint8), "f16", VARIANTS[0]))  # no integer kernel


if __name__ == "__main__":
    unittest.main()
