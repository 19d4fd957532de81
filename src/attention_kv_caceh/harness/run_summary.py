"""A run's summary dict: the latency statistics of `summary.summarize_run` and what the run knows
beside them (prompt lengths, the server's peaks and counters, the workload's implied hits, probes, the
client's own CPU, a trace's ideal prefix-hit rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from attention_kv_caceh.harness.backends import RequestSpec, SimulatedServer
from attention_kv_caceh.harness.client_cpu import CpuSpan, client_cpu_summary, client_cpu_warning
from attention_kv_caceh.harness.config import MIN_SERVER_SAMPLES, HarnessConfig
from attention_kv_caceh.harness.planning import prompt_lengths
from attention_kv_caceh.harness.prefix_ideal import compare_prefix_hits, ideal_prefix_hits
from attention_kv_caceh.harness.probes import probe_summary
from attention_kv_caceh.harness.prompts import PromptTokenizer
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.server_counters import (
    CounterSnapshot,
    RunCounters,
    counter_warnings,
    spec_decode_result,
)
from attention_kv_caceh.harness.server_metrics import ServerMetricsPoller
from attention_kv_caceh.harness.summary import SLOWER_RATE, SLOWER_TRACE, summarize_run
from attention_kv_caceh.harness.workloads import implied_prefix_hits, per_turn_summary

__all__ = ["LoadOutcome", "run_summary", "trace_prefix_summary"]


@dataclass
class LoadOutcome:
    """The measured load: its records (request order) and probes, the clock's start and end (ns), the
    client's in-flight series and peak, each worker's CpuSpan, and the coordinating parent's when the
    load ran in worker processes."""

    records: list[RequestRecord]
    probes: list[RequestRecord]
    start_ns: int
    end_ns: int
    in_flight: list[tuple[int, int]]
    peak: int
    cpu: list[CpuSpan]
    parent_cpu: CpuSpan | None


def _as_count(value: float | None) -> int | float | None:
    """A request count read as a float (Prometheus) as an int when it is whole (printed as `5`)."""
    return int(value) if value is not None and float(value).is_integer() else value


def trace_prefix_summary(
    config: HarnessConfig,
    specs: Sequence[RequestSpec],
    probes: Sequence[RequestRecord],
    counters: dict[str, Any] | None,
    server_block_size: int | None,
) -> dict[str, Any]:
    """The trace's ideal prefix hits (`prefix_ideal.ideal_prefix_hits` over the measured specs, at the
    server's block size when known, else the trace's) beside the server's measured ones. The probes'
    prompt tokens are queried too (they are shorter than a block, so they never hit)."""
    assert config.trace is not None
    chunk = config.trace.tokens_per_hash
    block = server_block_size or chunk
    source = "the server's /metrics" if server_block_size else "the trace's tokens per hash id"
    hits, queries = ideal_prefix_hits([(s.hash_ids, s.prompt_tokens) for s in specs], chunk, block)
    queries += sum(r.prompt_tokens or 0 for r in probes if r.http_status == 200 or r.ok)
    return compare_prefix_hits(
        hits, queries, counters, num_requests=len(specs), block_size=block, block_size_source=source
    )


def run_summary(
    config: HarnessConfig,
    outcome: LoadOutcome,
    *,
    specs: Sequence[RequestSpec],
    model: str | None,
    tokenizer: PromptTokenizer | None,
    counters: RunCounters,
    rounds: Sequence[tuple[int, CounterSnapshot | None, CounterSnapshot | None]],
    poller: ServerMetricsPoller | None,
    simulated: SimulatedServer | None,
    block_size: int | None,
) -> dict[str, Any]:
    """The summary of one run (module docstring); `warnings` lists what makes its numbers doubtful."""
    records = outcome.records
    duration_s = (outcome.end_ns - outcome.start_ns) / 1e9
    summary: dict[str, Any] = {
        "label": config.label,
        "model_id": model,
        "tokenizer_id": tokenizer.name if tokenizer is not None else None,
        "prompt_lengths": None,  # set below, from the records
    }
    slower = SLOWER_RATE if config.trace is None else SLOWER_TRACE
    summary |= summarize_run(
        records, duration_s, slo=config.goodput, peak_in_flight=outcome.peak, slower=slower
    )
    lengths, why = (
        # a multi-turn prompt is the whole history plus --prompt-len words: no token length was asked for
        ("not requested", None)
        if config.workload.kind == "multi-turn"
        else ("exact", None)
        if simulated is not None
        else prompt_lengths(config, tokenizer, records, summary["prompt_tokens_off_pct"])
    )
    summary["prompt_lengths"] = lengths
    if why is not None:
        summary["warnings"].insert(0, why)
    server_samples = poller.samples if poller is not None else []
    server_exact = list(simulated.samples) if simulated is not None else []
    peaks_from = server_exact or server_samples
    summary["server_metrics_source"] = (
        "simulated (exact)" if server_exact else ("prometheus" if server_samples else None)
    )
    too_few = poller is not None and not server_exact and len(server_samples) < MIN_SERVER_SAMPLES
    if too_few:  # a peak of a few samples is a guess (often 0 at idle moments): none is reported
        peaks_from = []
    summary["peak_server_running"] = _as_count(max((s.running for s in peaks_from), default=None))
    summary["peak_server_waiting"] = _as_count(max((s.waiting for s in peaks_from), default=None))
    summary["workload"] = config.workload.describe()
    summary["server_counters"] = counters.delta([*records, *outcome.probes])
    summary |= spec_decode_result(summary["server_counters"])
    summary["server_counters_error"] = counters.error or None
    if config.workload.kind == "multi-turn":
        summary["per_turn"] = per_turn_summary(records, rounds)
    if summary["server_counters"] is not None:
        summary["warnings"] += counter_warnings(summary["server_counters"])
    if config.workload.kind == "shared-prefix":
        summary["implied_prefix_hit_tokens"] = implied_prefix_hits(config.workload, len(records), 1)
    if config.trace is not None:
        summary["trace"] = config.trace.describe()
        summary["trace_prefix"] = trace_prefix_summary(
            config, specs, outcome.probes, summary["server_counters"], block_size
        )
    if config.probe_rate > 0:
        summary |= probe_summary(outcome.probes, config.probe_rate)
    summary["client_cpu"] = client_cpu_summary(outcome.cpu, outcome.parent_cpu, duration_s)
    busy = client_cpu_warning(summary["client_cpu"], duration_s, can_split=config.backend != "simulated")
    if busy is not None:
        summary["warnings"].append(busy)
    summary["server_metrics_samples"] = len(server_samples) if poller is not None else None
    summary["server_metrics_interval_achieved_s"] = poller.achieved_interval_s if poller else None
    if too_few:
        summary["warnings"].append(
            f"only {len(server_samples)} server metrics samples (< {MIN_SERVER_SAMPLES}): too few for the "
            "server's peaks, which are not reported; use a longer run or a shorter --server-metrics-interval"
        )
    return summary
