"""AsyncLLM: the API process's side of the engine: requests in, one asyncio stream per request out.

Corresponds to vLLM v1's `vllm/v1/engine/async_llm.py`. AsyncLLM holds an MPClient (core_client.py) that
sends requests and aborts to the EngineCore, and an OutputProcessor (output_processor.py) that turns the
core's token ids into text deltas (one incremental detokenizer per request), applies stop strings (and
aborts the request in the core when one matches) and keeps the per-request timestamps the metrics read.

Where each piece runs:

- the event loop (uvicorn): `generate` / `add_request` (send the request), `abort`, reading the streams;
- the output thread of this process: wait for the core's next message, decode it, `process_outputs`
  (detokenize, stop strings), then hand every request's delta to the event loop in one
  `loop.call_soon_threadsafe` and the IterationStats to the stat loggers; the event loop never
  detokenizes;
- the core: in its own process for `serve` (`from_checkpoint`), or in a thread of this process for
  tests that hold a step or read the scheduler (`from_engine_core`): the same EngineCoreProc and sockets.

Faults: a core that dies (killed, out of memory, its loop failed) ends every open stream with
EngineDeadError; from then on `add_request` raises EngineDeadError and `is_running` is False (the server
answers 503 and /health 503). `shutdown(timeout_s)` drains: it refuses new requests, gives the running
ones up to `timeout_s` seconds, ends the rest with finish_reason "abort", and stops the core.

A request of `n` samples is `add_parallel_request`: `n` child requests (parallel_sampling.py's
ParentRequest), as vLLM's `add_request` fans out `SamplingParams.n`.

Left out: vLLM's input processor (prompts arrive here as token ids: the server tokenizes them and applies the
chat template, entrypoints/openai/), the gathering of a request's samples into one output (each child has its
own stream; parallel_sampling.py), LoRA, multimodal inputs, pooling (`encode`), several data-parallel engine cores, and the
utility calls other than `reset_prefix_cache` (sleep / wake_up, profiling, collective_rpc).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol, TypeVar

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.core import (
    STEP_STATS_MAXLEN,
    EngineCore,
    EngineCoreOutputs,
    EngineCoreRequest,
    StepStats,
)
from attention_kv_caceh.engine.core_client import EngineDeadError, MPClient
from attention_kv_caceh.engine.kv_cache_manager import KVCacheConfig
from attention_kv_caceh.engine.output_processor import (
    EngineDrainingError,
    OutputProcessor,
    RequestState,
    RequestStream,
    StreamItem,
)
from attention_kv_caceh.engine.parallel_sampling import ChildFactory, ChildRequest, ParentRequest
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.stats import IterationStats

__all__ = ["AsyncLLM", "EngineDeadError", "TokenizerLike"]

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=ChildRequest)


class TokenizerLike(Protocol):
    """What the API process needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """Token ids of `text`; with `max_length`, only its first `max_length` tokens."""
        ...

    def encode_counted(
        self, text: str, add_special_tokens: bool = True, max_length: int | None = None
    ) -> tuple[list[int], int, bool]:
        """`encode(text, add_special_tokens, max_length)`, the number of tokens of the whole text, and
        whether that number is exact (else a lower bound above `max_length`; see Tokenizer.encode_counted)."""
        ...

    def decode(self, ids: list[int], /) -> str:
        """Text of the ids."""
        ...


