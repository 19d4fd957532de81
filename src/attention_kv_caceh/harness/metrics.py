"""Per-request latency metrics, each defined once, from `perf_counter_ns` timestamps of one process.

Definitions (times in nanoseconds in, milliseconds out):

- client lateness = dispatch - arrival: how late the client's loop started a request after its
  scheduled arrival (0 for a punctual client; an overloaded client loop shows up here, not as queue);
- client queue time = sent - dispatch (time spent waiting for the client's concurrency semaphore);
- TTFT = first token - sent, as vLLM's `bench serve` defines it (`ttft`); TTFT from arrival = first
  token - arrival (queue included);
- ITL = gaps between consecutive token-bearing events (vLLM's `itl` list);
- TPOT = (finish - first token) / (output tokens - tokens in the first event), vLLM's `tpot` generalised
  to a first event carrying several tokens; undefined (None, never 0) when the denominator is 0 or
  every event arrived in the same read (finish = first token);
- E2EL = finish - sent, vLLM's `e2el` (its `latency`); E2E = finish - arrival, what the user waited
  from the scheduled arrival (client lateness and queue included).

`finish` is the last token-bearing event, so a trailing usage-only chunk or `[DONE]` never moves it, and
for every successful request E2EL = TTFT + sum(ITL) holds exactly in nanoseconds.
Goodput follows vLLM's `--goodput`: a request is good when every given SLO (TTFT, TPOT, E2EL, in ms) is
met; an undefined TPOT (one-token response) cannot violate the TPOT SLO.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from attention_kv_caceh.options import ConfigError

__all__ = [
    "NS_PER_MS",
    "GoodputSLO",
    "RequestMetrics",
    "compute_request_metrics",
    "parse_goodput",
]

NS_PER_MS = 1_000_000


def _ms(delta_ns: int) -> float:
    return delta_ns / NS_PER_MS


@dataclass(frozen=True)
class RequestMetrics:
    """Derived latencies of one request in milliseconds; None where the metric is undefined."""

    lateness_ms: float | None
    queue_ms: float | None
    ttft_ms: float | None
    ttft_from_arrival_ms: float | None
    itl_ms: tuple[float, ...]
    tpot_ms: float | None
    e2el_ms: float | None
    e2e_ms: float | None


def compute_request_metrics(
    *,
    arrival_ns: int,
    sent_ns: int | None,
    first_token_ns: int | None,
    token_times_ns: Sequence[int],
    tokens_per_event: Sequence[int],
    finish_ns: int | None,
    output_tokens: int,
    dispatch_ns: int | None = None,
) -> RequestMetrics:
    """Derive queue, TTFT, ITL, TPOT, E2EL and E2E (ms) from one request's timestamps (ns).

    Definitions and sources are in the module docstring. Without `dispatch_ns` (not recorded), lateness
    is None and queue time is counted from the arrival. A metric whose timestamps are missing (a request
    that never got a slot, or never got a token) is None; a one-token (one-event) response has an empty
    ITL list and TPOT None. Raises ValueError when `token_times_ns` and `tokens_per_event` differ in
    length or token times go backwards.
    """
    if len(token_times_ns) != len(tokens_per_event):
        raise ValueError(
            f"token_times_ns has {len(token_times_ns)} events but tokens_per_event has "
            f"{len(tokens_per_event)}"
        )
    if any(b < a for a, b in itertools.pairwise(token_times_ns)):
        raise ValueError("token_times_ns must be non-decreasing")
    lateness = _ms(dispatch_ns - arrival_ns) if dispatch_ns is not None else None
    queue_from = dispatch_ns if dispatch_ns is not None else arrival_ns
    queue = _ms(sent_ns - queue_from) if sent_ns is not None else None
    ttft = _ms(first_token_ns - sent_ns) if first_token_ns is not None and sent_ns is not None else None
    ttft_arrival = _ms(first_token_ns - arrival_ns) if first_token_ns is not None else None
    itl = tuple(_ms(b - a) for a, b in itertools.pairwise(token_times_ns))
    tpot: float | None = None
    if first_token_ns is not None and finish_ns is not None and tokens_per_event:
        decode_tokens = output_tokens - tokens_per_event[0]
        # finish == first token: every event came in one read, so no decode time was observed; a
        # TPOT of exactly 0 for a multi-token response would be a measurement artefact, not a speed.
        if decode_tokens > 0 and finish_ns > first_token_ns:
            tpot = _ms(finish_ns - first_token_ns) / decode_tokens
    e2el = _ms(finish_ns - sent_ns) if finish_ns is not None and sent_ns is not None else None
    e2e = _ms(finish_ns - arrival_ns) if finish_ns is not None else None
    return RequestMetrics(
        lateness_ms=lateness,
        queue_ms=queue,
        ttft_ms=ttft,
        ttft_from_arrival_ms=ttft_arrival,
        itl_ms=itl,
        tpot_ms=tpot,
        e2el_ms=e2el,
        e2e_ms=e2e,
    )


@dataclass(frozen=True)
class GoodputSLO:
    """Service-level objectives in milliseconds (vLLM `bench serve --goodput ttft:MS tpot:MS e2el:MS`).

    A None objective is not checked. Raises ConfigError for a non-positive objective.
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            value: float | None = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(name, f"must be > 0 ms, got {value}")

    @classmethod
    def of(cls, value: GoodputSLO | Sequence[str]) -> GoodputSLO:
        """`value` itself, or parsed from its items (`parse_goodput`)."""
        return value if isinstance(value, GoodputSLO) else parse_goodput(value)

    @property
    def empty(self) -> bool:
        """True when no objective is set (goodput is then not reported)."""
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def is_good(self, metrics: RequestMetrics) -> bool:
        """True when a successful request meets every set objective (undefined TPOT passes)."""
        if self.ttft_ms is not None and (metrics.ttft_ms is None or metrics.ttft_ms > self.ttft_ms):
            return False
        if self.tpot_ms is not None and metrics.tpot_ms is not None and metrics.tpot_ms > self.tpot_ms:
            return False
        return self.e2el_ms is None or (metrics.e2el_ms is not None and metrics.e2el_ms <= self.e2el_ms)

    def as_dict(self) -> dict[str, float]:
        """The set objectives as vLLM names them (`ttft`, `tpot`, `e2el`) in ms."""
        pairs = (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
        return {name: value for name, value in pairs if value is not None}


def parse_goodput(items: Sequence[str]) -> GoodputSLO:
    """Parse `["ttft:500", "tpot:50", "e2el:2000"]` (ms) into a GoodputSLO.

    Raises ValueError naming the offending item ("item 'ttft:x': ...") for an unknown metric, a repeated
    metric, a missing colon or a value that is not a positive number.
    """
    values: dict[str, float] = {}
    for item in items:
        name, sep, raw = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"item {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        if name in values:
            raise ValueError(f"item {item!r}: {name} given twice")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"item {item!r}: {raw!r} is not a number of ms") from None
        if not value > 0 or value == float("inf"):
            raise ValueError(f"item {item!r}: the objective must be a positive finite ms")
        values[name] = value
    return GoodputSLO(ttft_ms=values.get("ttft"), tpot_ms=values.get("tpot"), e2el_ms=values.get("e2el"))
