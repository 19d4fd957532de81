"""A run's summary: statistics of every metric over successful requests, throughput, goodput.

Statistics come from the project's one function, `timing.summarize_samples`; this module only maps its
keys to the names of vLLM's `bench serve` result file where the meaning is the same (`mean_ttft_ms`,
`median_ttft_ms`, `std_ttft_ms`, `p99_itl_ms`, ...; vLLM's std is the population std, as ours).
As in vLLM, latencies are over successful requests only, ITL is pooled over all of their gaps, and TPOT
over requests with a defined TPOT. Metrics with no sample are None (null), never 0.

`max_concurrent_requests` and `max_output_tokens_per_s` have vLLM's meaning: the run (from the first
successful request's send to the last one's finish) is cut into one-second buckets; a request is active
in every bucket from its send to its finish, and each token event adds its tokens to its bucket; the
maxima over buckets are reported. The client's own peak of in-flight requests is `max_client_in_flight`.
`warnings` lists what makes the run's numbers doubtful: client lateness P99 above LATENESS_WARN_MS,
prompts off their requested length, requests that got more output tokens than their `max_tokens`
(`num_over_requested_output`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from attention_kv_caceh.harness.metrics import GoodputSLO, RequestMetrics
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.timing import summarize_samples

__all__ = [
    "LATENESS_WARN_MS",
    "METRIC_NAMES",
    "PROMPT_OFF_WARN_PCT",
    "SLOWER_RATE",
    "SLOWER_TRACE",
    "STAT_KEYS",
    "second_bucket_peaks",
    "stats_with_vllm_names",
    "summarize_run",
]

PROMPT_OFF_WARN_PCT = 2.0  # actual prompt tokens this far from the requested ones get a warning
LATENESS_WARN_MS = 1.0  # a client loop this late (P99) is no longer measuring the server alone

# metric name in keys -> what it is (for the table)
METRIC_NAMES = {
    "lateness": "client lateness",
    "queue": "client queue time",
    "ttft": "TTFT (first token - sent)",
    "ttft_from_arrival": "TTFT from arrival",
    "itl": "ITL",
    "tpot": "TPOT",
    "e2el": "E2EL (finish - sent)",
    "e2e": "E2E (finish - arrival)",
}

# summarize_samples key -> vLLM prefix
STAT_KEYS = {
    "mean_ms": "mean",
    "median": "median",
    "stdev_ms": "std",
    "min_ms": "min",
    "p90_ms": "p90",
    "p95_ms": "p95",
    "p99_ms": "p99",
    "max_ms": "max",
}


def stats_with_vllm_names(metric: str, samples_ms: Sequence[float]) -> dict[str, float | None]:
    """`summarize_samples(samples_ms)` renamed as vLLM names them: `mean_{metric}_ms`,
    `median_{metric}_ms` (= P50), `std_{metric}_ms`, `p90_..`, `p95_..`, `p99_..`, plus `min_`, `max_`
    and `count_{metric}`. All None when there is no sample."""
    if not samples_ms:
        out: dict[str, float | None] = {f"count_{metric}": 0}
        out.update({f"{prefix}_{metric}_ms": None for prefix in STAT_KEYS.values()})
        return out
    stats = summarize_samples(samples_ms)
    out = {f"count_{metric}": int(stats["count"])}
    for key, prefix in STAT_KEYS.items():
        source = "p50_ms" if key == "median" else key
        out[f"{prefix}_{metric}_ms"] = stats[source]
    return out


def _metric_samples(metrics: Sequence[RequestMetrics]) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in METRIC_NAMES}
    for m in metrics:
        for name, value in (
            ("lateness", m.lateness_ms),
            ("queue", m.queue_ms),
            ("ttft", m.ttft_ms),
            ("ttft_from_arrival", m.ttft_from_arrival_ms),
            ("tpot", m.tpot_ms),
            ("e2el", m.e2el_ms),
            ("e2e", m.e2e_ms),
        ):
            if value is not None:
                samples[name].append(value)
        samples["itl"].extend(m.itl_ms)
    return samples


def second_bucket_peaks(records: Sequence[RequestRecord]) -> tuple[int, float]:
    """(max_concurrent_requests, max_output_tokens_per_s) of the successful `records` in vLLM's
    meaning (module docstring); (0, 0.0) without a successful request."""
    done = [r for r in records if r.ok and r.sent_ns is not None and r.finish_ns is not None]
    if not done:
        return 0, 0.0
    t0 = min(r.sent_ns for r in done if r.sent_ns is not None)
    end = max(r.finish_ns for r in done if r.finish_ns is not None)
    buckets = (end - t0) // 1_000_000_000 + 1
    active = [0] * buckets
    tokens = [0] * buckets
    for r in done:
        assert r.sent_ns is not None and r.finish_ns is not None
        for second in range((r.sent_ns - t0) // 10**9, (r.finish_ns - t0) // 10**9 + 1):
            active[second] += 1
        for time_ns, n in zip(r.token_times_ns, r.tokens_per_event, strict=True):
            tokens[(time_ns - t0) // 10**9] += n
    return max(active), float(max(tokens))


# How the lateness warning says to slow the arrivals: the flag that sets them in this kind of run.
SLOWER_RATE = "lower --request-rate"
SLOWER_TRACE = "replay the trace slower (--trace-speedup below its current value; below 1 stretches its gaps)"


def _lateness_warning(records: Sequence[RequestRecord], lateness_p99: float, slower: str) -> str:
    """What a client lateness P99 above LATENESS_WARN_MS means for this run: at a burst (every request
    arriving at once, `--request-rate inf`) one client loop starts the requests one after another, so
    lateness is the time it took to start them all; at a finite rate the client fell behind the
    schedule."""
    head = f"client lateness P99 is {lateness_p99:.2f} ms (> {LATENESS_WARN_MS:g} ms)"
    dispatched = [r.dispatch_ns for r in records if r.dispatch_ns is not None]
    if len(records) > 1 and len({r.arrival_ns for r in records}) == 1 and len(dispatched) > 1:
        spread_ms = (max(dispatched) - min(dispatched)) / 1e6
        return (
            f"{head}: all {len(records)} requests arrived at once (--request-rate inf) and the client's "
            f"one event loop started them one after another, the last {spread_ms:.1f} ms after the first "
            f"({spread_ms / (len(dispatched) - 1):.3f} ms each); TTFT and E2EL count from each request's "
            "send and leave this out, TTFT from arrival and E2E include it"
        )
    return (
        f"{head}: the client started requests later than their scheduled arrivals, so the load was "
        f"lighter than asked; {slower}, or run the client on a less busy machine"
    )


def summarize_run(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    slo: GoodputSLO | None = None,
    peak_in_flight: int | None = None,
    slower: str = SLOWER_RATE,
) -> dict[str, Any]:
    """The summary dict (vLLM key names where the meaning matches) of finished `records`.

    `duration_s` is the benchmark's wall time (first arrival to last stream end), the denominator of
    every throughput (requests/s, tokens/s). `slower` is the lateness warning's advice on slowing the
    arrivals (SLOWER_RATE, or SLOWER_TRACE for a trace replay). Raises ValueError for a non-positive
    duration.
    """
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    ok = [r for r in records if r.ok]
    failures = Counter(r.status for r in records if not r.ok)
    metrics = [r.metrics() for r in ok]
    input_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else (r.requested_prompt_tokens or 0) for r in ok
    )
    known = [r for r in ok if r.prompt_tokens is not None and r.requested_prompt_tokens is not None]
    requested = sum(r.requested_prompt_tokens or 0 for r in known)
    actual = sum(r.prompt_tokens or 0 for r in known)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration": duration_s,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": sum(failures.values()),
        "failures": dict(sorted(failures.items())),
        # ok streams that ended with a finish_reason and a clean close but no `data: [DONE]`
        "num_without_done_marker": sum(1 for r in ok if r.done_marker is False),
        # sent once more on a fresh connection after a reused one failed before any response byte
        "num_retried_fresh_connection": sum(1 for r in records if r.retried_fresh_connection),
        "total_input_tokens": input_tokens,
        # over successful requests whose actual prompt length is known
        "total_requested_prompt_tokens": requested if known else None,
        "total_actual_prompt_tokens": actual if known else None,
        "prompt_tokens_off_pct": (actual - requested) / requested * 100 if known and requested else None,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "max_client_in_flight": peak_in_flight,
    }
    summary["max_concurrent_requests"], summary["max_output_tokens_per_s"] = second_bucket_peaks(records)
    if slo is not None and not slo.empty:
        good = sum(1 for m in metrics if slo.is_good(m))
        summary["goodput_slo_ms"] = slo.as_dict()
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration_s
    else:
        summary["request_goodput"] = None
    for name, samples in _metric_samples(metrics).items():
        summary.update(stats_with_vllm_names(name, samples))
    warnings: list[str] = []
    lateness_p99 = summary["p99_lateness_ms"]
    if lateness_p99 is not None and lateness_p99 > LATENESS_WARN_MS:
        warnings.append(_lateness_warning(records, lateness_p99, slower))
    off = summary["prompt_tokens_off_pct"]
    if off is not None and abs(off) > PROMPT_OFF_WARN_PCT:
        warnings.append(
            f"prompts had {actual} tokens where {requested} were requested ({off:+.1f} %, more than "
            f"{PROMPT_OFF_WARN_PCT:g} % off)"
        )
    over = [
        r for r in ok if r.requested_output_tokens is not None and r.output_tokens > r.requested_output_tokens
    ]
    summary["num_over_requested_output"] = len(over)
    if over:
        worst = max(over, key=lambda r: r.output_tokens - (r.requested_output_tokens or 0))
        warnings.append(
            f"{len(over)} of {len(ok)} successful requests got more output tokens than asked for (request "
            f"{worst.request_id}: {worst.output_tokens} for max_tokens {worst.requested_output_tokens}): "
            "the server did not honour max_tokens, so throughput, TPOT and E2EL are of longer outputs "
            "than the run asked for"
        )
    summary["warnings"] = warnings
    return summary
