"""Atomic file writers: every result file is complete or absent, never half-written.

A reader (or a crash, or Ctrl-C) must never see a truncated CSV. Whole files are written to a temporary
file in the same folder, flushed, fsynced and renamed over the target (`os.replace` is atomic on POSIX).
Streams of records that must survive a crash line by line (per-request JSONL) are appended and flushed one
line at a time instead. Parent folders are created as needed.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import tempfile
import threading
from collections.abc import Generator, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = [
    "JsonlWriter",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_output_path",
    "ignoring_sigint",
    "meta_path",
    "write_csv_atomic",
    "write_json_atomic",
]


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` atomically: a temporary file in the same folder, fsynced, then renamed.

    Parent folders are created. Returns the path written. Raises OSError when the folder cannot be
    created or written; the previous file, if any, is then left as it was.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would give
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` as UTF-8 to `path` atomically (see `atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def meta_path(path: str | os.PathLike[str]) -> Path:
    """The metadata file that sits beside a raw file: `results/x.csv` -> `results/x.csv.meta.json`."""
    return Path(f"{os.fspath(path)}.meta.json")


def check_output_path(path: str | os.PathLike[str], flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """Validate an output path before anything is written; returns it as a Path.

    Raises ValueError naming `flag` and the path when it is a folder, does not end in one of `suffixes`
    (if given), or its nearest existing parent is a file or not writable (tested by creating and
    removing a temporary file there; no folder is created).
    """
    p = Path(path)
    if suffixes and p.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {str(p)!r} must end in {' or '.join(suffixes)}")
    if p.is_dir():
        raise ValueError(f"{flag} {str(p)!r} is a folder, expected a file path")
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {str(p)!r}: {parent} is not a folder")
            try:  # the only reliable test (root passes os.access everywhere): create and remove a file
                fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=parent)
                os.close(fd)
                os.unlink(probe)
            except OSError as exc:
                raise ValueError(f"{flag} {str(p)!r}: cannot write in {parent} ({exc.strerror})") from None
            break
    return p


@contextlib.contextmanager
def ignoring_sigint() -> Generator[None]:
    """Ignore SIGINT (Ctrl-C) inside the block, e.g. while the final files of an interrupted run are
    written: a second Ctrl-C (a terminal sends one to `uv` too, which forwards it) must not cut the save
    short. Outside the main thread, where signal handlers cannot be set, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_csv_atomic(
    path: str | os.PathLike[str],
    rows: Iterable[Mapping[str, Any]],
    fieldnames: Sequence[str],
) -> Path:
    """Write `rows` as a CSV with a header of `fieldnames`, atomically.

    Raises ValueError if a row has a key that is not in `fieldnames` (a silently dropped column would
    be a lost measurement).
    """
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(fieldnames), extrasaction="raise")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    return atomic_write_text(path, buffer.getvalue())


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write `obj` as indented JSON, atomically. Raises TypeError for objects JSON cannot encode."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


class JsonlWriter:
    """Append one JSON object per line, flushed (and fsynced) as each record is written.

    Used for per-request records: a crash or Ctrl-C after a record is written keeps it. The file is
    truncated when opened, so one run's file holds one run's records.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._file = self.path.open("w", encoding="utf-8")
        self.count = 0

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one record as a line of JSON and flush it to disk."""
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        self.count += 1

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
