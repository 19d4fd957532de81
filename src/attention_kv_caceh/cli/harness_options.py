"""The harness's flags for trace replay, probes, worker processes and repeats (their own groups, beside
the load flags of cli/harness.py), and what they become in a HarnessConfig."""

from __future__ import annotations

import argparse

from attention_kv_caceh.harness.config import MAX_WORKERS, HarnessConfig
from attention_kv_caceh.harness.repeats import MAX_REPEATS
from attention_kv_caceh.harness.trace import TRACE_FORMATS, TraceFormat, TraceSettings, read_trace

__all__ = ["DEFAULT_NUM_REQUESTS", "add_arguments", "num_requests", "setup_words", "trace_settings"]

DEFAULT_NUM_REQUESTS = 16
DEFAULT_TRACE_FORMAT: TraceFormat = "mooncake"


def add_arguments(parser: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """Declare --trace, --trace-format, --trace-block-size, --trace-speedup, --probe-rate, --workers
    and (not for a sweep, which has its own) --repeats."""
    g = parser.add_argument_group("trace replay (docs/serving.md#trace-replay)")
    g.add_argument(
        "--trace",
        default=None,
        metavar="FILE.jsonl",
        help="replay a trace: one {timestamp, input_length, output_length, hash_ids} a line (vLLM's "
        "timed_trace, Mooncake's); arrivals follow the timestamps, equal hash ids give equal token "
        "blocks; --num-requests takes its first rows (default: not used)",
    )
    g.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        default=None,
        help="mooncake: timestamps in ms, 512 tokens per hash id; timed-trace: timestamps in s, 16 "
        f"tokens per hash id (vLLM's defaults) (default: {DEFAULT_TRACE_FORMAT})",
    )
    g.add_argument(
        "--trace-block-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="tokens per hash id (vLLM's --timed-trace-chunk-hash-size) (default: the format's)",
    )
    g.add_argument(
        "--trace-speedup",
        type=float,
        default=1.0,
        help="divide the trace's arrival gaps by this (2: twice as fast) (default: %(default)s)",
    )
    g = parser.add_argument_group("probes and client processes")
    g.add_argument(
        "--probe-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="one-token probe requests per second beside the load, one at a time, outside "
        "--concurrency and the load's statistics; the summary gives their TTFT and E2EL "
        "(vLLM's --probe-request-rate) (default: %(default)s, none)",
    )
    g.add_argument(
        "--workers",
        type=int,
        default=1,
        help=f"client processes the load is split over, one event loop each, on one arrival schedule "
        f"(--concurrency is split between them); at most {MAX_WORKERS} (default: %(default)s)",
    )
    if not sweep:
        g.add_argument(
            "--repeats",
            type=int,
            default=1,
            help=f"run the same load this many times (prefix cache emptied before each; at most "
            f"{MAX_REPEATS}); every headline metric gets a mean and a 95 %% confidence interval; with "
            "--jsonl x.jsonl each run's records go to x-r0.jsonl, x-r1.jsonl, ... (default: %(default)s)",
        )


def trace_settings(args: argparse.Namespace) -> TraceSettings | None:
    """The TraceSettings of the flags, or None without --trace. A trace flag without --trace, a length
    flag with it (the rows give the lengths; one shapes only --warmup-requests, so it is taken when
    there are some), or a bad value, raises ValueError naming it."""
    if args.trace is None:
        for flag, given in (
            ("--trace-format", args.trace_format is not None),
            ("--trace-block-size", args.trace_block_size is not None),
            ("--trace-speedup", args.trace_speedup != 1.0),
        ):
            if given:
                raise ValueError(f"{flag} needs --trace FILE")
        return None
    if not args.warmup_requests:
        for flag, value in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)):
            if value is not None:
                raise ValueError(
                    f"{flag} {value}: the trace's rows give every request's lengths (it would shape only "
                    "--warmup-requests, and there are none)"
                )
    fmt: TraceFormat = args.trace_format or DEFAULT_TRACE_FORMAT
    return TraceSettings(args.trace, fmt, args.trace_block_size, args.trace_speedup)


def num_requests(args: argparse.Namespace, trace: TraceSettings | None) -> int:
    """--num-requests when given; else every row of the trace, or DEFAULT_NUM_REQUESTS."""
    if args.num_requests is not None:
        return int(args.num_requests)
    return len(read_trace(trace)) if trace is not None else DEFAULT_NUM_REQUESTS


def setup_words(config: HarnessConfig, repeats: int) -> str:
    """The setup line's words for these options (empty when none is used)."""
    words = ""
    if config.trace is not None:
        t = config.trace
        words += (
            f" trace={t.path} ({t.format}, {t.tokens_per_hash} tokens per hash id, speedup {t.speedup:g})"
        )
    if config.probe_rate > 0:
        words += f" probe_rate={config.probe_rate:g}"
    if config.workers > 1:
        words += f" workers={config.workers}"
    if repeats > 1:
        words += f" repeats={repeats}"
    return words
