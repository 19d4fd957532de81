"""`--workers N`: the measured load split over N client processes, one event loop each, on one shared
arrival schedule.

One Python event loop reads every stream, parses every SSE chunk and fills every record of a run, so a
server that streams faster than one core can read is measured as the client's speed. Here the parent
plans the run (prompts, lengths, arrival offsets: the same as one process plans them), then spawns N
worker processes. Request i goes to worker i mod N, with its arrival offset unchanged, and the client's
`--concurrency` C is split: worker w may have C // N (+1 for the first C mod N workers) requests in
flight. Each worker builds its own HTTP session, encodes its first bodies and opens its connections,
then waits; the parent sends every worker the same start time, a few milliseconds ahead. On Linux
`time.perf_counter_ns` is CLOCK_MONOTONIC, one clock for every process of the machine, so the records'
timestamps are comparable across workers. Each finished record is sent to the parent as it finishes
(the parent writes the JSONL exactly as one process does, and Ctrl-C keeps what finished); at the end
each worker sends its in-flight series and its CpuSpan.

Each worker is a `python -c` child (`spawn_worker`) running `worker_main`, talking over a socket pair
(pickled messages, each after its 4-byte length). The workers run in a process group of their own and
ignore SIGINT from their start (the parent handles Ctrl-C and stops them), and die with the parent
(PR_SET_PDEATHSIG on Linux). Probes, the `/metrics` poller and the counters stay in the parent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import gc
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

from attention_kv_caceh.harness.backends import OpenAIBackend, RequestSpec, load_session
from attention_kv_caceh.harness.client_cpu import CpuClock, CpuSpan
from attention_kv_caceh.harness.load import InFlightTracker, run_requests
from attention_kv_caceh.harness.records import RequestRecord

__all__ = ["WorkerLoad", "WorkerPlan", "cut_short", "run_worker_load", "spawn_worker", "split_load"]

_START_LEAD_NS = 20_000_000  # the shared start is this far ahead of the parent's clock when sent
FLUSH_S = 0.1  # a worker's finished records reach the parent within this (plus the socket's delay)
_READY_TIMEOUT_S = 120.0  # a worker that has not opened its connections by then failed to start


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker runs: `OpenAIBackend` keyword arguments, its specs and their arrival offsets
    (s after the shared start), and its share of the concurrency."""

    index: int
    backend: dict[str, Any]
    specs: list[RequestSpec]
    offsets_s: list[float]
    concurrency: int


@dataclass
class WorkerLoad:
    """The merged outcome: every record (request order), the in-flight series summed over the workers,
    its peak, and each worker's CpuSpan."""

    records: list[RequestRecord]
    in_flight: list[tuple[int, int]] = field(default_factory=lambda: list[tuple[int, int]]())
    peak: int = 0
    cpu: list[CpuSpan] = field(default_factory=lambda: list[CpuSpan]())


def split_load(
    specs: Sequence[RequestSpec], offsets_s: Sequence[float], concurrency: int, workers: int
) -> list[tuple[list[RequestSpec], list[float], int]]:
    """(specs, offsets, concurrency) of each worker: request i to worker i mod `workers`, the
    concurrency split as evenly as it goes (module docstring). Raises ValueError for fewer
    concurrency slots than workers."""
    if concurrency < workers:
        raise ValueError(f"concurrency {concurrency} cannot be split over {workers} workers")
    return [
        (
            list(specs[w::workers]),
            list(offsets_s[w::workers]),
            concurrency // workers + (w < concurrency % workers),
        )
        for w in range(workers)
    ]


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGTERM this process when its parent exits (prctl PR_SET_PDEATHSIG)."""
    name = ctypes.util.find_library("c")
    if name is not None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _frame(message: object) -> bytes:
    """A message on the wire: its pickle's length (4 bytes, big-endian), then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "big") + data


def _read_message(sock: socket.socket) -> Any:
    """One whole message from a blocking socket. Raises EOFError when it closes first."""
    size = int.from_bytes(_read_exactly(sock, 4), "big")
    return pickle.loads(_read_exactly(sock, size))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            raise EOFError("the connection closed")
        data += piece
    return bytes(data)


def worker_main(fd: int, parent_pid: int) -> None:
    """The worker process's entry (module docstring): its plan comes first on the socket `fd`."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    try:
        plan: WorkerPlan = _read_message(sock)
    except (EOFError, OSError):
        return  # the parent closed first: nothing to run
    asyncio.run(_worker(sock, plan))


class _Outbox:
    """A worker's finished records, sent to the parent in batches: at most FLUSH_S after the first
        record of a batch finished (each message wakes the parent's collector: a message per record cost it
    about 0.1 ms of CPU a request),
        each record as the tuple of its fields. The socket's asyncio transport buffers what the parent has
        not read yet, so a parent slow to read (waiting for a core) never stalls the event loop that
        timestamps tokens."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: list[tuple[Any, ...]] = []
        self._timer: asyncio.TimerHandle | None = None

    def add(self, record: RequestRecord) -> None:
        self.pending.append(tuple(vars(record).values()))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.pending:
            self.writer.write(_frame(("records", self.pending)))
            self.pending = []


