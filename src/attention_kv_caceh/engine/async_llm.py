"""AsyncLLM: the engine's `step()` loop in a background thread, one asyncio stream per request.

Corresponds to vLLM v1's `vllm/v1/engine/async_llm.py` plus the per-request queues of its
`output_processor.py`, at the size of this project: the engine runs in a thread of the server's process
(not an engine-core process behind ZMQ), one request has one sequence (n = 1), no logprobs, no LoRA.

Why a thread: a model step is seconds of NumPy work that releases the GIL in its matmuls; the asyncio event
loop keeps accepting connections and writing streams beside it. One engine step serves every running
request, and a stream waits for at most the step that produces its next token. Outputs cross into the event
loop with `loop.call_soon_threadsafe(queue.put_nowait, ...)`; adds and aborts cross into the engine thread
through a command list under a lock and are applied before the next step (so an abort frees the request's
KV blocks at the next step).

Every use of the engine's API lives in this module: `EngineLike` (add_request, abort_request, step,
has_unfinished_requests, the scheduler's running/waiting lists, the KV usage, the last StepStats),
`EngineRequestOutput` / `EngineStepStats` (the fields read), `TokenizerLike`, and `load_engine` (building
the engine from a checkpoint). Adapting to a renamed engine API is a change here only.

After every step AsyncLLM hands an `IterationStats` (stats.py, which defines how each time is measured) to
its stat loggers (the Prometheus metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

from attention_kv_caceh.engine.output_processor import (
    EngineDrainingError,
    EngineRequestError,
    EngineStepError,
    RequestDelta,
    RequestState,
    RequestStream,
    StreamItem,
)
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.stats import FinishedRequestStats, IterationStats

__all__ = ["AsyncLLM", "EngineLike", "TokenizerLike", "load_engine"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# The engine's API as this module uses it (the one place to adapt at merge).
# ---------------------------------------------------------------------------------------------------------


class EngineRequestOutput(Protocol):
    """One request's output of one step (the engine's RequestOutput)."""

    @property
    def request_id(self) -> str: ...
    @property
    def new_token_ids(self) -> Sequence[int]: ...
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> str | None: ...


class EngineStepStats(Protocol):
    """What one step did (the engine's StepStats); token counts are per step, not cumulative."""

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def num_decode_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int: ...


class _HasRequestId(Protocol):
    @property
    def request_id(self) -> str: ...


class _KVCacheManagerLike(Protocol):
    @property
    def usage(self) -> float: ...


class _SchedulerLike(Protocol):
    @property
    def running(self) -> Sequence[_HasRequestId]: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_manager(self) -> _KVCacheManagerLike: ...
    @property
    def max_model_len(self) -> int: ...


class _ConfigLike(Protocol):
    @property
    def max_num_seqs(self) -> int: ...


class EngineLike(Protocol):
    """The LLMEngine surface the server drives (llm_engine.py: LLMEngine)."""

    @property
    def config(self) -> _ConfigLike: ...
    @property
    def scheduler(self) -> _SchedulerLike: ...
    @property
    def step_stats(self) -> Sequence[EngineStepStats]: ...
    @property
    def num_steps(self) -> int: ...
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, /
    ) -> object: ...
    def abort_request(self, request_ids: str, /) -> None: ...
    def step(self) -> Sequence[EngineRequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...


class TokenizerLike(Protocol):
    """The tokenizer surface the server uses (tokenizer.py: Tokenizer)."""

    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], /) -> str: ...


def load_engine(model_dir: str, config_kwargs: dict[str, Any]) -> tuple[EngineLike, TokenizerLike, int]:
    """Build the real engine from a checkpoint folder: (engine, tokenizer, max_model_len).

    `config_kwargs` are EngineConfig fields. Raises ValueError / OSError from the config or the loading.
    """
    config_module: Any = importlib.import_module("attention_kv_caceh.engine.config")
    engine_module: Any = importlib.import_module("attention_kv_caceh.engine.llm_engine")
    config = config_module.EngineConfig(**config_kwargs)
    engine: Any = engine_module.LLMEngine.from_pretrained(model_dir, config)
    return engine, engine.tokenizer, int(engine.scheduler.max_model_len)


def _admission_limit(engine: EngineLike) -> int:
    return engine.config.max_num_seqs


def _num_running(engine: EngineLike) -> int:
    return engine.scheduler.num_running


def _running_ids(engine: EngineLike) -> list[str]:
    return [request.request_id for request in list(engine.scheduler.running)]


def _num_waiting(engine: EngineLike) -> int:
    return engine.scheduler.num_waiting


