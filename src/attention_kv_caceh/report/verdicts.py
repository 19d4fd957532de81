"""The words of a prediction's check: each verdict's line, the anomaly note, the boundary paragraphs.

`experiments/prediction_check.py` and `experiments/cache_prediction.py` return data (`Verdict`,
`ScanOutcome`, `CacheOutcome`); this module says it, the same way for the command's printout, its
metadata (`prediction_outcome`) and the Markdown the command and `report` write. Every figure is
formatted as the tables format it (`fmt_ms`, `fmt_rate`), so a paragraph quotes the table's digits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from attention_kv_caceh.experiments.cache_prediction import CacheOutcome
from attention_kv_caceh.experiments.prediction import BANDWIDTH
from attention_kv_caceh.experiments.prediction_check import (
    ANOMALY_FACTOR,
    ScanOutcome,
    Verdict,
    model_saturation,
)
from attention_kv_caceh.experiments.scan_stats import doubling_gains
from attention_kv_caceh.timing import SATURATION_GAIN

__all__ = [
    "VERDICT_MARK",
    "anomaly_note",
    "cache_boundary",
    "fmt_ms",
    "fmt_rate",
    "fmt_us",
    "sat_text",
    "saturation_verdict",
    "scan_boundary",
    "verdict_text",
]

VERDICT_MARK = {True: "held", False: "FAILED", None: "not checked"}


def fmt_ms(value: float) -> str:
    """Milliseconds as every table and paragraph writes them (4 decimals)."""
    return f"{value:.4f}"


def fmt_rate(value: float) -> str:
    """Positions per second as every table and paragraph writes them."""
    return f"{value:,.0f}"


def fmt_us(ms_per_position: float) -> str:
    """A slope in ms per position, written in us per position (4 decimals)."""
    return f"{ms_per_position * 1000:.4f}"


def sat_text(b: int | None) -> str:
    """A saturation point as text: "B = 4", or "not reached" for None."""
    return "not reached" if b is None else f"B = {b}"


def _at(b: int | None) -> str:
    return "as not reached" if b is None else f"at B = {b}"


def saturation_verdict(table: Sequence[Mapping[str, float]], gain: float = SATURATION_GAIN) -> str:
    """The first B at which doubling B raises positions/s by less than `gain` (10 %), or "Not reached"
    (`scan_stats.saturation_point`'s rule, with the gains it compared).

    Consecutive rows of the table (sorted by B) are compared; when B does not exactly double between
    them, the gain is normalised per doubling: (ratio of positions/s) ** (1 / log2(B2 / B1)) - 1.
    """
    gains = doubling_gains(table)
    for b1, b2, per_doubling in gains:
        if per_doubling < gain:
            return (
                f"Saturated at B = {b1}: going to B = {b2} raised positions/s by "
                f"{100 * per_doubling:.1f} % per doubling (< {100 * gain:.0f} %)"
            )
    if not gains:
        return "Not reached: a scan of one batch size has no doubling to compare"
    b1, b2, g = min(gains, key=lambda x: x[2])
    return (
        f"Not reached: every doubling raised positions/s by >= {100 * gain:.0f} % "
        f"(smallest: {100 * g:.1f} % from B = {b1} to B = {b2})"
    )


def verdict_text(v: Verdict) -> str:
    """The detail of one verdict: "held: ..." / "failed: ..." with the values compared, or what was
    recorded for free text."""
    mark = "held: " if v.held else "failed: "
    tol = f"1/{v.tolerance:g} .. {v.tolerance:g}"
    match v.kind:
        case "text":
            return f"recorded: {v.predicted!r}"
        case "saturation":
            if v.held:
                return f"held: predicted {sat_text(v.predicted)}, measured {sat_text(v.measured)}"
            return f"failed: measured {sat_text(v.measured)}, predicted {sat_text(v.predicted)}"
        case "p50":
            if v.held:
                return f"held at every B (measured / predicted within {tol})"
            return (
                f"failed at B = {', '.join(str(b) for b in v.batch_sizes)} (outside {tol}); worst B = "
                f"{v.worst}: measured {fmt_ms(v.measured)} ms, predicted {fmt_ms(v.predicted)} ms"
            )
        case "slope":
            return mark + f"measured {fmt_us(v.measured)}, predicted {fmt_us(v.predicted)} us/position"
        case "ratio":
            return mark + f"measured {v.measured:.2f}x, predicted {v.predicted:.2f}x"


def anomaly_note(outcome: ScanOutcome) -> str:
    """One sentence on the anomalies: none, or how many and whether leaving them out changes a verdict."""
    if not outcome.anomalies:
        return f"No sample above {ANOMALY_FACTOR:g} x its group's P95."
    changed = [f"{w.name} ({verdict_text(w)})" for w in outcome.changed_without_anomalies]
    return (
        f"{len(outcome.anomalies)} sample(s) above {ANOMALY_FACTOR:g} x their group's P95, kept in every "
        "statistic; "
        + ("without them no verdict changes." if not changed else "without them: " + "; ".join(changed) + ".")
    )


def scan_boundary(outcome: ScanOutcome) -> str:
    """One paragraph on the boundary, every figure taken from the outcome's rows (formatted as the
    table does).

    Says where per-sequence cost stops falling (the measured saturation point) and which model term
    dominates there, and that throughput rose while each step got slower. The outcome holds at least
    one row (`evaluate_scan` refuses no samples).
    """
    prediction, rows, measured = outcome.prediction, outcome.rows, outcome.measured_saturation
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


def cache_boundary(outcome: CacheOutcome) -> str:
    """One paragraph on the slopes: the bytes per position, the predicted and fitted slopes, their
    ratio, and where the Dynamic cache's copy outweighs a whole Preallocated step."""
    prediction = outcome.prediction
    by_kind = {r.cache: r for r in outcome.rows}
    dyn, pre = by_kind["dynamic"], by_kind["preallocated"]
    measured_ratio, predicted_ratio = outcome.measured_ratio, outcome.predicted_ratio
    per = dict(prediction.bytes_per_position)
    return (
        f"Each cached position adds {per['preallocated']:,} bytes to a Preallocated step (attention reads "
        f"K and V) and {per['dynamic']:,} to a Dynamic one (the append's copy reads and writes them again); "
        f"at the probe's {prediction.bandwidth_gb_s:.2f} GB/s that predicts {fmt_us(pre.predicted_ms_per_position)} "
        f"and {fmt_us(dyn.predicted_ms_per_position)} us per position. The fits measured "
        f"{fmt_us(pre.measured_ms_per_position)} (R^2 {pre.r2:.3f}) and {fmt_us(dyn.measured_ms_per_position)} "
        f"(R^2 {dyn.r2:.3f}) us per position, a ratio of {measured_ratio:.2f}x against "
        f"{predicted_ratio:.2f}x from bytes alone"
        + (
            f"; the copy costs more than a whole Preallocated step from T = {outcome.copy_dominates_from}."
            if outcome.copy_dominates_from is not None
            else "; the copy never outweighs a whole Preallocated step within the run."
        )
    )
