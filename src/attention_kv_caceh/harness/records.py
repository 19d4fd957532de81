"""The per-request record: every timestamp of one streamed request, and its JSON line.

Each request task owns its record and returns it (no shared mutable result object). Timestamps are
`time.perf_counter_ns()` values of the one client process, so differences are exact nanoseconds; the
derived metrics come from `metrics.compute_request_metrics` and are written beside the raw timestamps so
that every figure in a summary can be recomputed from the JSONL file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attention_kv_caceh.harness.metrics import RequestMetrics, compute_request_metrics

__all__ = ["FAILURE_KINDS", "JSONL_KEYS", "STATUS_OK", "RequestRecord"]

STATUS_OK = "ok"

# status values other than "ok": the failure kind, recorded per request, never dropped.
FAILURE_KINDS = (
    "http_error",  # HTTP 4xx/5xx; `http_status` and the body's start in `error`
    "stream_error",  # an error event inside a 200 stream
    "incomplete_stream",  # the stream ended (cleanly) without `data: [DONE]` and without a finish_reason
    "stream_cut",  # the connection broke mid-stream
    "malformed_sse",  # a `data:` line that is not JSON (or not an object)
    "event_too_large",  # one SSE event grew past sse.MAX_EVENT_BYTES
    "invalid_usage",  # a usage count that is negative, not an integer, or decreasing
    "no_tokens",  # the stream finished without a single token
    "connection_error",  # refused or unreachable
    "dns_error",  # the host name could not be resolved
    "tls_error",  # TLS handshake or certificate failure
    "too_many_redirects",  # a redirect loop
    "connection_closed",  # the server accepted the connection and closed it before answering
    "timeout",  # the request exceeded `--timeout`
)

# Keys of one JSONL line, in order (every timestamp and count of a request, then its metrics).
JSONL_KEYS = (
    "request_id",
    "arrival_ns",
    "dispatch_ns",
    "sent_ns",
    "first_token_ns",
    "token_times_ns",
    "tokens_per_event",
    "finish_ns",
    "stream_end_ns",
    "requested_prompt_tokens",
    "prompt_tokens",
    "requested_output_tokens",
    "output_tokens",
    "output_tokens_source",
    "tokens_per_event_source",
    "token_reconciliation",
    "done_marker",
    "status",
    "http_status",
    "error",
    "lateness_ms",
    "queue_ms",
    "ttft_ms",
    "itl_ms",
    "tpot_ms",
    "e2el_ms",
    "e2e_ms",
    "workload_group",
    "turn",
    "probe",
    "retried_fresh_connection",
    "first_error",
)


@dataclass
class RequestRecord:
    """Timestamps (ns, `perf_counter_ns`) and outcome of one request.

    `arrival_ns`: created, or scheduled arrival for a rate-driven load; `dispatch_ns`: the client's loop
    started the request (after its arrival; the gap is client lateness); `sent_ns`: a concurrency slot was
    acquired and the request is about to go out; `token_times_ns[i]`: arrival of the i-th token-bearing
    event carrying `tokens_per_event[i]` tokens; `finish_ns`: the last token-bearing event;
    `stream_end_ns`: the stream closed (after `[DONE]`, an error, or a cut).
    `requested_prompt_tokens`: the length asked for (None in JSONL files from before it was recorded);
    `prompt_tokens`: the length actually sent, as the
    server's usage reported it, else as a tokenizer checked it, else None (unknown, e.g. a failed
    request with an approximate prompt). `requested_output_tokens`: the `max_tokens` asked for (None in
    JSONL files from before it was recorded); a server that streams more is warned about in the summary.
    `output_tokens_source` says how `output_tokens` was obtained: "usage" (the server's usage
    statistics), "logprobs" (tokens listed per chunk), "chunks" (one per content-bearing chunk) or
    "simulated". `tokens_per_event_source` says how each event's tokens were derived ("usage",
    "logprobs", "chunks", "simulated"); `token_reconciliation` how they were made to sum to the final
    usage (None: no change needed). `done_marker` is False for a stream that ended with a
    `finish_reason` and a clean close but no `data: [DONE]` (accepted as ok, as vLLM's and SGLang's
    clients do), True when `[DONE]` came, None when not known (simulated, failed before the end).
    `group`, `turn`: the workload group and turn of the request (`RequestSpec`), None for the random
    workload. `probe`: a one-token probe sent beside the load (`probes.py`), kept out of the load's
    statistics. `retried_fresh_connection`: the first send went out on a reused keep-alive connection
    that the server had closed (it failed before any byte of the response) and the request was sent
    once more on a fresh one (`backends.OpenAIBackend.generate`); `first_error` is what the first send
    met (None without a retry). Its latencies count from the first send.
    """

    request_id: int
    arrival_ns: int
    requested_prompt_tokens: int | None = None
    prompt_tokens: int | None = None
    dispatch_ns: int | None = None
    sent_ns: int | None = None
    first_token_ns: int | None = None
    token_times_ns: list[int] = field(default_factory=lambda: [])
    tokens_per_event: list[int] = field(default_factory=lambda: [])
    finish_ns: int | None = None
    stream_end_ns: int | None = None
    output_tokens: int = 0
    output_tokens_source: str = "chunks"
    tokens_per_event_source: str = "chunks"
    token_reconciliation: str | None = None
    done_marker: bool | None = None
    status: str = "pending"
    http_status: int | None = None
    error: str | None = None
    group: int | None = None
    turn: int | None = None
    requested_output_tokens: int | None = None
    probe: bool = False
    retried_fresh_connection: bool = False
    first_error: str | None = None

    def add_token_event(self, time_ns: int, num_tokens: int) -> None:
        """Record one token-bearing event at `time_ns` carrying `num_tokens` tokens."""
        if self.first_token_ns is None:
            self.first_token_ns = time_ns
        self.token_times_ns.append(time_ns)
        self.tokens_per_event.append(num_tokens)
        self.finish_ns = time_ns

    def add_token_events(self, time_ns: int, counts: list[int]) -> None:
        """Record the token-bearing events of one read, all at `time_ns`, carrying `counts` tokens."""
        if not counts:
            return
        if self.first_token_ns is None:
            self.first_token_ns = time_ns
        self.token_times_ns += [time_ns] * len(counts)
        self.tokens_per_event += counts
        self.finish_ns = time_ns

    def fail(self, kind: str, error: str, end_ns: int | None = None) -> None:
        """Mark the request failed with a kind from FAILURE_KINDS. Raises ValueError for another kind."""
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {kind!r}; expected one of {FAILURE_KINDS}")
        self.status = kind
        self.error = error
        if end_ns is not None:
            self.stream_end_ns = end_ns

    @property
    def ok(self) -> bool:
        """True for a successful request (only these enter the latency statistics, as in vLLM)."""
        return self.status == STATUS_OK

    def metrics(self) -> RequestMetrics:
        """Derived latencies (ms); see `metrics.compute_request_metrics`."""
        return compute_request_metrics(
            arrival_ns=self.arrival_ns,
            dispatch_ns=self.dispatch_ns,
            sent_ns=self.sent_ns,
            first_token_ns=self.first_token_ns,
            token_times_ns=self.token_times_ns,
            tokens_per_event=self.tokens_per_event,
            finish_ns=self.finish_ns,
            output_tokens=self.output_tokens,
        )

    def to_json(self) -> dict[str, Any]:
        """One JSONL line as a dict with JSONL_KEYS in order; undefined metrics are None (null)."""
        m = self.metrics()
        return {
            "request_id": self.request_id,
            "arrival_ns": self.arrival_ns,
            "dispatch_ns": self.dispatch_ns,
            "sent_ns": self.sent_ns,
            "first_token_ns": self.first_token_ns,
            "token_times_ns": list(self.token_times_ns),
            "tokens_per_event": list(self.tokens_per_event),
            "finish_ns": self.finish_ns,
            "stream_end_ns": self.stream_end_ns,
            "requested_prompt_tokens": self.requested_prompt_tokens,
            "prompt_tokens": self.prompt_tokens,
            "requested_output_tokens": self.requested_output_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_source": self.output_tokens_source,
            "tokens_per_event_source": self.tokens_per_event_source,
            "token_reconciliation": self.token_reconciliation,
            "done_marker": self.done_marker,
            "status": self.status,
            "http_status": self.http_status,
            "error": self.error,
            "lateness_ms": m.lateness_ms,
            "queue_ms": m.queue_ms,
            "ttft_ms": m.ttft_ms,
            "itl_ms": list(m.itl_ms),
            "tpot_ms": m.tpot_ms,
            "e2el_ms": m.e2el_ms,
            "e2e_ms": m.e2e_ms,
            "workload_group": self.group,
            "turn": self.turn,
            "probe": self.probe,
            "retried_fresh_connection": self.retried_fresh_connection,
            "first_error": self.first_error,
        }
