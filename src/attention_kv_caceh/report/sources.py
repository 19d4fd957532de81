"""Opening a results folder's files for the report: regular files only, none above a size cap, and
the `.meta.json` beside each raw file.

A FIFO named `x.csv` would block a plain `open` forever, and a huge file would exhaust memory: every
file the report reads goes through `open_regular` (os.stat before opening, O_NONBLOCK, fstat again,
MAX_INPUT_BYTES). Problems are collected as `FileProblem`s, never raised to the caller of the report.
"""

from __future__ import annotations

import csv
import json
import os
import stat
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from attention_kv_caceh.files import meta_path

__all__ = [
    "ENCODING",
    "MAX_INPUT_BYTES",
    "FileProblem",
    "ReportResult",
    "int_keyed",
    "kind_word",
    "open_regular",
    "read_header",
    "read_meta",
]

# The largest file the report reads (raw CSV, JSONL or metadata), in bytes; far above what a default run
# writes. A file past the cap is listed, not read (the parsed rows are a multiple of the file's size).
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


# ------------------------------------------------------------------------------------ opening files


def kind_word(mode: int) -> str:
    """What a file that is not a regular file is: "a folder", "a FIFO", "a socket", ... (os.stat mode)."""
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
        raise ValueError(f"{kind_word(mode)}, not a regular file: not read")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{kind_word(info.st_mode)}, not a regular file: not read")
        if info.st_size > MAX_INPUT_BYTES:
            raise ValueError(
                f"{info.st_size / 2**20:.1f} MiB, above the report's cap of {MAX_INPUT_BYTES / 2**20:.0f} MiB "
                "(report.sources.MAX_INPUT_BYTES): not read"
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


# ------------------------------------------------------------------------------------------ metadata


def _refuse_constant(name: str) -> Any:
    """`json.load`'s parse_constant: NaN, Infinity and -Infinity are not JSON (RFC 8259); our writers
    never emit them (`files.strict_json_value`), so a file that has one was not written by us."""
    raise ValueError(f"{name} is not valid JSON (RFC 8259 has no NaN or Infinity)")


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
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(FileProblem(str(path), f"unreadable: {exc}"))
        return None
    except ValueError as exc:  # from open_regular: not a regular file, too large
        problems.append(FileProblem(str(path), str(exc)))
        return None
    try:
        with f:
            meta = json.load(f, parse_constant=_refuse_constant)
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(FileProblem(str(path), f"unreadable: {exc}"))
        return None
    except ValueError as exc:  # json.JSONDecodeError, or a NaN / Infinity token (_refuse_constant)
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
