"""EngineCore: the scheduler, the KV cache and the model runner behind one `step()`; EngineCoreProc: its busy loop.

Corresponds to vLLM v1's `vllm/v1/engine/core.py` (EngineCore, EngineCoreProc, run_busy_loop); the
messages it sends and receives are in outputs.py (vLLM's `vllm/v1/engine/__init__.py`).
A request enters in two parts, as in vLLM: `preprocess_add_request` builds the Request and hashes its
prompt blocks for the prefix cache (the input thread runs it, off the busy loop), then `add_request`
queues it in the scheduler (the busy loop). Left out: data parallelism, pipeline-parallel batch queues,
async scheduling (scheduling step N+1 while step N's outputs are processed: `_process_engine_step` is
the place it would go), LoRA and multimodal inputs, and the ROUTER/DEALER handshake (one front end talks
to one core over PUSH/PULL sockets).

One step, as vLLM's `EngineCore.step`: `scheduler.schedule()` -> `model_runner.execute_model()`, the
StructuredOutputManager's token bitmask for the step's structured rows (engine/structured_output/), and
`sample_tokens()` (the sampler, and the rejection sampler for requests with draft tokens: a
ModelRunnerOutput) -> `scheduler.update_from_output()` (the EngineCoreOutputs: one EngineCoreOutput per
request that got tokens); with speculative decoding the n-gram proposer then drafts the next tokens of
every request that runs on (vLLM's runner proposes right after sampling; `EngineConfig.speculative_config`),
and `Scheduler.make_stats` adds the step's StepStats. The core knows token ids only: text, stop strings and
per-request timestamps belong to the front end's OutputProcessor (output_processor.py).

EngineCoreProc runs a core in its own process (serve) or in a thread (tests), as vLLM does:

    input thread:  socket -> decode -> build the Request (hash its prompt blocks) -> input_queue
    busy loop:     drain input_queue (add / abort / utility) -> step() -> output_queue
    output thread: output_queue -> encode -> socket

An exception inside a step fails the requests that step was running (each gets an EngineCoreOutput with
finish_reason "error"; their blocks are freed) and the loop goes on; a request whose logits are not
finite fails alone (`model_runner.set_aside_non_finite`), the step's others keep their tokens. Any other exception ends the loop:
the core sends `engine_dead` and exits, and the front end fails every open request. In a process of its
own, the core exits when its parent dies (PR_SET_PDEATHSIG on Linux, and a check of getppid() by the
input thread on every platform), ignores SIGINT (Ctrl-C reaches the whole process group; the front end
drains and then tells the core to stop) and names itself `EngineCore` for `ps -o comm`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from .block_pool import get_request_block_hasher
from .config import EngineConfig
from .kv_cache_manager import KVCacheConfig, KVCacheGroups, full_batch_blocks
from .model_runner import NON_FINITE_LOGITS, ModelRunnerLike, sample_tokens, set_aside_non_finite
from .outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    UtilityOutput,
)
from .request import Request, RequestStatus
from .scheduler import Scheduler
from .spec_decode.ngram_proposer import NgramProposer
from .stats import StepStats
from .structured_output import StructuredOutputManager

__all__ = [
    "STEP_STATS_MAXLEN",
    "EngineCore",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreProc",
    "EngineCoreRequest",
    "ModelRunnerLike",
    "RequestType",
    "StepStats",
    "UtilityOutput",
    "run_engine_core",
]

logger = logging.getLogger(__name__)

# StepStats kept by a core: the newest this many steps (about 10 minutes of 25 ms steps), so a
# long-running server's memory stays bounded; a consumer that needs every step reads them as they come.
STEP_STATS_MAXLEN = 25_000

# How often the input thread checks that the parent process is alive (seconds).
_PARENT_POLL_S = 0.5


class EngineCore:
    """The scheduler, the KV cache manager and the model runner; `step()` runs one engine step.

    Args:
        config: EngineConfig.
        model_runner: anything with execute_model(SchedulerOutput) -> logits [R, V].
        num_blocks: KV blocks the runner allocated; None takes config.num_kv_blocks.
        max_model_len: most tokens per request; None takes config.max_model_len.
        eos_token_id: the end-of-sequence id, or None.
        extra_eos_token_ids: more end-of-sequence ids (a checkpoint may list several); like vLLM, they are
            added to a request's stop_token_ids unless it sets ignore_eos.
        max_step_stats: how many of the newest StepStats `step_stats` keeps.
        structured_output_manager: compiles the grammars of requests with structured_outputs and fills
            their masks (None: such requests are refused when added).

    Raises:
        ValueError: num_blocks or max_model_len is neither given nor in the config, or max_step_stats < 1.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_runner: ModelRunnerLike,
        *,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        max_step_stats: int = STEP_STATS_MAXLEN,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        blocks = num_blocks if num_blocks is not None else config.num_kv_blocks
        if blocks is None:
            raise ValueError("num_blocks is required when config.num_kv_blocks is None")
        model_len = max_model_len if max_model_len is not None else config.max_model_len
        if model_len is None:
            raise ValueError("max_model_len is required when config.max_model_len is None")
        if max_step_stats < 1:
            raise ValueError(f"max_step_stats must be >= 1, got {max_step_stats}")
        self.config = config
        self.model_runner = model_runner
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = tuple(t for t in extra_eos_token_ids if t != eos_token_id)
        # the runner's KV cache groups (a model with sliding-window layers); runners without: one group
        groups: KVCacheGroups = getattr(model_runner, "kv_cache_groups", ())
        self.scheduler = Scheduler(config, blocks, model_len, groups)
        # Requests that skip the prefix cache entirely (caching off) are not hashed, as in vLLM.
        self._block_hasher = (
            get_request_block_hasher(config.block_size) if config.enable_prefix_caching else None
        )
        self.step_stats: deque[StepStats] = deque(maxlen=max_step_stats)
        self.structured_output_manager = structured_output_manager
        self.num_steps = 0
        spec = config.speculative_config
        self.proposer: NgramProposer | None = None
        self._draft_schedule: list[int] = []
        if spec is not None:
            spec.check_fits(model_len)
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, model_len)
            self._draft_schedule = spec.draft_schedule(config.max_num_seqs)

    @classmethod
    def from_pretrained(cls, model_path: str, config: EngineConfig | None = None) -> EngineCore:
        """Load a Hugging Face checkpoint folder's model into a core (the tokenizer stays with the front end).

        Builds Model and ModelRunner, sizing the KV cache with config.num_blocks_for (the default
        capped at what max_num_seqs requests of max_model_len hold, `full_batch_blocks`); the eos ids come
        from tokenizer_config.json and config.json.

        Raises:
            ValueError / OSError: from loading, or a max_model_len above the checkpoint's.
        """
        from attention_kv_caceh.model_executor.model import Model

        from .model_runner import ModelRunner
        from .tokenizer import Tokenizer

        cfg = config or EngineConfig()
        model = Model.load(model_path, cfg.dtype, quantization=cfg.quantization, activations=cfg.activations)
        max_model_len = cfg.resolve_max_model_len(model.config.max_position_embeddings)
        bytes_per_block = ModelRunner.bytes_per_block(model.config, cfg.block_size, cfg.dtype)
        needed = full_batch_blocks(
            cfg.max_num_seqs,
            cfg.block_size,
            max_model_len,
            ModelRunner.model_kv_cache_groups(model.config),
            cfg.max_num_batched_tokens,
        )
        num_blocks = cfg.num_blocks_for(bytes_per_block, blocks_needed=needed)
        runner = ModelRunner(model, cfg, num_blocks)
        eos_ids = tuple(int(t) for t in model.config.eos_token_ids)
        tokenizer = Tokenizer.load(model_path)
        eos = tokenizer.eos_token_id
        if eos is None and eos_ids:
            eos = eos_ids[0]
        stop_ids = tuple(dict.fromkeys([int(t) for t in ([] if eos is None else [eos]) + list(eos_ids)]))
        return cls(
            cfg,
            runner,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            eos_token_id=eos,
            extra_eos_token_ids=eos_ids,
            structured_output_manager=StructuredOutputManager(tokenizer.backend_json(), stop_ids),
        )

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) of one request."""
        return self.scheduler.max_model_len

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The KV pool, sized once when the core was built; requests are admitted against it."""
        return self.scheduler.kv_cache_config

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """Build the core's Request from an EngineCoreRequest (vLLM's preprocess_add_request).

        Adds the checkpoint's extra eos ids to the stop ids and, with prefix caching on, gives the
        Request its block hasher, which hashes every full block of the prompt here. Touches no scheduler
        state, so EngineCoreProc runs it in its input thread, off the busy loop.

        Raises:
            ValueError: an empty prompt or a negative token id.
        """
        params = request.sampling_params
        extra = tuple(t for t in self.extra_eos_token_ids if t not in params.stop_token_ids)
        if extra and not params.ignore_eos:
            params = params.derive(stop_token_ids=params.stop_token_ids + extra)
        return Request(
            request.request_id, request.prompt_token_ids, params, self.eos_token_id, self._block_hasher
        )

    def add_request(self, request: Request) -> None:
        """Queue a Request built by preprocess_add_request; it runs from the next step.

        A request with structured_outputs gets its grammar compile submitted here (it waits in
        WAITING_FOR_FSM until the grammar is ready).

        Raises:
            ValueError: an id in use, a prompt over max_model_len, a request that cannot fit in the
                whole KV pool (see Scheduler.add_request), or structured_outputs on a core without a
                StructuredOutputManager.
        """
        if request.use_structured_output:
            if self.structured_output_manager is None:
                raise ValueError("structured_outputs needs a tokenizer this engine core was not given")
            self.scheduler.add_request(request)
            self.structured_output_manager.grammar_init(request)
            return
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests now and free their blocks (unknown or finished ids are ignored)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Any request waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix hash (vLLM's reset_prefix_cache); True when it was reset.

        Refused (False, nothing changes) while any request holds blocks, as vLLM refuses it: the hashes
        of blocks in use would be lost for requests that still extend them.
        """
        kv = self.scheduler.kv_cache_manager
        if kv.num_free_blocks != kv.num_blocks:
            return False
        kv.block_pool.reset_prefix_cache()
        return True

    def snapshot(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """`outputs` with the scheduler's queue sizes and KV usage filled in."""
        outputs.num_running = self.scheduler.num_running
        outputs.num_waiting = self.scheduler.num_waiting
        outputs.kv_cache_usage = float(self.scheduler.kv_cache_manager.usage)
        return outputs

    def step(self, on_schedule: Callable[[], None] | None = None) -> EngineCoreOutputs:
        """Run one engine step: schedule, execute and sample, update, propose (empty outputs when nothing
        was scheduled). The step's wall and CPU times cover all of it, its outputs included.

        `on_schedule` is called after scheduling, before the model runs (EngineCoreProc reports the new
        queue sizes from there, so the gauges move when a request is admitted, not a step later).

        Raises:
            ValueError: the runner's logits are not [R + D, V]; anything the runner raises.
        """
        t0, cpu0, start = time.perf_counter(), time.thread_time(), time.monotonic()
        scheduler_output = self.scheduler.schedule()
        rejected = self.scheduler.take_rejected()  # grammars that failed to compile
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self.snapshot(EngineCoreOutputs(rejected))
        if on_schedule is not None:
            on_schedule()
        logits = self.model_runner.execute_model(scheduler_output)  # [R + D, V]
        manager = self.structured_output_manager
        grammar_output = None if manager is None else manager.grammar_bitmask(scheduler_output)
        non_finite, logits = set_aside_non_finite(scheduler_output, logits)
        model_runner_output = sample_tokens(scheduler_output, logits, grammar_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        outputs.outputs[:0] = rejected
        if non_finite:
            self._fail_non_finite(outputs, non_finite)
        self._propose(outputs, len(scheduler_output.scheduled_requests))
        cpu_ms = (time.thread_time() - cpu0) * 1e3  # read inside the wall interval
        wall_ms = (time.perf_counter() - t0) * 1e3
        outputs.step_stats = self.scheduler.make_stats(
            scheduler_output, model_runner_output, self.num_steps, wall_ms, cpu_ms
        )
        self.step_stats.append(outputs.step_stats)
        self.num_steps += 1
        outputs.step_start, outputs.step_end = start, time.monotonic()
        return self.snapshot(outputs)

    def _fail_non_finite(self, outputs: EngineCoreOutputs, request_ids: list[str]) -> None:
        """Replace the step's outputs of requests whose logits were not finite by errors, and abort them
        (their blocks are freed); the step's other requests keep their tokens and run on."""
        failed = set(request_ids)
        self.abort_requests(request_ids)
        logger.error("non-finite logits: failing requests %s", ", ".join(request_ids))
        message = f"engine step failed: {NON_FINITE_LOGITS}"
        kept = [o for o in outputs.outputs if o.request_id not in failed]
        outputs.outputs = kept + [EngineCoreOutput(rid, [], "error", message) for rid in request_ids]

    def _propose(self, outputs: EngineCoreOutputs, batch_size: int) -> None:
        """Draft the next tokens of every request that got tokens and runs on, `Request.spec_token_ids`;
        as many as the draft schedule gives a step of `batch_size` requests (none: no proposing)."""
        if self.proposer is None:
            return
        k = self._draft_schedule[min(batch_size, len(self._draft_schedule) - 1)]
        if k <= 0:
            return
        for output in outputs.outputs:
            if not output.finished:
                request = self.scheduler.requests[output.request_id]
                drafts = self.proposer.propose(request.all_token_ids, k)
                # vLLM's update_draft_token_ids: drafts stop at the first token the grammar rejects
                request.spec_token_ids = StructuredOutputManager.validate_draft_tokens(request, drafts)

    def fail_running(self, exc: BaseException) -> EngineCoreOutputs:
        """After a step raised `exc`: abort the requests it was running (all unfinished ones when none
        ran) and report each with finish_reason "error"."""
        failed = [r.request_id for r in self.scheduler.running]
        if not failed:
            failed = list(self.scheduler.requests)
        self.abort_requests(failed)
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        outputs = [EngineCoreOutput(rid, [], "error", message) for rid in failed]
        return self.snapshot(EngineCoreOutputs(outputs, step_error=f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------------------------------------------------
# The core behind sockets.
# ---------------------------------------------------------------------------------------------------------


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_ids_decoder = msgspec.msgpack.Decoder(list[str])
_utility_decoder = msgspec.msgpack.Decoder(tuple[int, str])

_Input = tuple[bytes, Any]
_WAKE = b"wake"  # an input of the core's own: a grammar finished compiling


class EngineCoreProc:
    """A core fed by an input thread and drained by an output thread; `run_busy_loop()` until shutdown.

    Args:
        core: the EngineCore.
        input_address, output_address: ZMQ endpoints the front end bound (PUSH to the core's PULL,
            PULL from the core's PUSH).
        parent_pid: exit when the parent process is gone (None: no check, the core runs in a thread).
    """

    def __init__(
        self, core: EngineCore, input_address: str, output_address: str, parent_pid: int | None = None
    ) -> None:
        self.core = core
        self.parent_pid = parent_pid
        self.input_queue: queue.Queue[_Input] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | None] = queue.Queue()
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._reported = (-1, -1)  # (num_running, num_waiting) of the last message
        self._input_thread = threading.Thread(
            target=self._process_input_socket, args=(input_address,), name="core-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._process_output_socket, args=(output_address,), name="core-output", daemon=True
        )
        if core.structured_output_manager is not None:  # a compiled grammar wakes an idle busy loop
            core.structured_output_manager.on_grammar_ready = self._wake

    def _wake(self) -> None:
        self.input_queue.put_nowait((_WAKE, None))

    def run(self) -> None:
        """Start the IO threads, announce readiness, run the busy loop; on a fatal error send engine_dead."""
        self._input_thread.start()
        self._output_thread.start()
        self._push(EngineCoreOutputs(ready=True, kv_cache_config=self.core.kv_cache_config))
        try:
            self.run_busy_loop()
        except BaseException as exc:
            logger.exception("the engine core stopped")
            self.output_queue.put_nowait(EngineCoreOutputs(engine_dead=f"{type(exc).__name__}: {exc}"))
        finally:
            self._stop.set()
            self.output_queue.put_nowait(None)
            self._output_thread.join(timeout=5)
            self._input_thread.join(timeout=5)
            self._ctx.term()

    def run_busy_loop(self) -> None:
        """vLLM's run_busy_loop: drain the inputs (blocking while idle), step, push the outputs."""
        idle = True
        while True:
            if not self._process_input_queue(block=idle):
                return
            idle = not self._process_engine_step()

    def _process_input_queue(self, block: bool) -> bool:
        """Apply every waiting input; wait for one first when `block` (the last step scheduled nothing:
        only an input can change that). False on shutdown."""
        handled = False
        while True:
            try:
                waiting = block and not handled
                kind, payload = self.input_queue.get() if waiting else self.input_queue.get_nowait()
            except queue.Empty:
                break
            if kind == RequestType.SHUTDOWN:
                return False
            self._handle_client_request(kind, payload)
            handled = True
        if handled and not self.core.has_unfinished_requests():
            self._push(EngineCoreOutputs())  # the gauges go to 0
        return True

    def _push(self, outputs: EngineCoreOutputs) -> None:
        """Queue a message for the output thread, with the scheduler's queue sizes."""
        self.core.snapshot(outputs)
        self._reported = (outputs.num_running, outputs.num_waiting)
        self.output_queue.put_nowait(outputs)

    def _report_schedule(self) -> None:
        sched = self.core.scheduler
        if (sched.num_running, sched.num_waiting) != self._reported:
            self._push(EngineCoreOutputs())

    def _handle_client_request(self, kind: bytes, payload: Any) -> None:
        if kind == _WAKE:
            return
        if kind == RequestType.ADD:
            if isinstance(payload, EngineCoreOutput):  # the input thread refused it
                self._push(EngineCoreOutputs([payload]))
                return
            request: Request = payload
            try:
                self.core.add_request(request)
            except ValueError as exc:  # refused (e.g. larger than the whole KV pool): a client error
                rejected = EngineCoreOutput(request.request_id, [], "rejected", str(exc))
                self._push(EngineCoreOutputs([rejected]))
        elif kind == RequestType.ABORT:
            self.core.abort_requests(payload)
        elif kind == RequestType.UTILITY:
            call_id, method = payload
            answer = UtilityOutput(call_id)
            if method == "reset_prefix_cache":
                answer.result = self.core.reset_prefix_cache()
            else:
                answer.error = f"unknown utility method {method!r}"
            self._push(EngineCoreOutputs(utility_output=answer))

    def _process_engine_step(self) -> bool:
        """One step and its outputs; False when it scheduled nothing (the loop then waits for an input)."""
        if not self.core.has_unfinished_requests():
            return False
        try:
            outputs = self.core.step(self._report_schedule)
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it was running")
            self._push(self.core.fail_running(exc))
            return True
        if outputs.step_stats is None:
            if outputs.outputs:  # requests whose grammar failed to compile
                self._push(outputs)
            return False
        self._push(outputs)
        return True

    # -- IO threads: serialisation off the busy loop ---------------------------------------------------

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _process_input_socket(self, address: str) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            while not self._stop.is_set():
                if not sock.poll(int(_PARENT_POLL_S * 1000)):
                    if not self._parent_alive():
                        logger.error("the front-end process is gone; the engine core exits")
                        os._exit(1)
                    continue
                kind, data = sock.recv_multipart(copy=False)
                kind_bytes = bytes(kind.buffer)
                if kind_bytes == RequestType.ADD:
                    payload: Any = self._preprocess_add_request(_request_decoder.decode(data.buffer))
                elif kind_bytes == RequestType.ABORT:
                    payload = _ids_decoder.decode(data.buffer)
                elif kind_bytes == RequestType.UTILITY:
                    payload = _utility_decoder.decode(data.buffer)
                else:
                    payload = None
                self.input_queue.put_nowait((kind_bytes, payload))
                if kind_bytes == RequestType.SHUTDOWN:
                    return
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def _preprocess_add_request(self, request: EngineCoreRequest) -> Request | EngineCoreOutput:
        """In the input thread: the core's Request (its prompt blocks hashed), or the rejection to send."""
        try:
            return self.core.preprocess_add_request(request)
        except ValueError as exc:
            return EngineCoreOutput(request.request_id, [], "rejected", str(exc))

    def _process_output_socket(self, address: str) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)  # the last messages (engine_dead) get a second to leave
        sock.connect(address)
        buffer = bytearray()
        try:
            while True:
                outputs = self.output_queue.get()
                if outputs is None:
                    return
                _encoder.encode_into(outputs, buffer)
                sock.send(buffer, copy=True)
        finally:
            sock.close()


# ---------------------------------------------------------------------------------------------------------
# The process entry.
# ---------------------------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent exits (prctl PR_SET_PDEATHSIG); name it EngineCore."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is not None:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(libc_name, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            libc.prctl(_PR_SET_NAME, b"EngineCore", 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def run_engine_core(
    model_path: str,
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pid: int,
    cpu: int | None = None,
) -> None:
    """The engine-core process: load the checkpoint, then serve the front end until it says stop or dies.

    `cpu`: pin the process to this CPU (os.sched_setaffinity), None leaves it to the OS. A load failure
    is sent as engine_dead (the front end reports it) and the process exits 1.
    """
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the front end drains, then stops the core
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s engine core: %(message)s")
    try:
        core = EngineCore.from_pretrained(model_path, config)
    except Exception as exc:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(output_address)
        sock.send(_encoder.encode(EngineCoreOutputs(engine_dead=f"{type(exc).__name__}: {exc}")))
        sock.close()
        ctx.term()
        os._exit(1)
    EngineCoreProc(core, input_address, output_address, parent_pid).run()
