"""What crosses from the engine thread to a request's reader: deltas, errors, per-request state, streams.

Corresponds to vLLM v1's `vllm/v1/engine/output_processor.py` (OutputProcessor, RequestState,
RequestOutputCollector) at a small size: `OutputProcessor.process_outputs` turns one engine step's
RequestOutputs into each request's RequestDelta and the step's IterationStats (stats.py defines how each
time is measured); AsyncLLM's engine thread puts each delta (or the exception that ended the request) on
the request's asyncio.Queue through `loop.call_soon_threadsafe`; the reader iterates a RequestStream.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from attention_kv_caceh.engine.llm_engine import RequestOutput, StepStats
from attention_kv_caceh.engine.request import TokenLogprobs
from attention_kv_caceh.engine.stats import FinishedRequestStats, IterationStats

__all__ = [
    "EngineDrainingError",
    "EngineRequestError",
    "EngineStepError",
    "OutputProcessor",
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
    logprobs: tuple[TokenLogprobs, ...] = ()  # of new_token_ids, when the request asked for logprobs
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # once, with the first tokens


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
        first.logprobs + then.logprobs,
        first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs,
    )


class OutputProcessor:
    """The states of the requests being served, and one step's outputs turned into deltas and stats.

    Thread-safe: the event loop adds requests, the engine thread processes outputs and removes them.
    A request leaves when its finishing output is processed, or with `pop` (abort, refusal, failure).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)

    def request_ids(self) -> list[str]:
        """The ids of the requests being served, in the order they were added."""
        with self._lock:
            return list(self._states)

    def add_request(self, request_id: str, state: RequestState) -> None:
        """Track a new request. Raises ValueError for an id already in use."""
        with self._lock:
            if request_id in self._states:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._states[request_id] = state

    def pop(self, request_id: str) -> RequestState | None:
        """Stop tracking a request; its state, or None when unknown or already finished."""
        with self._lock:
            return self._states.pop(request_id, None)

    def abort_request(
        self, request_id: str, reason: str, now: float
    ) -> tuple[RequestState, RequestDelta, IterationStats] | None:
        """Stop tracking an aborted request: its state, its final (empty) delta and the stats recording
        it as finished with `reason`; None when unknown or already finished."""
        state = self.pop(request_id)
        if state is None:
            return None
        finished = state.finished_stats(reason, now)
        stats = IterationStats(0, 0, 0, 0, 0, 0, finished_requests=[finished])
        delta = RequestDelta(request_id, (), True, reason, state.num_prompt_tokens, state.num_output_tokens)
        return state, delta, stats

    def process_outputs(
        self,
        outputs: Sequence[RequestOutput],
        step_stats: StepStats | None,
        start: float,
        end: float,
    ) -> tuple[list[tuple[RequestState, RequestDelta]], IterationStats]:
        """One engine step that ran from `start` to `end` (time.monotonic() s): each tracked request's
        (state, delta) and the step's IterationStats. `step_stats` None: the step recorded none."""
        ttfts: list[float] = []
        itls: list[float] = []
        finished: list[FinishedRequestStats] = []
        deliveries: list[tuple[RequestState, RequestDelta]] = []
        prompt_tokens = generation_tokens = 0
        if step_stats is not None:
            with self._lock:
                scheduled = [self._states.get(rid) for rid in step_stats.num_scheduled_tokens]
            for state in scheduled:
                if state is not None and state.scheduled_time is None:
                    state.scheduled_time = start
        for output in outputs:
            with self._lock:
                state = self._states.get(output.request_id)
                if state is not None and output.finished:
                    del self._states[output.request_id]
            if state is None:
                continue  # aborted before this step's output arrived
            new_ids = tuple(int(t) for t in output.new_token_ids)
            if new_ids:
                ttft, itl = state.record_tokens(len(new_ids), start, end)
                if ttft is not None:
                    ttfts.append(ttft)
                    prompt_tokens += state.num_prompt_tokens
                if itl is not None:
                    itls.append(itl)
                generation_tokens += len(new_ids)
            reason = output.finish_reason if output.finished else None
            delta = RequestDelta(
                output.request_id,
                new_ids,
                output.finished,
                reason,
                state.num_prompt_tokens,
                state.num_output_tokens,
                tuple(output.logprobs),
                output.prompt_logprobs,
            )
            deliveries.append((state, delta))
            if output.finished:
                finished.append(state.finished_stats(reason or "stop", end))
        stats = IterationStats(
            num_prompt_tokens=prompt_tokens,
            num_generation_tokens=generation_tokens,
            num_scheduled_tokens=0
            if step_stats is None
            else step_stats.num_prefill_tokens + step_stats.num_decode_tokens,
            num_preemptions=0 if step_stats is None else step_stats.num_preemptions,
            prefix_cache_queries=0 if step_stats is None else step_stats.prefix_cache_queries,
            prefix_cache_hits=0 if step_stats is None else step_stats.prefix_cache_hits,
            time_to_first_tokens=ttfts,
            inter_token_latencies=itls,
            finished_requests=finished,
        )
        return deliveries, stats
