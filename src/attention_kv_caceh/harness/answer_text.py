"""The generated text of one streamed answer, for workloads whose next request repeats it (multi-turn).

A second reader of the same bytes the timing decoder sees, built on the one SSE parser (`sse.SSEParser`):
it joins `choices[0].text` (completions) or `choices[0].delta.content` (chat) of every event. It never
judges the stream (the timing decoder does); whatever it cannot read adds no text. Only requests whose
answer is needed pay for it.
"""

from __future__ import annotations

import json
from typing import Any, cast

from attention_kv_caceh.harness.sse import MAX_EVENT_BYTES, MalformedSSEError, SSEParser

__all__ = ["AnswerText"]


class AnswerText:
    """Feed the raw stream bytes; `text` is the answer so far."""

    def __init__(self) -> None:
        self._parser = SSEParser(MAX_EVENT_BYTES)
        self._parts: list[str] = []
        self.broken = False

    def feed(self, chunk: bytes) -> None:
        """Add the text of every event `chunk` completes (a stream it cannot parse adds nothing more)."""
        if self.broken:
            return
        try:
            events = self._parser.feed(chunk)
        except (UnicodeDecodeError, MalformedSSEError):
            self.broken = True
            return
        for event in events:
            try:
                obj: object = json.loads(event.data)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                self._parts.append(_choice_text(cast("dict[str, Any]", obj)))

    @property
    def text(self) -> str:
        return "".join(self._parts)


def _choice_text(obj: dict[str, Any]) -> str:
    choices: object = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return ""
    choice: object = cast("list[Any]", choices)[0]
    if not isinstance(choice, dict):
        return ""
    body = cast("dict[str, Any]", choice)
    text: object = body.get("text")
    if isinstance(text, str):
        return text
    delta: object = body.get("delta")
    if isinstance(delta, dict):
        content: object = cast("dict[str, Any]", delta).get("content")
        if isinstance(content, str):
            return content
    return ""
