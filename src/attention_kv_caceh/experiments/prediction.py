"""Predict before measuring: the scan's two-term roofline and the user's own prediction, as records.

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

Decisions (each applied in one place):

- Saturation uses one definition for prediction and measurement: `scan_stats.saturation_point`, the
  first B whose doubling raises positions/s = B * T / P50 by less than SATURATION_GAIN = 10 %, applied
  to the predicted P50s and to the measured P50s alike. For the roofline with o = overhead and
  s = bandwidth term per sequence, one doubling gains o / (o + 2Bs), so the model saturates once
  B * s > 4.5 * o; the "knee" where the bandwidth term first exceeds the overhead term comes earlier
  and is reported beside it.
- The user's saturation prediction holds on an exact match of B with the measured point; `none` holds
  when saturation is not reached. A B that is not scanned, or the largest B (it has no doubling after
  it), could never hold and is refused up front (`check_user_prediction`).
- A predicted P50 holds when measured / predicted lies within [1/2, 2] (MODEL_TOLERANCE = 2).

Records are JSON-serialisable (`to_json` / `from_json`) so the report can check them against the raw
files. Checking them is `prediction_check.py` (the scan) and `cache_prediction.py` (the `cache`
experiment's slopes); their text is `report/outcome.py`. Shape letters as in attention.py.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from attention_kv_caceh.experiments.calibration import Calibration, bytes_moved_per_step
from attention_kv_caceh.experiments.scan import ScanConfig
from attention_kv_caceh.experiments.scan_stats import saturation_point
from attention_kv_caceh.timing import SATURATION_GAIN

__all__ = [
    "BANDWIDTH",
    "MODEL_TOLERANCE",
    "OVERHEAD",
    "RooflineRow",
    "ScanPrediction",
    "UserPrediction",
    "check_user_prediction",
    "make_scan_prediction",
    "parse_saturation",
    "utc_now",
    "within",
]

MODEL_TOLERANCE = 2.0
OVERHEAD, BANDWIDTH = "call overhead", "bandwidth"


def within(ratio: float, tolerance: float) -> bool:
    """Whether measured / predicted lies within [1/tolerance, tolerance]: the prediction held."""
    return 1 / tolerance <= ratio <= tolerance


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
