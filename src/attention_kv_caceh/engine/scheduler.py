# stub: replaced by the scheduler branch at merge
"""SchedulerOutput (stub with the engine contract's fields only; the scheduler branch owns this module)."""

from __future__ import annotations

from dataclasses import dataclass, field

from attention_kv_caceh.engine.request import Request

__all__ = ["SchedulerOutput"]


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes (stub)."""

    scheduled_requests: list[Request]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list[str])
    finished_request_ids: list[str] = field(default_factory=list[str])
