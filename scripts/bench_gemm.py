"""Linear layers of a decode step, one thread: NumPy's x @ W.T against the packed kernels (and MKL's cblas).

y = x W^T for x [M, K] and W [N, K] (default the `small` preset's gate_up shape, 2048 x 768), at
M = 1, 2, 4, 8, 16, 32 rows, over COPIES different weights (100 MB of float32, beyond the last-level
cache, as a decode step streams its 400 MB) so that every call reads its weights from memory. The
paths: NumPy on float32, the packed kernel of this CPU's variant (`isa.compiled_variant`) on float32
and bfloat16 panels, and the block kernels on GGUF's Q8_0, Q4_0 and Q4_1 blocks (`--formats`). Each
figure is the median over rounds of this thread's CPU time per weight (time.thread_time: on a shared
machine, waiting for a core does not count), and its ratio to an np.dot read probe over the float32
weights' bytes timed in the same rounds (a format with fewer bytes can go below 1). Every path is
checked against the float64 product of x and the weights it holds before it is timed.

    OPENBLAS_NUM_THREADS=1 uv run python scripts/bench_gemm.py
    # the AVX2 variant on an AVX-512 CPU (everything compiled for AMD Zen 3):
    NUMBA_CPU_NAME=znver3 NUMBA_CPU_FEATURES= OPENBLAS_NUM_THREADS=1 uv run python scripts/bench_gemm.py
    # with MKL from Intel's `mkl` wheel in another environment (not a dependency of this project):
    OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 uv run python scripts/bench_gemm.py --mkl /path/to/libmkl_rt.so.3
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from attention_kv_caceh.kernels import block_formats, block_gemm, dispatch, gemm
from attention_kv_caceh.kernels.isa import compiled_variant

COPIES = 16
ROWS = (1, 2, 4, 8, 16, 32)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even)."""
    b = a.view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def mkl_paths(lib_path: str, weights: list[np.ndarray]) -> dict[str, Callable[[np.ndarray, int], np.ndarray]]:
    """cblas_sgemm, sgemm on a B packed once (cblas_sgemm_pack / _compute) and cblas_gemm_bf16bf16f32."""
    mkl = ctypes.CDLL(lib_path)
    mkl.MKL_Set_Num_Threads(1)
    p, f, i = ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    row_major, no_trans, trans, packed_b, b_matrix = 101, 111, 112, 151, 162
    mkl.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    mkl.cblas_gemm_bf16bf16f32.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    mkl.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    mkl.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
    mkl.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    mkl.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    n, k = weights[0].shape
    size = mkl.cblas_sgemm_pack_get_size(b_matrix, 1, n, k)
    packs = []
    for w in weights:
        buf = np.empty(size // 4 + 16, np.float32)
        mkl.cblas_sgemm_pack(row_major, b_matrix, trans, 32, n, k, 1.0, w.ctypes.data, k, buf.ctypes.data)
        packs.append(buf)
    halves = [bf16_bits(w) for w in weights]

    def sgemm(x: np.ndarray, j: int) -> np.ndarray:
        y = np.empty((x.shape[0], n), np.float32)
        mkl.cblas_sgemm(row_major, no_trans, trans, x.shape[0], n, k, 1.0, x.ctypes.data, k,
                        weights[j].ctypes.data, k, 0.0, y.ctypes.data, n)  # fmt: skip
        return y

    def sgemm_packed(x: np.ndarray, j: int) -> np.ndarray:
        y = np.empty((x.shape[0], n), np.float32)
        mkl.cblas_sgemm_compute(row_major, no_trans, packed_b, x.shape[0], n, k, x.ctypes.data, k,
                                packs[j].ctypes.data, k, 0.0, y.ctypes.data, n)  # fmt: skip
        return y

    def bf16(x: np.ndarray, j: int) -> np.ndarray:
        y = np.empty((x.shape[0], n), np.float32)
        xb = bf16_bits(x)
        mkl.cblas_gemm_bf16bf16f32(row_major, no_trans, trans, x.shape[0], n, k, 1.0, xb.ctypes.data, k,
                                   halves[j].ctypes.data, k, 0.0, y.ctypes.data, n)  # fmt: skip
        return y

    return {"MKL cblas_sgemm": sgemm, "MKL sgemm, B packed": sgemm_packed, "MKL bf16bf16f32": bf16}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=2048, help="output features N")
    parser.add_argument("--k", type=int, default=768, help="input features K")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (median)")
    parser.add_argument("--mkl", default=None, metavar="LIB", help="path to libmkl_rt.so.3 (default: no MKL)")
    parser.add_argument(
        "--formats",
        nargs="+",
        default=list(dispatch.WEIGHT_FORMATS),
        choices=list(dispatch.WEIGHT_FORMATS),
        help="weight formats of the packed paths",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    simd = compiled_variant()
    weights = [rng.standard_normal((args.n, args.k), dtype=np.float32) for _ in range(COPIES)]
    paths: dict[str, Callable[[np.ndarray, int], Any]] = {"numpy x @ W.T": lambda x, j: x @ weights[j].T}
    stored: dict[str, np.ndarray] = {"numpy x @ W.T": weights[0]}  # W as each path holds it, for the oracle
    for fmt in args.formats if simd is not None else []:
        if fmt in block_formats.BLOCK_FORMATS:
            blocks = [block_gemm.block_weight(block_formats.quantize_weight(w, fmt), fmt) for w in weights]
            name = f"blocks {blocks[0].path}"
            paths[name] = lambda x, j, b=blocks: block_gemm.block_linear(x, b[j])
            stored[name] = block_formats.dequantize_blocks(blocks[0].blocks, fmt)
        else:
            packs = [gemm.pack_weight(w, fmt) for w in weights]
            name = f"packed {packs[0].path}"
            paths[name] = lambda x, j, p=packs: gemm.packed_linear(x, p[j])
            stored[name] = gemm.unpack_weight(packs[0])
    if args.mkl:
        paths |= mkl_paths(args.mkl, weights)
    for name, path in paths.items():  # the oracle before any timing
        for m in ROWS:
            x = rng.standard_normal((m, args.k), dtype=np.float32)
            want = x.astype(np.float64) @ stored.get(name, weights[0]).T.astype(np.float64)
            err = float(np.abs(path(x, 0) - want).max() / np.abs(want).max())
            limit = 2**-8 * 4 if "bf16" in name or "vdpbf16ps" in name else 1e-5  # x read as bfloat16 there
            if err > limit:
                raise SystemExit(f"{name} at M={m}: relative error {err:.1e} over {limit:.1e}")
    probe = np.ones(args.n * args.k * COPIES, np.float32)
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for m in ROWS:
            x = rng.standard_normal((m, args.k), dtype=np.float32)
            for name, path in paths.items():
                start = time.thread_time()
                for j in range(COPIES):
                    path(x, j)
                samples.setdefault((name, m), []).append((time.thread_time() - start) * 1e3 / COPIES)
        start = time.thread_time()
        np.dot(probe, probe)
        samples.setdefault(("probe", 0), []).append((time.thread_time() - start) * 1e3 / COPIES)
    probe_ms = float(np.median(samples[("probe", 0)]))
    variant = simd.describe() if simd is not None else "no packed kernel for this CPU"
    print(f"W [{args.n}, {args.k}], {COPIES} copies; {variant}; read probe over the float32 weights "
          f"{probe_ms:.3f} ms per weight ({4 * args.n * args.k / probe_ms / 1e6:.1f} GB/s); "
          "CPU ms per call (ratio to the probe)")  # fmt: skip
    print(f"| path | {' | '.join(f'M={m}' for m in ROWS)} |")
    print(f"| --- |{' --- |' * len(ROWS)}")
    for name in paths:
        cells = [float(np.median(samples[(name, m)])) for m in ROWS]
        print(f"| {name} | {' | '.join(f'{c:.3f} ({c / probe_ms:.2f})' for c in cells)} |")


if __name__ == "__main__":
    main()
