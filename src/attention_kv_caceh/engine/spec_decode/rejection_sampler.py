"""Verification of a draft: which of a request's draft tokens the model keeps, and the token after.

Corresponds to vLLM v1's `vllm/v1/sample/rejection_sampler.py` for drafts without a draft distribution
(n-gram drafts: vLLM treats them as one-hot). One request at a time, with its own SamplingParams and
generator, like `engine/sampler.py`.

The runner gives the model's logits at the draft's k + 1 positions: row j follows the request's
tokens and draft[:j] (row 0 follows its last accepted token). For j = 0, 1, ...: row j goes through the
request's logits processors as if draft[:j] were already output tokens (so min_tokens, the penalties and
the logprobs mean at each position what they mean without speculation), then one token t_j is taken
from it exactly as `sampler.sample_row` takes a token (argmax at temperature 0, else a draw of the
request's generator). If j < k and t_j == draft[j], the draft token is accepted and row j + 1 applies;
otherwise t_j is the step's last token: the correction of a rejected draft token, or the bonus token
after a fully accepted draft. So a step yields between 1 and k + 1 tokens.

Why the output distribution is the model's. Each emitted token t_j is a sample of the model's
distribution p_j given everything emitted before it, since row j's context is exactly the tokens
emitted so far (they equal draft[:j]). So the emitted sequence is sampled as plain decoding samples it,
one token from p_j at a time, and at temperature 0 it is plain greedy decoding token for token.

It is also exactly rejection sampling (Leviathan et al. 2023; Chen et al. 2023) with a one-token draft
distribution q = one-hot(d), d = draft[j]. Rejection sampling accepts d with probability
min(1, p(d) / q(d)) = p(d), and on rejection draws from the residual max(0, p - q) normalized, which is
p(t) / (1 - p(d)) for t != d and 0 for d. Here P(accept) = P(t_j = d) = p(d), and given a rejection
t_j is distributed as p restricted to t != d and renormalized: the same two distributions. What this
form adds: one draw of the generator per emitted token, as without speculation, so a seeded request
yields the same tokens with and without speculation wherever the logits are equal.

With a grammar (structured outputs), row j is also masked by the grammar's bitmask row j, computed after
the grammar consumed draft[:j] (StructuredOutputManager.grammar_bitmask): the token taken at row j is the
one plain decoding would take there, so greedy output is the same with and without drafts.

Left out: drafts that come with a draft distribution (a draft model or EAGLE: acceptance by min(1, p / q) and
the residual draw from max(0, p - q)), and vLLM's batched kernels over every request's drafts at once (here
one request at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.engine.request import Request
from attention_kv_caceh.engine.sampler import apply_logits_processors, sample_row
from attention_kv_caceh.engine.structured_output.utils import apply_token_bitmask

__all__ = ["verify_draft"]

_MAX_LOGIT = float(np.finfo(np.float32).max)  # as sampler.sample: the penalties' bounds assume it


def verify_draft(
    logits: npt.NDArray[np.floating[Any]],
    request: Request,
    draft: Sequence[int],
    masks: npt.NDArray[np.int32] | None = None,
) -> list[int]:
    """The tokens one verification step yields for `request` (see the module docstring).

    logits `[k + 1, V]` (k = len(draft)): row j after the request's tokens and draft[:j]. Returns
    1 .. k + 1 token ids: the accepted draft prefix, then the model's own next token. Token j's
    logprobs come from raw row j, as `sampler.sample`'s do from its row (the model runner's
    `sample_tokens` takes them). `masks`: the grammar's bitmask rows `[k + 1, W]` int32, or None.

    Raises:
        ValueError: logits is not `[len(draft) + 1, V]`, or holds a NaN, an infinity or a value past
            float32's range (as `sampler.sample` refuses them).
    """
    if logits.ndim != 2 or logits.shape[0] != len(draft) + 1:
        raise ValueError(f"logits must be [k + 1 = {len(draft) + 1}, V], got shape {logits.shape}")
    if not -_MAX_LOGIT <= logits.min() <= logits.max() <= _MAX_LOGIT:  # NaN fails too
        raise ValueError(f"logits contain NaN, an infinity or a value past +-{_MAX_LOGIT:.4g}")
    params = request.sampling_params
    plain = not params.logit_bias and not params.has_penalties and params.min_tokens == 0
    tokens: list[int] = []
    for j in range(len(draft) + 1):
        row = logits[j] if plain else apply_logits_processors(logits[j], request, tokens)  # [V]
        if masks is not None:
            row = apply_token_bitmask(row, masks[j])
        token = sample_row(row, params, request.generator)
        tokens.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return tokens
