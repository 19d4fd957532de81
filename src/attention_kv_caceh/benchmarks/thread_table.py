"""`bench-engine --threads 1 2 ...`: the engine benchmark at several thread counts, and the table that compares them.

Each thread count runs `engine.run_engine_benchmark` whole (every max_num_seqs, each on a fresh engine
of that many threads, the model loaded again), with the read probe on as many threads
(`probes.read_probe`), so each row's bytes-per-step rate is set against what that many threads can
read. `thread_table_rows` keeps, per (threads, max_num_seqs), the numbers the table prints.

Left out: vLLM's benchmarks have no thread sweep (its CPU backend takes one `VLLM_CPU_OMP_THREADS_BIND`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from attention_kv_caceh.benchmarks.engine import run_engine_benchmark

__all__ = ["THREAD_TABLE_KEYS", "run_thread_sweep", "thread_table_rows"]

THREAD_TABLE_KEYS = (
    "threads",
    "max_num_seqs",
    "output_tokens_per_s",
    "decode_step_ms_p50",
    "bytes_per_decode_step",
    "decode_gb_per_s",
    "probe_gb_per_s",
    "probe_ratio",
)
"""The columns of the thread table, in order (fields of `EngineBenchRow`)."""


def run_thread_sweep(
    model_dir: str | Path, threads: tuple[int, ...], sizes: list[int], **kwargs: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`run_engine_benchmark(model_dir, sizes, threads=t, **kwargs)` for each t of `threads` in the
    order given; (every row as a dict, thread count by thread count; the first run's environment with
    `threads` the list). Raises what run_engine_benchmark raises."""
    rows: list[dict[str, Any]] = []
    environment: dict[str, Any] = {}
    for count in threads:
        result = run_engine_benchmark(model_dir, sizes, threads=count, **kwargs)
        rows += [asdict(row) for row in result.rows]
        environment = environment or result.environment
    return rows, environment | {"threads": list(threads)}


def thread_table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's columns (THREAD_TABLE_KEYS) of each row, in the rows' order."""
    return [{key: row[key] for key in THREAD_TABLE_KEYS} for row in rows]
