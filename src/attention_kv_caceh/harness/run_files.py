"""What one harness run writes, and the run that writes it: the per-request JSONL (a `RunRecorder`, one
record appended as each request finishes), its `<jsonl>.meta.json`, the summary JSON and the timeline.

`run_recorded` runs a config with every finished record written at once, and after the run (or a
Ctrl-C) writes the metadata (`status` complete or interrupted, `records`, the config as run, the
environment, the clock's `start_ns` / `end_ns` of a complete run, the engine `server`), the summary
JSON and the timeline, SIGINT ignored meanwhile; an interrupted run keeps every finished request and
gets a summary of them (`interrupted: true`) and a timeline rebuilt from them (`finished_run`). The
JSONL is opened at the first finished request (a failed smoke test leaves an earlier file alone) and
flushed per line, never fsynced, which would stall the event loop for milliseconds and show up in other
requests' timestamps (docs/files.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attention_kv_caceh.files import ignoring_sigint, meta_path, output_path, write_json_atomic
from attention_kv_caceh.harness.config import HarnessConfig
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.repeats import MAX_REPEATS
from attention_kv_caceh.harness.run import RunResult, run_harness
from attention_kv_caceh.harness.summary import summarize_run
from attention_kv_caceh.options import ConfigError, check_options, option
from attention_kv_caceh.recorder import RunRecorder, Status
from attention_kv_caceh.timing import capture_environment

__all__ = [
    "HarnessOutputs",
    "RecordSink",
    "RunOutcome",
    "finished_run",
    "partial_summary",
    "repeat_path",
    "run_recorded",
    "summary_document",
]

KIND = "serving-harness"


@dataclass(frozen=True)
class HarnessOutputs:
    """The files of a harness run and how many times it is run (`repeats`, `repeat_run.py`)."""

    jsonl: Path | None = option(
        None,
        parse=output_path(".jsonl"),
        help="per-request records, one JSON a line",
        default_text="not written",
    )
    summary_json: Path | None = option(
        None, parse=output_path(".json"), help="summary (vLLM key names)", default_text="not written"
    )
    plot: Path | None = option(None, parse=output_path(".png"), help="timeline PNG", default_text="not drawn")
    repeats: int = option(
        1,
        help=f"run the same load this many times (prefix cache emptied before each; at most {MAX_REPEATS}); "
        "every headline metric gets a mean and a 95 %% confidence interval; with --jsonl x.jsonl each "
        "run's records go to x-r0.jsonl, x-r1.jsonl, ...",
    )

    def __post_init__(self) -> None:
        check_options(self)
        if not 1 <= self.repeats <= MAX_REPEATS:
            raise ConfigError("repeats", f"must be in [1, {MAX_REPEATS}], got {self.repeats}")


def repeat_path(path: Path, index: int) -> Path:
    """`x.jsonl` -> `x-r{index}.jsonl` (any suffix)."""
    return path.with_name(f"{path.stem}-r{index}{path.suffix}")


class RecordSink:
    """The per-request JSONL of one run (None: not written), opened at the first finished request. The
    first OSError is kept in `error` and every later write is refused. `extra`: more metadata keys."""

    def __init__(self, path: Path | None, extra: dict[str, Any] | None = None) -> None:
        self.path = path
        self.error: OSError | None = None
        self._extra = {"records": 0, **(extra or {})}
        self._recorder: RunRecorder | None = None

    def write(self, record: RequestRecord) -> bool:
        """Append `record`; False once writing has failed."""
        if self.path is None:
            return True
        if self.error is not None:
            return False
        try:
            if self._recorder is None:
                self._recorder = RunRecorder(
                    KIND, self.path, None, config={}, environment={}, extra=self._extra, fsync=False,
                    save_on_open=False,
                )  # fmt: skip
            self._recorder.add([record.to_json()], save=False)
        except OSError as exc:
            self.error = exc
            return False
        return True

    @property
    def opened(self) -> bool:
        return self._recorder is not None

    @property
    def count(self) -> int:
        return 0 if self._recorder is None else self._recorder.count

    def close(self) -> None:
        if self._recorder is not None:
            try:
                self._recorder.close()
            except OSError as exc:
                self.error = self.error or exc

    def finish(
        self,
        status: Status,
        config: HarnessConfig,
        environment: dict[str, Any],
        result: RunResult | None,
        server: dict[str, Any] | None,
        written: list[str],
    ) -> None:
        """Write the metadata with `status`, the record count, the config as run, the environment, the
        clock of a complete run (from which `report` recomputes the throughputs) and the server; the
        paths go to `written` (the JSONL first). Nothing when no record was written."""
        if self._recorder is None or self.path is None:
            return
        written.append(str(self.path))
        meta = self._recorder.meta
        meta.update(records=self.count, config=config.describe(), environment=environment)
        if result is not None:
            meta |= {"start_ns": result.start_ns, "end_ns": result.end_ns}
        if server is not None:
            meta["server"] = server
        self._recorder.finish(status)
        written.append(str(meta_path(self.path)))


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


def partial_summary(config: HarnessConfig, finished: list[RequestRecord]) -> dict[str, Any]:
    """The summary of an interrupted run's finished requests (first arrival to last stream end),
    marked `interrupted`. `finished` must not be empty."""
    start = min(r.arrival_ns for r in finished)
    end = max(r.stream_end_ns or r.arrival_ns for r in finished)
    summary = summarize_run(finished, max(end - start, 1) / 1e9, slo=config.goodput)
    summary["interrupted"] = True
    return summary


def summary_document(
    result: RunResult | None, summary: dict[str, Any], config: HarnessConfig, environment: dict[str, Any]
) -> dict[str, Any]:
    """The summary JSON: the config as run, the environment, the summary's keys, the first /metrics errors."""
    doc: dict[str, Any] = {"config": config.describe(), "environment": environment, **summary}
    if result is not None:
        doc["server_metrics_errors"] = result.server_metrics_errors[:5]
    return doc


