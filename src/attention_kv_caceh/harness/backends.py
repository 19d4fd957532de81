"""Backends that turn one request into a stream of timed token events, filling a RequestRecord.

- `SimulatedBackend`: `asyncio.sleep`-driven streams from a `SimulatedServer` with a fixed number of
  batch slots, so client concurrency (the load's semaphore) and server batch (the slots) can differ
  without a real server; a request waiting for a slot shows up in its TTFT, as it would on vLLM.
- `OpenAIBackend`: `/v1/completions` or `/v1/chat/completions` of any OpenAI-compatible server (vLLM,
  SGLang, ...), streamed over one shared aiohttp session and decoded by the one parser in `sse.py`.

A backend never raises for a failed request: it records the failure kind, HTTP status and error text in
the record, which is then written like any other (see `records.FAILURE_KINDS`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from types import SimpleNamespace
from typing import Any, Literal, Protocol

import aiohttp
from yarl import URL

from attention_kv_caceh.harness.answer_text import AnswerText
from attention_kv_caceh.harness.client_errors import classify_client_error
from attention_kv_caceh.harness.records import STATUS_OK, RequestRecord
from attention_kv_caceh.harness.sse import (
    MAX_EVENT_BYTES,
    EventTooLargeError,
    InvalidUsageError,
    MalformedSSEError,
    OpenAIStreamDecoder,
    StreamErrorEvent,
)

__all__ = [
    "Backend",
    "OpenAIBackend",
    "RequestSpec",
    "ServerSample",
    "SimulatedBackend",
    "SimulatedServer",
    "endpoint_url",
    "load_session",
]


@dataclass(frozen=True)
class RequestSpec:
    """What to ask for: a prompt of `prompt_tokens` tokens (requested) and `output_tokens` tokens out.

    `prompt_token_ids`: the prompt as token ids (sent as such to `/v1/completions`);
    `prompt_tokens_checked`: the prompt's length as a tokenizer counted it (None: not checked, the
    prompt is approximate); `from_dataset`: a real prompt, not a synthetic one. `group` and `turn`:
    the workload's group (shared-prefix: which prefix; multi-turn: which conversation) and the turn
    within a conversation (from 0), None for the random workload; `messages`: the whole chat history
    as (role, content) pairs, sent as `messages` to the chat endpoint (the completions endpoint gets
    `prompt`, the history rendered as text). `prefix` and `prefix_tokens`: a shared-prefix workload's
    group prefix (the start of `prompt`) and its length in tokens; an exact prompt is then the
    prefix's first `prefix_tokens` tokens followed by the rest of `prompt` cut to the remaining length,
    so that a tokenizer of several tokens a word cannot cut a request's own suffix away.
    `hash_ids` and `hash_block_size`: a trace row's prompt blocks (`trace.py`), one id per
    `hash_block_size` tokens; an exact prompt is then the concatenation of each block's ids, equal ids
    giving equal blocks. `probe`: a one-token probe sent beside the load (`probes.py`).
    """

    request_id: int
    prompt_tokens: int
    output_tokens: int
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_tokens_checked: int | None = None
    from_dataset: bool = False
    group: int | None = None
    turn: int | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    prefix: str = ""
    prefix_tokens: int = 0
    hash_ids: tuple[int, ...] = ()
    hash_block_size: int = 0
    probe: bool = False

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(
                f"request {self.request_id}: prompt_tokens and output_tokens must be >= 1, got "
                f"{self.prompt_tokens} and {self.output_tokens}"
            )


class Backend(Protocol):
    """Sends one request and records its token events into `record` (never raises for failures)."""

    async def generate(self, spec: RequestSpec, record: RequestRecord) -> None: ...


@dataclass(frozen=True)
class ServerSample:
    """The server's queue at `time_ns`: running and waiting requests, KV-cache usage (0..1) if known."""

    time_ns: int
    running: float
    waiting: float
    kv_cache_usage: float | None = None


