"""The harness's own overhead: ITL error (measured - scripted) against a server with known delays.

Starts the scripted server (`scripted_server.py`) in a child process on 127.0.0.1, streaming one token
every `--itl-ms` (10 ms) on absolute deadlines, and runs the real HTTP path of the harness
(openai-completions backend, SSE parser, records) at each concurrency, with
`max(16, waves * concurrency)` requests (`--waves`, default 2). Reports P50/P99 (and mean, max)
of measured ITL - scripted ITL and of measured TTFT - scripted TTFT, in ms, via `summarize_samples`.
Client and server share this machine's cores, so the error includes the server's own lateness.

    uv run attention-kv-caceh overhead [--concurrency 1 64 256] [--json out.json]

(`python -m attention_kv_caceh.harness.overhead` still runs it.) The command line is `cli/overhead.py`;
this module measures and returns rows. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.run import HarnessConfig, run_harness
from attention_kv_caceh.timing import summarize_samples

__all__ = ["measure_overhead"]


def measure_overhead(
    url: str, concurrency: int, *, itl_ms: float, ttft_ms: float, tokens: int, waves: int
) -> dict[str, Any]:
    """Run `max(16, waves * concurrency)` requests of `tokens` tokens; return error statistics
    (ms) of ITL and TTFT against the script. Raises RuntimeError if any request failed."""
    config = HarnessConfig(
        backend="openai-completions",
        base_url=url,
        model="scripted",
        num_requests=max(16, waves * concurrency),
        concurrency=concurrency,
        output_len=LengthRange(tokens, tokens),
        server_metrics_interval_s=0,
        timeout_s=120,
    )
    result = asyncio.run(run_harness(config))
    if result.summary["failed"]:
        raise RuntimeError(f"concurrency {concurrency}: failures {result.summary['failures']}")
    itl_err = [x - itl_ms for r in result.records for x in r.metrics().itl_ms]
    ttft_err = [(r.metrics().ttft_ms or 0.0) - ttft_ms for r in result.records]
    return {
        "concurrency": concurrency,
        "requests": len(result.records),
        "itl_error": summarize_samples(itl_err),
        "ttft_error": summarize_samples(ttft_err),
        "output_throughput": result.summary["output_throughput"],
    }


if __name__ == "__main__":  # the old spelling of `attention-kv-caceh overhead`
    from sys import argv

    from attention_kv_caceh.cli import main

    raise SystemExit(main(["overhead", *argv[1:]]))
