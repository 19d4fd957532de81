"""SpecDecodingStats: one step's draft and acceptance counts, with vLLM's definitions.

Corresponds to vLLM v1's `vllm/v1/spec_decode/metrics.py` (SpecDecodingStats, and the formulas its
logger and `vllm bench serve` print). Per step, over the requests that verified a draft:

- num_drafts: requests that had draft tokens scheduled (one draft each);
- num_draft_tokens: draft tokens scheduled;
- num_accepted_tokens: draft tokens the model agreed with (counted before a stop condition
  trims the step's tokens, as vLLM counts them);
- num_accepted_tokens_per_pos[i]: drafts whose token at position i was accepted (so every earlier one
  was too).

From sums over a run: acceptance rate = accepted / draft tokens; mean acceptance length = 1 +
accepted / drafts (tokens a verified step yields per request, the bonus or corrected token included);
per-position acceptance rate = accepted_per_pos[i] / drafts.

Left out: vLLM's SpecDecodingLogging (the periodic log line of acceptance rates); SpecDecodingProm, the
Prometheus counters, is in engine/metrics.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["AcceptanceSummary", "SpecDecodingStats", "acceptance_summary"]


@dataclass
class SpecDecodingStats:
    """Counts of one step (or summed over several: `add`); see the module docstring."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list[int])

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one request's verified draft. Raises ValueError for accepted > drafted or > K."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(
                f"need 0 <= accepted ({num_accepted_tokens}) <= drafted ({num_draft_tokens}) <= "
                f"num_spec_tokens ({self.num_spec_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        """Add another step's counts (same num_spec_tokens, or fewer positions)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += n


@dataclass(frozen=True)
class AcceptanceSummary:
    """Sums over several steps and vLLM's derived figures (module docstring): acceptance_rate
    (accepted / draft tokens), acceptance_length (1 + accepted / drafts) and
    per_position_acceptance_rates (accepted_per_pos[i] / drafts); NaN without drafts."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]
    acceptance_rate: float
    acceptance_length: float
    per_position_acceptance_rates: tuple[float, ...]


def acceptance_summary(stats: Iterable[SpecDecodingStats | None], num_spec_tokens: int) -> AcceptanceSummary:
    """The AcceptanceSummary of `stats` (None entries, steps without speculation, skipped)."""
    total = SpecDecodingStats(num_spec_tokens)
    for s in stats:
        if s is not None:
            total.add(s)
    drafts, drafted, accepted = total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens
    return AcceptanceSummary(
        num_drafts=drafts,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        num_accepted_tokens_per_pos=tuple(total.num_accepted_tokens_per_pos),
        acceptance_rate=accepted / drafted if drafted else math.nan,
        acceptance_length=1 + accepted / drafts if drafts else math.nan,
        per_position_acceptance_rates=tuple(
            n / drafts if drafts else math.nan for n in total.num_accepted_tokens_per_pos
        ),
    )
