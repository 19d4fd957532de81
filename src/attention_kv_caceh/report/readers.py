"""Reading a results folder's raw files: tell each CSV's kind by its header, parse rows into the
dataclasses that wrote them, check that a file holds one run, read `.meta.json`, and note every problem.

A file kind is told by its CSV header, never by its name (see `classify_header`). Only regular files
are opened (`open_regular`: a FIFO named `x.csv` would block a plain `open` forever), and none larger
than MAX_INPUT_BYTES. Rows are streamed: the csv reader walks the open file and each row becomes one
slotted dataclass at once, so a file costs about 4x its size in memory, not its text plus a dict of
strings per row. Nothing here computes statistics or writes Markdown: `sections.py` does, `build.py`
puts it together; `jsonl.py` reads the serving harness's records.
"""

from __future__ import annotations

import csv
import json
import math
import os
import stat
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from attention_kv_caceh.experiments.cache_growth_stats import CacheMemoryRow, CacheStepSample
from attention_kv_caceh.experiments.views import ViewRow
from attention_kv_caceh.files import meta_path
from attention_kv_caceh.timing import Sample

__all__ = [
    "DERIVED",
    "IDENTITY",
    "KINDS",
    "MAX_INPUT_BYTES",
    "SLOT",
    "FileProblem",
    "ReportResult",
    "classify_header",
    "int_keyed",
    "open_regular",
    "parse_csv",
    "parse_rows",
    "read_header",
    "read_meta",
    "run_key",
]


T = TypeVar("T")

