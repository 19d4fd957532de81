"""AsyncLLM: the engine's `step()` loop in a background thread, one asyncio stream per request.

Corresponds to vLLM v1's `vllm/v1/engine/async_llm.py` plus the per-request queues of its
`output_processor.py`, at the size of this project: the engine runs in a thread of the server's process
(not an engine-core process behind ZMQ), one request has one sequence (the server fans `n` out into requests), no LoRA.

Why a thread: a model step is seconds of NumPy work that releases the GIL in its matmuls; the asyncio event
loop keeps accepting connections and writing streams beside it. One engine step serves every running
request, and a stream waits for at most the step that produces its next token. Outputs cross into the event
loop with `loop.call_soon_threadsafe(queue.put_nowait, ...)`; adds and aborts cross into the engine thread
through a command list under a lock and are applied before the next step (so an abort frees the request's
KV blocks at the next step).

Per-request state and the conversion of a step's outputs into deltas and IterationStats live in
output_processor.py (OutputProcessor); this module owns the thread, the command list and the delivery.

After every step AsyncLLM hands an `IterationStats` (stats.py, which defines how each time is measured) to
its stat loggers (the Prometheus metrics). Tests drive AsyncLLM with fakes of LLMEngine and Tokenizer
that have the same attributes (tests/fake_engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine, RequestOutput
from attention_kv_caceh.engine.output_processor import (
    EngineDrainingError,
    EngineRequestError,
    EngineStepError,
    OutputProcessor,
    RequestDelta,
    RequestState,
    RequestStream,
    StreamItem,
)
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.stats import IterationStats
from attention_kv_caceh.engine.tokenizer import Tokenizer

__all__ = ["AsyncLLM", "load_engine"]

logger = logging.getLogger(__name__)


def load_engine(model_dir: str, config_kwargs: dict[str, Any]) -> tuple[LLMEngine, Tokenizer, int]:
    """Build the real engine from a checkpoint folder: (engine, tokenizer, max_model_len).

    `config_kwargs` are EngineConfig fields. Raises ValueError / OSError from the config or the loading.
    """
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**config_kwargs))
    tokenizer = engine.tokenizer
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"{model_dir}: the engine was built without a tokenizer")
    return engine, tokenizer, engine.scheduler.max_model_len


# ---------------------------------------------------------------------------------------------------------
# The engine loop.
# ---------------------------------------------------------------------------------------------------------


class AsyncLLM:
    """Run `engine.step()` in a background thread and stream each request's outputs to asyncio.

    Call `start()` from the event loop that will read the streams, then `add_request` / `generate`;
    `await shutdown(timeout_s)` drains. The accessors (`num_running`, `num_waiting`, `kv_cache_usage`,
    `num_unfinished`) read the scheduler at the moment they are called (not the last step's snapshot).
    """

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor()
        self._cond = threading.Condition()
        # (kind, request_id, prompt_token_ids, sampling_params, finish_reason of an abort)
        self._commands: list[tuple[str, str, list[int], SamplingParams | None, str]] = []
        self._num_pending_adds = 0
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
            for request_id in self.output_processor.request_ids():
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
        state = RequestState(queue, time.monotonic(), len(prompt_token_ids))
        with self._cond:
            self.output_processor.add_request(request_id, state)
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
        return self.engine.config.max_num_seqs

    @property
    def num_running(self) -> int:
        """Requests in the scheduler's running list now."""
        return self.engine.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Requests waiting: in the scheduler's waiting queue plus added but not yet handed to the engine."""
        with self._cond:
            pending = self._num_pending_adds
        return self.engine.scheduler.num_waiting + pending

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use now (0..1)."""
        return float(self.engine.scheduler.kv_cache_manager.usage)

    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet finished, aborted or failed."""
        return len(self.output_processor)

    # -- engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop_forever()
        except Exception as exc:  # a bug outside engine.step(): fail everyone, /health turns 503
            logger.exception("the engine loop stopped")
            with self._cond:
                self._stop = True
            self._fail(self.output_processor.request_ids(), exc)

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
            state = self.output_processor.pop(request_id)
            if state is not None:
                self._deliver(state, EngineRequestError(str(exc)))
            self._signal_if_idle()
        except Exception as exc:
            logger.exception("adding request %s failed", request_id)
            self._fail([request_id], exc)
        finally:
            with self._cond:
                self._num_pending_adds -= 1

    def _apply_abort(self, request_id: str, reason: str) -> None:
        aborted = self.output_processor.abort_request(request_id, reason, time.monotonic())
        if aborted is None:
            return
        state, delta, stats = aborted
        self._record(stats)
        self._deliver(state, delta)
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
            outputs: Sequence[RequestOutput] = self.engine.step()
        except Exception as exc:
            self.num_failed_steps += 1
            logger.exception("engine step failed; failing the requests it was running")
            failed = [request.request_id for request in list(self.engine.scheduler.running)]
            if not failed:
                failed = self.output_processor.request_ids()
            for request_id in failed:
                with contextlib.suppress(Exception):  # the step's exception above is the one logged
                    self.engine.abort_request(request_id)
            self._fail(failed, exc)
            return True
        end = time.monotonic()
        self.num_steps += 1
        step_stats = self.engine.step_stats[-1] if self.engine.num_steps > num_stats else None
        deliveries, stats = self.output_processor.process_outputs(outputs, step_stats, start, end)
        for state, delta in deliveries:
            self._deliver(state, delta)
        self._record(stats)
        if stats.finished_requests:
            self._signal_if_idle()
        return bool(outputs) or step_stats is not None

    def _fail(self, request_ids: list[str], exc: Exception) -> None:
        for request_id in request_ids:
            state = self.output_processor.pop(request_id)
            if state is not None:
                error = EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}")
                self._deliver(state, error)
        self._signal_if_idle()

    def _deliver(self, state: RequestState, item: StreamItem) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is reading
            loop.call_soon_threadsafe(state.queue.put_nowait, item)

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
