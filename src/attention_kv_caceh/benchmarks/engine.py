"""Engine throughput benchmark: output tokens/s and decode step time at several max_num_seqs, against a read probe.

What vLLM's `benchmarks/benchmark_throughput.py` measures (random prompts, a fixed output length,
ignore_eos, every request submitted at once) for this engine, plus the lab's roofline question: a
decode step reads every weight once and each request's KV cache, so its time is bounded below by
reading those bytes; the ratio to `np.dot` over a buffer of the same size (the lab's read probe, as
`experiments.calibration.read_probe` times it) says how close the step comes to that bound. A step of
many requests is bounded by arithmetic instead: its linear layers do 2 flops per weight per request,
so the run also replays the step's linear layers alone (same weights, same rows) to give their share
of the step and their FLOP/s, against an FMA probe (`gemm.fma_probe`: float32 FMAs in registers), and
the step's paged decode attention alone (every layer's kernel call over the engine's KV caches, with the
latest decode step's block tables and context lengths) to give its share. All
probes are timed between decode steps of the same run, so on a shared machine they see the same load
as the steps. Nothing here prints; a CLI formats the rows.

Before anything is timed, an oracle: the first request run alone (greedy, or sampled with the same seed)
must produce the same first tokens as in the batched run; otherwise `OracleMismatch` is raised and nothing is reported.

Shape legend: R requests in a decode step, L layers, H_kv KV heads, D head dim, D_model hidden size.

Left out: vLLM's dataset sources (ShareGPT, sonnet, Hugging Face datasets: the prompts here are random token
ids only), its LoRA and multimodal requests, `n` > 1, the async-engine mode and the other backends
(transformers, MII); the byte and FLOP probes are this project's own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.benchmarks.engine_rows import EngineBenchResult, EngineBenchRow
from attention_kv_caceh.benchmarks.probes import (
    Probes,
    attention_replay,
    decode_kv_bytes,
    decode_weight_bytes,
    linear_parameters,
    linear_replay,
    resident_bytes,
)
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.core import StepStats
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.timing import capture_environment, summarize_samples

__all__ = [
    "EngineBenchResult",
    "EngineBenchRow",
    "decode_kv_bytes",
    "decode_weight_bytes",
    "engine_benchmark_rows",
    "linear_parameters",
    "resident_bytes",
    "run_engine_benchmark",
]


class _RecordingRunner:
    """A ModelRunner that also records, for each pure-decode step, (requests, positions attended) in
    `decode_steps` and the threads it computed on (`ModelRunner.active_threads`) in `decode_threads`."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.decode_steps: list[tuple[int, int]] = []
        self.decode_threads: list[int] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> npt.NDArray[np.floating[Any]]:
        logits = self.runner.execute_model(scheduler_output)
        if scheduler_output.num_prefill_tokens == 0:
            reqs = scheduler_output.scheduled_requests
            positions = sum(
                r.num_computed_tokens + scheduler_output.num_scheduled_tokens[r.request_id] for r in reqs
            )
            self.decode_steps.append((len(reqs), positions))
            self.decode_threads.append(self.runner.active_threads)
        return logits


def _engine(model: Model, tokenizer: Tokenizer | None, config: EngineConfig) -> LLMEngine:
    blocks = config.num_kv_blocks
    assert blocks is not None  # set by the caller
    runner = _RecordingRunner(ModelRunner(model, config, blocks))
    return LLMEngine(config, runner, tokenizer, num_blocks=blocks, max_model_len=config.max_model_len)


