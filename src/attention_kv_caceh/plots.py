"""Plots (matplotlib, Agg backend, PNG out). Each function takes rows already computed and a path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["plot_scan"]


def plot_scan(table: Sequence[dict[str, float]], path: str | Path, *, title: str = "") -> Path:
    """Batch-size scan: P50 step latency with P95 bars (left) and positions/s (right) against B.

    `table` holds `experiments.scan.scan_table` rows. Writes a PNG (folders created) and returns its path.
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
