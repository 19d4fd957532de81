"""The text of a prediction and of its check: the cards printed before timing, the table of predicted
against measured, the verdict lines and the Markdown subsection, and the `prediction_outcome` record.

The scan and `cache` print `prediction_card` / `cache_prediction_card` before their first timed
sample and `outcome_text` (or, without a user prediction, `model_lines`) after it; `outcome_markdown`
is the subsection both the commands and `report` write. The verdicts' words are `verdicts.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attention_kv_caceh.experiments.cache_prediction import CacheOutcome, CachePrediction
from attention_kv_caceh.experiments.prediction import ScanPrediction, UserPrediction
from attention_kv_caceh.experiments.prediction_check import Anomaly, ScanOutcome, Verdict
from attention_kv_caceh.report.verdicts import (
    VERDICT_MARK,
    anomaly_note,
    cache_boundary,
    fmt_ms,
    fmt_us,
    sat_text,
    scan_boundary,
    verdict_text,
)
from attention_kv_caceh.tables import markdown_table, text_table
from attention_kv_caceh.timing import summarize_samples

__all__ = [
    "anomaly_lines",
    "cache_prediction_card",
    "model_lines",
    "outcome_json",
    "outcome_markdown",
    "outcome_text",
    "prediction_card",
    "verdict_lines",
]


def _user_saturation(user: UserPrediction) -> str:
    if not user.saturation_given:
        return "not given"
    return sat_text(user.saturation)


def _boundary(outcome: ScanOutcome | CacheOutcome) -> str:
    return scan_boundary(outcome) if isinstance(outcome, ScanOutcome) else cache_boundary(outcome)


def prediction_card(prediction: ScanPrediction) -> str:
    """Plain-text card of everything the scan predicted, printed before the first timed sample."""
    c, user = prediction.calibration, prediction.user
    overhead_p50 = summarize_samples(c.overhead_samples_ms)["p50_ms"]
    probe_p50 = summarize_samples(c.probe_samples_ms)["p50_ms"]
    roofline = text_table(
        ["B", "bytes/step", "overhead ms", "bandwidth ms", "P50 ms", "dominant"],
        [
            [
                r.batch_size,
                f"{r.bytes_per_step:,}",
                fmt_ms(r.overhead_ms),
                fmt_ms(r.bandwidth_ms),
                fmt_ms(r.predicted_p50_ms),
                r.dominant,
            ]
            for r in prediction.rows
        ],
        indent="    ",
    )
    lines = [
        f"Prediction (written {prediction.written_at_utc}, before any timed sample)",
        f"  yours     {user.text!r}" if user.text else "  yours     no text (--predict)",
        f"            saturation: {_user_saturation(user)}",
        f"  overhead  {fmt_ms(c.overhead_ms)} ms per call = P50 {fmt_ms(overhead_p50)} ms at {c.overhead_shape} "
        f"minus its {c.overhead_bytes:,} bytes / bandwidth",
        f"  probe     {c.bandwidth_gb_s:.2f} GB/s = {c.probe_bytes:,} bytes / P50 {fmt_ms(probe_p50)} ms of "
        "np.dot(buf, buf)",
        "  model     P50(B) = overhead + bytes moved per step / probe bandwidth",
        roofline,
        f"  model saturation: {sat_text(prediction.saturation)} (saturation = the first doubling of B "
        f"that raises positions/s by < {100 * prediction.gain:.0f} %); bandwidth term above overhead from "
        + (f"B = {prediction.knee}" if prediction.knee is not None else "no scanned B"),
    ]
    return "\n".join(lines)


def cache_prediction_card(prediction: CachePrediction) -> str:
    """Plain text printed before the cache experiment times anything."""
    lines = [
        f"Prediction (written {prediction.written_at_utc}, before any timed step)",
        f"  probe     {prediction.bandwidth_gb_s:.2f} GB/s over {prediction.probe_bytes:,} bytes (np.dot)",
    ]
    for kind, nbytes in prediction.bytes_per_position:
        lines.append(
            f"  {kind:<13} {nbytes:,} bytes per position -> slope {fmt_us(prediction.slope_ms_per_position(kind))} "
            "us/position"
        )
    return "\n".join(lines)


def _outcome_table(outcome: ScanOutcome | CacheOutcome) -> tuple[list[str], list[list[str]]]:
    if isinstance(outcome, CacheOutcome):
        header = ["cache", "predicted us/position", "measured us/position", "measured / predicted", "R^2"]
        return header, [
            [
                r.cache,
                fmt_us(r.predicted_ms_per_position),
                fmt_us(r.measured_ms_per_position),
                f"{r.ratio:.2f}",
                f"{r.r2:.3f}",
            ]
            for r in outcome.rows
        ]
    header = ["B", "predicted P50 ms", "measured P50 ms", "measured / predicted", "dominant term", "P50 held"]
    return header, [
        [
            str(r.batch_size),
            fmt_ms(r.predicted_p50_ms),
            fmt_ms(r.measured_p50_ms),
            f"{r.ratio:.2f}",
            r.dominant,
            "yes" if r.held else "no",
        ]
        for r in outcome.rows
    ]


def anomaly_lines(outcome: ScanOutcome | CacheOutcome) -> list[str]:
    """One line per anomaly of a scan: its B, repeat, time and its group's P95 (none for a cache run)."""
    if isinstance(outcome, CacheOutcome):
        return []
    return [
        f"B = {a.batch_size}, repeat {a.repeat}: {fmt_ms(a.elapsed_ms)} ms (group P95 {fmt_ms(a.group_p95_ms)} ms)"
        for a in outcome.anomalies
    ]


