"""Reading a results folder's raw CSVs: tell each CSV's kind, parse rows into the dataclasses that
wrote them, check that a file holds one run and no row twice, and note every problem.

A file's kind is the `kind` its run recorded in its `.meta.json` (`recorder.RunRecorder`, see
RECORDED_KINDS), and its header must then be that kind's; a file without metadata or whose metadata
records no kind (an older run) is told by its CSV header alone (`classify_header`); never by its name. Files are opened
through `sources.open_regular` (regular files up to `sources.MAX_INPUT_BYTES`). Rows are streamed: the
csv reader walks the open file and each row becomes one slotted dataclass at once, repeated strings
shared, so the parsed rows stay a small multiple of the file's size. Nothing here computes statistics or writes Markdown: `sections.py`
does, `build.py` puts it together; `sources.py` opens files and reads metadata, `jsonl.py` the
harness's records.
"""

from __future__ import annotations

import csv
import math
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from attention_kv_caceh.experiments.cache_growth_stats import CACHE_KINDS, CacheMemoryRow, CacheStepSample
from attention_kv_caceh.experiments.views import ViewRow
from attention_kv_caceh.harness.sweep import CSV_FIELDS
from attention_kv_caceh.report.sources import FileProblem, open_regular
from attention_kv_caceh.timing import Sample

__all__ = [
    "CLASSES",
    "DERIVED",
    "IDENTITY",
    "KINDS",
    "LAB_MARKDOWN_HEADINGS",
    "OPTIONAL_COLUMNS",
    "RECORDED_KINDS",
    "SLOT",
    "classify_header",
    "kind_of",
    "parse_csv",
    "parse_rows",
    "raw_kind_of_file",
    "run_key",
    "written_by_lab",
]


T = TypeVar("T")


def _field_names(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


KINDS: dict[str, tuple[str, ...]] = {
    "scan": _field_names(Sample),
    "cache": _field_names(CacheStepSample),
    "cache-memory": _field_names(CacheMemoryRow),
    "views": _field_names(ViewRow),
    "sweep": CSV_FIELDS,  # read by `report.sweep.parse_sweep_csv` (its rows are dicts, not a dataclass)
}
# Columns a raw file may lack because it was written before they existed, and the value they then
# have: a scan CSV without `impl` timed NumPy's step (the only one before `--impl`).
OPTIONAL_COLUMNS: dict[str, str] = {"impl": "numpy"}
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
    "scan": ("batch_size", "impl", "repeat"),
    "cache": ("cache", "repeat", "step"),
    "cache-memory": ("cache", "step"),
}


def _cache_row(row: CacheStepSample | CacheMemoryRow) -> str | None:
    """What is inconsistent in one cache-growth row (timed or memory), or None: the cache is one of
    CACHE_KINDS, T = step + 1 (positions held after the step), and the step lies within the run."""
    if row.cache not in CACHE_KINDS:
        return f"column 'cache': {row.cache!r} is not one of {', '.join(CACHE_KINDS)}"
    if row.sequence_length != row.step + 1:
        return f"sequence_length {row.sequence_length} is not step + 1 = {row.step + 1}"
    if row.step >= row.steps:
        return f"step {row.step} lies outside the run's {row.steps} steps"
    return None


# Consistency between the columns of one row, per kind (beyond each value's own range).
ROW_CHECKS: dict[str, Callable[[Any], str | None]] = {"cache": _cache_row, "cache-memory": _cache_row}
# Summaries written by the commands: recognised so they can be named, never read for statistics.
DERIVED = {
    "scan summary": {"batch_size", "per_sequence_ms", "positions_per_s"},
    "cache summary": {"cache", "slope_ms_per_position", "total_p50_ms"},
}


def classify_header(header: Sequence[str]) -> str | None:
    """The kind of a CSV from its header: a key of KINDS, "derived:<name>", or None when unknown.

    A raw kind matches when the header holds exactly its columns (in any order), or all of them but
    some of OPTIONAL_COLUMNS (an older file).
    """
    columns = set(header)
    for kind, names in KINDS.items():
        if columns <= set(names) and set(names) - columns <= OPTIONAL_COLUMNS.keys():
            return kind
    for name, needed in DERIVED.items():
        if needed <= columns:
            return f"derived:{name}"
    return None


