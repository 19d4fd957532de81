"""`--trace FILE`: replay a timed trace of requests (vLLM's `timed_trace` JSONL, Mooncake's JSONL).

The format, one JSON object a line (blank lines skipped):

    {"timestamp": 27482, "input_length": 40, "output_length": 8, "hash_ids": [46, 47, 48]}

- `timestamp`: the request's arrival, a finite number >= 0 that never decreases from one line to the
  next; in milliseconds (`mooncake`) or seconds (`timed-trace`). The first row arrives when the run
  starts, row i `(timestamp_i - timestamp_0) / --trace-speedup` after it.
- `input_length`: the prompt's tokens, an integer >= 1.
- `output_length`: the tokens asked for (`max_tokens`), an integer >= 1.
- `hash_ids`: one integer >= 0 per block of `block_size` prompt tokens, ceil(input_length /
  block_size) of them; the last one covers what is left (input_length mod block_size tokens, or a
  whole block). Mooncake's blocks are 512 tokens, vLLM's `timed_trace` default (Alibaba's traces) 16;
  `--trace-block-size` sets another.

Any other key of a row is reported once in a warning and not used. A row that breaks one of these
rules is refused with its line number (ConfigError naming `path`, "'FILE' line 7: ...").

Equal hash ids give equal token blocks, exactly: block `h` is `block_size` token ids made from words
drawn from a generator seeded by `h` alone (`block_words`), each block tokenized on its own and cut to
its length, and the prompt is the concatenation of its blocks' ids, sent as token ids to
`/v1/completions` (a last, partial block is the first tokens of its block). Two rows that share their
first k hash ids therefore share their first k * block_size prompt tokens, and a server's prefix cache
can find them (`prefix_ideal.py` computes what an ideal cache finds).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from attention_kv_caceh.harness.backends import RequestSpec
from attention_kv_caceh.harness.load import SYNTHETIC_WORDS
from attention_kv_caceh.options import ConfigError, check_options, option

__all__ = [
    "TRACE_FORMATS",
    "TraceFormat",
    "TraceRow",
    "TraceSettings",
    "block_words",
    "read_trace",
    "trace_offsets_s",
    "trace_specs",
    "trace_text",
]

logger = logging.getLogger(__name__)

TraceFormat = Literal["mooncake", "timed-trace"]
TRACE_FORMATS: tuple[TraceFormat, ...] = ("mooncake", "timed-trace")
# format -> (seconds per timestamp unit, tokens per hash id by default)
_FORMAT_DEFAULTS: dict[TraceFormat, tuple[float, int]] = {"mooncake": (1e-3, 512), "timed-trace": (1.0, 16)}
_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
_MAX_ROWS = 10_000_000

_WORDS = SYNTHETIC_WORDS


@dataclass(frozen=True)
class TraceSettings:
    """`path` (--trace) with its `format`, `block_size` (None: the format's default) and `speedup`
    (arrival gaps are divided by it). Raises ConfigError naming the field for a value out of range or a
    path that is no regular file; the file itself is read by `read_trace`."""

    path: str = option(
        flag="--trace",
        metavar="FILE.jsonl",
        help="replay a trace: one {timestamp, input_length, output_length, hash_ids} a line (vLLM's "
        "timed_trace, Mooncake's); arrivals follow the timestamps, equal hash ids give equal token "
        "blocks; --num-requests takes its first rows",
        default_text="not used",
    )
    format: TraceFormat = option(
        "mooncake",
        flag="--trace-format",
        choices=TRACE_FORMATS,
        help="mooncake: timestamps in ms, 512 tokens per hash id; timed-trace: timestamps in s, 16 "
        "tokens per hash id (vLLM's defaults)",
        default_text="mooncake",
    )
    block_size: int | None = option(
        None,
        flag="--trace-block-size",
        metavar="TOKENS",
        minimum=1,
        help="tokens per hash id (vLLM's --timed-trace-chunk-hash-size)",
        default_text="the format's",
    )
    speedup: float = option(
        1.0, flag="--trace-speedup", help="divide the trace's arrival gaps by this (2: twice as fast)"
    )

    def __post_init__(self) -> None:
        check_options(self)
        if not (self.speedup > 0 and math.isfinite(self.speedup)):
            raise ConfigError("speedup", f"must be a finite number > 0, got {self.speedup}")
        target = Path(self.path)
        if not target.is_file():
            what = (
                "not a regular file (a folder, FIFO, device or socket)" if target.exists() else "no such file"
            )
            raise ConfigError("path", f"{self.path!r}: {what}")

    @property
    def tokens_per_hash(self) -> int:
        """Prompt tokens per hash id."""
        return self.block_size if self.block_size is not None else _FORMAT_DEFAULTS[self.format][1]

    @property
    def seconds_per_unit(self) -> float:
        """Seconds per timestamp unit (1e-3 for Mooncake's milliseconds)."""
        return _FORMAT_DEFAULTS[self.format][0]

    def describe(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "block_size": self.tokens_per_hash,
            "speedup": self.speedup,
        }


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: its line in the file, arrival timestamp (the file's unit), prompt and
    output lengths in tokens, and the hash id of each prompt block."""

    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _row(where: str, number: int, obj: object, block: int, extra: set[str]) -> TraceRow:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with {', '.join(_KEYS)}")
    row = cast("dict[str, Any]", obj)
    missing = [k for k in _KEYS if k not in row]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    extra.update(k for k in row if k not in _KEYS)
    ts, n, out, ids = (row[k] for k in _KEYS)
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not (math.isfinite(ts) and ts >= 0):
        raise ValueError(f"{where}: timestamp must be a finite number >= 0, got {ts!r}")
    if not _count(n):
        raise ValueError(f"{where}: input_length must be an integer >= 1, got {n!r}")
    if not _count(out):
        raise ValueError(f"{where}: output_length must be an integer >= 1, got {out!r}")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in cast("list[Any]", ids)
    ):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    hash_ids = tuple(cast("list[int]", ids))
    need = -(-cast("int", n) // block)
    if len(hash_ids) != need:
        raise ValueError(
            f"{where}: input_length {n} needs ceil({n} / {block}) = {need} hash ids of {block} tokens, "
            f"got {len(hash_ids)} (set the trace's block_size to its tokens per hash id)"
        )
    return TraceRow(number, float(ts), cast("int", n), cast("int", out), hash_ids)


@functools.lru_cache(maxsize=4)
def _read(path: str, block: int, _stamp: tuple[int, int]) -> tuple[TraceRow, ...]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path!r}: cannot read it: {exc}") from None
    rows: list[TraceRow] = []
    extra: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path!r} line {number}"
        try:
            obj: object = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        row = _row(where, number, obj, block, extra)
        if rows and row.timestamp < rows[-1].timestamp:
            raise ValueError(
                f"{where}: timestamp {row.timestamp:g} is before line {rows[-1].line}'s "
                f"{rows[-1].timestamp:g}: a trace's rows come in arrival order"
            )
        rows.append(row)
        if len(rows) > _MAX_ROWS:
            raise ValueError(f"{path!r}: more than {_MAX_ROWS} rows")
    if not rows:
        raise ValueError(f"{path!r}: no rows")
    if extra:
        logger.warning("trace %s: keys not used: %s", path, ", ".join(sorted(extra)))
    return tuple(rows)


def read_trace(settings: TraceSettings) -> tuple[TraceRow, ...]:
    """Every row of the trace file, checked (module docstring); read once per file version (cached
    on its path, size and modification time). Raises ConfigError (field `path`) naming the file and line."""
    try:
        info = os.stat(settings.path)
        return _read(settings.path, settings.tokens_per_hash, (info.st_size, info.st_mtime_ns))
    except OSError as exc:
        raise ConfigError("path", f"{settings.path!r}: cannot read it: {exc}", TraceSettings) from None
    except ValueError as exc:
        raise ConfigError("path", str(exc), TraceSettings) from None


def trace_offsets_s(rows: Sequence[TraceRow], settings: TraceSettings) -> list[float]:
    """Arrival offsets (s) of `rows` after the run's start: `(t_i - t_0) * unit / speedup`."""
    if not rows:
        return []
    scale = settings.seconds_per_unit / settings.speedup
    return [(row.timestamp - rows[0].timestamp) * scale for row in rows]


@functools.lru_cache(maxsize=65536)
def block_words(hash_id: int, n: int) -> tuple[str, ...]:
    """The `n` words of the block of `hash_id`: drawn from a generator seeded by the id alone, so the
    same id is the same words in every row, every run and every process."""
    rng = np.random.default_rng([0x7472616365, hash_id])
    return tuple(_WORDS[int(k)] for k in rng.integers(0, len(_WORDS), size=n))


def trace_specs(rows: Sequence[TraceRow], block_size: int) -> list[RequestSpec]:
    """One RequestSpec per row, request id = row index, with its lengths and hash ids and no text yet:
    `prompts.exact_prompts` turns the blocks into exact token ids, `trace_text` into words (a server
    without a tokenizer, where a word stands for a token)."""
    return [
        RequestSpec(
            i,
            row.input_length,
            row.output_length,
            hash_ids=row.hash_ids,
            hash_block_size=block_size,
        )
        for i, row in enumerate(rows)
    ]


def trace_text(spec: RequestSpec) -> str:
    """The prompt of a trace spec as words: its blocks' words, cut to `prompt_tokens` words."""
    words: list[str] = []
    for h in spec.hash_ids:
        words += block_words(h, spec.hash_block_size)
    return " ".join(words[: spec.prompt_tokens])
