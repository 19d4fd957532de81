"""Poll the server's own queue during a run: Prometheus `/metrics` or the simulated server's gauges.

vLLM exposes `vllm:num_requests_running` (requests in the engine's batch), `vllm:num_requests_waiting`
(queued in the scheduler) and `vllm:kv_cache_usage_perc` (0..1; `vllm:gpu_cache_usage_perc` on older
versions). The text is parsed with prometheus_client's parser, summing over label sets (several engines
or models). Polling keeps going through errors (recorded, not raised) and stops at the run's end. It
runs in its own thread with its own HTTP client, never in the event loop that timestamps tokens, asks
only for the gauges it uses and parses only their lines (a server may ignore the filter: vLLM 0.32
does); a value that is not a finite count is a polling error, not a sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from time import perf_counter_ns

from prometheus_client.parser import text_string_to_metric_families

from attention_kv_caceh.harness.backends import ServerSample

__all__ = [
    "COST_BUDGET",
    "DEFAULT_INTERVAL_S",
    "BadServerValueError",
    "ServerMetricsPoller",
    "metrics_url",
    "parse_vllm_metrics",
]

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


_WANTED = frozenset((*_RUNNING, *_WAITING, *_KV_USAGE))


def _wanted_lines(text: str) -> str:
    """Only the lines (samples and their `# HELP`/`# TYPE`) of the gauges used. vLLM 0.32 ignores the
    `name[]=` filter and answers its whole exposition (54 KB, ~12 ms of prometheus_client parsing in
    this process, holding the GIL the event loop that timestamps tokens needs); the kept lines parse in
    well under 1 ms."""
    kept: list[str] = []
    for line in text.splitlines():
        body = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        name = body.split("{", 1)[0].split(" ", 1)[0]
        if name in _WANTED:
            kept.append(line)
    return "\n".join(kept) + "\n"


def sample_from_metrics(text: str, time_ns: int) -> ServerSample | None:
    """A ServerSample from a `/metrics` text, or None when it lacks vLLM's request gauges.

    Raises BadServerValueError (a ValueError) for a gauge that is NaN, infinite, negative, or a KV-cache
    usage above 1: such a sample is recorded as a polling problem, never as a statistic.
    """
    totals = parse_vllm_metrics(_wanted_lines(text))
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
    """`/metrics` at the server's root (a trailing `/v1` is dropped), asking only for the gauges used
    (`name[]=...`, which prometheus_client's own exposition honours; vLLM 0.32 ignores it)."""
    names = "&".join(f"name[]={n}" for n in (*_RUNNING, *_WAITING, *_KV_USAGE))
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics?" + names


# The polling's budget: the server spends at most this share of its time answering scrapes. A scrape's
# round trip on loopback bounds what the server spent on it, so the interval is stretched to at least
# round trip / COST_BUDGET. Measured on the 2-core development machine (prometheus_client 0.x): a
# vLLM-like unfiltered exposition of 27 KB takes 9.0 ms to generate (a 55 KB one about twice that),
# the 3 filtered gauges 0.05 ms; an HTTP round trip of a small answer from an aiohttp server on
# loopback 0.4 ms (median). So at the default 0.5 s a filtered scrape costs the server about 0.1 %;
# a server that ignores the filter (about 18 ms a scrape) is polled every ~1.8 s instead.
COST_BUDGET = 0.01
DEFAULT_INTERVAL_S = 0.5


class ServerMetricsPoller:
    """Every `interval_s` (or longer, see COST_BUDGET), take one ServerSample: from `snapshot()` (the
    simulated server, in the event loop: a few attribute reads) or from GET `url` (Prometheus).

    HTTP polling runs in its own thread with its own HTTP client (urllib), so neither the request nor
    the parse ever blocks the event loop that timestamps tokens. A sample's `time_ns` is the server-side
    time estimate: the midpoint between sending the GET and receiving the response headers
    (`perf_counter_ns`), not when the body was parsed. Use `start()` then `await stop()`. `samples`
    holds the series (`on_sample`, if given, is called from the thread with each); `errors` the first
    failures; `unsupported` is set when the endpoint answered
    without vLLM's gauges or with 404 (polling then stops); `achieved_interval_s` the mean gap.
    Raises ValueError for an interval <= 0 or for neither or both of `url` and `snapshot`.
    """

    def __init__(
        self,
        interval_s: float,
        *,
        url: str | None = None,
        snapshot: Callable[[], ServerSample] | None = None,
        headers: dict[str, str] | None = None,
        on_sample: Callable[[ServerSample], None] | None = None,
    ) -> None:
        if not (interval_s > 0 and math.isfinite(interval_s)):
            raise ValueError(f"server metrics interval must be a finite number > 0 s, got {interval_s}")
        if (snapshot is None) == (url is None):
            raise ValueError("give either snapshot or url")
        self.interval_s = interval_s
        self.url = url
        self.snapshot = snapshot
        self.headers = dict(headers or {})
        self.on_sample = on_sample
        self.samples: list[ServerSample] = []
        self.errors: list[str] = []
        self.unsupported = False
        self.round_trips_s: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # --- HTTP, in the polling thread -------------------------------------------------------------
    def poll_once(self) -> bool:
        """One HTTP scrape (blocking: the polling thread calls it); False when polling should stop."""
        assert self.url is not None
        timeout_s = min(10.0, max(1.0, 10 * self.interval_s))
        request = urllib.request.Request(self.url, headers=self.headers)
        sent = perf_counter_ns()
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                headers_at = perf_counter_ns()
                text = response.read().decode("utf-8", errors="replace")
            self.round_trips_s.append((headers_at - sent) / 1e9)
            sample = sample_from_metrics(text, (sent + headers_at) // 2)
        except urllib.error.HTTPError as exc:
            self.errors.append(f"GET {self.url}: HTTP {exc.code}")
            self.unsupported = exc.code == 404
            return not self.unsupported and len(self.errors) < 20
        except (OSError, ValueError) as exc:  # URLError, timeouts, resets; bad text or bad values
            self.errors.append(f"GET {self.url}: {type(exc).__name__}: {exc}")
            return len(self.errors) < 20
        if sample is None:
            self.unsupported = True
            self.errors.append(f"{self.url} has no vllm:num_requests_running/waiting")
            return False
        self.samples.append(sample)
        if self.on_sample is not None:
            self.on_sample(sample)
        return True

    def _interval_now(self) -> float:
        """The interval, stretched so that scrapes take at most COST_BUDGET of the server's time."""
        if not self.round_trips_s:
            return self.interval_s
        recent = sorted(self.round_trips_s[-5:])
        return max(self.interval_s, recent[len(recent) // 2] / COST_BUDGET)

    def _thread_main(self) -> None:
        next_time = time.monotonic()
        # a sample at the start, one per interval, and a last one begun after stop() was called
        while True:
            stopping = self._stop.is_set()  # read before the poll: a poll begun earlier is not the last
            if not self.poll_once() or stopping:
                return
            next_time += self._interval_now()
            delay = next_time - time.monotonic()
            if delay < 0:  # a slow scrape: start again from now, never a burst of catch-up scrapes
                next_time, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    # --- simulated, in the event loop ------------------------------------------------------------
    async def _snapshot_loop(self) -> None:
        assert self.snapshot is not None
        loop = asyncio.get_running_loop()
        next_time = loop.time()
        while True:
            self.samples.append(self.snapshot())
            next_time += self.interval_s
            await asyncio.sleep(max(0.0, next_time - loop.time()))

    def start(self) -> None:
        """Begin polling (a thread for HTTP, a task for a snapshot; call from the event loop)."""
        self._stop.clear()
        if self.snapshot is not None:
            self._task = asyncio.create_task(self._snapshot_loop(), name="server-metrics")
        else:
            self._thread = threading.Thread(target=self._thread_main, name="server-metrics", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        """Stop polling and wait for it to end (the thread is joined off the event loop)."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def achieved_interval_s(self) -> float | None:
        """Mean time between consecutive samples (s); None with fewer than 2 samples."""
        if len(self.samples) < 2:
            return None
        return (self.samples[-1].time_ns - self.samples[0].time_ns) / (len(self.samples) - 1) / 1e9
