"""The batch-size scan after its last batch size: verdicts per implementation, the prediction check,
the files' final state and what is printed (`cli/scan.py` runs the loop and calls `finish_scan`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from attention_kv_caceh.cli.scan_output import format_scan_table, plot_title
from attention_kv_caceh.experiments.prediction import ScanPrediction
from attention_kv_caceh.experiments.prediction_check import evaluate_scan, outcome_json
from attention_kv_caceh.experiments.prediction_text import scan_outcome_text
from attention_kv_caceh.experiments.scan import BatchResult, ScanConfig
from attention_kv_caceh.experiments.scan_stats import saturation_verdict, scan_tables
from attention_kv_caceh.files import meta_path

__all__ = ["finish_scan", "scan_result_tables", "summary_path"]


def summary_path(csv_path: Path) -> Path:
    """`results/benchmark.csv` -> `results/benchmark-summary.csv`."""
    return csv_path.with_name(f"{csv_path.stem}-summary.csv")


def finish_scan(
    config: ScanConfig,
    plot: Path | None,
    csv_path: Path,
    results: Sequence[BatchResult],
    predictions: dict[str, ScanPrediction],
    meta: dict[str, Any],
    flush: Callable[[str], None],
) -> int:
    """After the last B: the verdicts and the prediction check per implementation, the files' last
    state (`flush`: "complete", or "oracle-failed" when an implementation failed its oracle), the
    table, the plot and one JSON line. Returns the exit code: 1 when an implementation failed its
    oracle (`meta["oracle_failures"]`), else 0."""
    tables = scan_result_tables(results)
    several = len(tables) > 1
    verdicts = {impl: saturation_verdict(t) for impl, t in tables.items()}
    samples = [s for r in results for s in r.samples]
    outcomes = {
        impl: evaluate_scan(predictions[impl], [s for s in samples if s.impl == impl])
        for impl in tables
        if impl in predictions
    }
    first = next(iter(tables))
    meta["saturation"] = verdicts[first]
    meta["saturation_by_impl"] = verdicts
    outcome_records = {
        impl: outcome_json(o.verdicts, o.anomalies) | {"measured_saturation": o.measured_saturation}
        for impl, o in outcomes.items()
    }
    meta["prediction_outcome"] = outcome_records[first]
    meta["prediction_outcomes"] = outcome_records
    failed = meta.get("oracle_failures", {})
    flush("oracle-failed" if failed else "complete")
    print()
    print(format_scan_table(tables))
    print()
    for impl, verdict in verdicts.items():
        print(f"Saturation{f' ({impl})' if several else ''}: {verdict}")
    for impl, outcome in outcomes.items():
        print()
        if several:
            print(f"[{impl}]")
        print(scan_outcome_text(outcome))
    print()
    passed = [impl for impl in tables if impl not in failed]
    if passed:
        worst = max(
            (e for r in results for impl, e in r.oracle_errors if impl in passed),
            default=max(r.oracle_max_abs_error for r in results),  # a result without per-impl errors
        )
        print(
            f"Oracle: every B of {', '.join(passed)} matched the float64 per-sequence reference "
            f"(max |error| {worst:.2e})"
        )
    for impl in failed:
        print(f"Oracle FAILED for {impl}: {failed[impl]}")
    written = [str(csv_path), str(summary_path(csv_path)), str(meta_path(csv_path))]
    if plot is not None:
        from attention_kv_caceh.report.plots import plot_scan

        plot_scan(tables[first], plot, title=plot_title(config) + ("" if not several else f", {first}"))
        written.append(str(plot))
    print(f"Wrote {', '.join(written)}")
    summary = {
        "raw_csv": str(csv_path),
        "rows": len(samples),
        "saturation": verdicts[first],
        "p50_ms": {int(r["batch_size"]): round(r["p50_ms"], 6) for r in tables[first]},
        "predictions": {v.name: v.held for v in outcomes[first].verdicts} if first in outcomes else {},
        "impls": {
            impl: {
                "p50_ms": {int(r["batch_size"]): round(r["p50_ms"], 6) for r in t},
                "bandwidth_ratio": {int(r["batch_size"]): round(r["bandwidth_ratio"], 4) for r in t},
                "saturation": verdicts[impl],
            }
            for impl, t in tables.items()
        },
        "oracle_failures": sorted(failed),
    }
    print(json.dumps(summary))
    return 1 if failed else 0


def scan_result_tables(results: Sequence[BatchResult]) -> dict[str, list[dict[str, float]]]:
    """`scan_stats.scan_tables` of every finished B: impl -> rows, against each B's probe."""
    return scan_tables(
        [s for r in results for s in r.samples],
        {r.batch_size: r.probe_samples_ms for r in results},
        {r.batch_size: r.kv_bytes_per_step for r in results},
    )
