"""The `cache` experiment's prediction: the slope of step time against cached positions T, from bytes.

Per position a Preallocated step reads K and V, 2 * B * H_kv * D * itemsize bytes, and a Dynamic step's
append copies them again (`np.concatenate` reads the old positions and writes the new ones), three
times as much; divided by the read probe's bandwidth (over the K/V bytes at T = N) that gives ms per
position. `predict_slopes` measures the probe and stamps the prediction before the run times anything;
`evaluate_cache` compares it with the fitted slopes (`cache_growth_stats.summarize_cache_growth`): a
slope, and the Dynamic / Preallocated ratio, holds when measured / predicted lies within [1/2, 2]
(`prediction.MODEL_TOLERANCE`). Data only: the words are `report/outcome.py`.

Shape letters as in attention.py: B batch, H_kv KV heads, D head dim, T cached positions, N steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from attention_kv_caceh.experiments.cache_growth_stats import CACHE_KINDS, CacheGrowthSummary
from attention_kv_caceh.experiments.calibration import read_probe
from attention_kv_caceh.experiments.prediction import MODEL_TOLERANCE, utc_now, within
from attention_kv_caceh.experiments.prediction_check import Verdict
from attention_kv_caceh.timing import summarize_samples

if TYPE_CHECKING:
    from attention_kv_caceh.experiments.cache_growth import CacheGrowthConfig

__all__ = [
    "CacheOutcome",
    "CachePrediction",
    "CacheSlopeRow",
    "cache_bytes_per_position",
    "cache_probe_bytes",
    "evaluate_cache",
    "make_cache_prediction",
    "predict_slopes",
]

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
    """The slopes table and the verdicts, with what the boundary paragraph quotes: the two ratios of
    Dynamic to Preallocated slope and where the copy outweighs a whole Preallocated step (None: not
    within the run)."""

    prediction: CachePrediction
    rows: tuple[CacheSlopeRow, ...]
    verdicts: tuple[Verdict, ...]
    predicted_ratio: float
    measured_ratio: float
    copy_dominates_from: int | None


def evaluate_cache(prediction: CachePrediction, summary: CacheGrowthSummary) -> CacheOutcome:
    """Compare predicted slopes with the fitted ones of `summarize_cache_growth` (raw rows only)."""
    tol = prediction.tolerance
    rows: list[CacheSlopeRow] = []
    verdicts: list[Verdict] = []
    for kind in CACHE_KINDS:
        fit = summary.fits[kind]
        predicted = prediction.slope_ms_per_position(kind)
        ok = within(fit.slope_ms_per_position / predicted, tol)
        rows.append(CacheSlopeRow(kind, predicted, fit.slope_ms_per_position, fit.r2, ok))
        verdicts.append(
            Verdict(f"{kind} slope", ok, "slope", predicted, fit.slope_ms_per_position, tolerance=tol)
        )
    by_kind = {r.cache: r for r in rows}
    dyn, pre = by_kind["dynamic"], by_kind["preallocated"]
    predicted_ratio = dyn.predicted_ms_per_position / pre.predicted_ms_per_position
    measured_ratio = dyn.measured_ms_per_position / pre.measured_ms_per_position
    ok = measured_ratio > 0 and within(measured_ratio / predicted_ratio, tol)
    verdicts.append(
        Verdict("dynamic / preallocated", ok, "ratio", predicted_ratio, measured_ratio, tolerance=tol)
    )
    return CacheOutcome(
        prediction, tuple(rows), tuple(verdicts), predicted_ratio, measured_ratio, summary.copy_dominates_from
    )


def predict_slopes(config: CacheGrowthConfig) -> CachePrediction:
    """The predicted slopes, measured and stamped before the run times anything.

    Bytes per cached position per cache (`cache_bytes_per_position`) over the read probe's bandwidth
    (`calibration.read_probe`: `np.dot` over the K/V bytes of a cache at T = N, 3 warm-up + 30 timed
    calls).
    """
    shape = (config.batch_size, config.num_kv_heads, config.head_dim, config.dtype)
    nbytes = cache_probe_bytes(*shape, config.steps)
    return make_cache_prediction(cache_bytes_per_position(*shape), nbytes, read_probe(nbytes, config.dtype))
