"""kernels/_block_gemm_kquant_int_jit.py: integer dot products of Q8_K activations and k-quant blocks.

Oracle: exact NumPy int64 arithmetic on the same quants (x's from `quantize_activations(x, "q8_k")`,
the weight's integer q, sc, mn decoded here from the bytes as ggml's `dequantize_row_q2_K` .. `_q6_K`
loops read them), combined in float64. The kernel may differ only by its float32 roundings: per
super-block b and lane it adds c_b D_b to an accumulator, c_b an exact int32 sum and D_b = d_w d_x
(or -dmin_w d_x) rounded once, c_b converted to float32 (exact below 2^24, else one rounding), by F
FMAs (F = 2 with minimums: Q2_K, Q4_K, Q5_K; F = 1 for Q3_K, Q6_K), then log2 L additions of the
lanes. With u = eps / 2 the first-order bound is (F B + 2 + log2 L) u sum |terms|, B = K / 256; the
test allows (F B + log2 L + 4) eps sum |terms|, about twice that, where sum |terms| is sum_b |D_b|
times the magnitudes of the integers the kernel adds (S_j: x's quants summed over the run j of one
scale; q before the offset o subtracted, o = 32 for Q6_K, 4 for Q3_K, else 0):

    sum_j |sc_j| (sum |q qx| + o |S_j|)  +  (with minimums, at dmin_w) sum_j mn_j |S_j|

Also: the largest quants and scales against x quants of +-127 stay exact, every row tile gives the
same bits (M = 9 at once against each row alone, slices of W's rows, a strided y), and the
float32-activation kernel `block_gemm.block_linear` agrees within the quantization of x; on every
kernel variant (their loops run on any CPU).
"""

from __future__ import annotations

import math
import unittest

import numpy as np

from attention_kv_caceh.kernels import _block_gemm_kquant_int_jit as kq
from attention_kv_caceh.kernels._block_gemm_int_jit import BLOCK_SPECS, host_dot
from attention_kv_caceh.kernels.activation_quant import QuantizedActivations, quantize_activations
from attention_kv_caceh.kernels.block_formats import FORMATS, dequantize_blocks
from attention_kv_caceh.kernels.block_gemm import block_linear, block_weight
from attention_kv_caceh.kernels.isa import ISAS, SimdVariant
from attention_kv_caceh.oracle import tolerance_for
from tests.test_block_gemm import random_blocks

ISA_NAMES = list(BLOCK_SPECS)
EPS32 = float(np.finfo(np.float32).eps)


def run_kernel(xq: QuantizedActivations, blocks: np.ndarray, fmt: str, isa: str, out: np.ndarray) -> None:
    """out `[M, N]` = x W^T by the integer kernel of (isa, fmt), from Q8_K activations."""
    kq.ENTRY_POINTS[(isa, fmt)]((xq.q, xq.d, xq.sums), blocks, out)


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


def _two_bit_quants(b: np.ndarray, start: int) -> np.ndarray:
    """The 2-bit quants `[N, B, 256]` of the 64 bytes at `start` (`dequantize_row_q2_K`'s loop: value
    128 h + 32 j + l is bits 2 j of byte 32 h + l)."""
    q = np.zeros((*b.shape[:2], 256), np.int64)
    for h in range(2):
        for j in range(4):
            q[..., 128 * h + 32 * j : 128 * h + 32 * j + 32] = (
                b[..., start + 32 * h : start + 32 * h + 32] >> 2 * j
            ) & 3
    return q


