"""The harness's own overhead: ITL error (measured - scripted) against a server with known delays.

Starts the scripted server (`scripted_server.py`) in a child process on 127.0.0.1, streaming one token
every `--itl-ms` (10 ms) on absolute deadlines, and runs the real HTTP path of the harness
(openai-completions backend, SSE parser, records) at each concurrency, with
`max(16, waves * concurrency)` requests (`--waves`, default 2). Reports P50/P99 (and mean, max)
of measured ITL - scripted ITL and of measured TTFT - scripted TTFT, in ms, via `summarize_samples`.
Client and server share this machine's cores, so the error includes the server's own lateness.

    uv run attention-kv-caceh overhead [--concurrency 1 64 256] [--json out.json]

The command line is `cli/overhead.py`; this module measures and returns rows. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.run import HarnessConfig, RunResult, run_harness
from attention_kv_caceh.harness.server_metrics import DEFAULT_INTERVAL_S
from attention_kv_caceh.timing import summarize_samples

__all__ = ["measure_overhead"]


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
