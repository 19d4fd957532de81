"""The results report: read every raw file in a results folder and write the findings back as Markdown.

Statistics are recomputed from raw samples only (`timing.summarize_samples` through `scan.scan_table`
and `cache_growth.summarize_cache_growth`); summary files in the folder are listed and ignored. File
kinds are told apart by their CSV header, never by their name:

- batch-size scan raw CSV: the fields of `timing.Sample`; its `<csv>.meta.json` gives the environment,
  the read-bandwidth probe samples and the KV bytes per step.
- cache-growth raw CSV (`CacheStepSample` fields) and its memory CSV (`CacheMemoryRow` fields), paired
  by their run parameters.
- the view/copy table (`ViewRow` fields).
- serving-harness per-request JSONL (`*.jsonl`): records rebuilt from their raw timestamps and summarized
  by the harness's own `summarize_run` (completed requests only).

Outliers are flagged (a sample above 2 x the P95 of its group) and kept. A missing or malformed file is
named with what is wrong, and everything else is still reported. Plots go beside the report.
"""

from __future__ import annotations

import csv
import json
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from attention_kv_caceh.experiments.cache_growth import (
    CACHE_KINDS,
    CacheGrowthSummary,
    CacheMemoryRow,
    CacheStepSample,
    summarize_cache_growth,
)
from attention_kv_caceh.experiments.scan import saturation_verdict, scan_table
from attention_kv_caceh.experiments.views import ViewRow, views_markdown
from attention_kv_caceh.files import meta_path
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.summary import METRIC_NAMES, summarize_run
from attention_kv_caceh.timing import Sample, summarize_samples

__all__ = [
    "OUTLIER_FACTOR",
    "FileProblem",
    "ReportResult",
    "build_report",
    "classify_header",
    "flag_outliers",
    "parse_rows",
]

# A sample above OUTLIER_FACTOR x the P95 of its group is flagged (kept, never dropped).
OUTLIER_FACTOR = 2.0

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


