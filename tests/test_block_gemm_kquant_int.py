"""kernels/_block_gemm_kquant_int_jit.py: integer dot products of Q8_K activations and Q4_K / Q5_K / Q6_K blocks.

Oracle: exact NumPy int64 arithmetic on the same quants (x's from `quantize_activations(x, "q8_k")`,
the weight's integer q, sc, mn decoded here from the bytes as ggml's `dequantize_row_q4_K`,
`_q5_K` and `_q6_K` loops read them), combined in float64. The kernel may differ only by its float32
roundings; per super-block b and lane it adds c_b D_b to an accumulator, c_b an exact int32 sum and
D_b = d_w d_x (or -dmin_w d_x) rounded once, c_b converted to float32 (exact below 2^24, else one
rounding), one FMA each (two per super-block for Q4_K, one for Q6_K), then log2 L additions of the
lanes. With u = eps / 2 the first-order bound is (F B + 2 + log2 L) u sum |terms|, F the FMAs per
super-block and B = K / 256; the test allows (2 B + log2 L + 4) eps sum |terms|, about twice that,
where sum |terms| is sum_b |D_b| times the sum of the magnitudes of the integers the kernel adds:
Q4_K, Q5_K  sum_s sc_s sum |q qx| + (dmin) sum_s mn_s |S_s|    (S_s = x's quants summed over sub-block s),
Q6_K        sum_t |sc_t| (sum q6 |qx| + 32 |S_t|)               (q6 = 0 .. 63 before the - 32, t per 16).
Also: every row tile gives the same bits (M = 9 at once against each row alone, slices of W's rows,
a strided y), and the float32-activation kernel `block_gemm.block_linear` agrees within the
quantization of x; on every kernel variant (their loops run on any CPU).
"""

from __future__ import annotations

import math
import unittest

import numpy as np

from attention_kv_caceh.kernels import _block_gemm_kquant_int_jit as kq
from attention_kv_caceh.kernels._block_gemm_int_jit import BLOCK_SPECS, host_dot
from attention_kv_caceh.kernels.activation_quant import QuantizedActivations, quantize_activations
from attention_kv_caceh.kernels.block_formats import dequantize_blocks
from attention_kv_caceh.kernels.block_gemm import block_linear, block_weight
from attention_kv_caceh.kernels.isa import ISAS, SimdVariant
from attention_kv_caceh.oracle import tolerance_for
from tests.test_block_gemm import random_blocks

ISA_NAMES = list(BLOCK_SPECS)
EPS32 = float(np.finfo(np.float32).eps)


def run_kernel(xq: QuantizedActivations, blocks: np.ndarray, fmt: str, isa: str, out: np.ndarray) -> None:
    """out `[M, N]` = x W^T by the integer kernel of (isa, fmt), from Q8_K activations."""
    kq.ENTRY_POINTS[(isa, fmt)](xq.q, xq.d, xq.sums, blocks, out)


def kquant_int_linear(x: np.ndarray, blocks: np.ndarray, fmt: str, isa: str) -> np.ndarray:
    """y float32 `[M, N]` for x float32 `[M, K]`, quantized to Q8_K first."""
    out = np.empty((x.shape[0], blocks.shape[0]), dtype=np.float32)
    run_kernel(quantize_activations(x, "q8_k"), blocks, fmt, isa, out)
    return out


def _half(b: np.ndarray, at: int) -> np.ndarray:
    return b[..., at : at + 2].copy().view("<f2")[..., 0].astype(np.float64)


def q4_k_quants(blocks: np.ndarray, fifth: bool = False) -> dict[str, np.ndarray]:
    """Q4_K blocks uint8 `[N, B * 144]` -> d, dmin float64 `[N, B]`; q, sc, mn int64 `[N, B, 256]`
    (each weight's 4-bit quant and its sub-block's 6-bit scale and min), as `dequantize_row_q4_K`.
    fifth: Q5_K blocks `[N, B * 176]` (`dequantize_row_q5_K`: q gains 16 where its bit of qh is set)."""
    raw = blocks.reshape(blocks.shape[0], -1, 176 if fifth else 144)
    b = raw.astype(np.int64)
    scales = b[..., 4:16]
    q = np.zeros((*b.shape[:2], 256), np.int64)
    sc, mn = np.zeros_like(q), np.zeros_like(q)
    for j in range(8):  # get_scale_min_k4(j, scales)
        if j < 4:
            s, m = scales[..., j] & 63, scales[..., j + 4] & 63
        else:
            s = (scales[..., j + 4] & 0xF) | ((scales[..., j - 4] >> 6) << 4)
            m = (scales[..., j + 4] >> 4) | ((scales[..., j] >> 6) << 4)
        sc[..., 32 * j : 32 * j + 32] = s[..., None]
        mn[..., 32 * j : 32 * j + 32] = m[..., None]
    start = 48 if fifth else 16
    qh = b[..., 16:48]
    for chunk in range(4):  # 64 weights from 32 bytes: low nibbles, then high
        qs = b[..., start + 32 * chunk : start + 32 + 32 * chunk]
        q[..., 64 * chunk : 64 * chunk + 32] = qs & 0xF
        q[..., 64 * chunk + 32 : 64 * chunk + 64] = qs >> 4
        if fifth:  # u1 = 1 << 2 chunk, u2 = 2 << 2 chunk
            q[..., 64 * chunk : 64 * chunk + 32] += np.where(qh & (1 << 2 * chunk), 16, 0)
            q[..., 64 * chunk + 32 : 64 * chunk + 64] += np.where(qh & (2 << 2 * chunk), 16, 0)
    return {"d": _half(raw, 0), "dmin": _half(raw, 2), "q": q, "sc": sc, "mn": mn}


