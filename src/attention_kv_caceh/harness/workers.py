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

Each worker is a `python -m attention_kv_caceh.harness.workers` child talking over a socket pair
(multiprocessing's `Connection`, pickled messages). The workers ignore SIGINT (the parent handles Ctrl-C
and stops them) and die with the parent (PR_SET_PDEATHSIG on Linux). Probes, the `/metrics` poller and the counters stay in the parent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from time import perf_counter_ns
from typing import Any, cast

import aiohttp

from attention_kv_caceh.harness.backends import OpenAIBackend, RequestSpec
from attention_kv_caceh.harness.client_cpu import CpuClock, CpuSpan
from attention_kv_caceh.harness.load import InFlightTracker, run_requests
from attention_kv_caceh.harness.records import RequestRecord

__all__ = ["WorkerLoad", "WorkerPlan", "run_worker_load", "split_load"]

_START_LEAD_NS = 20_000_000  # the shared start is this far ahead of the parent's clock when sent
FLUSH_S = 0.02  # a worker's finished records reach the parent within this (plus the pipe's delay)
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


def worker_main(fd: int, parent_pid: int) -> None:
    """The worker process's entry (module docstring): its plan comes first on the connection `fd`."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    plan: WorkerPlan = conn.recv()
    asyncio.run(_worker(conn, plan))
    conn.close()


class _Outbox:
    """A worker's finished records, sent to the parent in batches: at most FLUSH_S after the first
    record of a batch finished (a batch per record cost the parent about 0.1 ms of CPU a request), as
    dicts of the record's fields (pickled several times faster than the dataclass)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.pending: list[dict[str, Any]] = []
        self._timer: asyncio.TimerHandle | None = None

    def add(self, record: RequestRecord) -> None:
        self.pending.append(vars(record))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.pending:
            self.conn.send(("records", self.pending))
            self.pending = []


async def _stop_message(conn: Connection) -> None:
    """Return when the parent sends ("stop", 0) or closes the connection."""
    with contextlib.suppress(EOFError, OSError):
        await asyncio.to_thread(conn.recv)


async def _worker(conn: Connection, plan: WorkerPlan) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        backend = OpenAIBackend(session, **plan.backend)
        first = plan.specs[: plan.concurrency]
        backend.prepare(first)
        await backend.open_connections(len(first))
        conn.send(("ready", plan.index))
        message: tuple[str, int] = await asyncio.to_thread(conn.recv)
        if message[0] != "start":
            return
        gc.collect()
        gc.freeze()
        clock = CpuClock()
        clock.start()
        tracker = InFlightTracker()
        outbox = _Outbox(conn)
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
        stop = asyncio.create_task(_stop_message(conn))  # the parent was interrupted, or closed
        await asyncio.wait((load, stop), return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
        outbox.flush()
        conn.send(("done", (tracker.samples, tracker.peak, clock.stop(finished))))
    finally:
        await session.close()


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
    """The worker processes and the parent's ends of their connections (a socket pair each)."""

    def __init__(self, plans: Sequence[WorkerPlan]) -> None:
        # Each worker is `python -m attention_kv_caceh.harness.workers FD PARENT_PID`, not a
        # multiprocessing child: a spawned child re-imports the parent's main module, which a script
        # calling run_harness without an `if __name__ == "__main__"` guard cannot survive.
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for plan in plans:
            ours, theirs = socket.socketpair()
            with theirs:
                proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid())],
                    pass_fds=[theirs.fileno()],
                )
            conn = Connection(ours.detach())
            self.conns.append(conn)
            self.procs.append(proc)
            conn.send(plan)

    def wait_ready(self) -> None:
        """Block until every worker said ready. Raises RuntimeError naming a worker that died or
        did not answer in time."""
        pending = set(range(len(self.conns)))
        deadline = perf_counter_ns() + int(_READY_TIMEOUT_S * 1e9)
        while pending:
            left = (deadline - perf_counter_ns()) / 1e9
            if left <= 0:
                raise RuntimeError(f"client worker {min(pending)} did not start in {_READY_TIMEOUT_S:g} s")
            for ready in wait([self.conns[i] for i in pending], timeout=min(left, 1.0)):
                conn = cast("Connection", ready)
                index = self.conns.index(conn)
                try:
                    conn.recv()
                except EOFError:
                    raise RuntimeError(f"client worker {index} exited before it was ready") from None
                pending.discard(index)

    def start(self, start_ns: int) -> None:
        for conn in self.conns:
            conn.send(("start", start_ns))

    def collect(self, deliver: Callable[[RequestRecord], None], stop: threading.Event) -> list[Any]:
        """Pass every record to `deliver` as it comes; returns each worker's final (in-flight series,
        peak, CpuSpan). Raises RuntimeError when a worker dies first. When `stop` is set (the parent was
        interrupted), every worker is told to stop, and what they finished is still collected (for up
        to 10 s)."""
        done: dict[int, Any] = {}
        deadline: int | None = None
        while len(done) < len(self.conns):
            if stop.is_set() and deadline is None:
                deadline = perf_counter_ns() + 10_000_000_000
                for i, conn in enumerate(self.conns):
                    if i not in done:
                        conn.send(("stop", 0))
            if deadline is not None and perf_counter_ns() > deadline:
                break
            live = [c for i, c in enumerate(self.conns) if i not in done]
            for ready in wait(live, timeout=0.1):
                conn = cast("Connection", ready)
                index = self.conns.index(conn)
                try:
                    message: tuple[str, Any] = conn.recv()
                except EOFError:
                    raise RuntimeError(
                        f"client worker {index} exited during the run (exit code {self.procs[index].poll()})"
                    ) from None
                if message[0] == "records":
                    for fields in message[1]:
                        deliver(RequestRecord(**fields))
                else:
                    done[index] = message[1]
        return [done[i] for i in sorted(done)]

    def close(self) -> None:
        """Close the sockets (a worker exits when its socket closes) and stop every worker still
        running after 5 s (SIGTERM, then SIGKILL after 5 s more)."""
        for conn in self.conns:
            conn.close()
        for how in ("wait", "terminate", "kill"):
            for proc in self.procs:
                if how != "wait" and proc.poll() is None:
                    proc.terminate() if how == "terminate" else proc.kill()
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            if all(proc.poll() is not None for proc in self.procs):
                return


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

    def deliver(record: RequestRecord) -> None:
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
