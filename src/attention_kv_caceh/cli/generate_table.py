"""The per-step table `generate` prints: one row per engine step, as the step ends.

Columns (the numbers of `engine.llm_engine.StepStats`):
    step      step index (0, 1, ...)
    reqs      requests scheduled in the step (the batch's R)
    tokens    tokens computed in the step (the flattened batch's N), = prefill + decode
    prefill   tokens of prompt chunks (and of recomputation after a preemption)
    decode    tokens of requests computing their newest sampled token (1 each)
    run/wait  num_requests_running / num_requests_waiting after the step
    free      free KV blocks after the step (kv% = used / total blocks)
    preempt   requests preempted in the step (their blocks freed, recomputed later)
    hit/query prompt tokens found in / looked up in the prefix cache at the step's admissions
    ms        wall time of the step
    batch     request:tokens of every scheduled request, in batch order; `*` marks a request that
              finished in the step

Rows: each of the first 50 steps (ALWAYS_ROWS); after that, only the steps where something changes (a prefill
chunk or admission, a preemption, a finished request, a prefix-cache lookup, a different running or
waiting count), every 25th step (EVERY), and the last step. A line says how many unchanged decode steps
were left out between two rows; --trace of `generate` keeps every step.
"""

from __future__ import annotations

from typing import Any, TextIO

__all__ = ["ALWAYS_ROWS", "EVERY", "StepTable"]

ALWAYS_ROWS = 50
"""Steps printed unconditionally at the start."""
EVERY = 25
"""After ALWAYS_ROWS, an unchanged step is still printed when its index is a multiple of this."""
_BATCH_WIDTH = 60

_HEADER = (
    f"{'step':>5} {'reqs':>4} {'tokens':>6} {'prefill':>7} {'decode':>6} {'run':>4} {'wait':>4} "
    f"{'free':>6} {'kv%':>5} {'preempt':>7} {'hit/query':>11} {'ms':>8}  batch (request:tokens, *finished)"
)


class StepTable:
    """Prints the header, then a row per StepStats under the row rule above, to `stream`."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.skipped = 0
        self.rows = 0
        self._previous: tuple[int, int] | None = None

    def header(self) -> None:
        """The column names and a rule."""
        print(_HEADER, file=self.stream)
        print("-" * len(_HEADER), file=self.stream)

    def _changed(self, stats: Any, finished: list[str]) -> bool:
        counts = (stats.num_running, stats.num_waiting)
        return bool(
            stats.num_prefill_tokens
            or stats.num_preemptions
            or finished
            or stats.prefix_cache_queries
            or counts != self._previous
        )

    def row(self, stats: Any, finished: list[str], *, last: bool = False) -> bool:
        """Print the row of one StepStats if the rule says so; return whether it was printed."""
        changed = self._changed(stats, finished)
        self._previous = (stats.num_running, stats.num_waiting)
        index = int(stats.step_index)
        if not (index < ALWAYS_ROWS or changed or index % EVERY == 0 or last):
            self.skipped += 1
            return False
        self._flush_skipped()
        done = set(finished)
        batch = " ".join(
            f"{rid}:{n}{'*' if rid in done else ''}" for rid, n in stats.num_scheduled_tokens.items()
        )
        if len(batch) > _BATCH_WIDTH:
            batch = batch[: _BATCH_WIDTH - 3] + "..."
        tokens = sum(stats.num_scheduled_tokens.values())
        hits = f"{stats.prefix_cache_hits}/{stats.prefix_cache_queries}"
        print(
            f"{index:>5} {len(stats.num_scheduled_tokens):>4} {tokens:>6} {stats.num_prefill_tokens:>7} "
            f"{stats.num_decode_tokens:>6} {stats.num_running:>4} {stats.num_waiting:>4} "
            f"{stats.num_free_blocks:>6} {100 * stats.kv_cache_usage:>5.1f} {stats.num_preemptions:>7} "
            f"{hits:>11} {stats.step_time_ms:>8.2f}  {batch}",
            file=self.stream,
        )
        self.rows += 1
        return True

    def _flush_skipped(self) -> None:
        if self.skipped:
            print(f"{'':>5} ... {self.skipped} decode steps without change not shown", file=self.stream)
            self.skipped = 0

    def footer(self) -> None:
        """The count of steps left out at the end (an interrupted run), then a rule."""
        self._flush_skipped()
        print("-" * len(_HEADER), file=self.stream)