# The `kind` a lab command's recorder writes in the metadata -> the kind of its raw CSV here.
RECORDED_KINDS: dict[str, str] = {
    "batch-size-scan": "scan",
    "cache-growth": "cache",
    "cache-memory": "cache-memory",
    "view-copy-table": "views",
}


def kind_of(header: Sequence[str], meta: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """(kind, problem) of a CSV with this header and metadata (None: no metadata or none readable).

    The recorded `kind` decides: one of RECORDED_KINDS gives its kind, provided the header is that
    kind's (else a problem saying both); another recorded kind is a problem. Without a recorded kind
    the header decides (`classify_header`; None when unknown).
    """
    recorded: Any = None if meta is None else meta.get("kind")
    if recorded is None:
        return classify_header(header), None
    if not isinstance(recorded, str) or recorded not in RECORDED_KINDS:
        known = ", ".join(RECORDED_KINDS)
        return None, f"its metadata records kind {recorded!r}, not a raw CSV kind report reads ({known})"
    kind = RECORDED_KINDS[recorded]
    by_header = classify_header(header)
    if by_header != kind:
        shown = ", ".join(header) or "(empty)"
        return None, f"its metadata records kind {recorded!r}, but its header is not a {kind} CSV's: {shown}"
    return kind, None


def raw_kind_of_file(path: Path) -> str | None:
    """The raw kind (a key of KINDS) of the CSV at `path` told by its first line (`classify_header`), or
    None: not a raw CSV (a summary, another file), empty, or unreadable. What `cli.common.check_side_files`
    asks before a file beside a raw CSV is replaced."""
    try:
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.reader([f.readline()]))
    except (OSError, UnicodeDecodeError):
        return None
    kind = classify_header(rows[0]) if rows else None
    return kind if kind in KINDS else None


# How the first line of every Markdown file a lab command writes beside its raw CSV begins: the heading
# of its section (`sections.py`: scan, cache growth; `views.py`: the view/copy table).
LAB_MARKDOWN_HEADINGS = ("### Batch-size scan: `", "### KV-cache growth: `", "### View/copy table: `")


def written_by_lab(path: Path) -> bool:
    """True when the Markdown file at `path` begins with one of LAB_MARKDOWN_HEADINGS (a lab command
    wrote it); False for any other file (a user's notes, an empty or unreadable one)."""
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline(200)
    except (OSError, UnicodeDecodeError):
        return False
    return first.startswith(LAB_MARKDOWN_HEADINGS)


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
    naming the row and column of the first bad or missing value; a column of OPTIONAL_COLUMNS that the
    header lacks takes its value there. Repeated strings (dtype, cache kind)
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
            if at is None and name in OPTIONAL_COLUMNS:
                raw = OPTIONAL_COLUMNS[name]  # the header lacks the column: an older file
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
    the columns of a row against each other (ROW_CHECKS: a cache row's T is its step + 1); one run per file (rows that differ in an IDENTITY column); no duplicate rows (two rows with the same
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
        identity, slot, check = IDENTITY.get(kind, ()), SLOT.get(kind, ()), ROW_CHECKS.get(kind)
        runs: dict[tuple[Any, ...], int] = {}
        seen: dict[tuple[Any, ...], dict[tuple[Any, ...], int]] = {}  # run -> slot -> first row
        out: list[T] = []
        last: tuple[int, list[str | None]] | None = None
        for i, cells in _rows(reader, len(header)):
            if last is not None:
                out.append(_checked(parse, last, identity, slot, runs, seen, check))
            last = (i, cells)
    if last is None:
        return out
    i, cells = last
    cut = not ends
    if not cut:
        try:
            out.append(_checked(parse, last, identity, slot, runs, seen, check))
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
    check: Callable[[Any], str | None] | None,
) -> T:
    i, cells = row
    parsed = parse(i, cells)
    if check is not None and (wrong := check(parsed)) is not None:
        raise ValueError(f"row {i}: {wrong}")
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


def run_key(row: CacheStepSample | CacheMemoryRow) -> tuple[Any, ...]:
    """The parameters a cache-growth run shares with its memory rows (IDENTITY["cache-memory"])."""
    return tuple(getattr(row, name) for name in IDENTITY["cache-memory"])
