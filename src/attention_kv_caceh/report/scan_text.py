"""The batch-size scan's words: its setup card, its table and saturation verdict, what it prints as it
runs and after the last B, its last JSON line, and the Markdown it rewrites beside its raw CSV.

The numbers come from `experiments/scan_stats.py` and `experiments/scan_run.py` (`ScanRun`); the
prediction's words from `outcome.py`; the run's section from `predictions.scan_run_markdown`, the one
`report` renders from the raw file, so the command's Markdown and the report's agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from attention_kv_caceh.experiments.prediction_check import ScanOutcome
from attention_kv_caceh.experiments.scan import ScanConfig, kv_bytes_per_step
from attention_kv_caceh.experiments.scan_run import ScanEvent, ScanRun
from attention_kv_caceh.experiments.scan_stats import summary_rows
from attention_kv_caceh.presets import get_preset
from attention_kv_caceh.report.outcome import model_lines, outcome_json, outcome_text, prediction_card
from attention_kv_caceh.report.predictions import scan_run_markdown
from attention_kv_caceh.report.verdicts import saturation_verdict
from attention_kv_caceh.tables import text_table

__all__ = [
    "event_line",
    "format_scan_table",
    "load_warning",
    "plot_title",
    "prediction_cards",
    "result_records",
    "result_text",
    "scan_live_markdown",
    "setup_card",
    "summary_json",
    "threads_warning",
]


def setup_card(
    config: ScanConfig, env: Mapping[str, Any], impls: Sequence[str] = ("numpy",), skipped: Sequence[str] = ()
) -> str:
    """The setup printed before a scan; `skipped`: implementations of --impl all that are not run
    (torch-sdpa where torch cannot be imported), each on a line of its own."""
    one_thread = [i for i in impls if i != "numpy"]
    itemsize = 4 if config.dtype == "float32" else 8
    pools: list[dict[str, Any]] = env["blas"]
    blas = ", ".join(f"{p['internal_api']} {p['version']} ({p['num_threads']} threads)" for p in pools)
    lines = [
        "Batch-size scan: one decode step = append 1 position to the KV cache, attend over T+1",
        f"  shape    B in {list(config.batch_sizes)}, H={config.num_heads}, H_kv={config.num_kv_heads}, "
        f"T={config.seq_len}, D={config.head_dim}, {config.dtype}, {config.cache} cache"
        + (f", model {config.model} (one layer)" if config.model else ""),
        f"  timing   {config.warmup} warm-up + {config.repeats} timed calls per B, seed {config.seed}",
    ]
    if len(impls) > 1 or impls[0] != "numpy":
        lines.append(
            f"  impls    {', '.join(impls)}, checked then timed at every B in this order"
            + (f"; {', '.join(one_thread)}: 1 thread" if one_thread else "")
        )
    lines += [f"  {impl}: skipped (torch not importable)" for impl in skipped]
    lines += [
        f"  BLAS     {blas or 'none found'}",
        f"  CPU      {env['cpu_model']} ({env['cpu_count']} logical CPUs)",
        f"  KV read  {kv_bytes_per_step(config, 1) / 1e6:.3f} MB per step per sequence "
        f"(2 x H_kv x (T+1) x D x {itemsize} B)",
    ]
    if config.model:
        preset = get_preset(config.model)
        per_token = preset.kv_bytes_per_token(config.dtype)
        lines.append(
            f"  model    {config.model}: {preset.num_layers} layers, KV cache {per_token / 1024:.0f} KiB "
            f"per token in {config.dtype}, {per_token * config.seq_len / 2**20:.1f} MiB per sequence at T="
            f"{config.seq_len}"
        )
    return "\n".join(lines)


def plot_title(config: ScanConfig, impl: str = "") -> str:
    """The plot's title; `impl` names the implementation drawn when the scan timed several."""
    return (
        f"decode step, T={config.seq_len}, H={config.num_heads}, H_kv={config.num_kv_heads}, "
        f"D={config.head_dim}, {config.dtype}, {config.cache} cache" + (f", {impl}" if impl else "")
    )


