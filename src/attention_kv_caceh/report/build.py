"""`build_report`: one pass over a results folder, one handler per kind of raw file, one Markdown text.

Each raw kind (`readers.KINDS`, plus per-request JSONL) has a handler in `_CSV_HANDLERS` that parses the
file and appends its section (from `sections.py`, `serving.py` or `sweep.py`) and plot; cache-growth runs are paired with their
memory rows once every file has been read. A handler's failure is a problem of that file only.
"""

from __future__ import annotations

import csv
import os
import stat
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attention_kv_caceh.experiments.cache_growth_stats import CacheMemoryRow, CacheStepSample
from attention_kv_caceh.experiments.scan_impls import IMPLS
from attention_kv_caceh.experiments.views import ViewRow
from attention_kv_caceh.files import meta_path
from attention_kv_caceh.report.environment import environment_card
from attention_kv_caceh.report.jsonl import generate_output_kind, read_jsonl
from attention_kv_caceh.report.predictions import cache_run_markdown, scan_run_markdown
from attention_kv_caceh.report.readers import CLASSES, kind_of, parse_csv, run_key
from attention_kv_caceh.report.repeats import RepeatFile, repeat_of, repeats_section
from attention_kv_caceh.report.serving import serving_section
from attention_kv_caceh.report.sources import FileProblem, ReportResult, kind_word, read_header, read_meta
from attention_kv_caceh.report.sweep import parse_sweep_csv, read_sweep_json, sweep_section
from attention_kv_caceh.report.views import views_section
from attention_kv_caceh.timing import Sample

__all__ = ["build_report", "planned_plots"]


