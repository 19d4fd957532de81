"""The harness's own overhead: ITL error (measured - scripted) against a server with known delays.

Starts the scripted server (`scripted_server.py`) in a child process on 127.0.0.1, streaming one token
every `--itl-ms` (10 ms) on absolute deadlines, and runs the real HTTP path of the harness
(openai-completions backend, SSE parser, records) at each concurrency, with
`max(16, waves * concurrency)` requests (`--waves`, default 2). Reports P50/P99 (and mean, max)
of measured ITL - scripted ITL and of measured TTFT - scripted TTFT, in ms, via `summarize_samples`.
Client and server share this machine's cores, so the error includes the server's own lateness.

    uv run python -m attention_kv_caceh.harness.overhead [--concurrency 1 64 256] [--json out.json]

Bad flags exit 2 with one line on stderr before the server starts; a failed request exits 1.

A benchmark, not a test: it asserts nothing and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
from typing import Any

from attention_kv_caceh.files import check_output_path, write_json_atomic
from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.run import MAX_REQUESTS, HarnessConfig, RunResult, run_harness
from attention_kv_caceh.harness.scripted_server import scripted_server_process
from attention_kv_caceh.harness.server_metrics import DEFAULT_INTERVAL_S
from attention_kv_caceh.timing import capture_environment, summarize_samples

__all__ = ["main", "measure_overhead"]

PROG = "python -m attention_kv_caceh.harness.overhead"


def _one_run(url: str, concurrency: int, *, tokens: int, waves: int, interval_s: float) -> RunResult:
    config = HarnessConfig(
        backend="openai-completions",
        base_url=url,
        model="scripted",
        num_requests=max(16, waves * concurrency),
        concurrency=concurrency,
        output_len=LengthRange(tokens, tokens),
        server_metrics_interval_s=interval_s,
        timeout_s=120,
    )
    result = asyncio.run(run_harness(config))
    if result.summary["failed"]:
        raise RuntimeError(f"concurrency {concurrency}: failures {result.summary['failures']}")
    return result


def _p99_itl(result: RunResult) -> float:
    return summarize_samples([x for r in result.records for x in r.metrics().itl_ms])["p99_ms"]


def measure_overhead(
    url: str,
    concurrency: int,
    *,
    itl_ms: float,
    ttft_ms: float,
    tokens: int,
    waves: int,
    polling_interval_s: float = DEFAULT_INTERVAL_S,
    polling_pairs: int = 2,
) -> dict[str, Any]:
    """Run `max(16, waves * concurrency)` requests of `tokens` tokens without server polling; return
    error statistics (ms) of ITL and TTFT against the script. Then the cost of `/metrics` polling:
    `polling_pairs` pairs of runs alternating off / on (every `polling_interval_s`; 0 pairs: skipped),
    reported as `polling`: the median ratio of run durations (on / off), ITL P99 off and on (ms), and
    the samples taken. Raises ValueError for tokens < 2 (no ITL) or a run beyond the harness's limits
    (before any request), RuntimeError if any request failed."""
    if tokens < 2:
        raise ValueError(f"tokens must be >= 2 (ITL needs two tokens per request), got {tokens}")
    if polling_pairs < 0:
        raise ValueError(f"polling_pairs must be >= 0, got {polling_pairs}")
    HarnessConfig(num_requests=max(16, waves * concurrency), concurrency=concurrency)  # validates
    result = _one_run(url, concurrency, tokens=tokens, waves=waves, interval_s=0)
    itl_err = [x - itl_ms for r in result.records for x in r.metrics().itl_ms]
    ttft_err = [(r.metrics().ttft_ms or 0.0) - ttft_ms for r in result.records]
    row: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(result.records),
        "itl_error": summarize_samples(itl_err),
        "ttft_error": summarize_samples(ttft_err),
        "output_throughput": result.summary["output_throughput"],
    }
    if polling_pairs:
        ratios: list[float] = []
        p99_off: list[float] = []
        p99_on: list[float] = []
        samples: list[int] = []
        for _ in range(polling_pairs):
            off = _one_run(url, concurrency, tokens=tokens, waves=waves, interval_s=0)
            on = _one_run(url, concurrency, tokens=tokens, waves=waves, interval_s=polling_interval_s)
            ratios.append(on.duration_s / off.duration_s)
            p99_off.append(_p99_itl(off))
            p99_on.append(_p99_itl(on))
            samples.append(int(on.summary["server_metrics_samples"] or 0))
        row["polling"] = {
            "interval_s": polling_interval_s,
            "pairs": polling_pairs,
            "duration_ratio_on_off_median": statistics.median(ratios),
            "itl_p99_off_ms": statistics.median(p99_off),
            "itl_p99_on_ms": statistics.median(p99_on),
            "samples_per_run": samples,
        }
    return row


def _check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag of the first bad value."""
    concurrency: list[int] = args.concurrency
    for value in concurrency:
        if value < 1:
            raise ValueError(f"--concurrency must be >= 1, got {value}")
    checks = [
        ("--itl-ms", args.itl_ms, args.itl_ms >= 0 and math.isfinite(args.itl_ms), "a finite number >= 0"),
        (
            "--ttft-ms",
            args.ttft_ms,
            args.ttft_ms >= 0 and math.isfinite(args.ttft_ms),
            "a finite number >= 0",
        ),
        ("--tokens", args.tokens, args.tokens >= 2, ">= 2 (ITL needs two tokens per request)"),
        ("--waves", args.waves, args.waves >= 1, ">= 1"),
        (
            "--waves",
            args.waves,
            args.waves * max(concurrency, default=1) <= MAX_REQUESTS,
            f"at most {MAX_REQUESTS} requests per run (waves x concurrency)",
        ),
    ]
    for flag, value, ok, expected in checks:
        if not ok:
            raise ValueError(f"{flag} must be {expected}, got {value}")
    if args.json is not None:
        check_output_path(args.json, "--json")


