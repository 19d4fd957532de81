"""The report's section of a harness run's repeats (`harness --repeats N`): every headline metric's mean
and 95 % confidence interval over the repeats, recomputed from the repeats' own JSONL files.

The harness writes repeat i of `--jsonl x.jsonl` as `x-rI.jsonl`, whose `.meta.json` says
`repeat: {index, count, of: "x.jsonl"}`. Each file's records are summarized as its serving section
summarizes them (`serving.summarize_file`), and the intervals come from the harness's own
`harness.repeats.repeat_intervals` (Student's t), so `report` and `harness` state the same intervals.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.repeats import repeat_intervals
from attention_kv_caceh.report.serving import summarize_file
from attention_kv_caceh.tables import markdown_table

__all__ = ["RepeatFile", "repeat_of", "repeats_section"]


@dataclass(frozen=True)
class RepeatFile:
    """One repeat's JSONL: its index, the count the run asked for, its file name and records, and its
    metadata."""

    index: int
    count: int
    name: str
    records: Sequence[RequestRecord]
    meta: Mapping[str, Any]


def repeat_of(meta: Mapping[str, Any] | None) -> tuple[str, int, int] | None:
    """(the `--jsonl` name the repeats share, index, count) of a repeat's metadata, or None for a run
    that is not one repeat of several (or whose `repeat` block is malformed)."""
    block: Any = meta.get("repeat") if meta is not None else None
    if not isinstance(block, dict):
        return None
    info = typing.cast("dict[str, Any]", block)
    of, index, count = info.get("of"), info.get("index"), info.get("count")
    if not (isinstance(of, str) and isinstance(index, int) and isinstance(count, int)):
        return None
    if isinstance(index, bool) or isinstance(count, bool) or not 0 <= index < count:
        return None
    return of, index, count


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}"


def repeats_section(of: str, files: Sequence[RepeatFile]) -> str:
    """The intervals of the repeats of `of` (module docstring), with each repeat's value of each metric.
    Only repeats whose metadata says `status: complete` count (an interrupted repeat's records are a
    shorter run, not a sample of the same one); the section names the ones it leaves out. Raises
    ValueError when a repeat's records cannot be summarized."""
    count = max(f.count for f in files)
    ordered = sorted((f for f in files if f.meta.get("status") == "complete"), key=lambda f: f.index)
    left_out = sorted((f for f in files if f.meta.get("status") != "complete"), key=lambda f: f.index)
    found = f"{len(ordered)} of {count} repeats"
    if left_out:
        names = ", ".join(f"`{f.name}` ({f.meta.get('status', 'no status')})" for f in left_out)
        found += f" ({len(left_out)} left out, not complete: {names})"
    elif len(ordered) != count:
        found += " (the others are missing)"
    if not ordered:
        return f"### Repeats of `{of}`: {found}\n\nNo complete repeat: no interval.\n"
    summaries = [summarize_file(f.records, f.meta) for f in ordered]
    intervals = repeat_intervals(summaries)
    rows: list[list[object]] = []
    for metric, ci in intervals.items():
        interval = "-" if ci["low"] is None else f"[{_num(ci['low'])}, {_num(ci['high'])}]"
        half = "-" if ci["half_width"] is None else f"± {_num(ci['half_width'])}"
        rows.append(
            [metric, ci["n"], _num(ci["mean"]), interval, half, ", ".join(_num(v) for v in ci["values"])]
        )
    return (
        f"### Repeats of `{of}`: {found}\n\n"
        f"Files: {', '.join(f'`{f.name}`' for f in ordered)}. Mean and 95 % confidence interval of each "
        "headline metric over the complete repeats: mean ± t(0.975, n - 1) × s / √n, s the sample standard "
        "deviation (`harness.repeats`); each repeat's value recomputed from its records.\n\n"
        + markdown_table(["metric", "n", "mean", "95 % CI", "half width", "repeats"], rows)
        + ("\nOne repeat: no interval.\n" if len(ordered) < 2 else "")
    )
