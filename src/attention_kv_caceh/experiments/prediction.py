"""Predict before measuring, then say which prediction held: the scan's roofline and the `cache`
experiment's slopes (the first and last steps of the lab's method).

The batch-size scan records two predictions before its first timed sample:

- the user's: free text (`--predict`, recorded and shown, not checked: it is prose) and optionally a
  saturation point (`--predict-saturation B`, or `none` for "not reached within the scan");
- the model's: a two-term roofline per batch size B,

      predicted P50(B) = overhead_ms + bytes_moved(B) / bandwidth,

  where overhead_ms is the fixed per-call cost measured at the smallest shape (B = 1, T = 1) minus that
  shape's own bytes term, bandwidth is the read probe's (`np.dot(buf, buf)`) P50 bandwidth over the
  K/V bytes of the largest B, and bytes_moved(B) is `calibration.bytes_moved_per_step` (K/V read by
  attention plus the Dynamic cache's copy; a caller such as an engine benchmark may pass its own bytes
  per step, weights included). Both terms are measured first and recorded (`calibration.calibrate`).

The `cache` experiment predicts the slope of step time against cached positions T: per position a
Preallocated step reads K and V, 2 * B * H_kv * D * itemsize bytes, and a Dynamic step's append copies
them again (`np.concatenate` reads the old positions and writes the new ones), three times as much;
divided by the read probe's bandwidth (over the K/V bytes at T = N) that gives ms per position.

Decisions (each applied in one place below):

- Saturation uses one definition for prediction and measurement: `scan_stats.saturation_point`, the
  first B whose doubling raises positions/s = B * T / P50 by less than SATURATION_GAIN = 10 %, applied
  to the predicted P50s and to the measured P50s alike. For the roofline with o = overhead and
  s = bandwidth term per sequence, one doubling gains o / (o + 2Bs), so the model saturates once
  B * s > 4.5 * o; the "knee" where the bandwidth term first exceeds the overhead term comes earlier
  and is reported beside it.
- The user's saturation prediction holds on an exact match of B with the measured point; `none` holds
  when saturation is not reached. A B that is not scanned, or the largest B (it has no doubling after
  it), could never hold and is refused up front (`check_user_prediction`).
- A predicted P50 or slope holds when measured / predicted lies within [1/2, 2] (MODEL_TOLERANCE = 2);
  the model's saturation point holds on an exact match like the user's.
- Anomalies: samples above ANOMALY_FACTOR = 2 x their group's P95 are listed with their repeat index.
  They stay in every statistic; the verdicts are recomputed without them only to say whether they
  change any verdict.

Records are JSON-serialisable (`to_json` / `from_json`) so the report can check them against the raw
files. `outcome_text` renders what the commands print, `outcome_markdown` what they write beside their
raw file, both through `tables`. Nothing here prints or touches files. Shape letters as in
attention.py: B batch, H_kv KV heads, D head dim, T cached positions, N steps.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_kv_caceh.experiments.cache_growth_stats import CACHE_KINDS, CacheGrowthSummary
from attention_kv_caceh.experiments.calibration import Calibration, bytes_moved_per_step
from attention_kv_caceh.experiments.scan import ScanConfig
from attention_kv_caceh.experiments.scan_stats import (
    SATURATION_GAIN,
    doubling_gains,
    saturation_point,
    scan_table,
)
from attention_kv_caceh.tables import markdown_table, text_table
from attention_kv_caceh.timing import Sample, summarize_samples

__all__ = [
    "ANOMALY_FACTOR",
    "BANDWIDTH",
    "MODEL_TOLERANCE",
    "OVERHEAD",
    "VERDICT_MARK",
    "Anomaly",
    "CacheOutcome",
    "CachePrediction",
    "CacheSlopeRow",
    "PredictionRow",
    "RooflineRow",
    "ScanOutcome",
    "ScanPrediction",
    "UserPrediction",
    "Verdict",
    "anomaly_lines",
    "cache_bytes_per_position",
    "cache_prediction_card",
    "cache_probe_bytes",
    "check_user_prediction",
    "evaluate_cache",
    "evaluate_scan",
    "explain_scan",
    "find_anomalies",
    "fmt_ms",
    "fmt_rate",
    "make_cache_prediction",
    "make_scan_prediction",
    "model_saturation",
    "outcome_json",
    "outcome_markdown",
    "outcome_text",
    "parse_saturation",
    "prediction_card",
    "sat_text",
    "utc_now",
    "verdict_lines",
]

MODEL_TOLERANCE = 2.0
OVERHEAD, BANDWIDTH = "call overhead", "bandwidth"


def utc_now() -> str:
    """The current UTC time, ISO 8601 with microseconds (so it orders against the first sample)."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def parse_saturation(text: str) -> int | None:
    """`--predict-saturation` text -> a batch size, or None for "none". Raises ValueError otherwise."""
    if text.strip().lower() == "none":
        return None
    try:
        b = int(text)
    except ValueError:
        raise ValueError(f"a predicted saturation is a batch size or 'none', got {text!r}") from None
    if b < 1:
        raise ValueError(f"a predicted saturation must be a batch size >= 1, got {b}")
    return b


