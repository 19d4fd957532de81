"""The `overhead` command's table: the harness's own ITL and TTFT error against the scripted server
(rows of `harness.overhead.measure_overhead`, milliseconds)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_overhead", "overhead_heading"]


def overhead_heading(itl_ms: float, ttft_ms: float, tokens: int) -> str:
    """The line above the table: the script the server followed."""
    return (
        f"scripted ITL {itl_ms} ms, TTFT {ttft_ms} ms, {tokens} tokens/request; "
        "error = measured - scripted (ms)"
    )


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
