"""What the batch-size scan prints: its setup card, its fixed-width table and its plot's title.

Text only, no I/O; `cli/scan.py` prints it. The prediction's card and its after-run table come from
`experiments/prediction_text.py` (the report shows the same content as Markdown).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from attention_kv_caceh.experiments.scan import ScanConfig, kv_bytes_per_step
from attention_kv_caceh.presets import get_preset

__all__ = ["format_scan_table", "plot_title", "setup_card", "summary_rows"]


def _fmt(value: float, digits: int = 3) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def format_scan_table(tables: Mapping[str, Sequence[dict[str, float]]]) -> str:
    """Fixed-width text table of `scan_tables` rows (impl -> `scan_table` rows).

    One implementation: the plain table. Several: one row per implementation at each B, side by side
    (an `impl` column after B), every ratio to the same B's probe.
    """
    several = len(tables) > 1
    impl_head = f" {'impl':<10}" if several else ""
    header = (
        f"{'B':>4}{impl_head} {'P50 ms':>9} {'P95 ms':>9} {'min ms':>9} {'max ms':>9} {'ms/seq':>9} "
        f"{'positions/s':>13} {'speedup':>8} {'KV GB/s':>8} {'probe GB/s':>10} {'ratio':>6}"
    )
    lines = [header, "-" * len(header)]
    rows = [(int(r["batch_size"]), i, impl, r) for i, (impl, t) in enumerate(tables.items()) for r in t]
    for b, _, impl, r in sorted(rows, key=lambda x: (x[0], x[1])):
        cell = f" {impl:<10}" if several else ""
        lines.append(
            f"{b:>4}{cell} {r['p50_ms']:>9.4f} {r['p95_ms']:>9.4f} {r['min_ms']:>9.4f} "
            f"{r['max_ms']:>9.4f} {r['per_sequence_ms']:>9.4f} {r['positions_per_s']:>13,.0f} "
            f"{r['speedup']:>7.2f}x {_fmt(r['kv_read_gb_s'], 2):>8} {_fmt(r['probe_read_gb_s'], 2):>10} "
            f"{_fmt(r['bandwidth_ratio'], 2):>6}"
        )
    return "\n".join(lines)


def summary_rows(tables: Mapping[str, Sequence[dict[str, float]]]) -> list[dict[str, object]]:
    """The summary CSV's rows: per B (ascending), one row per implementation in `tables`' order."""
    rows: list[tuple[int, int, dict[str, object]]] = []
    for i, (impl, t) in enumerate(tables.items()):
        for r in t:
            row: dict[str, object] = {"impl": impl, **r}
            rows.append((int(r["batch_size"]), i, row))
    return [row for _, _, row in sorted(rows, key=lambda x: (x[0], x[1]))]


def _blas_line(env: dict[str, Any]) -> str:
    pools: list[dict[str, Any]] = env["blas"]
    text = ", ".join(f"{p['internal_api']} {p['version']} ({p['num_threads']} threads)" for p in pools)
    return text or "none found"


def setup_card(
    config: ScanConfig, env: dict[str, Any], impls: Sequence[str] = ("numpy",), skipped: Sequence[str] = ()
) -> str:
    """The setup printed before a scan; `skipped`: implementations of --impl all that are not run
    (torch-sdpa where torch cannot be imported), each on a line of its own."""
    one_thread = [i for i in impls if i != "numpy"]
    itemsize = 4 if config.dtype == "float32" else 8
    lines = [
        "Batch-size scan: one decode step = append 1 position to the KV cache, attend over T+1",
        f"  shape    B in {list(config.batch_sizes)}, H={config.num_heads}, H_kv={config.num_kv_heads}, "
        f"T={config.seq_len}, D={config.head_dim}, {config.dtype}, {config.cache} cache"
        + (f", model {config.model} (one layer)" if config.model else ""),
        f"  timing   {config.warmup} warm-up + {config.repeats} timed calls per B, seed {config.seed}",
        *(
            [
                f"  impls    {', '.join(impls)}, checked then timed at every B in this order"
                + (f"; {', '.join(one_thread)}: 1 thread" if one_thread else "")
            ]
            if len(impls) > 1 or impls[0] != "numpy"
            else []
        ),
        *(f"  {impl}: skipped (torch not importable)" for impl in skipped),
        f"  BLAS     {_blas_line(env)}",
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


def plot_title(config: ScanConfig) -> str:
    return (
        f"decode step, T={config.seq_len}, H={config.num_heads}, H_kv={config.num_kv_heads}, "
        f"D={config.head_dim}, {config.dtype}, {config.cache} cache"
    )
