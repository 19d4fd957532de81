"""What crosses from the engine thread to a request's reader: deltas, errors, per-request state, streams.

Corresponds to vLLM v1's `vllm/v1/engine/output_processor.py` (RequestState, RequestOutputCollector) at a
small size: the engine thread puts each request's RequestDelta (or the exception that ended it) on the
request's asyncio.Queue through `loop.call_soon_threadsafe`; the reader iterates a RequestStream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from attention_kv_caceh.engine.stats import FinishedRequestStats

__all__ = [
    "EngineDrainingError",
    "EngineRequestError",
    "EngineStepError",
    "RequestDelta",
    "RequestState",
    "RequestStream",
    "StreamItem",
]


@dataclass(frozen=True)
class RequestDelta:
    """New tokens of one request after one step. `finish_reason`: "stop" | "length" | "abort" | None."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, including new_token_ids


class EngineStepError(RuntimeError):
    """The engine step that served this request raised; the request was aborted."""


class EngineRequestError(ValueError):
    """The engine refused the request when it was added (a client error: HTTP 400)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and admits no new request."""


StreamItem = RequestDelta | BaseException


@dataclass
class RequestState:
    """One request's stream queue and timing (times: time.monotonic() seconds; see stats.py).

    Fields other than `queue` are touched by the engine thread only.
    """

    queue: asyncio.Queue[StreamItem]
    arrival_time: float
    num_prompt_tokens: int
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0

    def record_tokens(self, n: int, start: float, end: float) -> tuple[float | None, float | None]:
        """Note n new tokens from the step that ran from `start` to `end`: (TTFT, ITL), each None when it
        does not apply (TTFT on the first tokens only, ITL on the later ones)."""
        if self.scheduled_time is None:
            self.scheduled_time = start
        ttft = itl = None
        if self.first_token_time is None:
            self.first_token_time = end
            ttft = end - self.arrival_time
        elif self.last_token_time is not None:
            itl = end - self.last_token_time
        self.last_token_time = end
        self.num_output_tokens += n
        return ttft, itl

    def finished_stats(self, reason: str, now: float) -> FinishedRequestStats:
        """The request's FinishedRequestStats when it ends at `now` with `reason`."""
        scheduled = self.scheduled_time if self.scheduled_time is not None else now
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - self.arrival_time,
            queued_time=scheduled - self.arrival_time,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_output_tokens,
        )


class RequestStream:
    """The async iterator of one request's RequestDeltas; `close()` aborts it if it has not finished.

    When the reader falls behind the engine, the deltas waiting in the queue come out merged into one (as
    vLLM's RequestOutputCollector merges them): a reader then waits on an empty queue after every delta,
    so a fast engine can never keep the event loop from serving other connections. Iteration raises
    EngineStepError when the step serving the request failed, EngineRequestError when the engine refused
    the request.
    """

    def __init__(
        self, request_id: str, queue: asyncio.Queue[StreamItem], abort: Callable[[str, str], None]
    ) -> None:
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
        self._done = False
        self._error: BaseException | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        if self._error is not None:
            self._done = True
            raise self._error
        item = await self._queue.get()
        merged: RequestDelta | None = None
        while True:
            if isinstance(item, BaseException):
                if merged is None:
                    self._done = True
                    raise item
                self._error = item  # the tokens before it first
                break
            merged = item if merged is None else _merge(merged, item)
            if merged.finished or self._queue.empty():
                break
            item = self._queue.get_nowait()
        if merged.finished:
            self._done = True
        return merged

    def close(self, finish_reason: str = "abort") -> None:
        """Abort the request unless it finished (idempotent); applied before the engine's next step.

        `finish_reason` is what the metrics record: "abort" for a client that left, "stop" for a stop
        string the server found in the text.
        """
        if not self._done:
            self._done = True
            self._abort(self.request_id, finish_reason)


def _merge(first: RequestDelta, then: RequestDelta) -> RequestDelta:
    """`first` followed by `then` as one delta."""
    return RequestDelta(
        first.request_id,
        first.new_token_ids + then.new_token_ids,
        then.finished,
        then.finish_reason,
        then.num_prompt_tokens,
        then.num_output_tokens,
    )
