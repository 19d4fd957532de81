"""Per-step and per-request serving statistics handed from AsyncLLM to stat loggers (the metrics).

Corresponds to vLLM v1's `vllm/v1/metrics/stats.py` (IterationStats, FinishedRequestStats), with the
definitions the front end's OutputProcessor measures them by (its RequestState holds the timestamps):
TTFT from the request's arrival at AsyncLLM to the moment the front end received its first token;
inter-token latency between consecutive token-bearing messages of a request; queue time from arrival to
the start of the first core step that scheduled it (the core's clock: time.monotonic() is one clock for
every process of the machine); E2E latency from arrival to the moment the front end received the
finishing output. Times are `time.monotonic()` differences in seconds.

Left out: SchedulerStats (the core's StepStats plays its part, core.py), the per-request phase times (prefill,
decode, inference, mean time per output token) and `max_tokens` of vLLM's FinishedRequestStats,
IterationStats' `n` of each new request, LoRA request states, and KV-connector and multimodal-cache stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attention_kv_caceh.engine.spec_decode.metrics import SpecDecodingStats

__all__ = ["FinishedRequestStats", "IterationStats"]


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
