"""The ideal prefix-hit rate of a trace, read off the trace itself, beside the rate a server measured.

A prefix cache (vLLM v1's, this engine's) keeps full blocks of `block_size` tokens under a hash chained
over every token before them, and a new prompt hits its longest run of leading blocks that are cached,
capped at `(num_tokens - 1) // block_size` blocks (the last prompt token is always computed, to give
the logits of the first output token). The *ideal* cache is such a cache with unbounded memory, filled
in arrival order: request i hits every leading block whose whole prefix (every token up to the block's
end) some earlier request of the trace had, within the cap. A server that never evicts a block the
trace reuses and computes each block before the next request needing it arrives finds exactly these
hits; fewer means its cache evicted them (too small a KV pool) or requests sharing a prefix ran at the
same time; more means a request's blocks were hit twice (a preempted request re-admitted).

Tokens are compared by their labels: position p of a row is the pair (hash_ids[p // C], p % C), C the
trace's tokens per hash id. `trace.py` builds the prompts so that equal labels are equal token ids, so
the ideal is computed at any `block_size`, the server's when it is known (its `/metrics`
`vllm:cache_config_info{block_size=...}`, as vLLM and `serve` export it), else C. The comparison
(`compare_prefix_hits`) allows one block a request: the measured hits equal the ideal when they are
within `block_size` tokens a request of it.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "compare_prefix_hits",
    "ideal_prefix_hits",
    "parse_block_size",
    "read_server_block_size",
]

_CACHE_INFO = "vllm:cache_config_info"

Segment = tuple[int, int, int]  # (hash id, first offset, end offset) of a block's run of one trace chunk


def _block(hash_ids: Sequence[int], chunk: int, start: int, end: int) -> tuple[Segment, ...]:
    """The labels of positions [start, end) as runs of one hash id each."""
    runs: list[Segment] = []
    p = start
    while p < end:
        k, offset = divmod(p, chunk)
        stop = min(end, (k + 1) * chunk)
        runs.append((hash_ids[k], offset, offset + stop - p))
        p = stop
    return tuple(runs)


def ideal_prefix_hits(
    rows: Sequence[tuple[Sequence[int], int]], chunk: int, block_size: int
) -> tuple[int, int]:
    """(hit tokens, queried tokens) of the ideal prefix cache (module docstring) over `rows`, each
    (hash ids, prompt length in tokens) in arrival order; `chunk`: tokens per hash id; `block_size`:
    the cache's tokens per block. The queries are every prompt token, as vLLM counts them.

    A trie of block prefixes: a node is a run of leading blocks, its children keyed by the next
    block's labels, so a lookup costs one dict access a block. Raises ValueError for a chunk or block
    size < 1, or a row whose hash ids do not cover its length.
    """
    if chunk < 1 or block_size < 1:
        raise ValueError(f"chunk and block sizes must be >= 1, got {chunk} and {block_size}")
    children: dict[tuple[int, tuple[Segment, ...]], int] = {}
    hits = queries = 0
    for hash_ids, n in rows:
        if len(hash_ids) * chunk < n:
            raise ValueError(f"{len(hash_ids)} hash ids of {chunk} tokens do not cover {n} tokens")
        queries += n
        cap = (n - 1) // block_size  # blocks that may hit
        node, hit = 0, True
        for j in range(n // block_size):  # every full block is cached once computed
            key = (node, _block(hash_ids, chunk, j * block_size, (j + 1) * block_size))
            child = children.get(key)
            if child is None:
                hit = False
                child = children[key] = len(children) + 1
            elif hit and j < cap:
                hits += block_size
            node = child
    return hits, queries


def parse_block_size(text: str) -> int | None:
    """The `block_size` label of `vllm:cache_config_info` in a Prometheus exposition, or None when
    the exposition has none (or it is not a positive integer)."""
    lines = [line for line in text.splitlines() if _CACHE_INFO in line]
    if not lines:
        return None
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                value = sample.labels.get("block_size", "")
                if value.isdigit() and int(value) > 0:
                    return int(value)
    except ValueError:
        return None
    return None


def read_server_block_size(base_url: str, headers: Mapping[str, str] | None = None) -> int | None:
    """The server's KV block size from its GET /metrics (`parse_block_size`); None when it cannot be
    read or the server does not say. Blocking (urllib): call it between runs."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=10.0) as response:
            return parse_block_size(response.read().decode("utf-8", errors="replace"))
    except (OSError, ValueError, urllib.error.URLError):
        return None


def compare_prefix_hits(
    ideal_hits: int,
    ideal_queries: int,
    counters: Mapping[str, Any] | None,
    *,
    num_requests: int,
    block_size: int,
    block_size_source: str,
) -> dict[str, Any]:
    """The trace's ideal hits beside the server's measured ones (`server_counters` of a summary), their
    difference in tokens and in rate, and a verdict: "equal" (within one block a request,
    `block_size * num_requests` tokens), "below", "above", or "not measured" (no counters)."""
    out: dict[str, Any] = {
        "block_size": block_size,
        "block_size_source": block_size_source,
        "ideal_hit_tokens": ideal_hits,
        "ideal_query_tokens": ideal_queries,
        "ideal_hit_rate": ideal_hits / ideal_queries if ideal_queries else None,
        "tolerance_tokens": block_size * num_requests,
    }
    hits = counters.get("prefix_cache_hits") if counters else None
    queries = counters.get("prefix_cache_queries") if counters else None
    rate = counters.get("prefix_cache_hit_rate") if counters else None
    out |= {"measured_hit_tokens": hits, "measured_query_tokens": queries, "measured_hit_rate": rate}
    if hits is None:
        out |= {"difference_tokens": None, "difference_rate": None, "verdict": "not measured"}
        return out
    diff = hits - ideal_hits
    out["difference_tokens"] = diff
    out["difference_rate"] = rate - out["ideal_hit_rate"] if rate is not None and ideal_queries else None
    out["verdict"] = "equal" if abs(diff) <= out["tolerance_tokens"] else ("below" if diff < 0 else "above")
    return out
