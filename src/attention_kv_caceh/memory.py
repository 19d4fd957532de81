"""How much memory a command may plan to use, the one up-front memory check, and the one byte formatter.

Every command that holds its data in memory (the scan's arrays, the cache run's caches and rows, the
harness's requests and records) estimates its peak before it starts and compares it with
`MEMORY_FRACTION` of `timing.memory_limit_bytes()` (physical memory, or a lower `ulimit -v`). The other
part is left to Python, NumPy, the interpreter's own allocations and the rest of the machine. A run that
would not fit is refused before any file is touched, with both sizes in the message.
"""

from __future__ import annotations

from attention_kv_caceh.timing import memory_limit_bytes

__all__ = ["MEMORY_FRACTION", "MemoryBudgetError", "check_memory", "format_bytes", "memory_budget_bytes"]

# Share of this process's memory limit a run may plan to use: the estimates count the large arrays and
# rows only, so half is left for everything they do not count.
MEMORY_FRACTION = 0.5


class MemoryBudgetError(ValueError):
    """A run's estimated peak memory is over `memory_budget_bytes()`: bad input, refused up front."""


def memory_budget_bytes() -> int | None:
    """Bytes a run may plan to use: MEMORY_FRACTION of `timing.memory_limit_bytes()`; None when unknown."""
    limit = memory_limit_bytes()
    return None if limit is None else int(limit * MEMORY_FRACTION)


def format_bytes(n: float) -> str:
    """`n` bytes with a binary unit: `512 B`, `1.50 KiB`, `16.00 MiB`, `2.00 GiB` (two decimals)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def check_memory(needed: int, what: str, lower: str) -> None:
    """Raise MemoryBudgetError when `needed` bytes exceed `memory_budget_bytes()`.

    `what` describes the run ("this scan for B=8, T=128"), `lower` names the flags that shrink it. Does
    nothing where the machine's memory is unknown.
    """
    budget = memory_budget_bytes()
    if budget is not None and needed > budget:
        raise MemoryBudgetError(
            f"{what} needs about {format_bytes(needed)}, more than the {format_bytes(budget)} a run may "
            f"plan to use ({MEMORY_FRACTION:.0%} of the memory this process may use); lower {lower}"
        )
