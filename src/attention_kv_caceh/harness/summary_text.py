"""The text of a harness summary, as `harness` prints it: the fixed-width table of the latency metrics
(`format_summary`) with the throughput and server lines above it, and the lines about the server's
counters and the workload below it: one line of the server's prefix-cache, preemption and token counters
over the run, the speculative-decoding acceptance over it, the per-turn table of a multi-turn run, a
trace's ideal prefix-hit rate beside the measured one, the probes' latencies, and the client's own CPU."""

from __future__ import annotations

from typing import Any

from attention_kv_caceh.harness.summary import METRIC_NAMES

__all__ = [
    "client_cpu_line",
    "counter_line",
    "format_summary",
    "per_turn_lines",
    "probe_line",
    "spec_decode_lines",
    "summary_extra_lines",
    "trace_line",
]

_VERDICTS = {
    "equal": "equal within one block a request",
    "below": (
        "BELOW the ideal by more than one block a request: the server's cache did not keep blocks the trace "
        "reuses (a KV pool too small evicts them), or requests sharing blocks ran at the same time"
    ),
    "above": (
        "ABOVE the ideal by more than one block a request: blocks were hit twice (preempted requests "
        "re-admitted?) or the server's blocks are not the trace's"
    ),
    "not measured": "the server's counters could not be read",
}


