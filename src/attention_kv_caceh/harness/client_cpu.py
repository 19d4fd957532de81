"""The client's own CPU over the measured load, per request and per token event, and whether the client
was the bottleneck.

Each client process measures, from the clock's start to the load's end, its process CPU time (every
thread: the event loop, the `/metrics` poller, the record collector of a multi-process run) and its
event loop thread's CPU time (`time.thread_time_ns` in the loop's thread). A loop that ran on a core for
CLIENT_BUSY_WARN or more of the load's wall time had no time left to read the server's streams: its
timestamps lag the server and its throughput is the client's. The summary then warns and says how many
workers would share the load.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from attention_kv_caceh.harness.records import RequestRecord

__all__ = ["CLIENT_BUSY_WARN", "CpuClock", "CpuSpan", "client_cpu_summary", "client_cpu_warning"]

CLIENT_BUSY_WARN = 0.9  # an event loop on a core this much of the load's wall time was the bottleneck


@dataclass(frozen=True)
class CpuSpan:
    """One process's CPU over the load (ns): all threads (`process_ns`), its event loop thread
    (`loop_ns`; 0 for a process that ran no load), and the requests and token events it handled."""

    process_ns: int
    loop_ns: int
    requests: int = 0
    token_events: int = 0


class CpuClock:
    """`start()` then `stop()` in the same (event loop) thread: the CpuSpan between them."""

    def __init__(self) -> None:
        self._process = 0
        self._thread = 0

    def start(self) -> None:
        self._process, self._thread = time.process_time_ns(), time.thread_time_ns()

    def stop(self, records: Sequence[RequestRecord] = (), *, loop: bool = True) -> CpuSpan:
        process, thread = time.process_time_ns() - self._process, time.thread_time_ns() - self._thread
        events = sum(len(r.token_times_ns) for r in records)
        return CpuSpan(process, thread if loop else 0, len(records), events)


def client_cpu_summary(
    workers: Sequence[CpuSpan], parent: CpuSpan | None, duration_s: float
) -> dict[str, Any]:
    """The summary's `client_cpu`: the total process CPU of every client process (the workers, and the
    parent that coordinated them when there were several), per request and per token event (µs), and
    each worker's share with its loop's busy fraction (loop CPU / the load's wall time)."""
    total_ns = sum(w.process_ns for w in workers) + (parent.process_ns if parent is not None else 0)
    everyone = [*workers, *([parent] if parent is not None else [])]
    requests = sum(w.requests for w in everyone)  # the parent's: the probes it sent
    events = sum(w.token_events for w in everyone)
    per_worker = [
        {
            "process_cpu_s": w.process_ns / 1e9,
            "loop_cpu_s": w.loop_ns / 1e9,
            "loop_busy_fraction": w.loop_ns / 1e9 / duration_s if duration_s > 0 else None,
            "requests": w.requests,
            "token_events": w.token_events,
        }
        for w in workers
    ]
    return {
        "workers": len(workers),
        "process_cpu_s": total_ns / 1e9,
        "coordinator_cpu_s": parent.process_ns / 1e9 if parent is not None else None,
        "requests": requests,
        "token_events": events,
        "per_request_us": total_ns / 1e3 / requests if requests else None,
        "per_token_event_us": total_ns / 1e3 / events if events else None,
        "loop_busy_fraction": max((w["loop_busy_fraction"] or 0.0 for w in per_worker), default=None),
        "per_worker": per_worker,
    }


def client_cpu_warning(cpu: dict[str, Any], duration_s: float, *, can_split: bool = True) -> str | None:
    """A warning when the busiest event loop ran CLIENT_BUSY_WARN or more of the load's wall time. Its
    advice is more --workers where the run can split its load (`can_split`: an HTTP backend); the
    simulated backend serves from the client's own process, so there it is a lighter load."""
    busy = cpu.get("loop_busy_fraction")
    if busy is None or busy < CLIENT_BUSY_WARN:
        return None
    workers = int(cpu["workers"])
    per_event = cpu.get("per_token_event_us")
    cost = f", {per_event:.1f} µs of client CPU per token event" if per_event is not None else ""
    return (
        f"the client was the bottleneck: its busiest event loop ran on a core {100 * busy:.0f} % of the "
        f"load's {duration_s:.2f} s ({cpu['token_events']} token events over {workers} worker(s){cost}); "
        "its timestamps lag the server and its throughput is the client's: "
        + (
            f"split the load with --workers {2 * workers} (on a machine with the cores for them)"
            if can_split
            else "the simulated server runs in the client's process (it takes no --workers): lower "
            "--concurrency or the token rate (--per-token-ms higher)"
        )
    )
