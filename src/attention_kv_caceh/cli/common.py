"""What every subcommand of `attention-kv-caceh` shares: errors, output checks, warnings, the help format.

- `UsageError`: bad input, found before any file is touched; `main` prints one line and exits 2.
- `CommandFailed`: a failure after work started (an oracle mismatch, a failed request, a file that could
  not be written); `main` prints one line and exits 1. Files already written stay complete.
- `check_memory`: the memory estimate of a run, too large a UsageError.
- `check_outputs`: every file a command will write (raw, summary, metadata, plots) is checked up front.
- `check_raw_outputs`: the three checks below for a lab command's raw CSV, the files beside it, its plot.
- `check_side_files`: a file written beside the raw file never replaces another run's raw file.
- `check_markdown_file`: the `<stem>.md` written beside the raw file never replaces a Markdown file
  that no lab command wrote (a user's notes).
- `warn_if_blas_unpinned`: the one BLAS-pinning warning.
- `warn_if_threads_busy`: the one warning for an explicit `--threads N` on CPUs other processes keep
  busy (`cpu_load.explicit_threads_warning`; generate, serve, bench-engine).
- `HelpFormatter`: the one way defaults appear in `--help`: "(default: X)" is appended to every flag
  whose help text does not already say its default; flags without a value of their own spell it out
  ("(default: not written)").
- A final save runs inside `files.ignoring_sigint()`: a second Ctrl-C (or a SIGTERM, which `main`
  turns into a Ctrl-C) cannot cut it short.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NoReturn

from attention_kv_caceh.files import (
    check_not_inputs,
    check_output_path,
    markdown_path,
    meta_path,
)

__all__ = [
    "PROG",
    "CommandFailed",
    "HelpFormatter",
    "OneLineParser",
    "UsageError",
    "check_markdown_file",
    "check_memory",
    "check_outputs",
    "check_raw_outputs",
    "check_side_files",
    "stdout_closed",
    "warn_if_blas_unpinned",
    "warn_if_threads_busy",
]

PROG = "attention-kv-caceh"


class UsageError(Exception):
    """Bad command-line input, found before any file was touched: one line on stderr, exit code 2."""


class CommandFailed(Exception):
    """A failure after the command started working: one line on stderr, exit code 1."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing a usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows "(default: X)" after each flag's help unless the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            text
            and "(default" not in text
            # identity, not equality: a default of 0 equals False and must still be shown
            and not any(action.default is hidden for hidden in (None, False, argparse.SUPPRESS))
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def warn_if_blas_unpinned(hint: str = "") -> None:
    """Warn on stderr when no BLAS/OpenMP thread count was fixed before the process began."""
    from attention_kv_caceh.timing import blas_threads_pinned

    if not blas_threads_pinned():
        print(
            "warning: BLAS threads were not pinned before start (set OPENBLAS_NUM_THREADS=1 "
            f"OMP_NUM_THREADS=1{hint}); timings may vary with thread count",
            file=sys.stderr,
        )


def warn_if_threads_busy(command: str, counts: Sequence[int]) -> float | None:
    """Before an engine loads: with an explicit thread count of 2 or more (`counts`: the --threads
    values given), measure the CPUs other processes keep busy (`cpu_load.measure_others_busy`, 0.25 s
    on this process's CPU set) and print one warning on stderr when the largest count is more than the
    load governor would take (`cpu_load.explicit_threads_warning`). The counts are kept as given.
    Returns the measured busy CPUs (None: not measured, no count of 2 or more, or no /proc/stat)."""
    if not counts or max(counts) < 2:
        return None
    from attention_kv_caceh.cpu_load import explicit_threads_warning, measure_others_busy
    from attention_kv_caceh.cpus import usable_cpus

    ids = usable_cpus().ids
    others = measure_others_busy(ids)
    warning = explicit_threads_warning(max(counts), others, len(ids))
    if warning is not None:
        print(f"{PROG} {command}: {warning}", file=sys.stderr, flush=True)
    return others