def _run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    probes: Callable[[], None] | None = None,
    probe_every: int = 1,
) -> tuple[list[list[int]], float, list[float]]:
    """Submit all prompts, step until done; (output ids per prompt, wall seconds of the steps, this
    thread's CPU milliseconds of each pure-decode step).

    `probes` runs after every probe_every-th pure-decode step (outside the wall time returned), so
    probes and decode steps share the machine's load of the moment.
    """
    ids = [f"bench-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    num_decode_steps = 0
    wall = 0.0
    cpu_ms: list[float] = []
    while engine.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.thread_time()
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        wall += time.perf_counter() - t0
        if engine.step_stats and engine.step_stats[-1].num_prefill_tokens == 0:
            cpu_ms.append((time.thread_time() - c0) * 1e3)
            num_decode_steps += 1
            if probes is not None and num_decode_steps % probe_every == 0:
                probes()
    return [outputs[rid] for rid in ids], wall, cpu_ms


def run_engine_benchmark(
    model_dir: str | Path,
    max_num_seqs_list: tuple[int, ...] | list[int] = (1, 4, 16, 32),
    prompt_len: int = 128,
    output_len: int = 128,
    dtype: str = "float32",
    seed: int = 0,
    *,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    oracle_tokens: int | None = None,
    probe_every: int = 1,
    detokenize: bool = True,
    tokenizer: Tokenizer | None = None,
    gemm: str = "auto",
    temperature: float = 0.0,
    quantization: str | None = None,
    threads: int | None = None,
    activations: str | None = None,
) -> EngineBenchResult:
    """Run max_num_seqs requests at once on a fresh LLMEngine for each value of max_num_seqs_list.

    Each run: a KV pool of exactly the blocks the requests need (no preemption), prefix caching off
    (random prompts share nothing, and the oracle's solo run must not leave request 0 cached); the
    solo run of request 0 (oracle_tokens tokens, None: min(4, output_len); the solo run also warms
    the engine up); then all
    requests (random token ids of prompt_len drawn from `seed`, ignore_eos, max_tokens=output_len,
    sampled at `temperature` (0: greedy) by each request's own generator seeded with `seed`) stepped to completion, with the read probe, the linear-layer replay and the
    FMA probe timed after every probe_every-th pure-decode step (not counted in the step times or the
    wall time; every step by default, so probes and steps sample the same moments of a shared
    machine's load). With detokenize, requests stream text through the tokenizer as a server's would:
    `tokenizer`, or (None) the one Tokenizer.load reads from model_dir after the weights are loaded.
    gemm: the model's GEMM path choice (`Model`'s gemm: "auto", "packed" or "numpy"); quantization: the
    GGUF block format of the linear weights (`Model`'s quantization; None: dtype); activations: `Model`'s
    (`dispatch.ACTIVATION_CHOICES`). threads: the
    engine's threads (`EngineConfig.threads`), the replays' too, and the read probe's
    (`kernels.threads.read_probe`); None: the engine's default and np.dot's one thread. The oracle holds
    at any temperature: request 0's generator draws the same numbers alone as in the batch.

    Raises:
        ValueError: an empty or non-positive max_num_seqs_list, prompt_len < 1, output_len < 2 (no
            decode step), max_num_batched_tokens below a max_num_seqs (it is used as given: a prompt
            longer than it is prefilled in chunks), oracle_tokens outside 1 .. output_len, probe_every < 1,
            a temperature SamplingParams refuses (not finite or < 0), or
            prompt_len + output_len beyond the model's max_position_embeddings, a gemm `Model`
            refuses; CheckpointError from loading.
        OracleMismatch: request 0's first tokens in a batched run differ from its solo run.
    """
    seqs = list(max_num_seqs_list)
    oracle_tokens = _check_arguments(
        seqs, prompt_len, output_len, max_num_batched_tokens, oracle_tokens, probe_every
    )
    rss_before = resident_bytes()
    load_start = time.perf_counter()
    model = Model.load(model_dir, dtype, gemm, quantization, activations)
    load_s = time.perf_counter() - load_start
    loaded = {"load_s": load_s, "rss_before_load_bytes": rss_before, "rss_after_load_bytes": resident_bytes()}
    if prompt_len + output_len > model.config.max_position_embeddings:
        raise ValueError(
            f"prompt_len + output_len = {prompt_len + output_len} exceeds the model's "
            f"max_position_embeddings {model.config.max_position_embeddings}"
        )
    if not detokenize:
        tokenizer = None
    elif tokenizer is None:
        tokenizer = Tokenizer.load(model_dir)
    setup = _Setup(
        model, tokenizer, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature, seed=seed),
        prompt_len, output_len, block_size, max_num_batched_tokens, oracle_tokens, probe_every, seed, dtype,
        quantization, threads,
    )  # fmt: skip
    rows = tuple(engine_benchmark_rows(setup, seqs))
    environment = capture_environment() | {
        "model_dir": str(model_dir),
        "dtype": dtype,
        "num_parameters": model.num_parameters,
        "architecture": model.config.architecture,
        "gemm_path": model.gemm_path,
        "gemm_note": model.gemm_note,
        "weight_format": model.weight_format,
        "weight_notes": model.weight_notes,
        "quantization": quantization,
        "activations": model.activations,
        "temperature": temperature,
        "seed": seed,
        "weight_bytes": decode_weight_bytes(model, 0),
        **loaded,
    }
    return EngineBenchResult(rows, environment)


