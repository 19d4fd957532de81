"""Atomic file writers: every result file is complete or absent, never half-written.

A reader (or a crash, or Ctrl-C) must never see a truncated CSV. Whole files are written to a temporary
file in the same folder, flushed, fsynced and renamed over the target (`os.replace` is atomic on POSIX).
Streams of records that must survive a crash line by line (per-request JSONL) are appended and flushed one
line at a time instead. Parent folders are created as needed.

Only regular files are ever replaced or written. An output path that names a device, FIFO, socket or
folder is refused by `check_output_path` (before a run starts) and again by every writer (defence in
depth), and the thing there is left untouched: renaming a temporary file over `/dev/null` would turn
the device into a regular file. A symlink is followed: its target must be a regular file or absent, and
the writers write the target, leaving the link in place.

No output ever replaces an input: `check_not_inputs` compares every output path of a command with every
file it reads (symlinks resolved, hard links found by device and inode) before anything is opened.

Every JSON written here is strict JSON (RFC 8259 has no NaN or Infinity): `strict_json_value` turns a
non-finite float into `null`, which in our files means "undefined" (a rate over zero time, a mean of no
samples), and `json.dumps(..., allow_nan=False)` guarantees that no `NaN` token is ever written.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, cast

__all__ = [
    "JsonlWriter",
    "NotARegularFileError",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_not_inputs",
    "check_output_path",
    "ignoring_sigint",
    "input_files",
    "markdown_path",
    "meta_path",
    "output_path",
    "path_problem",
    "strict_json_value",
    "write_csv_atomic",
    "write_json_atomic",
]


class NotARegularFileError(OSError):
    """An output path names something other than a regular file (a device, FIFO, socket or folder).

    An OSError, like every other failure to write a file, so callers that handle write errors handle
    this one too.
    """


def _file_kind(mode: int) -> str:
    """A word for what a `st_mode` names, for error messages."""
    for test, word in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return word
    return "not a regular file"


def _resolve(path: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """Where a write to `path` lands, symlinks resolved (a dangling one gives its target's path), and
    what exists there: None for nothing or a regular file, else a word for it ("a FIFO").

    Raises OSError when the path cannot be examined (a symlink loop, a permission error).
    """
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):  # absent (a file as a parent: reported by the caller)
        return target, None
    if stat.S_ISREG(mode):
        return target, None
    kind = _file_kind(mode)
    return target, f"a symlink to {kind} ({target})" if os.path.islink(path) else kind


def _write_target(path: str | os.PathLike[str]) -> Path:
    """`_resolve`, raising NotARegularFileError when something other than a regular file is there."""
    target, kind = _resolve(path)
    if kind is not None:
        raise NotARegularFileError(
            f"{os.fspath(path)!r} is {kind}, not a regular file; refusing to replace it"
        )
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` atomically: a temporary file in the same folder, fsynced, then renamed.

    A symlink at `path` is followed: its target is replaced and the link kept. Parent folders are
    created. Returns `path` as a Path, as given (not resolved). Raises
    NotARegularFileError (an OSError) when `path` names an existing device, FIFO, socket or folder,
    which is left untouched, and OSError when the folder cannot be created or written; the previous
    file, if any, is then left as it was.
    """
    target = _write_target(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would give
        _write_target(target)  # again just before the rename: the narrowest window we can give
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` as UTF-8 to `path` atomically (see `atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def markdown_path(path: str | os.PathLike[str]) -> Path:
    """The Markdown a lab command writes beside its raw file: `results/benchmark.csv` ->
    `results/benchmark.md` (`report` renders the same section from the raw file)."""
    return Path(path).with_suffix(".md")


def meta_path(path: str | os.PathLike[str]) -> Path:
    """The metadata file that sits beside a raw file: `results/x.csv` -> `results/x.csv.meta.json`."""
    return Path(f"{os.fspath(path)}.meta.json")


def check_output_path(path: str | os.PathLike[str], flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """Validate an output path before anything is written; returns it as a Path (as given).

    Raises ValueError (which the CLI reports as a usage error, exit status 2) naming `flag` and the
    path when:
    - it is empty ("empty path": `Path("")` would silently mean the current folder);
    - it does not end in one of `suffixes` (if given). Suffixes are exact and lower-case: `B.CSV` is
      refused with "use .csv", because every reader of our files looks for the lower-case suffix;
    - something other than a regular file exists there (a folder, device, FIFO or socket), which is
      left untouched. A symlink is followed: its target must be a regular file or absent;
    - its nearest existing parent (of the symlink's target, for a symlink) is a file or not writable
      (tested by creating and removing a temporary file there; no folder is created).
    """
    problem = path_problem(os.fspath(path), suffixes)
    if problem is not None:
        raise ValueError(f"{flag}: {problem}" if problem == "empty path" else f"{flag} {problem}")
    p = Path(path)
    try:
        target, kind = _resolve(p)
    except OSError as exc:
        raise ValueError(f"{flag} {str(p)!r}: cannot use this path ({exc.strerror or exc})") from None
    if kind == "a folder":
        raise ValueError(f"{flag} {str(p)!r} is a folder, expected a file path")
    if kind is not None:
        raise ValueError(f"{flag} {str(p)!r} is {kind}, expected a regular file (or a new path)")
    for parent in target.parents:
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


def input_files(path: str | os.PathLike[str], suffixes: tuple[str, ...] = ()) -> list[Path]:
    """The files an input flag reads: `path` itself, or for a folder (a checkpoint, a results folder) the
    regular files directly in it, only those ending in one of `suffixes` when given. Symlinks are kept as
    given (`check_not_inputs` resolves them). An unreadable folder gives []."""
    p = Path(path)
    if not p.is_dir():
        return [p]
    try:
        children = sorted(p.iterdir())
    except OSError:
        return []
    return [c for c in children if c.is_file() and (not suffixes or c.name.endswith(suffixes))]


def _same_file(a: Path, b: Path) -> bool:
    """Whether writing `a` would write the file `b` names: the same path once symlinks are resolved, or
    the same device and inode (a hard link, a bind mount)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): no inode to share
        return False


def check_not_inputs(
    outputs: Iterable[tuple[str, str | os.PathLike[str] | None]],
    inputs: Iterable[tuple[str, str | os.PathLike[str] | None]],
) -> None:
    """Refuse an output that would replace a file the command reads, before anything is opened.

    `outputs` and `inputs` hold (flag, path) pairs; a None path is skipped. Each input stands for the
    files `input_files` gives (give a folder's files yourself to filter them). An output is the same
    file as an input when both resolve to one path (symlinks followed, a dangling one to its target) or
    share a device and inode (a hard link). Raises ValueError, one line naming both flags and paths.
    """
    read: list[tuple[str, str, Path]] = []
    for flag, path in inputs:
        if path is not None:
            read += [(flag, os.fspath(path), f) for f in input_files(path)]
    for out_flag, out in outputs:
        if out is None:
            continue
        for in_flag, given, file in read:
            if _same_file(Path(out), file):
                where = "" if os.fspath(file) == given else f" (its {file.name})"
                raise ValueError(
                    f"{out_flag} {os.fspath(out)!r} is the file {in_flag} {given!r}{where} reads; an "
                    f"output never replaces an input: choose another {out_flag}"
                )


def path_problem(text: str, suffixes: tuple[str, ...] = ()) -> str | None:
    """What is wrong with an output path's text on its own (no file system access), or None.

    "empty path" for "", else, when `suffixes` are given and the path does not end in one of them,
    "'x.CSV' must end in .csv; suffixes are lower-case: use .csv" (suffixes are exact and lower-case,
    because every reader of our files looks for the lower-case suffix).
    """
    if text == "":
        return "empty path"
    p = Path(text)
    if suffixes and p.suffix not in suffixes:
        hint = f"; suffixes are lower-case: use {p.suffix.lower()}" if p.suffix.lower() in suffixes else ""
        return f"{text!r} must end in {' or '.join(suffixes)}{hint}"
    return None


def output_path(*suffixes: str) -> Callable[[str], Path]:
    """The parse of an output file option (`options.option(parse=output_path(".csv"))`): the text as a
    Path, or ValueError with `path_problem`'s reason ("empty path", a wrong suffix), which the CLI
    reports naming the flag, so no side-file name is ever derived from a bad path."""

    def parse(text: str) -> Path:
        problem = path_problem(text, suffixes)
        if problem is not None:
            raise ValueError(problem)
        return Path(text)

    return parse


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


def strict_json_value(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, +inf, -inf) replaced by None, ready for strict JSON.

    JSON has no NaN or Infinity (RFC 8259, section 6); Python's `json` writes them as bare `NaN` and
    `Infinity` tokens that strict parsers (JavaScript's `JSON.parse`, `jq`) reject. In the files of this
    project `null` means "undefined": a statistic with no samples, a rate over zero time. Floats include
    NumPy floating scalars. Mappings become dicts and lists/tuples become lists, recursively; anything
    else is returned as it is (so `json.dumps` still raises TypeError for what it cannot encode). The
    input is not modified.
    """
    # NumPy floating scalars are recognised without importing NumPy here (this module is imported by the
    # command's entry point before `main` can catch a Ctrl-C): np.float64 subclasses float, and every
    # np.floating scalar is a "numpy" object whose dtype kind is "f".
    dtype_kind = getattr(getattr(obj, "dtype", None), "kind", None)
    is_numpy_scalar = type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0
    if isinstance(obj, float) or (is_numpy_scalar and dtype_kind == "f"):
        value = float(cast("float", obj))
        return value if math.isfinite(value) else None
    if isinstance(obj, Mapping):
        mapping = cast("Mapping[Any, Any]", obj)
        return {key: strict_json_value(value) for key, value in mapping.items()}
    if isinstance(obj, list | tuple):
        items = cast("Sequence[Any]", obj)
        return [strict_json_value(item) for item in items]
    return obj


def _dumps_strict(obj: Any, **kwargs: Any) -> str:
    """`json.dumps` of `strict_json_value(obj)` with `allow_nan=False`: never writes NaN or Infinity."""
    return json.dumps(strict_json_value(obj), allow_nan=False, **kwargs)


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write `obj` as indented strict JSON, atomically (see `atomic_write_bytes` for symlinks and the
    errors raised). Non-finite floats are written as `null` (`strict_json_value`). Raises TypeError for
    objects JSON cannot encode."""
    return atomic_write_text(path, _dumps_strict(obj, indent=2, sort_keys=False) + "\n")


class JsonlWriter:
    """Append one strict-JSON object per line, flushed (and fsynced) as each record is written.

    Used for per-request records: a crash or Ctrl-C after a record is written keeps it. The file is
    truncated when opened, so one run's file holds one run's records. Non-finite floats are written as
    `null` (`strict_json_value`). A symlink at `path` is followed and its target written.

    Raises NotARegularFileError (an OSError) when `path` names an existing device, FIFO, socket or
    folder, which is left untouched (a FIFO is not opened, so the call does not block), and OSError when
    the file cannot be created.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        target = _write_target(self.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        # O_NONBLOCK: should a FIFO appear at the path after the check, opening it fails (ENXIO) or
        # returns at once instead of waiting for a reader; fstat then refuses it. No O_TRUNC until the
        # open file is known to be a regular one.
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise NotARegularFileError(
                    f"{os.fspath(path)!r} is {_file_kind(mode)}, not a regular file; refusing to write it"
                )
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            self._file = os.fdopen(fd, "w", encoding="utf-8")
        except BaseException:
            os.close(fd)
            raise
        self._fsync = fsync
        self.count = 0

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one record as a line of strict JSON and flush it to disk."""
        self._file.write(_dumps_strict(record, separators=(",", ":")) + "\n")
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
