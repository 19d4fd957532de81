"""OutputProcessor: the core's token ids turned into each request's text deltas, stop strings and timestamps.

Corresponds to vLLM v1's `vllm/v1/engine/output_processor.py` (OutputProcessor, RequestState,
RequestOutputCollector) and `detokenizer.py`, at a small size. It lives in the front end (the API process,
or LLMEngine's caller) and is the one output path: per request ONE IncrementalDetokenizer (tokenizer.py,
vLLM's windowed offsets: a step costs a short window of tokens, not the whole output), the `stop` strings
of its SamplingParams, and the timestamps the metrics are made of (stats.py defines each time).

Stop strings: the text stops before the first occurrence of any of them, with finish_reason "stop", and
`process_outputs` returns the request among `reqs_to_abort` so the caller aborts it in the core (its
blocks are freed at the core's next step). While stop strings are set, the last `max(len(stop)) - 1`
characters are held back from the deltas (a stop string may straddle two of them), so the deltas always
concatenate to the whole text. A token whose text cannot be sent yet (half of a UTF-8 character, or held
back) still yields a delta, with empty text: a server sends it as a chunk so a client can time every
token, as vLLM does.

Thread-safety: the event loop adds requests and reads streams; the thread that runs `process_outputs`
(AsyncLLM's output thread) removes finished ones; a lock guards the table.

Left out: vLLM's output kinds other than deltas (CUMULATIVE and FINAL_ONLY), parallel sampling's ParentRequest
aggregation (`n` is fanned out by AsyncLLM.add_parallel_request, each child with its own stream), pooling
outputs, LoRA request states, and tracing (OpenTelemetry spans).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from attention_kv_caceh.engine.core import EngineCoreOutputs
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.stats import FinishedRequestStats, IterationStats
from attention_kv_caceh.engine.tokenizer import IncrementalDetokenizer, TextDecoder, Tokenizer

__all__ = [
    "EngineDrainingError",
    "EngineRequestError",
    "EngineStepError",
    "OutputProcessor",
    "OutputProcessorOutput",
    "RequestDelta",
    "RequestState",
    "RequestStream",
    "StreamItem",
]


@dataclass(frozen=True)
class RequestDelta:
    """What one step added to one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens produced (one per step, up to 1 + K with speculative decoding; more when
            a slow reader's deltas were merged).
        text: the text they added that can be sent ("" without a tokenizer, while a UTF-8 character is
            incomplete, or while held back for a stop string).
        finished: the request ended.
        finish_reason: "stop" | "length" | "abort" when finished, else None.
        num_prompt_tokens: prompt tokens.
        num_output_tokens: output tokens so far, including new_token_ids.
        new_logprobs: the core's logprobs payloads of these tokens (a list, one entry per token), or None.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: list[Any] | None = None


class EngineStepError(RuntimeError):
    """The engine step that served this request raised; the request was aborted."""


class EngineRequestError(ValueError):
    """The engine refused the request when it was added (a client error: HTTP 400)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and admits no new request."""


StreamItem = RequestDelta | BaseException


@dataclass
class RequestState:
    """One request in the front end: its text state and its times (time.monotonic() seconds; stats.py).

    `queue` is where AsyncLLM delivers its deltas (None for LLMEngine, which returns them).
    """

    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    detokenizer: IncrementalDetokenizer | None
    queue: asyncio.Queue[StreamItem] | None = None
    text: str = ""  # every character produced so far (only kept with stop strings)
    sent: int = 0  # characters of `text` already in a delta
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    holdback: int = field(init=False)
    floor: int | None = field(init=False)  # a stop string must end after text[:floor]; None: not yet

    def __post_init__(self) -> None:
        self.holdback = max((len(s) for s in self.params.stop), default=1) - 1
        self.floor = 0 if self.params.min_tokens == 0 else None

    def record_tokens(self, n: int, now: float) -> tuple[float | None, float | None]:
        """Note n new tokens received at `now`: (TTFT, ITL), each None when it does not apply (TTFT on
        the first tokens only, ITL on the later ones)."""
        ttft = itl = None
        if self.first_token_time is None:
            self.first_token_time = now
            ttft = now - self.arrival_time
        elif self.last_token_time is not None:
            itl = now - self.last_token_time
        self.last_token_time = now
        self.num_output_tokens += n
        return ttft, itl

    def finished_stats(self, reason: str, now: float) -> FinishedRequestStats:
        """The request's FinishedRequestStats when it ends at `now` with `reason`."""
        scheduled = self.scheduled_time if self.scheduled_time is not None else now
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - self.arrival_time,
            queued_time=max(scheduled - self.arrival_time, 0.0),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
        )

    def text_delta_each(
        self, new_ids: list[int], finished: bool, stop_token: bool = False
    ) -> tuple[str, bool, int]:
        """`text_delta` of several tokens one at a time, so that a stop string ends the request at the
        token that completes it, as it would have one token per step (vLLM drops the tokens after that
        one too): (text, whether a stop string ended it, tokens kept). `num_output_tokens` counts the
        kept tokens only."""
        if not self.params.stop or len(new_ids) <= 1:
            text, stopped = self.text_delta(new_ids, finished, stop_token)
            return text, stopped, len(new_ids)
        base = self.num_output_tokens - len(new_ids)
        out = ""
        for i, token in enumerate(new_ids):
            last = i == len(new_ids) - 1
            self.num_output_tokens = base + i + 1
            text, stopped = self.text_delta([token], finished and last, stop_token and last)
            out += text
            if stopped:
                return out, True, i + 1
        return out, False, len(new_ids)

    def text_delta(self, new_ids: list[int], finished: bool, stop_token: bool = False) -> tuple[str, bool]:
        """The sendable text after `new_ids`, and whether a stop string ended the request.

        `stop_token`: the last id is eos or a stop token id that ended the request; its text is left out
        unless include_stop_str_in_output (as vLLM does). A stop string counts only when it ends in the
        text of a token after the first min_tokens (`floor`); with include_stop_str_in_output the text
        keeps it."""
        detok = self.detokenizer
        if detok is None:
            return "", False
        params = self.params
        ids = list(new_ids)
        if stop_token and ids and not params.include_stop_str_in_output:
            ids.pop()
        before = self.num_output_tokens - len(new_ids)  # record_tokens counted new_ids already
        if self.floor is None and before + len(ids) >= params.min_tokens:
            first = detok.add(ids[: params.min_tokens - before])
            self.floor = len(self.text) + len(first)
            new = first + detok.add(ids[params.min_tokens - before :])
        else:
            new = detok.add(ids)
        if finished:
            new += detok.flush()
        stops = params.stop
        if not stops:
            return new, False
        self.text += new
        found: list[tuple[int, str]] = []
        if self.floor is not None:
            start = max(0, self.sent - self.holdback)
            for stop in stops:
                i = self.text.find(stop, max(start, self.floor - len(stop) + 1))
                if i >= 0:
                    found.append((i, stop))
        if found:
            index, stop = min(found, key=lambda f: f[0])
            end = index + len(stop) if params.include_stop_str_in_output else index
            delta = self.text[self.sent : end]
            self.sent = end
            return delta, True
        end = len(self.text) if finished else len(self.text) - self.holdback
        if end <= self.sent:
            return "", False
        delta = self.text[self.sent : end]
        self.sent = end
        return delta, False