def q2_k_quants(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q2_K blocks uint8 `[N, B * 84]` -> d, dmin float64 `[N, B]`; q (0 .. 3), sc, mn (the low and
    high nibble of its 16's scale byte) int64 `[N, B, 256]`, as `dequantize_row_q2_K`."""
    raw = blocks.reshape(blocks.shape[0], -1, 84)
    b = raw.astype(np.int64)
    scales = np.repeat(b[..., 0:16], 16, axis=2)
    return {
        "d": _half(raw, 80),
        "dmin": _half(raw, 82),
        "q": _two_bit_quants(b, 16),
        "sc": scales & 15,
        "mn": scales >> 4,
    }


def q3_k_quants(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q3_K blocks uint8 `[N, B * 110]` -> d float64 `[N, B]`; q (0 .. 7: the 2 bits plus 4 where bit
    4 h + j of hmask[l] is set; the weight is q - 4) and sc (its 16's 6-bit scale minus 32) int64
    `[N, B, 256]`, as `dequantize_row_q3_K`."""
    raw = blocks.reshape(blocks.shape[0], -1, 110)
    b = raw.astype(np.int64)
    q = _two_bit_quants(b, 32)
    for g in range(8):
        q[..., 32 * g : 32 * g + 32] += 4 * ((b[..., 0:32] >> g) & 1)
    s = b[..., 96:108]
    sc = np.zeros((*b.shape[:2], 16), np.int64)
    for j in range(16):
        low = s[..., j] & 15 if j < 8 else s[..., j - 8] >> 4
        sc[..., j] = (low | ((s[..., 8 + j % 4] >> 2 * (j // 4)) & 3) << 4) - 32
    return {"d": _half(raw, 108), "q": q, "sc": np.repeat(sc, 16, axis=2)}


SUB = {"q2_k": 16, "q3_k": 16, "q4_k": 32, "q5_k": 32, "q6_k": 16}
"""Values per scale."""
OFFSET = {"q3_k": 4, "q6_k": 32}
"""What the weight's quant has subtracted (the weight is sc (q - offset))."""


def int_fields(blocks: np.ndarray, fmt: str) -> dict[str, np.ndarray]:
    """The integer fields of `fmt`'s blocks (q, sc; dmin, mn for the formats with minimums) and d."""
    if fmt in ("q4_k", "q5_k"):
        return q4_k_quants(blocks, fmt == "q5_k")
    return {"q2_k": q2_k_quants, "q3_k": q3_k_quants, "q6_k": q6_k_quants}[fmt](blocks)


def decoded(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """The weights float64 `[N, K]` from the integer fields (checked against `dequantize_blocks`)."""
    f = int_fields(blocks, fmt)
    w = f["d"][..., None] * f["sc"] * (f["q"] - OFFSET.get(fmt, 0))
    if "dmin" in f:
        w = w - f["dmin"][..., None] * f["mn"]
    return w.reshape(blocks.shape[0], -1)


def exact_and_bound(
    xq: QuantizedActivations, blocks: np.ndarray, fmt: str, lanes: int
) -> tuple[np.ndarray, np.ndarray]:
    """(the exact float64 combine of the int64 super-block sums `[M, N]`, the float32 rounding bound)."""
    m, k = xq.q.shape
    qx = xq.q.reshape(m, -1, 256).astype(np.int64)  # [M, B, 256]
    sub, offset = SUB[fmt], OFFSET.get(fmt, 0)
    runs = qx.reshape(m, qx.shape[1], -1, sub).sum(axis=3)  # S per scale [M, B, 256 / sub]
    np.testing.assert_array_equal(xq.sums, qx.reshape(m, -1, 16).sum(axis=2))  # bsums: x's quants per 16
    spread = np.repeat(runs, sub, axis=2)  # [M, B, 256]: each value's S
    dx = xq.d.astype(np.float64)[:, None, :]  # [M, 1, B]
    f = int_fields(blocks, fmt)
    dot = lambda a, w: np.einsum("mbl,nbl->mnb", a, w)  # noqa: E731  (int64, exact)
    terms = f["d"][None] * dx * dot(qx, f["sc"] * (f["q"] - offset))
    mags = dot(np.abs(qx), np.abs(f["sc"]) * f["q"]) + offset * dot(np.abs(spread), np.abs(f["sc"])) // sub
    sizes = np.abs(f["d"][None] * dx) * mags.astype(np.float64)
    per_block = 1
    if "dmin" in f:
        terms = terms - f["dmin"][None] * dx * dot(qx, f["mn"])
        sizes = sizes + np.abs(f["dmin"][None] * dx) * (dot(np.abs(spread), f["mn"]) // sub).astype(
            np.float64
        )
        per_block = 2
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

    def test_the_largest_quants_and_scales_stay_exact(self) -> None:
        """Every byte 0xff, 0x80 or 0x7f (the largest q, and int8 scales -1, -128, 127 for Q6_K) against
        x whose quants are all -127 or all 127: the int16 pairs of `vpmaddubsw` (at most 2 * 63 * 127)
        and the int32 sums stay exact."""
        x = np.stack([np.full(512, 0.5), np.full(512, -3.0), np.tile([1.0, -1.0], 256)]).astype(np.float32)
        xq = quantize_activations(x, "q8_k")
        for fmt in kq.KQUANT_INT_FORMATS:
            row = FORMATS[fmt]
            for fill in (0xFF, 0x80, 0x7F):
                raw = np.full((2, 2, row.nbytes), fill, np.uint8)
                for field in row.half_fields:
                    at = row.field_offset(field)
                    raw[..., at : at + 2] = np.array([0.75], "<f2").view(np.uint8)
                raw = raw.reshape(2, -1)
                for isa in ISA_NAMES:
                    got = np.empty((3, 2), np.float32)
                    run_kernel(xq, raw, fmt, isa, got)
                    want, bound = exact_and_bound(xq, raw, fmt, host_dot(isa)[1])
                    with self.subTest(fmt=fmt, fill=fill, isa=isa):
                        self.assertTrue((np.abs(got - want) <= bound).all(), f"{got} {want}")

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
