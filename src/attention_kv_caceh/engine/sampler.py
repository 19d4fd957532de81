"""Sampler: the next token of each request from its logits row.

Corresponds to vLLM v1's `vllm/v1/sample/sampler.py` and `ops/topk_topp_sampler.py`, one request at a time.
Left out: logprobs, penalties, min_p, logit bias, bad words, batched vectorized kernels.

Per row, in vLLM's order: temperature below SAMPLING_EPS = 1e-5 (0 included) -> argmax (greedy, no random
draw; as vLLM does, since a tinier temperature overflows the division or samples rounding noise). Otherwise divide the logits by
the temperature, keep the top_k largest (top_k > 0), keep the smallest set of most probable tokens whose
probability sums to >= top_p (the "nucleus", Holtzman et al. 2020, always at least the most probable token),
renormalize the softmax over the kept tokens and draw one token by inverse CDF with ONE uniform number from
the request's own `np.random.Generator` (seeded from SamplingParams.seed). A request's draws therefore depend
only on its own seed and its own logits, never on which other requests share the batch.

Ties are broken toward the lower token id everywhere (np.argmax and a stable sort), so top_k=1 and a tiny
top_p pick exactly the greedy token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .request import Request, SamplingParams

__all__ = ["sample", "sample_row"]


def sample_row(
    logits: npt.NDArray[np.floating[Any]], params: SamplingParams, generator: np.random.Generator
) -> int:
    """One token id from a logits row `[V]` (float32/64); see the module docstring for the rule."""
    if params.is_greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature  # [V]
    order = np.argsort(-scaled, kind="stable")  # [V], most probable first, ties by token id
    sorted_logits = scaled[order]
    if params.top_k > 0:
        sorted_logits = sorted_logits[: params.top_k]  # [k]
    probs = np.exp(sorted_logits - sorted_logits[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        # Keep token j while the probability mass BEFORE it is < top_p, so the first token always stays.
        mass_before = np.cumsum(probs) - probs
        probs = probs[mass_before < params.top_p]
        probs /= probs.sum()
    cdf = np.cumsum(probs)
    u = generator.random() * float(cdf[-1])
    j = min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)
    return int(order[j])


def sample(logits: npt.NDArray[np.floating[Any]], requests: Sequence[Request]) -> list[int]:
    """Next token of each request: row i of `logits` `[R, V]` belongs to requests[i].

    Raises:
        ValueError: logits is not 2-D with one row per request, or holds a NaN.
    """
    if logits.ndim != 2 or logits.shape[0] != len(requests):
        raise ValueError(f"logits must be [R={len(requests)}, V], got shape {logits.shape}")
    if np.isnan(logits).any():
        raise ValueError("logits contain NaN")
    return [sample_row(logits[i], r.sampling_params, r.generator) for i, r in enumerate(requests)]
