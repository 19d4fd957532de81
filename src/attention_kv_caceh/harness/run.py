"""One harness run: smoke test, warm-up, the measured load (with probes beside it, in one process or
several), server polling, and the summary.

`run_harness` prints nothing: it returns a RunResult (records, summary, client in-flight and server
series) and hands each finished record to `on_record` as it finishes, so the caller can write it at
once and keep it if the run is interrupted. What is sent is planned in `planning.py`; the summary's
parts beyond the latency statistics are assembled in `run_summary.py`.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from time import perf_counter_ns
from typing import Any

import aiohttp
import numpy as np

from attention_kv_caceh.harness.backends import (
    Backend,
    OpenAIBackend,
    RequestSpec,
    ServerSample,
    SimulatedBackend,
    SimulatedServer,
    load_session,
)
from attention_kv_caceh.harness.client_cpu import CpuClock, CpuSpan
from attention_kv_caceh.harness.config import (
    BACKENDS,
    MAX_REQUESTS,
    MAX_SCHEDULE_S,
    MAX_TOKENS,
    MIN_SERVER_SAMPLES,
    BackendName,
    HarnessConfig,
)
from attention_kv_caceh.harness.discovery import (
    ContextLengthError,
    ModelDiscoveryError,
    context_problem,
    dataset_context_problem,
    discover_model,
    served_context,
)
from attention_kv_caceh.harness.load import InFlightTracker, run_requests, smoke_test
from attention_kv_caceh.harness.planning import exact_specs, plan_requests
from attention_kv_caceh.harness.prefix_ideal import read_server_block_size
from attention_kv_caceh.harness.probes import probe_spec, run_probes
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run_summary import LoadOutcome, run_summary
from attention_kv_caceh.harness.server_counters import CounterSnapshot, RunCounters
from attention_kv_caceh.harness.server_metrics import ServerMetricsPoller, metrics_url
from attention_kv_caceh.harness.workers import WorkerPlan, run_worker_load, split_load
from attention_kv_caceh.harness.workloads import Conversation, TaggingBackend, plan_conversations, run_rounds

__all__ = [
    "BACKENDS",
    "MAX_REQUESTS",
    "MAX_SCHEDULE_S",
    "MAX_TOKENS",
    "MIN_SERVER_SAMPLES",
    "BackendName",
    "ContextLengthError",
    "HarnessConfig",
    "ModelDiscoveryError",
    "RunResult",
    "context_problem",
    "dataset_context_problem",
    "plan_requests",
    "run_harness",
]


@dataclass
class RunResult:
    """What a run measured. Times are `perf_counter_ns`; `duration_s` is start to last stream end.
    `config` is the config as actually run (its `model` the one used, e.g. read from /v1/models).
    `probe_records`: the probes sent beside the load (`probes.py`), not among `records`."""

    config: HarnessConfig
    records: list[RequestRecord]
    summary: dict[str, Any]
    start_ns: int
    end_ns: int
    in_flight: list[tuple[int, int]]
    server_samples: list[ServerSample]
    server_exact: list[ServerSample]
    server_metrics_errors: list[str]
    probe_records: list[RequestRecord] = field(default_factory=lambda: list[RequestRecord]())

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


async def _first_sample(poller: ServerMetricsPoller, limit_s: float = 2.0) -> None:
    """Wait (up to `limit_s`) until the poller's first scrape is done. Its thread holds the GIL while
    it sets up its HTTP client and parses the answer; begun at the clock's start, that held the event
    loop off the first requests of a burst for 5-10 ms. The next scrape comes an interval later."""
    deadline = perf_counter_ns() + int(limit_s * 1e9)
    while not (poller.samples or poller.errors) and perf_counter_ns() < deadline:
        await asyncio.sleep(0.001)


def _freeze_heap() -> bool:
    """Collect garbage now and move every object that exists to the collector's permanent generation
    (`gc.freeze`), so that the collections that run during the measured load traverse only what the
    load itself allocates. Without it, a full collection over the run's prompts, bodies and modules
    stopped the event loop for tens of milliseconds in the middle of a burst, and every request after
    it started that much later. Returns True when this call froze (the caller unfreezes after the run);
    False when objects were already frozen by someone else (their freeze is left alone)."""
    if gc.get_freeze_count():
        return False
    gc.collect()
    gc.freeze()
    return True


def _backend_kwargs(config: HarnessConfig, model: str, keep_answers: bool) -> dict[str, Any]:
    """OpenAIBackend's keyword arguments (bar the session) for `config`: what a worker rebuilds it from."""
    return {
        "base_url": config.base_url,
        "model": model,
        "endpoint": "chat" if config.backend == "openai-chat" else "completions",
        "api_key": config.api_key,
        "timeout_s": config.timeout_s,
        "ignore_eos": config.ignore_eos,
        "keep_answers": keep_answers,
        "sampling": config.sampling.body_fields(),
    }


