"""Probe requests: one-token requests sent beside the load, to measure what the load does to an
unrelated user (vLLM's `bench serve --probe-request-rate`).

A probe is a prompt of one token asking for one output token. Probes bypass the client's concurrency
limit and go one at a time: probe k is due `k / rate` s after the load starts, and starts then, or when
the probe before it ends if that is later (the slots it overran are skipped), so a stalled server gets
one probe, not a pile of them. Their records carry `probe: true` and stay out of the load's statistics;
the summary gives their own TTFT and E2EL (`probe_summary`, vLLM's `probe_` key names). They stop when
the load's last request has finished (a probe then in flight is awaited and kept).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from time import perf_counter_ns
from typing import Any

from attention_kv_caceh.harness.backends import Backend, RequestSpec
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.summary import stats_with_vllm_names

__all__ = ["PROBE_ID_BASE", "probe_spec", "probe_summary", "run_probes"]

PROBE_ID_BASE = -3 * 10**6  # probe k has request id PROBE_ID_BASE - k (warm-ups start at -1 - 10**6)


def probe_spec() -> RequestSpec:
    """The probe's request: a one-token prompt (made exact by a tokenizer), one output token."""
    return RequestSpec(PROBE_ID_BASE, 1, 1, "hello", probe=True)


async def run_probes(
    backend: Backend,
    template: RequestSpec,
    rate: float,
    start_ns: int,
    stop: asyncio.Event,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Send probes (module docstring) at `rate` per second from `start_ns` until `stop` is set; each
    finished record goes to `on_record` and into the returned list. Raises ValueError for a rate that
    is not a finite number > 0."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"probe rate must be a finite number > 0, got {rate}")
    interval_ns = max(1, round(1e9 / rate))
    records: list[RequestRecord] = []
    k = 0
    while not stop.is_set():
        due = start_ns + k * interval_ns
        wait_s = (due - perf_counter_ns()) / 1e9
        if wait_s > 0:
            try:
                await asyncio.wait_for(stop.wait(), wait_s)
                break  # the load ended before this probe was due
            except TimeoutError:
                pass
        spec = replace(template, request_id=PROBE_ID_BASE - k)
        record = RequestRecord(spec.request_id, due, spec.prompt_tokens, probe=True)
        record.requested_output_tokens = spec.output_tokens
        record.dispatch_ns = record.sent_ns = perf_counter_ns()
        await backend.generate(spec, record)
        records.append(record)
        if on_record is not None:
            on_record(record)
        k = max(k + 1, -(-(perf_counter_ns() - start_ns) // interval_ns))  # skip the slots overrun
    return records


def probe_summary(records: Sequence[RequestRecord], rate: float) -> dict[str, Any]:
    """`probe_rate`, `probe_completed`, `probe_failed` and the statistics of the successful probes'
    TTFT and E2EL with vLLM's names prefixed `probe_` (`probe_median_ttft_ms`, `probe_p99_e2el_ms`)."""
    ok = [r for r in records if r.ok]
    metrics = [r.metrics() for r in ok]
    out: dict[str, Any] = {
        "probe_rate": rate,
        "probe_completed": len(ok),
        "probe_failed": len(records) - len(ok),
    }
    for metric, values in (
        ("ttft", [m.ttft_ms for m in metrics if m.ttft_ms is not None]),
        ("e2el", [m.e2el_ms for m in metrics if m.e2el_ms is not None]),
    ):
        out |= {f"probe_{key}": value for key, value in stats_with_vllm_names(metric, values).items()}
    return out
