"""The report's section of one serving-harness run (per-request JSONL and its `.meta.json`).

The records' raw timestamps are summarized by the harness's own `harness.summary.summarize_run`, so the
report and the `harness` command state the same TTFT, ITL, TPOT, E2EL and goodput; reading and checking
the file is `jsonl.py`'s job. From the metadata the section takes the run's `label`, its goodput SLO
(`config.goodput`, recomputed against the records), the clock's `start_ns` / `end_ns` when the harness
recorded them (the duration of every throughput; else first arrival to last stream end) and the `server`
block the harness records for an engine server it started. Probe records (`probe: true`) stay out of
the table and get a sentence of their own. The lab's sections (scan, cache growth, views) are
`sections.py`; the intervals over a run's repeats are `repeats.py`.
"""

from __future__ import annotations

import typing
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from attention_kv_caceh.harness.metrics import GoodputSLO
from attention_kv_caceh.harness.probes import probe_summary
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.summary import METRIC_NAMES, summarize_run
from attention_kv_caceh.tables import markdown_table

__all__ = ["serving_section", "summarize_file"]


def _sampling_sentence(config: Mapping[str, Any], problems: list[str]) -> str:
    """What the run sent as sampling fields (`config.sampling`), as a sentence; "" for a run that does
    not record it (the simulated backend, an older file)."""
    sampling: Any = config.get("sampling")
    if sampling is None:
        return ""
    if not isinstance(sampling, dict):
        problems.append(f"'config.sampling' {sampling!r} is not an object: left out")
        return ""
    fields = typing.cast("dict[str, Any]", sampling)
    if not fields:
        return " Sampling: no field sent (the server's defaults)."
    return " Sampling sent: " + ", ".join(f"`{k}` {v}" for k, v in fields.items()) + "."


def _settings(meta: Mapping[str, Any] | None, problems: list[str]) -> tuple[str, GoodputSLO | None, Any, str]:
    """The label, the goodput SLO, the server block and the sampling sentence of a run's metadata; a
    malformed one is noted in `problems` and left out."""
    if meta is None:
        return "", None, None, ""
    config: Any = meta.get("config", {})
    if not isinstance(config, dict):
        problems.append("'config' is not an object: label and goodput left out")
        config = {}
    config = typing.cast("dict[str, Any]", config)
    label = config.get("label") or ""
    if not isinstance(label, str):
        problems.append(f"'config.label' {label!r} is not text: left out")
        label = ""
    slo: GoodputSLO | None = None
    goodput: Any = config.get("goodput") or {}
    try:
        items = typing.cast("dict[str, Any]", goodput).items()
        slo = GoodputSLO(**{f"{k}_ms": float(v) for k, v in items})
    except (AttributeError, TypeError, ValueError) as exc:
        problems.append(f"'config.goodput' {goodput!r} is not an SLO in ms ({exc}): goodput left out")
    server: Any = meta.get("server")
    if server is not None and not isinstance(server, dict):
        problems.append("'server' is not an object: left out")
        server = None
    sampling = _sampling_sentence(config, problems)
    return label, slo if slo is not None and not slo.empty else None, typing.cast("Any", server), sampling


def _server_table(server: Mapping[str, Any]) -> str:
    """The harness's `server` block (the engine server it started) as one table: part, field, value."""
    rows: list[list[object]] = []
    for part, value in server.items():
        if isinstance(value, dict):
            rows += [[part, k, v] for k, v in typing.cast("dict[str, object]", value).items()]
        else:
            rows.append([part, "", value])
    return "Server (as the harness recorded it):\n\n" + markdown_table(["part", "field", "value"], rows)


def _duration_s(records: Sequence[RequestRecord], meta: Mapping[str, Any] | None) -> float:
    """The run's duration: the clock's `start_ns` to `end_ns` of the metadata when both are integers
    in order, else the first arrival to the last stream end or finish (NaN when there is none)."""
    if meta is not None:
        start, end = meta.get("start_ns"), meta.get("end_ns")
        if isinstance(start, int) and isinstance(end, int) and not isinstance(start, bool) and end > start:
            return (end - start) / 1e9
    first = min(r.arrival_ns for r in records)
    ends = [t for r in records for t in (r.stream_end_ns, r.finish_ns) if t is not None]
    return (max(ends) - first) / 1e9 if ends and max(ends) > first else float("nan")


