"""Decode-step read bandwidth: the NumPy path, the fused Numba kernel (contiguous and paged) and, where
torch is importable, torch's SDPA, against the scan's read probe, on the scan's own arrays.

    uv run python scripts/bench_kernels.py            # large shape, then the scan's default shape
    uv run python scripts/bench_kernels.py --rounds 3 --repeats 5   # quicker

Shapes: "large" is B=4, H=H_kv=8, T=4096, D=128, float32 with a preallocated cache; "default"
is the scan's default (B = 1, 2, 4, 8; H=H_kv=1; T=128; D=64; float32; dynamic cache). Inputs and caches
are built exactly as experiments/scan.py builds them; every step is checked against the NumPy step
before anything is timed. Methods are timed in alternating rounds (round-robin, `--repeats` calls each
per round, the cache rewound outside the timed region) and the median over all rounds is reported,
by wall clock (as the scan) and by this thread's CPU time (less sensitive to a loaded machine).
The paged kernel reads the same K/V scattered into shuffled blocks of `--block-size` positions; it
times the attention only (the engine appends through its slot mapping, not timed here).
Prints a table per shape and one JSON object on the last line. Compile time is paid before timing
and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from attention_kv_caceh.attention import multihead_decode_step
from attention_kv_caceh.cache import make_cache
from attention_kv_caceh.experiments.fused import FusedDecodeStep, torch_sdpa_available, torch_sdpa_step
from attention_kv_caceh.experiments.scan import ScanConfig, build_inputs, kv_bytes_per_step
from attention_kv_caceh.kernels.decode_attention import (
    compile_seconds,
    paged_decode_attention,
    paged_decode_attention_into,
    prepare_paged_decode_attention,
)
from attention_kv_caceh.model_executor.paged_attention import pack_kv_blocks
from attention_kv_caceh.oracle import check_close, tolerance_for

SHAPES = {
    "large": ScanConfig(
        batch_sizes=(4,), num_heads=8, num_kv_heads=8, seq_len=4096, head_dim=128, cache="preallocated"
    ),
    "default": ScanConfig(),
}


def to_paged(keys: np.ndarray, values: np.ndarray, block_size: int, seed: int) -> tuple[np.ndarray, ...]:
    """[B, H_kv, T, D] -> the engine's k/v_cache (`pack_kv_blocks`) in shuffled blocks, block_tables,
    context_lens."""
    b, h_kv, t, d = keys.shape
    per_seq = -(-t // block_size)
    ids = np.random.default_rng(seed).permutation(b * per_seq).astype(np.int32)
    tables = ids.reshape(b, per_seq)  # [B, max_blocks]
    k_cache = np.zeros((b * per_seq, block_size, h_kv, d), keys.dtype)
    v_cache = np.zeros_like(k_cache)
    padded = per_seq * block_size
    for src, dst in ((keys, k_cache), (values, v_cache)):
        rows = np.zeros((b, h_kv, padded, d), keys.dtype)
        rows[:, :, :t] = src
        blocks = rows.reshape(b, h_kv, per_seq, block_size, d).transpose(
            0, 2, 3, 1, 4
        )  # [B, nb, BS, H_kv, D]
        dst[tables.reshape(-1)] = blocks.reshape(-1, block_size, h_kv, d)
    return *pack_kv_blocks(k_cache, v_cache), tables, np.full(b, t, np.int32)


def bench_batch(config: ScanConfig, b: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build the scan's inputs and cache for batch size b, check every method, then time them."""
    inputs = build_inputs(config)
    t = config.seq_len
    q_t, k_t, v_t = (np.ascontiguousarray(x[:b]) for x in (inputs.q_t, inputs.k_t, inputs.v_t))
    max_len = t + 1 + args.extra_capacity
    cache = make_cache(
        config.cache, b, config.num_kv_heads, config.head_dim, max_seq_len=max_len, dtype=config.dtype
    )
    cache.append(np.ascontiguousarray(inputs.k_prefix[:b]), np.ascontiguousarray(inputs.v_prefix[:b]))

    def rewind() -> None:
        cache.truncate(t)

    expected, _ = multihead_decode_step(q_t, k_t, v_t, cache)  # [B, H, 1, D]
    keys, values = np.ascontiguousarray(cache.keys), np.ascontiguousarray(cache.values)  # [B, H_kv, T+1, D]
    rtol, atol = tolerance_for(config.dtype, config.head_dim + t + 1)
    rewind()
    fused = FusedDecodeStep(q_t, threads=args.threads)
    fused.prepare(q_t, k_t, v_t, cache)  # compile outside the timed region
    check_close(fused(q_t, k_t, v_t, cache), expected, rtol=rtol, atol=atol, what="fused")
    methods: dict[str, Callable[[], object]] = {
        "numpy": lambda: multihead_decode_step(q_t, k_t, v_t, cache),
        "fused": lambda: fused(q_t, k_t, v_t, cache),
    }
    k_cache, v_cache, tables, lens = to_paged(keys, values, args.block_size, config.seed)
    q_rows, out_rows = q_t[:, :, 0], np.empty_like(q_t[:, :, 0])
    prepare_paged_decode_attention(q_rows, k_cache, v_cache, tables, lens, out_rows, args.threads)
    paged = paged_decode_attention(q_rows, k_cache, v_cache, tables, lens)
    check_close(paged, expected[:, :, 0], rtol=rtol, atol=atol, what="paged")
    scale = 1.0 / np.sqrt(config.head_dim)
    methods["paged"] = lambda: paged_decode_attention_into(
        q_rows, k_cache, v_cache, tables, lens, out_rows, scale, args.threads
    )
    if torch_sdpa_available():
        step = torch_sdpa_step(args.threads)
        rewind()
        check_close(step(q_t, k_t, v_t, cache), expected, rtol=rtol, atol=atol, what="torch")
        methods["torch"] = lambda: step(q_t, k_t, v_t, cache)
    nbytes = kv_bytes_per_step(config, b)
    probe = np.ones(nbytes // np.dtype(config.dtype).itemsize, dtype=config.dtype)
    methods = {"probe": lambda: np.dot(probe, probe), **methods}

    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            for i in range(args.warmup + args.repeats):
                rewind()
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                fn()
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                if i >= args.warmup:
                    wall[name].append((w1 - w0) / 1e6)
                    cpu[name].append((c1 - c0) / 1e6)
    row: dict[str, Any] = {"B": b, "T": t + 1, "kv_bytes": nbytes}
    for clock, samples in (("wall", wall), ("cpu", cpu)):
        probe_ms = statistics.median(samples["probe"])
        for name, ms in samples.items():
            med = statistics.median(ms)
            row[f"{name}_{clock}_ms"] = med
            row[f"{name}_{clock}_gb_s"] = nbytes / med / 1e6
            row[f"{name}_{clock}_vs_probe"] = probe_ms / med
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["large", "default"])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds over all methods")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per method per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per method per round")
    parser.add_argument("--threads", type=int, default=1, help="Numba and torch threads")
    parser.add_argument("--block-size", type=int, default=16, help="paged KV block size")
    parser.add_argument(
        "--extra-capacity",
        type=int,
        default=0,
        help="preallocated cache positions beyond T+1 (0 = the scan's)",
    )
    args = parser.parse_args()
    print(
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}  threads={args.threads}  "
        f"torch={'yes' if torch_sdpa_available() else 'no'}  cpus={os.cpu_count()}  "
        f"load average={os.getloadavg()[0]:.1f}"
    )
    rows: list[dict[str, Any]] = []
    for shape in args.shapes:
        config = SHAPES[shape]
        for b in config.batch_sizes:
            row = {"shape": shape, **bench_batch(config, b, args)}
            rows.append(row)
            names = [k[: -len("_wall_ms")] for k in row if k.endswith("_wall_ms")]
            print(f"\n{shape}: B={b} T={row['T']} kv bytes/step={row['kv_bytes'] / 1e6:.2f} MB")
            print(
                f"{'method':>8} {'wall ms':>9} {'GB/s':>7} {'/probe':>7} {'cpu ms':>9} {'GB/s':>7} {'/probe':>7}"
            )
            for name in names:
                print(
                    f"{name:>8} {row[f'{name}_wall_ms']:9.4f} {row[f'{name}_wall_gb_s']:7.2f} "
                    f"{row[f'{name}_wall_vs_probe']:7.2f} {row[f'{name}_cpu_ms']:9.4f} "
                    f"{row[f'{name}_cpu_gb_s']:7.2f} {row[f'{name}_cpu_vs_probe']:7.2f}"
                )
    print(f"\ncompile/load seconds: {compile_seconds()}")
    print(json.dumps({"rows": rows, "compile_seconds": compile_seconds()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
