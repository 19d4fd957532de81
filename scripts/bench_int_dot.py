"""Integer-dot block kernels against the float32-activation ones, one thread, one weight in cache.

y = x W^T for W [1536, 576] (the real model's gate_up shape, N x K) in Q4_1 and Q8_0, x at M = 1, 8,
32 rows: `block_gemm.block_linear_into` (each block decoded to float32 for the rows of x) against
`block_gemm_int.int_linear_into` (x quantized to Q8_1 / Q8_0 once per call, included, then integer
dot products). Each figure is the best of 7 rounds of 100 calls, microseconds per call; the two
paths alternate within a round.

    OPENBLAS_NUM_THREADS=1 uv run python scripts/bench_int_dot.py
"""

from __future__ import annotations

import time

import numpy as np

from attention_kv_caceh.kernels.block_formats import quantize_weight
from attention_kv_caceh.kernels.block_gemm import block_linear_into, block_weight
from attention_kv_caceh.kernels.block_gemm_int import int_linear_into


def main() -> None:
    rng = np.random.default_rng(0)
    n, k = 1536, 576
    w = rng.standard_normal((n, k)).astype(np.float32)
    for fmt in ("q4_1", "q8_0", "q5_0"):
        weight = block_weight(quantize_weight(w, fmt), fmt)
        for m in (1, 8, 32):
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = np.empty((m, n), dtype=np.float32)
            best: dict[str, float] = {}
            for _ in range(7):
                for name, fn in (("float-activation", block_linear_into), ("integer", int_linear_into)):
                    fn(x, weight, out)
                    start = time.perf_counter()
                    for _ in range(100):
                        fn(x, weight, out)
                    best[name] = min(best.get(name, 1e9), (time.perf_counter() - start) / 100 * 1e6)
            cells = "  ".join(f"{name} {us:7.1f} us" for name, us in best.items())
            print(f"{weight.isa} {fmt} M={m:2d}  {cells}")


if __name__ == "__main__":
    main()