def _describe(exc: BaseException) -> str:
    """An unexpected error in one line: its type, and its message when it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _plot_target(out: Path, csv_name: str) -> Path:
    return out.with_name(f"{out.stem}-{Path(csv_name).stem}.png")


# Raw file suffixes, exact and lower-case, as `files.check_output_path` makes every writer use them.
SUFFIXES = (".csv", ".jsonl")
_META = ".meta.json"


def _case_mismatch(name: str) -> str | None:
    """The lower-case suffix a name has in another case (`B.CSV` -> ".csv"), else None."""
    lower = name.lower()
    for suffix in (*SUFFIXES, _META):
        if lower.endswith(suffix) and not name.endswith(suffix):
            return suffix
    return None


def planned_plots(results_dir: str | Path, out_path: str | Path) -> list[Path]:
    """The PNGs `build_report` may write beside `out_path`: one per scan or cache-growth raw CSV in
    `results_dir` (told by its recorded kind, else its header: `readers.kind_of`; regular `.csv` files
    only). Lets a caller check them before
    anything is written.

    Raises ValueError when `results_dir` is not a folder.
    """
    folder, out = Path(results_dir), Path(out_path)
    if not folder.is_dir():
        raise ValueError(f"--results {str(results_dir)!r} is not a folder")
    return [
        _plot_target(out, path.name)
        for path in sorted(folder.iterdir())
        if path.suffix == ".csv"
        and kind_of(read_header(path), read_meta(path, [], required=False))[0] in ("scan", "cache")
    ]


@dataclass
class _Build:
    """What the handlers fill while the folder is read."""

    out: Path
    plot: bool
    result: ReportResult
    folder: Path = Path()  # the --results folder: problems name files by their path in it
    metas: dict[str, dict[str, Any]] = field(default_factory=lambda: dict[str, dict[str, Any]]())
    buckets: dict[str, list[str]] = field(
        default_factory=lambda: {
            "scan": [],
            "cache": [],
            "views": [],
            "sweep": [],
            "serving": [],
            "repeats": [],
        }
    )
    skipped: list[str] = field(default_factory=lambda: list[str]())
    not_read: list[str] = field(default_factory=lambda: list[str]())  # other commands' files, by design
    no_meta: list[str] = field(default_factory=lambda: list[str]())  # raw files used without metadata
    cache_runs: list[tuple[str, list[CacheStepSample], dict[str, Any] | None]] = field(
        default_factory=lambda: list[tuple[str, list[CacheStepSample], dict[str, Any] | None]]()
    )
    memory_files: dict[str, list[CacheMemoryRow]] = field(
        default_factory=lambda: dict[str, list[CacheMemoryRow]]()
    )
    repeats: dict[str, list[RepeatFile]] = field(default_factory=lambda: dict[str, list[RepeatFile]]())


def _scan(b: _Build, path: Path, rows: list[Any], meta: dict[str, Any] | None) -> None:
    samples: list[Sample] = rows
    unknown = sorted({s.impl for s in samples} - set(IMPLS))
    if unknown:
        raise ValueError(f"unknown impl {', '.join(map(repr, unknown))} (expected one of {', '.join(IMPLS)})")
    problems: list[str] = []
    text, table = scan_run_markdown(path.name, samples, meta, problems)
    # problems name files as the folder walk does: by their path
    b.result.problems += [FileProblem(str(meta_path(path)), p) for p in problems]
    if b.plot:
        from attention_kv_caceh.report.plots import plot_scan

        target = _plot_target(b.out, path.name)
        b.result.plots.append(plot_scan(table, target, title=f"Batch-size scan: {path.name}"))
        text += f"\n![{path.name}]({target.name})\n"
    b.buckets["scan"].append(text)


def _cache(b: _Build, path: Path, rows: list[Any], meta: dict[str, Any] | None) -> None:
    b.cache_runs.append((path.name, rows, meta))


def _cache_memory(b: _Build, path: Path, rows: list[Any], meta: dict[str, Any] | None) -> None:
    b.memory_files[path.name] = rows


def _views(b: _Build, path: Path, rows: list[Any], meta: dict[str, Any] | None) -> None:
    views: list[ViewRow] = rows
    b.buckets["views"].append(views_section(path.name, views))


def _sweep(b: _Build, path: Path, rows: list[Any], meta: dict[str, Any] | None) -> None:
    problems: list[str] = []
    text = sweep_section(path.name, rows, meta, problems)
    b.result.problems += [FileProblem(str(path.with_suffix(".json")), p) for p in problems]
    b.buckets["sweep"].append(text)


# Raw CSV kind -> handler. Every kind but the memory rows has its own `.meta.json`.
_CSV_HANDLERS: dict[str, Callable[[_Build, Path, list[Any], dict[str, Any] | None], None]] = {
    "scan": _scan,
    "cache": _cache,
    "cache-memory": _cache_memory,
    "views": _views,
    "sweep": _sweep,
}


def _not_regular(path: Path) -> str | None:
    """Why a raw-file name is not read as a file (a folder, a FIFO, a broken link), or None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if path.is_symlink() else "gone while the folder was read"
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    return None if stat.S_ISREG(mode) else kind_word(mode)


def _read_csv_file(b: _Build, path: Path) -> None:
    problems = b.result.problems
    try:
        header = read_header(path, quiet=False)
    except ValueError as exc:  # not a regular file, above the size cap (UnicodeDecodeError: below)
        if isinstance(exc, UnicodeDecodeError):
            problems.append(FileProblem(str(path), f"unreadable CSV: {exc}"))
        else:
            problems.append(FileProblem(str(path), str(exc)))
        return
    except (OSError, csv.Error) as exc:
        problems.append(FileProblem(str(path), f"unreadable CSV: {exc}"))
        return
    found: list[FileProblem] = []  # the metadata's own problems, reported for a raw file that reads it
    meta = read_meta(path, found, required=False)
    kind, wrong = kind_of(header, meta)
    if wrong is not None:
        problems.append(FileProblem(str(path), wrong))
        return
    if kind is None:
        problems.append(FileProblem(str(path), f"unrecognised header: {', '.join(header) or '(empty)'}"))
        return
    if kind.startswith("derived:"):
        b.skipped.append(f"`{path.name}` ({kind[8:]}: statistics are recomputed from the raw samples)")
        return
    try:
        if kind == "sweep":
            rows: list[Any] = parse_sweep_csv(path)
        else:
            rows = parse_csv(CLASSES[kind], kind, path, problems)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        problems.append(FileProblem(str(path), f"unreadable CSV: {exc}"))
        return
    except ValueError as exc:
        problems.append(FileProblem(str(path), f"malformed {kind} CSV: {exc}"))
        return
    if not rows:
        problems.append(FileProblem(str(path), f"{kind} CSV with a header but no rows"))
        return
    if kind == "sweep":  # its environment is in the sweep.json beside it
        meta = read_sweep_json(path, rows[0]["axis"], problems)
    elif kind == "cache-memory":  # paired with its run's rows, whose metadata it copies
        meta = None
    else:
        problems += found
        if meta is None and not found:
            problems.append(
                FileProblem(str(meta_path(path)), "missing: the environment of this run is unknown")
            )
    try:
        _CSV_HANDLERS[kind](b, path, rows, meta)
    except ValueError as exc:
        problems.append(FileProblem(str(path), f"malformed {kind} CSV: {exc}"))
        return
    except Exception as exc:  # one file's failure must not cost the whole report (MemoryError included)
        problems.append(FileProblem(str(path), f"cannot report this {kind} CSV: {_describe(exc)}"))
        return
    # only a file that is reported has a column in the environment card
    if meta is not None:
        b.metas[path.name] = meta
    elif kind != "cache-memory":
        b.no_meta.append(path.name)
    b.result.sources.append(path.name)


