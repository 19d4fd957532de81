"""`harness --repeats N`: the same run N times, every run kept, and a mean with a 95 % confidence
interval for every headline metric (`harness/repeats.py`).

Each repeat is exactly the harness run of the flags (the same seed: the same prompts and arrivals), its
smoke test only before the first; before every repeat the server's prefix cache is emptied with `POST
/reset_prefix_cache` where it offers it, so that no repeat finds what the one before computed. With
`--jsonl x.jsonl`, repeat i writes `x-rI.jsonl` (as it finishes, line by line) and `x-rI.jsonl.meta.json`
(its config, environment, `repeat: {index, count, of}` and the clock's `start_ns` / `end_ns`, from which
`report` recomputes its throughputs); `--plot x.png` draws `x-rI.png`; `--summary-json` holds every
repeat's summary (`runs`) and the `intervals`. Ctrl-C keeps every finished repeat and the records of the
one in progress, and still prints and saves the intervals of the finished ones.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from attention_kv_caceh.cli.common import PROG, UsageError, check_outputs
from attention_kv_caceh.cli.harness_output import JsonlSink, error, failure_line
from attention_kv_caceh.files import ignoring_sigint, meta_path, write_json_atomic
from attention_kv_caceh.harness.config import HarnessConfig
from attention_kv_caceh.harness.discovery import ContextLengthError, ModelDiscoveryError
from attention_kv_caceh.harness.load import SmokeTestError
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.repeats import MAX_REPEATS, repeat_intervals
from attention_kv_caceh.harness.run import RunResult, run_harness
from attention_kv_caceh.harness.server_counters import reset_prefix_cache
from attention_kv_caceh.timing import capture_environment

__all__ = ["check_repeat_outputs", "format_intervals", "repeat_path", "run_repeats"]


def repeat_path(path: Path, index: int) -> Path:
    """`x.jsonl` -> `x-r{index}.jsonl` (any suffix)."""
    return path.with_name(f"{path.stem}-r{index}{path.suffix}")


def check_repeat_outputs(
    args: argparse.Namespace, inputs: list[tuple[str, str | None]] | None = None
) -> None:
    """--repeats in range, and every per-repeat file checked up front, none of them one of `inputs`
    ((flag, path) of what the run reads) (UsageError naming the flag)."""
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise UsageError(f"--repeats must be in [1, {MAX_REPEATS}], got {args.repeats}")
    outputs: list[tuple[str, Path | None, tuple[str, ...]]] = []
    for i in range(args.repeats):
        if args.jsonl is not None:
            outputs += [("--jsonl", repeat_path(args.jsonl, i), (".jsonl",))]
            outputs += [("--jsonl", meta_path(repeat_path(args.jsonl, i)), ())]
        if args.plot is not None:
            outputs.append(("--plot", repeat_path(args.plot, i), (".png",)))
    check_outputs(outputs, inputs or [])


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}"


def format_intervals(intervals: dict[str, dict[str, Any]]) -> str:
    """The intervals as a fixed-width table: metric, n, mean, the 95 % interval, its half width."""
    header = f"{'metric':<24}{'n':>4}{'mean':>12}{'95 % CI low':>14}{'high':>12}{'+/-':>11}{'+/- %':>8}"
    lines = [header, "-" * len(header)]
    for metric, ci in intervals.items():
        share = (
            f"{100 * ci['half_width'] / abs(ci['mean']):.1f}"
            if ci["half_width"] is not None and ci["mean"]
            else "-"
        )
        lines.append(
            f"{metric:<24}{ci['n']:>4}{_num(ci['mean']):>12}{_num(ci['low']):>14}{_num(ci['high']):>12}"
            f"{_num(ci['half_width']):>11}{share:>8}"
        )
    return "\n".join(lines)


def _save_repeat(
    args: argparse.Namespace,
    index: int,
    result: RunResult | None,
    config: HarnessConfig,
    sink: JsonlSink,
    environment: dict[str, Any],
    server: dict[str, Any] | None,
) -> list[str]:
    """Write repeat `index`'s metadata (and its timeline when complete); returns the paths written."""
    written: list[str] = []
    if sink.opened and args.jsonl is not None:
        jsonl = repeat_path(args.jsonl, index)
        meta: dict[str, Any] = {
            "kind": "serving-harness",
            "status": "complete" if result is not None else "interrupted",
            "records": sink.count,
            "config": (result.config if result is not None else config).describe(),
            "environment": environment,
            "repeat": {"index": index, "count": args.repeats, "of": args.jsonl.name},
        }
        if result is not None:
            meta |= {"start_ns": result.start_ns, "end_ns": result.end_ns}
        if server is not None:
            meta["server"] = server
        written += [str(jsonl), str(write_json_atomic(meta_path(jsonl), meta))]
    if result is not None and args.plot is not None:
        from attention_kv_caceh.harness.timeline import plot_timeline

        written.append(str(plot_timeline(result, repeat_path(args.plot, index))))
    return written


