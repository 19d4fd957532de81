"""Reading a results folder's raw files: tell each CSV's kind by its header, parse rows into the
dataclasses that wrote them, read `.meta.json` and per-request JSONL, and note every problem.

A file kind is told by its CSV header, never by its name (see `classify_header`). Nothing here computes
statistics or writes Markdown: `sections.py` does, `build.py` puts it together.
"""

from __future__ import annotations

import csv
import io
import json
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from attention_kv_caceh.experiments.cache_growth_stats import CacheMemoryRow, CacheStepSample
from attention_kv_caceh.experiments.views import ViewRow
from attention_kv_caceh.files import meta_path
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.timing import Sample

__all__ = [
    "DERIVED",
    "KINDS",
    "CsvFile",
    "FileProblem",
    "ReportResult",
    "classify_header",
    "int_keyed",
    "parse_file_rows",
    "parse_rows",
    "read_csv",
    "read_header",
    "read_jsonl",
    "read_meta",
    "run_key",
]


T = TypeVar("T")


@dataclass(frozen=True)
class FileProblem:
    """A file the report could not use (fully or in part), and what is wrong with it."""

    path: str
    problem: str


@dataclass
class ReportResult:
    """The Markdown text, the PNGs written beside it, and every file problem found."""

    markdown: str
    plots: list[Path] = field(default_factory=lambda: list[Path]())
    problems: list[FileProblem] = field(default_factory=lambda: list[FileProblem]())
    sources: list[str] = field(default_factory=lambda: list[str]())


def _field_names(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


KINDS: dict[str, tuple[str, ...]] = {
    "scan": _field_names(Sample),
    "cache": _field_names(CacheStepSample),
    "cache-memory": _field_names(CacheMemoryRow),
    "views": _field_names(ViewRow),
}
# Summaries written by the commands: recognised so they can be named, never read for statistics.
DERIVED = {
    "scan summary": {"batch_size", "per_sequence_ms", "positions_per_s"},
    "cache summary": {"cache", "slope_ms_per_position", "total_p50_ms"},
}


def classify_header(header: Sequence[str]) -> str | None:
    """The kind of a CSV from its header: a key of KINDS, "derived:<name>", or None when unknown.

    A raw kind matches when the header holds exactly its columns (in any order).
    """
    columns = set(header)
    for kind, names in KINDS.items():
        if columns == set(names):
            return kind
    for name, needed in DERIVED.items():
        if needed <= columns:
            return f"derived:{name}"
    return None


def _convert(value: str, kind: Any, column: str) -> Any:
    if kind is bool:
        if value not in ("True", "False"):
            raise ValueError(f"column {column!r}: {value!r} is not True or False")
        return value == "True"
    if kind is int:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"column {column!r}: {value!r} is not an integer") from None
    if kind is float:
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"column {column!r}: {value!r} is not a number") from None
        if not math.isfinite(number):
            raise ValueError(f"column {column!r}: {value!r} is not finite")
        return number
    return value


# Smallest valid value of the raw columns that have one (in any file kind that has the column): sizes
# are counts, times and repeat indices cannot be negative.
MINIMUM: dict[str, int] = {
    "batch_size": 1,
    "sequence_length": 1,
    "num_heads": 1,
    "num_kv_heads": 1,
    "head_dim": 1,
    "steps": 1,
    "elapsed_ms": 0,
    "repeat": 0,
    "step": 0,
    "warmup": 0,
}


def parse_rows(cls: type[T], rows: Sequence[Mapping[str, str | None]]) -> list[T]:
    """Build dataclass instances from CSV rows (strings), converting each field to its annotated type.

    Numbers must be finite, and the columns of MINIMUM at least that value. Raises ValueError naming
    the data row (1-based, after the header) and column of the first bad value.
    """
    spec: Any = cls
    if not is_dataclass(spec):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(spec)
    names = [f.name for f in fields(spec)]
    out: list[T] = []
    for i, row in enumerate(rows, start=1):
        values: dict[str, Any] = {}
        for name in names:
            raw = row.get(name)
            if raw is None:
                raise ValueError(f"row {i}: column {name!r} is missing")
            try:
                values[name] = _convert(raw, hints[name], name)
            except ValueError as exc:
                raise ValueError(f"row {i}: {exc}") from None
            if name in MINIMUM and values[name] < MINIMUM[name]:
                raise ValueError(f"row {i}: column {name!r}: {raw!r} must be >= {MINIMUM[name]}")
        out.append(cls(**values))
    return out


# ------------------------------------------------------------------------------------------- reading


@dataclass
class CsvFile:
    """A CSV's header and data rows (a short row has None for its missing cells), whether its last
    row may have been cut off (short), and whether it was (not ended by a line break, while the lines
    before it are: a writer ends every row, so a file cut in its last row, even between the digits of
    its last cell, lacks the final one)."""

    header: list[str]
    rows: list[dict[str, str | None]]
    tail_suspect: bool
    tail_cut: bool = False


# A UTF-8 byte-order mark before the header (Excel writes one) is dropped, not read as a column name.
ENCODING = "utf-8-sig"