def q6_k_quants(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q6_K blocks uint8 `[N, B * 210]` -> d float64 `[N, B]`; q (0 .. 63, the weight is q - 32) and
    sc (the int8 scale of its 16) int64 `[N, B, 256]`, as `dequantize_row_q6_K`."""
    raw = blocks.reshape(blocks.shape[0], -1, 210)
    b = raw.astype(np.int64)
    q = np.zeros((*b.shape[:2], 256), np.int64)
    sc = np.zeros_like(q)
    scales = raw[..., 192:208].view(np.int8).astype(np.int64)
    for half in range(2):
        ql, qh = b[..., 64 * half : 64 * half + 64], b[..., 128 + 32 * half : 160 + 32 * half]
        base = 128 * half
        for j in range(32):
            q[..., base + j] = (ql[..., j] & 0xF) | ((qh[..., j] >> 0) & 3) << 4
            q[..., base + j + 32] = (ql[..., j + 32] & 0xF) | ((qh[..., j] >> 2) & 3) << 4
            q[..., base + j + 64] = (ql[..., j] >> 4) | ((qh[..., j] >> 4) & 3) << 4
            q[..., base + j + 96] = (ql[..., j + 32] >> 4) | ((qh[..., j] >> 6) & 3) << 4
            for g in range(4):
                sc[..., base + j + 32 * g] = scales[..., 8 * half + j // 16 + 2 * g]
    return {"d": _half(raw, 208), "q": q, "sc": sc}


def decoded(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """The weights float64 `[N, K]` from the integer fields (checked against `dequantize_blocks`)."""
    if fmt in ("q4_k", "q5_k"):
        f = q4_k_quants(blocks, fmt == "q5_k")
        w = f["d"][..., None] * f["sc"] * f["q"] - f["dmin"][..., None] * f["mn"]
    else:
        f = q6_k_quants(blocks)
        w = f["d"][..., None] * f["sc"] * (f["q"] - 32)
    return w.reshape(blocks.shape[0], -1)


def exact_and_bound(
    xq: QuantizedActivations, blocks: np.ndarray, fmt: str, lanes: int
) -> tuple[np.ndarray, np.ndarray]:
    """(the exact float64 combine of the int64 super-block sums `[M, N]`, the float32 rounding bound)."""
    m, k = xq.q.shape
    qx = xq.q.reshape(m, -1, 256).astype(np.int64)  # [M, B, 256]
    sub = 16 if fmt == "q6_k" else 32
    runs = qx.reshape(m, qx.shape[1], -1, sub).sum(axis=3)  # S per sub-block [M, B, 256 / sub]
    np.testing.assert_array_equal(xq.sums, qx.reshape(m, -1, 16).sum(axis=2))  # bsums: x's quants per 16
    spread = np.repeat(runs, sub, axis=2)  # [M, B, 256]: each value's S
    dx = xq.d.astype(np.float64)[:, None, :]  # [M, 1, B]
    if fmt in ("q4_k", "q5_k"):
        f = q4_k_quants(blocks, fmt == "q5_k")
        isum = np.einsum("mbl,nbl->mnb", qx, f["sc"] * f["q"])
        msum = np.einsum("mbl,nbl->mnb", qx, f["mn"])
        terms = f["d"][None] * dx * isum - f["dmin"][None] * dx * msum
        mag_i = np.einsum("mbl,nbl->mnb", np.abs(qx), f["sc"] * f["q"]).astype(np.float64)
        mag_m = np.einsum("mbl,nbl->mnb", np.abs(spread), f["mn"]).astype(np.float64) / sub
        sizes = np.abs(f["d"][None] * dx) * mag_i + np.abs(f["dmin"][None] * dx) * mag_m
        per_block = 2
    else:
        f = q6_k_quants(blocks)
        isum = np.einsum("mbl,nbl->mnb", qx, f["sc"] * (f["q"] - 32))
        terms = f["d"][None] * dx * isum
        mags = np.einsum("mbl,nbl->mnb", np.abs(qx), np.abs(f["sc"]) * f["q"])
        mags = mags + 32 * np.einsum("mbl,nbl->mnb", np.abs(spread), np.abs(f["sc"])) // sub
        sizes = np.abs(f["d"][None] * dx) * mags.astype(np.float64)
        per_block = 1
    roundings = per_block * (k // 256) + math.log2(lanes) + 4
    return terms.sum(axis=2), roundings * EPS32 * sizes.sum(axis=2)


def _case(rng: np.random.Generator, m: int, n: int, blocks: int, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    x = (rng.standard_normal((m, 256 * blocks)) * rng.choice([1e-3, 1.0, 40.0], size=(m, 1))).astype(
        np.float32
    )
    x[0, :256] = 0.0  # a zero super-block (d_x = 0)
    if m > 1:
        x[1, :] = np.float32(0.5)  # constant: every quant of x is -127
    return x, random_blocks(rng, fmt, n, blocks)


class KQuantIntTest(unittest.TestCase):
    def test_the_integer_decode_is_the_library_decode(self) -> None:
        rng = np.random.default_rng(3)
        for fmt in kq.KQUANT_INT_FORMATS:
            raw = random_blocks(rng, fmt, 7, 3)
            with self.subTest(fmt=fmt):
                np.testing.assert_array_equal(decoded(raw, fmt), dequantize_blocks(raw, fmt))

    def test_every_variant_matches_exact_integer_arithmetic(self) -> None:
        rng = np.random.default_rng(0)
        for isa in ISA_NAMES:
            lanes = host_dot(isa)[1]
            for fmt in kq.KQUANT_INT_FORMATS:
                for m, n, blocks in ((1, 1, 1), (7, 5, 2), (9, 13, 3)):
                    x, raw = _case(rng, m, n, blocks, fmt)
                    xq = quantize_activations(x, "q8_k")
                    got = np.empty((m, n), np.float32)
                    run_kernel(xq, raw, fmt, isa, got)
                    want, bound = exact_and_bound(xq, raw, fmt, lanes)
                    with self.subTest(isa=isa, fmt=fmt, shape=(m, n, 256 * blocks)):
                        error = np.abs(got.astype(np.float64) - want)
                        self.assertTrue((error <= bound).all(), f"{error.max():.3e} > {bound.min():.3e}")
                        self.assertTrue(np.isfinite(got).all())

    def test_every_row_tile_gives_the_same_bits(self) -> None:
        rng = np.random.default_rng(1)
        for isa in ISA_NAMES:
            for fmt in kq.KQUANT_INT_FORMATS:
                x, raw = _case(rng, 9, 7, 2, fmt)
                xq = quantize_activations(x, "q8_k")
                full = np.empty((9, 7), np.float32)
                run_kernel(xq, raw, fmt, isa, full)  # tiles of 8 and 1 (neon: 4, 4, 1)
                wide = np.full((9, 20), np.nan, dtype=np.float32)
                run_kernel(xq, raw[2:6], fmt, isa, wide[:, 4:8])  # W rows 2 .. 5 into columns 4 .. 7
                with self.subTest(isa=isa, fmt=fmt):
                    for row in range(9):
                        alone = kquant_int_linear(x[row : row + 1], raw, fmt, isa)
                        np.testing.assert_array_equal(alone[0], full[row])
                    np.testing.assert_array_equal(wide[:, 4:8], full[:, 2:6])
                    self.assertTrue(np.isnan(wide[:, :4]).all() and np.isnan(wide[:, 8:]).all())
                    np.testing.assert_array_equal(kquant_int_linear(x[3:7], raw, fmt, isa), full[3:7])

    def test_agrees_with_the_float_activation_kernel_within_the_quantization_of_x(self) -> None:
        rng = np.random.default_rng(2)
        for isa in ISA_NAMES:
            variant = SimdVariant(isa, *ISAS[isa], False, "test")
            for fmt in kq.KQUANT_INT_FORMATS:
                x, raw = _case(rng, 6, 11, 3, fmt)
                xq = quantize_activations(x, "q8_k")
                x_hat = np.repeat(xq.d.astype(np.float64), 256, axis=1) * xq.q  # x as its quants say
                w = np.abs(dequantize_blocks(raw, fmt))  # [N, K]
                got = kquant_int_linear(x, raw, fmt, isa).astype(np.float64)
                ref = block_linear(x, block_weight(raw, fmt, variant)).astype(np.float64)
                rtol, _ = tolerance_for(np.float32, x.shape[1])
                bound = np.abs(x - x_hat) @ w.T + rtol * (np.abs(x) + np.abs(x_hat)) @ w.T + 1e-30
                with self.subTest(isa=isa, fmt=fmt):
                    self.assertTrue((np.abs(got - ref) <= bound).all())
                    # the quantization of x is no more than half a step of d_x per value
                    step = np.repeat(np.abs(xq.d.astype(np.float64)), 256, axis=1) / 2
                    self.assertTrue((np.abs(x - x_hat) <= step * (1 + 1e-6)).all())


if __name__ == "__main__":
    unittest.main()
