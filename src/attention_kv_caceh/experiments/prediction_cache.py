"""Predicted slopes for the `cache` experiment, written before it times anything, then checked.

Per cached position T, one decode step over a Preallocated cache moves the K and V that attention
reads: bytes_per_position = 2 * B * H_kv * D * itemsize. A Dynamic cache's append also copies them
(`np.concatenate` reads the T - 1 old positions and writes T new ones), so it moves three times as
much per position. Divided by the read probe's bandwidth (`np.dot(buf, buf)` over the K/V bytes at
T = N, the largest cache of the run), that gives each cache's predicted slope in ms per position;
the slope ratio (3) follows from the bytes alone.

Verdicts, as for the scan (see `prediction`): a slope holds when the fitted slope
(`cache_growth_stats.CacheFit`) / the predicted one lies within [1/2, 2] (MODEL_TOLERANCE); the
Dynamic / Preallocated ratio is judged the same way. Records are JSON-serialisable for the report.
Nothing here prints or touches files.

Shape letters as in attention.py: B batch, H_kv KV heads, D head dim, T cached positions, N steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_kv_caceh.experiments.cache_growth_stats import CACHE_KINDS, CacheGrowthSummary
from attention_kv_caceh.experiments.prediction import MODEL_TOLERANCE, utc_now
from attention_kv_caceh.experiments.prediction_check import Verdict
from attention_kv_caceh.timing import summarize_samples

__all__ = [
    "CacheOutcome",
    "CachePrediction",
    "CacheSlopeRow",
    "cache_bytes_per_position",
    "cache_outcome_markdown",
    "cache_outcome_text",
    "cache_prediction_card",
    "cache_probe_bytes",
    "evaluate_cache",
    "make_cache_prediction",
]

# Bytes moved per cached position, in units of the K/V bytes attention reads (see the docstring).
_TRAFFIC = {"preallocated": 1, "dynamic": 3}


def cache_bytes_per_position(batch_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> dict[str, int]:
    """{cache kind: bytes one step moves per cached position}: 2 * B * H_kv * D * itemsize x 1 or 3.

    Raises ValueError for a non-positive size, TypeError for an unknown dtype (np.dtype).
    """
    if min(batch_size, num_kv_heads, head_dim) < 1:
        raise ValueError(f"sizes must be >= 1, got B={batch_size}, H_kv={num_kv_heads}, D={head_dim}")
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


def _within(ratio: float, tolerance: float) -> bool:
    return 1 / tolerance <= ratio <= tolerance


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


def _cells(outcome: CacheOutcome) -> list[list[str]]:
    return [
        [
            r.cache,
            _us(r.predicted_ms_per_position),
            _us(r.measured_ms_per_position),
            f"{r.ratio:.2f}",
            f"{r.r2:.3f}",
        ]
        for r in outcome.rows
    ]


_HEADER = ["cache", "predicted us/position", "measured us/position", "measured / predicted", "R^2"]
_MARK = {True: "held", False: "FAILED", None: "not checked"}


def cache_outcome_text(outcome: CacheOutcome) -> str:
    """Fixed-width slopes table, verdict lines and the paragraph, printed after the run."""
    cells = _cells(outcome)
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(_HEADER)]
    return "\n".join(
        [
            "Prediction against measurement",
            "  ".join(h.rjust(w) for h, w in zip(_HEADER, widths, strict=True)),
            *("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells),
            "",
            *(f"{v.name:<23} {_MARK[v.held]:<7} {v.text}" for v in outcome.verdicts),
            "",
            "Boundary: " + outcome.explanation,
        ]
    )


def cache_outcome_markdown(outcome: CacheOutcome) -> str:
    """The same as `cache_outcome_text`, as a Markdown subsection for the report."""

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return (
        "\n".join(
            [
                "#### Prediction against measurement\n",
                f"Written {outcome.prediction.written_at_utc}, before any timed step.\n",
                row(_HEADER),
                "|" + " --- |" * len(_HEADER),
                *(row(r) for r in _cells(outcome)),
                "",
                row(["prediction", "verdict", "detail"]),
                "| --- | --- | --- |",
                *(row([v.name, _MARK[v.held], v.text]) for v in outcome.verdicts),
                "",
                "Boundary: " + outcome.explanation,
            ]
        )
        + "\n"
    )
