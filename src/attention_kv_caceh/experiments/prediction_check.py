"""Which prediction held: a scan's prediction (`prediction.ScanPrediction`) against its raw samples.

`evaluate_scan` returns data only: the per-B rows of predicted against measured P50, the measured
saturation point, one `Verdict` per prediction (held or not, with the values it compared), the
anomalies and the verdicts recomputed without them. The words for all of it (tables, verdict lines,
the boundary paragraph) are `report/outcome.py` and `report/verdicts.py`.

- A predicted P50 holds when measured / predicted lies within [1/2, 2] (`prediction.MODEL_TOLERANCE`);
  a saturation point holds on an exact match (None = not reached on both sides).
- Anomalies: samples above ANOMALY_FACTOR = 2 x their group's P95 are listed with their repeat index.
  They stay in every statistic; the verdicts are recomputed without them only to say whether they
  change any verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from attention_kv_caceh.experiments.prediction import ScanPrediction, within
from attention_kv_caceh.experiments.scan_stats import saturation_point, scan_table
from attention_kv_caceh.timing import Sample, summarize_samples

__all__ = [
    "ANOMALY_FACTOR",
    "Anomaly",
    "PredictionRow",
    "ScanOutcome",
    "Verdict",
    "VerdictKind",
    "evaluate_scan",
    "find_anomalies",
    "model_saturation",
]

ANOMALY_FACTOR = 2.0

# What a verdict compares: free text (never judged), a saturation point, P50 per B, a slope, a ratio.
VerdictKind = Literal["text", "saturation", "p50", "slope", "ratio"]


@dataclass(frozen=True)
class Verdict:
    """One prediction's verdict; held is None for a prediction that cannot be checked (free text).

    predicted / measured: what was compared (a B or None for "not reached", ms, ms per position, a
    ratio; the text for kind "text"). For kind "p50": `batch_sizes` the B's outside the tolerance,
    predicted / measured the P50s (ms) of the worst of them, `worst` its B; `tolerance` the bound.
    """

    name: str
    held: bool | None
    kind: VerdictKind
    predicted: Any = None
    measured: Any = None
    batch_sizes: tuple[int, ...] = ()
    worst: int | None = None
    tolerance: float = 2.0


@dataclass(frozen=True)
class Anomaly:
    """A raw sample above ANOMALY_FACTOR x its group's P95 (kept in every statistic)."""

    batch_size: int
    repeat: int
    elapsed_ms: float
    group_p95_ms: float


def find_anomalies(samples: Sequence[Sample], factor: float = ANOMALY_FACTOR) -> list[Anomaly]:
    """Samples with elapsed_ms > factor x the P95 of their batch size's samples, by (B, repeat)."""
    by_b: dict[int, list[Sample]] = {}
    for s in samples:
        by_b.setdefault(s.batch_size, []).append(s)
    out: list[Anomaly] = []
    for b in sorted(by_b):
        p95 = summarize_samples([s.elapsed_ms for s in by_b[b]])["p95_ms"]
        out += [Anomaly(b, s.repeat, s.elapsed_ms, p95) for s in by_b[b] if s.elapsed_ms > factor * p95]
    return sorted(out, key=lambda a: (a.batch_size, a.repeat))


@dataclass(frozen=True)
class PredictionRow:
    """Predicted against measured P50 at one B; ratio = measured / predicted."""

    batch_size: int
    predicted_p50_ms: float
    measured_p50_ms: float
    overhead_ms: float
    bandwidth_ms: float
    dominant: str
    per_sequence_ms: float
    positions_per_s: float
    held: bool

    @property
    def ratio(self) -> float:
        return self.measured_p50_ms / self.predicted_p50_ms


