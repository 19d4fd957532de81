"""EngineCoreClient: how a front end reaches an EngineCore, in its own process or beside it.

Corresponds to vLLM v1's `vllm/v1/engine/core_client.py`, which has three clients (InprocClient,
SyncMPClient, AsyncMPClient, plus data-parallel ones); two here, the multiprocess one serving both the
blocking front end and AsyncLLM, which reads it from a thread instead of awaiting an asyncio socket:

- `InprocClient`: the core in the caller's thread; `add_request` builds the Request (hashing its prompt
  blocks) and queues it at once, `get_output()` runs one `step()`. LLMEngine (offline:
  `generate`, `bench-engine`) uses it, as vLLM's LLMEngine does without multiprocessing.
- `MPClient`: the core behind two ZMQ sockets (msgpack through msgspec, vLLM's transport): add / abort /
  utility calls go out on a PUSH socket, EngineCoreOutputs come back on a PULL socket. `launch_process`
  starts the core in a child process (serve, `harness --backend engine`); `launch_thread` runs the very
  same EngineCoreProc in a thread of this process (tests that hold a step or read the scheduler).
  Left out: vLLM's ROUTER/DEALER identities (one front end per core), data-parallel clients.

The front end binds both sockets before the core starts (no connect race), as socket files in a private
folder that only the core's process may connect to (ipc.py: a 0700 folder, a ZAP handler checking the
peer's pid); the files are removed once the core has connected both. Without ZMQ's ipc transport
(Windows), TCP loopback, open to every local process.
`get_output()` waits on the output socket and on the core's liveness together: for a process, its
sentinel fd is polled beside the socket, so a dead core is seen at once and raises EngineDeadError.

Backpressure is not death. A core that reads its input more slowly than the front end sends (a request
that fans out into thousands of engine requests, a flood of clients, a core whose input thread waits for
the GIL) makes the sends queue in the front end, never fail: the input socket has no high-water mark
(ZMQ_SNDHWM 0, so ZMQ's own queue in this process holds what the core has not read yet), and a frame
that finds no connected peer (the instant before the core's input socket connects) waits in `_pending`
until `get_output()`'s poll loop sends it, in order. The core is declared dead only when its process
(or thread) has exited or it reported that its loop failed (`engine_dead`), never because a send would
block. Left out, as in vLLM v1: a heartbeat (a core that is alive but stuck is not declared dead).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
from collections import deque
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from .config import EngineConfig
from .core import EngineCore, EngineCoreProc, run_engine_core
from .ipc import PrivateChannels
from .kv_cache_manager import KVCacheConfig
from .outputs import EngineCoreOutputs, EngineCoreRequest, RequestType
from .request import Request

__all__ = ["EngineDeadError", "InprocClient", "MPClient"]

logger = logging.getLogger(__name__)

# How long get_output() waits on the socket before checking a thread-run core is alive (ms).
_POLL_MS = 100
# ... and while frames wait in the front end for the core's input socket to connect (ms).
_PENDING_POLL_MS = 5


class EngineDeadError(RuntimeError):
    """The engine core is gone (killed, out of memory, or its loop failed); no request can be served
    (vLLM's EngineDeadError)."""


class InprocClient:
    """The core in this thread: requests apply at once, `get_output()` runs one step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def add_request(self, request: EngineCoreRequest) -> Request:
        """Build the core's Request (hashing its prompt blocks) and queue it; the Request.

        Raises ValueError when the core refuses it."""
        engine_request = self.core.preprocess_add_request(request)
        self.core.add_request(engine_request)
        return engine_request

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests and free their blocks now."""
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """One engine step's outputs (empty when nothing was scheduled; then, while a grammar is
        compiling, it first waits up to 50 ms for one to finish rather than spin)."""
        outputs = self.core.step()
        manager = self.core.structured_output_manager
        if outputs.step_stats is None and not outputs.outputs and manager is not None:
            manager.wait_for_grammar(0.05)
        return outputs

    def reset_prefix_cache(self) -> bool:
        """See EngineCore.reset_prefix_cache."""
        return self.core.reset_prefix_cache()


class MPClient:
    """A core behind ZMQ sockets, started by `launch_process` or `launch_thread`.

    Thread-safe senders (`add_request`, `abort_requests`, `call_utility`) and one reader: the thread that
    calls `get_output()` (AsyncLLM's output thread). `call_utility` returns a Future that get_output()
    resolves when the answer arrives.
    """

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(
            zmq.SNDHWM, 0
        )  # no high-water mark: a slow core queues sends, never fails them
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self.channels: PrivateChannels | None = None
        if zmq.has("ipc"):
            self.channels = PrivateChannels(self._ctx)
            self.channels.bind(self._input, "input")
            self.channels.bind(self._output, "output")
        else:
            logger.warning("no ZMQ ipc transport here: the engine core's sockets are on TCP loopback")
            self._input.bind("tcp://127.0.0.1:*")
            self._output.bind("tcp://127.0.0.1:*")
        self.input_address = self._input.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_address = self._output.getsockopt_string(zmq.LAST_ENDPOINT)
        self._send_lock = threading.Lock()
        self._pending: deque[tuple[bytes, bytes]] = deque()  # frames no connected peer took yet, in order
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._call_ids = itertools.count()
        self._calls: dict[int, Future[Any]] = {}
        self.process: BaseProcess | None = None
        self.thread: threading.Thread | None = None
        self.proc: EngineCoreProc | None = None
        self.dead: str | None = None
        self.kv_cache_config: KVCacheConfig | None = None  # the pool the core reported when ready
        self._closed = False

    # -- starting the core -----------------------------------------------------------------------------

    @classmethod
    def launch_process(
        cls,
        model_path: str,
        config: EngineConfig,
        *,
        cpu: int | None = None,
        startup_timeout_s: float = 600.0,
    ) -> MPClient:
        """Start `run_engine_core` in a child process (spawned: a fresh interpreter) and wait until it has
        loaded the checkpoint. Raises EngineDeadError when it fails to load or exits before."""
        client = cls()
        ctx = multiprocessing.get_context("spawn")
        client.process = ctx.Process(
            target=run_engine_core,
            args=(model_path, config, client.input_address, client.output_address, os.getpid(), cpu),
            name="EngineCore",
            daemon=True,
        )
        client.process.start()
        if client.channels is not None and client.process.pid is not None:
            client.channels.admit(client.process.pid)
        client._poller.register(client.process.sentinel, zmq.POLLIN)
        client._wait_ready(startup_timeout_s)
        return client

    @classmethod
    def launch_thread(cls, core: EngineCore) -> MPClient:
        """Run `core` under an EngineCoreProc in a daemon thread of this process (same sockets, same loop)."""
        client = cls()
        client.start_thread(core)
        return client

    def start_thread(self, core: EngineCore) -> None:
        """`launch_thread`'s second half, for a client already bound: start `core` in a thread of this
        process (the only process its channels admit) and wait until it is ready."""
        if self.channels is not None:
            self.channels.admit(os.getpid())
        self.proc = EngineCoreProc(core, self.input_address, self.output_address)
        self.thread = threading.Thread(target=self.proc.run, name="engine-core", daemon=True)
        self.thread.start()
        self._wait_ready(60.0)

    def _wait_ready(self, timeout_s: float) -> None:
        try:
            while True:
                outputs = self.get_output(timeout_s)
                if outputs is None:
                    raise EngineDeadError(f"the engine core did not start within {timeout_s:.0f} s")
                if outputs.ready:
                    self.kv_cache_config = outputs.kv_cache_config
                    break
            # the output channel is connected (ready came through it); once the input is too, no file
            # names the channels any more
            if self.channels is not None and not self.channels.wait_connected(timeout_s):
                raise EngineDeadError(f"the engine core did not connect its input within {timeout_s:.0f} s")
        except EngineDeadError:
            self.close()
            raise

    # -- state -----------------------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        """The core runs (its process or thread is alive) and never reported a fatal error."""
        if self.dead is not None or self._closed:
            return False
        if self.process is not None:
            return self.process.is_alive()
        return self.thread is not None and self.thread.is_alive()

    def _core_gone(self) -> str | None:
        if self.process is not None and not self.process.is_alive():
            return f"the engine core process exited (exit code {self.process.exitcode})"
        if self.thread is not None and not self.thread.is_alive():
            return "the engine core thread stopped"
        return None

    # -- sending ---------------------------------------------------------------------------------------

    def _send(self, kind: bytes, payload: Any) -> None:
        """Queue one message for the core, in order; it never blocks and never fails for a slow core.

        Raises EngineDeadError when the core is already known to be gone or was shut down; msgspec's errors
        (an integer outside 64 bits) before anything is queued."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        data = self._encoder.encode(payload)
        with self._send_lock:
            if self._closed:
                raise EngineDeadError("the engine core was shut down")
            self._pending.append((kind, data))
            self._flush_pending()

    def _flush_pending(self) -> None:
        """Hand the waiting frames to ZMQ, oldest first (holding `_send_lock`). With no high-water mark a
        send fails (zmq.Again) only while no peer is connected; the frames then stay for the next try."""
        while self._pending:
            kind, data = self._pending[0]
            try:
                self._input.send_multipart((kind, data), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._pending.popleft()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the core. Raises EngineDeadError when the core is gone."""
        self._send(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Ask the core to abort requests (applied before its next step); no-op on a dead core."""
        if request_ids and self.dead is None and not self._closed:
            with contextlib.suppress(EngineDeadError):
                self._send(RequestType.ABORT, request_ids)

    def call_utility(self, method: str) -> Future[Any]:
        """Call a core method by name (`reset_prefix_cache`); the Future holds its result, or
        EngineDeadError / RuntimeError."""
        future: Future[Any] = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._send(RequestType.UTILITY, (call_id, method))
        except EngineDeadError as exc:
            self._calls.pop(call_id, None)
            future.set_exception(exc)
        return future

    # -- receiving -------------------------------------------------------------------------------------

    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs | None:
        """The core's next message, or None after `timeout_s` (None: wait for ever).

        Utility answers are resolved here (and still returned). Raises EngineDeadError when the core is
        gone or reported a fatal error; every pending utility call fails with it.
        """
        waited = 0.0
        while True:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            if self._closed and self._core_gone() is not None:
                self._mark_dead("the engine core was shut down")
                raise EngineDeadError(self.dead)
            poll_ms = _POLL_MS
            if self._pending:
                with self._send_lock:
                    if not self._closed:
                        self._flush_pending()
                    poll_ms = _PENDING_POLL_MS if self._pending else _POLL_MS
            events = dict(self._poller.poll(poll_ms))
            if self._output in events:
                outputs = self._decoder.decode(self._output.recv(copy=False).buffer)
                if outputs.utility_output is not None:
                    answer = outputs.utility_output
                    future = self._calls.pop(answer.call_id, None)
                    if future is not None:
                        if answer.error is not None:
                            future.set_exception(RuntimeError(answer.error))
                        else:
                            future.set_result(answer.result)
                if outputs.engine_dead is not None:
                    self._mark_dead(f"the engine core failed: {outputs.engine_dead}")
                    raise EngineDeadError(self.dead)
                return outputs
            gone = self._core_gone()
            if gone is not None:
                self._mark_dead(gone)
                raise EngineDeadError(gone)
            waited += poll_ms / 1000
            if timeout_s is not None and waited >= timeout_s:
                return None

    def _mark_dead(self, reason: str) -> None:
        self.dead = reason
        with self._send_lock:
            self._pending.clear()  # nobody will read them; their requests fail with the rest
        calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(EngineDeadError(reason))

    # -- stopping --------------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Tell the core to stop and wait up to `timeout_s` for it; kill a process that outlives that
        (idempotent). The reader's get_output() then raises EngineDeadError; `close()` the sockets after
        the reader has stopped."""
        with self._send_lock:
            if self._closed:
                return
            if self.dead is None:
                self._pending.append((RequestType.SHUTDOWN, b""))  # after whatever still waits
                with contextlib.suppress(zmq.ZMQError):
                    self._flush_pending()
            self._closed = True
        if self.thread is not None:
            self.thread.join(timeout_s)
        if self.process is not None:
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)

    def close(self) -> None:
        """Close the sockets (after shutdown() and after the reader stopped)."""
        self.shutdown(0.0)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()  # also ends the channels' ZAP thread
        if self.channels is not None:
            self.channels.close()
