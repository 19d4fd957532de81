"""The n-gram (prompt-lookup) proposer: guess a request's next tokens by finding its last tokens earlier on.

Corresponds to vLLM v1's `vllm/v1/spec_decode/ngram_proposer.py` (NgramProposer and
`_find_longest_matched_ngram_and_propose_tokens`). The rule, the same as vLLM's:

    tokens = prompt + output (the accepted ones), T of them.
    Find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the last n tokens also occur
    earlier, ending before the last token; among the occurrences of that longest n, take the earliest.
    Propose the (at most) k tokens that followed it; none when no n-gram of at least prompt_lookup_min
    tokens recurs, and none past max_model_len (k is capped at max_model_len - T).

Example (min 2, max 3, k 4): tokens [1, 2, 3, 4, 2, 3]: the last 3 tokens [4, 2, 3] do not occur
earlier; the last 2, [2, 3], occur at positions 1..2, followed by [4, 2, 3] (only three tokens follow),
so the proposal is [4, 2, 3].

vLLM finds the match with a Knuth-Morris-Pratt scan of the reversed tokens (O(T)); this version tries
every earlier end position and extends the match backwards (O(T * prompt_lookup_max)), which reads as
the rule above and costs microseconds at the lengths served here. Both are compiled with Numba.
Left out: vLLM's batch-parallel variant (`batch_propose_numba`): one request at a time here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba  # pyright: ignore[reportMissingTypeStubs]
import numpy as np
import numpy.typing as npt

__all__ = ["NgramProposer", "find_ngram_draft"]


@numba.njit(cache=True, nogil=True)  # pyright: ignore[reportUntypedFunctionDecorator]
def _longest_match(tokens: Any, min_n: int, max_n: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """(end, n) of the earliest occurrence of the longest recurring suffix: tokens[end - n + 1 : end + 1]
    == tokens[T - n : T] with end <= T - 2 and min_n <= n <= max_n; (-1, 0) when there is none."""
    t = tokens.shape[0]
    best_end, best_n = -1, 0
    for end in range(t - 1):  # occurrences end before the last token
        n = 0
        while n < max_n and n <= end and tokens[end - n] == tokens[t - 1 - n]:
            n += 1
        if n > best_n:  # strictly longer: the earliest occurrence of each length is kept
            best_end, best_n = end, n
            if n == max_n:
                break  # no later occurrence can be longer
    if best_n < min_n:
        return -1, 0
    return best_end, best_n


def find_ngram_draft(
    tokens: npt.NDArray[np.int64], min_n: int, max_n: int, k: int, max_model_len: int
) -> npt.NDArray[np.int64]:
    """The draft after `tokens` `[T]` int64 (the rule of the module docstring): at most
    min(k, max_model_len - T) tokens, empty when nothing matches. A view of `tokens`."""
    t = tokens.shape[0]
    k = min(k, max_model_len - t)
    if t < min_n or k <= 0:
        return tokens[:0]
    end, _ = _longest_match(tokens, min_n, max_n)
    if end < 0:
        return tokens[:0]
    return tokens[end + 1 : end + 1 + k]


class NgramProposer:
    """Proposes draft tokens for requests from their own tokens (`find_ngram_draft`).

    Args:
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths matched (1 <= min <= max).
        max_model_len: no draft reaches past it.

    Building one compiles the matcher (or loads it from Numba's disk cache), as vLLM's constructor does,
    so no step pays for it.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, max_model_len: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len
        find_ngram_draft(np.zeros(8, dtype=np.int64), self.min_n, self.max_n, 1, max_model_len)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """At most k draft tokens after `token_ids` (a request's prompt + output); [] when none."""
        if k <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [T]
        return find_ngram_draft(tokens, self.min_n, self.max_n, k, self.max_model_len).tolist()
