"""What `attention-kv-caceh harness` prints and how it keeps records: the summary table, the failure
line, the per-request JSONL sink (opened at the first finished request, flushed per line), and
`report_and_save`, everything the command does after the run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attention_kv_caceh.cli.common import PROG
from attention_kv_caceh.cli.harness_engine import format_engine_steps
from attention_kv_caceh.cli.workload_output import summary_extra_lines
from attention_kv_caceh.files import JsonlWriter, ignoring_sigint, meta_path, write_json_atomic
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import HarnessConfig, RunResult
from attention_kv_caceh.harness.summary import METRIC_NAMES, summarize_run
from attention_kv_caceh.timing import capture_environment

__all__ = [
    "JsonlSink",
    "error",
    "failure_line",
    "format_summary",
    "report_and_save",
    "summary_document",
]


def _fmt(value: Any, width: int = 9) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, int):
        return f"{value:>{width}d}"
    return f"{float(value):>{width}.2f}"


def _server_peaks(summary: dict[str, Any]) -> str:
    """The server's peaks, or why there are none (not polled, or too few /metrics samples)."""
    samples = summary.get("server_metrics_samples")
    running, waiting = summary.get("peak_server_running"), summary.get("peak_server_waiting")
    if running is None and waiting is None and samples is not None:
        return f"peak server running/waiting: not reported (only {samples} /metrics samples: too few)"
    return (
        f"peak server running: {_fmt(running, 0)}   peak server waiting: {_fmt(waiting, 0)}   "
        f"(server: {summary.get('server_metrics_source') or 'not polled'})"
    )


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width text table (ms), with throughput and server lines above it."""
    lines = [
        f"requests: {summary['completed']} ok, {summary['failed']} failed "
        f"{summary['failures'] or ''}".rstrip(),
        f"duration: {summary['duration']:.3f} s   requests/s: {summary['request_throughput']:.2f}"
        f"   output tokens/s: {summary['output_throughput']:.1f}"
        f"   total tokens/s: {summary['total_token_throughput']:.1f}",
        f"peak client in-flight: {_fmt(summary['max_client_in_flight'], 0)}   " + _server_peaks(summary),
    ]
    if summary.get("request_goodput") is not None:
        lines.append(
            f"goodput: {summary['request_goodput']:.2f} req/s "
            f"({summary['good_requests']} of {summary['completed']} meet {summary['goodput_slo_ms']})"
        )
    lines += [f"warning: {w}" for w in summary.get("warnings", [])]
    header = f"{'metric (ms)':<26}{'count':>7}" + "".join(
        f"{h:>9}" for h in ("mean", "p50", "p90", "p95", "p99", "min", "max", "stdev")
    )
    lines += [header, "-" * len(header)]
    for metric, label in METRIC_NAMES.items():
        cells = [
            summary[f"{prefix}_{metric}_ms"]
            for prefix in ("mean", "median", "p90", "p95", "p99", "min", "max", "std")
        ]
        lines.append(f"{label:<26}{summary[f'count_{metric}']:>7d}" + "".join(_fmt(c) for c in cells))
    return "\n".join(lines + summary_extra_lines(summary))


def summary_document(
    result: RunResult | None, summary: dict[str, Any], config: HarnessConfig, environment: dict[str, Any]
) -> dict[str, Any]:
    doc: dict[str, Any] = {"config": config.describe(), "environment": environment, **summary}
    if result is not None:
        doc["server_metrics_errors"] = result.server_metrics_errors[:5]
    return doc


def _one_line(text: object, limit: int = 300) -> str:
    """`text` on one line (whitespace runs collapsed), cut to `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def error(message: object) -> None:
    """Print a runtime error as the one line `attention-kv-caceh: error: ...` on stderr."""
    print(f"{PROG}: error: {_one_line(message, 1000)}", file=sys.stderr)


def failure_line(records: list[RequestRecord]) -> str | None:
    """One line on the failed requests (how many, and the first one's status and error); None if none."""
    failed = sorted((r for r in records if not r.ok), key=lambda r: r.request_id)
    if not failed:
        return None
    first = failed[0]
    http = f" (HTTP {first.http_status})" if first.http_status is not None else ""
    return (
        f"{len(failed)} of {len(records)} requests failed; first: request {first.request_id}: "
        f"{first.status}{http}: {_one_line(first.error)}"
    )


class JsonlSink:
    """The per-request JSONL, opened at the first finished request (a failed smoke test leaves an
    earlier file alone) and flushed per line (survives a crash or Ctrl-C of this process); no fsync,
    which would stall the event loop for milliseconds and show up in other requests' timestamps.
    The first OSError is kept in `error` and every later write is refused."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.error: OSError | None = None
        self.count = 0
        self._writer: JsonlWriter | None = None

    def write(self, record: RequestRecord) -> bool:
        """Append `record`; False once writing has failed."""
        if self.path is None:
            return True
        if self.error is not None:
            return False
        try:
            if self._writer is None:
                meta_path(self.path).unlink(missing_ok=True)  # an earlier run's must not describe this one
                self._writer = JsonlWriter(self.path, fsync=False)
            self._writer.write(record.to_json())
        except OSError as exc:
            self.error = exc
            return False
        self.count += 1
        return True

    @property
    def opened(self) -> bool:
        return self._writer is not None

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError as exc:
                self.error = self.error or exc


def _sent(r: RequestRecord) -> int:
    return r.sent_ns if r.sent_ns is not None else r.arrival_ns


def finished_run(config: HarnessConfig, finished: list[RequestRecord], summary: dict[str, Any]) -> RunResult:
    """A RunResult of the finished requests of an interrupted run, for its timeline: starts at the
    first send, ends at the last stream end; the client in-flight count (`load.InFlightTracker`: sent
    to stream end) is rebuilt from each finished request's `sent_ns` (its arrival if never sent) and
    `stream_end_ns` (requests cut off are not in it); no server samples. `finished` must not be
    empty."""
    spans = [(_sent(r), r.stream_end_ns or _sent(r)) for r in finished]
    events = sorted([(sent, 1) for sent, _ in spans] + [(end, -1) for _, end in spans])
    in_flight: list[tuple[int, int]] = []
    count = 0
    for t, step in events:
        count += step
        in_flight.append((t, count))
    return RunResult(
        config=config,
        records=list(finished),
        summary=summary,
        start_ns=events[0][0],
        end_ns=events[-1][0],
        in_flight=in_flight,
        server_samples=[],
        server_exact=[],
        server_metrics_errors=[],
    )


def report_and_save(
    args: argparse.Namespace,
    config: HarnessConfig,
    sink: JsonlSink,
    finished: list[RequestRecord],
    result: RunResult | None,
    *,
    interrupted: bool,
    describe_server: Callable[[], dict[str, Any]] | None = None,
) -> int:
    """After a harness run: write the JSONL's metadata, the summary JSON and the timeline (SIGINT
    ignored meanwhile), then print the summary (and the engine's step line when `describe_server` is
    given) and what was written; returns the exit code (0, 1
    after a failure reported on stderr, 130 interrupted)."""
    if sink.error is not None:
        error(
            f"could not write --jsonl {args.jsonl}: {sink.error}; run stopped "
            f"({sink.count} of {len(finished)} finished requests written)"
        )
        return 1
    if interrupted:
        kept = f" in {args.jsonl}" if sink.opened else ""
        print(f"{PROG}: interrupted; {len(finished)} finished requests kept{kept}", file=sys.stderr)

    partial: RunResult | None = None  # an interrupted run: what finished, for the timeline
    if result is not None:
        summary = result.summary
        config = result.config  # as actually run (the model read from the server)
    elif finished:
        start = min(r.arrival_ns for r in finished)
        end = max(r.stream_end_ns or r.arrival_ns for r in finished)
        summary = summarize_run(finished, max(end - start, 1) / 1e9, slo=config.goodput)
        summary["interrupted"] = True
        partial = finished_run(config, finished, summary)
    else:
        return 130
    server = describe_server() if describe_server is not None else None
    written: list[str] = []
    with ignoring_sigint():  # the files first, whole: a Ctrl-C or a closed stdout cannot cut them short
        failed = _save(args, config, sink, result, partial, summary, server, written)
    print(format_summary(summary))
    if server is not None:
        print(format_engine_steps(server))
    if written:
        print("wrote: " + ", ".join(written))
    if failed is not None:
        error(f"could not write an output file: {failed}")
        return 1
    if result is None:
        return 130
    failures = failure_line(result.records)
    if failures is not None:
        error(failures)
        return 1
    return 0


def _save(
    args: argparse.Namespace,
    config: HarnessConfig,
    sink: JsonlSink,
    result: RunResult | None,
    partial: RunResult | None,
    summary: dict[str, Any],
    server: dict[str, Any] | None,
    written: list[str],
) -> OSError | None:
    """Write the JSONL's metadata, the summary JSON and the timeline, adding each path to `written`;
    returns the OSError that stopped it, or None."""
    environment: dict[str, Any] | None = None
    try:
        if sink.opened:
            written.append(str(args.jsonl))
            environment = capture_environment()
            meta = {
                "kind": "serving-harness",
                "status": "interrupted" if result is None else "complete",
                "records": sink.count,
                "config": config.describe(),
                "environment": environment,
            }
            if result is not None:  # the clock, from which `report` recomputes the throughputs
                meta |= {"start_ns": result.start_ns, "end_ns": result.end_ns}
            if server is not None:
                meta["server"] = server
            written.append(str(write_json_atomic(meta_path(args.jsonl), meta)))
        if args.summary_json is not None:
            environment = environment or capture_environment()
            doc = summary_document(result, summary, config, environment)
            if server is not None:
                doc["server"] = server
            written.append(str(write_json_atomic(args.summary_json, doc)))
        timeline = result if result is not None else partial  # interrupted: the requests that finished
        if args.plot is not None and timeline is not None:
            from attention_kv_caceh.harness.timeline import plot_timeline

            written.append(str(plot_timeline(timeline, args.plot)))
    except OSError as exc:
        return exc
    return None
