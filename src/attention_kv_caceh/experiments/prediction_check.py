"""The second half of a prediction: compare it with the raw samples and explain the boundary.

`evaluate_scan` takes a `prediction.ScanPrediction` (written before the first timed sample, or rebuilt
from metadata with `ScanPrediction.from_json`) and a scan's raw samples, and returns the per-B table
of predicted against measured P50, the verdict on every prediction, the anomalies and one paragraph
explaining the boundary. The decisions (saturation rule, tolerance, "held") are stated in the
docstring of `prediction`. Nothing here prints or touches files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from attention_kv_caceh.experiments.prediction import BANDWIDTH, ScanPrediction
from attention_kv_caceh.experiments.scan_stats import doubling_gains, saturation_point, scan_table
from attention_kv_caceh.timing import Sample, summarize_samples

__all__ = [
    "ANOMALY_FACTOR",
    "Anomaly",
    "PredictionRow",
    "ScanOutcome",
    "Verdict",
    "evaluate_scan",
    "explain_scan",
    "find_anomalies",
    "fmt_ms",
    "fmt_rate",
    "model_saturation",
    "outcome_json",
    "sat_text",
]

# A sample above this many times its group's P95 is listed as an anomaly (and kept).
ANOMALY_FACTOR = 2.0


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
class Verdict:
    """One prediction's verdict; held is None for a prediction that cannot be checked (free text)."""

    name: str
    held: bool | None
    text: str


@dataclass(frozen=True)
class ScanOutcome:
    """Predictions against measurements: the per-B table, verdicts, anomalies and the explanation."""

    prediction: ScanPrediction
    rows: tuple[PredictionRow, ...]
    measured_saturation: int | None
    verdicts: tuple[Verdict, ...]
    anomalies: tuple[Anomaly, ...]
    anomaly_note: str
    explanation: str


def fmt_ms(value: float) -> str:
    """Milliseconds as every table and paragraph here writes them (4 decimals)."""
    return f"{value:.4f}"


def fmt_rate(value: float) -> str:
    """Positions per second as every table and paragraph here writes them."""
    return f"{value:,.0f}"


def sat_text(b: int | None) -> str:
    """A saturation point as text: "B = 4", or "not reached" for None."""
    return "not reached" if b is None else f"B = {b}"


def _at(b: int | None) -> str:
    return "as not reached" if b is None else f"at B = {b}"


def _saturation_verdict(name: str, predicted: int | None, measured: int | None) -> Verdict:
    """Held on an exact match (None = not reached on both sides)."""
    if predicted == measured:
        return Verdict(name, True, f"held: predicted {sat_text(predicted)}, measured {sat_text(measured)}")
    return Verdict(name, False, f"failed: measured {sat_text(measured)}, predicted {sat_text(predicted)}")


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
        out.append(Verdict("user (text)", None, f"recorded: {user.text!r}"))
    if user.saturation_given:
        out.append(_saturation_verdict("user saturation", user.saturation, measured))
    out.append(_saturation_verdict("model saturation", model_saturation(prediction, rows), measured))
    missed = [r for r in rows if not r.held]
    tol = prediction.tolerance
    if not missed:
        text = f"held at every B (measured / predicted within 1/{tol:g} .. {tol:g})"
    else:
        worst = max(missed, key=lambda r: abs(math.log(r.ratio)))
        text = (
            f"failed at B = {', '.join(str(r.batch_size) for r in missed)} (outside 1/{tol:g} .. {tol:g}); "
            f"worst B = {worst.batch_size}: measured {fmt_ms(worst.measured_p50_ms)} ms, predicted "
            f"{fmt_ms(worst.predicted_p50_ms)} ms"
        )
    out.append(Verdict("model P50", not missed, text))
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
        ratio = t["p50_ms"] / m.predicted_p50_ms
        held = 1 / prediction.tolerance <= ratio <= prediction.tolerance
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
    if not anomalies:
        note = f"No sample above {ANOMALY_FACTOR:g} x its group's P95."
    else:
        flagged = {(a.batch_size, a.repeat) for a in anomalies}
        kept = [s for s in samples if (s.batch_size, s.repeat) not in flagged]
        _, _, without = _compare(prediction, kept)
        changed = [f"{v.name} ({w.text})" for v, w in zip(verdicts, without, strict=True) if v.held != w.held]
        note = (
            f"{len(anomalies)} sample(s) above {ANOMALY_FACTOR:g} x their group's P95, kept in every "
            "statistic; "
            + (
                "without them no verdict changes."
                if not changed
                else "without them: " + "; ".join(changed) + "."
            )
        )
    return ScanOutcome(
        prediction,
        tuple(rows),
        measured,
        tuple(verdicts),
        tuple(anomalies),
        note,
        explain_scan(prediction, rows, measured),
    )