@dataclass(frozen=True)
class ScanOutcome:
    """Predictions against measurements: the per-B rows, the verdicts, the anomalies, and the verdicts
    without the anomalies (empty when there are none)."""

    prediction: ScanPrediction
    rows: tuple[PredictionRow, ...]
    measured_saturation: int | None
    verdicts: tuple[Verdict, ...]
    anomalies: tuple[Anomaly, ...]
    without_anomalies: tuple[Verdict, ...] = ()

    @property
    def changed_without_anomalies(self) -> list[Verdict]:
        """The verdicts (as recomputed without the anomalies) whose held differs."""
        return [w for v, w in zip(self.verdicts, self.without_anomalies, strict=False) if v.held != w.held]


def _saturation_verdict(name: str, predicted: int | None, measured: int | None) -> Verdict:
    """Held on an exact match (None = not reached on both sides)."""
    return Verdict(name, predicted == measured, "saturation", predicted, measured)


def model_saturation(prediction: ScanPrediction, rows: Sequence[PredictionRow]) -> int | None:
    """The model's saturation point over the batch sizes in `rows` (all, unless the scan was cut short),
    so that it is compared like with like with the measured one."""
    measured_sizes = {r.batch_size for r in rows}
    predicted = [r for r in prediction.predicted_table() if r["batch_size"] in measured_sizes]
    return saturation_point(predicted, prediction.gain)


def _verdicts(
    prediction: ScanPrediction, rows: Sequence[PredictionRow], measured: int | None
) -> list[Verdict]:
    user = prediction.user
    out: list[Verdict] = []
    if user.text:
        out.append(Verdict("user (text)", None, "text", user.text))
    if user.saturation_given:
        out.append(_saturation_verdict("user saturation", user.saturation, measured))
    out.append(_saturation_verdict("model saturation", model_saturation(prediction, rows), measured))
    missed = [r for r in rows if not r.held]
    tol = prediction.tolerance
    if not missed:
        out.append(Verdict("model P50", True, "p50", tolerance=tol))
    else:
        worst = max(missed, key=lambda r: abs(math.log(r.ratio)))
        out.append(
            Verdict(
                "model P50",
                False,
                "p50",
                worst.predicted_p50_ms,
                worst.measured_p50_ms,
                tuple(r.batch_size for r in missed),
                worst.batch_size,
                tol,
            )
        )
    return out


def _compare(
    prediction: ScanPrediction, samples: Sequence[Sample]
) -> tuple[list[PredictionRow], int | None, list[Verdict]]:
    table = {int(r["batch_size"]): r for r in scan_table(samples)}
    model = {r.batch_size: r for r in prediction.rows}
    unknown = sorted(set(table) - set(model))
    if unknown:
        raise ValueError(f"samples at B = {unknown} have no prediction (predicted: {sorted(model)})")
    rows: list[PredictionRow] = []
    for b in sorted(table):
        m, t = model[b], table[b]
        held = within(t["p50_ms"] / m.predicted_p50_ms, prediction.tolerance)
        rows.append(
            PredictionRow(
                b,
                m.predicted_p50_ms,
                t["p50_ms"],
                m.overhead_ms,
                m.bandwidth_ms,
                m.dominant,
                t["per_sequence_ms"],
                t["positions_per_s"],
                held,
            )
        )
    measured = saturation_point(list(table.values()), prediction.gain)
    return rows, measured, _verdicts(prediction, rows, measured)


def evaluate_scan(prediction: ScanPrediction, samples: Sequence[Sample]) -> ScanOutcome:
    """Compare a prediction with a scan's raw samples (all of them, anomalies included).

    Measured P50 and positions/s come from `scan_stats.scan_table`, the measured saturation from
    `scan_stats.saturation_point`. A partial scan (fewer B than predicted) is compared on the B it has.
    Raises ValueError for no samples or samples at a B that was not predicted.
    """
    rows, measured, verdicts = _compare(prediction, samples)
    anomalies = find_anomalies(samples)
    without: list[Verdict] = []
    if anomalies:
        flagged = {(a.batch_size, a.repeat) for a in anomalies}
        _, _, without = _compare(prediction, [s for s in samples if (s.batch_size, s.repeat) not in flagged])
    return ScanOutcome(prediction, tuple(rows), measured, tuple(verdicts), tuple(anomalies), tuple(without))
