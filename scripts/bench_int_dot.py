"""Integer-dot block kernels against the float32-activation ones, one thread, one weight in cache.

y = x W^T for W [1536, 576] (the real model's gate_up shape, N x K) in Q4_1, Q8_0 and Q5_0, x at M = 1, 8,
32 rows: `block_gemm.block_linear_into` (each block decoded to float32 for the rows of x) against
`block_gemm_int.int_linear_into` (x quantized to Q8_1 / Q8_0 once per call, included, then integer
dot products). Each figure is the best of 7 rounds of 100 calls, microseconds per call; the two
paths alternate within a round.

With --kquants: W [576, 1536] (the real model's down_proj shape, K = 1536 = 6 super-blocks) in each
k-quant (Q4_K, Q6_K, Q5_K, Q2_K, Q3_K), random blocks with finite float16 scales (the k-quants have
no quantizer here), x quantized to Q8_K once per call (included).

    OPENBLAS_NUM_THREADS=1 uv run python scripts/bench_int_dot.py [--kquants]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from attention_kv_caceh.kernels import _block_gemm_kquant_int_jit as kquant
from attention_kv_caceh.kernels.block_formats import FORMATS, quantize_weight
from attention_kv_caceh.kernels.block_gemm import block_linear_into, block_weight
from attention_kv_caceh.kernels.block_gemm_int import int_linear_into


def random_kquant_blocks(rng: np.random.Generator, fmt: str, n: int, k: int) -> np.ndarray:
    """Blocks uint8 `[N, K / 256 * bytes]` of random bytes whose float16 fields (d, dmin) are finite."""
    row = FORMATS[fmt]
    raw = rng.integers(0, 256, size=(n, k // row.block, row.nbytes), dtype=np.uint8)
    for field in row.half_fields:
        at = row.field_offset(field)
        scale = (rng.standard_normal(raw.shape[:2]) * 1e-3).astype("<f2")
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def main() -> None:
    rng = np.random.default_rng(0)
    if "--kquants" in sys.argv[1:]:
        n, k = 576, 1536
        weights = [
            block_weight(random_kquant_blocks(rng, fmt, n, k), fmt) for fmt in kquant.KQUANT_INT_FORMATS
        ]
    else:
        n, k = 1536, 576
        w = rng.standard_normal((n, k)).astype(np.float32)
        weights = [block_weight(quantize_weight(w, fmt), fmt) for fmt in ("q4_1", "q8_0", "q5_0")]
    for weight in weights:
        fmt = weight.format
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