class SimulatedServer:
    """A server with `slots` batch slots: at most `slots` requests decode at once, the rest wait.

    `samples` records (time, running, waiting) at every change, exactly; `peak_running` and
    `peak_waiting` are the maxima. Times: `prefill_ms` before the first token, `per_token_ms` between
    tokens. Raises ValueError for slots < 1 or negative times.
    """

    def __init__(self, slots: int, prefill_ms: float, per_token_ms: float) -> None:
        if slots < 1:
            raise ValueError(f"server slots must be >= 1, got {slots}")
        if prefill_ms < 0 or per_token_ms < 0:
            raise ValueError(f"prefill_ms and per_token_ms must be >= 0, got {prefill_ms} and {per_token_ms}")
        self.slots = slots
        self.prefill_s = prefill_ms / 1000
        self.per_token_s = per_token_ms / 1000
        self._slot_gate = asyncio.Semaphore(slots)
        self.running = 0
        self.waiting = 0
        self.peak_running = 0
        self.peak_waiting = 0
        self.samples: list[ServerSample] = []

    def _note(self) -> None:
        self.peak_running = max(self.peak_running, self.running)
        self.peak_waiting = max(self.peak_waiting, self.waiting)
        self.samples.append(ServerSample(perf_counter_ns(), self.running, self.waiting))

    def reset_stats(self) -> None:
        """Forget samples and peaks (after a warm-up), keeping the current counts."""
        self.samples = []
        self.peak_running = self.running
        self.peak_waiting = self.waiting

    def snapshot(self) -> ServerSample:
        """The current running and waiting counts (what a `/metrics` poll would see)."""
        return ServerSample(perf_counter_ns(), self.running, self.waiting)

    async def stream(self, spec: RequestSpec, record: RequestRecord) -> None:
        """Wait for a slot, prefill, then emit `spec.output_tokens` one-token events into `record`."""
        if self._slot_gate.locked():  # no free slot: wait in the server's queue
            self.waiting += 1
            self._note()
            try:
                await self._slot_gate.acquire()
            finally:
                self.waiting -= 1
        else:
            await self._slot_gate.acquire()  # returns at once
        self.running += 1
        self._note()
        try:
            await asyncio.sleep(self.prefill_s)
            record.add_token_event(perf_counter_ns(), 1)
            for _ in range(spec.output_tokens - 1):
                await asyncio.sleep(self.per_token_s)
                record.add_token_event(perf_counter_ns(), 1)
        finally:
            self.running -= 1
            self._slot_gate.release()
            self._note()


class SimulatedBackend:
    """Streams from a SimulatedServer; output tokens are exactly those asked for. With `keep_answers`,
    `answers[request_id]` is a made-up answer text of one word per output token."""

    def __init__(self, server: SimulatedServer, *, keep_answers: bool = False) -> None:
        self.server = server
        self.keep_answers = keep_answers
        self.answers: dict[int, str] = {}

    async def generate(self, spec: RequestSpec, record: RequestRecord) -> None:
        """Fill `record` with one event per token; status "ok" when the stream completes."""
        await self.server.stream(spec, record)
        record.stream_end_ns = perf_counter_ns()
        record.output_tokens = sum(record.tokens_per_event)
        record.output_tokens_source = "simulated"
        record.prompt_tokens = spec.prompt_tokens
        record.tokens_per_event_source = "simulated"
        record.status = STATUS_OK
        if self.keep_answers:
            self.answers[spec.request_id] = " ".join(f"t{k}" for k in range(record.output_tokens))


