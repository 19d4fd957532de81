"""Sampler: the next token of each request from its logits row, and the log-probabilities asked for.

Corresponds to vLLM v1's `vllm/v1/sample/sampler.py`, `ops/topk_topp_sampler.py`, `ops/penalties.py`, the
logit-bias and min-tokens logits processors and `vllm/model_executor/layers/utils.py` (apply_penalties),
one request (one row of the batch) at a time, each with its own SamplingParams. A structured request's
row is masked by its grammar's bitmask row last, after the penalties (structured_output/utils.py), so
only tokens its grammar allows can be drawn. Left out: min_p, bad words, allowed token ids, vectorized
kernels over the whole batch.

Per row, in vLLM's order: the logprobs are taken first, from the raw logits (vLLM's default
`raw_logprobs`); then the logit bias is added; eos and the stop token ids are masked (-inf) while the
request has fewer than `min_tokens` output tokens; then the penalties:
repetition_penalty over the prompt and output tokens (logit / p where the logit is > 0, logit * p
otherwise; Keskar et al. 2019, as vLLM and transformers apply it), then OpenAI's
`logit -= frequency_penalty * count + presence_penalty * (count > 0)` over the output tokens. Then temperature below SAMPLING_EPS = 1e-5 (0 included) -> argmax (greedy, no random
draw; as vLLM does, since a tinier temperature overflows the division or samples rounding noise). Otherwise divide the logits by
the temperature, keep the top_k largest (top_k > 0), keep the smallest set of most probable tokens whose
probability sums to >= top_p (the "nucleus", Holtzman et al. 2020, always at least the most probable token),
renormalize the softmax over the kept tokens and draw one token by inverse CDF with ONE uniform number from
the request's own `np.random.Generator` (seeded from SamplingParams.seed). The kept tokens are ordered
most probable first when top_k or top_p restricts them (top_k alone: np.partition, then a sort of k ids;
top_p: a sort of the vocabulary); with neither, the CDF runs over the whole vocabulary in token-id order,
the same distribution without sorting V logits per token. A request's draws therefore depend
only on its own seed and its own logits, never on which other requests share the batch.

Ties are broken toward the lower token id everywhere (np.argmax and a stable sort), so top_k=1 and a tiny
top_p pick exactly the greedy token.

Every value computed stays finite for every value SamplingParams accepts (the min_tokens mask aside, whose
-inf is the point): `sample` refuses logits that are NaN, infinite or past float32's range (|x| > 3.4e38,
which no model here produces), the bias is at most 100 in size, the repetition penalty within
[1e-100, 1e100] and the frequency and presence penalties within [-2, 2], so a penalized logit is at most
about 3.4e138 in size and divided by a temperature of at least SAMPLING_EPS at most 3.4e143; softmax then
subtracts the maximum, so exp() underflows to 0 where it must and never overflows. A min_tokens mask that
would cover every token (stop ids listing the whole vocabulary) is not applied: the server refuses such a
request up front, and in the engine it would otherwise leave nothing to sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .request import Request, SamplingParams, TokenLogprobs
from .structured_output.utils import apply_token_bitmask

__all__ = ["apply_logits_processors", "sample", "sample_row", "token_logprobs"]

_MAX_LOGIT = float(np.finfo(np.float32).max)  # the largest logit `sample` accepts, in size


def apply_logits_processors(
    logits: npt.NDArray[np.floating[Any]], request: Request, pending: Sequence[int] = ()
) -> npt.NDArray[np.float64]:
    """The request's logits row `[V]` after logit bias, the min_tokens mask and the penalties (float64 copy).

    `pending`: output tokens the request has at this row beyond `request.output_token_ids` (a
    speculative step's tokens accepted before this position), counted as output tokens. Bias ids outside
    `[0, V)` are ignored here (the server refuses them before).
    """
    params = request.sampling_params
    row = logits.astype(np.float64)  # [V]
    vocab = row.shape[0]
    for token_id, bias in params.logit_bias:
        if 0 <= token_id < vocab:
            row[token_id] += bias
    if request.num_output_tokens + len(pending) < params.min_tokens:
        stops = list(params.stop_token_ids)
        if not params.ignore_eos and request.eos_token_id is not None:
            stops.append(request.eos_token_id)
        stop_ids = np.unique(np.array([t for t in stops if 0 <= t < vocab], dtype=np.int64))
        if stop_ids.size < vocab:  # a mask over every token would leave nothing to sample
            row[stop_ids] = -np.inf
    if not params.has_penalties:
        return row
    output = np.asarray([*request.output_token_ids, *pending], dtype=np.int64)
    if params.repetition_penalty != 1.0:
        seen = np.zeros(vocab, dtype=bool)  # [V]
        prompt = np.asarray(request.prompt_token_ids, dtype=np.int64)
        seen[prompt[prompt < vocab]] = True
        seen[output[output < vocab]] = True
        p = params.repetition_penalty
        row = np.where(seen, np.where(row > 0, row / p, row * p), row)
    counts = np.bincount(output[output < vocab], minlength=vocab).astype(np.float64)  # [V]
    row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return row


def token_logprobs(logits: npt.NDArray[np.floating[Any]], token_id: int, k: int) -> TokenLogprobs:
    """TokenLogprobs of `token_id` under a logits row `[V]`: log-softmax in float64, rank, top k.

    log_softmax(x)_t = x_t - max(x) - log(sum(exp(x - max(x)))).
    """
    row = logits.astype(np.float64)  # [V]
    shifted = row - row.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())  # [V]
    rank = 1 + int(np.count_nonzero(row > row[token_id]))
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        order = np.argsort(-row, kind="stable")[:k]  # [k], most probable first, ties by token id
        top = tuple((int(t), float(logprobs[t])) for t in order)
    return TokenLogprobs(int(token_id), float(logprobs[token_id]), rank, top)


def _top_k_ids(scaled: npt.NDArray[np.float64], k: int) -> npt.NDArray[np.intp]:
    """Ids of the k largest entries of `scaled` `[V]` (0 < k < V), ties at the boundary to the lower ids;
    np.partition finds the k-th largest value in O(V), so no full sort of the vocabulary is needed."""
    kth = np.partition(scaled, scaled.size - k)[scaled.size - k]  # the k-th largest value
    above = np.flatnonzero(scaled > kth)
    tied = np.flatnonzero(scaled == kth)[: k - above.size]
    return np.concatenate([above, tied])


def sample_row(
    logits: npt.NDArray[np.floating[Any]], params: SamplingParams, generator: np.random.Generator
) -> int:
    """One token id from a logits row `[V]` (float32/64); see the module docstring for the rule."""
    if params.is_greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature  # [V]
    order: npt.NDArray[np.intp] | None = None  # None: the whole vocabulary in token-id order
    if params.top_k > 0 or params.top_p < 1.0:
        ids = _top_k_ids(scaled, params.top_k) if 0 < params.top_k < scaled.size else np.arange(scaled.size)
        order = ids[np.lexsort((ids, -scaled[ids]))]  # most probable first, ties by token id
    values = scaled if order is None else scaled[order]
    probs = np.exp(values - values.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        # Keep token j while the probability mass BEFORE it is < top_p, so the first token always stays.
        mass_before = np.cumsum(probs) - probs
        probs = probs[mass_before < params.top_p]
        probs /= probs.sum()
    cdf = np.cumsum(probs)
    u = generator.random() * float(cdf[-1])
    j = min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)
    return j if order is None else int(order[j])


def sample(
    logits: npt.NDArray[np.floating[Any]],
    requests: Sequence[Request],
    masks: Sequence[npt.NDArray[np.int32] | None] | None = None,
) -> list[int]:
    """Next token of each request: row i of `logits` `[R, V]` belongs to requests[i]. The logprobs of
    the sampled tokens come from the same raw rows (`token_logprobs`; the model runner's
    `sample_tokens` takes them). `masks[i]`: request i's grammar bitmask row `[W]` int32, or None.

    Raises:
        ValueError: logits is not 2-D with one row per request, or holds a NaN, an infinity or a value
            past float32's range (see the module docstring: the penalties' bounds assume it); a mask
            that allows no token.
    """
    if logits.ndim != 2 or logits.shape[0] != len(requests):
        raise ValueError(f"logits must be [R={len(requests)}, V], got shape {logits.shape}")
    if logits.size and not -_MAX_LOGIT <= logits.min() <= logits.max() <= _MAX_LOGIT:  # NaN fails too
        raise ValueError(f"logits contain NaN, an infinity or a value past +-{_MAX_LOGIT:.4g}")
    tokens: list[int] = []
    for i, request in enumerate(requests):
        params = request.sampling_params
        plain = not params.logit_bias and not params.has_penalties and params.min_tokens == 0
        row = logits[i] if plain else apply_logits_processors(logits[i], request)
        mask = None if masks is None else masks[i]
        if mask is not None:
            row = apply_token_bitmask(row, mask)
        tokens.append(sample_row(row, params, request.generator))
    return tokens
