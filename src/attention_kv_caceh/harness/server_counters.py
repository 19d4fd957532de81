"""The server's cumulative counters around one run: `/metrics` read before and after, and the difference.

vLLM (and `serve`) export counters whose difference over a run says what the server did for it:
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (tokens looked up in the prefix
cache and tokens found there: the run's hit rate is hits / queries), `vllm:num_preemptions_total`,
`vllm:prompt_tokens_total` and `vllm:generation_tokens_total` (tokens the engine prefilled and generated,
compared with the client's own counts), and `vllm:request_success_total{finished_reason=...}` (requests
by finish reason). A counter is summed over its label sets except `finished_reason`, which is kept.

With speculative decoding, vLLM's spec-decode counters too (`vllm:spec_decode_num_drafts_total`,
`..._num_draft_tokens_total`, `..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total`
by `position`), and from their differences what `vllm bench serve` reports (its
`fetch_spec_decode_metrics`): acceptance rate (%) = accepted / draft tokens, acceptance length = 1 +
accepted / drafts, and per position accepted_per_pos[i] / drafts; nothing when the run drafted nothing.

Also `reset_prefix_cache`: vLLM's `POST /reset_prefix_cache`, sent between the points of a sweep so that
each point starts from an empty prefix cache; a server without it (404, 405) is recorded as not offering
it, never an error. Both are blocking (urllib) and run between runs, never while requests are timed.
"""

from __future__ import annotations

import asyncio
import math
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from attention_kv_caceh.harness.records import RequestRecord

__all__ = [
    "COUNTER_NAMES",
    "SETTLE_S",
    "CounterSnapshot",
    "RunCounters",
    "counter_delta",
    "counter_warnings",
    "read_counters",
    "reset_prefix_cache",
    "spec_decode_delta",
    "spec_decode_result",
]

# Summary key -> the exposed sample name (a counter's `_total` sample).
COUNTER_NAMES = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "spec_decode_num_drafts": "vllm:spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
_SUCCESS = "vllm:request_success_total"
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_WANTED = frozenset((*COUNTER_NAMES.values(), _SUCCESS, _PER_POS))
_TIMEOUT_S = 10.0
SETTLE_S = 1.0  # how long the read after a run waits for the server's counters to catch up


@dataclass(frozen=True)
class CounterSnapshot:
    """The counters at one moment: {summary key: value} (absent: the server does not export it),
    {finish reason: requests} and {draft position: accepted tokens}."""

    values: Mapping[str, float]
    finished: Mapping[str, float]
    accepted_per_pos: Mapping[int, float] = field(default_factory=dict[int, float])


def _root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def parse_counters(text: str) -> CounterSnapshot:
    """The counters of a Prometheus exposition `text` (only their lines are parsed).

    Raises ValueError when those lines are not in the Prometheus text format or a value is not a finite
    number >= 0.
    """
    kept: list[str] = []
    for line in text.splitlines():
        body = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        name = body.split("{", 1)[0].split(" ", 1)[0]
        # a counter's TYPE/HELP line names the family (no `_total`); its sample has it
        if name in _WANTED or f"{name}_total" in _WANTED:
            kept.append(line)
    values: dict[str, float] = {}
    finished: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    by_sample = {sample: key for key, sample in COUNTER_NAMES.items()}
    for family in text_string_to_metric_families("\n".join(kept) + "\n"):
        for sample in family.samples:
            value = float(sample.value)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{sample.name} = {value!r}: not a finite count")
            if sample.name == _SUCCESS:
                reason = sample.labels.get("finished_reason", "")
                finished[reason] = finished.get(reason, 0.0) + value
            elif sample.name == _PER_POS:
                position = sample.labels.get("position", "")
                if not position.isdigit():
                    raise ValueError(f"{sample.name}: position label {position!r} is not a number")
                per_pos[int(position)] = per_pos.get(int(position), 0.0) + value
            elif sample.name in by_sample:
                key = by_sample[sample.name]
                values[key] = values.get(key, 0.0) + value
    return CounterSnapshot(values, finished, per_pos)


