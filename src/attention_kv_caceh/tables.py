"""The one table writer: every table the commands print and every Markdown table they write.

`text_table` is the fixed-width form printed on a terminal, `markdown_table` the Markdown form written
beside a raw file and collected by the report; both take a header and rows of cells. `format_number` is
the report's number format (floats given to `markdown_table` go through it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["format_number", "markdown_table", "text_table"]


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


def _cell(value: object) -> str:
    return format_number(value) if isinstance(value, float) else str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table: one header row, then one row per `rows` entry (floats by `format_number`,
    anything else by `str`; a `|` inside a cell is escaped)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines) + "\n"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "") -> str:
    """A fixed-width table: each column right-aligned to its widest cell, a rule under the header."""
    cells = [[_cell(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return indent + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))

    return "\n".join([line(headers), indent + "-" * (sum(widths) + 2 * (len(widths) - 1)), *map(line, cells)])
