"""The run recorder: one measuring run's raw file and metadata, saved as it goes, whatever stops it.

    with RunRecorder("batch-size-scan", csv_path, SAMPLE_FIELDS, config=asdict(config),
                     environment=capture_environment(), side_files=write_summary) as run:
        for rows in measure(...):          # a library loop that yields rows
            run.add(rows)                  # raw file and metadata rewritten atomically
        run.finish("complete")

Every measuring command has the same life (docs/files.md): the metadata's `status` is `running` while it
runs, then `complete`, `interrupted` (Ctrl-C, SIGTERM), `oracle-failed`, `out-of-memory` or `failed`;
every row already taken is on disk whichever way it ends. The recorder owns that life, so a command is
flags -> config -> run -> print.

The raw file is a CSV (`.csv`, rewritten atomically with the metadata on every `add`) or JSON lines
(`.jsonl`, one record appended, flushed and fsynced per row, so a crash keeps every record). The
metadata is `<raw file>.meta.json` (strict JSON, written atomically). `side_files(recorder)` is called
after every save, to rewrite the files derived from the rows (a summary CSV, the run's Markdown);
`before_save(recorder)` before it, to update metadata derived from the run's state (row counts).

Leaving the `with` block by an exception saves the files with the status it means (KeyboardInterrupt:
`interrupted`; MemoryError: `out-of-memory`; OracleMismatch: `oracle-failed`; any other Exception:
`failed`, with its text under `error`), with Ctrl-C ignored during that save, and lets the exception go
on: the CLI maps it to the exit code. Leaving it normally without `finish` saves `complete`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from attention_kv_caceh.files import (
    JsonlWriter,
    ignoring_sigint,
    meta_path,
    write_csv_atomic,
    write_json_atomic,
)
from attention_kv_caceh.oracle import OracleMismatch

__all__ = ["STATUSES", "RunRecorder", "Status"]

Status = Literal["running", "complete", "interrupted", "oracle-failed", "out-of-memory", "failed"]
STATUSES: tuple[Status, ...] = (
    "running",
    "complete",
    "interrupted",
    "oracle-failed",
    "out-of-memory",
    "failed",
)


def status_of(exc: BaseException) -> Status | None:
    """The status a run stopped by `exc` ends with (None: an exception that is not a stop, e.g. SystemExit)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, MemoryError):
        return "out-of-memory"
    if isinstance(exc, OracleMismatch):
        return "oracle-failed"
    if isinstance(exc, Exception):
        return "failed"
    return None


class RunRecorder:
    """The files of one run: rows in `path` (CSV or JSONL, by suffix) and `meta` in `<path>.meta.json`.

    `meta` is a plain dict the run may add to (predictions, probe samples, per-B records); it starts as
    {"kind", "status", "config", "environment", **extra}. `rows` holds every row added (CSV only; a
    JSONL run keeps `count`). `fields`: the CSV header, or None for JSONL. Raises ValueError for a row
    with a key outside `fields` (a dropped column would be a lost measurement) and OSError from the files.

    `fsync` False: JSONL rows are flushed, not fsynced (a loop that must not stall for a disk, such as
    the serving harness's event loop; a crash of the process still keeps them). `save_on_open` False:
    nothing is saved until the first `save` (an earlier run's metadata beside `path` is removed), for a
    run whose open must cost one file and no atomic write.
    """

    def __init__(
        self,
        kind: str,
        path: str | os.PathLike[str],
        fields: Sequence[str] | None,
        *,
        config: Mapping[str, Any],
        environment: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
        side_files: Callable[[RunRecorder], None] | None = None,
        before_save: Callable[[RunRecorder], None] | None = None,
        fsync: bool = True,
        save_on_open: bool = True,
    ) -> None:
        self.path = Path(path)
        self.fields = None if fields is None else tuple(fields)
        self.meta: dict[str, Any] = {
            "kind": kind,
            "status": "running",
            "config": dict(config),
            "environment": dict(environment),
            **(extra or {}),
        }
        self.rows: list[Mapping[str, Any]] = []
        self.count = 0
        self._side_files = side_files
        self._before_save = before_save
        self._jsonl = JsonlWriter(self.path, fsync=fsync) if self.path.suffix == ".jsonl" else None
        if save_on_open:
            self.save()
        else:  # an earlier run's metadata must not describe this run's rows until the first save
            meta_path(self.path).unlink(missing_ok=True)

    @property
    def status(self) -> Status:
        return self.meta["status"]

    def add(self, rows: Iterable[Mapping[str, Any]], *, save: bool = True) -> None:
        """Append `rows` and save (a JSONL row is on disk before the next one is written). With `save`
        False a CSV's rows are kept for the next save (the one `finish` or the `with` block makes), e.g.
        the rows of a pass a stop cut short, added just before the run's final save."""
        added = list(rows)
        if self._jsonl is not None:
            for row in added:
                self._jsonl.write(row)
        else:
            self.rows.extend(added)
        self.count += len(added)
        if save:
            self.save()

    def save(self, status: Status | None = None) -> None:
        """Rewrite the raw CSV (not a JSONL file: its rows are on disk), the metadata with `status` (None:
        unchanged) and the side files; `before_save(recorder)` first (to bring derived metadata, such as
        row counts, up to date)."""
        if status is not None:
            self.meta["status"] = status
        if self._before_save is not None:
            self._before_save(self)
        if self.fields is not None:
            write_csv_atomic(self.path, self.rows, self.fields)
        write_json_atomic(meta_path(self.path), self.meta)
        if self._side_files is not None:
            self._side_files(self)

    def finish(self, status: Status = "complete", error: str | None = None) -> None:
        """Save the run's final state; `error` is recorded under `error`. Ctrl-C waits for the save."""
        if error is not None:
            self.meta["error"] = error
        with ignoring_sigint():
            self.save(status)
        self.close()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            if self.status == "running":
                self.finish("complete")
            self.close()
            return
        status = status_of(exc)
        if status is None or self.status != "running":
            self.close()  # already finished (or SystemExit): nothing to record
            return
        self.finish(status, error=None if status == "interrupted" else f"{type(exc).__name__}: {exc}")
