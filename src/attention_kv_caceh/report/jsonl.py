"""Reading the serving harness's per-request JSONL for the report: one `RequestRecord` per line.

A line is skipped, and named as a problem, when it is not JSON, not a record, a timestamp is not an
integer, a token count is not an integer >= 0 (a negative count would be summed into throughput), its
timestamps run backwards (sent before arrival would be reported as a negative queue time),
or it repeats a request id (a request counted twice). Keys the records do not have (derived
latencies, fields a newer harness adds) are ignored. The file is streamed line by line through
`readers.open_regular` (regular files up to its size cap only).
"""

from __future__ import annotations

import itertools
import json
import typing
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.report.sources import FileProblem, open_regular

__all__ = ["check_timestamps", "generate_output_kind", "read_jsonl"]

_NAMES = frozenset(f.name for f in fields(RequestRecord))
_TIMES = ("arrival_ns", "sent_ns", "first_token_ns", "finish_ns", "stream_end_ns")
_COUNTS = ("output_tokens", "prompt_tokens", "requested_prompt_tokens")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _record_from_json(rec: Mapping[str, Any]) -> RequestRecord:
    """A harness RequestRecord from one JSON object (its raw timestamps; other keys are ignored).

    Raises ValueError when a required key is missing, a timestamp is not an integer or a token count
    is not an integer >= 0.
    """
    try:
        record = RequestRecord(**{k: v for k, v in rec.items() if k in _NAMES})
    except TypeError as exc:
        raise ValueError(f"not a per-request record ({exc})") from None
    for name in ("request_id", *_TIMES):
        value = getattr(record, name)
        if (value is not None or name in ("request_id", "arrival_ns")) and not _is_int(value):
            raise ValueError(f"{name} {value!r} is not an integer")
    times: Any = record.token_times_ns
    if not isinstance(times, list) or not all(_is_int(t) for t in typing.cast("list[Any]", times)):
        raise ValueError("token_times_ns is not a list of integers (ns)")
    for name in _COUNTS:
        count: Any = getattr(record, name)
        if count is None and name != "output_tokens":
            continue
        if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
            raise ValueError(f"{name} {count!r} is not a token count (an integer >= 0)")
    probe: Any = record.probe
    if not isinstance(probe, bool):
        raise ValueError(f"probe {probe!r} is not true or false")
    per_event: Any = record.tokens_per_event
    if not isinstance(per_event, list) or not all(
        _is_int(n) and n >= 0 for n in typing.cast("list[Any]", per_event)
    ):
        raise ValueError("tokens_per_event is not a list of token counts (integers >= 0)")
    return record


def check_timestamps(record: RequestRecord) -> str | None:
    """What is out of order in a record's timestamps, or None. They must run arrival <= sent <= first
    token <= every later token <= finish, and sent <= stream end (a request cannot be answered before
    it was sent, nor sent before it arrived)."""
    chain = [
        ("arrival_ns", record.arrival_ns),
        ("sent_ns", record.sent_ns),
        ("first_token_ns", record.first_token_ns),
        *((f"token_times_ns[{i}]", t) for i, t in enumerate(record.token_times_ns)),
        ("finish_ns", record.finish_ns),
    ]
    known = [(name, t) for name, t in chain if t is not None]
    for (a, ta), (b, tb) in itertools.pairwise(known):
        if tb < ta:
            return f"{b} < {a} ({tb} < {ta})"
    if (
        record.sent_ns is not None
        and record.stream_end_ns is not None
        and record.stream_end_ns < record.sent_ns
    ):
        return f"stream_end_ns < sent_ns ({record.stream_end_ns} < {record.sent_ns})"
    return None


# Keys every line of `generate`'s --output has, and every line of its --trace (StepStats and the ids
# of the requests that finished in the step).
_GENERATE_OUTPUT_KEYS = frozenset(
    {"index", "prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}
)
_GENERATE_TRACE_KEYS = frozenset(
    {"step_index", "num_scheduled_tokens", "num_prefill_tokens", "finished_request_ids"}
)


def generate_output_kind(path: Path) -> str | None:
    """ "--output" or "--trace" when the first non-blank line of `path` is a line of that `generate`
    output (a JSON object with all its keys), else None (also when the file cannot be read: the
    per-request reader then names the problem)."""
    try:
        f, _ = open_regular(path, newline=None)
        with f:
            line = next((ln for ln in f if ln.strip()), "")
        raw = json.loads(line)
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(raw, dict):
        return None
    keys = set(typing.cast("dict[str, Any]", raw))
    if keys >= _GENERATE_OUTPUT_KEYS:
        return "--output"
    if keys >= _GENERATE_TRACE_KEYS:
        return "--trace"
    return None


def read_jsonl(path: Path, problems: list[FileProblem]) -> list[RequestRecord] | None:
    """Serving-harness records of one JSONL file; bad lines are skipped and noted, None (noted) when
    none is left or the file cannot be read."""
    records: list[RequestRecord] = []
    ids: dict[Any, int] = {}

    def skip(i: int, why: str) -> None:
        problems.append(FileProblem(str(path), f"line {i}: {why}; line skipped"))

    try:
        f, _ = open_regular(path, newline=None)
        with f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    skip(i, f"malformed JSON ({exc.msg})")
                    continue
                if not isinstance(raw, dict):
                    skip(i, "not a JSON object")
                    continue
                try:
                    record = _record_from_json(typing.cast("dict[str, Any]", raw))
                except ValueError as exc:
                    skip(i, str(exc))
                    continue
                disorder = check_timestamps(record)
                if disorder is not None:
                    skip(i, f"timestamps out of order: {disorder}")
                    continue
                first = ids.setdefault(record.request_id, i)
                if first != i:
                    skip(i, f"request_id {record.request_id!r} already on line {first}")
                    continue
                records.append(record)
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(FileProblem(str(path), f"unreadable: {exc}"))
        return None
    except ValueError as exc:  # from open_regular
        problems.append(FileProblem(str(path), str(exc)))
        return None
    if not records:
        problems.append(FileProblem(str(path), "no per-request records"))
        return None
    return records