def _check_arguments(
    seqs: list[int],
    prompt_len: int,
    output_len: int,
    max_num_batched_tokens: int,
    oracle_tokens: int | None,
    probe_every: int,
) -> int:
    """ValueError for arguments `run_engine_benchmark` refuses; returns oracle_tokens (None: min(4, output_len))."""
    if not seqs or any(s < 1 for s in seqs):
        raise ValueError(f"max_num_seqs_list must hold positive counts, got {seqs}")
    if prompt_len < 1 or output_len < 2:
        raise ValueError(f"need prompt_len >= 1 and output_len >= 2, got {prompt_len}, {output_len}")
    if max_num_batched_tokens < max(seqs):
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= every max_num_seqs "
            f"(largest {max(seqs)}) so every running request can decode in one step"
        )
    if oracle_tokens is None:
        oracle_tokens = min(4, output_len)
    if not 1 <= oracle_tokens <= output_len or probe_every < 1:
        raise ValueError(
            f"oracle_tokens must be in 1 .. {output_len} and probe_every >= 1, got {oracle_tokens}, {probe_every}"
        )
    return oracle_tokens


@dataclass(frozen=True)
class _Setup:
    """What every row of one benchmark shares (the arguments of `run_engine_benchmark`, the loaded model)."""

    model: Model
    tokenizer: Tokenizer | None
    sampling: SamplingParams
    prompt_len: int
    output_len: int
    block_size: int
    max_num_batched_tokens: int
    oracle_tokens: int
    probe_every: int
    seed: int
    dtype: str
    quantization: str | None
    threads: int | None = None


def engine_benchmark_rows(setup: _Setup, seqs: list[int]) -> Iterator[EngineBenchRow]:
    """One row per max_num_seqs of `seqs`, each on a fresh engine, yielded as it is measured; the
    prompts of every row are drawn from one generator seeded with `setup.seed`."""
    rng = np.random.default_rng(setup.seed)
    for num_seqs in seqs:
        yield _bench_one(setup, num_seqs, rng)


