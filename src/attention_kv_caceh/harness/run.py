"""One harness run: smoke test, warm-up, the measured load, server polling, and the summary.

`run_harness` prints nothing: it returns a RunResult (records, summary, client in-flight and server
series) and hands each finished record to `on_record` as it finishes, so the caller can write it at
once and keep it if the run is interrupted.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from time import perf_counter_ns
from typing import Any, cast

import aiohttp
import numpy as np

from attention_kv_caceh.harness.backends import (
    Backend,
    OpenAIBackend,
    RequestSpec,
    ServerSample,
    SimulatedBackend,
    SimulatedServer,
)
from attention_kv_caceh.harness.client_errors import UNREACHABLE_KINDS, classify_client_error
from attention_kv_caceh.harness.config import (
    BACKENDS,
    MAX_REQUESTS,
    MAX_SCHEDULE_S,
    MAX_TOKENS,
    MIN_SERVER_SAMPLES,
    BackendName,
    HarnessConfig,
)
from attention_kv_caceh.harness.copy_workload import copy_specs
from attention_kv_caceh.harness.dataset import read_dataset
from attention_kv_caceh.harness.load import (
    InFlightTracker,
    SmokeTestError,
    arrival_offsets_s,
    make_request_specs,
    run_requests,
    smoke_test,
    unreachable_message,
)
from attention_kv_caceh.harness.prompts import (
    LocalTokenizer,
    PromptTokenizer,
    ServerTokenizer,
    exact_prompts,
    probe_server_tokenizer,
)
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.server_counters import (
    CounterSnapshot,
    RunCounters,
    counter_warnings,
    spec_decode_result,
)
from attention_kv_caceh.harness.server_metrics import ServerMetricsPoller, metrics_url
from attention_kv_caceh.harness.summary import summarize_run
from attention_kv_caceh.harness.workloads import (
    TaggingBackend,
    implied_prefix_hits,
    per_turn_summary,
    plan_conversations,
    run_rounds,
    shared_prefix_specs,
)

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


def plan_requests(config: HarnessConfig) -> tuple[list[RequestSpec], list[RequestSpec], list[float]]:
    """(warm-up specs, measured specs, arrival offsets in s) of `config`.

    The measured specs and arrivals come from `seed` alone; warm-ups draw from their own stream
    (`default_rng([seed, 1])`), so adding warm-ups never changes the measured prompts. With a
    `dataset`, the measured prompts are its first `num_requests` entries (their `output_len`, else the
    drawn one; the requested prompt length is the word count until a tokenizer counts it). A
    shared-prefix workload's specs are `workloads.shared_prefix_specs`; a multi-turn workload's measured
    requests are planned by `workloads.plan_conversations` instead (these specs are unused). Raises
    ValueError for a dataset that cannot be read or has fewer entries than `num_requests`.
    """
    rng = np.random.default_rng(config.seed)
    if config.workload.kind == "shared-prefix":
        specs = shared_prefix_specs(
            config.workload, config.num_requests, config.prompt_len, config.output_len, rng, config.seed
        )
    elif config.workload.kind == "copy":
        specs = copy_specs(config.num_requests, config.prompt_len, config.output_len, rng, config.seed)
    else:
        specs = make_request_specs(config.num_requests, config.prompt_len, config.output_len, rng)
    if config.dataset is not None and config.workload.kind == "random":
        specs = _dataset_specs(config, specs)
    offsets = arrival_offsets_s(config.num_requests, config.request_rate, config.burstiness, rng)
    warm_rng = np.random.default_rng([config.seed, 1])
    warm_specs = make_request_specs(
        config.warmup_requests, config.prompt_len, config.output_len, warm_rng, first_id=-1 - 10**6
    )
    return warm_specs, specs, offsets


def _dataset_specs(config: HarnessConfig, drawn: list[RequestSpec]) -> list[RequestSpec]:
    assert config.dataset is not None
    entries = read_dataset(config.dataset)
    if len(entries) < config.num_requests:
        raise ValueError(
            f"--dataset {config.dataset!r} has {len(entries)} entries, fewer than --num-requests "
            f"{config.num_requests}"
        )
    return [
        RequestSpec(
            spec.request_id,
            max(1, len(prompt.split())),
            output_len if output_len is not None else spec.output_tokens,
            prompt,
            from_dataset=True,
        )
        for spec, (prompt, output_len) in zip(drawn, entries, strict=False)
    ]


async def _exact(
    config: HarnessConfig, session: aiohttp.ClientSession | None, model: str | None, *specs: list[RequestSpec]
) -> tuple[PromptTokenizer | None, list[list[RequestSpec]]]:
    """The tokenizer used (local --tokenizer, else the server's /tokenize, else None) and `specs`
    with exact prompts (unchanged without a tokenizer or with the simulated backend). Raises
    ValueError for an unreadable --tokenizer, SmokeTestError when tokenizing fails mid-way."""
    tokenizer: PromptTokenizer | None = None
    if config.backend == "simulated":
        return None, list(specs)
    if config.tokenizer is not None:
        tokenizer = LocalTokenizer(config.tokenizer)
    elif session is not None and model is not None:
        chat = config.backend == "openai-chat"
        server = ServerTokenizer(session, config.base_url, model, config.timeout_s, chat=chat)
        tokenizer = server if await probe_server_tokenizer(server) else None
    if tokenizer is None:
        return None, list(specs)
    ids = config.backend == "openai-completions"
    try:
        groups = [await exact_prompts(group, tokenizer, token_ids=ids) for group in specs]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise SmokeTestError(
            f"building prompts of exact length with {tokenizer.name} failed: {type(exc).__name__}: {exc}"
        ) from None
    if _without_template(config, tokenizer):
        # the local count leaves out the chat template: never record it as the length the server saw
        groups = [[replace(spec, prompt_tokens_checked=None) for spec in group] for group in groups]
    return tokenizer, groups


def _without_template(config: HarnessConfig, tokenizer: PromptTokenizer | None) -> bool:
    """True when chat prompts were counted by a local tokenizer.json, which has no chat template."""
    return config.backend == "openai-chat" and isinstance(tokenizer, LocalTokenizer)


def _prompt_lengths(
    config: HarnessConfig,
    tokenizer: PromptTokenizer | None,
    records: list[RequestRecord],
    off_pct: float | None,
) -> tuple[str, str | None]:
    """("exact" or "approximate", the warning saying why when approximate) for a run against a server.

    Exact: prompts built with the server's /tokenize, or with a local tokenizer for `/v1/completions`;
    chat prompts built with a local tokenizer only where the server's usage reported, for every
    successful request, exactly the requested length (the template's tokens are not in the local count).
    """
    measured = (
        f"the server counted {off_pct:+.1f} % against the requested tokens"
        if off_pct is not None
        else "the server reported no prompt token counts"
    )
    if tokenizer is None:
        return "approximate", (
            f"prompt lengths are approximate (no --tokenizer and no POST /tokenize on the server): {measured}"
        )
    if _without_template(config, tokenizer):
        ok = [r for r in records if r.ok]
        if ok and all(r.prompt_tokens == r.requested_prompt_tokens for r in ok):
            return "exact", None  # the server's own counts confirm every prompt
        return "approximate", (
            f"prompt lengths are approximate: --tokenizer {tokenizer.name} has no chat template, and the "
            f"server counts the template's tokens of /v1/chat/completions too: {measured}"
        )
    return "exact", None


@dataclass
class RunResult:
    """What a run measured. Times are `perf_counter_ns`; `duration_s` is start to last stream end.
    `config` is the config as actually run (its `model` the one used, e.g. read from /v1/models)."""

    config: HarnessConfig
    records: list[RequestRecord]
    summary: dict[str, Any]
    start_ns: int
    end_ns: int
    in_flight: list[tuple[int, int]]
    server_samples: list[ServerSample]
    server_exact: list[ServerSample]
    server_metrics_errors: list[str]

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _as_count(value: float | None) -> int | float | None:
    """A request count read as a float (Prometheus) as an int when it is whole (printed as `5`)."""
    return int(value) if value is not None and float(value).is_integer() else value


class ModelDiscoveryError(RuntimeError):
    """No --model was given and none could be read from the server's GET /v1/models."""


async def _discover_model(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str:
    """The first model id from GET /v1/models. Raises ModelDiscoveryError if none can be found (the
    server cannot be reached, does not answer in time, or lists no model)."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    limit_s = min(timeout_s, 30.0)
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit_s)) as response:
            if response.status != 200:
                text = (await response.content.read(200)).decode("utf-8", errors="replace")
                raise ModelDiscoveryError(
                    f"no --model given and GET {url} answered HTTP {response.status}"
                    + (f": {' '.join(text.split())[:200]}" if text.strip() else "")
                    + "; pass --model"
                )
            body: Any = await response.json(content_type=None)
    except aiohttp.ClientError as exc:
        kind, detail = classify_client_error(exc, after_headers=False)
        if kind in UNREACHABLE_KINDS and isinstance(exc, aiohttp.ClientConnectionError):
            raise ModelDiscoveryError(unreachable_message(base_url, f"GET {url}: {detail}")) from None
        raise ModelDiscoveryError(
            f"no --model given and GET {url} failed: {kind}: {detail}; pass --model"
        ) from None
    except TimeoutError:
        raise ModelDiscoveryError(
            f"the server at {base_url} did not answer GET {url} within {limit_s:g} s"
        ) from None
    except ValueError as exc:
        raise ModelDiscoveryError(
            f"no --model given and GET {url} failed ({type(exc).__name__}: {exc}); pass --model"
        ) from None
    data: object = cast("dict[str, Any]", body).get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data:
        first: object = cast("list[Any]", data)[0]
        if isinstance(first, dict):
            model_id: object = cast("dict[str, Any]", first).get("id")
            if isinstance(model_id, str):
                return model_id
    raise ModelDiscoveryError(f"no --model given and {url} lists no model; pass --model")


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


class ContextLengthError(ValueError):
    """The requests asked for cannot fit the model's context (max_model_len): bad input, found before
    any request is sent."""


def context_problem(config: HarnessConfig, limit: int, what: str) -> str | None:
    """Why `config`'s synthetic requests cannot fit a context of `limit` tokens (`what` names the limit
    and its source in the message), or None. A server refuses a prompt of `limit` tokens or more (no
    room for an output token, HTTP 400) and serves a prompt + max_tokens above `limit` with fewer output
    tokens than asked (vLLM and `serve` cap max_tokens to the context left), which a benchmark must not
    take for the requested length. Dataset prompts are checked once counted (`dataset_context_problem`)."""
    if config.dataset is not None:
        return None
    prompt, output = config.prompt_len.high, config.output_len.high
    if prompt >= limit:
        return (
            f"--prompt-len {config.prompt_len}: a prompt of {prompt} tokens does not fit the model's "
            f"context, {what}, with room for an output token"
        )
    if prompt + output > limit:
        return (
            f"--prompt-len {config.prompt_len} + --output-len {config.output_len}: up to {prompt + output} "
            f"tokens per request, more than the model's context, {what}"
        )
    return None


def dataset_context_problem(config: HarnessConfig, specs: list[RequestSpec], limit: int) -> str | None:
    """Why a counted dataset prompt (with its output length) cannot fit `limit` tokens, or None."""
    for spec in specs:
        n = spec.prompt_tokens_checked
        if spec.from_dataset and n is not None and (n >= limit or n + spec.output_tokens > limit):
            return (
                f"--dataset {config.dataset}: entry {spec.request_id + 1} has a prompt of {n} tokens and "
                f"an output of {spec.output_tokens}, more than the model's context, max_model_len {limit}"
            )
    return None


async def _served_context(
    session: aiohttp.ClientSession, base_url: str, model: str, timeout_s: float
) -> int | None:
    """The `max_model_len` of `model` in the server's GET /v1/models (vLLM and `serve` list it), or None
    when the server does not say (then the server itself refuses what does not fit)."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=min(timeout_s, 30.0))) as response:
            body: Any = await response.json(content_type=None) if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    data: object = cast("dict[str, Any]", body).get("data") if isinstance(body, dict) else None
    for card in cast("list[Any]", data) if isinstance(data, list) else []:
        if isinstance(card, dict) and cast("dict[str, Any]", card).get("id") == model:
            limit: object = cast("dict[str, Any]", card).get("max_model_len")
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                return limit
    return None


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
    unreadable --tokenizer or --dataset.
    Each measured record is passed to `on_record` as its request finishes.
    """
    smoke_spec = RequestSpec(-1, 1, min(4, config.output_len.low), "hello")
    warm_specs, specs, offsets = plan_requests(config)
    model_used: str | None = None
    multi_turn = config.workload.kind == "multi-turn"
    conversations = (
        plan_conversations(
            config.workload,
            config.num_requests,
            config.prompt_len,
            config.output_len,
            np.random.default_rng([config.seed, 3]),
            config.dataset,
        )
        if multi_turn
        else []
    )
    if multi_turn:  # one arrival per conversation, from the same seeded stream as a random run's
        offsets = offsets[: len(conversations)]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    counters = RunCounters(config.base_url, headers, enabled=config.backend != "simulated")
    rounds: list[tuple[int, CounterSnapshot | None, CounterSnapshot | None]] = []

    session: aiohttp.ClientSession | None = None
    simulated: SimulatedServer | None = None
    backend: Backend | None = None
    if config.backend == "simulated":
        simulated = SimulatedServer(config.server_slots, config.prefill_ms, config.per_token_ms)
        backend = SimulatedBackend(simulated, keep_answers=multi_turn)
    else:
        # limit=0: the harness's semaphore, not aiohttp's default pool of 100, bounds concurrency.
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        if session is not None:
            model_used = config.model or await _discover_model(session, config.base_url, config.timeout_s)
            backend = OpenAIBackend(
                session,
                base_url=config.base_url,
                model=model_used,
                endpoint="chat" if config.backend == "openai-chat" else "completions",
                api_key=config.api_key,
                timeout_s=config.timeout_s,
                ignore_eos=config.ignore_eos,
                keep_answers=multi_turn,
                sampling=config.sampling.body_fields(),
            )
        assert backend is not None
        tokenizer, (warm_specs, specs) = await _exact(config, session, model_used, warm_specs, specs)
        if session is not None and model_used is not None:
            limit = await _served_context(session, config.base_url, model_used, config.timeout_s)
            if limit is not None:
                what = f"max_model_len {limit} (GET /v1/models)"
                problem = context_problem(config, limit, what) or dataset_context_problem(
                    config, specs, limit
                )
                if problem is not None:
                    raise ContextLengthError(problem)
        target = "the simulated server" if simulated is not None else config.base_url
        if config.smoke_test:
            await smoke_test(backend, smoke_spec, target)
        if warm_specs:
            await run_requests(backend, warm_specs, [0.0] * len(warm_specs), config.concurrency)
        if simulated is not None:
            simulated.reset_stats()
        if isinstance(backend, OpenAIBackend):  # the client's own work, done before the clock starts
            first = specs[: config.concurrency]  # those that can go out at once (memory: one body each)
            backend.prepare(first)
            await backend.open_connections(len(first))

        poller: ServerMetricsPoller | None = None
        if config.server_metrics_interval_s > 0:
            if simulated is not None:
                poller = ServerMetricsPoller(config.server_metrics_interval_s, snapshot=simulated.snapshot)
            else:
                headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
                poller = ServerMetricsPoller(
                    config.server_metrics_interval_s, url=metrics_url(config.base_url), headers=headers
                )
        tracker = InFlightTracker()
        await counters.read_before()
        frozen = False
        try:
            if poller is not None:
                poller.start()
                await _first_sample(poller)
            frozen = _freeze_heap()
            start_ns = perf_counter_ns()
            if multi_turn:
                answers: dict[int, str] = getattr(backend, "answers", {})
                round_before: list[CounterSnapshot | None] = [None]

                async def before_round(turn: int) -> None:
                    round_before[0] = await counters.snapshot() if turn else counters.before

                async def after_round(turn: int) -> None:
                    rounds.append((turn, round_before[0], await counters.snapshot()))

                records = await run_rounds(
                    backend,
                    answers,
                    conversations,
                    offsets,
                    config.concurrency,
                    tracker=tracker,
                    on_record=on_record,
                    before_round=before_round,
                    after_round=after_round,
                )
            else:
                tagged = TaggingBackend(backend) if config.workload.kind != "random" else backend
                records = await run_requests(
                    tagged,
                    specs,
                    offsets,
                    config.concurrency,
                    tracker=tracker,
                    on_record=on_record,
                    start_ns=start_ns,
                )
        finally:
            if frozen:
                gc.unfreeze()
            if poller is not None:
                await poller.stop()
        end_ns = perf_counter_ns()
        await counters.read_after(records)
    finally:
        if session is not None:
            await session.close()

    used = replace(config, model=model_used) if model_used is not None else config
    summary: dict[str, Any] = {
        "label": config.label,
        "model_id": model_used,
        "tokenizer_id": tokenizer.name if tokenizer is not None else None,
        "prompt_lengths": None,  # set below, from the records
    }
    summary |= summarize_run(
        records, (end_ns - start_ns) / 1e9, slo=config.goodput, peak_in_flight=tracker.peak
    )
    lengths, why = (
        # a multi-turn prompt is the whole history plus --prompt-len words: no token length was asked for
        ("not requested", None)
        if multi_turn
        else ("exact", None)
        if simulated is not None
        else _prompt_lengths(config, tokenizer, records, summary["prompt_tokens_off_pct"])
    )
    summary["prompt_lengths"] = lengths
    if why is not None:
        summary["warnings"].insert(0, why)
    server_samples = poller.samples if poller is not None else []
    server_exact = list(simulated.samples) if simulated is not None else []
    peaks_from = server_exact or server_samples
    summary["server_metrics_source"] = (
        "simulated (exact)" if server_exact else ("prometheus" if server_samples else None)
    )
    too_few = poller is not None and not server_exact and len(server_samples) < MIN_SERVER_SAMPLES
    if too_few:  # a peak of a few samples is a guess (often 0 at idle moments): none is reported
        peaks_from = []
    summary["peak_server_running"] = _as_count(max((s.running for s in peaks_from), default=None))
    summary["peak_server_waiting"] = _as_count(max((s.waiting for s in peaks_from), default=None))
    summary["workload"] = config.workload.describe()
    summary["server_counters"] = counters.delta(records)
    summary |= spec_decode_result(summary["server_counters"])
    summary["server_counters_error"] = counters.error or None
    if multi_turn:
        summary["per_turn"] = per_turn_summary(records, rounds)
    if summary["server_counters"] is not None:
        summary["warnings"] += counter_warnings(summary["server_counters"])
    if config.workload.kind == "shared-prefix":
        summary["implied_prefix_hit_tokens"] = implied_prefix_hits(config.workload, len(records), 1)
    summary["server_metrics_samples"] = len(server_samples) if poller is not None else None
    summary["server_metrics_interval_achieved_s"] = poller.achieved_interval_s if poller else None
    if too_few:
        summary["warnings"].append(
            f"only {len(server_samples)} server metrics samples (< {MIN_SERVER_SAMPLES}): too few for the "
            "server's peaks, which are not reported; use a longer run or a shorter --server-metrics-interval"
        )
    return RunResult(
        config=used,
        records=records,
        summary=summary,
        start_ns=start_ns,
        end_ns=end_ns,
        in_flight=list(tracker.samples),
        server_samples=list(server_samples),
        server_exact=server_exact,
        server_metrics_errors=list(poller.errors) if poller is not None else [],
    )
