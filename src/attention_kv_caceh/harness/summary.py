"""A run's summary: statistics of every metric over successful requests, throughput, goodput.

Statistics come from the project's one function, `timing.summarize_samples`; this module only maps its
keys to the names of vLLM's `bench serve` result file where the meaning is the same (`mean_ttft_ms`,
`median_ttft_ms`, `std_ttft_ms`, `p99_itl_ms`, ...; vLLM's std is the population std, as ours).
As in vLLM, latencies are over successful requests only, ITL is pooled over all of their gaps, and TPOT
over requests with a defined TPOT. Metrics with no sample are None (null), never 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from attention_kv_caceh.harness.metrics import GoodputSLO, RequestMetrics
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.timing import summarize_samples

__all__ = ["METRIC_NAMES", "STAT_KEYS", "stats_with_vllm_names", "summarize_run"]

# metric name in keys -> what it is (for the table)
METRIC_NAMES = {
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


def summarize_run(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    slo: GoodputSLO | None = None,
    peak_in_flight: int | None = None,
) -> dict[str, Any]:
    """The summary dict (vLLM key names where the meaning matches) of finished `records`.

    `duration_s` is the benchmark's wall time (first arrival to last stream end), the denominator of
    every throughput (requests/s, tokens/s). Raises ValueError for a non-positive duration.
    """
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    ok = [r for r in records if r.ok]
    failures = Counter(r.status for r in records if not r.ok)
    metrics = [r.metrics() for r in ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration": duration_s,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": sum(failures.values()),
        "failures": dict(sorted(failures.items())),
        # ok streams that ended with a finish_reason and a clean close but no `data: [DONE]`
        "num_without_done_marker": sum(1 for r in ok if r.done_marker is False),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "max_concurrent_requests": peak_in_flight,
    }
    if slo is not None and not slo.empty:
        good = sum(1 for m in metrics if slo.is_good(m))
        summary["goodput_slo_ms"] = slo.as_dict()
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration_s
    else:
        summary["request_goodput"] = None
    for name, samples in _metric_samples(metrics).items():
        summary.update(stats_with_vllm_names(name, samples))
    return summary
