"""Engine throughput benchmark: output tokens/s and decode step time at several max_num_seqs, against a read probe.

What vLLM's `benchmarks/benchmark_throughput.py` measures (random prompts, a fixed output length,
ignore_eos, every request submitted at once) for this engine, plus the lab's roofline question: a
decode step reads every weight once and each request's KV cache, so its time is bounded below by
reading those bytes; the ratio to `np.dot` over a buffer of the same size (the lab's read probe, as
`experiments.calibration.read_probe` times it) says how close the step comes to that bound. The probe
is timed between decode steps of the same run, so on a shared machine both see the same load. Nothing
here prints; a CLI formats the rows.

Before anything is timed, an oracle: the first request run alone (greedy) must produce the same first
tokens as in the batched run; otherwise `OracleMismatch` is raised and nothing is reported.

Shape legend: R requests in a decode step, L layers, H_kv KV heads, D head dim, D_model hidden size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model import Model
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.timing import capture_environment, summarize_samples

__all__ = [
    "EngineBenchResult",
    "EngineBenchRow",
    "decode_kv_bytes",
    "decode_weight_bytes",
    "run_engine_benchmark",
]


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
        oracle_tokens: first tokens of request 0 checked against its solo run.
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
    mean_num_seqs: float
    mean_context_len: float
    weight_bytes_per_decode_step: int
    kv_bytes_per_decode_step: int
    bytes_per_decode_step: int
    decode_gb_per_s: float
    probe_gb_per_s: float
    probe_ratio: float
    oracle_tokens: int


@dataclass(frozen=True)
class EngineBenchResult:
    """The rows of `run_engine_benchmark`, in max_num_seqs_list order, and what produced them
    (`timing.capture_environment()` plus the model folder, dtype and parameter count)."""

    rows: tuple[EngineBenchRow, ...]
    environment: dict[str, Any]


def decode_weight_bytes(model: Model, num_seqs: float) -> float:
    """Weight bytes one decode step reads: every layer's tensors, the final norm, the LM head, and
    num_seqs rows of the embedding table (the rest of the table is not read unless it is the tied LM
    head, which is counted once as the LM head). Engine dtype itemsize."""
    layer_items = sum(int(a.size) for layer in model.layers for a in vars(layer).values() if a is not None)
    items = layer_items + model.norm.size + model.lm_head.size
    return (items + num_seqs * model.config.hidden_size) * model.dtype.itemsize


def decode_kv_bytes(model: Model, num_positions: float) -> float:
    """KV bytes a decode step reads for num_positions attended positions summed over its requests:
    K and V of every layer, 2 * L * H_kv * D * itemsize per position."""
    per_position = ModelRunner.bytes_per_block(model.config, 1, model.dtype.name)
    return per_position * num_positions


class _RecordingRunner:
    """A ModelRunner that also records, for each pure-decode step, (requests, positions attended)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.decode_steps: list[tuple[int, int]] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> npt.NDArray[np.floating[Any]]:
        if scheduler_output.num_prefill_tokens == 0:
            reqs = scheduler_output.scheduled_requests
            positions = sum(
                r.num_computed_tokens + scheduler_output.num_scheduled_tokens[r.request_id] for r in reqs
            )
            self.decode_steps.append((len(reqs), positions))
        return self.runner.execute_model(scheduler_output)


def _engine(model: Model, tokenizer: Tokenizer | None, config: EngineConfig) -> LLMEngine:
    blocks = config.num_kv_blocks
    assert blocks is not None  # set by the caller
    runner = _RecordingRunner(ModelRunner(model, config, blocks))
    return LLMEngine(config, runner, tokenizer, num_blocks=blocks, max_model_len=config.max_model_len)