def _line(index: int, summary: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        value = summary.get(key)
        return "-" if value is None else f"{value:.2f}"

    return (
        f"repeat {index}: {summary['completed']} ok {summary['failed']} failed   requests/s "
        f"{summary['request_throughput']:.2f}   output tokens/s {summary['output_throughput']:.1f}   "
        f"TTFT p50/p99 {ms('median_ttft_ms')}/{ms('p99_ttft_ms')} ms   "
        f"TPOT p50/p99 {ms('median_tpot_ms')}/{ms('p99_tpot_ms')} ms"
    )


def run_repeats(
    args: argparse.Namespace, config: HarnessConfig, describe_server: Callable[[], dict[str, Any]] | None
) -> int:
    """Run `config` `args.repeats` times (module docstring); returns the exit code: 0, 1 (a runtime
    failure, failed requests), 2 (the server's context refuses the requests), 130 (interrupted)."""
    environment = capture_environment()
    results: list[RunResult] = []
    resets: list[str] = []
    code = 0
    written: list[str] = []
    for index in range(args.repeats):
        one = config if index == 0 else replace(config, smoke_test=False)
        if config.backend != "simulated":
            headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
            ok, why = reset_prefix_cache(config.base_url, headers)
            resets.append("yes" if ok else why)
        sink = JsonlSink(repeat_path(args.jsonl, index) if args.jsonl is not None else None)

        def on_record(record: RequestRecord, sink: JsonlSink = sink) -> None:
            sink.write(record)

        result: RunResult | None = None
        try:
            result = asyncio.run(run_harness(one, on_record=on_record))
        except (SmokeTestError, ModelDiscoveryError, RuntimeError) as exc:
            error(exc)
            code = 1
        except ContextLengthError as exc:
            error(exc)
            return 2
        except KeyboardInterrupt:
            code = 130
        finally:
            sink.close()
        server = describe_server() if describe_server is not None and result is not None else None
        with ignoring_sigint():
            written += _save_repeat(args, index, result, config, sink, environment, server)
        if sink.error is not None:
            error(f"could not write --jsonl {sink.path}: {sink.error}")
            code = 1
        if result is None or sink.error is not None:
            break
        results.append(result)
        print(_line(index, result.summary), flush=True)
        for warning in result.summary["warnings"]:
            print(f"  warning: {warning}", flush=True)
        failures = failure_line(result.records)
        if failures is not None:
            error(f"repeat {index}: {failures}")
            code = code or 1
    if code == 130:
        print(f"{PROG}: interrupted; {len(results)} finished repeats kept", file=sys.stderr)
    if not results:
        return code or 1
    with ignoring_sigint():
        return _finish(args, config, results, resets, environment, written, code, describe_server)


def _finish(
    args: argparse.Namespace,
    config: HarnessConfig,
    results: list[RunResult],
    resets: list[str],
    environment: dict[str, Any],
    written: list[str],
    code: int,
    describe_server: Callable[[], dict[str, Any]] | None,
) -> int:
    """The intervals: printed, and with every run's summary in --summary-json."""
    summaries = [r.summary for r in results]
    intervals = repeat_intervals(summaries)
    if args.summary_json is not None:
        doc: dict[str, Any] = {
            "kind": "serving-harness-repeats",
            "config": results[-1].config.describe(),
            "environment": environment,
            "repeats": args.repeats,
            "completed_repeats": len(results),
            "prefix_cache_reset": resets,
            "intervals": intervals,
            "runs": summaries,
        }
        if describe_server is not None:
            doc["server"] = describe_server()
        try:
            written.append(str(write_json_atomic(args.summary_json, doc)))
        except OSError as exc:
            error(f"could not write an output file: {exc}")
            code = 1
    print(f"{len(results)} repeats: mean and 95 % confidence interval (Student's t) of each metric")
    print(format_intervals(intervals))
    if len(results) < 2:
        print("(one repeat: no interval)")
    if written:
        print("wrote: " + ", ".join(written))
    return code