def main(argv: list[str] | None = None) -> int:
    """Measure and print the overhead table; returns 0 (1 if a run had failures, 2 for bad flags)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="ITL error of the harness against a scripted local server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 64, 256],
        metavar="N",
        help="client in-flight limits to measure, one run each",
    )
    parser.add_argument("--itl-ms", type=float, default=10.0, help="scripted inter-token delay (ms)")
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="scripted time to first token (ms)")
    parser.add_argument("--tokens", type=int, default=50, help="tokens per request")
    parser.add_argument(
        "--waves",
        type=int,
        default=2,
        help="requests per concurrency slot: each run sends max(16, waves x concurrency) requests",
    )
    parser.add_argument("--json", default=None, help="also save the results as JSON here")
    args = parser.parse_args(argv)
    try:
        _check_args(args)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with scripted_server_process(args.ttft_ms, args.itl_ms, metrics_padding=55_000) as url:
        for concurrency in args.concurrency:
            try:
                rows.append(
                    measure_overhead(
                        url,
                        concurrency,
                        itl_ms=args.itl_ms,
                        ttft_ms=args.ttft_ms,
                        tokens=args.tokens,
                        waves=args.waves,
                    )
                )
            except RuntimeError as exc:
                print(f"{PROG}: error: {exc}", file=sys.stderr)
                return 1
    print(
        f"scripted ITL {args.itl_ms} ms, TTFT {args.ttft_ms} ms, {args.tokens} tokens/request; "
        "error = measured - scripted (ms)"
    )
    header = (
        f"{'concurrency':>11}{'requests':>9}{'ITL n':>8}{'ITL p50':>9}{'ITL p99':>9}"
        f"{'ITL mean':>9}{'ITL max':>9}{'TTFT p50':>9}{'TTFT p99':>9}{'tok/s':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        itl, ttft = row["itl_error"], row["ttft_error"]
        print(
            f"{row['concurrency']:>11}{row['requests']:>9}{int(itl['count']):>8}"
            f"{itl['p50_ms']:>9.3f}{itl['p99_ms']:>9.3f}{itl['mean_ms']:>9.3f}{itl['max_ms']:>9.3f}"
            f"{ttft['p50_ms']:>9.3f}{ttft['p99_ms']:>9.3f}{row['output_throughput']:>9.0f}"
        )
    for row in rows:
        polling = row.get("polling")
        if polling is not None:
            print(
                f"concurrency {row['concurrency']}: /metrics polling every {polling['interval_s']} s "
                f"(55 KB answers): duration on/off {polling['duration_ratio_on_off_median']:.3f}, "
                f"ITL p99 off {polling['itl_p99_off_ms']:.2f} ms, on {polling['itl_p99_on_ms']:.2f} ms, "
                f"samples {polling['samples_per_run']}"
            )
    if args.json:
        try:
            write_json_atomic(args.json, {"environment": capture_environment(), "rows": rows})
        except OSError as exc:
            print(f"{PROG}: error: could not write --json {args.json}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