def threads_warning(blas_threads: int | None, cpus: int) -> str | None:
    """The warning for --blas-threads above this machine's logical CPUs, or None."""
    if blas_threads is None or blas_threads <= cpus:
        return None
    return (
        f"warning: --blas-threads {blas_threads} is more than the {cpus} logical CPUs here; "
        "the threads will compete for cores"
    )


def load_warning(others: float | None, window_s: float) -> str | None:
    """The warning for other processes keeping `others` CPUs' worth busy (measured over `window_s`
    seconds before timing), or None below `cpu_load.LOAD_WARNING_CPUS` or when not measured."""
    from attention_kv_caceh.cpu_load import LOAD_WARNING_CPUS

    if others is None or others < LOAD_WARNING_CPUS:
        return None
    return (
        f"warning: other processes keep {others:.1f} CPUs busy (measured over {window_s:g} s before "
        "timing); the timings share the machine with them and may be slower and noisier "
        "(recorded as others_busy_cpus in the metadata)"
    )


def prediction_cards(run: ScanRun) -> str:
    """Every implementation's prediction card (`outcome.prediction_card`), each after a blank line and,
    when the scan times several, its name."""
    parts = [
        "\n" + (f"[{impl}]\n" if len(run.impls) > 1 else "") + prediction_card(p)
        for impl, p in run.predictions.items()
    ]
    return "\n".join(parts)


def _fmt(value: float, digits: int = 3) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def format_scan_table(tables: Mapping[str, Sequence[dict[str, float]]]) -> str:
    """Fixed-width text table (`tables.text_table`) of `scan_tables` rows (impl -> `scan_table` rows).

    One implementation: the plain table. Several: one row per implementation at each B, side by side
    (an `impl` column after B), every ratio to the same B's probe.
    """
    several = len(tables) > 1
    header = ["B", *(["impl"] if several else []), "P50 ms", "P95 ms", "min ms", "max ms", "ms/seq"]
    header += ["positions/s", "speedup", "KV GB/s", "probe GB/s", "ratio"]
    rows: list[list[str]] = []
    for row in summary_rows(tables):
        r: dict[str, Any] = row
        cells = [str(int(r["batch_size"])), *([r["impl"]] if several else [])]
        cells += [f"{r[k]:.4f}" for k in ("p50_ms", "p95_ms", "min_ms", "max_ms", "per_sequence_ms")]
        cells += [f"{r['positions_per_s']:,.0f}", f"{r['speedup']:.2f}x"]
        cells += [_fmt(r[k], 2) for k in ("kv_read_gb_s", "probe_read_gb_s", "bandwidth_ratio")]
        rows.append(cells)
    return text_table(header, rows)


def event_line(prog: str, event: ScanEvent) -> str:
    """The stderr line of an oracle failure while the scan runs."""
    if event.kind == "calibration-failed":
        return (
            f"{prog}: oracle check failed in the calibration of {event.impl} (B=1, T=1), nothing timed "
            f"for it: {event.message}"
        )
    if event.kind == "all-failed":
        return f"{prog}: oracle check failed at B={event.batch_size}, nothing timed for it: {event.message}"
    return (
        f"{prog}: oracle check failed for {event.impl} at B={event.batch_size}, nothing timed for it from "
        f"here on: {event.message}"
    )


def result_records(run: ScanRun, outcomes: Mapping[str, ScanOutcome]) -> dict[str, Any]:
    """The metadata a finished scan adds: the saturation verdicts and the prediction outcomes (the
    first implementation's, and every implementation's)."""
    verdicts = {impl: saturation_verdict(t) for impl, t in run.tables().items()}
    first = next(iter(verdicts))
    records = {
        impl: outcome_json(o.verdicts, o.anomalies) | {"measured_saturation": o.measured_saturation}
        for impl, o in outcomes.items()
    }
    return {
        "saturation": verdicts[first],
        "saturation_by_impl": verdicts,
        "prediction_outcome": records[first],
        "prediction_outcomes": records,
    }


