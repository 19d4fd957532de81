"""The Markdown of one lab run, as its command writes it beside its raw file and the report collects
it: the run's section (`sections.py`) followed by its prediction against the measurement.

A scan or cache run records its prediction before its first timed sample (`ScanPrediction.to_json()` /
`CachePrediction.to_json()` under `"prediction"` in its `.meta.json`; `"predictions"`, impl -> record,
for `--impl all`). The record is rebuilt (`from_json` recomputes every derived part) and compared with
the raw rows (`evaluate_scan` / `evaluate_cache`), exactly as the command did, so the verdicts come
from the raw files. A record that cannot be rebuilt or compared is a problem of the metadata file,
never an error: it is returned in the problem list and its table left out.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from typing import Any

from attention_kv_caceh.experiments.cache_growth_stats import CacheMemoryRow, CacheStepSample
from attention_kv_caceh.experiments.cache_prediction import CachePrediction, evaluate_cache
from attention_kv_caceh.experiments.prediction import ScanPrediction
from attention_kv_caceh.experiments.prediction_check import evaluate_scan
from attention_kv_caceh.report.outcome import outcome_markdown
from attention_kv_caceh.report.sections import cache_section, scan_section
from attention_kv_caceh.report.sources import FileProblem, int_keyed
from attention_kv_caceh.timing import Sample

__all__ = ["cache_run_markdown", "scan_run_markdown"]

# What a malformed record raises in from_json / evaluate (a missing key, a wrong type, a bad value).
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError)


def _section(build: Callable[[Mapping[str, Any]], str], prediction: Any, problems: list[str]) -> str:
    if not isinstance(prediction, dict):
        problems.append(
            f"malformed 'prediction': not an object ({type(prediction).__name__}); prediction table left out"
        )
        return ""
    try:
        return "\n" + build(typing.cast("dict[str, Any]", prediction))
    except _MALFORMED as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        problems.append(f"malformed 'prediction' ({why}): prediction table left out")
        return ""


def scan_run_markdown(
    name: str, samples: list[Sample], meta: Mapping[str, Any] | None, problems: list[str]
) -> tuple[str, list[dict[str, float]]]:
    """The Markdown of one scan (raw `samples`, its metadata `meta` or None) and the first
    implementation's `scan_table` rows (for a plot). What is malformed in `meta` is appended to
    `problems`. Raises ValueError from `scan_section` on inconsistent samples."""
    found: list[FileProblem] = []
    probe = int_keyed(meta, "probe_samples_ms", "", found)
    kv = int_keyed(meta, "kv_bytes_per_step", "", found)
    problems += [p.problem for p in found]
    text, table = scan_section(name, samples, probe, kv)
    impls = list(dict.fromkeys(s.impl for s in samples))
    by_impl = meta.get("predictions") if meta is not None and len(impls) > 1 else None
    if isinstance(by_impl, dict):  # `--impl all`: one prediction per implementation, each on its rows
        pairs = [(i, typing.cast("dict[str, Any]", by_impl).get(i)) for i in impls]
    else:
        pairs = [(impls[0], None if meta is None else meta.get("prediction"))]
    for impl, prediction in pairs:
        if prediction is None:
            continue
        mine = [s for s in samples if s.impl == impl]

        def build(data: Mapping[str, Any], rows: list[Sample] = mine) -> str:
            return outcome_markdown(evaluate_scan(ScanPrediction.from_json(data), rows))

        section = _section(build, prediction, problems)
        text += (f"\n**{impl}**\n" if len(pairs) > 1 else "") + section
    return text, table


def cache_run_markdown(
    name: str,
    samples: list[CacheStepSample],
    memory: list[CacheMemoryRow],
    meta: Mapping[str, Any] | None,
    problems: list[str],
) -> str:
    """The Markdown of one cache-growth run (raw step rows, the memory rows of the same run, possibly
    none, and its metadata). What is malformed in `meta` is appended to `problems`. Raises ValueError
    from `cache_section` (a cache without samples or with one position)."""
    text, summary = cache_section(name, samples, memory)
    prediction = None if meta is None else meta.get("prediction")
    if prediction is not None:
        text += _section(
            lambda data: outcome_markdown(evaluate_cache(CachePrediction.from_json(data), summary)),
            prediction,
            problems,
        )
    return text
