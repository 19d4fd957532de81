"""Per-step and per-request serving statistics handed from AsyncLLM to stat loggers (the metrics).

Corresponds to vLLM v1's `vllm/v1/metrics/stats.py` (SchedulerStats, IterationStats, FinishedRequestStats), with the
definitions the front end's OutputProcessor measures them by (its RequestState holds the timestamps):
TTFT from the request's arrival at AsyncLLM to the moment the front end received its first token;
inter-token latency between consecutive token-bearing messages of a request; queue time from arrival to
the start of the first core step that scheduled it (the core's clock: time.monotonic() is one clock for
every process of the machine); E2E latency from arrival to the moment the front end received the
finishing output. Times are `time.monotonic()` differences in seconds.

StepStats plays the part of vLLM's SchedulerStats: `scheduler.Scheduler.make_stats` builds one per step
after `update_from_output` (vLLM's Scheduler.make_stats and make_spec_decoding_stats), with the
wall and CPU times the core measured around the step.

Left out: SchedulerStats' KV-cache eviction events and connector fields, the per-request phase times (prefill,
decode, inference, mean time per output token) and `max_tokens` of vLLM's FinishedRequestStats,
IterationStats' `n` of each new request, LoRA request states, and KV-connector and multimodal-cache stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attention_kv_caceh.engine.spec_decode.metrics import SpecDecodingStats

__all__ = ["FinishedRequestStats", "IterationStats", "StepStats"]


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