def _num(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def counter_line(summary: dict[str, Any]) -> str | None:
    """`server counters: ...` from `summary["server_counters"]`; a line saying why when they could not
    be read; None for a run without them (the simulated backend)."""
    delta: dict[str, Any] | None = summary.get("server_counters")
    if delta is None:
        why = summary.get("server_counters_error")
        return f"server counters: not read ({why})" if why else None
    rate = delta["prefix_cache_hit_rate"]
    finished = ", ".join(f"{k} {v}" for k, v in delta["finished_requests"].items()) or "-"
    return (
        f"server counters: prefix cache hits {_num(delta['prefix_cache_hits'])} of "
        f"{_num(delta['prefix_cache_queries'])} tokens queried "
        f"(hit rate {'-' if rate is None else f'{100 * rate:.1f} %'})   preemptions: {_num(delta['preemptions'])}   "
        f"prompt tokens: {_num(delta['prompt_tokens'])} (client {delta['client_prompt_tokens']})   "
        f"generation tokens: {_num(delta['generation_tokens'])} (client {delta['client_output_tokens']})   "
        f"finished: {finished}"
    )


def spec_decode_lines(summary: dict[str, Any]) -> list[str]:
    """The "Speculative Decoding" block of `vllm bench serve`, from the summary's spec_decode_* keys;
    [] for a run that drafted nothing (or a server without speculative decoding)."""
    if "spec_decode_num_drafts" not in summary:
        return []
    per_pos = ", ".join(f"{100 * r:.1f}" for r in summary["spec_decode_per_position_acceptance_rates"])
    return [
        f"speculative decoding: acceptance rate {summary['spec_decode_acceptance_rate']:.2f} %   "
        f"acceptance length {summary['spec_decode_acceptance_length']:.2f}   "
        f"drafts {summary['spec_decode_num_drafts']}   draft tokens {summary['spec_decode_draft_tokens']}   "
        f"accepted tokens {summary['spec_decode_accepted_tokens']}   per position (%): {per_pos}"
    ]


def per_turn_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The per-turn table of a multi-turn run (TTFT in ms, the server's hit rate over each round)."""
    header = f"{'turn':>4}{'requests':>9}{'prompt':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'hit rate':>10}"
    lines = [header, "-" * len(header)]
    for row in rows:
        rate = row.get("prefix_cache_hit_rate")
        lines.append(
            f"{row['turn']:>4}{row['completed']:>9}{_num(row['mean_prompt_tokens'], '.1f'):>9}"
            f"{_num(row['median_ttft_ms'], '.2f'):>10}{_num(row['p99_ttft_ms'], '.2f'):>10}"
            f"{'-' if rate is None else f'{100 * rate:.1f} %':>10}"
        )
    return lines


def _pct(rate: Any) -> str:
    return "-" if rate is None else f"{100 * rate:.1f} %"


def trace_line(summary: dict[str, Any]) -> str | None:
    """The trace's ideal prefix-cache hits beside the server's, their difference and what it means."""
    p: dict[str, Any] | None = summary.get("trace_prefix")
    if p is None:
        return None
    verdict = _VERDICTS[p["verdict"]]
    if p["verdict"] == "not measured" and not summary.get("server_counters_error"):
        verdict = "the server has no prefix cache counters (the simulated backend keeps none)"
    diff = p["difference_tokens"]
    rate_diff = p["difference_rate"]
    difference = (
        ""
        if diff is None
        else f"; difference {diff:+d} tokens"
        + (f" ({100 * rate_diff:+.1f} points)" if rate_diff is not None else "")
        + f", tolerance {p['tolerance_tokens']}"
    )
    measured = (
        "not measured"
        if p["measured_hit_tokens"] is None
        else f"measured {p['measured_hit_tokens']} of {_num(p['measured_query_tokens'])} "
        f"({_pct(p['measured_hit_rate'])})"
    )
    return (
        f"trace prefix cache: ideal hits {p['ideal_hit_tokens']} of {p['ideal_query_tokens']} tokens "
        f"({_pct(p['ideal_hit_rate'])}, unbounded cache in arrival order, block size {p['block_size']} from "
        f"{p['block_size_source']}); {measured}{difference}: {verdict}"
    )


def probe_line(summary: dict[str, Any]) -> str | None:
    """The probes' count and their TTFT and E2EL (ms), apart from the load's."""
    if "probe_completed" not in summary:
        return None
    return (
        f"probes (1 token in, 1 out, {summary['probe_rate']:g}/s beside the load): "
        f"{summary['probe_completed']} ok, {summary['probe_failed']} failed   TTFT p50/p99 "
        f"{_num(summary['probe_median_ttft_ms'], '.2f')}/{_num(summary['probe_p99_ttft_ms'], '.2f')} ms   "
        f"E2EL p50/p99 {_num(summary['probe_median_e2el_ms'], '.2f')}/"
        f"{_num(summary['probe_p99_e2el_ms'], '.2f')} ms"
    )


def client_cpu_line(summary: dict[str, Any]) -> str | None:
    """The client's own CPU per token event and per request over the load."""
    cpu: dict[str, Any] | None = summary.get("client_cpu")
    if cpu is None:
        return None
    return (
        f"client CPU: {_num(cpu['per_token_event_us'], '.1f')} µs per token event, "
        f"{_num(cpu['per_request_us'], '.0f')} µs per request ({cpu['process_cpu_s']:.3f} s over "
        f"{cpu['workers']} process(es){' and the coordinator' if cpu['coordinator_cpu_s'] is not None else ''}; "
        f"busiest event loop {_pct(cpu['loop_busy_fraction'])} of the load)"
    )


def summary_extra_lines(summary: dict[str, Any]) -> list[str]:
    """The counter line and, for a multi-turn run, the per-turn table (prompt: mean tokens a request)."""
    lines: list[str] = []
    line = counter_line(summary)
    if line is not None:
        lines.append(line)
    lines += spec_decode_lines(summary)
    implied = summary.get("implied_prefix_hit_tokens")
    delta = summary.get("server_counters")
    if implied is not None:
        queries = delta["prefix_cache_queries"] if delta else None
        share = f" = {100 * implied / queries:.1f} % of the server's queries" if queries else ""
        lines.append(
            f"shared-prefix workload implies {implied} hit tokens (every request after its group's first "
            f"reuses the whole prefix){share}; a server finds whole blocks only, so up to one block a "
            "request fewer"
        )
    lines += [x for x in (trace_line(summary), probe_line(summary), client_cpu_line(summary)) if x]
    rows = summary.get("per_turn")
    if rows:
        lines += per_turn_lines(rows)
    return lines


def _fmt(value: Any, width: int = 9) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, int):
        return f"{value:>{width}d}"
    return f"{float(value):>{width}.2f}"


def _server_peaks(summary: dict[str, Any]) -> str:
    """The server's peaks, or why there are none (not polled, or too few /metrics samples)."""
    samples = summary.get("server_metrics_samples")
    running, waiting = summary.get("peak_server_running"), summary.get("peak_server_waiting")
    if running is None and waiting is None and samples is not None:
        return f"peak server running/waiting: not reported (only {samples} /metrics samples: too few)"
    return (
        f"peak server running: {_fmt(running, 0)}   peak server waiting: {_fmt(waiting, 0)}   "
        f"(server: {summary.get('server_metrics_source') or 'not polled'})"
    )


def _retried(summary: dict[str, Any]) -> str:
    """ ", retried on a fresh connection: N" when any request was (`OpenAIBackend.generate`)."""
    n = summary.get("num_retried_fresh_connection") or 0
    return f", retried on a fresh connection: {n}" if n else ""


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width text table (ms), with throughput and server lines above it and
    `summary_extra_lines` below it."""
    lines = [
        f"requests: {summary['completed']} ok, {summary['failed']} failed "
        f"{summary['failures'] or ''}".rstrip()
        + _retried(summary),
        f"duration: {summary['duration']:.3f} s   requests/s: {summary['request_throughput']:.2f}"
        f"   output tokens/s: {summary['output_throughput']:.1f}"
        f"   total tokens/s: {summary['total_token_throughput']:.1f}",
        f"peak client in-flight: {_fmt(summary['max_client_in_flight'], 0)}   " + _server_peaks(summary),
    ]
    if summary.get("request_goodput") is not None:
        lines.append(
            f"goodput: {summary['request_goodput']:.2f} req/s "
            f"({summary['good_requests']} of {summary['completed']} meet {summary['goodput_slo_ms']})"
        )
    lines += [f"warning: {w}" for w in summary.get("warnings", [])]
    header = f"{'metric (ms)':<26}{'count':>7}" + "".join(
        f"{h:>9}" for h in ("mean", "p50", "p90", "p95", "p99", "min", "max", "stdev")
    )
    lines += [header, "-" * len(header)]
    for metric, label in METRIC_NAMES.items():
        cells = [
            summary[f"{prefix}_{metric}_ms"]
            for prefix in ("mean", "median", "p90", "p95", "p99", "min", "max", "std")
        ]
        lines.append(f"{label:<26}{summary[f'count_{metric}']:>7d}" + "".join(_fmt(c) for c in cells))
    return "\n".join(lines + summary_extra_lines(summary))
