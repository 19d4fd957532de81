"""The report's section of a sweep (`sweep --out-dir DIR`): DIR/sweep.csv, read strictly, and the
DIR/sweep.json beside it.

The CSV's columns are `harness.sweep.CSV_FIELDS` (one row per point and repeat, `harness.sweep.sweep_row`);
the knee is recomputed from the rows by `harness.sweep.find_knee`, and an SLO search's tries (a sweep.json
with an `slo` block: every row is one try) are judged again against its pass fraction. The sweep.json
gives the environment card its column and says whether the sweep was an SLO search; without it the
section is the table and the knee. Each run's own JSONL in DIR has its own serving section (`serving.py`).
"""

from __future__ import annotations

import csv
import math
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attention_kv_caceh.harness.sweep import CSV_FIELDS, SLO_PASS_FRACTION, Axis, find_knee
from attention_kv_caceh.report.sources import FileProblem, open_regular, read_json_object
from attention_kv_caceh.tables import markdown_table

__all__ = ["parse_sweep_csv", "read_sweep_json", "sweep_section"]

AXES: tuple[Axis, ...] = ("concurrency", "request_rate")
# How each column of CSV_FIELDS is read: (type, smallest value or None, whether it may be empty). An
# empty cell is a statistic without samples or a counter the server does not export (`sweep_row`).
_INT, _FLOAT, _RATE, _TEXT = "int", "float", "rate", "text"  # rate: a float > 0 that may be inf
_COLUMNS: dict[str, tuple[str, float | None, bool]] = {
    "axis": (_TEXT, None, False),
    "value": (_RATE, None, False),
    "repeat": (_INT, 0, False),
    "concurrency": (_INT, 1, False),
    "request_rate": (_RATE, None, False),
    "completed": (_INT, 0, False),
    "failed": (_INT, 0, False),
    "duration_s": (_FLOAT, 0, False),
    "request_throughput": (_FLOAT, 0, False),
    "output_throughput": (_FLOAT, 0, False),
    **{f"{p}_{m}_ms": (_FLOAT, 0, True) for m in ("ttft", "tpot", "itl", "e2el") for p in ("median", "p99")},
    "p99_lateness_ms": (_FLOAT, None, True),
    "good_fraction": (_FLOAT, 0, True),
    "prefix_cache_queries": (_FLOAT, 0, True),
    "prefix_cache_hits": (_FLOAT, 0, True),
    "prefix_cache_hit_rate": (_FLOAT, 0, True),
    "preemptions": (_FLOAT, 0, True),
    "prefix_cache_reset": (_TEXT, None, False),
    "jsonl": (_TEXT, None, True),
}
_FRACTIONS = ("good_fraction", "prefix_cache_hit_rate")


def _value(column: str, raw: str | None) -> Any:
    kind, least, optional = _COLUMNS[column]
    if raw is None:
        raise ValueError(f"column {column!r} is missing")
    if kind == _TEXT:
        return raw
    if raw == "" and optional:
        return None
    try:
        value: Any = int(raw) if kind == _INT else float(raw)
    except ValueError:
        raise ValueError(
            f"column {column!r}: {raw!r} is not {'an integer' if kind == _INT else 'a number'}"
        ) from None
    if kind == _RATE:
        if not (value > 0 and not math.isnan(value)):
            raise ValueError(f"column {column!r}: {raw!r} must be > 0 (or inf)")
    elif not math.isfinite(value):
        raise ValueError(f"column {column!r}: {raw!r} is not finite")
    if least is not None and value < least:
        raise ValueError(f"column {column!r}: {raw!r} must be >= {least:g}")
    if column in _FRACTIONS and value > 1:
        raise ValueError(f"column {column!r}: {raw!r} is a fraction, must be <= 1")
    return value


def _row(i: int, cells: Mapping[str, str | None]) -> dict[str, Any]:
    try:
        row = {column: _value(column, cells.get(column)) for column in CSV_FIELDS}
    except ValueError as exc:
        raise ValueError(f"row {i}: {exc}") from None
    if row["axis"] not in AXES:
        raise ValueError(f"row {i}: column 'axis': {row['axis']!r} is not one of {', '.join(AXES)}")
    if row["value"] != row[row["axis"]]:
        raise ValueError(
            f"row {i}: value {row['value']:g} is not the row's {row['axis']} {row[row['axis']]:g}"
        )
    return row


