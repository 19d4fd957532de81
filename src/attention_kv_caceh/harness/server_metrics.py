"""Poll the server's own queue during a run: Prometheus `/metrics` or the simulated server's gauges.

vLLM exposes `vllm:num_requests_running` (requests in the engine's batch), `vllm:num_requests_waiting`
(queued in the scheduler) and `vllm:kv_cache_usage_perc` (0..1; `vllm:gpu_cache_usage_perc` on older
versions). The text is parsed with prometheus_client's parser, summing over label sets (several engines
or models). Polling keeps going through errors (recorded, not raised) and stops at the run's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from time import perf_counter_ns

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from attention_kv_caceh.harness.backends import ServerSample

__all__ = ["BadServerValueError", "ServerMetricsPoller", "metrics_url", "parse_vllm_metrics"]

_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum each sample of a Prometheus exposition `text` over its labels: {sample name: value}.

    Raises ValueError when the text is not in the Prometheus text format.
    """
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def _first(totals: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in totals:
            return totals[name]
    return None


class BadServerValueError(ValueError):
    """A gauge that is not a finite number in its range (NaN, +-Inf, negative, KV usage > 1)."""


def _checked(name: str, value: float, upper: float = math.inf) -> float:
    if not (math.isfinite(value) and 0 <= value <= upper):
        raise BadServerValueError(f"{name} = {value!r}: not a finite number in [0, {upper:g}]")
    return value


def sample_from_metrics(text: str, time_ns: int) -> ServerSample | None:
    """A ServerSample from a `/metrics` text, or None when it lacks vLLM's request gauges.

    Raises BadServerValueError (a ValueError) for a gauge that is NaN, infinite, negative, or a KV-cache
    usage above 1: such a sample is recorded as a polling problem, never as a statistic.
    """
    totals = parse_vllm_metrics(text)
    running = _first(totals, _RUNNING)
    waiting = _first(totals, _WAITING)
    if running is None or waiting is None:
        return None
    kv = _first(totals, _KV_USAGE)
    return ServerSample(
        time_ns,
        _checked(_RUNNING[0], running),
        _checked(_WAITING[0], waiting),
        None if kv is None else _checked("kv_cache_usage_perc", kv, 1.0),
    )


def metrics_url(base_url: str) -> str:
    """`/metrics` at the server's root (a trailing `/v1` is dropped)."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"


class ServerMetricsPoller:
    """Every `interval_s`, take one ServerSample: from `snapshot()` or from GET `url` (Prometheus).

    Use `start()` then `await stop()`. `samples` holds the series; `errors` the first few failures;
    `unsupported` is set when the endpoint answered without vLLM's gauges (polling then stops).
    """

    def __init__(
        self,
        interval_s: float,
        *,
        session: aiohttp.ClientSession | None = None,
        url: str | None = None,
        snapshot: Callable[[], ServerSample] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"server metrics interval must be > 0 s, got {interval_s}")
        if (snapshot is None) == (url is None or session is None):
            raise ValueError("give either snapshot, or url and session")
        self.interval_s = interval_s
        self.session = session
        self.url = url
        self.snapshot = snapshot
        self.samples: list[ServerSample] = []
        self.errors: list[str] = []
        self.unsupported = False
        self._task: asyncio.Task[None] | None = None

    async def _poll_once(self) -> bool:
        if self.snapshot is not None:
            self.samples.append(self.snapshot())
            return True
        assert self.session is not None
        assert self.url is not None
        try:
            timeout = aiohttp.ClientTimeout(total=max(1.0, 10 * self.interval_s))
            async with self.session.get(self.url, timeout=timeout) as response:
                if response.status != 200:
                    self.errors.append(f"GET {self.url}: HTTP {response.status}")
                    self.unsupported = response.status == 404
                    return not self.unsupported
                text = await response.text()
            sample = sample_from_metrics(text, perf_counter_ns())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.errors.append(f"GET {self.url}: {type(exc).__name__}: {exc}")
            return len(self.errors) < 20
        if sample is None:
            self.unsupported = True
            self.errors.append(f"{self.url} has no vllm:num_requests_running/waiting")
            return False
        self.samples.append(sample)
        return True

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_time = loop.time()
        while await self._poll_once():
            next_time += self.interval_s
            await asyncio.sleep(max(0.0, next_time - loop.time()))

    def start(self) -> None:
        """Begin polling in a background task."""
        self._task = asyncio.create_task(self._loop(), name="server-metrics")

    async def stop(self) -> None:
        """Stop polling and wait for the task to end."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