class AsyncLLM:
    """Serve requests from asyncio through an engine core behind `client`.

    Build it with `from_checkpoint` (the core in a child process) or `from_engine_core` (the core in a
    thread). Call `start()` from the event loop that reads the streams; `await shutdown(timeout_s)` drains.

    Attributes:
        step_stats: the core's StepStats as they arrived, the newest STEP_STATS_MAXLEN.
        num_steps: steps reported by the core; num_failed_steps: steps that raised.
        engine_core: the EngineCore when it runs in this process (tests read its scheduler), else None.
    """

    def __init__(
        self,
        client: MPClient,
        tokenizer: TokenizerLike,
        *,
        max_num_seqs: int,
        max_model_len: int,
        engine_core: EngineCore | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.engine_core = engine_core
        self.output_processor = OutputProcessor(tokenizer)
        self.step_stats: deque[StepStats] = deque(maxlen=STEP_STATS_MAXLEN)
        self.num_steps = 0
        self.num_failed_steps = 0
        self._num_running = 0
        self._kv_cache_usage = 0.0
        self._stat_loggers: list[Callable[[IterationStats], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._draining = False
        self._stopped = False
        self.errored: EngineDeadError | None = None

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str,
        config: EngineConfig,
        tokenizer: TokenizerLike,
        max_model_len: int,
        *,
        cpu: int | None = None,
    ) -> AsyncLLM:
        """Start the engine core in a child process that loads `model_dir` (waits until it has).

        Raises EngineDeadError when the core fails to load or exits during its start.
        """
        client = MPClient.launch_process(model_dir, config, cpu=cpu)
        return cls(client, tokenizer, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len)

    @classmethod
    def from_engine_core(cls, core: EngineCore, tokenizer: TokenizerLike) -> AsyncLLM:
        """Run `core` in a thread of this process behind the same sockets (tests)."""
        client = MPClient.launch_thread(core)
        return cls(
            client,
            tokenizer,
            max_num_seqs=core.config.max_num_seqs,
            max_model_len=core.max_model_len,
            engine_core=core,
        )

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the output thread; call from the event loop that reads the streams."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLM already started")
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._thread = threading.Thread(target=self._run_output_handler, name="output-handler", daemon=True)
        self._thread.start()

    @property
    def is_started(self) -> bool:
        """start() was called."""
        return self._thread is not None

    @property
    def is_running(self) -> bool:
        """True while the core and the output thread are alive and no shutdown began."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self.client.is_alive
            and self.errored is None
            and not self._stopped
        )

    @property
    def is_draining(self) -> bool:
        """shutdown() was called."""
        return self._draining

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop admitting, let running requests finish for up to `timeout_s`, end the rest with
        finish_reason "abort", stop the core (idempotent)."""
        self._draining = True
        if self._thread is None or self._idle is None or self._stopped:
            if not self._stopped:
                self._stopped = True
                await asyncio.to_thread(self.client.close)
            return
        if self.num_unfinished > 0:
            self._idle.clear()
            if self.num_unfinished > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), timeout_s)
        for request_id in self.output_processor.request_ids():
            self.abort(request_id, "abort")
        self._stopped = True
        await asyncio.to_thread(self.client.shutdown, 5.0)
        await asyncio.to_thread(self._thread.join, 10.0)
        await asyncio.to_thread(self.client.close)

    def add_stat_logger(self, record: Callable[[IterationStats], None]) -> None:
        """Call `record(stats)` after every core message, from the output thread."""
        self._stat_loggers.append(record)

    # -- requests --------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> RequestStream:
        """Send a request to the core; returns its stream.

        Raises EngineDeadError when the core is gone, EngineDrainingError while shutting down, ValueError
        for a request id already in use, RuntimeError before `start()`; any error on the way to the core
        (such as msgspec's OverflowError for an integer outside 64 bits) after the request was tracked
        untracks it before it propagates, so `num_unfinished` and the drain never count it.
        """
        if self._loop is None:
            raise RuntimeError("AsyncLLM.start() was not called")
        if self.errored is not None:
            raise EngineDeadError(str(self.errored))
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        now = time.monotonic()
        self.output_processor.add_request(request_id, len(prompt_token_ids), sampling_params, now, queue)
        if self.errored is not None:  # the core died since the check above, and its requests were failed
            self.output_processor.pop(request_id)
            self._signal_if_idle()
            raise EngineDeadError(str(self.errored))
        try:
            self.client.add_request(EngineCoreRequest(request_id, prompt_token_ids, sampling_params, now))
        except BaseException:
            # whatever failed on the way to the core (dead core, a value the wire format cannot carry),
            # the request was never served: untrack it so the gauges and the drain do not wait for it
            self.output_processor.pop(request_id)
            self._signal_if_idle()
            raise
        return RequestStream(request_id, queue, self.abort)

    def add_parallel_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        n: int,
        *,
        first_index: int = 0,
        make_child: ChildFactory[C] = ChildRequest,
    ) -> list[C]:
        """vLLM's `add_request` for a request of `n` samples: `n` engine requests (ParentRequest,
        parallel_sampling.py), child `i` with id `{i}_{request_id}` (`request_id` itself when n is 1),
        seed `seed + i` and index `first_index + i`, built by `make_child`. The first child is added now;
        the others start when it has its first token (`ChildRequest.deltas`), sharing its prompt's blocks
        in the prefix cache. Raises ValueError for n < 1, and as add_request for the first child (then
        nothing of the request is tracked).
        """
        parent = ParentRequest(request_id, n, sampling_params)
        children: list[C] = []
        for i in range(n):
            child_id, params = parent.child_info(i)
            leader = children[0] if children else None
            children.append(
                make_child(first_index + i, child_id, prompt_token_ids, params, self.add_request, leader)
            )
        children[0].start()
        return children

    def generate(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str
    ) -> RequestStream:
        """vLLM's `generate`: add the request; iterate the returned stream (`async for delta in ...`) for
        its RequestDeltas, and `close()` it to abort. Raises as add_request, at the call."""
        return self.add_request(request_id, prompt_token_ids, sampling_params)

    def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """End a request now with `finish_reason` and abort it in the core before its next step (no-op for
        an unknown or finished one)."""
        aborted = self.output_processor.abort_request(request_id, finish_reason, time.monotonic())
        if aborted is None:
            return
        state, delta, stats = aborted
        self._record(stats)
        self._deliver([(state, delta)])
        self.client.abort_requests([request_id])
        self._signal_if_idle()

    async def reset_prefix_cache(self) -> bool:
        """Forget the core's prefix cache (vLLM's POST /reset_prefix_cache); False when the core refused
        because requests hold blocks. Raises EngineDeadError when the core is gone."""
        future = self.client.call_utility("reset_prefix_cache")
        return bool(await asyncio.wrap_future(future))

    # -- what the gauges read --------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests running in the core, as it last reported (it reports when a step admits or ends one);
        0 once the core is dead."""
        return 0 if self.errored is not None else min(self._num_running, self.num_unfinished)

    @property
    def num_waiting(self) -> int:
        """Requests not finished and not running: queued in the core or on their way to it."""
        return max(self.num_unfinished - self.num_running, 0)

    @property
    def kv_cache_config(self) -> KVCacheConfig | None:
        """The KV pool the engine core reported in its ready message (None: it reported none)."""
        return self.client.kv_cache_config

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (0..1), as the core last reported; 0 once the core is dead (its
        blocks went with it)."""
        return 0.0 if self.errored is not None else self._kv_cache_usage

    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet finished, aborted or failed."""
        return len(self.output_processor)

    # -- the output thread -----------------------------------------------------------------------------

    def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = self.client.get_output()
                assert outputs is not None
                self._handle(outputs)
        except EngineDeadError as exc:
            if not self._stopped:
                logger.error("%s; failing every open request", exc)
                self.errored = exc
            message = str(exc)
            self._deliver(self.output_processor.fail_all(lambda: EngineDeadError(message)))
            self._num_running, self._kv_cache_usage = 0, 0.0
            self._signal_if_idle()
        except Exception as exc:  # a bug in this thread: nothing more can be served
            logger.exception("the output handler stopped")
            self.errored = EngineDeadError(f"the output handler failed: {type(exc).__name__}: {exc}")
            message = str(self.errored)
            self._deliver(self.output_processor.fail_all(lambda: EngineDeadError(message)))
            self._num_running, self._kv_cache_usage = 0, 0.0
            self._signal_if_idle()

    def _handle(self, outputs: EngineCoreOutputs) -> None:
        now = time.monotonic()
        self._num_running = outputs.num_running
        self._kv_cache_usage = outputs.kv_cache_usage
        if outputs.step_stats is not None:
            self.step_stats.append(outputs.step_stats)
            self.num_steps += 1
        if outputs.step_error is not None:
            self.num_failed_steps += 1
            logger.error("engine step failed (%s); its requests were failed", outputs.step_error)
        if not outputs.outputs and outputs.step_stats is None:
            self._signal_if_idle()
            return
        processed = self.output_processor.process_outputs(outputs, now)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        self._deliver(processed.deliveries)
        self._record(processed.stats)
        self._signal_if_idle()

    def _deliver(self, deliveries: list[tuple[RequestState, StreamItem]]) -> None:
        loop = self._loop
        if loop is None or not deliveries:
            return
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is reading
            loop.call_soon_threadsafe(_put_all, deliveries)

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


def _put_all(deliveries: list[tuple[RequestState, StreamItem]]) -> None:
    """On the event loop: put each item on its request's queue."""
    for state, item in deliveries:
        if state.queue is not None:
            state.queue.put_nowait(item)
