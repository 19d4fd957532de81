"""Per-step and per-request serving statistics handed from AsyncLLM to stat loggers (the metrics).

Corresponds to vLLM v1's `vllm/v1/metrics/stats.py` (SchedulerStats, IterationStats, FinishedRequestStats), with the
definitions the front end's OutputProcessor measures them by (its RequestState holds the timestamps):
TTFT from the request's arrival at AsyncLLM to the moment the front end received its first token;
inter-token latency between consecutive token-bearing messages of a request; queue time from arrival to
the start of the first core step that scheduled it (the core's clock: time.monotonic() is one clock for
every process of the machine); E2E latency from arrival to the moment the front end received the
finishing output. Times are `time.monotonic()` differences in seconds.

StepStats plays the part of vLLM's SchedulerStats: `make_step_stats` builds one per step from the
scheduler after `update_from_output` (vLLM's Scheduler.make_stats and make_spec_decoding_stats), with the
wall and CPU times the core measured around the step.

Left out: SchedulerStats' KV-cache eviction events and connector fields, the per-request phase times (prefill,
decode, inference, mean time per output token) and `max_tokens` of vLLM's FinishedRequestStats,
IterationStats' `n` of each new request, LoRA request states, and KV-connector and multimodal-cache stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attention_kv_caceh.engine.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from attention_kv_caceh.engine.outputs import ModelRunnerOutput
    from attention_kv_caceh.engine.scheduler import Scheduler, SchedulerOutput

__all__ = ["FinishedRequestStats", "IterationStats", "StepStats", "make_step_stats"]


@dataclass(frozen=True)
class StepStats:
    """One step's scheduling and cache numbers (vLLM's SchedulerStats per step).

    Attributes:
        step_index: 0, 1, 2, ... over the core's life.
        num_scheduled_tokens: request_id -> tokens computed this step.
        num_prefill_tokens, num_decode_tokens: split of the step's tokens (see SchedulerOutput).
        num_running, num_waiting: queue sizes after the step (vLLM's num_requests_running / _waiting).
        num_free_blocks: free KV blocks after the step.
        kv_cache_usage: used / total blocks after the step, in [0, 1].
        num_preemptions: requests preempted in this step.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up / found at this step's admissions.
        step_time_ms: wall time of the step (perf_counter), milliseconds.
        step_cpu_ms: CPU time of the thread that ran the step (time.thread_time), milliseconds: unlike
            step_time_ms it leaves out the time the thread waited for a CPU or for the GIL, so on a
            shared machine it tells the step's own work from the waiting.
        spec_decoding: the step's draft and acceptance counts (speculative decoding on), else None.
    """

    step_index: int
    num_scheduled_tokens: dict[str, int]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    step_time_ms: float
    step_cpu_ms: float = 0.0
    spec_decoding: SpecDecodingStats | None = None


def make_step_stats(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    model_runner_output: ModelRunnerOutput,
    step_index: int,
    step_time_ms: float,
    step_cpu_ms: float,
) -> StepStats:
    """The StepStats of the step `scheduler.update_from_output` just applied: the queues and the pool now,
    the prefix-cache lookups since its schedule() began, and with speculative decoding each verified
    request's drafts and accepted count (before a stop trimmed its tokens, as vLLM counts them)."""
    spec = scheduler.config.speculative_config
    spec_stats = None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)
    drafts = scheduler_output.scheduled_spec_decode_tokens
    if spec_stats is not None:
        for rid, tokens in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        ):
            if drafts.get(rid):
                spec_stats.observe_draft(len(drafts[rid]), len(tokens) - 1)
    kv = scheduler.kv_cache_manager
    queries0, hits0 = scheduler.prefix_cache_at_schedule
    return StepStats(
        step_index=step_index,
        num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
        num_prefill_tokens=scheduler_output.num_prefill_tokens,
        num_decode_tokens=scheduler_output.num_decode_tokens,
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        num_free_blocks=kv.num_free_blocks,
        kv_cache_usage=kv.usage,
        num_preemptions=len(scheduler_output.preempted_request_ids),
        prefix_cache_queries=kv.prefix_cache_queries - queries0,
        prefix_cache_hits=kv.prefix_cache_hits - hits0,
        step_time_ms=step_time_ms,
        step_cpu_ms=step_cpu_ms,
        spec_decoding=spec_stats,
    )


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request (vLLM v1's FinishedRequestStats); times in seconds."""

    finish_reason: str
    e2e_latency: float
    queued_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at the latest admission
    num_preemptions: int = 0


@dataclass(frozen=True)
class IterationStats:
    """What one engine step did, for stat loggers (vLLM v1's IterationStats); times in seconds."""

    num_prompt_tokens: int = 0  # prompt tokens of requests whose prefill finished this step
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0  # prefill + decode tokens computed this step
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list[float])
    inter_token_latencies: list[float] = field(default_factory=list[float])
    finished_requests: list[FinishedRequestStats] = field(default_factory=list[FinishedRequestStats])
    spec_decoding: SpecDecodingStats | None = None  # the step's drafts (speculative decoding on)