@dataclass
class OutputProcessorOutput:
    """One message's results: `deliveries` (state, delta or the exception that ended the request),
    the IterationStats for the stat loggers, and the requests a stop string ended (abort them in the core)."""

    deliveries: list[tuple[RequestState, StreamItem]]
    stats: IterationStats
    reqs_to_abort: list[str]


class _KeepSpecialTokens:
    """A decoder that keeps special tokens (skip_special_tokens=False) when the tokenizer can."""

    def __init__(self, tokenizer: TextDecoder) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: list[int], /) -> str:
        if isinstance(self._tokenizer, Tokenizer):
            return self._tokenizer.decode(token_ids, skip_special_tokens=False)
        return self._tokenizer.decode(token_ids)


class OutputProcessor:
    """The states of the requests being served; one core message turned into deltas and stats.

    `tokenizer` None: no text (deltas carry token ids only) and stop strings never match.
    """

    def __init__(self, tokenizer: TextDecoder | None) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)

    def request_ids(self) -> list[str]:
        """The ids of the requests being served, in the order they were added."""
        with self._lock:
            return list(self._states)

    def add_request(
        self,
        request_id: str,
        num_prompt_tokens: int,
        params: SamplingParams,
        arrival_time: float,
        queue: asyncio.Queue[StreamItem] | None = None,
    ) -> RequestState:
        """Track a new request. Raises ValueError for an id already in use."""
        detokenizer = None
        if self.tokenizer is not None:
            decoder = self.tokenizer if params.skip_special_tokens else _KeepSpecialTokens(self.tokenizer)
            detokenizer = IncrementalDetokenizer(decoder)
        state = RequestState(request_id, num_prompt_tokens, params, arrival_time, detokenizer, queue)
        with self._lock:
            if request_id in self._states:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._states[request_id] = state
        return state

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
        stats = IterationStats(finished_requests=[state.finished_stats(reason, now)])
        delta = RequestDelta(
            request_id, (), "", True, reason, state.num_prompt_tokens, state.num_output_tokens
        )
        return state, delta, stats

    def fail_all(self, make_error: Callable[[], BaseException]) -> list[tuple[RequestState, StreamItem]]:
        """Stop tracking every request; each with the exception `make_error()` gives."""
        with self._lock:
            states, self._states = list(self._states.values()), {}
        return [(state, make_error()) for state in states]

    def process_outputs(self, outputs: EngineCoreOutputs, now: float) -> OutputProcessorOutput:
        """One core message received at `now` (time.monotonic() s): each tracked request's delta or
        error, the IterationStats, and the requests a stop string ended."""
        ttfts: list[float] = []
        itls: list[float] = []
        finished: list[FinishedRequestStats] = []
        deliveries: list[tuple[RequestState, StreamItem]] = []
        to_abort: list[str] = []
        prompt_tokens = generation_tokens = 0
        step_stats = outputs.step_stats
        if step_stats is not None:
            with self._lock:
                scheduled = [self._states.get(rid) for rid in step_stats.num_scheduled_tokens]
            for state in scheduled:
                if state is not None and state.scheduled_time is None:
                    state.scheduled_time = outputs.step_start
        for output in outputs.outputs:
            with self._lock:
                state = self._states.get(output.request_id)
            if state is None:
                continue  # aborted before this output arrived
            reason = output.finish_reason
            if reason in ("error", "rejected"):
                self.pop(output.request_id)
                message = output.error or reason
                error = EngineRequestError(message) if reason == "rejected" else EngineStepError(message)
                deliveries.append((state, error))
                continue
            new_ids = output.new_token_ids
            state.num_cached_tokens = output.num_cached_tokens
            state.num_preemptions = output.num_preemptions
            if new_ids:
                ttft, itl = state.record_tokens(len(new_ids), now)
                if ttft is not None:
                    ttfts.append(ttft)
                    prompt_tokens += state.num_prompt_tokens
                if itl is not None:
                    itls.append(itl)
                generation_tokens += len(new_ids)
            text, stopped, kept = state.text_delta_each(
                new_ids, reason is not None, reason == "stop" and not output.grammar_stop
            )
            if stopped:
                reason = "stop"
                to_abort.append(output.request_id)
                generation_tokens -= len(new_ids) - kept
                new_ids = new_ids[:kept]
            if reason is not None:
                self.pop(output.request_id)
                finished.append(state.finished_stats(reason, now))
            logprobs = None if output.new_logprobs is None else list(output.new_logprobs)[: len(new_ids)]
            delta = RequestDelta(
                output.request_id,
                tuple(new_ids),
                text,
                reason is not None,
                reason,
                state.num_prompt_tokens,
                state.num_output_tokens,
                logprobs,
            )
            deliveries.append((state, delta))
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
            spec_decoding=None if step_stats is None else step_stats.spec_decoding,
        )
        return OutputProcessorOutput(deliveries, stats, to_abort)


class RequestStream:
    """The async iterator of one request's RequestDeltas; `close()` aborts it if it has not finished.

    When the reader falls behind the engine, the deltas waiting in the queue come out merged into one (as
    vLLM's RequestOutputCollector merges them): a reader then waits on an empty queue after every delta,
    so a fast engine can never keep the event loop from serving other connections. Iteration raises
    EngineStepError when the step serving the request failed, EngineRequestError when the engine refused
    the request, EngineDeadError (core_client.py) when the engine core died.
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

        `finish_reason` is what the metrics record ("abort" for a client that left).
        """
        if not self._done:
            self._done = True
            self._abort(self.request_id, finish_reason)


def _merge(first: RequestDelta, then: RequestDelta) -> RequestDelta:
    """`first` followed by `then` as one delta."""
    logprobs = None
    if first.new_logprobs is not None or then.new_logprobs is not None:
        logprobs = (first.new_logprobs or []) + (then.new_logprobs or [])
    return RequestDelta(
        first.request_id,
        first.new_token_ids + then.new_token_ids,
        first.text + then.text,
        then.finished,
        then.finish_reason,
        then.num_prompt_tokens,
        then.num_output_tokens,
        logprobs,
    )
