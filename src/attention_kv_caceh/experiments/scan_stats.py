"""The batch-size scan's summary statistics: the per-B table and the saturation rule.

Everything here is recomputed from raw `timing.Sample` rows (and the read-probe samples and KV byte
counts of a run's metadata), so the scan command, the report and the prediction check all summarise a
scan the same way: `scan_table` (one row per B, `summarize_samples` statistics, throughput and
bandwidth), `scan_tables` (one table per implementation) and the saturation rule (`doubling_gains`,
`saturation_point`: the first B whose doubling raises positions/s by less than SATURATION_GAIN);
`summary_rows` gives the summary CSV's rows. Numbers only: the printed table and the verdict's words
are `report/scan_text.py`. Running the scan (config, inputs, timed steps) is `scan.py`'s job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from attention_kv_caceh.experiments.scan_impls import IMPLS
from attention_kv_caceh.timing import SATURATION_GAIN, Sample, doubling_gains_xy, summarize_samples

__all__ = [
    "SUMMARY_FIELDS",
    "doubling_gains",
    "saturation_point",
    "scan_table",
    "scan_tables",
    "summary_rows",
]

SUMMARY_FIELDS: tuple[str, ...] = (
    "batch_size",
    "impl",
    "sequence_length",
    "count",
    "p50_ms",
    "p95_ms",
    "min_ms",
    "max_ms",
    "mean_ms",
    "stdev_ms",
    "per_sequence_ms",
    "positions_per_s",
    "speedup",
    "kv_bytes_per_step",
    "kv_read_gb_s",
    "probe_read_gb_s",
    "bandwidth_ratio",
)


def scan_table(
    samples: Sequence[Sample],
    probe_samples_ms: Mapping[int, Sequence[float]] | None = None,
    kv_bytes: Mapping[int, int] | None = None,
) -> list[dict[str, float]]:
    """The summary table, one row per batch size, recomputed from raw samples only.

    Per B: the statistics of `summarize_samples`; per_sequence_ms = P50 / B (ms); positions_per_s =
    B * T / P50 (T = the cached sequence length); speedup = positions_per_s / that of the smallest B
    (B = 1 in the default scan); kv_read_gb_s = kv bytes per step / P50 (1e9 bytes/s); probe_read_gb_s
    = the same bytes / P50 of the probe; bandwidth_ratio = kv_read / probe_read. Bandwidth columns are
    NaN where the probe samples or byte counts are not given. Rows are sorted by B.

    Raises ValueError for no samples, samples of more than one implementation (`scan_tables` splits
    them), or samples of one B with different sequence lengths.
    """
    if not samples:
        raise ValueError("scan_table needs at least one sample")
    impls = sorted({s.impl for s in samples})
    if len(impls) > 1:
        raise ValueError(f"samples mix implementations {impls}: summarise each alone (scan_tables)")
    by_b: dict[int, list[Sample]] = {}
    for s in samples:
        by_b.setdefault(s.batch_size, []).append(s)
    rows: list[dict[str, float]] = []
    for b in sorted(by_b):
        group = by_b[b]
        lengths = {s.sequence_length for s in group}
        if len(lengths) != 1:
            raise ValueError(f"samples of B={b} mix sequence lengths {sorted(lengths)}")
        t = lengths.pop()
        stats = summarize_samples([s.elapsed_ms for s in group])
        p50_s = stats["p50_ms"] / 1000
        nbytes: float = kv_bytes[b] if kv_bytes and b in kv_bytes else math.nan
        kv_gb_s = nbytes / p50_s / 1e9 if p50_s > 0 else math.nan
        probe = probe_samples_ms.get(b) if probe_samples_ms else None
        probe_gb_s = nbytes / (summarize_samples(probe)["p50_ms"] / 1000) / 1e9 if probe else math.nan
        rows.append(
            {
                "batch_size": b,
                "sequence_length": t,
                "count": int(stats["count"]),
                "p50_ms": stats["p50_ms"],
                "p95_ms": stats["p95_ms"],
                "min_ms": stats["min_ms"],
                "max_ms": stats["max_ms"],
                "mean_ms": stats["mean_ms"],
                "stdev_ms": stats["stdev_ms"],
                "per_sequence_ms": stats["p50_ms"] / b,
                "positions_per_s": b * t / p50_s if p50_s > 0 else math.inf,
                "speedup": math.nan,
                "kv_bytes_per_step": nbytes,
                "kv_read_gb_s": kv_gb_s,
                "probe_read_gb_s": probe_gb_s,
                "bandwidth_ratio": kv_gb_s / probe_gb_s if probe else math.nan,
            }
        )
    base = rows[0]["positions_per_s"]
    for row in rows:
        row["speedup"] = row["positions_per_s"] / base
    return rows


def scan_tables(
    samples: Sequence[Sample],
    probe_samples_ms: Mapping[int, Sequence[float]] | None = None,
    kv_bytes: Mapping[int, int] | None = None,
) -> dict[str, list[dict[str, float]]]:
    """`scan_table` per implementation (`Sample.impl`), in IMPLS order (unknown names after, sorted).

    Every implementation's ratio is to the same per-B probe. Raises ValueError as scan_table does.
    """
    by_impl: dict[str, list[Sample]] = {}
    for s in samples:
        by_impl.setdefault(s.impl, []).append(s)
    order = [i for i in IMPLS if i in by_impl] + sorted(set(by_impl) - set(IMPLS))
    return {impl: scan_table(by_impl[impl], probe_samples_ms, kv_bytes) for impl in order}


def doubling_gains(table: Sequence[Mapping[str, float]]) -> list[tuple[int, int, float]]:
    """(B1, B2, gain per doubling) for consecutive rows sorted by B: the saturation rule's gains.

    gain = (positions/s at B2 / positions/s at B1) ** (1 / log2(B2 / B1)) - 1, so a step of exactly one
    doubling gives the plain relative gain. Rows need `batch_size` and `positions_per_s`.
    """
    points = [(r["batch_size"], r["positions_per_s"]) for r in table]
    return [(int(b1), int(b2), gain) for b1, b2, gain in doubling_gains_xy(points)]


def saturation_point(table: Sequence[Mapping[str, float]], gain: float = SATURATION_GAIN) -> int | None:
    """The first B whose doubling (normalised per doubling when B does not exactly double, see
    `doubling_gains`) raises positions/s by less than `gain`, or None when not reached."""
    for b1, _, per_doubling in doubling_gains(table):
        if per_doubling < gain:
            return b1
    return None


def summary_rows(tables: Mapping[str, Sequence[dict[str, float]]]) -> list[dict[str, object]]:
    """The summary CSV's rows: per B (ascending), one row per implementation in `tables`' order."""
    rows: list[tuple[int, int, dict[str, object]]] = [
        (int(r["batch_size"]), i, {"impl": impl, **r})
        for i, (impl, t) in enumerate(tables.items())
        for r in t
    ]
    return [row for _, _, row in sorted(rows, key=lambda x: (x[0], x[1]))]
