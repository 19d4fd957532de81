"""The one Server-Sent Events parser, and the one decoder of OpenAI-style token streams.

Both OpenAI endpoints (`/v1/completions` and `/v1/chat/completions`) stream `data: {json}` events ended
by `data: [DONE]`; they differ only in where the text sits (`choices[0].text` or
`choices[0].delta.content`). `SSEParser` follows the WHATWG event-stream rules (lines end in LF, CRLF or
CR; `:` starts a comment; several `data:` lines join with LF; a blank line dispatches). The decoder
decides what is a token-bearing event, the point common tools get wrong:

- a chat stream's opening chunk that carries only the role is not a token;
- a trailing usage-only chunk (`choices: []`) is not a token (and so never moves the finish time);
- a chunk carrying several tokens counts as that many: by the change in `usage.completion_tokens` where
  the server sends continuous usage (vLLM's `stream_options.continuous_usage_stats`), else by the
  chunk's `logprobs` token list, else one per content-bearing chunk; `output_tokens_source` records
  which.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, cast

__all__ = [
    "MalformedSSEError",
    "OpenAIStreamDecoder",
    "SSEEvent",
    "SSEParser",
    "StreamErrorEvent",
]

_LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: its `event:` type ("message" by default) and joined `data:` lines."""

    data: str
    event: str = "message"


class SSEParser:
    """Incremental event-stream parser: feed bytes as they arrive, get the completed events."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[str] = []
        self._event_type = ""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse `chunk` (any split of the byte stream); return the events it completed, in order.

        Raises UnicodeDecodeError for a line that is not UTF-8.
        """
        self._buffer += chunk
        events: list[SSEEvent] = []
        start = 0
        for match in _LINE_END.finditer(self._buffer):
            # A CR at the very end may be the first half of a CRLF split across reads: wait for more.
            if match.group() == b"\r" and match.end() == len(self._buffer):
                break
            line = self._buffer[start : match.start()].decode("utf-8")
            start = match.end()
            event = self._line(line)
            if event is not None:
                events.append(event)
        self._buffer = self._buffer[start:]
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            if not self._data_lines:
                self._event_type = ""
                return None
            event = SSEEvent(data="\n".join(self._data_lines), event=self._event_type or "message")
            self._data_lines = []
            self._event_type = ""
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data_lines.append(value)
        elif name == "event":
            self._event_type = value
        # `id`, `retry` and unknown fields are ignored, as the standard says.
        return None

    @property
    def pending(self) -> bool:
        """True when bytes or data lines of an undispatched event are buffered (a cut stream)."""
        return bool(self._buffer.strip()) or bool(self._data_lines)


class StreamErrorEvent(Exception):
    """The server sent an error inside the stream (an `error` object or an `event: error`)."""


class MalformedSSEError(Exception):
    """A `data:` payload that is neither `[DONE]` nor a JSON object."""


def _as_dict(value: object) -> dict[str, Any] | None:
    return cast("dict[str, Any]", value) if isinstance(value, dict) else None


def _as_list(value: object) -> list[Any] | None:
    return cast("list[Any]", value) if isinstance(value, list) else None


def _choice_text(choice: dict[str, Any]) -> str:
    text = choice.get("text")
    if isinstance(text, str) and text:
        return text
    delta = _as_dict(choice.get("delta")) or {}
    for key in ("content", "reasoning_content", "reasoning"):
        value = delta.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


def _logprob_tokens(choice: dict[str, Any]) -> int | None:
    logprobs = _as_dict(choice.get("logprobs"))
    if logprobs is None:
        return None
    tokens = _as_list(logprobs.get("tokens"))  # completions
    if tokens is None:
        tokens = _as_list(logprobs.get("content"))  # chat
    return len(tokens) if tokens else None


class OpenAIStreamDecoder:
    """Turn the bytes of one OpenAI-style stream into token counts per token-bearing event.

    `feed` returns, for each token-bearing event completed by the bytes, its number of tokens. After the
    stream: `done` (saw `[DONE]`), `failure` (the error that stopped decoding), `output_tokens` and `output_tokens_source`, `prompt_tokens` (from
    usage, else None).
    """

    def __init__(self) -> None:
        self._parser = SSEParser()
        self.done = False
        self.failure: StreamErrorEvent | MalformedSSEError | None = None
        self.prompt_tokens: int | None = None
        self._usage_completion: int | None = None
        self._counted = 0
        self._count_source = "chunks"

    def feed(self, chunk: bytes) -> list[int]:
        """Parse `chunk`; return the token count of each token-bearing event it completed.

        An error event (StreamErrorEvent) or a `data:` payload that is not a JSON object or not UTF-8
        (MalformedSSEError) stops decoding: the counts of the events before it are still returned, and
        the exception is left in `failure` for the caller to raise. Data after `[DONE]` is ignored.
        """
        if self.failure is not None or self.done:
            return []
        counts: list[int] = []
        try:
            for event in self._parser.feed(chunk):
                count = self._event(event)
                if count is not None:
                    counts.append(count)
                if self.done:
                    break
        except UnicodeDecodeError as exc:
            self.failure = MalformedSSEError(f"stream is not UTF-8: {exc}")
        except (StreamErrorEvent, MalformedSSEError) as exc:
            self.failure = exc
        return counts

    def _event(self, event: SSEEvent) -> int | None:
        if event.event == "error":
            raise StreamErrorEvent(event.data[:500])
        data = event.data.strip()
        if data == "[DONE]":
            self.done = True
            return None
        try:
            obj = _as_dict(json.loads(data))
        except json.JSONDecodeError:
            obj = None
        if obj is None:
            raise MalformedSSEError(f"data line is not a JSON object: {data[:200]!r}")
        error = obj.get("error")
        if error is not None or obj.get("object") == "error":
            detail = _as_dict(error)
            message = detail.get("message") if detail is not None else error
            raise StreamErrorEvent(str(message or obj.get("message") or data[:500]))
        usage_delta = self._usage(obj)
        choices = _as_list(obj.get("choices")) or []
        choice = _as_dict(choices[0]) if choices else None
        if choice is None:
            return None  # usage-only (or empty) chunk: not a token
        text = _choice_text(choice)
        if usage_delta is not None and usage_delta > 0:
            self._count_source = "usage"
            count = usage_delta
        elif text:
            logprob_count = _logprob_tokens(choice)
            if logprob_count is not None:
                self._count_source = "logprobs"
            count = logprob_count or 1
        else:
            return None  # role-only or empty delta: not a token
        self._counted += count
        return count

    def _usage(self, obj: dict[str, Any]) -> int | None:
        """Update usage from a chunk; return the change in completion tokens, None without usage."""
        usage = _as_dict(obj.get("usage"))
        if usage is None:
            return None
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        completion = usage.get("completion_tokens")
        if not isinstance(completion, int):
            return None
        previous = self._usage_completion or 0
        self._usage_completion = completion
        return completion - previous

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage count when it gave one, else the counted tokens."""
        return self._usage_completion if self._usage_completion is not None else self._counted

    @property
    def output_tokens_source(self) -> str:
        """How `output_tokens` was obtained: "usage", "logprobs" or "chunks"."""
        return "usage" if self._usage_completion is not None else self._count_source

    @property
    def truncated(self) -> bool:
        """True when bytes of an unfinished event are left over."""
        return self._parser.pending