def summarize_file(
    records: Sequence[RequestRecord], meta: Mapping[str, Any] | None, slo: GoodputSLO | None = None
) -> dict[str, Any]:
    """`harness.summary.summarize_run` of a file's load records (probes left out) over its duration
    (`_duration_s`). Raises ValueError when it cannot summarize them."""
    load = [r for r in records if not r.probe]
    return summarize_run(load, _duration_s(load or records, meta), slo=slo)


def _probe_sentence(probes: Sequence[RequestRecord]) -> str:
    if not probes:
        return ""
    p = probe_summary(probes, 0.0)

    def ms(key: str) -> str:
        return "-" if p[key] is None else f"{p[key]:.3g} ms"

    return (
        f" Probes (one-token requests sent beside the load, not in the table): {p['probe_completed']} "
        f"completed, {p['probe_failed']} failed; TTFT P50 {ms('probe_median_ttft_ms')}, P99 "
        f"{ms('probe_p99_ttft_ms')}; E2EL P50 {ms('probe_median_e2el_ms')}, P99 {ms('probe_p99_e2el_ms')}."
    )


def serving_section(
    name: str,
    records: Sequence[RequestRecord],
    meta: Mapping[str, Any] | None = None,
    problems: list[str] | None = None,
) -> str:
    """The section of one serving-harness JSONL file (at least one record), summarized by
    `summarize_file` from the records' raw timestamps. When no request completed it says so, with the
    failure kinds, instead of a table of nothing. `meta`: the run's `.meta.json` (label, goodput SLO,
    clock, server block, the sampling fields sent); what is malformed in it is appended to `problems`.

    Raises ValueError when `summarize_run` cannot summarize the records.
    """
    label, slo, server, sampling = _settings(meta, problems if problems is not None else [])
    title = f"### Serving run: `{name}`" + (f" ({label})" if label else "") + "\n\n"
    load = [r for r in records if not r.probe]
    probes = [r for r in records if r.probe]
    if not any(r.ok for r in load):
        failures = Counter(r.status for r in load)
        return (
            f"{title}{len(load)} request(s), **none completed** (failures: "
            + ", ".join(f"{k}: {v}" for k, v in sorted(failures.items()))
            + "): there is no latency or throughput to report."
            + _probe_sentence(probes)
            + "\n"
        )
    summary = summarize_file(records, meta, slo)
    duration_s = summary["duration"]
    rows: list[list[object]] = []
    for metric, metric_label in METRIC_NAMES.items():
        count = summary.get(f"count_{metric}") or 0
        if count:
            row: list[object] = [metric_label, int(count)]
            row += [float(summary[f"{p}_{metric}_ms"]) for p in ("median", "p90", "p99", "mean", "max")]
            rows.append(row)
    failures = ", ".join(f"{k}: {v}" for k, v in summary["failures"].items()) or "none"
    goodput = ""
    if slo is not None:
        objectives = ", ".join(f"{k} <= {v:g} ms" for k, v in slo.as_dict().items())
        goodput = (
            f" Goodput: {summary['request_goodput']:.3g} requests/s ({summary['good_requests']} of "
            f"{summary['completed']} completed requests meet {objectives})."
        )
    return (
        f"{title}{summary['num_requests']} request(s), "
        f"{summary['completed']} completed, failures: {failures}; {summary['request_throughput']:.3g} "
        f"requests/s and {summary['output_throughput']:.3g} output tokens/s over {duration_s:.3g} s."
        f"{goodput}{sampling}{_probe_sentence(probes)} Latencies of completed requests only "
        "(`harness.summary.summarize_run`); ITL pools every gap.\n\n"
        + markdown_table(["metric", "n", "P50 ms", "P90 ms", "P99 ms", "mean ms", "max ms"], rows)
        + ("\n" + _server_table(server) if server else "")
    )
