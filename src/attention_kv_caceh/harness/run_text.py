"""The lines `harness` and `sweep` print around a run's summary (`summary_text.format_summary`): the setup
line, the failed requests, the engine's own step record, a repeat's line and the repeats' intervals, a
sweep point's line, the sweep's table and the SLO search's tries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from attention_kv_caceh.harness.config import HarnessConfig
from attention_kv_caceh.harness.records import RequestRecord

__all__ = [
    "failure_line",
    "format_engine_steps",
    "format_intervals",
    "format_sweep_table",
    "one_line",
    "point_line",
    "repeat_line",
    "setup_line",
    "slo_lines",
]


def one_line(text: object, limit: int = 300) -> str:
    """`text` on one line (whitespace runs collapsed), cut to `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def setup_line(backend: str, config: HarnessConfig, repeats: int) -> str:
    """`harness: backend=...`: what the run is about to do (`backend` as given, engine included)."""
    simulated = config.backend == "simulated"
    words = f"harness: backend={backend} " + (f"base_url={config.base_url} " if not simulated else "")
    if simulated:
        words += (
            f"server_slots={config.server_slots} prefill_ms={config.prefill_ms} "
            f"per_token_ms={config.per_token_ms} "
        )
    words += f"num_requests={config.num_requests} concurrency={config.concurrency} " + (
        f"request_rate={config.request_rate} prompt_len={config.prompt_len} output_len={config.output_len}"
        if config.trace is None
        else "(arrivals and lengths from the trace)"
    )
    words += "".join(f" {k}={v}" for k, v in config.sampling.body_fields().items())
    if config.trace is not None:
        t = config.trace
        words += (
            f" trace={t.path} ({t.format}, {t.tokens_per_hash} tokens per hash id, speedup {t.speedup:g})"
        )
    if config.probe_rate > 0:
        words += f" probe_rate={config.probe_rate:g}"
    if config.workers > 1:
        words += f" workers={config.workers}"
    return words + (f" repeats={repeats}" if repeats > 1 else "")


def failure_line(records: Sequence[RequestRecord]) -> str | None:
    """One line on the failed requests (how many, and the first one's status and error); None if none."""
    failed = sorted((r for r in records if not r.ok), key=lambda r: r.request_id)
    if not failed:
        return None
    first = failed[0]
    http = f" (HTTP {first.http_status})" if first.http_status is not None else ""
    return (
        f"{len(failed)} of {len(records)} requests failed; first: request {first.request_id}: "
        f"{first.status}{http}: {one_line(first.error)}"
    )


def format_engine_steps(server: Mapping[str, Any]) -> str:
    """One line of the engine's own step record (exact, unlike the /metrics samples above it)."""
    steps: dict[str, Any] = server["engine_steps"]
    if "error" in steps:
        return f"engine steps: not read ({steps['error']})"

    def ms(key: str) -> str:
        value = steps.get(key)
        return "-" if value is None else f"{value:.2f} ms"

    return (
        f"engine steps: {steps['num_steps']}   max running: {steps['max_num_running']}   "
        f"max waiting: {steps['max_num_waiting']}   preemptions: {steps['num_preemptions']}   "
        f"step time P50: {ms('median_step_time_ms')}   decode step P50: {ms('median_decode_step_time_ms')}"
        f" (CPU {ms('median_decode_step_cpu_time_ms')})"
    )


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}"


def _ms(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(float(value), spec)


def repeat_line(index: int, summary: Mapping[str, Any]) -> str:
    """`repeat I: ...`: one repeat's counts, throughputs and TTFT / TPOT percentiles."""

    def ms(key: str) -> str:
        return _ms(summary.get(key), ".2f")

    return (
        f"repeat {index}: {summary['completed']} ok {summary['failed']} failed   requests/s "
        f"{summary['request_throughput']:.2f}   output tokens/s {summary['output_throughput']:.1f}   "
        f"TTFT p50/p99 {ms('median_ttft_ms')}/{ms('p99_ttft_ms')} ms   "
        f"TPOT p50/p99 {ms('median_tpot_ms')}/{ms('p99_tpot_ms')} ms"
    )


def format_intervals(intervals: Mapping[str, Mapping[str, Any]]) -> str:
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


def point_line(name: str, row: Mapping[str, Any]) -> str:
    """`sweep: NAME: ...`: one sweep run's row."""
    rate = row["prefix_cache_hit_rate"]
    good = row["good_fraction"]
    return (
        f"sweep: {name}: {row['completed']} ok {row['failed']} failed   output tokens/s "
        f"{row['output_throughput']:.1f}   TTFT p50/p99 {_ms(row['median_ttft_ms'])}/{_ms(row['p99_ttft_ms'])} ms"
        f"   TPOT p50/p99 {_ms(row['median_tpot_ms'])}/{_ms(row['p99_tpot_ms'])} ms"
        + (f"   good {100 * good:.1f} %" if good is not None else "")
        + (f"   prefix-cache hit rate {100 * rate:.1f} %" if rate is not None else "")
        + f"   cache reset: {row['prefix_cache_reset']}"
    )


def format_sweep_table(rows: Sequence[Mapping[str, Any]], axis: str) -> str:
    """The sweep's table: one line per run."""
    head = "concurrency" if axis == "concurrency" else "rate (req/s)"
    header = (
        f"{head:>12}{'repeat':>7}{'ok':>6}{'req/s':>8}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}{'hit rate':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        rate = r["prefix_cache_hit_rate"]
        lines.append(
            f"{r['value']:>12g}{r['repeat']:>7}{r['completed']:>6}{r['request_throughput']:>8.2f}"
            f"{r['output_throughput']:>10.1f}{_ms(r['median_ttft_ms']):>10}{_ms(r['p99_ttft_ms']):>10}"
            f"{_ms(r['median_tpot_ms']):>10}{_ms(r['p99_tpot_ms']):>10}"
            f"{'-' if rate is None else f'{100 * rate:.1f}%':>9}"
        )
    return "\n".join(lines)


def slo_lines(
    objectives: Sequence[str],
    pass_fraction: float,
    tries: Sequence[tuple[float, float, bool]],
    best: float | None,
    lowest_failing: float | None,
) -> list[str]:
    """The SLO search's report: every try (rate, good fraction, passed) and the verdict."""
    lines = [f"SLO search ({' '.join(objectives)}, pass: >= {100 * pass_fraction:.0f} % of requests good):"]
    for i, (rate, fraction, passed) in enumerate(tries):
        lines.append(
            f"  try {i}: rate {rate:.4g} req/s: {100 * fraction:.1f} % good: {'pass' if passed else 'fail'}"
        )
    if best is None:
        lowest = min(rate for rate, _, _ in tries)
        lines.append(f"SLO search: no rate passed in {len(tries)} runs (lowest tried {lowest:.4g} req/s)")
        return lines
    lines.append(
        f"SLO search: highest passing rate {best:.4g} req/s"
        + (
            f" (lowest failing {lowest_failing:.4g} req/s)"
            if lowest_failing is not None
            else " (no failing rate found: raise --max-runs or the start)"
        )
        + f", {len(tries)} runs"
    )
    return lines