@dataclass
class _Load:
    """What the measured load needs besides the config: the backend, the planned requests, the
    counters (read between multi-turn rounds) and where records go."""

    backend: Backend
    specs: list[RequestSpec]
    offsets: list[float]
    probe: RequestSpec
    counters: RunCounters
    on_record: Callable[[RequestRecord], None] | None
    model: str | None
    conversations: list[Any]
    rounds: list[tuple[int, CounterSnapshot | None, CounterSnapshot | None]] = field(
        default_factory=lambda: list[tuple[int, CounterSnapshot | None, CounterSnapshot | None]]()
    )


async def _measure(config: HarnessConfig, load: _Load) -> LoadOutcome:
    """The measured load, from the clock's start to its last stream end, with probes beside it; in this
    process, or over `config.workers` worker processes (`workers.py`). Ctrl-C cancels it: every record
    already finished has gone to `on_record`, probes included."""
    stop_probes = asyncio.Event()
    probe_tasks: list[asyncio.Task[list[RequestRecord]]] = []  # one when probes run

    def start_probes(start_ns: int) -> None:
        if config.probe_rate > 0:
            probe_tasks.append(
                asyncio.create_task(
                    run_probes(
                        load.backend, load.probe, config.probe_rate, start_ns, stop_probes, load.on_record
                    )
                )
            )

    clock = CpuClock()
    tracker = InFlightTracker()
    spans: list[CpuSpan] = []
    try:
        clock.start()
        start_ns = perf_counter_ns()
        if config.workers > 1:
            assert load.model is not None
            kwargs = _backend_kwargs(config, load.model, keep_answers=False)
            plans = [
                WorkerPlan(w, kwargs, specs, offsets, share)
                for w, (specs, offsets, share) in enumerate(
                    split_load(load.specs, load.offsets, config.concurrency, config.workers)
                )
            ]
            starts: list[int] = []

            def on_start(shared_start_ns: int) -> None:
                clock.start()  # the coordinator's CPU from the shared start: its setup is not the load's
                starts.append(shared_start_ns)
                start_probes(shared_start_ns)

            merged = await run_worker_load(plans, load.on_record, on_start=on_start)
            start_ns, records, spans = starts[0], merged.records, merged.cpu
            in_flight, peak = merged.in_flight, merged.peak
        else:
            start_probes(start_ns)
            records = await _one_process_load(config, load, tracker, start_ns)
            in_flight, peak = list(tracker.samples), tracker.peak
        end_ns = perf_counter_ns()
        stop_probes.set()
        probes = [record for task in probe_tasks for record in await task]
    finally:
        for task in probe_tasks:
            task.cancel()  # a no-op once done
    own = clock.stop(probes if spans else [*records, *probes], loop=not spans)
    return LoadOutcome(
        records, probes, start_ns, end_ns, in_flight, peak, spans or [own], own if spans else None
    )


async def _one_process_load(
    config: HarnessConfig, load: _Load, tracker: InFlightTracker, start_ns: int
) -> list[RequestRecord]:
    if config.workload.kind == "multi-turn":
        counters = load.counters
        answers: dict[int, str] = getattr(load.backend, "answers", {})
        round_before: list[CounterSnapshot | None] = [None]

        async def before_round(turn: int) -> None:
            round_before[0] = await counters.snapshot() if turn else counters.before

        async def after_round(turn: int) -> None:
            load.rounds.append((turn, round_before[0], await counters.snapshot()))

        return await run_rounds(
            load.backend,
            answers,
            load.conversations,
            load.offsets,
            config.concurrency,
            tracker=tracker,
            on_record=load.on_record,
            before_round=before_round,
            after_round=after_round,
        )
    tagged = TaggingBackend(load.backend) if config.workload.kind != "random" else load.backend
    return await run_requests(
        tagged,
        load.specs,
        load.offsets,
        config.concurrency,
        tracker=tracker,
        on_record=load.on_record,
        start_ns=start_ns,
    )


def _conversations(config: HarnessConfig) -> list[Conversation]:
    """The conversations of a multi-turn run (seeded by `[seed, 3]`)."""
    return plan_conversations(
        config.workload,
        config.num_requests,
        config.prompt_len,
        config.output_len,
        np.random.default_rng([config.seed, 3]),
        config.dataset,
    )


async def _check_server(
    config: HarnessConfig,
    session: aiohttp.ClientSession,
    model: str,
    specs: list[RequestSpec],
    headers: dict[str, str] | None,
) -> int | None:
    """Raise ContextLengthError when the served context (GET /v1/models) cannot fit the requests;
    returns the server's KV block size for a trace run (None otherwise or when it is not told)."""
    limit = await served_context(session, config.base_url, model, config.timeout_s)
    if limit is not None:
        what = f"max_model_len {limit} (GET /v1/models)"
        problem = context_problem(config, limit, what) or dataset_context_problem(config, specs, limit)
        if problem is not None:
            raise ContextLengthError(problem)
    if config.trace is None:
        return None
    return await asyncio.to_thread(read_server_block_size, config.base_url, headers)


