"""What the CLI prints and the report shows for a prediction: plain text and Markdown, no I/O.

`prediction_card` is printed before the first timed sample (the calibration, the user's prediction
and the model's per-B roofline); `scan_outcome_text` after the run (predicted against measured P50 per
B, the dominant term, the verdicts, the anomalies and the boundary paragraph); `scan_outcome_markdown`
is the same for the report. Figures are formatted by `prediction_check.fmt_ms` / `fmt_rate`, as in the
paragraph, so the table and the explanation show the same digits.
"""

from __future__ import annotations

from collections.abc import Sequence

from attention_kv_caceh.experiments.prediction import ScanPrediction
from attention_kv_caceh.experiments.prediction_check import ScanOutcome, fmt_ms, sat_text
from attention_kv_caceh.timing import summarize_samples

__all__ = [
    "VERDICT_MARK",
    "prediction_card",
    "scan_outcome_markdown",
    "scan_outcome_text",
]

VERDICT_MARK = {True: "held", False: "FAILED", None: "not checked"}


def prediction_card(prediction: ScanPrediction) -> str:
    """Plain-text card of everything predicted, printed before the first timed sample."""
    c, user = prediction.calibration, prediction.user
    overhead_p50 = summarize_samples(c.overhead_samples_ms)["p50_ms"]
    probe_p50 = summarize_samples(c.probe_samples_ms)["p50_ms"]
    lines = [
        f"Prediction (written {prediction.written_at_utc}, before any timed sample)",
        f"  yours     {user.text!r}" if user.text else "  yours     no text (--predict)",
        f"            saturation: {user.saturation_text()}",
        f"  overhead  {fmt_ms(c.overhead_ms)} ms per call = P50 {fmt_ms(overhead_p50)} ms at {c.overhead_shape} "
        f"minus its {c.overhead_bytes:,} bytes / bandwidth",
        f"  probe     {c.bandwidth_gb_s:.2f} GB/s = {c.probe_bytes:,} bytes / P50 {fmt_ms(probe_p50)} ms of "
        "np.dot(buf, buf)",
        "  model     P50(B) = overhead + bytes moved per step / probe bandwidth",
        *("  " + line for line in _roofline_lines(prediction)),
        f"  model saturation: {sat_text(prediction.saturation)} (saturation = the first doubling of B "
        f"that raises positions/s by < {100 * prediction.gain:.0f} %); bandwidth term above overhead from "
        + (f"B = {prediction.knee}" if prediction.knee is not None else "no scanned B"),
    ]
    return "\n".join(lines)


def _roofline_lines(prediction: ScanPrediction) -> list[str]:
    header = f"{'B':>4} {'bytes/step':>12} {'overhead ms':>12} {'bandwidth ms':>13} {'P50 ms':>9}  dominant"
    lines = [header, "-" * len(header)]
    for r in prediction.rows:
        lines.append(
            f"{r.batch_size:>4} {r.bytes_per_step:>12,} {fmt_ms(r.overhead_ms):>12} "
            f"{fmt_ms(r.bandwidth_ms):>13} {fmt_ms(r.predicted_p50_ms):>9}  {r.dominant}"
        )
    return lines


def _cells(outcome: ScanOutcome) -> tuple[list[str], list[list[str]]]:
    header = ["B", "predicted P50 ms", "measured P50 ms", "measured / predicted", "dominant term", "P50 held"]
    rows = [
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
    return header, rows


def _anomaly_lines(outcome: ScanOutcome) -> list[str]:
    return [
        f"B = {a.batch_size}, repeat {a.repeat}: {fmt_ms(a.elapsed_ms)} ms (group P95 {fmt_ms(a.group_p95_ms)} ms)"
        for a in outcome.anomalies
    ]


def scan_outcome_text(outcome: ScanOutcome) -> str:
    """Fixed-width table, verdict lines, anomalies and the paragraph, printed after the run."""
    header, rows = _cells(outcome)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        "Prediction against measurement",
        "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
        "-" * (sum(widths) + 2 * (len(widths) - 1)),
        *("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows),
        "",
        *(f"{v.name:<17} {VERDICT_MARK[v.held]:<11} {v.text}" for v in outcome.verdicts),
        "",
        "Anomalies: " + outcome.anomaly_note,
        *("  " + line for line in _anomaly_lines(outcome)),
        "",
        "Boundary: " + outcome.explanation,
    ]
    return "\n".join(lines)


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def scan_outcome_markdown(outcome: ScanOutcome) -> str:
    """The same content as `scan_outcome_text`, as a Markdown subsection for the report."""
    p = outcome.prediction
    header, rows = _cells(outcome)
    out = [
        "#### Prediction against measurement\n",
        f"Written {p.written_at_utc}, before any timed sample. Model: P50(B) = "
        f"{fmt_ms(p.calibration.overhead_ms)} ms call overhead (at {p.calibration.overhead_shape}) + bytes "
        f"moved per step / {p.calibration.bandwidth_gb_s:.2f} GB/s (read probe); held when measured / "
        f"predicted lies within 1/{p.tolerance:g} .. {p.tolerance:g}.\n",
        _md_row(header),
        "|" + " --- |" * len(header),
        *(_md_row(r) for r in rows),
        "",
        _md_row(["prediction", "verdict", "detail"]),
        "| --- | --- | --- |",
        *(_md_row([v.name, VERDICT_MARK[v.held], v.text]) for v in outcome.verdicts),
        "",
        "Anomalies: " + outcome.anomaly_note,
        *("- " + line for line in _anomaly_lines(outcome)),
        "",
        "Boundary: " + outcome.explanation,
    ]
    return "\n".join(out) + "\n"