async def _read_async(reader: asyncio.StreamReader) -> Any:
    """One whole message from the parent. Raises asyncio.IncompleteReadError when it closes first."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    return pickle.loads(await reader.readexactly(size))


async def _stop_message(reader: asyncio.StreamReader) -> None:
    """Return when the parent sends ("stop", 0) or closes the connection."""
    with contextlib.suppress(asyncio.IncompleteReadError, OSError):
        await _read_async(reader)


async def _worker(sock: socket.socket, plan: WorkerPlan) -> None:
    reader, writer = await asyncio.open_connection(sock=sock)
    session = load_session()
    try:
        backend = OpenAIBackend(session, **plan.backend)
        first = plan.specs[: plan.concurrency]
        backend.prepare(first)
        await backend.open_connections(len(first))
        writer.write(_frame(("ready", plan.index)))
        try:
            message: tuple[str, int] = await _read_async(reader)
        except (asyncio.IncompleteReadError, OSError):
            return  # the parent closed before the start (interrupted while the workers started)
        if message[0] != "start":
            return
        gc.collect()
        gc.freeze()
        clock = CpuClock()
        clock.start()
        tracker = InFlightTracker()
        outbox = _Outbox(writer)
        finished: list[RequestRecord] = []

        def on_record(record: RequestRecord) -> None:
            finished.append(record)
            outbox.add(record)

        load = asyncio.create_task(
            run_requests(
                backend,
                plan.specs,
                plan.offsets_s,
                plan.concurrency,
                tracker=tracker,
                on_record=on_record,
                start_ns=message[1],
            )
        )
        stop = asyncio.create_task(_stop_message(reader))  # the parent was interrupted, or closed
        await asyncio.wait((load, stop), return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
        span = clock.stop(finished)
        outbox.flush()
        writer.write(_frame(("done", (tracker.samples, tracker.peak, span))))
        await writer.drain()
        await stop  # until the parent closes its end
    finally:
        await session.close()
        writer.close()


# The worker's entry: SIGINT is ignored before anything else is imported (an import takes a second, and a
# Ctrl-C in it would print a traceback per worker), then `worker_main`.
_ENTRY = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    f"from {__name__} import worker_main; import sys; worker_main(int(sys.argv[1]), int(sys.argv[2]))"
)


def spawn_worker(fd: int) -> subprocess.Popen[bytes]:
    """Start one worker process talking over the socket `fd` (passed to it). It runs in a process
    group of its own, so a terminal's Ctrl-C (SIGINT to the foreground group) never reaches it, from
    its first instruction on; it also ignores SIGINT (`_ENTRY`) and dies with this process."""
    return subprocess.Popen(
        [sys.executable, "-c", _ENTRY, str(fd), str(os.getpid())], pass_fds=[fd], process_group=0
    )


def _merge_in_flight(series: Sequence[Sequence[tuple[int, int]]]) -> tuple[list[tuple[int, int]], int]:
    """The sum over workers of their in-flight counts, as one series of (time, count), and its peak."""
    steps: list[tuple[int, int]] = []
    for samples in series:
        previous = 0
        for time_ns, count in samples:
            steps.append((time_ns, count - previous))
            previous = count
    steps.sort()
    merged: list[tuple[int, int]] = []
    total = peak = 0
    for time_ns, change in steps:
        total += change
        peak = max(peak, total)
        merged.append((time_ns, total))
    return merged, peak


class _Pool:
    """The worker processes and the parent's ends of their sockets."""

    def __init__(self, plans: Sequence[WorkerPlan]) -> None:
        # Each worker is `python -c _ENTRY FD PARENT_PID` (`spawn_worker`), not a
        # multiprocessing child: a spawned child re-imports the parent's main module, which a script
        # calling run_harness without an `if __name__ == "__main__"` guard cannot survive.
        self.socks: list[socket.socket] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for plan in plans:
            ours, theirs = socket.socketpair()
            with theirs:
                proc = spawn_worker(theirs.fileno())
            self.socks.append(ours)
            self.procs.append(proc)
            ours.sendall(_frame(plan))

    def wait_ready(self) -> None:
        """Block until every worker said ready. Raises RuntimeError naming a worker that died or
        did not answer in time."""
        for index, sock in enumerate(self.socks):
            sock.settimeout(_READY_TIMEOUT_S)
            try:
                _read_message(sock)
            except TimeoutError:
                raise RuntimeError(f"client worker {index} did not start in {_READY_TIMEOUT_S:g} s") from None
            except (EOFError, OSError):
                raise RuntimeError(f"client worker {index} exited before it was ready") from None
            sock.settimeout(None)

    def start(self, start_ns: int) -> None:
        for sock in self.socks:
            sock.sendall(_frame(("start", start_ns)))

    def collect(self, deliver: Callable[[RequestRecord], None], stop: threading.Event) -> list[Any]:
        """Pass every record to `deliver` as it comes; returns each worker's final (in-flight series,
        peak, CpuSpan). Raises RuntimeError when a worker dies first. When `stop` is set (the parent was
        interrupted), every worker is told to stop, and what they finished is still collected (for up
        to 10 s)."""
        done: dict[int, Any] = {}
        buffers = [bytearray() for _ in self.socks]
        deadline: int | None = None
        with selectors.DefaultSelector() as selector:
            for index, sock in enumerate(self.socks):
                selector.register(sock, selectors.EVENT_READ, index)
            while len(done) < len(self.socks):
                if stop.is_set() and deadline is None:
                    deadline = perf_counter_ns() + 10_000_000_000
                    for index, sock in enumerate(self.socks):
                        if index not in done:
                            with contextlib.suppress(OSError):
                                sock.sendall(_frame(("stop", 0)))
                if deadline is not None and perf_counter_ns() > deadline:
                    break
                for key, _ in selector.select(timeout=0.1):
                    index: int = key.data
                    piece = self.socks[index].recv(1 << 20)
                    if not piece:
                        raise RuntimeError(
                            f"client worker {index} exited during the run (exit code "
                            f"{self.procs[index].poll()})"
                        )
                    buffer = buffers[index]
                    buffer += piece
                    while len(buffer) >= 4 and len(buffer) >= 4 + (size := int.from_bytes(buffer[:4], "big")):
                        message: tuple[str, Any] = pickle.loads(buffer[4 : 4 + size])
                        del buffer[: 4 + size]
                        if message[0] == "records":
                            for fields in message[1]:
                                deliver(RequestRecord(*fields))
                        else:
                            done[index] = message[1]
                            selector.unregister(self.socks[index])
        return [done[i] for i in sorted(done)]

    def close(self) -> None:
        """Close the sockets (a worker exits when its socket closes) and stop every worker still
        running after 5 s (SIGTERM, then SIGKILL after 5 s more)."""
        for sock in self.socks:
            sock.close()
        for how in ("wait", "terminate", "kill"):
            for proc in self.procs:
                if how != "wait" and proc.poll() is None:
                    proc.terminate() if how == "terminate" else proc.kill()
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            if all(proc.poll() is not None for proc in self.procs):
                return


