"""Draw a sweep's throughput-latency curve: output tokens/s against P50 and P99 TTFT (left) and TPOT
(right), one marker per run, a line through each point's mean over its repeats, each point labelled
with its load, and the knee marked. matplotlib with the Agg backend, PNG out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from attention_kv_caceh.files import atomic_write_bytes
from attention_kv_caceh.harness.sweep import Axis, Knee, point_means

__all__ = ["plot_sweep"]


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
