"""Compiled linear layer (Numba): y = x W^T with the weight packed once, read once for all rows of x.

A decode step of B sequences multiplies B rows of activations by every weight matrix. Reading the
weights costs the same for any B, and each weight serves 2 B flops, so up to B of about (FMA peak /
read bandwidth) the step should cost what B = 1 costs. NumPy's `x @ W.T` (OpenBLAS, one thread) does
not get there: for 2 to 8 rows it packs (copies) W on every call and runs several times slower than
for one row. This module packs W once, at load, into the layout its kernel reads, and the kernel
streams each packed row once for all rows of x (the loop and the layout: `_gemm_jit`).

Layout (legend: M rows of x, K input features, N output features, NR = PANEL_WIDTH): W `[N, K]`
(Hugging Face's `[out, in]`) becomes panels `[ceil(N / NR), K, NR]`, panel p = W[p NR : (p + 1) NR]^T,
zero-padded when NR does not divide N. float32 only; the model's float64 path (the equivalence tests')
stays NumPy. NumPy's `x @ W.T` in float64 is the oracle the tests hold this kernel to.

The kernel is written for AVX-512 (32 vector registers of 16 float32); LLVM compiles the same IR for
any CPU, but where AVX-512F is missing the engine keeps NumPy (`packed_path_available`), since nothing
here was measured elsewhere. `fma_probe` times the same FMA instruction in registers only: the FLOP/s
ceiling that `bench-engine` reports the linear layers against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from attention_kv_caceh import _gemm_jit as _jit

__all__ = [
    "PANEL_WIDTH",
    "PackedWeight",
    "fma_probe",
    "pack_weight",
    "packed_linear",
    "packed_linear_into",
    "packed_path_available",
    "prepare_packed_linear",
    "unpack_weight",
]

PANEL_WIDTH: int = _jit.PANEL_WIDTH
F32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class PackedWeight:
    """A float32 weight `[N, K]` stored as panels `[P, K, PANEL_WIDTH]`, P = ceil(N / PANEL_WIDTH).

    out_features: N (the panels' last P * PANEL_WIDTH - N columns are zero padding).
    """

    panels: F32Array
    out_features: int

    @property
    def in_features(self) -> int:
        """K."""
        return int(self.panels.shape[1])

    @property
    def padded_out_features(self) -> int:
        """P * PANEL_WIDTH: the width of the kernel's output rows."""
        return int(self.panels.shape[0] * self.panels.shape[2])


def pack_weight(weight: npt.NDArray[Any]) -> PackedWeight:
    """Pack W `[N, K]` float32 into panels (module docstring). Copies; W is left as it is.

    Raises ValueError for a weight that is not a 2-D float32 array with N, K >= 1.
    """
    if weight.ndim != 2 or weight.dtype != np.float32 or 0 in weight.shape:
        raise ValueError(f"weight must be a non-empty float32 [N, K], got {weight.dtype} {weight.shape}")
    n, k = weight.shape
    p = -(-n // PANEL_WIDTH)
    padded = np.zeros((p * PANEL_WIDTH, k), dtype=np.float32)  # [P NR, K]
    padded[:n] = weight
    panels = np.ascontiguousarray(padded.reshape(p, PANEL_WIDTH, k).transpose(0, 2, 1))  # [P, K, NR]
    return PackedWeight(panels, n)


def unpack_weight(packed: PackedWeight) -> F32Array:
    """W `[N, K]` back from its panels (for oracles and tests)."""
    p, k, nr = packed.panels.shape
    return np.ascontiguousarray(packed.panels.transpose(0, 2, 1).reshape(p * nr, k)[: packed.out_features])


def packed_linear_into(x: F32Array, packed: PackedWeight, out: F32Array) -> None:
    """The hot path of `packed_linear`: no checks, no allocation.

    x `[M, K]` float32 with unit-stride rows; out `[M, padded_out_features]` float32, C-contiguous rows;
    anything else gives undefined results (reads or writes out of bounds).
    """
    _jit.packed_matmul(x, packed.panels, out)


def packed_linear(x: npt.NDArray[Any], packed: PackedWeight) -> F32Array:
    """y = x W^T: x `[M, K]` float32 -> `[M, N]` float32, C-contiguous.

    Sums run over k in order, one float32 FMA per term (no reassociation); the result differs from
    NumPy's in the last bits only. Raises ValueError for an x that is not float32 `[M, K]`.
    """
    if x.ndim != 2 or x.dtype != np.float32 or x.shape[1] != packed.in_features:
        raise ValueError(f"x must be float32 [M, {packed.in_features}], got {x.dtype} {x.shape}")
    rows = np.ascontiguousarray(x)
    out = np.empty((x.shape[0], packed.padded_out_features), dtype=np.float32)  # [M, P NR]
    packed_linear_into(rows, packed, out)
    if packed.padded_out_features == packed.out_features:
        return out
    return np.ascontiguousarray(out[:, : packed.out_features])  # [M, N]


def prepare_packed_linear() -> float:
    """Compile (or load from Numba's disk cache) the kernel now; returns the seconds that took.

    One call on a one-panel weight with 15 rows, so every tile height (8, 4, 2, 1) is compiled.
    """
    start = time.perf_counter()
    packed = pack_weight(np.zeros((PANEL_WIDTH, 4), dtype=np.float32))
    packed_linear(np.zeros((15, 4), dtype=np.float32), packed)
    return time.perf_counter() - start


def packed_path_available() -> tuple[bool, str]:
    """Whether this CPU runs the packed kernel (AVX-512F), and a short reason for the note."""
    try:
        from llvmlite import binding

        features = cast(dict[str, bool], binding.get_host_cpu_features())
        has = bool(features.get("avx512f", False))
        cpu = str(binding.get_host_cpu_name())
    except Exception as exc:  # llvmlite cannot read the host CPU: keep NumPy
        return False, f"host CPU features unreadable ({exc})"
    return has, f"{cpu}, AVX-512F {'present' if has else 'missing'}"


def fma_probe(seconds: float = 0.01) -> float:
    """FLOP/s of float32 FMAs in registers (16 independent 16-lane chains), one thread, wall clock.

    A short calibration call sizes the timed call to take about `seconds`; on a shared machine, give
    it the duration of what it is compared with, so both see the same share of the CPU. The ceiling
    a compute-bound float32 kernel on this core can reach. Raises ValueError for seconds <= 0.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    calibration = 20_000  # 10 M flops: 0.1 ms at 100 GFLOP/s
    start = time.perf_counter()
    _jit.fma_rounds(calibration, np.float32(1.0))  # compiles or loads on the first call
    rate = calibration / max(time.perf_counter() - start, 1e-9)  # rounds per second, roughly
    rounds = max(1000, int(rate * seconds))
    start = time.perf_counter()
    _jit.fma_rounds(rounds, np.float32(1.0))
    return rounds * 512 / (time.perf_counter() - start)