def load_session() -> aiohttp.ClientSession:
    """The HTTP session of a load: no connection limit (the harness's semaphore bounds concurrency, not
    aiohttp's default pool of 100), no cookie jar (servers set none a benchmark needs) and no
    decompression (SSE is not compressed): each of those costs every request a little CPU. An idle
    connection is kept KEEPALIVE_S, less than servers keep one (uvicorn's and cpp-httplib's 5 s). The
    session reports which requests went out on a reused connection (`REUSE_TRACE`), so that
    `OpenAIBackend` can retry one the server had closed (see there)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        trace_configs=[REUSE_TRACE],
    )


def _fresh_session() -> aiohttp.ClientSession:
    """A session whose every request opens a connection of its own (closed after it): a retry's."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
    )


class _Attempt:
    """Per-request trace context: whether aiohttp sent the request on a pooled (reused) connection."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _on_reuse(
    session: aiohttp.ClientSession, context: SimpleNamespace, params: aiohttp.TraceConnectionReuseconnParams
) -> None:
    del session, params
    attempt = getattr(context, "trace_request_ctx", None)
    if isinstance(attempt, _Attempt):
        attempt.reused = True


REUSE_TRACE = aiohttp.TraceConfig()
"""aiohttp trace that marks a request's `_Attempt` (its `trace_request_ctx`) when its connection was
taken from the pool."""
REUSE_TRACE.on_connection_reuseconn.append(_on_reuse)


def _closed_before_answering(exc: aiohttp.ClientError, record: RequestRecord) -> bool:
    """The connection closed or failed before any byte of the response: no status line or header
    parsed (aiohttp's ServerDisconnectedError carries the partial message when one had begun), no
    event, and not a failure to connect (ClientConnectorError)."""
    if record.http_status is not None or record.token_times_ns:
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return isinstance(exc.message, str)  # a RawResponseMessage: the response had begun
    return isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError)


KEEPALIVE_S = 2.0
"""How long the load keeps an idle connection to reuse (below the servers' own keep-alive timeouts)."""


_AFTER_DONE_S = 1.0  # how long the end of a body is awaited after `[DONE]`


async def _read_to_end(content: aiohttp.StreamReader) -> None:
    """Read what follows `[DONE]` (the chunked body's last, empty chunk, usually in a later read) so
    that aiohttp puts the connection back in its pool for the next request; a body left unread closes
    it. A server that keeps the stream open longer than `_AFTER_DONE_S` after `[DONE]` only costs that
    connection (its bytes after `[DONE]` are not decoded; the record is already complete)."""
    try:
        async with asyncio.timeout(_AFTER_DONE_S):
            while not content.at_eof():
                await content.readany()
    except TimeoutError:
        pass


def endpoint_url(base_url: str, endpoint: Literal["completions", "chat"]) -> str:
    """`base_url` (with or without a trailing `/v1`) joined with the endpoint's path."""
    base = base_url.rstrip("/")
    base = base.removesuffix("/v1")
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    return base + path


class OpenAIBackend:
    """Streams from an OpenAI-compatible `/v1/completions` or `/v1/chat/completions` endpoint.

    Asks for `stream_options: {"include_usage": true, "continuous_usage_stats": true}` so that vLLM
    reports the tokens of every chunk. `timeout_s` bounds each whole request; `max_event_bytes` one SSE
    event (beyond it the request fails as `event_too_large`). The aiohttp session is
    shared by all requests and owned by the caller. With `keep_answers`, `answers[request_id]` is the
    text each request streamed (`answer_text.AnswerText`), for a multi-turn workload's next turn.
    `sampling`: fields added to every body as given (e.g. {"temperature": 0.0}; `sampling.SamplingOptions`
    checks them); none by default, so the server's defaults decide.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        base_url: str,
        model: str,
        endpoint: Literal["completions", "chat"],
        api_key: str | None = None,
        timeout_s: float = 600.0,
        ignore_eos: bool = False,
        max_event_bytes: int = MAX_EVENT_BYTES,
        keep_answers: bool = False,
        sampling: Mapping[str, Any] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout must be > 0 s, got {timeout_s}")
        self.session = session
        self.url = endpoint_url(base_url, endpoint)
        self._url = URL(self.url)  # parsed once: a str URL is parsed again by every request
        self.model = model
        self.endpoint = endpoint
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.ignore_eos = ignore_eos
        self.max_event_bytes = max_event_bytes
        self.keep_answers = keep_answers
        self.sampling = dict(sampling or {})
        self.answers: dict[int, str] = {}
        self._bodies: dict[int, tuple[RequestSpec, bytes]] = {}  # request_id -> (spec, its JSON body)

    def prepare(self, specs: Sequence[RequestSpec]) -> None:
        """Encode the JSON bodies of `specs` now, so that sending one costs no encoding (a long
        prompt's body takes a while to encode, and at a burst every encoding delays the next send)."""
        self._bodies = {spec.request_id: (spec, self._body(spec)) for spec in specs}

    def _body(self, spec: RequestSpec) -> bytes:
        """The encoded body of `spec`: prepared (when `spec` itself was prepared), else encoded now."""
        prepared = self._bodies.get(spec.request_id)
        if prepared is not None and prepared[0] is spec:
            return prepared[1]
        return json.dumps(self.payload(spec)).encode()

    async def open_connections(self, n: int) -> int:
        """Open up to `n` keep-alive connections to the server now (concurrent `GET /v1/models`, each
        answer read to its end), so that a burst of requests reuses them instead of connecting while
        the clock runs. Returns how many answered; failures are left to the requests to meet."""
        models = self.url.rsplit("/v1/", 1)[0] + "/v1/models"

        async def one() -> bool:
            try:
                async with self.session.get(models, headers=self.headers, timeout=self.timeout) as response:
                    await response.read()
                    return True
            except (aiohttp.ClientError, TimeoutError):
                return False

        return sum(await asyncio.gather(*(one() for _ in range(n))))

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        """The JSON body of one streamed request: the prompt or messages, the output length, the
        sampling fields given (`sampling`) and `ignore_eos` when asked for."""
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.endpoint == "completions":
            body["prompt"] = list(spec.prompt_token_ids) if spec.prompt_token_ids else spec.prompt
            body["max_tokens"] = spec.output_tokens
        else:
            pairs = spec.messages if spec.messages is not None else (("user", spec.prompt),)
            body["messages"] = [{"role": role, "content": content} for role, content in pairs]
            body["max_completion_tokens"] = spec.output_tokens
        body.update(self.sampling)
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def _stream(
        self,
        session: aiohttp.ClientSession,
        spec: RequestSpec,
        record: RequestRecord,
        decoder: OpenAIStreamDecoder,
        answer: AnswerText | None,
        timeout: aiohttp.ClientTimeout,
        attempt: _Attempt | None,
    ) -> bool:
        """One send of `spec` on `session` and its stream into `record`: True when a 200 stream was
        read, False for an HTTP error status (recorded in `record`). Raises what aiohttp and the
        decoder raise."""
        async with session.post(
            self._url, data=self._body(spec), headers=self.headers, timeout=timeout, trace_request_ctx=attempt
        ) as response:
            record.http_status = response.status
            if response.status != 200:
                body = await response.text(errors="replace")
                record.fail(
                    "http_error",
                    body.strip()[:500] or "(empty body)",
                    perf_counter_ns(),
                )
                return False
            async for chunk in response.content.iter_any():
                now = perf_counter_ns()
                if answer is not None:
                    answer.feed(chunk)
                record.add_token_events(now, decoder.feed(chunk))
                if decoder.failure is not None:
                    raise decoder.failure
                if decoder.done:
                    await _read_to_end(response.content)
                    break
        return True

    async def _retry_on_a_fresh_connection(
        self,
        spec: RequestSpec,
        record: RequestRecord,
        decoder: OpenAIStreamDecoder,
        answer: AnswerText | None,
    ) -> bool:
        """The one retry (see `generate`), within what is left of the request's timeout; returns what
        `_stream` returns."""
        record.retried_fresh_connection = True
        spent_s = (perf_counter_ns() - (record.sent_ns or perf_counter_ns())) / 1e9
        left_s = (self.timeout.total or 0.0) - spent_s
        if left_s <= 0:
            raise TimeoutError
        async with _fresh_session() as fresh:
            return await self._stream(
                fresh, spec, record, decoder, answer, aiohttp.ClientTimeout(total=left_s), None
            )

    async def generate(self, spec: RequestSpec, record: RequestRecord) -> None:
        """Send `spec`, timestamp every token-bearing event into `record`, record any failure.

        A request sent on a reused keep-alive connection (`load_session`'s `REUSE_TRACE` says so) that
        the server had closed, so that the connection failed before any byte of the response came, is
        sent once more on a fresh connection, as HTTP clients do for an idempotent request on a stale
        connection (urllib3, browsers): the server never received it. `record.retried_fresh_connection`
        says so; its latencies still count from the first send (`sent_ns`), and the retry gets what is
        left of the timeout. A request that got any byte of its response, or that failed on a fresh
        connection, is never sent again.
        """
        decoder = OpenAIStreamDecoder(self.max_event_bytes)
        answer = AnswerText() if self.keep_answers else None
        attempt = _Attempt()
        try:
            try:
                streamed = await self._stream(
                    self.session, spec, record, decoder, answer, self.timeout, attempt
                )
            except aiohttp.ClientError as exc:
                if not (attempt.reused and _closed_before_answering(exc, record)):
                    raise
                record.first_error = classify_client_error(exc, after_headers=False)[1]
                streamed = await self._retry_on_a_fresh_connection(spec, record, decoder, answer)
        except StreamErrorEvent as exc:
            record.fail("stream_error", str(exc), perf_counter_ns())
        except EventTooLargeError as exc:
            record.fail("event_too_large", str(exc), perf_counter_ns())
        except InvalidUsageError as exc:
            record.fail("invalid_usage", str(exc), perf_counter_ns())
        except MalformedSSEError as exc:
            record.fail("malformed_sse", str(exc), perf_counter_ns())
        except TimeoutError:
            record.fail("timeout", "request exceeded the timeout", perf_counter_ns())
        except aiohttp.ClientError as exc:
            kind, message = classify_client_error(exc, after_headers=record.http_status is not None)
            record.fail(kind, message, perf_counter_ns())
        else:
            if streamed:
                self._finish(decoder, record)
        finally:
            if answer is not None:
                self.answers[spec.request_id] = answer.text
            if decoder.prompt_tokens is not None:
                record.prompt_tokens = decoder.prompt_tokens
            elif spec.prompt_tokens_checked is not None:
                record.prompt_tokens = spec.prompt_tokens_checked
            record.output_tokens = decoder.output_tokens
            record.output_tokens_source = decoder.output_tokens_source
            record.tokens_per_event_source = decoder.tokens_per_event_source

    @staticmethod
    def _finish(decoder: OpenAIStreamDecoder, record: RequestRecord) -> None:
        """Judge a stream that closed cleanly: ok with `[DONE]`, or without it after a finish_reason
        (`done_marker` False); else incomplete_stream, or no_tokens when no event came."""
        end_ns = perf_counter_ns()
        finished = decoder.done or (decoder.finish_reason is not None and not decoder.truncated)
        if not finished:
            what = "mid-event" if decoder.truncated else "after the last event"
            record.fail(
                "incomplete_stream", f"stream ended {what} without a finish_reason or data: [DONE]", end_ns
            )
        elif not record.token_times_ns:
            record.fail("no_tokens", "stream finished without a token", end_ns)
        else:
            counts, note = decoder.reconciled_counts()
            record.tokens_per_event = counts
            record.token_reconciliation = note
            record.done_marker = decoder.done
            record.stream_end_ns = end_ns
            record.status = STATUS_OK