async def _run_until_write_fails(
    config: HarnessConfig, sink: RecordSink, on_record: Callable[[RequestRecord], None]
) -> RunResult | None:
    """`run_harness`, with every finished record passed to `on_record` and to `sink`; the run is
    stopped (None returned) when the sink fails to write. Ctrl-C still raises KeyboardInterrupt."""
    task: asyncio.Task[RunResult] | None = None

    def record_finished(record: RequestRecord) -> None:
        on_record(record)
        if not sink.write(record) and task is not None:
            task.cancel()

    task = asyncio.create_task(run_harness(config, on_record=record_finished))
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if sink.error is None or (current is not None and current.cancelling()):
            raise  # cancelled from outside (Ctrl-C)
        return None


@dataclass
class RunOutcome:
    """How a recorded run ended. `summary` None: nothing finished (or the JSONL failed: `sink.error`);
    `save_error`: the OSError that stopped the final writes; `written`: the paths written."""

    sink: RecordSink
    finished: list[RequestRecord]
    result: RunResult | None = None
    summary: dict[str, Any] | None = None
    interrupted: bool = False
    server: dict[str, Any] | None = None
    save_error: OSError | None = None
    written: list[str] = field(default_factory=lambda: list[str]())


def run_recorded(
    config: HarnessConfig,
    outputs: HarnessOutputs,
    *,
    on_record: Callable[[RequestRecord], None] | None = None,
    describe_server: Callable[[], dict[str, Any]] | None = None,
) -> RunOutcome:
    """Run `config` once and write its files (module docstring); `on_record(record)` for each finished
    measured request (probes are written, never summarized), `describe_server()` after the run for the
    `server` of the outputs. Raises what `run_harness` raises before the load (smoke test, discovery,
    context); KeyboardInterrupt only while the run is not yet recorded."""
    sink = RecordSink(outputs.jsonl)
    out = RunOutcome(sink, [])

    def finished(record: RequestRecord) -> None:
        if not record.probe:
            out.finished.append(record)
            if on_record is not None:
                on_record(record)

    with contextlib.ExitStack() as after_interrupt:
        try:
            out.result = asyncio.run(_run_until_write_fails(config, sink, finished))
        except KeyboardInterrupt:
            # A second Ctrl-C (a terminal sends one to `uv` too, which forwards it) must not cut short
            # the save of what the run finished: SIGINT is ignored from here to the end.
            after_interrupt.enter_context(ignoring_sigint())
            out.interrupted = True
        finally:
            sink.close()
        if sink.error is not None:
            return out
        partial: RunResult | None = None  # an interrupted run: what finished, for the timeline
        if out.result is not None:
            out.summary = out.result.summary
            config = out.result.config  # as actually run (the model read from the server)
        elif out.finished:
            out.summary = partial_summary(config, out.finished)
            partial = finished_run(config, out.finished, out.summary)
        else:
            return out
        out.server = describe_server() if describe_server is not None else None
        with ignoring_sigint():  # the files first, whole: a Ctrl-C or a closed stdout cannot cut them short
            out.save_error = _save(config, outputs, out, partial)
    return out


def _save(
    config: HarnessConfig, outputs: HarnessOutputs, out: RunOutcome, partial: RunResult | None
) -> OSError | None:
    """Write the JSONL's metadata, the summary JSON and the timeline, adding each path to
    `out.written`; returns the OSError that stopped it, or None."""
    assert out.summary is not None
    environment: dict[str, Any] | None = None
    try:
        if out.sink.opened:
            environment = capture_environment()
            status: Status = "interrupted" if out.result is None else "complete"
            out.sink.finish(status, config, environment, out.result, out.server, out.written)
        if outputs.summary_json is not None:
            doc = summary_document(out.result, out.summary, config, environment or capture_environment())
            if out.server is not None:
                doc["server"] = out.server
            out.written.append(str(write_json_atomic(outputs.summary_json, doc)))
        timeline = out.result if out.result is not None else partial  # interrupted: what finished
        if outputs.plot is not None and timeline is not None:
            from attention_kv_caceh.harness.timeline import plot_timeline

            out.written.append(str(plot_timeline(timeline, outputs.plot)))
    except OSError as exc:
        return exc
    return None
