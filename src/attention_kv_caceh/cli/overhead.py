"""`attention-kv-caceh overhead`: the harness's own ITL and TTFT error against the scripted server.

Starts `harness/scripted_server.py` in a child process on 127.0.0.1 (one token every `--itl-ms` on
absolute deadlines), runs `harness.overhead.measure_overhead` at each `--concurrency`, and prints P50/P99
(mean, max) of measured minus scripted ITL and TTFT in ms. Bad flags exit 2 before the server starts; a
failed request exits 1.
"""

from __future__ import annotations

import argparse
from typing import Any

from attention_kv_caceh.cli.common import (
    CommandFailed,
    UsageError,
    check_outputs,
    nonnegative_float,
    output_file,
    positive_int,
)

__all__ = ["HELP", "add_arguments", "run"]

HELP = "the harness's own overhead: ITL and TTFT error against a scripted local server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `overhead`: the concurrencies, the script (ITL, TTFT, tokens), waves, --json."""
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="+",
        default=[1, 64, 256],
        metavar="N",
        help="client in-flight limits to measure, one run each",
    )
    parser.add_argument(
        "--itl-ms", type=nonnegative_float, default=10.0, help="scripted inter-token delay (ms)"
    )
    parser.add_argument(
        "--ttft-ms", type=nonnegative_float, default=20.0, help="scripted time to first token (ms)"
    )
    parser.add_argument(
        "--tokens", type=_at_least_two, default=50, help="tokens per request (>= 2: ITL needs two tokens)"
    )
    parser.add_argument(
        "--waves",
        type=positive_int,
        default=2,
        help="requests per concurrency slot: each run sends max(16, waves x concurrency) requests",
    )
    parser.add_argument(
        "--json",
        type=output_file(".json"),
        default=None,
        metavar="PATH",
        help="also save the results as JSON here (default: not written)",
    )


def _at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (ITL needs two tokens per request), got {value}")
    return value


def format_overhead(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table of `measure_overhead` rows (ms)."""
    header = (
        f"{'concurrency':>11}{'requests':>9}{'ITL n':>8}{'ITL p50':>9}{'ITL p99':>9}"
        f"{'ITL mean':>9}{'ITL max':>9}{'TTFT p50':>9}{'TTFT p99':>9}{'tok/s':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        itl, ttft = row["itl_error"], row["ttft_error"]
        lines.append(
            f"{row['concurrency']:>11}{row['requests']:>9}{int(itl['count']):>8}"
            f"{itl['p50_ms']:>9.3f}{itl['p99_ms']:>9.3f}{itl['mean_ms']:>9.3f}{itl['max_ms']:>9.3f}"
            f"{ttft['p50_ms']:>9.3f}{ttft['p99_ms']:>9.3f}{row['output_throughput']:>9.0f}"
        )
    for row in rows:
        polling = row.get("polling")
        if polling is not None:
            lines.append(
                f"concurrency {row['concurrency']}: /metrics polling every {polling['interval_s']} s "
                f"(55 KB answers): duration on/off {polling['duration_ratio_on_off_median']:.3f}, "
                f"ITL p99 off {polling['itl_p99_off_ms']:.2f} ms, on {polling['itl_p99_on_ms']:.2f} ms, "
                f"samples {polling['samples_per_run']}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Measure and print the overhead table; raises UsageError for an unwritable --json (before the
    server starts), CommandFailed when a request failed or --json could not be written."""
    check_outputs([("--json", args.json, (".json",))])
    from attention_kv_caceh.harness.config import MAX_REQUESTS

    if args.waves * max(args.concurrency) > MAX_REQUESTS:
        raise UsageError(
            f"--waves {args.waves}: at most {MAX_REQUESTS} requests per run (waves x concurrency)"
        )

    from attention_kv_caceh.files import write_json_atomic
    from attention_kv_caceh.harness.overhead import measure_overhead
    from attention_kv_caceh.harness.scripted_server import scripted_server_process
    from attention_kv_caceh.timing import capture_environment

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
                raise CommandFailed(str(exc)) from None
    print(
        f"scripted ITL {args.itl_ms} ms, TTFT {args.ttft_ms} ms, {args.tokens} tokens/request; "
        "error = measured - scripted (ms)"
    )
    print(format_overhead(rows))
    if args.json:
        try:
            write_json_atomic(args.json, {"environment": capture_environment(), "rows": rows})
        except OSError as exc:
            raise CommandFailed(f"could not write --json {args.json}: {exc}") from None
    return 0