def _read_jsonl_file(b: _Build, path: Path) -> None:
    problems = b.result.problems
    generated = generate_output_kind(path)
    if generated is not None:  # `generate` prints its own summary; its files hold no timing to recompute
        what = "continuations" if generated == "--output" else "per-step engine trace"
        b.not_read.append(f"`{path.name}` (`generate {generated}`: {what})")
        return
    records = read_jsonl(path, problems)
    if records is None:
        return
    # The harness writes `<jsonl>.meta.json`; older runs have none (noted in the card).
    meta = read_meta(path, problems, required=False)
    meta_problems: list[str] = []
    try:
        text = serving_section(path.name, records, meta, meta_problems)
    except ValueError as exc:
        problems.append(FileProblem(str(path), f"cannot summarize: {exc}"))
        return
    except Exception as exc:
        problems.append(FileProblem(str(path), f"cannot summarize: {_describe(exc)}"))
        return
    problems += [FileProblem(str(meta_path(path)), p) for p in meta_problems]
    b.buckets["serving"].append(text)
    repeat = repeat_of(meta)
    if repeat is not None and meta is not None:
        of, index, count = repeat
        b.repeats.setdefault(of, []).append(RepeatFile(index, count, path.name, records, meta))
    b.result.sources.append(path.name)
    if meta is not None:
        b.metas[path.name] = meta
    else:
        b.no_meta.append(path.name)


def _memory_of(
    b: _Build, name: str, samples: list[CacheStepSample], meta: dict[str, Any] | None
) -> list[CacheMemoryRow]:
    """The memory rows of a cache run: the memory CSV its metadata names (`files.memory`) when that one
    has the run's parameters, else the one memory CSV with them; none (noted) when several match."""
    key = run_key(samples[0])
    matching = [m for m, rows in b.memory_files.items() if run_key(rows[0]) == key]
    files: Any = meta.get("files") if meta is not None else None
    named: Any = typing.cast("dict[str, Any]", files).get("memory") if isinstance(files, dict) else None
    if isinstance(named, str) and Path(named).name in matching:
        return b.memory_files[Path(named).name]
    if len(matching) == 1:
        return b.memory_files[matching[0]]
    if matching:
        b.result.problems.append(
            FileProblem(
                str(b.folder / name),
                f"{len(matching)} memory CSVs have this run's parameters ({', '.join(matching)}) and its "
                "metadata names none of them: the memory table is left out",
            )
        )
    return []


