"""The Markdown sections of the results report for the lab's raw files: scan and cache growth (the
view/copy table's is `views.py`).

Each section recomputes its statistics from the raw rows it is given (`scan_stats.scan_table`,
`cache_growth_stats.summarize_cache_growth`) and returns Markdown; finding and
reading the files, pairing them and listing what is wrong with them is the job of `readers.py` and
`build.py`. Outliers (a sample above OUTLIER_FACTOR x the P95 of its group) are named under their
section and kept in every statistic. The serving harness's section is `serving.py`, the environment
card `environment.py`, the number format and table they all use `tables.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from attention_kv_caceh.experiments.cache_growth_stats import (
    CACHE_KINDS,
    CacheGrowthSummary,
    CacheMemoryRow,
    CacheStepSample,
    partial_passes,
    summarize_cache_growth,
)
from attention_kv_caceh.experiments.scan_stats import scan_table
from attention_kv_caceh.memory import format_bytes
from attention_kv_caceh.report.verdicts import saturation_verdict
from attention_kv_caceh.tables import format_number, markdown_table
from attention_kv_caceh.timing import Sample, summarize_samples

__all__ = [
    "OUTLIER_FACTOR",
    "cache_section",
    "flag_outliers",
    "scan_section",
]

# A sample above OUTLIER_FACTOR x the P95 of its group is flagged (kept, never dropped).
OUTLIER_FACTOR = 2.0


def flag_outliers(values: Sequence[float], factor: float = OUTLIER_FACTOR) -> list[int]:
    """Indices of the values above `factor` x their P95 (`summarize_samples`); empty for no values."""
    if not values:
        return []
    limit = factor * summarize_samples(values)["p95_ms"]
    return [i for i, v in enumerate(values) if v > limit]


# ------------------------------------------------------------------------------------------- scan


def scan_section(
    name: str,
    samples: list[Sample],
    probe: Mapping[int, Sequence[float]] | None,
    kv: Mapping[int, int] | None,
) -> tuple[str, list[dict[str, float]]]:
    """The section of one batch-size scan CSV and its first implementation's `scan_stats.scan_table` rows
    (for the plot).

    `samples` are the file's raw rows (at least one); `probe` (B -> read-bandwidth probe samples, ms)
    and `kv` (B -> KV bytes read per step) come from its metadata, None where unknown (the bandwidth
    columns are then n/a). A file of several implementations (`--impl all`) gets one part per
    implementation (`Sample.impl`), each against the same probe. Raises ValueError from `scan_table`
    on inconsistent samples.
    """
    by_impl: dict[str, list[Sample]] = {}
    for s in samples:
        by_impl.setdefault(s.impl, []).append(s)
    parts = [
        _scan_part(
            f"`{name}`" + (f", {impl}" if len(by_impl) > 1 or impl != "numpy" else ""), group, probe, kv
        )
        for impl, group in by_impl.items()
    ]
    return "\n".join(text for text, _ in parts), parts[0][1]


def _scan_part(
    title: str,
    samples: list[Sample],
    probe: Mapping[int, Sequence[float]] | None,
    kv: Mapping[int, int] | None,
) -> tuple[str, list[dict[str, float]]]:
    """`scan_section` for the samples of one implementation."""
    table = scan_table(samples, probe, kv)
    verdict = saturation_verdict(table)
    first = samples[0]
    out = [
        f"### Batch-size scan: {title}\n",
        f"{len(samples)} raw samples; T = {table[0]['sequence_length']:.0f}, H = {first.num_heads}, "
        f"H_kv = {first.num_kv_heads}, D = {first.head_dim}, {first.dtype}, {first.cache} cache"
        + (f", model {first.model}" if first.model else "")
        + f", {first.warmup} warm-up calls.\n",
        markdown_table(
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
            f"- B = {r['batch_size']:.0f}: the step takes {format_number(r['p50_ms'])} ms, "
            f"{r['p50_ms'] / base['p50_ms']:.2f}x the B = {base['batch_size']:.0f} step "
            f"({format_number(base['p50_ms'])} ms), so each request waits {r['p50_ms'] / base['p50_ms']:.2f}x as "
            f"long per token, while the per-sequence cost is {format_number(r['per_sequence_ms'])} ms "
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
            f"B={group[i].batch_size} repeat {group[i].repeat}: {format_number(group[i].elapsed_ms)} ms"
            for i in idx
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

# Why the table shows two R^2 and which to trust (the same line, measured against two sets of points).
R2_NOTE = (
    "**Which R^2 to trust.** Both columns judge the same line. R^2 (the first) compares it with the "
    "per-position medians it was fitted to: that says whether the cost grows linearly in T, and it is the "
    "one to read. R^2 (raw) compares it with every raw sample, so it also counts the timer noise and "
    "stray slow steps between repeats at the same T, which no line of T can explain; it is lower by that "
    "noise, and a large gap between the two means noisy samples, not a bad fit.\n"
)


def _memory_table(memory: Mapping[str, Mapping[str, float]]) -> str:
    """The memory part of a cache section (`CacheGrowthSummary.memory`), or a line saying there is none."""
    if not memory:
        return "No memory CSV with the same run parameters was found.\n"
    header = [
        "cache",
        "append peak at T=1",
        "append peak at T=N",
        "B/position (traced)",
        "new buffers B/position",
        "largest step peak",
        "nbytes at N",
        "theoretical at N",
    ]
    rows = [
        [
            k,
            format_bytes(m["append_bytes_first_step"]),
            format_bytes(m["append_bytes_last_step"]),
            m["append_bytes_per_position"],
            m["new_buffer_bytes_per_position"],
            format_bytes(m["max_step_peak_bytes"]),
            format_bytes(m["final_cache_nbytes"]),
            format_bytes(m["final_theoretical_bytes"]),
        ]
        for k, m in memory.items()
    ]
    return "Memory (untimed pass under tracemalloc):\n\n" + markdown_table(header, rows)


def cache_section(
    name: str, samples: list[CacheStepSample], memory: list[CacheMemoryRow]
) -> tuple[str, CacheGrowthSummary]:
    """The section of one cache-growth raw CSV (with the memory rows of the same run, possibly none)
    and its `summarize_cache_growth` summary.

    Raises ValueError from `summarize_cache_growth` (a cache without samples or with one position).
    """
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
        + f", {repeats} timed passes per cache after {first.warmup} warm-up pass(es)"
        + (
            f"; cut part-way (rows kept, left out of the N-step totals): {', '.join(cut)}.\n"
            if (cut := partial_passes(samples, memory))
            else ".\n"
        ),
        "Per-step P50 (all repeats, positions in a window of N/64 ending at T):\n",
        markdown_table(
            ["T", "dynamic P50 ms", "preallocated P50 ms", "dynamic / preallocated"],
            [
                [int(c["sequence_length"]), c["dynamic_p50_ms"], c["preallocated_p50_ms"], c["ratio"]]
                for c in s.checkpoints
            ],
        ),
        "Per-step time against T (np.polyfit on the per-position median over repeats):\n",
        markdown_table(
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
        R2_NOTE,
    ]
    out.append(_memory_table(s.memory))
    w = max(1, n // 64)
    flagged: list[str] = []
    for kind in CACHE_KINDS:
        rows = [x for x in samples if x.cache == kind]
        for lo in range(0, n, w):
            group = [x for x in rows if lo < x.sequence_length <= lo + w]
            flagged += [
                f"{kind} T={group[i].sequence_length} repeat {group[i].repeat}: {format_number(group[i].elapsed_ms)} ms"
                for i in flag_outliers([x.elapsed_ms for x in group])
            ]
    out.append(_outlier_line(flagged, f"its cache in windows of {w} positions"))
    return "\n".join(out) + "\n", s