def _bench_one(setup: _Setup, num_seqs: int, rng: np.random.Generator) -> EngineBenchRow:
    """The oracle, then the timed run of `num_seqs` requests with the probes between its decode steps."""
    model, seed = setup.model, setup.seed
    max_model_len = setup.prompt_len + setup.output_len
    config = EngineConfig(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,  # a longer prompt is prefilled in chunks
        block_size=setup.block_size,
        num_kv_blocks=-(-max_model_len // setup.block_size) * num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        dtype=setup.dtype,
        quantization=setup.quantization,
        threads=setup.threads,
    )
    prompts = rng.integers(0, model.config.vocab_size, size=(num_seqs, setup.prompt_len)).tolist()
    engine = _engine(model, setup.tokenizer, config)
    solo, _, _ = _run(engine, prompts[:1], replace(setup.sampling, max_tokens=setup.oracle_tokens))
    stats_start = engine.num_steps
    runner = engine.model_runner
    assert isinstance(runner, _RecordingRunner)
    runner.decode_steps.clear()
    runner.decode_threads.clear()
    # The probe buffer holds the bytes of a decode step of requests in lockstep (mean context
    # prompt_len + output_len / 2); the run's actual mean differs by a few KV positions at most,
    # and a read rate does not depend on so small a size difference.
    expected = decode_weight_bytes(model, num_seqs) + decode_kv_bytes(
        model, num_seqs * (setup.prompt_len + setup.output_len / 2)
    )
    probe = np.ones(int(expected) // model.dtype.itemsize, dtype=model.dtype)
    np.dot(probe, probe)  # touch the pages once, outside any timing
    replay = linear_replay(model, num_seqs, np.random.default_rng([seed, num_seqs]))
    replay()  # the same: first touches outside any timing
    probes = Probes(probe, replay, attention_replay(model, runner.runner, seed), threads=setup.threads)
    outputs, total_s, cpu_ms = _run(engine, prompts, setup.sampling, probes, setup.probe_every)
    if not probes.read_ms:  # fewer pure-decode steps than expected: probe after the run
        probes()
    probes.close()
    oracle = setup.oracle_tokens
    if outputs[0][:oracle] != solo[0]:
        raise OracleMismatch(
            f"max_num_seqs={num_seqs}: request 0's first tokens {outputs[0][:oracle]} differ "
            f"from its solo run {solo[0]}; refusing to report timings"
        )
    stats = [s for s in engine.step_stats if s.step_index >= stats_start and s.num_prefill_tokens == 0]
    threads = (runner.runner.threads, float(np.mean(runner.decode_threads)))
    return _row(
        setup, num_seqs, stats, runner.decode_steps, probes, probe.nbytes, outputs, total_s, cpu_ms, threads
    )


def _row(
    setup: _Setup,
    num_seqs: int,
    stats: list[StepStats],
    decode_steps: list[tuple[int, int]],
    probes: Probes,
    probe_bytes: int,
    outputs: list[list[int]],
    total_s: float,
    cpu_ms: list[float],
    threads: tuple[int, float],
) -> EngineBenchRow:
    """The row of one run from its pure-decode steps' StepStats, the runner's (requests, positions) of
    those steps, the probes' samples and the runner's (threads, mean threads of those steps)
    (`EngineBenchRow` says what each number is)."""
    model = setup.model
    read_ms, lin_ms = float(np.median(probes.read_ms)), float(np.median(probes.linear_ms))
    fma_gflops = float(np.median(probes.fma_flops)) / 1e9
    attn_ms = float(np.median(probes.attention_ms)) if probes.attention_ms else math.nan
    step_ms = [s.step_time_ms for s in stats]
    summary = summarize_samples(step_ms)
    decode_tokens = sum(s.num_decode_tokens for s in stats)
    mean_seqs = float(np.mean([r for r, _ in decode_steps]))
    mean_positions = float(np.mean([p for _, p in decode_steps]))
    weight_bytes = decode_weight_bytes(model, mean_seqs)
    kv_bytes = decode_kv_bytes(model, mean_positions)
    nbytes = round(weight_bytes + kv_bytes)
    decode_gbps = nbytes / (summary["p50_ms"] * 1e6)
    probe_gbps = probe_bytes / (read_ms * 1e6)
    num_output = sum(len(o) for o in outputs)
    decode_s = sum(step_ms) / 1e3
    lin_gflops = 2 * num_seqs * linear_parameters(model) / (lin_ms * 1e6)
    return EngineBenchRow(
        max_num_seqs=num_seqs,
        prompt_len=setup.prompt_len,
        output_len=setup.output_len,
        num_output_tokens=num_output,
        total_time_s=total_s,
        output_tokens_per_s=num_output / total_s,
        num_decode_steps=len(stats),
        decode_time_s=decode_s,
        decode_tokens_per_s=decode_tokens / decode_s,
        decode_step_ms_p50=summary["p50_ms"],
        decode_step_ms_p95=summary["p95_ms"],
        decode_step_cpu_ms_p50=summarize_samples(cpu_ms)["p50_ms"],
        core_step_cpu_ms_p50=summarize_samples([s.step_cpu_ms for s in stats])["p50_ms"],
        mean_num_seqs=mean_seqs,
        mean_context_len=mean_positions / mean_seqs,
        weight_bytes_per_decode_step=round(weight_bytes),
        kv_bytes_per_decode_step=round(kv_bytes),
        bytes_per_decode_step=nbytes,
        decode_gb_per_s=decode_gbps,
        probe_gb_per_s=probe_gbps,
        probe_ratio=decode_gbps / probe_gbps,
        linear_ms=lin_ms,
        linear_share=lin_ms / summary["p50_ms"],
        attention_ms=attn_ms,
        attention_share=attn_ms / summary["p50_ms"],
        linear_gflop_per_s=lin_gflops,
        fma_gflop_per_s=fma_gflops,
        fma_ratio=lin_gflops / fma_gflops,
        gemm_path=model.gemm_path,
        gemm_kernel=model.layers[0].qkv_proj.kernel + (" x int8" if model.int8_products else ""),
        oracle_tokens=setup.oracle_tokens,
        threads=threads[0],
        mean_threads=threads[1],
    )
