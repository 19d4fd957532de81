"""Time the paged decode attention kernel alone at the engine's shapes: one decode step of all layers.

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 uv run python scripts/bench_paged_decode.py --num-seqs 8 32

Shapes as the `small` preset's engine: `--layers` KV caches (default 12), each as the engine allocates
it (`model_executor.paged_attention.allocate_kv_cache`: block size 16, H_kv=4, D=64, float32), H=12 query
heads, every sequence `--context-len` positions (default 192, the mean context of 128 prompt + 128
output tokens) in blocks drawn in shuffled order from a pool twice the size needed, as the engine's
block tables scatter them. One step calls `paged_decode_attention_into` once per layer, on one thread.
Before timing, the first layer's output is checked against a float64 softmax(q K^T / sqrt(D)) V per
sequence and head. Steps alternate with a read probe (`np.dot` over a float32 buffer of the bytes a
step reads), so both see the same load; CPU time of this thread (a shared machine's other processes do
not count). Prints, per batch, the median and minimum step (ms), the KV bytes a step reads, the rate
that implies (the KV does not fit in the caches at 8 or more sequences, so this is a read from memory),
the probe's rate and the ratio of the two medians (1.0 = the kernel reads its KV as fast as np.dot).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from attention_kv_caceh.kernels.decode_attention import paged_decode_attention_into
from attention_kv_caceh.model_executor.paged_attention import allocate_kv_cache

H, H_KV, D, BLOCK_SIZE = 12, 4, 64, 16


def run(num_seqs: int, context_len: int, layers: int, repeats: int, seed: int) -> None:
    """Build the caches, check the first layer against float64, time `repeats` steps and probes; print."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = 2 * num_seqs * blocks_per_seq
    caches = []
    for _ in range(layers):
        k_cache, v_cache = allocate_kv_cache(num_blocks, BLOCK_SIZE, H_KV, D, np.float32)
        k_cache[...] = rng.standard_normal(k_cache.shape)
        v_cache[...] = rng.standard_normal(v_cache.shape)
        caches.append((k_cache, v_cache))
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
        keys = k_cache[chosen[b]].transpose(0, 3, 1, 2).reshape(-1, H_KV, D)[:context_len].astype(np.float64)
        values = (
            v_cache[chosen[b]].transpose(0, 2, 1, 3).reshape(-1, H_KV, D)[:context_len].astype(np.float64)
        )
        for h in range(H):
            j = h // (H // H_KV)
            s = keys[:, j] @ q[b, h].astype(np.float64) * scale  # [T]
            p = np.exp(s - s.max())
            worst = max(worst, float(np.abs(p @ values[:, j] / p.sum() - out[b, h]).max()))
    if worst > 1e-4:
        raise SystemExit(f"paged kernel differs from the float64 reference by {worst:.2e}")

    nbytes = num_seqs * context_len * H_KV * D * 4 * 2 * layers  # K and V a step reads
    probe = np.ones(nbytes // 4, np.float32)
    np.dot(probe, probe)  # touch the pages once
    steps: list[float] = []
    probes: list[float] = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for k_cache, v_cache in caches:
            paged_decode_attention_into(q, k_cache, v_cache, tables, lens, out, scale)
        steps.append((time.thread_time() - t0) * 1e3)
        t0 = time.thread_time()
        np.dot(probe, probe)
        probes.append((time.thread_time() - t0) * 1e3)
    median, probe_ms = statistics.median(steps), statistics.median(probes)
    print(
        f"{num_seqs} seqs, context {context_len}: step median {median:.2f} ms, min {min(steps):.2f} ms, "
        f"{nbytes / 1e6:.0f} MB of KV -> {nbytes / median / 1e6:.2f} GB/s; read probe {probe_ms:.2f} ms, "
        f"{nbytes / probe_ms / 1e6:.2f} GB/s; ratio {probe_ms / median:.2f} (max error vs float64 {worst:.1e})"
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
