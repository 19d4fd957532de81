"""Speculative decoding benchmark: the same requests with and without n-gram drafts, in one run.

What vLLM's offline throughput benchmark with `--speculative-config` reports (output tokens/s, the
acceptance counts of `vllm/v1/spec_decode/metrics.py`), measured beside the same run without
speculation, plus the two numbers that explain the difference:

- TPOT: per request, (time of its last token - time of its first) / (output tokens - 1), averaged over
  the requests (vLLM's `mean_tpot_ms`); times are taken after each engine step, as a client that is
  handed every step's outputs would see them.
- verification cost: the median time of a decode step that verified drafts (B requests, B + drafts
  rows) over the median decode step of the run without drafts (B rows). Speculation pays when the mean
  acceptance length (tokens per verified request-step) exceeds it.

Each max_num_seqs value runs `pairs` pairs of runs (without, then with speculation; the next pair in
the other order) on fresh engines over the same prompts (prefix caching off, so neither run finds the other's blocks); tok/s and
TPOT are medians over the runs, and their ratios medians of each pair's ratio. Before anything is timed, an oracle: request 0 alone, without and
with drafts, must produce the same tokens (greedy, or the same seeded draws: speculation changes no
token, see spec_decode/rejection_sampler.py), and so must every request of every timed pair;
otherwise OracleMismatch is raised and nothing is reported. Nothing here prints.

Left out: vLLM's dataset loaders (the prompts come from the caller), draft methods other than `ngram`, and the
online benchmark (`vllm bench serve`) against a server with speculation on.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.core import StepStats
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig
from attention_kv_caceh.engine.spec_decode.metrics import acceptance_summary
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.timing import capture_environment

__all__ = ["RunTimes", "SpecBenchRow", "run_spec_benchmark", "time_requests"]


@dataclass(frozen=True)
class RunTimes:
    """One run of `time_requests`: output ids per prompt, wall seconds from the first step to the last,
    mean TPOT (ms), and the engine's StepStats (the engine itself, its KV cache, is let go)."""

    outputs: list[list[int]]
    wall_s: float
    mean_tpot_ms: float
    step_stats: list[StepStats]

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens / wall seconds."""
        return sum(len(o) for o in self.outputs) / self.wall_s


def time_requests(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams) -> RunTimes:
    """Submit every prompt at once, step until done, timing each request's first and last token."""
    ids = [f"bench-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, list(prompt), params)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        now = time.perf_counter()
        for out in step_outputs:
            if out.new_token_ids:
                outputs[out.request_id].extend(out.new_token_ids)
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
    wall = time.perf_counter() - start
    tpots = [(last[r] - first[r]) / (len(outputs[r]) - 1) * 1e3 for r in ids if len(outputs[r]) > 1]
    stats = list(engine.step_stats)
    return RunTimes(
        [outputs[r] for r in ids], wall, statistics.fmean(tpots) if tpots else float("nan"), stats
    )


@dataclass(frozen=True)
class SpecBenchRow:
    """One max_num_seqs setting of `run_spec_benchmark` (medians over `pairs` where timed).

    Attributes:
        max_num_seqs: requests submitted at once (and the engine's limit).
        workload: "random" (random token ids) or "copy" (harness.copy_workload prompts).
        mean_prompt_len, output_len: tokens per request.
        output_tokens_per_s_off, output_tokens_per_s_on: without / with speculation (medians);
            `tok_s_ratio`: the median over the pairs of on / off (each pair ran back to back).
        cpu_tok_s_ratio: the same ratio of output tokens per second of the engine steps' CPU time
            (StepStats.step_cpu_ms summed over a run): the work of each run, without the time a shared
            machine's other processes held the core, so it moves less than the wall-clock ratio.
        tpot_ms_off, tpot_ms_on: mean TPOT (module docstring), ms (medians); `tpot_ratio`: the median over
            the pairs of on / off.
        decode_step_ms_p50: median decode step without speculation (steps without prefill tokens).
        verify_step_ms_p50: median decode step with speculation among those that verified drafts (NaN
            when none did); `verify_rows_mean`: their mean tokens (rows); `verify_cost`: the ratio of
            the two step times.
        draft_step_share: share of the decode steps with speculation that verified drafts.
        num_drafts, num_draft_tokens, num_accepted_tokens, acceptance_rate, acceptance_length,
            per_position_acceptance_rates: vLLM's figures over one run with speculation
            (`spec_decode.metrics.acceptance_summary`).
        pairs: timed pairs.
        runs_tok_s_off, runs_tok_s_on, runs_tpot_ms_off, runs_tpot_ms_on: every timed run's output tok/s
            and mean TPOT, in run order (the raw samples behind the medians).
    """

    max_num_seqs: int
    workload: str
    mean_prompt_len: float
    output_len: int
    output_tokens_per_s_off: float
    output_tokens_per_s_on: float
    tok_s_ratio: float
    cpu_tok_s_ratio: float
    tpot_ms_off: float
    tpot_ms_on: float
    tpot_ratio: float
    decode_step_ms_p50: float
    verify_step_ms_p50: float
    verify_rows_mean: float
    verify_cost: float
    draft_step_share: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    acceptance_length: float
    per_position_acceptance_rates: tuple[float, ...]
    pairs: int
    runs_tok_s_off: tuple[float, ...] = ()
    runs_tok_s_on: tuple[float, ...] = ()
    runs_tpot_ms_off: tuple[float, ...] = ()
    runs_tpot_ms_on: tuple[float, ...] = ()


def _pair_ratio(on: list[RunTimes], off: list[RunTimes], value: Callable[[RunTimes], float]) -> float:
    """The median over the pairs of value(with drafts) / value(without): the two runs of a pair ran
    back to back, so a load that drifts over the whole benchmark divides out of each ratio."""
    return statistics.median(value(a) / value(b) for a, b in zip(on, off, strict=True))


def _tokens_per_cpu_s(run: RunTimes) -> float:
    return sum(len(o) for o in run.outputs) / (sum(s.step_cpu_ms for s in run.step_stats) / 1e3)


def _check(label: str, off: list[list[int]], on: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            raise OracleMismatch(
                f"{label}: request {i}'s tokens with speculation differ from those without at output "
                f"token {at} ({a[at : at + 4]} vs {b[at : at + 4]}); refusing to report timings"
            )


def run_spec_benchmark(
    model_dir: str | Path,
    speculative_config: SpeculativeConfig,
    prompts: Sequence[list[int]],
    max_num_seqs_list: Sequence[int] = (1, 32),
    output_len: int = 128,
    dtype: str = "float32",
    *,
    workload: str = "random",
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    pairs: int = 1,
    gemm: str = "auto",
    temperature: float = 0.0,
    seed: int = 0,
    detokenize: bool = True,
    quantization: str | None = None,
    activations: str | None = None,
) -> tuple[list[SpecBenchRow], dict[str, Any]]:
    """For each max_num_seqs B: the first B of `prompts` (token ids; the list must hold at least the
    largest B), ignore_eos, max_tokens=output_len, sampled at `temperature` with each request's
    generator seeded with `seed`, in `pairs` alternating pairs without and with `speculative_config`.
    quantization: the linear weights' GGUF block format (`Model.load`'s; None: weights in dtype);
    activations: `Model.load`'s (`dispatch.ACTIVATION_CHOICES`).

    Returns the rows (max_num_seqs_list order) and the environment (`timing.capture_environment()`
    plus the model, the speculative config, the workload).

    Raises:
        ValueError: an empty or non-positive max_num_seqs_list, fewer prompts than its largest value,
            an empty prompt, output_len < 2, pairs < 1, max_num_batched_tokens below a max_num_seqs,
            or prompt + output_len + K beyond the model's max_position_embeddings; CheckpointError.
        OracleMismatch: tokens with speculation differ from those without (module docstring).
    """
    seqs = list(max_num_seqs_list)
    if not seqs or any(b < 1 for b in seqs):
        raise ValueError(f"max_num_seqs_list must hold positive counts, got {seqs}")
    if len(prompts) < max(seqs) or any(not p for p in prompts):
        raise ValueError(f"need {max(seqs)} non-empty prompts, got {len(prompts)}")
    if output_len < 2 or pairs < 1:
        raise ValueError(f"need output_len >= 2 and pairs >= 1, got {output_len}, {pairs}")
    if max_num_batched_tokens < max(seqs):
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= every max_num_seqs")
    k = speculative_config.num_speculative_tokens
    model = Model.load(model_dir, dtype, gemm, quantization, activations)
    longest = max(len(p) for p in prompts[: max(seqs)])
    max_model_len = longest + output_len + k + 1
    if max_model_len > model.config.max_position_embeddings:
        raise ValueError(
            f"the longest prompt ({longest}) + output_len ({output_len}) + K ({k}) + 1 exceeds the model's "
            f"max_position_embeddings {model.config.max_position_embeddings}"
        )
    tokenizer = Tokenizer.load(model_dir) if detokenize else None
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature, seed=seed)
    blocks_per_request = -(-max_model_len // block_size)

    def engine(num_seqs: int, spec: SpeculativeConfig | None) -> LLMEngine:
        config = EngineConfig(
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=blocks_per_request * num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=False,
            dtype=dtype,
            quantization=quantization,
            speculative_config=spec,
        )
        runner = ModelRunner(model, config, blocks_per_request * num_seqs)
        return LLMEngine(
            config, runner, tokenizer, num_blocks=config.num_kv_blocks, max_model_len=max_model_len
        )

    # the oracle, which also warms every compiled path up: request 0 alone, without and with drafts
    solo = replace(params, max_tokens=min(output_len, 32))
    _check(
        "request 0 alone",
        time_requests(engine(1, None), prompts[:1], solo).outputs,
        time_requests(engine(1, speculative_config), prompts[:1], solo).outputs,
    )
    rows: list[SpecBenchRow] = []
    for b in seqs:
        batch = [list(p) for p in prompts[:b]]
        off_runs, on_runs = _timed_pairs(
            lambda spec, b=b: engine(b, spec), speculative_config, batch, params, pairs
        )
        rows.append(_spec_row(b, batch, off_runs, on_runs, k, workload, output_len, pairs))
    environment = capture_environment() | {
        "model_dir": str(model_dir),
        "dtype": dtype,
        "quantization": quantization,
        "num_parameters": model.num_parameters,
        "architecture": model.config.architecture,
        "gemm_path": model.gemm_path,
        "speculative_config": speculative_config.to_dict(),
        "workload": workload,
        "temperature": temperature,
        "seed": seed,
    }
    return rows, environment


def _timed_pairs(
    engine: Callable[[SpeculativeConfig | None], LLMEngine],
    speculative_config: SpeculativeConfig,
    batch: list[list[int]],
    params: SamplingParams,
    pairs: int,
) -> tuple[list[RunTimes], list[RunTimes]]:
    """`pairs` pairs of runs of `batch` on fresh engines (`engine(spec)`), without and with
    `speculative_config`; the order alternates, so that neither side is always the second. Each pair's
    tokens are checked equal (`_check`). Returns the runs without and with drafts."""
    off_runs: list[RunTimes] = []
    on_runs: list[RunTimes] = []
    for pair in range(pairs):
        for spec in (None, speculative_config) if pair % 2 == 0 else (speculative_config, None):
            gc.collect()  # the previous run's engine and KV cache go before this one is built
            run = time_requests(engine(spec), batch, params)
            (off_runs if spec is None else on_runs).append(run)
        _check(f"max_num_seqs={len(batch)}", off_runs[-1].outputs, on_runs[-1].outputs)
    return off_runs, on_runs


def _spec_row(
    b: int,
    batch: list[list[int]],
    off_runs: list[RunTimes],
    on_runs: list[RunTimes],
    k: int,
    workload: str,
    output_len: int,
    pairs: int,
) -> SpecBenchRow:
    """The row of max_num_seqs `b` from its timed runs (`SpecBenchRow` says what each number is)."""
    decode_off = [s.step_time_ms for r in off_runs for s in r.step_stats if s.num_prefill_tokens == 0]
    on_steps = [s for r in on_runs for s in r.step_stats if s.num_prefill_tokens == 0]
    verify = [s for s in on_steps if s.spec_decoding is not None and s.spec_decoding.num_drafts > 0]
    decode_ms = statistics.median(decode_off)
    verify_ms = statistics.median([s.step_time_ms for s in verify]) if verify else float("nan")
    rows_mean = statistics.fmean([sum(s.num_scheduled_tokens.values()) for s in verify]) if verify else 0.0
    acc = acceptance_summary((s.spec_decoding for s in on_runs[0].step_stats), k)
    return SpecBenchRow(
        max_num_seqs=b,
        workload=workload,
        mean_prompt_len=statistics.fmean(len(p) for p in batch),
        output_len=output_len,
        output_tokens_per_s_off=statistics.median(r.output_tokens_per_s for r in off_runs),
        output_tokens_per_s_on=statistics.median(r.output_tokens_per_s for r in on_runs),
        tok_s_ratio=_pair_ratio(on_runs, off_runs, lambda r: r.output_tokens_per_s),
        cpu_tok_s_ratio=_pair_ratio(on_runs, off_runs, _tokens_per_cpu_s),
        tpot_ms_off=statistics.median(r.mean_tpot_ms for r in off_runs),
        tpot_ms_on=statistics.median(r.mean_tpot_ms for r in on_runs),
        tpot_ratio=_pair_ratio(on_runs, off_runs, lambda r: r.mean_tpot_ms),
        decode_step_ms_p50=decode_ms,
        verify_step_ms_p50=verify_ms,
        verify_rows_mean=rows_mean,
        verify_cost=verify_ms / decode_ms,
        draft_step_share=len(verify) / len(on_steps) if on_steps else 0.0,
        num_drafts=acc.num_drafts,
        num_draft_tokens=acc.num_draft_tokens,
        num_accepted_tokens=acc.num_accepted_tokens,
        acceptance_rate=acc.acceptance_rate,
        acceptance_length=acc.acceptance_length,
        per_position_acceptance_rates=acc.per_position_acceptance_rates,
        pairs=pairs,
        runs_tok_s_off=tuple(r.output_tokens_per_s for r in off_runs),
        runs_tok_s_on=tuple(r.output_tokens_per_s for r in on_runs),
        runs_tpot_ms_off=tuple(r.mean_tpot_ms for r in off_runs),
        runs_tpot_ms_on=tuple(r.mean_tpot_ms for r in on_runs),
    )