def parse_sweep_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a sweep.csv as `sweep_row` dicts (numbers as int or float, an empty cell None).

    Raises ValueError naming the row (1-based, after the header) for a value that is not of its column's
    type or out of its range (counts and latencies >= 0, fractions in [0, 1], rates > 0 or inf), an axis
    that is not concurrency or request_rate, a `value` that is not the row's value of its axis, rows of
    two axes (a sweep varies one), a row with more cells than the header, and a row that repeats another
    (same value, repeat and JSONL file: it would count twice in the knee). Raises OSError / ValueError
    from `sources.open_regular` too.
    """
    f, _ = open_regular(path)
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[Any, ...], int] = {}
    with f:
        for i, cells in enumerate(csv.DictReader(f), start=1):
            if None in cells:
                raise ValueError(f"row {i} has more cells than the header")
            row = _row(i, cells)
            if rows and row["axis"] != rows[0]["axis"]:
                raise ValueError(
                    f"row {i}: axis {row['axis']} after {rows[0]['axis']}: a sweep varies one axis"
                )
            first = seen.setdefault((row["value"], row["repeat"], row["jsonl"]), i)
            if first != i:
                raise ValueError(
                    f"row {i} repeats row {first} (value {row['value']:g}, repeat {row['repeat']}): a "
                    "duplicated row would count twice"
                )
            rows.append(row)
    return rows


def read_sweep_json(csv_path: Path, axis: str, problems: list[FileProblem]) -> dict[str, Any] | None:
    """The sweep.json beside `csv_path` (same stem); None when there is none, or (with a problem noted)
    when it is malformed, not a sweep's (`kind` "serving-sweep") or of another axis than the CSV."""
    path = csv_path.with_suffix(".json")
    if not path.exists() and not path.is_symlink():
        return None
    doc = read_json_object(path, problems)
    if doc is None:
        return None
    if doc.get("kind") != "serving-sweep" or doc.get("axis") != axis:
        problems.append(
            FileProblem(
                str(path),
                f"not this sweep's summary (kind {doc.get('kind')!r}, axis {doc.get('axis')!r}; the CSV's "
                f"axis is {axis!r}): not used",
            )
        )
        return None
    return doc


def _cell(value: Any, scale: float = 1.0) -> object:
    return "-" if value is None else float(value) * scale


def _slo_part(rows: Sequence[Mapping[str, Any]], slo: Mapping[str, Any], problems: list[str]) -> str:
    """The SLO search's tries, judged again: each row is a try, passing when its good fraction (none
    counting as 0) reaches the pass fraction."""
    fraction: Any = slo.get("pass_fraction", SLO_PASS_FRACTION)
    if not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        problems.append(f"'slo.pass_fraction' {fraction!r} is not in (0, 1]: {SLO_PASS_FRACTION} used")
        fraction = SLO_PASS_FRACTION
    objectives: Any = slo.get("objectives_ms")
    said = (
        ", ".join(f"{k} <= {v} ms" for k, v in typing.cast("dict[str, Any]", objectives).items())
        if isinstance(objectives, dict)
        else "?"
    )
    tries = [(float(r["request_rate"]), r["good_fraction"] or 0.0) for r in rows]
    passed = [rate for rate, good in tries if good >= fraction]
    failed = [rate for rate, good in tries if good < fraction]
    best = max(passed) if passed else None
    if slo.get("best_rate") != best:
        problems.append(f"'slo.best_rate' {slo.get('best_rate')!r}; the rows say {best!r}")
    table = markdown_table(
        ["try", "rate (req/s)", "good %", "verdict"],
        [
            [i, rate, 100 * good, "pass" if good >= fraction else "fail"]
            for i, (rate, good) in enumerate(tries)
        ],
    )
    verdict = (
        f"highest passing rate {best:g} req/s"
        + (f", lowest failing {min(failed):g} req/s" if failed else ", no failing rate found")
        if best is not None
        else f"no rate passed (lowest tried {min(r for r, _ in tries):g} req/s)"
    )
    return (
        f"SLO search ({said}; a rate passes when >= {100 * fraction:g} % of its requests meet every "
        f"objective): {verdict}, {len(tries)} runs.\n\n" + table
    )


def sweep_section(
    name: str, rows: Sequence[Mapping[str, Any]], doc: Mapping[str, Any] | None, problems: list[str]
) -> str:
    """The section of one sweep.csv (at least one row): a table of every run, then the knee
    (`find_knee`) or, when `doc` (the sweep.json) holds an SLO search, its tries. What is malformed in
    `doc` is appended to `problems`."""
    axis: Axis = rows[0]["axis"]
    slo: Any = doc.get("slo") if doc is not None else None
    if slo is not None and not isinstance(slo, dict):
        problems.append("'slo' is not an object: the SLO search is left out")
        slo = None
    head = "concurrency" if axis == "concurrency" else "rate (req/s)"
    table = markdown_table(
        [head, "repeat", "ok", "failed", "req/s", "out tok/s", "TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms",
         "TPOT P99 ms", "E2EL P99 ms", "good %", "hit rate %", "cache reset"],
        [
            [r["value"], r["repeat"], r["completed"], r["failed"], r["request_throughput"],
             r["output_throughput"], _cell(r["median_ttft_ms"]), _cell(r["p99_ttft_ms"]),
             _cell(r["median_tpot_ms"]), _cell(r["p99_tpot_ms"]), _cell(r["p99_e2el_ms"]),
             _cell(r["good_fraction"], 100), _cell(r["prefix_cache_hit_rate"], 100), r["prefix_cache_reset"]]
            for r in rows
        ],
    )  # fmt: skip
    if slo is not None:
        tail = _slo_part(rows, typing.cast("dict[str, Any]", slo), problems)
    else:
        tail = f"{find_knee(rows, axis).verdict} (`harness.sweep.find_knee`, over the mean of each point's repeats).\n"
    failed = sum(int(r["failed"]) for r in rows)
    return (
        f"### Sweep: `{name}` (over {axis.replace('_', ' ')}, {len(rows)} runs"
        + (f", {failed} failed requests" if failed else "")
        + ")\n\n"
        + table
        + "\n"
        + tail
    )