def cut_short(record: RequestRecord, interrupted_ns: int) -> bool:
    """True for a failed request whose stream ended after the parent was interrupted at `interrupted_ns`
    (perf_counter_ns): the workers ignore SIGINT and run on until told to stop, while a server in the
    same process group (the engine backend's `serve`) already refuses or ends requests as it shuts down
    ("the server is shutting down", HTTP 503). One process cancels such requests at Ctrl-C and records
    none of them; so does the parent of the workers, rather than count them as server failures."""
    if record.ok:
        return False
    end = record.stream_end_ns or record.finish_ns or record.sent_ns or record.arrival_ns
    return end >= interrupted_ns


async def run_worker_load(
    plans: Sequence[WorkerPlan],
    on_record: Callable[[RequestRecord], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> WorkerLoad:
    """Run `plans` in worker processes (module docstring); `on_start(start_ns)` is called with the
    shared start when it is sent, `on_record(record)` on this event loop as each record arrives.
    Returns the merged WorkerLoad. Raises RuntimeError when a worker fails to start or dies. If
    cancelled (Ctrl-C), the workers are stopped and every record already received has been passed on."""
    loop = asyncio.get_running_loop()
    pool = await asyncio.to_thread(_Pool, plans)
    stop = threading.Event()
    records: list[RequestRecord] = []
    interrupted_ns: list[int] = []  # when this was cancelled (Ctrl-C), once it was

    def deliver(record: RequestRecord) -> None:
        if interrupted_ns and cut_short(record, interrupted_ns[0]):
            return  # as one process cancels the requests in flight at Ctrl-C, unrecorded
        records.append(record)
        if on_record is not None:
            loop.call_soon_threadsafe(on_record, record)

    collector = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="harness-collector")
    collecting: concurrent.futures.Future[list[Any]] | None = None
    try:
        await asyncio.to_thread(pool.wait_ready)
        start_ns = perf_counter_ns() + _START_LEAD_NS
        pool.start(start_ns)
        if on_start is not None:
            on_start(start_ns)
        collecting = collector.submit(pool.collect, deliver, stop)
        finals = await asyncio.wrap_future(collecting)
    except asyncio.CancelledError:
        interrupted_ns.append(perf_counter_ns())
        raise
    finally:
        stop.set()  # interrupted: the workers stop and send what they finished
        if collecting is not None:
            await asyncio.to_thread(concurrent.futures.wait, [collecting], 15.0)
        await asyncio.sleep(0)  # the last records' on_record calls run before this returns
        collector.shutdown(wait=False)
        await asyncio.to_thread(pool.close)
    in_flight, peak = _merge_in_flight([f[0] for f in finals])
    return WorkerLoad(sorted(records, key=lambda r: r.request_id), in_flight, peak, [f[2] for f in finals])


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]))
