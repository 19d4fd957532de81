"""The rows of `bench-engine` without speculation: one `EngineBenchRow` per (threads, max_num_seqs) run.

`benchmarks/engine.py` measures them (its docstring says how); `benchmarks/thread_table.py` runs them at
several thread counts. Left out: vLLM's benchmarks have no such rows; these are this project's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EngineBenchResult", "EngineBenchRow"]


@dataclass(frozen=True)
class EngineBenchRow:
    """One max_num_seqs setting of `run_engine_benchmark`.

    Attributes:
        max_num_seqs: the engine's limit, and the number of requests submitted.
        prompt_len, output_len: tokens per request (random prompt ids; every request yields output_len).
        num_output_tokens: output tokens of all requests (max_num_seqs * output_len).
        total_time_s: wall time from the first step to the last (prefill and decode), seconds.
        output_tokens_per_s: num_output_tokens / total_time_s (vLLM's output throughput).
        num_decode_steps: steps that computed only decode tokens (StepStats.num_prefill_tokens == 0).
        decode_time_s: sum of those steps' step_time_ms, seconds (the decode phase; the steps run back
            to back, so this is its wall time less the Python loop between steps).
        decode_tokens_per_s: output tokens of those steps / decode_time_s.
        decode_step_ms_p50, decode_step_ms_p95: percentiles of those steps' step_time_ms
            (`timing.summarize_samples`, linear interpolation).
        decode_step_cpu_ms_p50: median CPU time of the benchmark's thread over those steps (the engine
            steps in it), ms: unlike the wall time, it leaves out the time a shared machine's other
            processes held the core, so its ratios between rows stay comparable under changing load.
        core_step_cpu_ms_p50: median of those steps' StepStats.step_cpu_ms: the core's step alone,
            without the output processing decode_step_cpu_ms_p50 holds; what a server's engine steps
            report as median_decode_step_cpu_time_ms.
        mean_num_seqs: mean requests per pure-decode step.
        mean_context_len: mean context length (positions attended) of a request in those steps.
        weight_bytes_per_decode_step: `decode_weight_bytes` at mean_num_seqs.
        kv_bytes_per_decode_step: `decode_kv_bytes` at mean_num_seqs * mean_context_len positions.
        bytes_per_decode_step: the sum of the two, rounded to whole bytes.
        decode_gb_per_s: bytes_per_decode_step / decode_step_ms_p50, in 1e9 bytes per second.
        probe_gb_per_s: read rate of np.dot(buf, buf) over a float buffer of about
            bytes_per_decode_step (the lockstep estimate, within a few KV positions), median of the
            samples timed between this run's decode steps; 1e9 bytes per second.
        probe_ratio: decode_gb_per_s / probe_gb_per_s (1.0 = the step reads its bytes as fast as np.dot).
        linear_ms: the step's linear layers replayed alone at max_num_seqs rows (every layer's qkv, o,
            gate_up and down projections and the LM head, random inputs), median of the replays timed
            between this run's decode steps; milliseconds.
        linear_share: linear_ms / decode_step_ms_p50.
        attention_ms: the latest decode step's paged attention replayed alone (`kernels.
            paged_decode_attention_into` for every layer, over the engine's KV caches with that step's
            block tables and context lengths, random queries), median of the replays timed between
            this run's decode steps; milliseconds (NaN when no pure-decode step preceded a probe).
        attention_share: attention_ms / decode_step_ms_p50.
        linear_gflop_per_s: 2 * max_num_seqs * `linear_parameters` / linear_ms, in 1e9 flops per second.
        fma_gflop_per_s: `gemm.fma_probe` (float32 FMAs in registers, one thread), median of the probes
            timed between this run's decode steps; 1e9 flops per second.
        fma_ratio: linear_gflop_per_s / fma_gflop_per_s (1.0 = the linear layers run at the FMA peak).
        gemm_path: the GEMM path of the linear layers ("packed" or "numpy", `Model.gemm_path`).
        gemm_kernel: the kernel that multiplies the layers' weights (`LinearWeight.kernel` of the
            first layer's qkv projection, e.g. "avx2 float32", "avx512 q4_1", "numpy float64").
        oracle_tokens: first tokens of request 0 checked against its solo run.
        threads: the engine's threads (`EngineConfig.threads`, or its default); the read probe ran on
            as many (`kernels.threads.read_probe`) when the run was given a thread count, else np.dot.
        mean_threads: mean threads the pure-decode steps computed on (`ModelRunner.active_threads`):
            `threads` when it was given, else what the default's load governor left of it
            (`cpu_load.LoadGovernor`: fewer while other processes keep CPUs busy).
    """

    max_num_seqs: int
    prompt_len: int
    output_len: int
    num_output_tokens: int
    total_time_s: float
    output_tokens_per_s: float
    num_decode_steps: int
    decode_time_s: float
    decode_tokens_per_s: float
    decode_step_ms_p50: float
    decode_step_ms_p95: float
    decode_step_cpu_ms_p50: float
    core_step_cpu_ms_p50: float
    mean_num_seqs: float
    mean_context_len: float
    weight_bytes_per_decode_step: int
    kv_bytes_per_decode_step: int
    bytes_per_decode_step: int
    decode_gb_per_s: float
    probe_gb_per_s: float
    probe_ratio: float
    linear_ms: float
    linear_share: float
    attention_ms: float
    attention_share: float
    linear_gflop_per_s: float
    fma_gflop_per_s: float
    fma_ratio: float
    gemm_path: str
    gemm_kernel: str
    oracle_tokens: int
    threads: int = 1
    mean_threads: float = 1.0


@dataclass(frozen=True)
class EngineBenchResult:
    """The rows of `run_engine_benchmark`, in max_num_seqs_list order, and what produced them
    (`timing.capture_environment()` plus the model, dtype and parameter count), and what loading cost:
    `load_s` (seconds of `Model.load`: reading, dequantizing, packing the weights), `rss_before_load_bytes`
    and `rss_after_load_bytes` (`resident_bytes()`, None without /proc), `weight_bytes` (the weights a
    decode step reads as stored, `decode_weight_bytes` without embedding rows)."""

    rows: tuple[EngineBenchRow, ...]
    environment: dict[str, Any]