async def _prepare_client(backend: Backend, config: HarnessConfig, specs: list[RequestSpec]) -> None:
    """The client's own work before the clock starts: the bodies of the requests that can go out at
    once encoded (memory: one body each) and as many connections opened (one process only)."""
    if isinstance(backend, OpenAIBackend) and config.workers == 1:
        first = specs[: config.concurrency]
        backend.prepare(first)
        await backend.open_connections(len(first))


def _poller(
    config: HarnessConfig, simulated: SimulatedServer | None, headers: dict[str, str] | None
) -> ServerMetricsPoller | None:
    """The /metrics poller of the run (the simulated server's snapshots), or None (interval 0)."""
    if config.server_metrics_interval_s <= 0:
        return None
    if simulated is not None:
        return ServerMetricsPoller(config.server_metrics_interval_s, snapshot=simulated.snapshot)
    url = metrics_url(config.base_url)
    return ServerMetricsPoller(config.server_metrics_interval_s, url=url, headers=headers)


async def run_harness(
    config: HarnessConfig,
    *,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Run `config`: smoke test (fails fast), warm-up (discarded), then the measured load. Before the
    clock starts, the bodies of the first `concurrency` requests are encoded and as many connections
    are opened (`OpenAIBackend.prepare`, `open_connections`), so a burst costs the client no connects.

    Raises load.SmokeTestError when the smoke test (or building exact prompts) fails,
    ModelDiscoveryError when no model can be found, ContextLengthError (before the smoke test) when
    the server's GET /v1/models gives a max_model_len the requests cannot fit, ValueError for an
    unreadable --tokenizer or --dataset, RuntimeError when a worker process fails.
    Each measured record (and each probe's) is passed to `on_record` as its request finishes.
    """
    smoke_spec = RequestSpec(-1, 1, min(4, config.output_len.low), "hello")
    warm_specs, specs, offsets = plan_requests(config)
    model_used: str | None = None
    multi_turn = config.workload.kind == "multi-turn"
    conversations = _conversations(config) if multi_turn else []
    if multi_turn:  # one arrival per conversation, from the same seeded stream as a random run's
        offsets = offsets[: len(conversations)]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    counters = RunCounters(config.base_url, headers, enabled=config.backend != "simulated")
    block_size: int | None = None

    session: aiohttp.ClientSession | None = None
    simulated: SimulatedServer | None = None
    backend: Backend | None = None
    if config.backend == "simulated":
        simulated = SimulatedServer(config.server_slots, config.prefill_ms, config.per_token_ms)
        backend = SimulatedBackend(simulated, keep_answers=multi_turn)
    else:
        session = load_session()
    try:
        if session is not None:
            model_used = config.model or await discover_model(session, config.base_url, config.timeout_s)
            backend = OpenAIBackend(session, **_backend_kwargs(config, model_used, multi_turn))
        assert backend is not None
        tokenizer, (warm_specs, specs, (probe,)) = await exact_specs(
            config, session, model_used, warm_specs, specs, [probe_spec()]
        )
        if session is not None and model_used is not None:
            block_size = await _check_server(config, session, model_used, specs, headers)
        target = "the simulated server" if simulated is not None else config.base_url
        if config.smoke_test:
            await smoke_test(backend, smoke_spec, target)
        if warm_specs:
            await run_requests(backend, warm_specs, [0.0] * len(warm_specs), config.concurrency)
        if simulated is not None:
            simulated.reset_stats()
        await _prepare_client(backend, config, specs)

        poller = _poller(config, simulated, headers)
        await counters.read_before()
        frozen = False
        load = _Load(backend, specs, offsets, probe, counters, on_record, model_used, conversations)
        try:
            if poller is not None:
                poller.start()
                await _first_sample(poller)
            frozen = _freeze_heap()
            outcome = await _measure(config, load)
        finally:
            if frozen:
                gc.unfreeze()
            if poller is not None:
                await poller.stop()
        await counters.read_after([*outcome.records, *outcome.probes])
    finally:
        if session is not None:
            await session.close()

    used = replace(config, model=model_used) if model_used is not None else config
    summary = run_summary(
        config,
        outcome,
        specs=specs,
        model=model_used,
        tokenizer=tokenizer,
        counters=counters,
        rounds=load.rounds,
        poller=poller,
        simulated=simulated,
        block_size=block_size,
    )
    return RunResult(
        config=used,
        records=outcome.records,
        summary=summary,
        start_ns=outcome.start_ns,
        end_ns=outcome.end_ns,
        in_flight=outcome.in_flight,
        server_samples=list(poller.samples) if poller is not None else [],
        server_exact=list(simulated.samples) if simulated is not None else [],
        server_metrics_errors=list(poller.errors) if poller is not None else [],
        probe_records=outcome.probes,
    )