def read_counters(
    base_url: str, headers: Mapping[str, str] | None = None
) -> tuple[CounterSnapshot | None, str]:
    """GET `/metrics` at the server's root: (the counters, "") or (None, why not). Never raises for a
    server that cannot be reached or answers something else."""
    url = _root(base_url) + "/metrics"
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            text = response.read().decode("utf-8", errors="replace")
        return parse_counters(text), ""
    except urllib.error.HTTPError as exc:
        return None, f"GET {url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return None, f"GET {url}: {type(exc).__name__}: {exc}"


def _whole(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def counter_delta(
    before: CounterSnapshot, after: CounterSnapshot, *, client_prompt_tokens: int, client_output_tokens: int
) -> dict[str, Any]:
    """The run's server counters: after - before for each counter both snapshots have (None where the
    server does not export it), `prefix_cache_hit_rate` = hits / queries (None without queries),
    `finished_requests` by reason, and the server's prompt and generation tokens beside the client's
    counts (`client_prompt_tokens`, `client_output_tokens` of the successful requests) with their
    difference. A counter that went down (the server restarted) is None and listed in `counter_resets`."""
    out: dict[str, Any] = {}
    resets: list[str] = []
    for key in COUNTER_NAMES:
        if key in before.values and key in after.values:
            diff = after.values[key] - before.values[key]
            if diff < 0:
                resets.append(COUNTER_NAMES[key])
                out[key] = None
            else:
                out[key] = _whole(diff)
        else:
            out[key] = None
    queries, hits = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = hits / queries if queries and hits is not None else None
    out["finished_requests"] = {
        reason: _whole(after.finished[reason] - before.finished.get(reason, 0.0))
        for reason in sorted(after.finished)
        if after.finished[reason] - before.finished.get(reason, 0.0) > 0
    }
    out["client_prompt_tokens"] = client_prompt_tokens
    out["client_output_tokens"] = client_output_tokens
    out["prompt_tokens_diff"] = (
        None if out["prompt_tokens"] is None else out["prompt_tokens"] - client_prompt_tokens
    )
    out["generation_tokens_diff"] = (
        None if out["generation_tokens"] is None else out["generation_tokens"] - client_output_tokens
    )
    out["counter_resets"] = resets
    out["spec_decode"] = spec_decode_delta(before, after)
    return out


def spec_decode_delta(before: CounterSnapshot, after: CounterSnapshot) -> dict[str, Any] | None:
    """What `vllm bench serve` computes from the spec-decode counters around a run (module docstring):
    num_drafts, draft_tokens, accepted_tokens, acceptance_rate (percent), acceptance_length and
    per_position_acceptance_rates; None when the server does not export them or the run drafted no
    token."""
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    if any(k not in before.values or k not in after.values for k in keys):
        return None
    drafts, drafted, accepted = (after.values[k] - before.values[k] for k in keys)
    if drafted <= 0:
        return None
    positions = sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos))
    per_pos = [
        (after.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)) / drafts
        if drafts > 0
        else 0.0
        for p in positions
    ]
    return {
        "num_drafts": _whole(drafts),
        "draft_tokens": _whole(drafted),
        "accepted_tokens": _whole(accepted),
        "acceptance_rate": 100 * accepted / drafted,
        "acceptance_length": 1 + accepted / drafts if drafts > 0 else 0.0,
        "per_position_acceptance_rates": per_pos,
    }


