"""Draw a sweep's throughput-latency curve: output tokens/s against P50 and P99 TTFT (left) and TPOT
(right), one marker per run, a line through each point's mean over its repeats, each point labelled
with its load, and the knee marked; and its Pareto plot: output tokens/s per user against total output
tokens/s, one point per grid value, the frontier marked (`sweep.pareto_points`). matplotlib with the Agg
backend, PNG out.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from attention_kv_caceh.files import atomic_write_bytes
from attention_kv_caceh.harness.sweep import Axis, Knee, pareto_points, point_means

__all__ = ["plot_pareto", "plot_sweep"]


def plot_sweep(
    rows: Sequence[Mapping[str, Any]], axis: Axis, knee: Knee, path: str | Path, title: str
) -> Path:
    """Write the curve of `rows` (sweep.CSV_FIELDS rows) as a PNG at `path` (atomically); returns it."""
    import io

    short = "c" if axis == "concurrency" else "rate"
    fig, panels = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    throughput = dict(point_means(rows, "output_throughput"))
    for ax, metric, name in ((panels[0], "ttft", "TTFT"), (panels[1], "tpot", "TPOT")):
        for stat, style, label, color in (("median", "o-", "P50", "C0"), ("p99", "s--", "P99", "C1")):
            key = f"{stat}_{metric}_ms"
            xs = [float(r["output_throughput"]) for r in rows if r.get(key) is not None]
            ys = [float(r[key]) for r in rows if r.get(key) is not None]
            ax.scatter(xs, ys, s=12, alpha=0.35, color=color)
            means = [(throughput[v], y) for v, y in point_means(rows, key) if v in throughput]
            if means:
                ax.plot(
                    [m[0] for m in means], [m[1] for m in means], style, color=color, label=f"{label} {name}"
                )
            if stat == "median":
                for value, y in point_means(rows, key):
                    if value in throughput:
                        text = f"{short}={value:g}" if math.isfinite(value) else f"{short}=inf"
                        ax.annotate(
                            text,
                            (throughput[value], y),
                            textcoords="offset points",
                            xytext=(4, 4),
                            fontsize=7,
                        )
        if knee.value is not None and knee.value in throughput:
            ax.axvline(
                throughput[knee.value], color="grey", linestyle=":", label=f"knee ({short}={knee.value:g})"
            )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue())


def plot_pareto(rows: Sequence[Mapping[str, Any]], axis: Axis, path: str | Path, title: str) -> Path:
    """Write the Pareto plot of `rows` (sweep.CSV_FIELDS rows) as a PNG at `path` (atomically): total
    output tokens/s on x, output tokens/s per user on y, each grid value a point labelled with its load;
    the frontier's points filled and joined, the dominated ones hollow. Returns the path."""
    import io

    short = "c" if axis == "concurrency" else "rate"
    points = pareto_points(rows)
    fig, ax = plt.subplots(figsize=(6.4, 4.8), constrained_layout=True)
    front = sorted((p for p in points if p.frontier), key=lambda p: p.total)
    others = [p for p in points if not p.frontier]
    if front:
        ax.plot(
            [p.total for p in front],
            [p.per_user for p in front],
            "o-",
            color="C3",
            label=f"Pareto frontier ({len(front)} of {len(points)} points)",
        )
    if others:
        ax.scatter(
            [p.total for p in others],
            [p.per_user for p in others],
            facecolors="none",
            edgecolors="C0",
            label="dominated",
        )
    for p in points:
        text = f"{short}={p.value:g}" if math.isfinite(p.value) else f"{short}=inf"
        ax.annotate(text, (p.total, p.per_user), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("total output tokens/s (all users)")
    ax.set_ylabel("output tokens/s per user (1000 / median TPOT ms)")
    ax.grid(True, alpha=0.3)
    if points:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no point has a TPOT", transform=ax.transAxes, ha="center")
    ax.set_title(textwrap.fill(title, 72), fontsize=9)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue())
