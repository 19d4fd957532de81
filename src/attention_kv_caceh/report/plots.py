"""Plots of the lab's raw results: matplotlib with the Agg backend only, PNG out.

Each function takes rows already computed (or raw rows) and a path, and writes a complete PNG or none
(temporary file, then rename). `plot_cache_growth` builds a `matplotlib.figure.Figure` on an Agg canvas
(no pyplot state) and writes it with `files.atomic_write_bytes`; `plot_scan` uses pyplot under Agg.
"""

# Matplotlib's own annotations leave `**kwargs` of Axes methods untyped, which strict mode reports on
# every call; only that check is relaxed here.
# pyright: reportUnknownMemberType=false

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from attention_kv_caceh.experiments.cache_growth_stats import (
    CACHE_KINDS,
    CacheMemoryRow,
    CacheStepSample,
    per_position_median,
    rolling_median,
    summarize_cache_growth,
)
from attention_kv_caceh.files import atomic_write_bytes

__all__ = ["plot_cache_growth", "plot_scan", "save_figure"]

COLORS = {"dynamic": "tab:red", "preallocated": "tab:blue"}


def save_figure(fig: Figure, path: str | os.PathLike[str], *, dpi: int = 110) -> Path:
    """Render `fig` as PNG through the Agg canvas and write it atomically; returns the path.

    Raises ValueError when `path` does not end in .png, OSError when it cannot be written.
    """
    if Path(path).suffix.lower() != ".png":
        raise ValueError(f"plot path {str(path)!r} must end in .png")
    canvas = FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.set_dpi(dpi)
    canvas.print_png(buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def plot_scan(table: Sequence[dict[str, float]], path: str | Path, *, title: str = "") -> Path:
    """Batch-size scan: P50 step latency with P95 bars (left) and positions/s (right) against B.

    `table` holds `experiments.scan_stats.scan_table` rows. Writes a PNG (folders created) and returns its path.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    b = [r["batch_size"] for r in table]
    p50 = [r["p50_ms"] for r in table]
    p95_err = [r["p95_ms"] - r["p50_ms"] for r in table]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.errorbar(b, p50, yerr=[[0] * len(p50), p95_err], marker="o", capsize=4, label="step P50 (bar to P95)")
    ax1.plot(b, [r["per_sequence_ms"] for r in table], marker="s", ls="--", label="per sequence (P50 / B)")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch size B")
    ax1.set_ylabel("step latency (ms)")
    ax1.set_title("latency of one decode step")
    ax1.legend()
    ax2.plot(b, [r["positions_per_s"] for r in table], marker="o", color="tab:green")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch size B")
    ax2.set_ylabel("positions / s (B x T / P50)")
    ax2.set_title("throughput")
    for ax in (ax1, ax2):
        ax.set_xticks(b, [str(int(x)) for x in b])
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(out)
    return out


def plot_cache_growth(
    samples: Sequence[CacheStepSample],
    memory: Sequence[CacheMemoryRow],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    dpi: int = 110,
) -> Path:
    """Per-step time against T for both caches, and bytes allocated per step, as one PNG.

    Top: every raw sample (faint points), the rolling median (window N/64) of the per-position median
    over repeats (bold), and the fitted line (dashed). The y axis stops at 3x the largest rolling
    median; points above it are counted in the legend, not dropped from the data.
    Bottom (when memory rows are given): traced peak bytes of the cache's append and the bytes of
    freshly allocated K/V buffers, per step, on a log axis.

    Raises ValueError when a cache has no samples (see `summarize_cache_growth`) or the path is not .png.
    """
    if Path(path).suffix.lower() != ".png":
        raise ValueError(f"plot path {str(path)!r} must end in .png")
    summary = summarize_cache_growth(samples, memory)
    fig = Figure(figsize=(9.0, 7.5 if memory else 4.5), layout="constrained")
    axes: list[Axes] = list(fig.subplots(2, 1, sharex=True)) if memory else [fig.subplots(1, 1)]
    ax = axes[0]
    top = 0.0
    smooth: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] = {}
    for kind in CACHE_KINDS:
        ts, med = per_position_median(samples, kind)
        window = max(1, int(ts.max()) // 64)
        smooth[kind] = (ts, rolling_median(med, window))
        top = max(top, float(smooth[kind][1].max()))
    ylim = 3.0 * top
    for kind in CACHE_KINDS:
        raw_t = np.array([s.sequence_length for s in samples if s.cache == kind], dtype=np.float64)
        raw_y = np.array([s.elapsed_ms for s in samples if s.cache == kind], dtype=np.float64)
        above = int(np.count_nonzero(raw_y > ylim))
        color = COLORS[kind]
        ax.scatter(raw_t, raw_y, s=3, alpha=0.15, color=color, linewidths=0)
        fit = summary.fits[kind]
        ts, rolled = smooth[kind]
        ax.plot(
            ts,
            rolled,
            color=color,
            linewidth=2.2,
            label=f"{kind}: rolling median ({above} raw points above the axis)",
        )
        ax.plot(
            ts,
            fit.intercept_ms + fit.slope_ms_per_position * ts,
            color=color,
            linestyle="--",
            linewidth=1,
            label=f"{kind} fit: {fit.slope_ms_per_position * 1000:.3g} us/position, R^2 {fit.r2:.2f}",
        )
    ax.set_ylim(0.0, ylim)
    ax.set_ylabel("per-step time (ms)")
    ax.set_title(
        title or f"Decode step over a growing KV cache (N-step total ratio {summary.total_ratio:.2f}x)"
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    if memory:
        mx = axes[1]
        for kind in CACHE_KINDS:
            rows = sorted((m for m in memory if m.cache == kind), key=lambda m: m.sequence_length)
            ts = np.array([m.sequence_length for m in rows], dtype=np.float64)
            peak = np.array([max(m.append_peak_bytes, 1) for m in rows], dtype=np.float64)
            fresh = np.array([m.new_buffer_bytes for m in rows], dtype=np.float64)
            mx.plot(ts, peak, color=COLORS[kind], linewidth=1.5, label=f"{kind}: traced append peak")
            if np.any(fresh > 0):
                mx.plot(
                    ts,
                    fresh,
                    color=COLORS[kind],
                    linestyle=":",
                    linewidth=1.5,
                    label=f"{kind}: new K/V buffer bytes",
                )
        mx.set_yscale("log")
        mx.set_ylabel("bytes allocated per step")
        mx.grid(alpha=0.3, which="both")
        mx.legend(loc="center right", fontsize=8)
        mx.set_xlabel("cached positions T after the step")
    else:
        ax.set_xlabel("cached positions T after the step")
    return save_figure(fig, path, dpi=dpi)