def spec_decode_result(delta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keys `vllm bench serve` adds to its result JSON for a run that drafted tokens
    (`spec_decode_acceptance_rate`, `..._acceptance_length`, `..._num_drafts`, `..._draft_tokens`,
    `..._accepted_tokens`, `..._per_position_acceptance_rates`); {} otherwise."""
    spec = None if delta is None else delta.get("spec_decode")
    if spec is None:
        return {}
    return {
        "spec_decode_acceptance_rate": spec["acceptance_rate"],
        "spec_decode_acceptance_length": spec["acceptance_length"],
        "spec_decode_num_drafts": spec["num_drafts"],
        "spec_decode_draft_tokens": spec["draft_tokens"],
        "spec_decode_accepted_tokens": spec["accepted_tokens"],
        "spec_decode_per_position_acceptance_rates": spec["per_position_acceptance_rates"],
    }


def reset_prefix_cache(base_url: str, headers: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """POST `/reset_prefix_cache` (vLLM's endpoint): (True, "") when the server answered 2xx, else
    (False, why: "not offered (HTTP 404)", another status, or a connection error). Never raises."""
    url = _root(base_url) + "/reset_prefix_cache"
    request = urllib.request.Request(url, data=b"", method="POST", headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            response.read()
        return True, ""
    except urllib.error.HTTPError as exc:
        if exc.code in (404, 405):
            return False, f"not offered (HTTP {exc.code})"
        return False, f"POST {url}: HTTP {exc.code}"
    except OSError as exc:
        return False, f"POST {url}: {type(exc).__name__}: {exc}"


def _client_counts(records: Sequence[RequestRecord]) -> tuple[int, int]:
    """(prompt tokens, output tokens) the client counted over every request the server answered."""
    answered = [r for r in records if r.http_status == 200 or r.ok]
    return sum(r.prompt_tokens or 0 for r in answered), sum(r.output_tokens for r in answered)


def _tokens(snapshot: CounterSnapshot) -> tuple[float | None, float | None]:
    return snapshot.values.get("prompt_tokens"), snapshot.values.get("generation_tokens")


class RunCounters:
    """The server's counters around one run (module docstring): `read_before()` just before the load,
    `read_after(records)` just after it, then `delta(records)`. Disabled (every method a no-op, `delta`
    None) for the simulated backend. `error` says why the counters could not be read (a server
    without /metrics, say); it is never raised."""

    def __init__(self, base_url: str, headers: Mapping[str, str] | None, *, enabled: bool) -> None:
        self.base_url = base_url
        self.headers = dict(headers or {})
        self.enabled = enabled
        self.before: CounterSnapshot | None = None
        self.after: CounterSnapshot | None = None
        self.error = ""

    async def snapshot(self) -> CounterSnapshot | None:
        """The counters now (None when they cannot be read; `error` says why)."""
        if not self.enabled:
            return None
        snapshot, why = await asyncio.to_thread(read_counters, self.base_url, self.headers)
        if snapshot is None:
            self.error = self.error or why
        return snapshot

    async def read_before(self) -> None:
        """Read the counters before the load. The smoke test and warm-up requests may still be adding
        their last step, so the read is repeated (up to SETTLE_S) until two reads 50 ms apart agree on
        the prompt and generation tokens."""
        deadline = time.monotonic() + SETTLE_S
        self.before = await self.snapshot()
        while self.before is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            again = await self.snapshot()
            if again is None or _tokens(again) == _tokens(self.before):
                self.before = again if again is not None else self.before
                return
            self.before = again

    async def read_after(self, records: Sequence[RequestRecord]) -> None:
        """Read the counters after the load. A server may add a request's last step to its counters just
        after the stream ends, so the read is repeated (up to SETTLE_S) until the generation tokens
        reach the client's count."""
        if self.before is None:
            return
        _, output = _client_counts(records)
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.after = await self.snapshot()
            if self.after is None or time.monotonic() > deadline:
                return
            generated = self.after.values.get("generation_tokens", 0.0) - self.before.values.get(
                "generation_tokens", 0.0
            )
            if "generation_tokens" not in self.after.values or generated >= output:
                return
            await asyncio.sleep(0.05)

    def delta(self, records: Sequence[RequestRecord]) -> dict[str, Any] | None:
        """`counter_delta` of the run against the client's counts of `records`; None without both
        snapshots."""
        if self.before is None or self.after is None:
            return None
        prompt, output = _client_counts(records)
        return counter_delta(
            self.before, self.after, client_prompt_tokens=prompt, client_output_tokens=output
        )


def counter_warnings(delta: Mapping[str, Any]) -> list[str]:
    """Lines for a summary's warnings: the server's token counts that differ from the client's, and
    counters that went down during the run."""
    out: list[str] = []
    for what, key, client in (
        ("prompt", "prompt_tokens", "client_prompt_tokens"),
        ("generation", "generation_tokens", "client_output_tokens"),
    ):
        diff = delta.get(f"{key}_diff")
        if diff:
            out.append(
                f"the server's /metrics counted {delta[key]} {what} tokens in the run, the client "
                f"{delta[client]} ({diff:+d}); another client may be using the server"
            )
    if delta.get("counter_resets"):
        out.append(
            f"server counters went down during the run (restarted?): {', '.join(delta['counter_resets'])}"
        )
    return out
