# stub: replaced by the scheduler branch at merge
"""Request and SamplingParams (stub with the engine contract's names only; the scheduler branch owns this module)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Request", "RequestStatus", "SamplingParams"]


class RequestStatus(enum.Enum):
    """Lifecycle of a request (stub)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (stub)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Request:
    """One request's tokens and block table (stub: only what the model runner reads)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list[int])
    block_ids: list[int] = field(default_factory=list[int])
    num_cached_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """len(all_token_ids)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """len(prompt_token_ids)."""
        return len(self.prompt_token_ids)
