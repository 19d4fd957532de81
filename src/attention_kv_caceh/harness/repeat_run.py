"""`harness --repeats N`: the same run N times, every run kept, and a mean with a 95 % confidence
interval for every headline metric (`repeats.py`).

Each repeat is exactly the harness run of the config (the same seed: the same prompts and arrivals), its
smoke test only before the first; before every repeat the server's prefix cache is emptied with `POST
/reset_prefix_cache` where it offers it, so that no repeat finds what the one before computed. With a
JSONL `x.jsonl`, repeat i writes `x-rI.jsonl` (as it finishes, line by line) and `x-rI.jsonl.meta.json`
(its config, environment, `repeat: {index, count, of}` and the clock's `start_ns` / `end_ns`, from which
`report` recomputes its throughputs); a plot `x.png` is drawn as `x-rI.png`; the summary JSON holds every
repeat's summary (`runs`) and the `intervals`. Ctrl-C keeps every finished repeat and the records of the
one in progress, and still saves and prints the intervals of the finished ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from attention_kv_caceh.files import ignoring_sigint, write_json_atomic
from attention_kv_caceh.harness.config import HarnessConfig
from attention_kv_caceh.harness.discovery import ContextLengthError, ModelDiscoveryError
from attention_kv_caceh.harness.load import SmokeTestError
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.repeats import repeat_intervals
from attention_kv_caceh.harness.run import RunResult, run_harness
from attention_kv_caceh.harness.run_files import HarnessOutputs, RecordSink, repeat_path
from attention_kv_caceh.harness.run_text import failure_line, format_intervals, repeat_line
from attention_kv_caceh.harness.server_counters import reset_prefix_cache
from attention_kv_caceh.timing import capture_environment

__all__ = ["RepeatsOutcome", "run_repeats"]

Ending = Literal["complete", "failed", "refused", "interrupted"]


@dataclass
class RepeatsOutcome:
    """How the repeats ended (`refused`: the server's context refuses the requests) and what finished."""

    ending: Ending = "complete"
    results: list[RunResult] = field(default_factory=lambda: list[RunResult]())


def reset_cache(config: HarnessConfig) -> str:
    """Empty the server's prefix cache: "yes", or why not ("-" for the simulated backend)."""
    if config.backend == "simulated":
        return "-"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    ok, why = reset_prefix_cache(config.base_url, headers)
    return "yes" if ok else why


def run_repeats(
    config: HarnessConfig,
    outputs: HarnessOutputs,
    describe_server: Callable[[], dict[str, Any]] | None,
    say: Callable[[str], None],
    error: Callable[[str], None],
) -> RepeatsOutcome:
    """Run `config` `outputs.repeats` times (module docstring): a line per repeat to `say`, a failure
    line per failing repeat to `error`, then the intervals table to `say`."""
    environment = capture_environment()
    out = RepeatsOutcome()
    resets: list[str] = []
    written: list[str] = []
    for index in range(outputs.repeats):
        one = config if index == 0 else replace(config, smoke_test=False)
        if config.backend != "simulated":
            resets.append(reset_cache(config))
        jsonl = repeat_path(outputs.jsonl, index) if outputs.jsonl is not None else None
        of = {"index": index, "count": outputs.repeats, "of": outputs.jsonl.name if outputs.jsonl else None}
        sink = RecordSink(jsonl, {"repeat": of})
        result: RunResult | None = None

        def on_record(record: RequestRecord, sink: RecordSink = sink) -> None:
            sink.write(record)

        try:
            result = asyncio.run(run_harness(one, on_record=on_record))
        except (SmokeTestError, ModelDiscoveryError, RuntimeError) as exc:
            error(str(exc))
            out.ending = "failed"
        except ContextLengthError as exc:
            error(str(exc))
            out.ending = "refused"
            return out
        except KeyboardInterrupt:
            out.ending = "interrupted"
        finally:
            sink.close()
        server = describe_server() if describe_server is not None and result is not None else None
        with ignoring_sigint():
            sink.finish(
                "complete" if result is not None else "interrupted",
                result.config if result is not None else config,
                environment, result, server, written,
            )  # fmt: skip
            if result is not None and outputs.plot is not None:
                from attention_kv_caceh.harness.timeline import plot_timeline

                written.append(str(plot_timeline(result, repeat_path(outputs.plot, index))))
        if sink.error is not None:
            error(f"could not write --jsonl {sink.path}: {sink.error}")
            out.ending = "failed"
        if result is None or sink.error is not None:
            break
        out.results.append(result)
        say(repeat_line(index, result.summary))
        for warning in result.summary["warnings"]:
            say(f"  warning: {warning}")
        failures = failure_line(result.records)
        if failures is not None:
            error(f"repeat {index}: {failures}")
            if out.ending == "complete":
                out.ending = "failed"
    if out.results:
        with ignoring_sigint():
            _finish(outputs, out, resets, environment, written, describe_server, say, error)
    return out


def _finish(
    outputs: HarnessOutputs,
    out: RepeatsOutcome,
    resets: list[str],
    environment: dict[str, Any],
    written: list[str],
    describe_server: Callable[[], dict[str, Any]] | None,
    say: Callable[[str], None],
    error: Callable[[str], None],
) -> None:
    """The intervals: printed, and with every run's summary in the summary JSON."""
    summaries = [r.summary for r in out.results]
    intervals = repeat_intervals(summaries)
    if outputs.summary_json is not None:
        doc: dict[str, Any] = {
            "kind": "serving-harness-repeats",
            "config": out.results[-1].config.describe(),
            "environment": environment,
            "repeats": outputs.repeats,
            "completed_repeats": len(out.results),
            "prefix_cache_reset": resets,
            "intervals": intervals,
            "runs": summaries,
        }
        if describe_server is not None:
            doc["server"] = describe_server()
        try:
            written.append(str(write_json_atomic(outputs.summary_json, doc)))
        except OSError as exc:
            error(f"could not write an output file: {exc}")
            out.ending = "failed"
    say(f"{len(out.results)} repeats: mean and 95 % confidence interval (Student's t) of each metric")
    say(format_intervals(intervals))
    if len(out.results) < 2:
        say("(one repeat: no interval)")
    if written:
        say("wrote: " + ", ".join(written))