def _kv_cache_usage(engine: EngineLike) -> float:
    return float(engine.scheduler.kv_cache_manager.usage)


# ---------------------------------------------------------------------------------------------------------
# The engine loop.
# ---------------------------------------------------------------------------------------------------------


class AsyncLLM:
    """Run `engine.step()` in a background thread and stream each request's outputs to asyncio.

    Call `start()` from the event loop that will read the streams, then `add_request` / `generate`;
    `await shutdown(timeout_s)` drains. The accessors (`num_running`, `num_waiting`, `kv_cache_usage`,
    `num_unfinished`) read the scheduler at the moment they are called (not the last step's snapshot).
    """

    def __init__(self, engine: EngineLike, tokenizer: TokenizerLike) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._cond = threading.Condition()
        # (kind, request_id, prompt_token_ids, sampling_params, finish_reason of an abort)
        self._commands: list[tuple[str, str, list[int], SamplingParams | None, str]] = []
        self._num_pending_adds = 0
        self._tracked: dict[str, RequestState] = {}
        self._stop = False
        self._draining = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None
        self._stat_loggers: list[Callable[[IterationStats], None]] = []
        self.num_steps = 0
        self.num_failed_steps = 0

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that reads the streams."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLM already started")
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop admitting, let running requests finish for up to `timeout_s`, abort the rest, stop the thread."""
        self._draining = True
        if self._thread is None or self._idle is None:
            return
        if self.num_unfinished > 0:
            self._idle.clear()
            if self.num_unfinished > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), timeout_s)
        with self._cond:
            for request_id in list(self._tracked):
                self._commands.append(("abort", request_id, [], None, "abort"))
            self._commands.append(("stop", "", [], None, ""))
            self._cond.notify()
        await asyncio.to_thread(self._thread.join, max(timeout_s, 1.0))

    def add_stat_logger(self, record: Callable[[IterationStats], None]) -> None:
        """Call `record(stats)` after every step, from the engine thread."""
        self._stat_loggers.append(record)

    # -- requests --------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> RequestStream:
        """Queue a request for the engine's next step; returns its stream.

        Raises EngineDrainingError while shutting down, ValueError for a request id already in use,
        RuntimeError before `start()`.
        """
        if self._loop is None:
            raise RuntimeError("AsyncLLM.start() was not called")
        if self._draining or self._stop:
            raise EngineDrainingError("the server is shutting down")
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        with self._cond:
            if request_id in self._tracked:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._tracked[request_id] = RequestState(queue, time.monotonic(), len(prompt_token_ids))
            self._commands.append(("add", request_id, list(prompt_token_ids), sampling_params, ""))
            self._num_pending_adds += 1
            self._cond.notify()
        return RequestStream(request_id, queue, self.abort)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> AsyncIterator[RequestDelta]:
        """Add a request and yield its RequestDeltas; leaving the loop early aborts it."""
        stream = self.add_request(request_id, prompt_token_ids, sampling_params)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """Abort a request at the engine's next step (no-op for an unknown or finished one)."""
        with self._cond:
            self._commands.append(("abort", request_id, [], None, finish_reason))
            self._cond.notify()

    # -- accessors read at the moment of the call ------------------------------------------------------

    @property
    def max_num_seqs(self) -> int:
        """The engine's max_num_seqs (requests one step may run)."""
        return _admission_limit(self.engine)

    @property
    def num_running(self) -> int:
        """Requests in the scheduler's running list now."""
        return _num_running(self.engine)

    @property
    def num_waiting(self) -> int:
        """Requests waiting: in the scheduler's waiting queue plus added but not yet handed to the engine."""
        with self._cond:
            pending = self._num_pending_adds
        return _num_waiting(self.engine) + pending

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use now (0..1)."""
        return _kv_cache_usage(self.engine)

    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet finished, aborted or failed."""
        with self._cond:
            return len(self._tracked)

    # -- engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop_forever()
        except Exception as exc:  # a bug outside engine.step(): fail everyone, /health turns 503
            logger.exception("the engine loop stopped")
            with self._cond:
                self._stop = True
                failed = list(self._tracked)
            self._fail(failed, exc)

    def _loop_forever(self) -> None:
        busy = False
        while True:
            with self._cond:
                while not self._commands and not busy:
                    self._cond.wait()
                commands, self._commands = self._commands, []
            for kind, request_id, prompt, params, reason in commands:
                if kind == "stop":
                    self._stop = True
                    return
                if kind == "add":
                    assert params is not None
                    self._apply_add(request_id, prompt, params)
                else:
                    self._apply_abort(request_id, reason)
            # a step that scheduled nothing cannot be followed by one that does until an add or an abort
            # changes the engine's state: wait for a command instead of spinning
            busy = self.engine.has_unfinished_requests() and self._step()

    def _apply_add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except ValueError as exc:  # the engine refused the request (e.g. larger than the whole KV pool)
            with self._cond:
                tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self._deliver(tracked, EngineRequestError(str(exc)))
            self._signal_if_idle()
        except Exception as exc:
            logger.exception("adding request %s failed", request_id)
            self._fail([request_id], exc)
        finally:
            with self._cond:
                self._num_pending_adds -= 1

    def _apply_abort(self, request_id: str, reason: str) -> None:
        with self._cond:
            tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        finished = tracked.finished_stats(reason, time.monotonic())
        self._record(IterationStats(0, 0, 0, 0, 0, 0, finished_requests=[finished]))
        delta = RequestDelta(
            request_id, (), True, reason, tracked.num_prompt_tokens, tracked.num_output_tokens
        )
        self._deliver(tracked, delta)
        try:
            self.engine.abort_request(request_id)  # frees its KV blocks before the next step
        except Exception:
            logger.exception("abort of request %s failed", request_id)
        self._signal_if_idle()

    def _step(self) -> bool:
        """One engine step and its outputs; False when the step scheduled nothing."""
        start = time.monotonic()
        num_stats = self.engine.num_steps  # step_stats is bounded: its length stops growing
        try:
            outputs = list(self.engine.step())
        except Exception as exc:
            self.num_failed_steps += 1
            logger.exception("engine step failed; failing the requests it was running")
            failed = _running_ids(self.engine)
            if not failed:
                with self._cond:
                    failed = list(self._tracked)
            for request_id in failed:
                with contextlib.suppress(Exception):  # the step's exception above is the one logged
                    self.engine.abort_request(request_id)
            self._fail(failed, exc)
            return True
        end = time.monotonic()
        self.num_steps += 1
        step_stats = self.engine.step_stats[-1] if self.engine.num_steps > num_stats else None
        self._process(outputs, step_stats, start, end)
        return bool(outputs) or step_stats is not None

    def _process(
        self,
        outputs: list[EngineRequestOutput],
        step_stats: EngineStepStats | None,
        start: float,
        end: float,
    ) -> None:
        ttfts: list[float] = []
        itls: list[float] = []
        finished: list[FinishedRequestStats] = []
        prompt_tokens = 0
        generation_tokens = 0
        if step_stats is not None:
            with self._cond:
                scheduled = [self._tracked.get(rid) for rid in step_stats.num_scheduled_tokens]
            for tracked in scheduled:
                if tracked is not None and tracked.scheduled_time is None:
                    tracked.scheduled_time = start
        for output in outputs:
            with self._cond:
                tracked = self._tracked.get(output.request_id)
                if tracked is not None and output.finished:
                    del self._tracked[output.request_id]
            if tracked is None:
                continue  # aborted before this step's output arrived
            new_ids = tuple(int(t) for t in output.new_token_ids)
            if new_ids:
                ttft, itl = tracked.record_tokens(len(new_ids), start, end)
                if ttft is not None:
                    ttfts.append(ttft)
                    prompt_tokens += tracked.num_prompt_tokens
                if itl is not None:
                    itls.append(itl)
                generation_tokens += len(new_ids)
            reason = output.finish_reason if output.finished else None
            delta = RequestDelta(
                output.request_id,
                new_ids,
                output.finished,
                reason,
                tracked.num_prompt_tokens,
                tracked.num_output_tokens,
            )
            self._deliver(tracked, delta)
            if output.finished:
                finished.append(tracked.finished_stats(reason or "stop", end))
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
        self._record(stats)
        if finished:
            self._signal_if_idle()

    def _fail(self, request_ids: list[str], exc: Exception) -> None:
        for request_id in request_ids:
            with self._cond:
                tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                error = EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}")
                self._deliver(tracked, error)
        self._signal_if_idle()

    def _deliver(self, tracked: RequestState, item: StreamItem) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is reading
            loop.call_soon_threadsafe(tracked.queue.put_nowait, item)

    def _record(self, stats: IterationStats) -> None:
        for record in self._stat_loggers:
            try:
                record(stats)
            except Exception:
                logger.exception("stat logger failed")

    def _signal_if_idle(self) -> None:
        loop, idle = self._loop, self._idle
        if loop is None or idle is None or self.num_unfinished > 0:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(idle.set)
