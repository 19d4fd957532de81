"""Draw a run as a per-request timeline over client in-flight and server running/waiting counts.

Top panel: one row per request, time in ms from the run's start: client lateness (arrival -> dispatch,
the client's own delay in starting the request), client queue (dispatch -> sent, waiting for a slot of
the concurrency semaphore), waiting for the first token (sent -> first token: TTFT, which includes waiting in the server's queue), decoding
(first token -> finish) with a tick per token event; a failed request ends in a red cross. Bottom panel:
the client's in-flight requests (the semaphore) beside the server's running and waiting requests, to
show that client concurrency is not the server's batch. Server values are steps drawn at the times the
server was sampled (a value holds until the next sample; nothing is invented between samples), each
polled sample marked, with the sample count in the panel's title and the legend beside the panel. matplotlib with the Agg backend, PNG out.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attention_kv_caceh.harness.run import RunResult

__all__ = ["draw_timeline", "plot_timeline"]

_LATENESS = "tab:red"  # arrival -> dispatch: the client's loop started the request late
_QUEUE = "0.75"  # dispatch -> sent: waiting for a slot of the client's concurrency semaphore
_MAX_TICKS = 20_000  # beyond this many token events, ticks would be ink, not information


def draw_timeline(result: RunResult) -> Figure:
    """The timeline of `result` as a matplotlib Figure (the caller closes it)."""
    t0 = result.start_ns

    def ms(t_ns: int) -> float:
        return (t_ns - t0) / 1e6

    records = sorted(result.records, key=lambda r: (r.arrival_ns, r.request_id))
    n = len(records)
    height = min(2.0 + 0.22 * n, 14.0) + 2.5
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, height), sharex=True, gridspec_kw={"height_ratios": [max(n, 4), 6]}
    )
    draw_ticks = sum(len(r.token_times_ns) for r in records) <= _MAX_TICKS
    for row, r in enumerate(records):
        sent = r.sent_ns if r.sent_ns is not None else r.arrival_ns
        dispatch = r.dispatch_ns if r.dispatch_ns is not None else r.arrival_ns
        # client lateness (arrival -> dispatch), then client queue (dispatch -> sent: the semaphore)
        top.barh(row, ms(dispatch) - ms(r.arrival_ns), left=ms(r.arrival_ns), color=_LATENESS, height=0.7)
        top.barh(row, ms(sent) - ms(dispatch), left=ms(dispatch), color=_QUEUE, height=0.7)
        if r.first_token_ns is not None:
            top.barh(row, ms(r.first_token_ns) - ms(sent), left=ms(sent), color="tab:orange")
            finish = r.finish_ns if r.finish_ns is not None else r.first_token_ns
            top.barh(row, ms(finish) - ms(r.first_token_ns), left=ms(r.first_token_ns), color="tab:blue")
            if draw_ticks:
                ticks = [ms(t) for t in r.token_times_ns]
                top.plot(ticks, [row] * len(ticks), "|", color="black", markersize=6)
        if not r.ok:
            end = r.stream_end_ns if r.stream_end_ns is not None else sent
            top.plot([ms(end)], [row], "x", color="red", markersize=8)
    top.set_ylabel("request (by arrival)")
    top.set_ylim(-0.8, max(n, 1) - 0.2)
    top.invert_yaxis()
    top.set_title(
        "client lateness (red), client queue (grey), waiting for first token = TTFT (orange), "
        "decoding (blue, | = token event)",
        fontsize="small",
    )

    in_flight = [(0.0, 0)] + [(ms(t), c) for t, c in result.in_flight]
    bottom.step(
        [t for t, _ in in_flight],
        [c for _, c in in_flight],
        where="post",
        label="client in-flight",
        linewidth=4,
        alpha=0.45,
        color="tab:purple",
    )
    _draw_server(bottom, result, ms)
    bottom.set_xlabel("time since start (ms)")
    bottom.set_ylabel("requests")
    # beside the panel, never over the curves
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _draw_server(ax: Axes, result: RunResult, ms: Callable[[int], float]) -> None:
    """Server running/waiting as steps at the server's own sample times (`where="post"`: a value holds
    until the next sample), each sample marked; the panel title says how many samples there are."""
    exact = bool(result.server_exact)
    server = result.server_exact or result.server_samples
    if not server:
        ax.set_title("client in-flight (server not polled)", fontsize="small")
        return
    times = [ms(s.time_ns) for s in server]
    marker = None if exact else "o"
    ax.step(
        times,
        [s.running for s in server],
        where="post",
        label="server running",
        color="k",
        marker=marker,
        markersize=3,
    )
    ax.step(
        times,
        [s.waiting for s in server],
        where="post",
        label="server waiting",
        color="tab:red",
        linestyle="--",
        marker=marker,
        markersize=3,
    )
    source = "simulated server, every change (exact)" if exact else "/metrics polls, o = a sample"
    ax.set_title(
        f"client in-flight and server queue: {len(server)} server samples ({source})", fontsize="small"
    )


def plot_timeline(result: RunResult, path: str | os.PathLike[str]) -> Path:
    """Write the timeline of `result` to `path` (PNG); returns the path. Raises OSError on write."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig = draw_timeline(result)
    try:
        fig.savefig(target, dpi=110, bbox_inches="tight")  # pyright: ignore[reportUnknownMemberType]
    finally:
        plt.close(fig)
    return target
