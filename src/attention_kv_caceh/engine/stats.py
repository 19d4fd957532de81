"""Per-step and per-request serving statistics handed from AsyncLLM to stat loggers (the metrics).

Corresponds to vLLM v1's `vllm/v1/metrics/stats.py` (IterationStats, FinishedRequestStats), with the
definitions AsyncLLM measures them by: TTFT from the request's arrival at AsyncLLM to the end of the step
that produced its first token; inter-token latency between consecutive token-producing steps of a request;
queue time from arrival to the start of the first step that scheduled it; E2E latency from arrival to the
end of the finishing step. Times are `time.monotonic()` differences in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FinishedRequestStats", "IterationStats"]


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request (vLLM v1's FinishedRequestStats); times in seconds."""

    finish_reason: str
    e2e_latency: float
    queued_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass(frozen=True)
class IterationStats:
    """What one engine step did, for stat loggers (vLLM v1's IterationStats); times in seconds."""

    num_prompt_tokens: int  # prompt tokens of requests whose prefill finished this step
    num_generation_tokens: int
    num_scheduled_tokens: int  # prefill + decode tokens computed this step
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    time_to_first_tokens: list[float] = field(default_factory=list[float])
    inter_token_latencies: list[float] = field(default_factory=list[float])
    finished_requests: list[FinishedRequestStats] = field(default_factory=list[FinishedRequestStats])
