"""apply_token_bitmask: a grammar's bitmask row applied to a logits row before sampling.

Corresponds to vLLM's `apply_grammar_bitmask` in `vllm/v1/structured_output/utils.py` (xgrammar's
`apply_token_bitmask_inplace` on the GPU). Left out: the batched in-place kernel over the whole logits
tensor: here one row at a time, in float64 (the sampler's own precision), leaving the raw logits
untouched so the logprobs the runner reports stay those of the model's raw distribution.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["allowed_tokens", "apply_token_bitmask"]


def allowed_tokens(mask_row: npt.NDArray[np.int32], vocab_size: int) -> npt.NDArray[np.bool_]:
    """The bitmask row `[ceil(V_g / 32)]` int32 (token t is bit t % 32 of word t // 32) as booleans `[V]`;
    ids past the mask's own vocabulary (a model whose vocab_size exceeds its tokenizer's) are not allowed."""
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")  # [32 * W], little-endian words
    if bits.shape[0] >= vocab_size:
        return bits[:vocab_size].astype(bool)
    out = np.zeros(vocab_size, dtype=bool)
    out[: bits.shape[0]] = bits
    return out


def apply_token_bitmask(
    row: npt.NDArray[np.floating[Any]], mask_row: npt.NDArray[np.int32]
) -> npt.NDArray[np.float64]:
    """`row` `[V]` as float64 with every token the mask forbids at -inf (a copy).

    Raises ValueError when the mask forbids every token (a grammar in error: nothing could be sampled)."""
    allowed = allowed_tokens(mask_row, row.shape[0])
    if not allowed.any():
        raise ValueError("the grammar allows no token at this position")
    return np.where(allowed, row.astype(np.float64), -np.inf)