def _pair_cache_runs(b: _Build) -> None:
    """Each cache-growth run with the memory rows of the same parameters: its section and plot."""
    for name, samples, meta in b.cache_runs:
        memory = _memory_of(b, name, samples, meta)
        try:
            problems: list[str] = []
            text = cache_run_markdown(name, samples, memory, meta, problems)
            b.result.problems += [FileProblem(str(meta_path(b.folder / name)), p) for p in problems]
            if b.plot:
                from attention_kv_caceh.report.plots import plot_cache_growth

                target = _plot_target(b.out, name)
                title = f"KV-cache growth: {name}"
                b.result.plots.append(plot_cache_growth(samples, memory, target, title=title))
                text += f"\n![{name}]({target.name})\n"
        except ValueError as exc:
            b.result.problems.append(
                FileProblem(str(b.folder / name), f"cannot summarize the cache run: {exc}")
            )
            continue
        except Exception as exc:
            b.result.problems.append(
                FileProblem(str(b.folder / name), f"cannot summarize the cache run: {_describe(exc)}")
            )
            continue
        b.buckets["cache"].append(text)


def build_report(
    results_dir: str | Path,
    out_path: str | Path,
    *,
    plot: bool = True,
) -> ReportResult:
    """Read every raw file in `results_dir`, recompute the statistics, draw the plots beside `out_path`
    (named `<report stem>-<csv stem>.png`), and return the Markdown (the caller writes it).

    Raw files are found by exact, lower-case suffix (`.csv`, `.jsonl`), the rule every writer follows.
    Raises ValueError when `results_dir` is not a folder or `out_path` does not end in .md. Problems
    with individual files never raise: they are returned in `problems` and listed in the report, and
    so is an unexpected error in one file's section (the others are still reported). Listed and not
    read: a raw-file name that is not a regular file (a folder, a FIFO, a broken link), a suffix that
    differs only in case (`B.CSV`), a file above `sources.MAX_INPUT_BYTES`; rejected with the reason:
    a row with a value out of range (see `readers.parse_rows`), a file mixing runs or repeating a row
    (see `readers.parse_csv`). A metadata `prediction` that cannot be rebuilt is listed too.
    """
    folder, out = Path(results_dir), Path(out_path)
    if not folder.is_dir():
        raise ValueError(f"--results {str(results_dir)!r} is not a folder")
    if out.suffix.lower() != ".md":
        raise ValueError(f"--out {str(out_path)!r} must end in .md")
    b = _Build(out=out, plot=plot, result=ReportResult(markdown=""), folder=folder)
    for path in sorted(folder.iterdir()):
        if (suffix := _case_mismatch(path.name)) is not None:
            b.result.problems.append(FileProblem(str(path), f"not read: suffixes are lower-case ({suffix})"))
        elif path.suffix not in SUFFIXES:
            continue
        elif (why := _not_regular(path)) is not None:
            b.result.problems.append(FileProblem(str(path), f"skipped: {why}"))
        else:
            try:
                (_read_csv_file if path.suffix == ".csv" else _read_jsonl_file)(b, path)
            except MemoryError:  # what is left of the file's rows is freed with this frame
                b.result.problems.append(
                    FileProblem(str(path), "out of memory while reading it: not reported")
                )
    _pair_cache_runs(b)
    for of, files in sorted(b.repeats.items()):
        try:
            b.buckets["repeats"].append(repeats_section(of, files))
        except ValueError as exc:
            b.result.problems.append(FileProblem(str(folder / of), f"cannot summarize its repeats: {exc}"))

    result, problems = b.result, b.result.problems
    parts = [
        "# Results report\n",
        f"Recomputed from the raw files in `{folder}`: {', '.join(f'`{s}`' for s in result.sources) or 'none'}.\n",
        "## Environment\n",
        environment_card(b.metas, b.no_meta),
        "## Results\n",
        *([t for bucket in b.buckets.values() for t in bucket] or ["No raw results were found.\n"]),
    ]
    if b.skipped:
        parts += ["## Summary files not used\n", *(f"- {s}" for s in b.skipped), ""]
    if b.not_read:
        parts += [
            "## Files of other commands, not a kind report reads\n",
            *(f"- {s}" for s in b.not_read),
            "",
        ]
    if problems:
        parts += [
            "## Problems with files\n",
            *(f"- `{p.path}`: {p.problem}" for p in problems),
            "",
        ]
    result.markdown = "\n".join(parts).rstrip("\n") + "\n"
    return result