@dataclass(frozen=True)
class UserPrediction:
    """The user's own prediction: free text and, when `saturation_given`, a B (None = "none")."""

    text: str = ""
    saturation_given: bool = False
    saturation: int | None = None

    def __post_init__(self) -> None:
        if self.saturation is not None and not self.saturation_given:
            raise ValueError(f"saturation={self.saturation} needs saturation_given=True")
        if self.saturation is not None and self.saturation < 1:
            raise ValueError(f"a predicted saturation must be >= 1, got {self.saturation}")

    def saturation_text(self) -> str:
        if not self.saturation_given:
            return "not given"
        return "not reached" if self.saturation is None else f"B = {self.saturation}"


def check_user_prediction(user: UserPrediction, batch_sizes: Sequence[int]) -> None:
    """Refuse a saturation prediction that no scan over `batch_sizes` could confirm (ValueError).

    `saturation_point` only ever names a B that has a larger B after it, so the prediction must be one
    of the scanned sizes other than the largest; with fewer than two batch sizes no saturation
    (not even "not reached") can be measured.
    """
    if not user.saturation_given:
        return
    if len(batch_sizes) < 2:
        raise ValueError(
            f"a saturation prediction needs at least two batch sizes (saturation is a doubling of B that "
            f"gains < 10 % positions/s); --batch-sizes has {list(batch_sizes)}"
        )
    if user.saturation is None:
        return
    possible = sorted(batch_sizes)[:-1]
    if user.saturation not in possible:
        raise ValueError(
            f"predicted saturation B = {user.saturation} can never be measured: saturation is named at "
            f"a scanned B that has a larger one after it, one of {possible} (or 'none')"
        )


@dataclass(frozen=True)
class RooflineRow:
    """The model at one B: overhead_ms + bandwidth_ms = predicted_p50_ms (milliseconds)."""

    batch_size: int
    bytes_per_step: int
    overhead_ms: float
    bandwidth_ms: float

    @property
    def predicted_p50_ms(self) -> float:
        return self.overhead_ms + self.bandwidth_ms

    @property
    def dominant(self) -> str:
        """The larger term: "call overhead" or "bandwidth" (overhead on a tie)."""
        return BANDWIDTH if self.bandwidth_ms > self.overhead_ms else OVERHEAD