# The largest file the report reads (raw CSV, JSONL or metadata), in bytes. A default `cache` run writes
# about 2 MB, a default scan far less; a file past the cap is listed, not read (the report would hold
# roughly 4x it in memory).
MAX_INPUT_BYTES = 128 * 1024 * 1024


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
CLASSES: dict[str, type[Any]] = {
    "scan": Sample,
    "cache": CacheStepSample,
    "cache-memory": CacheMemoryRow,
    "views": ViewRow,
}
# A run's identity: every parameter column. Rows of one raw file must agree on all of them (a file that
# mixes runs would be reported as one run, its first row's). The scan's batch size is what it scans.
IDENTITY: dict[str, tuple[str, ...]] = {
    "scan": (
        "sequence_length",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "cache",
        "model",
        "seed",
        "warmup",
    ),
    "cache": (
        "batch_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "model",
        "seed",
        "warmup",
        "steps",
    ),
    "cache-memory": (
        "batch_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "model",
        "seed",
        "steps",
    ),
}
# What names one measurement within a run: two rows that share it are duplicates (counted twice in
# every statistic), and reject the file. The remaining columns are the measured values.
SLOT: dict[str, tuple[str, ...]] = {
    "scan": ("batch_size", "repeat"),
    "cache": ("cache", "repeat", "step"),
    "cache-memory": ("cache", "step"),
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


# -------------------------------------------------------------------------------------- one value


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
# are counts, repeat indices cannot be negative.
MINIMUM: dict[str, int] = {
    "batch_size": 1,
    "sequence_length": 1,
    "num_heads": 1,
    "num_kv_heads": 1,
    "head_dim": 1,
    "steps": 1,
    "repeat": 0,
    "step": 0,
    "warmup": 0,
}
# Columns that must be above zero: a timed call takes time (0 ms would divide a rate by zero).
POSITIVE = ("elapsed_ms",)


def _row_parser(cls: type[T], header: Sequence[str]) -> Callable[[int, Sequence[str | None]], T]:
    """A function (data row number, cells in header order) -> instance of `cls`; raises ValueError
    naming the row and column of the first bad or missing value. Repeated strings (dtype, cache kind)
    are shared between rows, so a large file does not hold one copy per row."""
    spec: Any = cls
    if not is_dataclass(spec):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(spec)
    where = {name: i for i, name in enumerate(header)}
    columns = [(f.name, where.get(f.name), hints[f.name]) for f in fields(spec)]
    shared: dict[str, str] = {}

    def parse(i: int, cells: Sequence[str | None]) -> T:
        values: list[Any] = []
        for name, at, kind in columns:
            raw = cells[at] if at is not None and at < len(cells) else None
            if raw is None:
                raise ValueError(f"row {i}: column {name!r} is missing")
            try:
                value = _convert(raw, kind, name)
            except ValueError as exc:
                raise ValueError(f"row {i}: {exc}") from None
            if name in MINIMUM and value < MINIMUM[name]:
                raise ValueError(f"row {i}: column {name!r}: {raw!r} must be >= {MINIMUM[name]}")
            if name in POSITIVE and not value > 0:
                raise ValueError(f"row {i}: column {name!r}: {raw!r} must be > 0")
            values.append(shared.setdefault(value, value) if isinstance(value, str) else value)
        return cls(*values)

    return parse


def parse_rows(cls: type[T], rows: Sequence[Mapping[str, str | None]]) -> list[T]:
    """Build dataclass instances from CSV rows (strings), converting each field to its annotated type.

    Numbers must be finite, the columns of MINIMUM at least that value, those of POSITIVE above 0.
    Raises ValueError naming the data row (1-based, after the header) and column of the first bad value.
    """
    names = _field_names(cls)
    parse = _row_parser(cls, names)
    return [parse(i, [row.get(name) for name in names]) for i, row in enumerate(rows, start=1)]


# ------------------------------------------------------------------------------------ opening files


def _kind_word(mode: int) -> str:
    for test, word in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return word
    return "not a regular file"


# A UTF-8 byte-order mark before the header (Excel writes one) is dropped, not read as a column name.
ENCODING = "utf-8-sig"


def open_regular(path: Path, *, newline: str | None = "") -> tuple[IO[str], bool]:
    """Open a regular file of at most MAX_INPUT_BYTES as UTF-8 text (a byte-order mark dropped); also
    return whether it ends in a line break (False for an empty file).

    The kind is checked with os.stat before opening, and the file is opened with O_NONBLOCK and checked
    again with fstat, so a FIFO (or a device) put there never blocks the report. Raises ValueError
    ("a FIFO, not a regular file: not read", "300.0 MiB, above ...") and OSError when it cannot be opened.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{_kind_word(mode)}, not a regular file: not read")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{_kind_word(info.st_mode)}, not a regular file: not read")
        if info.st_size > MAX_INPUT_BYTES:
            raise ValueError(
                f"{info.st_size / 2**20:.1f} MiB, above the report's cap of {MAX_INPUT_BYTES / 2**20:.0f} MiB "
                "(report.readers.MAX_INPUT_BYTES): not read"
            )
        ends = info.st_size > 0 and os.pread(fd, 1, info.st_size - 1) in (b"\n", b"\r")
        os.set_blocking(fd, True)
        return os.fdopen(fd, encoding=ENCODING, newline=newline), ends
    except BaseException:
        os.close(fd)
        raise


def read_header(path: Path, *, quiet: bool = True) -> list[str]:
    """The header of a CSV ([] when empty). When it cannot be read (not a regular file, above the cap,
    not UTF-8): [] when `quiet`, else the OSError / ValueError / UnicodeDecodeError / csv.Error."""
    try:
        f, _ = open_regular(path)
        with f:
            empty: list[str] = []
            return next(csv.reader(f), empty)
    except (OSError, ValueError, UnicodeDecodeError, csv.Error):
        if quiet:
            return []
        raise


# -------------------------------------------------------------------------------------------- CSV


def _describe_runs(kind: str, runs: Mapping[tuple[Any, ...], int]) -> str:
    """The columns in which the runs of one file differ, and each run's first row."""
    names = IDENTITY[kind]
    keys = list(runs)
    differ = [
        f"{name} " + " / ".join(str(k[i]) or "''" for k in keys)
        for i, name in enumerate(names)
        if len({k[i] for k in keys}) > 1
    ]
    firsts = ", ".join(str(row) for row in runs.values())
    return (
        f"rows of {len(keys)} different runs ({'; '.join(differ)}; first rows {firsts}): a raw file holds "
        "one run, its identity is every parameter column; split the file to report each run"
    )


def _rows(reader: Iterator[list[str]], width: int) -> Iterator[tuple[int, list[str | None]]]:
    for i, row in enumerate(reader, start=1):
        if len(row) > width:
            raise ValueError(f"row {i} has more cells than the header")
        cells: list[str | None] = list(row)
        yield i, cells + [None] * (width - len(row))


def parse_csv(cls: type[T], kind: str, path: Path, problems: list[FileProblem]) -> list[T]:
    """The rows of a raw CSV of `kind` (a key of KINDS) as `cls` instances, streamed from the file.

    Checks, each a ValueError naming the row (1-based, after the header): every value (`parse_rows`);
    one run per file (rows that differ in an IDENTITY column); no duplicate rows (two rows with the same
    SLOT, e.g. a scan's batch size and repeat). The last row only, when it lacks its line break (its
    last cell may be cut yet valid, `42,1` of `42,12`) or is short and does not parse, is taken for a
    cut-off row of a truncated file: it is left out and noted in `problems`; a file whose only row is
    cut off raises. Raises OSError / ValueError from `open_regular` too.
    """
    f, ends = open_regular(path)
    with f:
        reader = csv.reader(f)
        none: list[str] = []
        header = next(reader, none)
        parse = _row_parser(cls, header)
        identity, slot = IDENTITY.get(kind, ()), SLOT.get(kind, ())
        runs: dict[tuple[Any, ...], int] = {}
        seen: dict[tuple[Any, ...], dict[tuple[Any, ...], int]] = {}  # run -> slot -> first row
        out: list[T] = []
        last: tuple[int, list[str | None]] | None = None
        for i, cells in _rows(reader, len(header)):
            if last is not None:
                out.append(_checked(parse, last, identity, slot, runs, seen))
            last = (i, cells)
    if last is None:
        return out
    i, cells = last
    cut = not ends
    if not cut:
        try:
            out.append(_checked(parse, last, identity, slot, runs, seen))
        except ValueError as exc:
            if None not in cells:
                raise  # a complete last row that is wrong, not a cut-off one
            if i == 1:
                raise ValueError(f"{exc} (truncated file?); no complete rows") from None
            cut = True
    if cut:
        if i == 1:
            raise ValueError("row 1 is incomplete (truncated file?); no complete rows")
        problems.append(
            FileProblem(str(path), f"row {i} is incomplete (truncated file?); {i - 1} complete rows used")
        )
    if len(runs) > 1:
        raise ValueError(_describe_runs(kind, runs))
    return out


def _checked(
    parse: Callable[[int, Sequence[str | None]], T],
    row: tuple[int, list[str | None]],
    identity: Sequence[str],
    slot: Sequence[str],
    runs: dict[tuple[Any, ...], int],
    seen: dict[tuple[Any, ...], dict[tuple[Any, ...], int]],
) -> T:
    i, cells = row
    parsed = parse(i, cells)
    run = tuple(getattr(parsed, name) for name in identity)
    if identity:
        runs.setdefault(run, i)
    if slot:
        key = tuple(getattr(parsed, name) for name in slot)
        first = seen.setdefault(run, {}).setdefault(key, i)
        if first != i:
            same = ", ".join(f"{name} {value}" for name, value in zip(slot, key, strict=True))
            raise ValueError(
                f"row {i} repeats row {first} (same parameters and {same}): a duplicated row would be "
                "counted twice in every statistic"
            )
    return parsed


# ------------------------------------------------------------------------------------------ metadata


def read_meta(csv_path: Path, problems: list[FileProblem], *, required: bool = True) -> dict[str, Any] | None:
    """The parsed `<file>.meta.json` of a raw file; None (with a problem noted, when `required` or
    malformed, not a regular file or too large) when it is missing or cannot be used."""
    path = meta_path(csv_path)
    if not path.exists() and not path.is_symlink():
        if required:
            problems.append(FileProblem(str(path), "missing: the environment of this run is unknown"))
        return None
    try:
        f, _ = open_regular(path, newline=None)
        with f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(FileProblem(str(path), f"unreadable: {exc}"))
        return None
    except json.JSONDecodeError as exc:
        problems.append(FileProblem(str(path), f"malformed JSON: {exc}"))
        return None
    except ValueError as exc:  # from open_regular: not a regular file, too large
        problems.append(FileProblem(str(path), str(exc)))
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
    """The parameters a cache-growth run shares with its memory rows (IDENTITY["cache-memory"])."""
    return tuple(getattr(row, name) for name in IDENTITY["cache-memory"])
