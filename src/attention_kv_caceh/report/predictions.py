"""The report's prediction subsections: the table and verdicts a run's metadata `prediction` gives.

A scan or cache run that recorded a prediction before its first timed sample stores
`ScanPrediction.to_json()` / `CachePrediction.to_json()` under `"prediction"` in its `.meta.json`.
The report rebuilds the record (`from_json`, which recomputes every derived part) and compares it with
the raw rows it read, exactly as the command did (`evaluate_scan` / `evaluate_cache`), so the verdicts
come from the raw files, not from what the command printed. A record that cannot be rebuilt or compared
is a problem of the metadata file, never an error of the report.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attention_kv_caceh.experiments.cache_growth_stats import CacheGrowthSummary
from attention_kv_caceh.experiments.prediction import (
    CachePrediction,
    ScanPrediction,
    evaluate_cache,
    evaluate_scan,
    outcome_markdown,
)
from attention_kv_caceh.timing import Sample

__all__ = ["cache_prediction_section", "scan_prediction_section"]

# What a malformed record raises in from_json / evaluate (a missing key, a wrong type, a bad value).
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError)


def _section(build: Callable[[Mapping[str, Any]], str], prediction: Any) -> tuple[str, str | None]:
    if not isinstance(prediction, dict):
        return (
            "",
            f"malformed 'prediction': not an object ({type(prediction).__name__}); prediction table left out",
        )
    try:
        return "\n" + build(typing.cast("dict[str, Any]", prediction)), None
    except _MALFORMED as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return "", f"malformed 'prediction' ({why}): prediction table left out"


def scan_prediction_section(prediction: Any, samples: Sequence[Sample]) -> tuple[str, str | None]:
    """The Markdown of a scan's `prediction` record against its raw samples, and None; or "" and the
    problem (one line) when the record is malformed or does not fit the samples (a batch size it did
    not predict)."""
    return _section(
        lambda data: outcome_markdown(evaluate_scan(ScanPrediction.from_json(data), samples)),
        prediction,
    )


def cache_prediction_section(prediction: Any, summary: CacheGrowthSummary) -> tuple[str, str | None]:
    """The Markdown of a cache run's `prediction` record against its summary (`summarize_cache_growth`
    of the raw rows), and None; or "" and the problem when the record is malformed."""
    return _section(
        lambda data: outcome_markdown(evaluate_cache(CachePrediction.from_json(data), summary)),
        prediction,
    )
