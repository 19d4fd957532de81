"""Lines of a harness summary about the server's counters and the workload: one line of the server's
prefix-cache, preemption and token counters over the run, the speculative-decoding acceptance over it,
and the per-turn table of a multi-turn run."""

from __future__ import annotations

from typing import Any

__all__ = ["counter_line", "per_turn_lines", "spec_decode_lines", "summary_extra_lines"]


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
    rows = summary.get("per_turn")
    if rows:
        lines += per_turn_lines(rows)
    return lines