def parse_rows(cls: type[T], rows: Sequence[Mapping[str, str | None]]) -> list[T]:
    """Build dataclass instances from CSV rows (strings), converting each field to its annotated type.

    Raises ValueError naming the data row (1-based, after the header) and column of the first bad value.
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
        out.append(cls(**values))
    return out


def flag_outliers(values: Sequence[float], factor: float = OUTLIER_FACTOR) -> list[int]:
    """Indices of the values above `factor` x their P95 (`summarize_samples`); empty for no values."""
    if not values:
        return []
    limit = factor * summarize_samples(values)["p95_ms"]
    return [i for i, v in enumerate(values) if v > limit]


# -------------------------------------------------------------------------------------------- helpers


def _num(x: float, digits: int = 4) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return "n/a"
    if x == 0:
        return "0"
    if abs(x) >= 10 ** (digits + 1) or abs(x) < 10 ** (-digits + 1):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for row in rows:
        cells = [_num(c) if isinstance(c, float) else str(c) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str | None]]]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows: list[dict[str, str | None]] = []
        for row in reader:
            if None in row:
                raise ValueError(f"row {len(rows) + 1} has more cells than the header")
            rows.append(dict(row))
    return header, rows


def _read_meta(csv_path: Path, problems: list[FileProblem]) -> dict[str, Any] | None:
    path = meta_path(csv_path)
    if not path.exists():
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


def _int_keyed(meta: Mapping[str, Any] | None, key: str, path: str, problems: list[FileProblem]) -> Any:
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


# ------------------------------------------------------------------------------------ environment


def _environment_card(metas: Mapping[str, Mapping[str, Any]]) -> str:
    if not metas:
        return "No metadata found: the environment of these results is unknown.\n"
    keys = [
        ("start_time_utc", "start (UTC)"),
        ("cpu_model", "CPU"),
        ("cpu_count", "CPU count"),
        ("platform", "platform"),
        ("python", "Python"),
        ("numpy", "NumPy"),
        ("blas", "BLAS"),
        ("blas_threads", "BLAS threads"),
        ("thread_env", "thread variables"),
        ("git_commit", "git commit"),
    ]
    names = list(metas)
    rows: list[list[object]] = []
    for key, label in keys:
        cells: list[object] = [label]
        for name in names:
            env: Any = metas[name].get("environment", {})
            value: Any = typing.cast("dict[str, Any]", env).get(key, "?") if isinstance(env, dict) else "?"
            if key == "blas" and isinstance(value, list):
                value = ", ".join(
                    f"{p.get('internal_api')} {p.get('version')}"
                    for p in typing.cast("list[dict[str, Any]]", value)
                )
            elif key == "thread_env" and isinstance(value, dict):
                value = (
                    " ".join(f"{k}={v}" for k, v in typing.cast("dict[str, Any]", value).items()) or "none"
                )
            elif key == "git_commit" and isinstance(value, str):
                value = value[:12]
            cells.append(str(value).replace("|", "/"))
        rows.append(cells)
    return _table(["", *names], rows)


# ------------------------------------------------------------------------------------------- scan


def _scan_section(
    name: str, samples: list[Sample], meta: Mapping[str, Any] | None, problems: list[FileProblem]
) -> tuple[str, list[dict[str, float]]]:
    meta_name = meta_path(name).name
    probe = _int_keyed(meta, "probe_samples_ms", meta_name, problems)
    kv = _int_keyed(meta, "kv_bytes_per_step", meta_name, problems)
    table = scan_table(samples, probe, kv)
    verdict = saturation_verdict(table)
    first = samples[0]
    out = [
        f"### Batch-size scan: `{name}`\n",
        f"{len(samples)} raw samples; T = {table[0]['sequence_length']:.0f}, H = {first.num_heads}, "
        f"H_kv = {first.num_kv_heads}, D = {first.head_dim}, {first.dtype}, {first.cache} cache"
        + (f", model {first.model}" if first.model else "")
        + f", {first.warmup} warm-up calls.\n",
        _table(
            [
                "B",
                "n",
                "P50 ms",
                "P95 ms",
                "min ms",
                "max ms",
                "per-seq ms",
                "positions/s",
                "speedup",
                "KV GB/s",
                "probe GB/s",
                "KV / probe",
            ],
            [
                [
                    int(r["batch_size"]),
                    int(r["count"]),
                    r["p50_ms"],
                    r["p95_ms"],
                    r["min_ms"],
                    r["max_ms"],
                    r["per_sequence_ms"],
                    r["positions_per_s"],
                    r["speedup"],
                    r["kv_read_gb_s"],
                    r["probe_read_gb_s"],
                    r["bandwidth_ratio"],
                ]
                for r in table
            ],
        ),
        f"**Saturation verdict:** {verdict}.\n",
        "**Why higher throughput does not make a single request faster.** Every sequence of a batch "
        "waits for the whole step before it gets its next token, so one request's per-token latency is "
        "the step's P50, not the per-sequence cost:\n",
    ]
    base = table[0]
    for r in table[1:]:
        out.append(
            f"- B = {r['batch_size']:.0f}: the step takes {_num(r['p50_ms'])} ms, "
            f"{r['p50_ms'] / base['p50_ms']:.2f}x the B = {base['batch_size']:.0f} step "
            f"({_num(base['p50_ms'])} ms), so each request waits {r['p50_ms'] / base['p50_ms']:.2f}x as "
            f"long per token, while the per-sequence cost is {_num(r['per_sequence_ms'])} ms "
            f"({r['per_sequence_ms'] / base['per_sequence_ms']:.2f}x) and positions/s rise "
            f"{r['speedup']:.2f}x."
        )
    if len(table) == 1:
        out.append("- One batch size only: nothing to compare.")
    out.append("")
    flagged: list[str] = []
    for r in table:
        group = [s for s in samples if s.batch_size == r["batch_size"]]
        idx = flag_outliers([s.elapsed_ms for s in group])
        flagged += [
            f"B={group[i].batch_size} repeat {group[i].repeat}: {_num(group[i].elapsed_ms)} ms" for i in idx
        ]
    out.append(_outlier_line(flagged, "its batch size"))
    return "\n".join(out) + "\n", table


def _outlier_line(flagged: Sequence[str], group: str) -> str:
    if not flagged:
        return f"Outliers (> {OUTLIER_FACTOR:g} x the P95 of {group}): none.\n"
    shown = "; ".join(flagged[:10]) + (f"; and {len(flagged) - 10} more" if len(flagged) > 10 else "")
    return (
        f"Outliers (> {OUTLIER_FACTOR:g} x the P95 of {group}), kept in every statistic: "
        f"{len(flagged)}: {shown}.\n"
    )


# ------------------------------------------------------------------------------------------ cache


def _run_key(row: CacheStepSample | CacheMemoryRow) -> tuple[Any, ...]:
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


def _cache_section(
    name: str, samples: list[CacheStepSample], memory: list[CacheMemoryRow]
) -> tuple[str, CacheGrowthSummary]:
    s = summarize_cache_growth(samples, memory)
    first = samples[0]
    n = max(x.sequence_length for x in samples)
    repeats = len({x.repeat for x in samples})
    fd, fp = s.fits["dynamic"], s.fits["preallocated"]
    out = [
        f"### KV-cache growth: `{name}`\n",
        f"{len(samples)} raw step samples: N = {n} steps, B = {first.batch_size}, H = {first.num_heads}, "
        f"H_kv = {first.num_kv_heads}, D = {first.head_dim}, {first.dtype}"
        + (f", model {first.model}" if first.model else "")
        + f", {repeats} timed passes per cache after {first.warmup} warm-up pass(es).\n",
        "Per-step P50 (all repeats, positions in a window of N/64 ending at T):\n",
        _table(
            ["T", "dynamic P50 ms", "preallocated P50 ms", "dynamic / preallocated"],
            [
                [int(c["sequence_length"]), c["dynamic_p50_ms"], c["preallocated_p50_ms"], c["ratio"]]
                for c in s.checkpoints
            ],
        ),
        "Per-step time against T (np.polyfit on the per-position median over repeats):\n",
        _table(
            ["cache", "slope us/position", "intercept ms", "R^2", "R^2 (raw)", "N-step total P50 ms"],
            [
                [
                    k,
                    s.fits[k].slope_ms_per_position * 1000,
                    s.fits[k].intercept_ms,
                    s.fits[k].r2,
                    s.fits[k].r2_raw,
                    s.totals[k]["p50_ms"],
                ]
                for k in CACHE_KINDS
            ],
        ),
        f"**N-step total time ratio** (dynamic / preallocated): **{s.total_ratio:.2f}x**. The Dynamic "
        f"cache's slope is {fd.slope_ms_per_position / fp.slope_ms_per_position:.1f}x the Preallocated "
        f"one's: both read T positions in attention, only the Dynamic one also copies them."
        if fp.slope_ms_per_position > 0
        else f"**N-step total time ratio** (dynamic / preallocated): **{s.total_ratio:.2f}x**.",
        "",
        "**Where the Dynamic cache's copying starts to dominate.** "
        + (
            f"The rolling median of the Dynamic step stays >= 1.1x the Preallocated one from T = "
            f"{s.copy_visible_from}"
            if s.copy_visible_from is not None
            else "The Dynamic step is not consistently >= 1.1x the Preallocated one within N"
        )
        + "; "
        + (
            f"it stays >= 2x (the copy costs more than the whole Preallocated step) from T = "
            f"{s.copy_dominates_from}"
            if s.copy_dominates_from is not None
            else "it does not stay >= 2x within N"
        )
        + (
            f" (the fitted lines reach 2x at T ~ {s.copy_dominates_fitted:.0f})."
            if s.copy_dominates_fitted is not None
            else "."
        )
        + f" How well a straight line describes the growth: R^2 = {fd.r2:.2f} (dynamic), {fp.r2:.2f} "
        "(preallocated); a low R^2 means the cost does not grow smoothly with T (cache sizes, page "
        "faults of fresh allocations, a shared machine), read the plot.\n",
    ]
    if s.memory:
        out.append("Memory (untimed pass under tracemalloc):\n")
        out.append(
            _table(
                [
                    "cache",
                    "append peak at T=1",
                    "append peak at T=N",
                    "B/position (traced)",
                    "new buffers B/position",
                    "largest step peak",
                    "nbytes at N",
                    "theoretical at N",
                ],
                [
                    [
                        k,
                        _bytes(m["append_bytes_first_step"]),
                        _bytes(m["append_bytes_last_step"]),
                        m["append_bytes_per_position"],
                        m["new_buffer_bytes_per_position"],
                        _bytes(m["max_step_peak_bytes"]),
                        _bytes(m["final_cache_nbytes"]),
                        _bytes(m["final_theoretical_bytes"]),
                    ]
                    for k, m in s.memory.items()
                ],
            )
        )
    else:
        out.append("No memory CSV with the same run parameters was found.\n")
    w = max(1, n // 64)
    flagged: list[str] = []
    for kind in CACHE_KINDS:
        rows = [x for x in samples if x.cache == kind]
        for lo in range(0, n, w):
            group = [x for x in rows if lo < x.sequence_length <= lo + w]
            flagged += [
                f"{kind} T={group[i].sequence_length} repeat {group[i].repeat}: {_num(group[i].elapsed_ms)} ms"
                for i in flag_outliers([x.elapsed_ms for x in group])
            ]
    out.append(_outlier_line(flagged, f"its cache in windows of {w} positions"))
    return "\n".join(out) + "\n", s


# ------------------------------------------------------------------------------------------ jsonl


def _record_from_json(rec: Mapping[str, Any]) -> RequestRecord:
    """A harness RequestRecord from one JSONL object (its raw timestamps; derived keys are ignored)."""
    names = {f.name for f in fields(RequestRecord)}
    try:
        return RequestRecord(**{k: v for k, v in rec.items() if k in names})
    except TypeError as exc:
        raise ValueError(f"not a per-request record ({exc})") from None


def _jsonl_section(path: Path, problems: list[FileProblem]) -> str | None:
    """Serving-harness records, summarized by `harness.summary.summarize_run` from raw timestamps."""
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
    start = min(r.arrival_ns for r in records)
    ends = [t for r in records for t in (r.stream_end_ns, r.finish_ns) if t is not None]
    duration_s = (max(ends) - start) / 1e9 if ends and max(ends) > start else float("nan")
    try:
        summary = summarize_run(records, duration_s)
    except ValueError as exc:
        problems.append(FileProblem(str(path), f"cannot summarize: {exc}"))
        return None
    rows: list[list[object]] = []
    for metric, label in METRIC_NAMES.items():
        count = summary.get(f"count_{metric}") or 0
        if count:
            row: list[object] = [label, int(count)]
            row += [float(summary[f"{p}_{metric}_ms"]) for p in ("median", "p90", "p99", "mean", "max")]
            rows.append(row)
    failures = ", ".join(f"{k}: {v}" for k, v in summary["failures"].items()) or "none"
    return (
        f"### Serving run: `{path.name}`\n\n{summary['num_requests']} request(s), "
        f"{summary['completed']} completed, failures: {failures}; {summary['request_throughput']:.3g} "
        f"requests/s and {summary['output_throughput']:.3g} output tokens/s over {duration_s:.3g} s. "
        "Latencies of completed requests only (`harness.summary.summarize_run`); ITL pools every gap.\n\n"
        + _table(["metric", "n", "P50 ms", "P90 ms", "P99 ms", "mean ms", "max ms"], rows)
    )


# ------------------------------------------------------------------------------------------- main


def build_report(
    results_dir: str | Path,
    out_path: str | Path,
    *,
    plot: bool = True,
) -> ReportResult:
    """Read every raw file in `results_dir`, recompute the statistics, draw the plots beside `out_path`
    (named `<report stem>-<csv stem>.png`), and return the Markdown (the caller writes it).

    Raises ValueError when `results_dir` is not a folder or `out_path` does not end in .md. Problems
    with individual files never raise: they are returned in `problems` and listed in the report.
    """
    folder, out = Path(results_dir), Path(out_path)
    if not folder.is_dir():
        raise ValueError(f"--results {str(results_dir)!r} is not a folder")
    if out.suffix.lower() != ".md":
        raise ValueError(f"--out {str(out_path)!r} must end in .md")
    result = ReportResult(markdown="")
    problems = result.problems
    metas: dict[str, dict[str, Any]] = {}
    buckets: dict[str, list[str]] = {"scan": [], "cache": [], "views": [], "serving": []}
    skipped: list[str] = []
    cache_runs: list[tuple[str, list[CacheStepSample]]] = []
    memory_rows: list[CacheMemoryRow] = []

    for path in sorted(folder.iterdir()):
        if path.suffix == ".csv" and path.is_file():
            try:
                header, rows = _read_csv(path)
            except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
                problems.append(FileProblem(str(path), f"unreadable CSV: {exc}"))
                continue
            kind = classify_header(header)
            if kind is None:
                problems.append(
                    FileProblem(str(path), f"unrecognised header: {', '.join(header) or '(empty)'}")
                )
                continue
            if kind.startswith("derived:"):
                skipped.append(f"`{path.name}` ({kind[8:]}: statistics are recomputed from the raw samples)")
                continue
            if not rows:
                problems.append(FileProblem(str(path), f"{kind} CSV with a header but no rows"))
                continue
            meta = _read_meta(path, problems) if kind != "cache-memory" else None
            if meta is not None:
                metas[path.name] = meta
            try:
                if kind == "scan":
                    text, table = _scan_section(path.name, parse_rows(Sample, rows), meta, problems)
                    if plot:
                        from attention_kv_caceh.plots import plot_scan

                        target = out.with_name(f"{out.stem}-{path.stem}.png")
                        result.plots.append(plot_scan(table, target, title=f"Batch-size scan: {path.name}"))
                        text += f"\n![{path.name}]({target.name})\n"
                    buckets["scan"].append(text)
                elif kind == "cache":
                    cache_runs.append((path.name, parse_rows(CacheStepSample, rows)))
                elif kind == "cache-memory":
                    memory_rows += parse_rows(CacheMemoryRow, rows)
                    result.sources.append(path.name)
                else:
                    table_md = views_markdown(parse_rows(ViewRow, rows))
                    buckets["views"].append(f"### View/copy table: `{path.name}`\n\n{table_md}")
            except ValueError as exc:
                problems.append(FileProblem(str(path), f"malformed {kind} CSV: {exc}"))
                continue
            if kind != "cache-memory":
                result.sources.append(path.name)
        elif path.suffix == ".jsonl" and path.is_file():
            text = _jsonl_section(path, problems)
            if text is not None:
                buckets["serving"].append(text)
                result.sources.append(path.name)

    for name, samples in cache_runs:
        key = _run_key(samples[0])
        memory = [m for m in memory_rows if _run_key(m) == key]
        try:
            text, _ = _cache_section(name, samples, memory)
        except ValueError as exc:
            problems.append(FileProblem(name, f"cannot summarize the cache run: {exc}"))
            continue
        if plot:
            from attention_kv_caceh.plots import plot_cache_growth

            target = out.with_name(f"{out.stem}-{Path(name).stem}.png")
            result.plots.append(plot_cache_growth(samples, memory, target, title=f"KV-cache growth: {name}"))
            text += f"\n![{name}]({target.name})\n"
        buckets["cache"].append(text)

    parts = [
        "# Results report\n",
        f"Recomputed from the raw files in `{folder}`: {', '.join(f'`{s}`' for s in result.sources) or 'none'}.\n",
        "## Environment\n",
        _environment_card(metas),
        "## Results\n",
        *([t for bucket in buckets.values() for t in bucket] or ["No raw results were found.\n"]),
    ]
    if skipped:
        parts += ["## Summary files not used\n", *(f"- {s}" for s in skipped), ""]
    if problems:
        parts += [
            "## Problems with files\n",
            *(f"- `{p.path}`: {p.problem}" for p in problems),
            "",
        ]
    result.markdown = "\n".join(parts).rstrip("\n") + "\n"
    return result