def verdict_lines(outcome: ScanOutcome | CacheOutcome, indent: str = "") -> list[str]:
    """One line per verdict: name, held / FAILED / not checked, and the detail."""
    width = max(len(v.name) for v in outcome.verdicts)
    return [
        f"{indent}{v.name:<{width}}  {VERDICT_MARK[v.held]:<11} {verdict_text(v)}" for v in outcome.verdicts
    ]


def outcome_text(outcome: ScanOutcome | CacheOutcome) -> str:
    """The table of predicted against measured, the verdicts, the anomalies (scan) and the boundary
    paragraph, as printed after a run."""
    header, rows = _outcome_table(outcome)
    lines = ["Prediction against measurement", text_table(header, rows), "", *verdict_lines(outcome), ""]
    if isinstance(outcome, ScanOutcome):
        lines += ["Anomalies: " + anomaly_note(outcome), *("  " + a for a in anomaly_lines(outcome)), ""]
    return "\n".join([*lines, "Boundary: " + _boundary(outcome)])


def outcome_markdown(outcome: ScanOutcome | CacheOutcome) -> str:
    """The same content as `outcome_text`, as a Markdown subsection."""
    header, rows = _outcome_table(outcome)
    if isinstance(outcome, ScanOutcome):
        p = outcome.prediction
        intro = (
            f"Written {p.written_at_utc}, before any timed sample. Model: P50(B) = "
            f"{fmt_ms(p.calibration.overhead_ms)} ms call overhead (at {p.calibration.overhead_shape}) + bytes "
            f"moved per step / {p.calibration.bandwidth_gb_s:.2f} GB/s (read probe); held when measured / "
            f"predicted lies within 1/{p.tolerance:g} .. {p.tolerance:g}."
        )
    else:
        intro = f"Written {outcome.prediction.written_at_utc}, before any timed step."
    verdicts = [[v.name, VERDICT_MARK[v.held], verdict_text(v)] for v in outcome.verdicts]
    out = [
        "#### Prediction against measurement\n",
        intro + "\n",
        markdown_table(header, rows),
        markdown_table(["prediction", "verdict", "detail"], verdicts),
    ]
    if isinstance(outcome, ScanOutcome):
        out += ["Anomalies: " + anomaly_note(outcome), *("- " + a for a in anomaly_lines(outcome)), ""]
    return "\n".join([*out, "Boundary: " + _boundary(outcome)]) + "\n"


def model_lines(outcome: ScanOutcome, impl: str = "") -> str:
    """The model's verdicts only, one line each, after a scan without a user prediction (and the
    anomalies, when there are some); `impl` (" (fused)") names the implementation of a scan of several."""
    c = outcome.prediction.calibration
    lines = [
        f"Model{impl}: P50(B) = {c.overhead_ms:.4f} ms call overhead + bytes moved / {c.bandwidth_gb_s:.2f} GB/s "
        "read probe, written before the first timed sample",
        *verdict_lines(outcome, indent="  "),
    ]
    if outcome.anomalies:
        lines += ["  anomalies: " + anomaly_note(outcome), *("    " + a for a in anomaly_lines(outcome))]
    return "\n".join(lines)


def outcome_json(verdicts: Sequence[Verdict], anomalies: Sequence[Anomaly] = ()) -> dict[str, Any]:
    """The verdicts (and anomalies) as JSON for the metadata and the CLI's last summary line.

    Derived data, written for readers of the file; the report recomputes it from the raw samples.
    """
    return {
        "verdicts": [{"name": v.name, "held": v.held, "text": verdict_text(v)} for v in verdicts],
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