def stdout_closed() -> None:
    """After a BrokenPipeError on stdout (its reader, e.g. `| head`, has gone): point stdout at
    os.devnull so that later prints and the interpreter's final flush neither fail nor print a
    traceback, as the CPython documentation of SIGPIPE recommends."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind stdout (a test's StringIO)
        pass


def check_memory(needed: int, what: str, lower: str) -> None:
    """`memory.check_memory`, whose MemoryBudgetError (a run too large for this machine, both sizes and
    the flags that lower it in its message) is here a UsageError: exit 2 before any file is touched."""
    from attention_kv_caceh import memory

    try:
        memory.check_memory(needed, what, lower)
    except memory.MemoryBudgetError as exc:
        raise UsageError(str(exc)) from None


def check_outputs(
    outputs: Iterable[tuple[str, str | os.PathLike[str] | None, tuple[str, ...]]],
    inputs: Iterable[tuple[str, str | os.PathLike[str] | None]] = (),
) -> None:
    """Check every file a command will write before the first sample is taken.

    `outputs` holds (what, path, suffixes): `what` names the flag ("--csv", or "--csv 'r/x.csv': the
    file beside it"), a None path is skipped, `suffixes` may be empty. `inputs` holds (flag, path) of
    every file or folder the command reads (`files.check_not_inputs`). Raises UsageError naming the flag
    and path for a wrong suffix, a folder, an unwritable parent (see `files.check_output_path`), two
    outputs that are the same file, or an output that is an input. Nothing is created.
    """
    outputs = list(outputs)
    seen: dict[Path, str] = {}
    for what, path, suffixes in outputs:
        if path is None:
            continue
        try:
            checked = check_output_path(path, what, suffixes)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        resolved = checked.resolve()
        if resolved in seen:
            raise UsageError(
                f"{what} {str(path)!r} is the same file as {seen[resolved]}; output files must differ"
            )
        seen[resolved] = what
    try:
        check_not_inputs([(what, path) for what, path, _ in outputs], inputs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_raw_outputs(
    csv: Path, side: dict[Path, tuple[str, ...]], *others: tuple[str, Path | None, tuple[str, ...]]
) -> None:
    """Every file a lab command writes around its raw CSV, checked before the first sample: `--csv`, the
    files beside it (`side`: each path -> the CSV header written there, () for a non-CSV; the `<stem>.md`
    beside the CSV is always one) and `others` ((flag, path, suffixes): the plot). Raises UsageError
    naming the flag (`check_outputs`, `check_side_files`, `check_markdown_file`). Nothing is created."""
    beside = f"--csv {str(csv)!r}: the file beside it"
    side = {**side, markdown_path(csv): ()}
    check_outputs([("--csv", csv, (".csv",)), *((beside, path, ()) for path in side), *others])
    check_side_files("--csv", side)
    check_markdown_file("--csv", csv)


def check_side_files(flag: str, side_files: dict[Path, tuple[str, ...]]) -> None:
    """Refuse to replace another run's raw file with a file written beside this run's raw file.

    `side_files` maps every file the command writes beside its raw file (its summary, memory rows and
    metadata) to the CSV header it writes there (() for a non-CSV). A side file that already exists
    is another run's raw file, and UsageError names `flag`, the file and why, when
    - a `.meta.json` sits beside it and the command does not write that metadata itself (only raw
      files have metadata beside them), or
    - its header is a raw file's (`report.readers.raw_kind_of_file`) other than the one written there.
    A side file of an earlier run of the same command (same --csv) is replaced, as before.
    """
    from attention_kv_caceh.report.readers import classify_header, raw_kind_of_file

    for path, header in side_files.items():
        if not path.is_file():
            continue
        meta = meta_path(path)
        if meta not in side_files and meta.is_file():
            why = f"{meta} is beside it"
        else:
            found = raw_kind_of_file(path)
            if found is None or found == classify_header(header):
                continue
            why = "its header is a raw file's header"
        raise UsageError(
            f"{flag}: {str(path)!r}, a file this run writes beside its raw file, is another run's raw "
            f"file ({why}); choose another {flag} or move that file"
        )


def check_markdown_file(flag: str, csv_path: str | os.PathLike[str]) -> None:
    """Refuse to replace a Markdown file beside the raw CSV that no lab command wrote.

    The command writes its section to `files.markdown_path(csv_path)` (`results/x.csv` ->
    `results/x.md`). When that file exists and a lab command did not write it
    (`report.readers.written_by_lab`: a user's notes, an empty or unreadable file), UsageError names
    `flag` and the file. A Markdown file of an earlier lab run is replaced, as before. Nothing is written.
    """
    from attention_kv_caceh.report.readers import written_by_lab

    path = markdown_path(csv_path)
    if path.is_file() and not written_by_lab(path):
        raise UsageError(
            f"{flag}: {str(path)!r} exists and was not written by a lab command (its first line is not "
            f"a section heading they write), and this run would replace it; choose another {flag} or "
            "move that file"
        )
