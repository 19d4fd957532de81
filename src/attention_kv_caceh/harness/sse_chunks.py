"""The chunks of an OpenAI-style stream: their shapes, checked, and the exceptions a bad one raises.

A `data:` payload is decoded twice over at most. First with msgspec into typed Structs (`Chunk`: the
fields the decoder reads, each a string, an integer or null as the API says, the rest skipped), which
checks the common chunk's types in C; anything that shape does not fit, and anything unusual (an error,
logprobs, tool calls), is decoded again into Python objects and checked field by field
(`checked_choices`, `usage_count`), so that the failure names the field. `sse.OpenAIStreamDecoder`
uses both.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec

__all__ = [
    "CHUNK_DECODER",
    "CHUNK_LIST_DECODER",
    "Chunk",
    "InvalidUsageError",
    "MalformedSSEError",
    "StreamErrorEvent",
    "as_dict",
    "carries_tokens",
    "checked_choices",
    "decode_json",
    "logprob_tokens",
    "nonempty_str",
    "short",
    "usage_count",
]


class StreamErrorEvent(Exception):
    """The server sent an error inside the stream (an `error` object or an `event: error`)."""


class MalformedSSEError(Exception):
    """A `data:` payload that is neither `[DONE]` nor a JSON object, or an object whose `choices` are not
    a list of objects with string `text` / `finish_reason` / `delta` fields."""


class InvalidUsageError(MalformedSSEError):
    """A `usage` count that is not a non-negative integer, or a `completion_tokens` that decreased
    (recorded as `invalid_usage`, never used as a statistic)."""


decode_json = msgspec.json.decode  # strict JSON, several times faster than json.loads


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    role: str | None = None
    tool_calls: Any = None
    function_call: Any = None


class _Choice(msgspec.Struct):
    text: str | None = None
    finish_reason: str | None = None
    delta: _Delta | None = None
    logprobs: Any = None


class Chunk(msgspec.Struct):
    """The fields of a stream chunk the decoder reads, typed: msgspec checks the types while it decodes
    (other fields are skipped), so the common chunk needs no check in Python (`_typed_event`)."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None
    object: Any = None


CHUNK_DECODER = msgspec.json.Decoder(Chunk)
CHUNK_LIST_DECODER = msgspec.json.Decoder(list[Chunk])  # several chunks of one read, in one call


def as_dict(value: object) -> dict[str, Any] | None:
    return cast("dict[str, Any]", value) if isinstance(value, dict) else None


def as_list(value: object) -> list[Any] | None:
    return cast("list[Any]", value) if isinstance(value, list) else None


def nonempty_str(value: object) -> bool:
    return isinstance(value, str) and value != ""


def tool_call_args(delta: dict[str, Any]) -> bool:
    """True when a chat delta carries generated tool-call text (a name or argument fragment)."""
    calls = [as_dict(c) for c in as_list(delta.get("tool_calls")) or []]
    legacy = as_dict(delta.get("function_call"))
    functions = [as_dict(c.get("function")) for c in calls if c is not None]
    functions.append(legacy)
    return any(
        f is not None and (nonempty_str(f.get("arguments")) or nonempty_str(f.get("name"))) for f in functions
    )


def logprob_tokens(choice: dict[str, Any]) -> int | None:
    logprobs = as_dict(choice.get("logprobs"))
    if logprobs is None:
        return None
    tokens = as_list(logprobs.get("tokens"))  # completions
    if tokens is None:
        tokens = as_list(logprobs.get("content"))  # chat
    return len(tokens) if tokens else None


def carries_tokens(choice: dict[str, Any]) -> bool:
    """True when a choice carries generated tokens: text, content, reasoning, refusal, tool-call
    name/arguments, or a non-empty logprobs list."""
    if nonempty_str(choice.get("text")) or logprob_tokens(choice):
        return True
    delta = as_dict(choice.get("delta")) or {}
    keys = ("content", "reasoning_content", "reasoning", "refusal")
    return any(nonempty_str(delta.get(key)) for key in keys) or tool_call_args(delta)


# Fields of a choice (and of a chat delta) that are text when present: a number or an object there is a
# malformed chunk, never a silently skipped one.
_TEXT_FIELDS = ("text", "finish_reason")
_DELTA_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal", "role")


def checked_choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """`obj["choices"]` checked: absent or null is no choice; else a list of objects whose `text`,
    `finish_reason` and `delta` fields (when present and not null) have the OpenAI API's types.
    Raises MalformedSSEError naming the field otherwise."""
    raw = obj.get("choices")
    if raw is None:
        return []
    choices = as_list(raw)
    if choices is None:
        raise MalformedSSEError(f"choices is {short(raw)}, not a list")
    checked: list[dict[str, Any]] = []
    for i, item in enumerate(choices):
        choice = as_dict(item)
        if choice is None:
            raise MalformedSSEError(f"choices[{i}] is {short(item)}, not an object")
        for key in _TEXT_FIELDS:
            value = choice.get(key)
            if value is not None and not isinstance(value, str):
                raise MalformedSSEError(f"choices[{i}].{key} is {short(value)}, not a string")
        delta_raw = choice.get("delta")
        if delta_raw is not None:
            delta = as_dict(delta_raw)
            if delta is None:
                raise MalformedSSEError(f"choices[{i}].delta is {short(delta_raw)}, not an object")
            for key in _DELTA_TEXT_FIELDS:
                value = delta.get(key)
                if value is not None and not isinstance(value, str):
                    raise MalformedSSEError(f"choices[{i}].delta.{key} is {short(value)}, not a string")
        checked.append(choice)
    return checked


def short(value: object) -> str:
    """`value` as JSON-ish text of at most 60 characters, for messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def usage_count(usage: dict[str, Any], key: str) -> int | None:
    """`usage[key]` checked: None when absent or null; raises InvalidUsageError unless an int >= 0."""
    value = usage.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidUsageError(f"usage.{key} is {value!r}, not a non-negative integer")
    return value