def read_csv(path: Path) -> CsvFile:
    with path.open(newline="", encoding=ENCODING) as f:
        text = f.read()
    reader = csv.DictReader(io.StringIO(text, newline=""))
    header = list(reader.fieldnames or [])
    rows: list[dict[str, str | None]] = []
    for row in reader:
        if None in row:
            raise ValueError(f"row {len(rows) + 1} has more cells than the header")
        rows.append(dict(row))
    short = bool(rows) and any(v is None for v in rows[-1].values())
    cut = bool(rows) and not text.endswith(("\n", "\r"))
    return CsvFile(header, rows, short or cut, cut)


def read_header(path: Path) -> list[str]:
    """The header of a CSV ([] when empty or unreadable)."""
    try:
        with path.open(newline="", encoding=ENCODING) as f:
            empty: list[str] = []
            return next(csv.reader(f), empty)
    except (OSError, UnicodeDecodeError, csv.Error):
        return []


def _parses(cls: type[Any], rows: Sequence[Mapping[str, str | None]]) -> bool:
    try:
        parse_rows(cls, rows)
    except ValueError:
        return False
    return True


def parse_file_rows(cls: type[T], file: CsvFile, path: Path, problems: list[FileProblem]) -> list[T]:
    """parse_rows over a file's rows; a last row cut off (truncated file) is left out and noted.

    Only the last row gets that treatment: always when it lacks its line break (its last cell may be
    cut yet valid, `42,1` of `42,12`), and when it is short and does not parse. Any other bad row raises
    ValueError as parse_rows does, and so does a file whose only row is cut off.
    """
    last = len(file.rows)
    if file.tail_cut:
        if last == 1:
            raise ValueError("row 1 is incomplete (truncated file?); no complete rows")
    else:
        try:
            return parse_rows(cls, file.rows)
        except ValueError as exc:
            if not file.tail_suspect or _parses(cls, file.rows[-1:]):
                raise  # the bad row is not a cut-off last one
            if last == 1:
                raise ValueError(f"{exc} (truncated file?); no complete rows") from None
    parsed = parse_rows(cls, file.rows[:-1])  # a bad row before the last rejects the file
    problems.append(
        FileProblem(str(path), f"row {last} is incomplete (truncated file?); {last - 1} complete rows used")
    )
    return parsed


def read_meta(csv_path: Path, problems: list[FileProblem], *, required: bool = True) -> dict[str, Any] | None:
    """The parsed `<file>.meta.json` of a raw file; None (with a problem noted, when `required` or
    malformed) when it is missing or malformed."""
    path = meta_path(csv_path)
    if not path.exists():
        if required:
            problems.append(FileProblem(str(path), "missing: the environment of this run is unknown"))
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(FileProblem(str(path), f"malformed JSON: {exc}"))
        return None
    if not isinstance(meta, dict):
        problems.append(FileProblem(str(path), "malformed: the top level is not an object"))
        return None
    return typing.cast("dict[str, Any]", meta)


def int_keyed(meta: Mapping[str, Any] | None, key: str, path: str, problems: list[FileProblem]) -> Any:
    """meta[key] as {int B: value}; None (with a problem noted) when absent or malformed."""
    if meta is None or key not in meta:
        if meta is not None:
            problems.append(FileProblem(path, f"no {key!r}: bandwidth columns are n/a"))
        return None
    raw = meta[key]
    try:
        return {int(b): v for b, v in typing.cast("dict[str, Any]", raw).items()}
    except (AttributeError, TypeError, ValueError):
        problems.append(FileProblem(path, f"{key!r} is not a mapping of batch size to values"))
        return None


def run_key(row: CacheStepSample | CacheMemoryRow) -> tuple[Any, ...]:
    return (
        row.batch_size,
        row.num_heads,
        row.num_kv_heads,
        row.head_dim,
        row.dtype,
        row.model,
        row.seed,
        row.steps,
    )


def _record_from_json(rec: Mapping[str, Any]) -> RequestRecord:
    """A harness RequestRecord from one JSONL object (its raw timestamps; derived keys are ignored)."""
    names = {f.name for f in fields(RequestRecord)}
    try:
        return RequestRecord(**{k: v for k, v in rec.items() if k in names})
    except TypeError as exc:
        raise ValueError(f"not a per-request record ({exc})") from None


def read_jsonl(path: Path, problems: list[FileProblem]) -> list[RequestRecord] | None:
    """Serving-harness records of one JSONL file; bad lines are skipped and noted, None when none."""
    records: list[RequestRecord] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(FileProblem(str(path), f"unreadable: {exc}"))
        return None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            records.append(_record_from_json(typing.cast("dict[str, Any]", record)))
        except json.JSONDecodeError as exc:
            problems.append(FileProblem(str(path), f"line {i}: malformed JSON ({exc.msg}); line skipped"))
        except ValueError as exc:
            problems.append(FileProblem(str(path), f"line {i}: {exc}; line skipped"))
    if not records:
        problems.append(FileProblem(str(path), "no per-request records"))
        return None
    return records
