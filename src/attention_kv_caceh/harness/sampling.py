"""The sampling fields a harness run sends with every request, as vLLM's `vllm bench serve` does.

`temperature`, `top_p`, `top_k`, `frequency_penalty`, `presence_penalty`, `repetition_penalty`, and
`response_format` (a JSON object, e.g. `{"type": "json_object"}`: a structured workload, whose grammar
masks the server pays for on every step) (the flags of the same names): each is None unless given, and only the given ones go into the request body
(`body_fields`), so a run that gives none leaves every choice to the server (vLLM and this project's `serve` then sample at temperature 1.0).
The ranges are those the project's `serve` accepts (`entrypoints/openai/serving.py:sampling_params_for`), checked
here so a bad value is a usage error before any request is sent. vLLM's `--min-p` is left out: the
project's engine does not sample with min_p, and its server would ignore the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from attention_kv_caceh.options import ConfigError, option

__all__ = ["SamplingOptions"]

_NOT_SENT = "not sent"


def _response_format(text: str) -> dict[str, Any]:
    """The parse of `--response-format`: a JSON object whose `type` is text, json_object or json_schema
    (with a `json_schema.schema` object); ValueError otherwise, which the CLI reports naming the flag."""
    try:
        obj: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    if not isinstance(obj, dict) or obj.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError('must be a JSON object with "type" text, json_object or json_schema')
    fmt: dict[str, Any] = obj  # pyright: ignore[reportUnknownVariableType]
    spec: Any = fmt.get("json_schema")
    if fmt["type"] == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):  # pyright: ignore[reportUnknownMemberType]
        raise ValueError('json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
    return fmt


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling fields to send (None: not sent). Raises ConfigError naming the field for a value the
    server would refuse: temperature not finite or < 0; top_p not in (0, 1]; top_k not an integer >= -1
    (-1 and 0 disable it); a frequency or presence penalty outside [-2, 2]; repetition_penalty outside
    [1e-100, 1e100] (vLLM takes any value > 0)."""

    temperature: float | None = option(None, help="0 is greedy; >= 0", default_text=_NOT_SENT)
    top_p: float | None = option(None, help="nucleus mass in (0, 1]", default_text=_NOT_SENT)
    top_k: int | None = option(
        None, help="keep the k most probable; -1 or 0: off", metavar="TOP_K", default_text=_NOT_SENT
    )
    frequency_penalty: float | None = option(None, help="OpenAI's, in [-2, 2]", default_text=_NOT_SENT)
    presence_penalty: float | None = option(None, help="OpenAI's, in [-2, 2]", default_text=_NOT_SENT)
    repetition_penalty: float | None = option(None, help="vLLM's, > 0 (1: off)", default_text=_NOT_SENT)
    response_format: dict[str, Any] | None = option(
        None,
        help='OpenAI\'s, as JSON: {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}',
        metavar="JSON",
        parse=_response_format,
        default_text=_NOT_SENT,
    )

    def __post_init__(self) -> None:
        def bad(name: str, expected: str, value: object) -> ConfigError:
            return ConfigError(name, f"must be {expected}, got {value}")

        t = self.temperature
        if t is not None and not (math.isfinite(t) and t >= 0):
            raise bad("temperature", "a finite number >= 0", t)
        p = self.top_p
        if p is not None and not (math.isfinite(p) and 0 < p <= 1):
            raise bad("top_p", "in (0, 1]", p)
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < -1):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise bad("top_k", "an integer >= -1 (-1 or 0: off)", k)
        for name in ("frequency_penalty", "presence_penalty"):
            value: float | None = getattr(self, name)
            if value is not None and not (math.isfinite(value) and -2 <= value <= 2):
                raise bad(name, "in [-2, 2]", value)
        r = self.repetition_penalty
        if r is not None and not 1e-100 <= r <= 1e100:
            raise bad("repetition_penalty", "in [1e-100, 1e100]", r)

    def body_fields(self) -> dict[str, Any]:
        """The given fields under their OpenAI names, in declaration order; {} when none is given."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
