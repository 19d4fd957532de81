"""The report's section of one serving-harness run (per-request JSONL).

The records' raw timestamps are summarized by the harness's own `harness.summary.summarize_run`, so the
report and the `harness` command state the same TTFT, ITL, TPOT and E2EL; reading and checking the
file is `jsonl.py`'s job. The lab's sections (scan, cache growth, views) are `sections.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.summary import METRIC_NAMES, summarize_run
from attention_kv_caceh.tables import markdown_table

__all__ = ["serving_section"]


def serving_section(name: str, records: Sequence[RequestRecord]) -> str:
    """The section of one serving-harness JSONL file, summarized by `harness.summary.summarize_run`
    from the records' raw timestamps (at least one record; the duration runs from the first arrival
    to the last stream end or finish). When no request completed it says so, with the failure kinds,
    instead of a table of nothing.

    Raises ValueError when `summarize_run` cannot summarize the records.
    """
    if not any(r.ok for r in records):
        failures = Counter(r.status for r in records)
        return (
            f"### Serving run: `{name}`\n\n{len(records)} request(s), **none completed** (failures: "
            + ", ".join(f"{k}: {v}" for k, v in sorted(failures.items()))
            + "): there is no latency or throughput to report.\n"
        )
    start = min(r.arrival_ns for r in records)
    ends = [t for r in records for t in (r.stream_end_ns, r.finish_ns) if t is not None]
    duration_s = (max(ends) - start) / 1e9 if ends and max(ends) > start else float("nan")
    summary = summarize_run(records, duration_s)
    rows: list[list[object]] = []
    for metric, label in METRIC_NAMES.items():
        count = summary.get(f"count_{metric}") or 0
        if count:
            row: list[object] = [label, int(count)]
            row += [float(summary[f"{p}_{metric}_ms"]) for p in ("median", "p90", "p99", "mean", "max")]
            rows.append(row)
    failures = ", ".join(f"{k}: {v}" for k, v in summary["failures"].items()) or "none"
    return (
        f"### Serving run: `{name}`\n\n{summary['num_requests']} request(s), "
        f"{summary['completed']} completed, failures: {failures}; {summary['request_throughput']:.3g} "
        f"requests/s and {summary['output_throughput']:.3g} output tokens/s over {duration_s:.3g} s. "
        "Latencies of completed requests only (`harness.summary.summarize_run`); ITL pools every gap.\n\n"
        + markdown_table(["metric", "n", "P50 ms", "P90 ms", "P99 ms", "mean ms", "max ms"], rows)
    )