@dataclass(frozen=True)
class ScanPrediction:
    """Everything predicted before the first timed sample; `written_at_utc` says when.

    bytes_per_step: (B, bytes moved by one step) for every scanned B, ascending; sequence_length: T.
    """

    written_at_utc: str
    user: UserPrediction
    calibration: Calibration
    sequence_length: int
    bytes_per_step: tuple[tuple[int, int], ...]
    gain: float = SATURATION_GAIN
    tolerance: float = MODEL_TOLERANCE

    def __post_init__(self) -> None:
        sizes = [b for b, _ in self.bytes_per_step]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"bytes_per_step needs distinct ascending batch sizes >= 1, got {sizes}")
        if any(n < 0 for _, n in self.bytes_per_step):
            raise ValueError(f"bytes per step must be >= 0, got {list(self.bytes_per_step)}")
        if self.sequence_length < 1 or self.gain <= 0 or self.tolerance < 1:
            raise ValueError(
                f"need sequence_length >= 1, gain > 0, tolerance >= 1; got {self.sequence_length}, "
                f"{self.gain}, {self.tolerance}"
            )
        check_user_prediction(self.user, sizes)
        zero = [r.batch_size for r in self.rows if r.predicted_p50_ms <= 0]
        if zero:
            raise ValueError(f"the model predicts 0 ms at B = {zero}: no overhead and no bytes moved")

    @property
    def rows(self) -> list[RooflineRow]:
        """One RooflineRow per B: bandwidth_ms = bytes / (probe bytes / probe P50 ms)."""
        o, bw = self.calibration.overhead_ms, self.calibration.bandwidth_bytes_per_ms
        return [RooflineRow(b, n, o, n / bw) for b, n in self.bytes_per_step]

    def predicted_table(self) -> list[dict[str, float]]:
        """`batch_size`, `p50_ms`, `positions_per_s` = B * T / P50 per B, as `scan_table` names them."""
        t = self.sequence_length
        return [
            {
                "batch_size": r.batch_size,
                "p50_ms": r.predicted_p50_ms,
                "positions_per_s": r.batch_size * t / (r.predicted_p50_ms / 1000),
            }
            for r in self.rows
        ]

    @property
    def saturation(self) -> int | None:
        """The model's saturation point by `scan_stats.saturation_point` (None: not reached)."""
        return saturation_point(self.predicted_table(), self.gain)

    @property
    def knee(self) -> int | None:
        """The first B whose bandwidth term exceeds its overhead term (None: none does)."""
        return next((r.batch_size for r in self.rows if r.dominant == BANDWIDTH), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; the model's rows and saturation are included for readers of the file."""
        return {
            "kind": "scan-roofline",
            "written_at_utc": self.written_at_utc,
            "user": {
                "text": self.user.text,
                "saturation_given": self.user.saturation_given,
                "saturation": self.user.saturation,
            },
            "calibration": self.calibration.to_json(),
            "sequence_length": self.sequence_length,
            "bytes_per_step": {str(b): n for b, n in self.bytes_per_step},
            "gain": self.gain,
            "tolerance": self.tolerance,
            "model": {
                "formula": "P50(B) = overhead_ms + bytes_per_step(B) / probe bandwidth",
                "rows": [
                    {
                        "batch_size": r.batch_size,
                        "overhead_ms": r.overhead_ms,
                        "bandwidth_ms": r.bandwidth_ms,
                        "predicted_p50_ms": r.predicted_p50_ms,
                        "dominant": r.dominant,
                    }
                    for r in self.rows
                ],
                "saturation": self.saturation,
                "knee": self.knee,
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScanPrediction:
        """Rebuild from `to_json` output; derived parts ("model") are recomputed, not read.

        Raises KeyError / ValueError / TypeError on a malformed record.
        """
        user = data["user"]
        sat = user["saturation"]
        return cls(
            written_at_utc=str(data["written_at_utc"]),
            user=UserPrediction(
                str(user["text"]), bool(user["saturation_given"]), None if sat is None else int(sat)
            ),
            calibration=Calibration.from_json(data["calibration"]),
            sequence_length=int(data["sequence_length"]),
            bytes_per_step=tuple(sorted((int(b), int(n)) for b, n in data["bytes_per_step"].items())),
            gain=float(data["gain"]),
            tolerance=float(data["tolerance"]),
        )


def make_scan_prediction(
    config: ScanConfig,
    calibration: Calibration,
    user: UserPrediction | None = None,
    bytes_per_step: Mapping[int, int] | None = None,
    written_at_utc: str | None = None,
) -> ScanPrediction:
    """The scan's prediction: bytes per B from `bytes_moved_per_step` unless given (e.g. with weights).

    Raises ValueError for a user saturation no scan of config.batch_sizes could confirm, or for
    bytes_per_step missing one of the scanned batch sizes.
    """
    sizes = sorted(config.batch_sizes)
    if bytes_per_step is None:
        bytes_per_step = {b: bytes_moved_per_step(config, b) for b in sizes}
    missing = [b for b in sizes if b not in bytes_per_step]
    if missing:
        raise ValueError(f"bytes_per_step lacks batch sizes {missing}")
    return ScanPrediction(
        written_at_utc=utc_now() if written_at_utc is None else written_at_utc,
        user=user or UserPrediction(),
        calibration=calibration,
        sequence_length=config.seq_len,
        bytes_per_step=tuple((b, int(bytes_per_step[b])) for b in sizes),
    )


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


def _within(ratio: float, tolerance: float) -> bool:
    """Whether measured / predicted lies within [1/tolerance, tolerance]: the prediction held."""
    return 1 / tolerance <= ratio <= tolerance


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
        held = _within(ratio, prediction.tolerance)
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
    dominates there, and that throughput rose while each step got slower. `rows` holds at least one row
    (`evaluate_scan` refuses no samples).
    """
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


# --------------------------------------------------------------------- the cache experiment's slopes

# Bytes moved per cached position, in units of the K/V bytes attention reads (see the module docstring).
_TRAFFIC = {"preallocated": 1, "dynamic": 3}


def cache_bytes_per_position(batch_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> dict[str, int]:
    """{cache kind: bytes one step moves per cached position}: 2 * B * H_kv * D * itemsize x 1 or 3.

    Sizes come from a validated `CacheGrowthConfig`; raises TypeError for an unknown dtype (np.dtype).
    """
    kv = 2 * batch_size * num_kv_heads * head_dim * np.dtype(dtype).itemsize
    return {kind: kv * _TRAFFIC[kind] for kind in CACHE_KINDS}


def cache_probe_bytes(batch_size: int, num_kv_heads: int, head_dim: int, dtype: str, steps: int) -> int:
    """K/V bytes of a cache holding N = steps positions: the probe's buffer size."""
    return cache_bytes_per_position(batch_size, num_kv_heads, head_dim, dtype)["preallocated"] * steps


@dataclass(frozen=True)
class CachePrediction:
    """The `cache` experiment's prediction: bytes per position per cache and the probe (ms samples)."""

    written_at_utc: str
    probe_bytes: int
    probe_samples_ms: tuple[float, ...]
    bytes_per_position: tuple[tuple[str, int], ...]
    tolerance: float = MODEL_TOLERANCE

    def __post_init__(self) -> None:
        kinds = sorted(k for k, _ in self.bytes_per_position)
        if kinds != sorted(CACHE_KINDS) or any(n < 1 for _, n in self.bytes_per_position):
            raise ValueError(
                f"need positive bytes for {list(CACHE_KINDS)}, got {list(self.bytes_per_position)}"
            )
        if self.probe_bytes < 1 or summarize_samples(self.probe_samples_ms)["p50_ms"] <= 0:
            raise ValueError("the probe needs > 0 bytes and a positive P50")
        if self.tolerance < 1:
            raise ValueError(f"tolerance must be >= 1, got {self.tolerance}")

    @property
    def bandwidth_gb_s(self) -> float:
        """probe_bytes / probe P50, in GB/s (1e9 bytes/s)."""
        return self.probe_bytes / (summarize_samples(self.probe_samples_ms)["p50_ms"] / 1000) / 1e9

    def slope_ms_per_position(self, kind: str) -> float:
        """bytes per position / bandwidth, in ms per position. Raises KeyError for an unknown kind."""
        bytes_per_ms = self.probe_bytes / summarize_samples(self.probe_samples_ms)["p50_ms"]
        return dict(self.bytes_per_position)[kind] / bytes_per_ms

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (predicted slopes included for readers; recomputed by from_json)."""
        return {
            "kind": "cache-slopes",
            "written_at_utc": self.written_at_utc,
            "probe_bytes": self.probe_bytes,
            "probe_samples_ms": list(self.probe_samples_ms),
            "bytes_per_position": dict(self.bytes_per_position),
            "tolerance": self.tolerance,
            "bandwidth_gb_s": self.bandwidth_gb_s,
            "slope_ms_per_position": {k: self.slope_ms_per_position(k) for k in CACHE_KINDS},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CachePrediction:
        """Rebuild from `to_json` output. Raises KeyError / ValueError / TypeError when malformed."""
        return cls(
            written_at_utc=str(data["written_at_utc"]),
            probe_bytes=int(data["probe_bytes"]),
            probe_samples_ms=tuple(float(x) for x in data["probe_samples_ms"]),
            bytes_per_position=tuple(sorted((str(k), int(v)) for k, v in data["bytes_per_position"].items())),
            tolerance=float(data["tolerance"]),
        )


def make_cache_prediction(
    bytes_per_position: Mapping[str, int],
    probe_bytes: int,
    probe_samples_ms: Sequence[float],
    written_at_utc: str | None = None,
) -> CachePrediction:
    """A CachePrediction stamped now (UTC) unless `written_at_utc` is given."""
    return CachePrediction(
        written_at_utc=utc_now() if written_at_utc is None else written_at_utc,
        probe_bytes=probe_bytes,
        probe_samples_ms=tuple(probe_samples_ms),
        bytes_per_position=tuple(sorted(bytes_per_position.items())),
    )


@dataclass(frozen=True)
class CacheSlopeRow:
    """Predicted against fitted slope of one cache (ms per position); ratio = measured / predicted."""

    cache: str
    predicted_ms_per_position: float
    measured_ms_per_position: float
    r2: float
    held: bool

    @property
    def ratio(self) -> float:
        return self.measured_ms_per_position / self.predicted_ms_per_position


@dataclass(frozen=True)
class CacheOutcome:
    """The slopes table, the verdicts and one paragraph of explanation."""

    prediction: CachePrediction
    rows: tuple[CacheSlopeRow, ...]
    verdicts: tuple[Verdict, ...]
    explanation: str


def _us(ms_per_position: float) -> str:
    return f"{ms_per_position * 1000:.4f}"


def evaluate_cache(prediction: CachePrediction, summary: CacheGrowthSummary) -> CacheOutcome:
    """Compare predicted slopes with the fitted ones of `summarize_cache_growth` (raw rows only)."""
    tol = prediction.tolerance
    rows: list[CacheSlopeRow] = []
    verdicts: list[Verdict] = []
    for kind in CACHE_KINDS:
        fit = summary.fits[kind]
        predicted = prediction.slope_ms_per_position(kind)
        ok = _within(fit.slope_ms_per_position / predicted, tol)
        rows.append(CacheSlopeRow(kind, predicted, fit.slope_ms_per_position, fit.r2, ok))
        detail = f"measured {_us(fit.slope_ms_per_position)}, predicted {_us(predicted)} us/position"
        verdicts.append(Verdict(f"{kind} slope", ok, ("held: " if ok else "failed: ") + detail))
    by_kind = {r.cache: r for r in rows}
    dyn, pre = by_kind["dynamic"], by_kind["preallocated"]
    predicted_ratio = dyn.predicted_ms_per_position / pre.predicted_ms_per_position
    measured_ratio = dyn.measured_ms_per_position / pre.measured_ms_per_position
    ok = measured_ratio > 0 and _within(measured_ratio / predicted_ratio, tol)
    verdicts.append(
        Verdict(
            "dynamic / preallocated",
            ok,
            ("held: " if ok else "failed: ")
            + f"measured {measured_ratio:.2f}x, predicted {predicted_ratio:.2f}x",
        )
    )
    per = dict(prediction.bytes_per_position)
    explanation = (
        f"Each cached position adds {per['preallocated']:,} bytes to a Preallocated step (attention reads "
        f"K and V) and {per['dynamic']:,} to a Dynamic one (the append's copy reads and writes them again); "
        f"at the probe's {prediction.bandwidth_gb_s:.2f} GB/s that predicts {_us(pre.predicted_ms_per_position)} "
        f"and {_us(dyn.predicted_ms_per_position)} us per position. The fits measured "
        f"{_us(pre.measured_ms_per_position)} (R^2 {pre.r2:.3f}) and {_us(dyn.measured_ms_per_position)} "
        f"(R^2 {dyn.r2:.3f}) us per position, a ratio of {measured_ratio:.2f}x against "
        f"{predicted_ratio:.2f}x from bytes alone"
        + (
            f"; the copy costs more than a whole Preallocated step from T = {summary.copy_dominates_from}."
            if summary.copy_dominates_from is not None
            else "; the copy never outweighs a whole Preallocated step within the run."
        )
    )
    return CacheOutcome(prediction, tuple(rows), tuple(verdicts), explanation)


# ------------------------------------------------------------------------------------------ rendering

VERDICT_MARK = {True: "held", False: "FAILED", None: "not checked"}


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
        f"            saturation: {user.saturation_text()}",
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
            f"  {kind:<13} {nbytes:,} bytes per position -> slope {_us(prediction.slope_ms_per_position(kind))} "
            "us/position"
        )
    return "\n".join(lines)


def _outcome_table(outcome: ScanOutcome | CacheOutcome) -> tuple[list[str], list[list[str]]]:
    if isinstance(outcome, CacheOutcome):
        header = ["cache", "predicted us/position", "measured us/position", "measured / predicted", "R^2"]
        return header, [
            [
                r.cache,
                _us(r.predicted_ms_per_position),
                _us(r.measured_ms_per_position),
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
    return [f"{indent}{v.name:<{width}}  {VERDICT_MARK[v.held]:<11} {v.text}" for v in outcome.verdicts]


def outcome_text(outcome: ScanOutcome | CacheOutcome) -> str:
    """The table of predicted against measured, the verdicts, the anomalies (scan) and the boundary
    paragraph, as printed after a run."""
    header, rows = _outcome_table(outcome)
    lines = ["Prediction against measurement", text_table(header, rows), "", *verdict_lines(outcome), ""]
    if isinstance(outcome, ScanOutcome):
        lines += ["Anomalies: " + outcome.anomaly_note, *("  " + a for a in anomaly_lines(outcome)), ""]
    return "\n".join([*lines, "Boundary: " + outcome.explanation])


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
    verdicts = [[v.name, VERDICT_MARK[v.held], v.text] for v in outcome.verdicts]
    out = [
        "#### Prediction against measurement\n",
        intro + "\n",
        markdown_table(header, rows),
        markdown_table(["prediction", "verdict", "detail"], verdicts),
    ]
    if isinstance(outcome, ScanOutcome):
        out += ["Anomalies: " + outcome.anomaly_note, *("- " + a for a in anomaly_lines(outcome)), ""]
    return "\n".join([*out, "Boundary: " + outcome.explanation]) + "\n"
