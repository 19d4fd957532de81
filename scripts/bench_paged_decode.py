"""Time the paged decode attention kernel alone at the engine's shapes: one decode step of all layers.

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 uv run python scripts/bench_paged_decode.py --num-seqs 8 32

Shapes as the `small` preset's engine: `--layers` KV caches (default 12), each K and V
`[num_blocks, block_size=16, H_kv=4, D=64]` float32, H=12 query heads, every sequence `--context-len`
positions (default 192, the mean context of 128 prompt + 128 output tokens) in blocks drawn in shuffled
order from a pool twice the size needed, as the engine's block tables scatter them. One step calls
`paged_decode_attention_into` once per layer, on one thread. Before timing, the first layer's output
is checked against a float64 softmax(q K^T / sqrt(D)) V per sequence and head. Prints, per batch, the
median and minimum step time over `--repeats` steps (ms), the KV bytes a step reads and the rate that
implies (the KV does not fit in the caches at 8 or more sequences, so this is a read from memory), and
the median time of one layer repeated (its KV then partly in cache) times the number of layers.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from attention_kv_caceh.kernels import paged_decode_attention_into

H, H_KV, D, BLOCK_SIZE = 12, 4, 64, 16


def run(num_seqs: int, context_len: int, layers: int, repeats: int, seed: int) -> None:
    """Build the caches, check the first layer against float64, time `repeats` steps; print one block."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = 2 * num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, H_KV, D)
    caches = [
        (rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32))
        for _ in range(layers)
    ]
    chosen = rng.permutation(num_blocks)[: num_seqs * blocks_per_seq].reshape(num_seqs, blocks_per_seq)
    tables = np.full((num_seqs, blocks_per_seq + 2), -1, np.int32)  # padded with -1, as the engine's
    tables[:, :blocks_per_seq] = chosen
    lens = np.full(num_seqs, context_len, np.int32)
    q = rng.standard_normal((num_seqs, H, D)).astype(np.float32)
    out = np.empty_like(q)
    scale = 1.0 / math.sqrt(D)

    k_cache, v_cache = caches[0]
    paged_decode_attention_into(q, k_cache, v_cache, tables, lens, out, scale)
    worst = 0.0
    for b in range(num_seqs):
        keys = k_cache[chosen[b]].reshape(-1, H_KV, D)[:context_len].astype(np.float64)  # [T, H_kv, D]
        values = v_cache[chosen[b]].reshape(-1, H_KV, D)[:context_len].astype(np.float64)
        for h in range(H):
            j = h // (H // H_KV)
            s = keys[:, j] @ q[b, h].astype(np.float64) * scale  # [T]
            p = np.exp(s - s.max())
            worst = max(worst, float(np.abs(p @ values[:, j] / p.sum() - out[b, h]).max()))
    if worst > 1e-4:
        raise SystemExit(f"paged kernel differs from the float64 reference by {worst:.2e}")

    steps: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k_cache, v_cache in caches:
            paged_decode_attention_into(q, k_cache, v_cache, tables, lens, out, scale)
        steps.append((time.perf_counter() - t0) * 1e3)
    one: list[float] = []
    k_cache, v_cache = caches[0]
    for _ in range(4 * repeats):
        t0 = time.perf_counter()
        paged_decode_attention_into(q, k_cache, v_cache, tables, lens, out, scale)
        one.append((time.perf_counter() - t0) * 1e3)
    mb = num_seqs * context_len * H_KV * D * 4 * 2 * layers / 1e6
    median = statistics.median(steps)
    print(
        f"{num_seqs} seqs, context {context_len}: step median {median:.2f} ms, min {min(steps):.2f} ms, "
        f"{mb:.0f} MB of KV -> {mb / median:.2f} GB/s; one layer repeated x{layers}: "
        f"{layers * statistics.median(one):.2f} ms (max error vs float64 {worst:.1e})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[8, 32], help="sequences per decode step")
    parser.add_argument("--context-len", type=int, default=192, help="positions each sequence attends")
    parser.add_argument("--layers", type=int, default=12, help="layers (one KV cache each) per step")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps after the oracle check")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs and the block tables, >= 0")
    args = parser.parse_args()
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    for n in args.num_seqs:
        if n < 1 or args.context_len < 1 or args.layers < 1 or args.repeats < 1:
            parser.error("--num-seqs, --context-len, --layers and --repeats must be >= 1")
        run(n, args.context_len, args.layers, args.repeats, args.seed)


if __name__ == "__main__":
    main()