def _run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    probe: npt.NDArray[np.floating[Any]] | None = None,
    probe_every: int = 1,
) -> tuple[list[list[int]], float, list[float]]:
    """Submit all prompts, step until done; (output ids per prompt, wall seconds of the steps, probe ms).

    With `probe`, np.dot(probe, probe) is timed after every probe_every-th pure-decode step (outside
    the wall time returned), so probe and decode steps share the machine's load of the moment.
    """
    ids = [f"bench-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    probe_ms: list[float] = []
    num_decode_steps = 0
    wall = 0.0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        wall += time.perf_counter() - t0
        if probe is not None and engine.step_stats and engine.step_stats[-1].num_prefill_tokens == 0:
            num_decode_steps += 1
            if num_decode_steps % probe_every == 0:
                t0 = time.perf_counter()
                np.dot(probe, probe)
                probe_ms.append((time.perf_counter() - t0) * 1e3)
    return [outputs[rid] for rid in ids], wall, probe_ms


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
) -> EngineBenchResult:
    """Run max_num_seqs requests at once on a fresh LLMEngine for each value of max_num_seqs_list.

    Each run: a KV pool of exactly the blocks the requests need (no preemption), prefix caching off
    (random prompts share nothing, and the oracle's solo run must not leave request 0 cached); the
    solo run of request 0 (oracle_tokens greedy tokens, None: min(4, output_len); the solo run also warms
    the engine up); then all
    requests (random token ids of prompt_len drawn from `seed`, greedy, ignore_eos,
    max_tokens=output_len) stepped to completion, with the read probe timed after every
    probe_every-th pure-decode step (not counted in the step times or the wall time; every step by
    default, so probe and steps sample the same moments of a shared machine's load). With
    detokenize, requests stream text through the tokenizer as a server's would.

    Raises:
        ValueError: an empty or non-positive max_num_seqs_list, prompt_len < 1, output_len < 2 (no
            decode step), oracle_tokens outside 1 .. output_len, probe_every < 1, or
            prompt_len + output_len beyond the model's max_position_embeddings; CheckpointError
            from loading.
        OracleMismatch: request 0's first tokens in a batched run differ from its solo run.
    """
    seqs = list(max_num_seqs_list)
    if not seqs or any(s < 1 for s in seqs):
        raise ValueError(f"max_num_seqs_list must hold positive counts, got {seqs}")
    if prompt_len < 1 or output_len < 2:
        raise ValueError(f"need prompt_len >= 1 and output_len >= 2, got {prompt_len}, {output_len}")
    if oracle_tokens is None:
        oracle_tokens = min(4, output_len)
    if not 1 <= oracle_tokens <= output_len or probe_every < 1:
        raise ValueError(
            f"oracle_tokens must be in 1 .. {output_len} and probe_every >= 1, got {oracle_tokens}, {probe_every}"
        )
    model = Model.load(model_dir, dtype)
    max_model_len = prompt_len + output_len
    if max_model_len > model.config.max_position_embeddings:
        raise ValueError(
            f"prompt_len + output_len = {max_model_len} exceeds the model's "
            f"max_position_embeddings {model.config.max_position_embeddings}"
        )
    tokenizer = Tokenizer.load(model_dir) if detokenize else None
    rng = np.random.default_rng(seed)
    blocks_per_request = -(-max_model_len // block_size)
    rows: list[EngineBenchRow] = []
    for num_seqs in seqs:
        config = EngineConfig(
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
            block_size=block_size,
            num_kv_blocks=blocks_per_request * num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=False,
            dtype=dtype,
        )
        prompts = rng.integers(0, model.config.vocab_size, size=(num_seqs, prompt_len)).tolist()
        engine = _engine(model, tokenizer, config)
        solo, _, _ = _run(engine, prompts[:1], SamplingParams(max_tokens=oracle_tokens, ignore_eos=True))
        stats_start = engine.num_steps
        runner = engine.model_runner
        assert isinstance(runner, _RecordingRunner)
        runner.decode_steps.clear()
        # The probe buffer holds the bytes of a decode step of requests in lockstep (mean context
        # prompt_len + output_len / 2); the run's actual mean differs by a few KV positions at most,
        # and a read rate does not depend on so small a size difference.
        expected = decode_weight_bytes(model, num_seqs) + decode_kv_bytes(
            model, num_seqs * (prompt_len + output_len / 2)
        )
        probe = np.ones(int(expected) // model.dtype.itemsize, dtype=model.dtype)
        np.dot(probe, probe)  # touch the pages once, outside any timing
        outputs, total_s, probe_ms = _run(
            engine,
            prompts,
            SamplingParams(max_tokens=output_len, ignore_eos=True),
            probe,
            probe_every=probe_every,
        )
        while len(probe_ms) < 1:  # fewer pure-decode steps than expected: probe after the run
            t0 = time.perf_counter()
            np.dot(probe, probe)
            probe_ms.append((time.perf_counter() - t0) * 1e3)
        probe_bytes = probe.nbytes
        del probe
        if outputs[0][:oracle_tokens] != solo[0]:
            raise OracleMismatch(
                f"max_num_seqs={num_seqs}: request 0's first tokens {outputs[0][:oracle_tokens]} differ "
                f"from its solo run {solo[0]}; refusing to report timings"
            )
        stats = [s for s in engine.step_stats if s.step_index >= stats_start and s.num_prefill_tokens == 0]
        step_ms = [s.step_time_ms for s in stats]
        summary = summarize_samples(step_ms)
        decode_tokens = sum(s.num_decode_tokens for s in stats)
        mean_seqs = float(np.mean([r for r, _ in runner.decode_steps]))
        mean_positions = float(np.mean([p for _, p in runner.decode_steps]))
        weight_bytes = decode_weight_bytes(model, mean_seqs)
        kv_bytes = decode_kv_bytes(model, mean_positions)
        nbytes = round(weight_bytes + kv_bytes)
        decode_gbps = nbytes / (summary["p50_ms"] * 1e6)
        probe_gbps = probe_bytes / (float(np.median(probe_ms)) * 1e6)
        num_output = sum(len(o) for o in outputs)
        decode_s = sum(step_ms) / 1e3
        rows.append(
            EngineBenchRow(
                max_num_seqs=num_seqs,
                prompt_len=prompt_len,
                output_len=output_len,
                num_output_tokens=num_output,
                total_time_s=total_s,
                output_tokens_per_s=num_output / total_s,
                num_decode_steps=len(stats),
                decode_time_s=decode_s,
                decode_tokens_per_s=decode_tokens / decode_s,
                decode_step_ms_p50=summary["p50_ms"],
                decode_step_ms_p95=summary["p95_ms"],
                mean_num_seqs=mean_seqs,
                mean_context_len=mean_positions / mean_seqs,
                weight_bytes_per_decode_step=round(weight_bytes),
                kv_bytes_per_decode_step=round(kv_bytes),
                bytes_per_decode_step=nbytes,
                decode_gb_per_s=decode_gbps,
                probe_gb_per_s=probe_gbps,
                probe_ratio=decode_gbps / probe_gbps,
                oracle_tokens=oracle_tokens,
            )
        )
    environment = capture_environment() | {
        "model_dir": str(model_dir),
        "dtype": dtype,
        "num_parameters": model.num_parameters,
        "architecture": model.config.architecture,
    }
    return EngineBenchResult(tuple(rows), environment)