def explain_scan(prediction: ScanPrediction, rows: Sequence[PredictionRow], measured: int | None) -> str:
    """One paragraph on the boundary, every figure taken from `rows` (formatted as the table does).

    Says where per-sequence cost stops falling (the measured saturation point) and which model term
    dominates there, and that throughput rose while each step got slower. Raises ValueError for no rows.
    """
    if not rows:
        raise ValueError("explain_scan needs at least one row")
    first, last = rows[0], rows[-1]
    if len(rows) == 1:
        return (
            f"One batch size (B = {first.batch_size}) was measured, so there is no boundary to explain: "
            f"P50 {fmt_ms(first.measured_p50_ms)} ms against {fmt_ms(first.predicted_p50_ms)} ms predicted, "
            f"{first.dominant} the larger term."
        )
    by_b = {r.batch_size: r for r in rows}
    table = [{"batch_size": r.batch_size, "positions_per_s": r.positions_per_s} for r in rows]
    gains = doubling_gains(table)
    parts: list[str] = []
    if measured is not None:
        b1, b2, g = next(x for x in gains if x[0] == measured)
        r1, r2 = by_b[b1], by_b[b2]
        parts.append(
            f"Per-sequence cost stops falling at B = {b1}: going to B = {b2} took it from "
            f"{fmt_ms(r1.per_sequence_ms)} to {fmt_ms(r2.per_sequence_ms)} ms and raised positions/s by only "
            f"{100 * g:.1f} % per doubling (< {100 * prediction.gain:.0f} %)."
        )
        why = r2
    else:
        b1, b2, g = min(gains, key=lambda x: x[2])
        parts.append(
            f"Per-sequence cost fell at every doubling, from {fmt_ms(first.per_sequence_ms)} ms at "
            f"B = {first.batch_size} to {fmt_ms(last.per_sequence_ms)} ms at B = {last.batch_size} "
            f"(smallest gain {100 * g:.1f} % from B = {b1} to B = {b2}): saturation was not reached."
        )
        why = last
    bound = "the bytes moved, not the fixed cost," if why.dominant == BANDWIDTH else "the fixed per-call cost"
    parts.append(
        f"At B = {why.batch_size} the model's bandwidth term is {fmt_ms(why.bandwidth_ms)} ms against "
        f"{fmt_ms(why.overhead_ms)} ms of call overhead, so {bound} sets the step time"
        + (
            f"; the bandwidth term first exceeds the overhead at B = {prediction.knee}."
            if prediction.knee is not None
            else "; the bandwidth term stays below the overhead at every scanned B."
        )
    )
    model = model_saturation(prediction, rows)
    if model != measured:
        # The doubling at the earlier of the two points is where model and measurement part.
        b = min(x for x in (model, measured) if x is not None)
        _, b2, measured_gain = next(x for x in gains if x[0] == b)
        predicted = [r for r in prediction.predicted_table() if r["batch_size"] in by_b]
        predicted_gain = next(g for b1, _, g in doubling_gains(predicted) if b1 == b)
        parts.append(
            f"The two-term model predicted saturation {_at(model)}, it was measured {_at(measured)}: from "
            f"B = {b} to B = {b2} the model expected positions/s to rise {100 * predicted_gain:.1f} % per "
            f"doubling and they rose {100 * measured_gain:.1f} %, "
            + (
                "so a cost outside call overhead and bytes / probe bandwidth grows with B there."
                if measured_gain < predicted_gain
                else "so the step's bytes moved faster than the probe read its buffer (a cache level the "
                "probe's larger buffer does not fit in, for one)."
            )
        )
    speedup = last.positions_per_s / first.positions_per_s
    slower = last.measured_p50_ms / first.measured_p50_ms
    parts.append(
        f"Throughput rose from {fmt_rate(first.positions_per_s)} to {fmt_rate(last.positions_per_s)} "
        f"positions/s ({speedup:.2f}x) while the step's P50 went from {fmt_ms(first.measured_p50_ms)} to "
        f"{fmt_ms(last.measured_p50_ms)} ms ({slower:.2f}x): "
        + (
            "every sequence waits for the whole step, so no single request got faster."
            if slower >= 1
            else "the larger step was not slower here, an exception worth rechecking."
        )
    )
    return " ".join(parts)


def outcome_json(verdicts: Sequence[Verdict], anomalies: Sequence[Anomaly] = ()) -> dict[str, Any]:
    """The verdicts (and anomalies) as JSON for the metadata and the CLI's last summary line.

    Derived data, written for readers of the file; the report recomputes it from the raw samples.
    """
    return {
        "verdicts": [{"name": v.name, "held": v.held, "text": v.text} for v in verdicts],
        "anomalies": [
            {
                "batch_size": a.batch_size,
                "repeat": a.repeat,
                "elapsed_ms": a.elapsed_ms,
                "group_p95_ms": a.group_p95_ms,
            }
            for a in anomalies
        ],
    }
