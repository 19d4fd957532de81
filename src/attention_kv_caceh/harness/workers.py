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

The workers ignore SIGINT (the parent handles Ctrl-C and stops them) and die with the parent
(PR_SET_PDEATHSIG on Linux). Probes, the `/metrics` poller and the counters stay in the parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import multiprocessing
import os
import signal
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


def worker_main(conn: Connection, plan: WorkerPlan, parent_pid: int) -> None:
    """The worker process's entry (module docstring)."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_worker(conn, plan))
    conn.close()


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
        records = await run_requests(
            backend,
            plan.specs,
            plan.offsets_s,
            plan.concurrency,
            tracker=tracker,
            on_record=lambda record: conn.send(("record", record)),
            start_ns=message[1],
        )
        span = clock.stop(records)
        conn.send(("done", (tracker.samples, tracker.peak, span)))
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
    """The worker processes and the parent's ends of their pipes."""

    def __init__(self, plans: Sequence[WorkerPlan]) -> None:
        context = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for plan in plans:
            parent_end, child_end = context.Pipe()
            proc = context.Process(
                target=worker_main, args=(child_end, plan, os.getpid()), name=f"harness-worker-{plan.index}"
            )
            proc.daemon = True
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

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
        peak, CpuSpan). Raises RuntimeError when a worker dies first; returns early when `stop` is set."""
        done: dict[int, Any] = {}
        while len(done) < len(self.conns) and not stop.is_set():
            live = [c for i, c in enumerate(self.conns) if i not in done]
            for ready in wait(live, timeout=0.1):
                conn = cast("Connection", ready)
                index = self.conns.index(conn)
                try:
                    message: tuple[str, Any] = conn.recv()
                except EOFError:
                    raise RuntimeError(
                        f"client worker {index} exited during the run (exit code "
                        f"{self.procs[index].exitcode})"
                    ) from None
                if message[0] == "record":
                    deliver(message[1])
                else:
                    done[index] = message[1]
        return [done[i] for i in sorted(done)]

    def close(self) -> None:
        """Stop every worker still running (SIGTERM, then SIGKILL after 5 s) and close the pipes."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


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

    try:
        await asyncio.to_thread(pool.wait_ready)
        start_ns = perf_counter_ns() + _START_LEAD_NS
        pool.start(start_ns)
        if on_start is not None:
            on_start(start_ns)
        finals: list[Any] = await asyncio.to_thread(pool.collect, deliver, stop)
        await asyncio.sleep(0)  # the last records' on_record calls run before the result is used
    finally:
        stop.set()
        await asyncio.to_thread(pool.close)
    in_flight, peak = _merge_in_flight([f[0] for f in finals])
    return WorkerLoad(sorted(records, key=lambda r: r.request_id), in_flight, peak, [f[2] for f in finals])