def result_text(run: ScanRun, outcomes: Mapping[str, ScanOutcome], *, user_gave: bool) -> str:
    """What a scan prints after its last B: the table, the saturation verdicts, the predictions against
    the measurement (in full when the user gave a prediction, else the model's verdicts only) and the
    oracle's verdict per implementation."""
    tables = run.tables()
    several = len(tables) > 1
    lines = ["", format_scan_table(tables), ""]
    lines += [
        f"Saturation{f' ({impl})' if several else ''}: {saturation_verdict(t)}" for impl, t in tables.items()
    ]
    for impl, outcome in outcomes.items():
        lines.append("")
        if user_gave:
            lines.append((f"[{impl}]\n" if several else "") + outcome_text(outcome))
        else:
            lines.append(model_lines(outcome, f" ({impl})" if several else ""))
    lines.append("")
    passed = [impl for impl in tables if impl not in run.failures]
    if passed:
        worst = max(
            (e for r in run.results for impl, e in r.oracle_errors if impl in passed),
            default=max(r.oracle_max_abs_error for r in run.results),
        )
        lines.append(
            f"Oracle: every B of {', '.join(passed)} matched the float64 per-sequence reference "
            f"(max |error| {worst:.2e})"
        )
    lines += [f"Oracle FAILED for {impl}: {where}" for impl, where in run.failures.items()]
    return "\n".join(lines)


def summary_json(run: ScanRun, outcomes: Mapping[str, ScanOutcome], raw_csv: str) -> dict[str, Any]:
    """The scan's last stdout line, as a JSON object: P50s, bandwidth ratios and saturation per
    implementation, and the first one's prediction verdicts."""
    tables = run.tables()
    first = next(iter(tables))
    return {
        "raw_csv": raw_csv,
        "rows": len(run.samples),
        "saturation": saturation_verdict(tables[first]),
        "p50_ms": {int(r["batch_size"]): round(r["p50_ms"], 6) for r in tables[first]},
        "predictions": {v.name: v.held for v in outcomes[first].verdicts} if first in outcomes else {},
        "impls": {
            impl: {
                "p50_ms": {int(r["batch_size"]): round(r["p50_ms"], 6) for r in t},
                "bandwidth_ratio": {int(r["batch_size"]): round(r["bandwidth_ratio"], 4) for r in t},
                "saturation": saturation_verdict(t),
            }
            for impl, t in tables.items()
        },
        "oracle_failures": sorted(run.failures),
    }


def scan_live_markdown(name: str, run: ScanRun, meta: Mapping[str, Any]) -> str:
    """The Markdown a scan rewrites beside its raw CSV after every B: the section `report` renders
    from the raw file (`predictions.scan_run_markdown`), with the run's status; a line saying so before
    the first B has finished. The samples of a B cut short by Ctrl-C are in the raw file but not in the
    tables (the status line says so)."""
    status = f"Status: {meta['status']}.\n\n"
    if run.partial:
        cut = (
            "its read probe was cut (every implementation's samples were taken)"
            if run.partial_stage == "probe"
            else f"cut during {run.partial_stage or 'its timing'}"
        )
        status = (
            f"Status: {meta['status']}; B = {run.partial[0].batch_size} incomplete, {cut}: its "
            f"{len(run.partial)} samples are in the raw CSV, not in this summary or the verdicts.\n\n"
        )
    samples = run.samples
    if not samples:
        return f"### Batch-size scan: `{name}`\n\n{status}No batch size has finished.\n"
    text, _ = scan_run_markdown(name, samples, meta, [])
    return text.replace("\n\n", f"\n\n{status}", 1)
