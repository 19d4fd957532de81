"""Compiled linear layer (Numba): y = x W^T with the weight packed once, read once for all rows of x.

A decode step of B sequences multiplies B rows of activations by every weight matrix. Reading the
weights costs the same for any B, and each weight serves 2 B flops, so up to B of about (FMA peak /
read bandwidth) the step should cost what B = 1 costs. NumPy's `x @ W.T` (OpenBLAS, one thread) does
not get there: for 2 to 8 rows it packs (copies) W on every call and runs several times slower than
for one row. This module packs W once, at load, into the layout its kernel reads, and the kernel
streams each packed row once for all rows of x (the loops and the layouts: `_gemm_jit`).

Layout (legend: M rows of x, K input features, N output features, NR the variant's panel width): W
`[N, K]` (Hugging Face's `[out, in]`) becomes panels `[ceil(N / NR), K, NR]` of float32, panel p =
W[p NR : (p + 1) NR]^T, zero-padded when NR does not divide N; or, for bfloat16 weights, panels
`[ceil(N / NR), ceil(K / 2), NR, 2]` of bfloat16 bit patterns (uint16), each output's pair of input
features adjacent. Activations and sums are float32 either way. NumPy's `x @ W.T` in float64 (of the
weights as packed) is the oracle the tests hold every variant to.

Variants: one per instruction set (`isa.compiled_variant`): AVX-512 (16 float32 lanes, an 8 x 32 tile
in its 32 vector registers), AVX2 (8 lanes, 6 x 16 in 16 registers) and NEON (4 lanes, 8 x 12 in 32
registers); bfloat16 weights are widened in registers, or, where the CPU has AVX-512 BF16, multiplied
by `vdpbf16ps`, which rounds x to bfloat16 too. Where no variant applies, `pack_weight` refuses and
the engine keeps NumPy. `fma_probe` times the variant's FMA instruction in registers only: the FLOP/s
ceiling that `bench-engine` reports the linear layers against.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels import _gemm_jit as _jit
from attention_kv_caceh.kernels.dispatch import WEIGHT_DTYPES
from attention_kv_caceh.kernels.isa import SimdVariant, compiled_variant
from attention_kv_caceh.kernels.threads import chunk_rows, row_split

__all__ = [
    "PackedWeight",
    "bfloat16_bits",
    "bfloat16_to_float32",
    "fma_probe",
    "pack_weight",
    "packed_linear",
    "packed_linear_into",
    "prepare_packed_linear",
    "unpack_weight",
]

F32Array = npt.NDArray[np.float32]


def bfloat16_bits(a: npt.NDArray[Any]) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    nan = np.isnan(np.ascontiguousarray(a, dtype=np.float32))
    return np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16)


def bfloat16_to_float32(bits: npt.NDArray[np.uint16]) -> F32Array:
    """bfloat16 bit patterns -> float32 (exact: bfloat16 is float32's top half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class PackedWeight:
    """A weight `[N, K]` stored as the panels of one kernel variant (module docstring).

    panels: float32 `[P, K, NR]` or uint16 `[P, ceil(K / 2), NR, 2]` (dtype "bfloat16").
    out_features: N (the panels' last P * NR - N columns are zero padding); in_features: K.
    isa: the variant ("avx512", "avx2", "neon"); kind: "f32", "bf16" (widened in registers) or
    "dpbf16" (`vdpbf16ps`).
    """

    panels: npt.NDArray[Any]
    out_features: int
    in_features: int
    isa: str
    kind: str

    @property
    def dtype(self) -> str:
        """ "float32" or "bfloat16": how the weights are stored."""
        return "float32" if self.kind == "f32" else "bfloat16"

    @property
    def padded_out_features(self) -> int:
        """P * NR: the width of the kernel's output rows."""
        return int(self.panels.shape[0] * self.panels.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the panels: what one call reads from memory."""
        return int(self.panels.nbytes)

    @property
    def path(self) -> str:
        """The kernel's name for notes, e.g. "avx512 float32" or "avx512 bfloat16 (vdpbf16ps)"."""
        how = {"f32": "float32", "bf16": "bfloat16 (widened)", "dpbf16": "bfloat16 (vdpbf16ps)"}[self.kind]
        return f"{self.isa} {how}"


def _variant(variant: SimdVariant | None) -> SimdVariant:
    found = variant if variant is not None else compiled_variant()
    if found is None:
        raise ValueError("no packed kernel for this CPU (no AVX2, AVX-512 or NEON variant): use NumPy")
    return found


def pack_weight(
    weight: npt.NDArray[Any], dtype: str = "float32", variant: SimdVariant | None = None
) -> PackedWeight:
    """Pack W `[N, K]` (float32, or any float when dtype is "bfloat16") into the panels of the variant
    `variant` (default `isa.compiled_variant()`). Copies; W is left as it is. bfloat16 rounds to
    nearest even.

    Raises ValueError for a weight that is not a non-empty 2-D array (float32 for dtype "float32"), a
    dtype outside WEIGHT_DTYPES, or no variant.
    """
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    floating = np.issubdtype(weight.dtype, np.floating)
    if (
        weight.ndim != 2
        or 0 in weight.shape
        or not floating
        or (dtype == "float32" and weight.dtype != np.float32)
    ):
        raise ValueError(f"weight must be a non-empty float32 [N, K], got {weight.dtype} {weight.shape}")
    simd = _variant(variant)
    kind = "f32" if dtype == "float32" else ("dpbf16" if simd.bf16_dot else "bf16")
    _, nr, _, _ = _jit.PANEL_SPECS[(simd.isa, kind)]
    n, k = weight.shape
    p = -(-n // nr)
    if kind == "f32":
        padded = np.zeros((p * nr, k), dtype=np.float32)  # [P NR, K]
        padded[:n] = weight
        panels = np.ascontiguousarray(padded.reshape(p, nr, k).transpose(0, 2, 1))  # [P, K, NR]
    else:
        k2 = -(-k // 2)
        padded16 = np.zeros((p * nr, 2 * k2), dtype=np.uint16)  # [P NR, 2 K2]
        padded16[:n, :k] = bfloat16_bits(weight)
        panels = np.ascontiguousarray(padded16.reshape(p, nr, k2, 2).transpose(0, 2, 1, 3))  # [P, K2, NR, 2]
    return PackedWeight(panels, n, k, simd.isa, kind)


def unpack_weight(packed: PackedWeight) -> F32Array:
    """W `[N, K]` as float32, back from its panels (bfloat16 widened exactly; for oracles and tests)."""
    n, k = packed.out_features, packed.in_features
    if packed.kind == "f32":
        p, _, nr = packed.panels.shape
        dense = packed.panels.transpose(0, 2, 1).reshape(p * nr, k)
    else:
        p, k2, nr, _ = packed.panels.shape
        dense = bfloat16_to_float32(packed.panels.transpose(0, 2, 1, 3).reshape(p * nr, 2 * k2))
    return np.ascontiguousarray(dense[:n, :k])


def packed_linear_into(x: F32Array, packed: PackedWeight, out: F32Array, threads: int = 1) -> None:
    """The hot path of `packed_linear`: no checks, no allocation (except a padded copy of x for
    bfloat16 panels of odd K).

    x `[M, K]` float32 with unit-stride rows; out `[M, padded_out_features]` float32, unit-stride rows;
    anything else gives undefined results (reads or writes out of bounds). threads > 1: the panels
    split into chunks over that many of Numba's threads (`threads.row_split`; the calling thread's
    count must be at least `threads`, `threads.set_threads`); the result is bit-identical.
    """
    if packed.kind == "bf16" and packed.in_features % 2:
        x = np.pad(x, ((0, 0), (0, 1)))  # the widening kernel reads x in pairs
    kernel = cast(Callable[..., None], _jit.ENTRY_POINTS[(packed.isa, packed.kind)])
    panels = packed.panels.shape[0]
    if threads == 1 or panels == 1:
        kernel(x, packed.panels, out)
        return
    nr = packed.panels.shape[2]
    row_split(kernel)(x, packed.panels, out, chunk_rows(panels, threads), nr, threads)


def packed_linear(x: npt.NDArray[Any], packed: PackedWeight, threads: int = 1) -> F32Array:
    """y = x W^T: x `[M, K]` float32 -> `[M, N]` float32, C-contiguous.

    float32 panels: sums run over k in order, one float32 FMA per term; the result differs from
    NumPy's in the last bits only. bfloat16 panels: W as rounded to bfloat16, x as given (widening) or
    rounded to bfloat16 (`vdpbf16ps`). threads: as `packed_linear_into` (the same result for every
    count). Raises ValueError for an x that is not float32 `[M, K]`.
    """
    if x.ndim != 2 or x.dtype != np.float32 or x.shape[1] != packed.in_features:
        raise ValueError(f"x must be float32 [M, {packed.in_features}], got {x.dtype} {x.shape}")
    rows = np.ascontiguousarray(x)
    out = np.empty((x.shape[0], packed.padded_out_features), dtype=np.float32)  # [M, P NR]
    packed_linear_into(rows, packed, out, threads)
    if packed.padded_out_features == packed.out_features:
        return out
    return np.ascontiguousarray(out[:, : packed.out_features])  # [M, N]


def prepare_packed_linear(dtype: str = "float32", variant: SimdVariant | None = None) -> float:
    """Compile (or load from Numba's disk cache) the kernel of `dtype`'s weights now; returns the
    seconds that took. One call on a one-panel weight with 15 rows, so every tile height is compiled."""
    start = time.perf_counter()
    packed = pack_weight(np.zeros((4, 4), dtype=np.float32), dtype, variant)
    packed_linear(np.zeros((15, 4), dtype=np.float32), packed)
    return time.perf_counter() - start


def fma_probe(seconds: float = 0.01, variant: SimdVariant | None = None) -> float:
    """FLOP/s of float32 FMAs in registers (independent chains of the variant's vectors,
    `_gemm_jit.FMA_PROBES`), one thread, wall clock.

    A short calibration call sizes the timed call to take about `seconds`; on a shared machine, give
    it the duration of what it is compared with, so both see the same share of the CPU. The ceiling
    a compute-bound float32 kernel on this core can reach. Raises ValueError for seconds <= 0 or no
    kernel variant for this CPU.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    isa = _variant(variant).isa
    rounds_of = cast(Callable[[int, np.float32], float], _jit.FMA_ENTRY_POINTS[isa])
    lanes, chains = _jit.FMA_PROBES[isa]
    calibration = 20_000  # about 10 M flops: 0.1 ms at 100 GFLOP/s
    start = time.perf_counter()
    rounds_of(calibration, np.float32(1.0))  # compiles or loads on the first call
    rate = calibration / max(time.perf_counter() - start, 1e-9)  # rounds per second, roughly
    rounds = max(1000, int(rate * seconds))
    start = time.perf_counter()
    rounds_of(rounds, np.float32(1.0))
    return rounds * 2 * lanes * chains / (time.perf_counter() - start)
