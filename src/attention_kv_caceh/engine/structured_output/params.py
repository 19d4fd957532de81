"""StructuredOutputsParams: which constraint a request's output must satisfy.

Corresponds to vLLM's `StructuredOutputsParams` in `vllm/sampling_params.py` (the fields and the
exactly-one-kind rule, with vLLM's names). Left out: `disable_fallback` (one backend here, llguidance, so
nothing to fall back to), `_backend` and the per-request backend choice.

The JSON schema travels serialized (a str), so the params stay frozen, hashable and msgpack-able inside
SamplingParams on the way to the engine core.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import cast

__all__ = ["STRUCTURED_OUTPUT_KINDS", "StructuredOutputsParams"]

# The kinds of constraint, in vLLM's field order; a request sets exactly one.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the output text (exactly one kind is set).

    Attributes:
        json: a JSON Schema, serialized as JSON text; the output is one JSON value valid under it.
        regex: a regular expression (Rust `regex` syntax: no look-around, no backreferences); the output
            matches it in full.
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar (llguidance's dialect) or a GBNF grammar; the output is a sentence of it.
        json_object: True: the output is one JSON object (any keys).
        structural_tag: vLLM's structural tag, JSON text `{"structures": [{"begin", "schema", "end"}, ...],
            "triggers": [...]}`: free text in which each segment that starts with a trigger is one of
            the structures (`begin`, a JSON value valid under `schema`, `end`).
        disable_any_whitespace: JSON without any whitespace between tokens (`,` and `:` as separators).
        disable_additional_properties: JSON objects of the schema that do not say otherwise get
            `"additionalProperties": false`.
        whitespace_pattern: the regex one run of whitespace between JSON tokens must match; None takes
            the bounded default (backend_guidance.DEFAULT_WHITESPACE_PATTERN), so JSON mode cannot emit
            an endless run of whitespace.

    Raises:
        ValueError: no kind or more than one kind is set, `json` / `structural_tag` is not JSON text,
            `choice` is empty or holds a non-string, `json_object` is False.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = self.kinds_set()
        if not kinds:
            raise ValueError(
                "You must use one kind of structured outputs constraint but none are specified "
                f"(one of {', '.join(STRUCTURED_OUTPUT_KINDS)})"
            )
        if len(kinds) > 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: {', '.join(kinds)}"
            )
        for name in ("json", "structural_tag"):
            text = getattr(self, name)
            if text is not None:
                try:
                    _json.loads(text)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"structured_outputs.{name} is not valid JSON: {exc}") from exc
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) for c in cast(tuple[object, ...], self.choice))
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be true when given")

    def kinds_set(self) -> list[str]:
        """The names of the kinds set (a valid params has exactly one)."""
        return [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) is not None]

    @property
    def kind(self) -> str:
        """The one kind set: "json", "regex", "choice", "grammar", "json_object" or "structural_tag"."""
        return self.kinds_set()[0]
