"""Load generation: request specs, arrival times, and the client's concurrency semaphore.

Arrivals follow vLLM's `bench serve`: with an infinite rate every request arrives at once; otherwise the
gaps between arrivals are gamma-distributed with shape `burstiness` and mean `1 / request_rate`
(burstiness 1 is a Poisson process; lower is burstier, higher more regular). Each request task waits
for its arrival, then for a slot of the `asyncio.Semaphore(concurrency)`: the semaphore bounds how many
requests the *client* has in flight, not how many the server batches. Each task returns its own
RequestRecord.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter_ns

import numpy as np

from attention_kv_caceh.harness.backends import Backend, RequestSpec
from attention_kv_caceh.harness.client_errors import UNREACHABLE_KINDS
from attention_kv_caceh.harness.records import RequestRecord

__all__ = [
    "SYNTHETIC_WORDS",
    "InFlightTracker",
    "LengthRange",
    "SmokeTestError",
    "arrival_offsets_s",
    "make_request_specs",
    "run_requests",
    "smoke_test",
    "unreachable_message",
]

# Single words (each one word to a word-counting server); a tokenizer turns them into exact prompts.
# Every synthetic prompt (random, shared-prefix, multi-turn, trace blocks) is made of these.
SYNTHETIC_WORDS = ("the", "cache", "holds", "keys", "and", "values", "of", "every", "token", "far")
_WORDS = SYNTHETIC_WORDS


@dataclass(frozen=True)
class LengthRange:
    """A token length, fixed (`low == high`) or drawn uniformly from [low, high] (inclusive)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"length range needs 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """Parse "N" or "LOW:HIGH". Raises ValueError naming the text for bad input."""
        low_text, sep, high_text = text.partition(":")
        try:
            low = int(low_text)
            high = int(high_text) if sep else low
        except ValueError:
            raise ValueError(f"expected N or LOW:HIGH (integers), got {text!r}") from None
        if low < 1 or high < low:
            raise ValueError(f"length range needs 1 <= LOW <= HIGH, got {text!r}")
        return cls(low, high)

    @classmethod
    def of(cls, value: LengthRange | str) -> LengthRange:
        """`value` itself, or parsed from its text (`parse`)."""
        return value if isinstance(value, LengthRange) else cls.parse(value)

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        """`n` lengths, all `low` when fixed."""
        if self.low == self.high:
            return [self.low] * n
        return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def make_request_specs(
    num_requests: int,
    prompt_len: LengthRange,
    output_len: LengthRange,
    rng: np.random.Generator,
    *,
    first_id: int = 0,
) -> list[RequestSpec]:
    """`num_requests` specs with lengths drawn from the ranges and a synthetic prompt of about
    `prompt_tokens` words (the exact count comes back from the server's usage where it reports it)."""
    prompts = prompt_len.draw(rng, num_requests)
    outputs = output_len.draw(rng, num_requests)
    specs: list[RequestSpec] = []
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        words = [_WORDS[int(k)] for k in rng.integers(0, len(_WORDS), size=p)]
        specs.append(RequestSpec(first_id + i, p, o, " ".join(words)))
    return specs


def arrival_offsets_s(
    num_requests: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Arrival times in seconds after the start; the first request arrives at 0.

    Infinite `request_rate`: all 0. Otherwise cumulative gamma gaps with shape `burstiness` and scale
    `1 / (request_rate * burstiness)` (mean gap `1 / request_rate`), as vLLM's `get_request`.
    Raises ValueError for a non-positive rate or burstiness, or a schedule too long to express in ns.
    """
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    theta = 1.0 / (request_rate * burstiness)
    if not math.isfinite(theta):
        raise ValueError(f"request rate {request_rate} x burstiness {burstiness} is too small for a schedule")
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)
    offsets: list[float] = [0.0, *np.cumsum(gaps).tolist()]
    if not math.isfinite(offsets[-1]) or offsets[-1] * 1e9 > 2**62:
        raise ValueError(
            f"request rate {request_rate}: the arrivals would span {offsets[-1]:.3g} s, too long"
        )
    return offsets


class InFlightTracker:
    """The client's in-flight count (requests between `sent` and the end of their stream) over time."""

    def __init__(self) -> None:
        self.count = 0
        self.peak = 0
        self.samples: list[tuple[int, int]] = []  # (time_ns, in-flight after the change)

    def enter(self) -> None:
        """A request acquired its slot."""
        self.count += 1
        self.peak = max(self.peak, self.count)
        self.samples.append((perf_counter_ns(), self.count))

    def exit(self) -> None:
        """A request's stream ended."""
        self.count -= 1
        self.samples.append((perf_counter_ns(), self.count))


async def _one_request(
    backend: Backend,
    spec: RequestSpec,
    arrival_ns: int,
    gate: asyncio.Semaphore,
    tracker: InFlightTracker,
) -> RequestRecord:
    delay_s = (arrival_ns - perf_counter_ns()) / 1e9
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    record = RequestRecord(spec.request_id, arrival_ns, spec.prompt_tokens)
    record.requested_output_tokens = spec.output_tokens
    record.dispatch_ns = perf_counter_ns()
    async with gate:
        record.sent_ns = perf_counter_ns()
        tracker.enter()
        try:
            await backend.generate(spec, record)
        finally:
            tracker.exit()
    return record


async def run_requests(
    backend: Backend,
    specs: Sequence[RequestSpec],
    offsets_s: Sequence[float],
    concurrency: int,
    *,
    tracker: InFlightTracker | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    start_ns: int | None = None,
) -> list[RequestRecord]:
    """Run every spec, arriving at `start_ns + offsets_s[i]`, at most `concurrency` in flight.

    `on_record` is called with each record as its request finishes (to write it at once); the records
    are also returned in request order. If cancelled (Ctrl-C), unfinished requests are cancelled and
    `on_record` has already seen every finished one. Raises ValueError for concurrency < 1 or
    mismatched lengths.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if len(specs) != len(offsets_s):
        raise ValueError(f"{len(specs)} specs but {len(offsets_s)} arrival offsets")
    gate = asyncio.Semaphore(concurrency)
    tracker = tracker if tracker is not None else InFlightTracker()
    start = perf_counter_ns() if start_ns is None else start_ns
    tasks = [
        asyncio.create_task(
            _one_request(backend, spec, start + round(offset * 1e9), gate, tracker),
            name=f"request-{spec.request_id}",
        )
        for spec, offset in zip(specs, offsets_s, strict=True)
    ]
    if on_record is not None:
        callback = on_record

        def _done(task: asyncio.Task[RequestRecord]) -> None:
            if not task.cancelled() and task.exception() is None:
                callback(task.result())

        for task in tasks:
            task.add_done_callback(_done)
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


class SmokeTestError(RuntimeError):
    """The one-request smoke test before a run failed; the message says why."""


def unreachable_message(target: str, detail: str) -> str:
    """The one wording of "no connection to the server" (smoke test, model discovery)."""
    return f"the server at {target} could not be reached ({detail}) - is the server running?"


async def smoke_test(backend: Backend, spec: RequestSpec, target: str) -> RequestRecord:
    """Send one request and fail fast if it does not stream tokens successfully.

    Raises SmokeTestError with the failure kind, HTTP status and error text, naming `target`.
    """
    record = RequestRecord(spec.request_id, perf_counter_ns(), spec.prompt_tokens)
    record.requested_output_tokens = spec.output_tokens
    record.sent_ns = record.arrival_ns
    await backend.generate(spec, record)
    if not record.ok:
        if record.status in UNREACHABLE_KINDS:
            raise SmokeTestError(
                f"smoke test failed: {record.status}: {unreachable_message(target, record.error or '')}"
            )
        status = f" (HTTP {record.http_status})" if record.http_status is not None else ""
        raise SmokeTestError(f"smoke test against {target} failed: {record.status}{status}: {record.error}")
    return record
