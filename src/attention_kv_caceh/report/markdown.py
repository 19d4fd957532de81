"""The Markdown building blocks every report section shares: one number format and one table.

Kept apart so the lab sections (`sections.py`), the serving section (`serving.py`) and the environment
card (`environment.py`) write numbers and tables the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["format_number", "markdown_table"]


def format_number(x: float, digits: int = 4) -> str:
    """`x` with `digits` significant digits, in scientific notation when very large or small; "0" for
    zero and "n/a" for NaN or infinity."""
    if isinstance(x, float) and not math.isfinite(x):
        return "n/a"
    if x == 0:
        return "0"
    if abs(x) >= 10 ** (digits + 1) or abs(x) < 10 ** (-digits + 1):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table: one header row, then one row per `rows` entry (floats by `format_number`,
    anything else by `str`)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for row in rows:
        cells = [format_number(c) if isinstance(c, float) else str(c) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
