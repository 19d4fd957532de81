"""The hermes tool parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the output.

Corresponds to vLLM's `vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py` (Hermes2ProToolParser):
the text before the first `<tool_call>` is the message's content, each block a tool call. Left out:
vLLM's partial-JSON parsing of the arguments while they stream (here the arguments' own text is sent as it
comes, holding back what may still be the object's closing brace or the end tag, so the fragments
concatenate to exactly the arguments' text) and the scratch-pad tags of some Hermes templates.

Streaming deltas follow OpenAI's shape: a call's first delta carries `index`, `id`, `type` and
`function.name` (with empty `arguments`), the later ones `index` and an `arguments` fragment.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

__all__ = ["Hermes2ProToolParser", "ToolCallDeltas", "make_tool_call_id"]

ToolCallDeltas = list[dict[str, Any]]  # chat delta objects: {"content": ...} or {"tool_calls": [...]}

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
# the arguments' key, found once the value's first character has come (a space streamed after the colon is
# not the value's)
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(?=\S)')


def make_tool_call_id() -> str:
    """A fresh tool call id (vLLM's `chatcmpl-tool-<hex>` form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": make_tool_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


class Hermes2ProToolParser:
    """Parses one choice's output; `extract_tool_calls` for a whole text, `feed` while it streams.

    Args:
        parallel_tool_calls: False keeps only the first call.
    """

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        self.parallel_tool_calls = parallel_tool_calls
        self._text = ""
        self._pos = 0  # the text before it is handled
        self._in_call = False
        self._index = -1  # the current call's index
        self._header_sent = False
        self._args_start: int | None = None
        self._args_sent = 0
        self.num_calls = 0

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole output; a block that is not a JSON object with a string
        `name` leaves the whole text as content (as vLLM does)."""
        blocks = _BLOCK.findall(text)
        if not blocks:
            return text, []
        calls: list[dict[str, Any]] = []
        for block in blocks:
            try:
                obj: Any = json.loads(block)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            spec: dict[str, Any] = obj  # pyright: ignore[reportUnknownVariableType]
            calls.append(_call(spec["name"], spec.get("arguments", spec.get("parameters", {}))))
        if not self.parallel_tool_calls:
            calls = calls[:1]
        content = text[: text.index(TOOL_CALL_START)]
        return (content if content.strip() else None), calls

    def feed(self, delta_text: str, final: bool = False) -> ToolCallDeltas:
        """The chat deltas that `delta_text` (the next piece of the output) completes; `final` flushes."""
        self._text += delta_text
        out: ToolCallDeltas = []
        while True:
            before = (self._pos, self._in_call)
            if self._in_call:
                self._step_call(out, final)
            else:
                self._step_text(out, final)
            if (self._pos, self._in_call) == before:
                return out

    def _step_text(self, out: ToolCallDeltas, final: bool) -> None:
        text = self._text
        start = text.find(TOOL_CALL_START, self._pos)
        end = start if start >= 0 else len(text) if final else len(text) - _held_prefix(text, TOOL_CALL_START)
        if end > self._pos and self._index < 0:  # content only before the first call
            out.append({"content": text[self._pos : end]})
        self._pos = end
        if start >= 0:
            self._pos = start + len(TOOL_CALL_START)
            self._in_call = True
            self._index += 1
            self._header_sent = False
            self._args_start = None
            self._args_sent = 0

    def _keep(self) -> bool:
        return self.parallel_tool_calls or self._index == 0

    def _step_call(self, out: ToolCallDeltas, final: bool) -> None:
        text, start = self._text, self._pos
        close = text.find(TOOL_CALL_END, start)
        body = text[start:] if close < 0 else text[start:close]
        name = _NAME.search(body)
        if name is not None and not self._header_sent and self._keep():
            header = _call(json.loads(f'"{name.group(1)}"'), "")
            out.append({"tool_calls": [{"index": self._index, **header}]})
            self._header_sent = True
            self.num_calls += 1
        if self._args_start is None:
            args = _ARGUMENTS.search(body)
            if args is not None:
                self._args_start = args.end()
                self._args_sent = self._args_start
        if close < 0:
            if self._header_sent and self._args_start is not None:
                safe = len(body) - _held_prefix(body, TOOL_CALL_END)
                safe = len(body[:safe].rstrip().rstrip("}").rstrip())
                self._emit_args(out, body, safe)
            if final:
                self._pos = len(text)
                self._in_call = False
            return
        if self._header_sent and self._args_start is not None:
            trimmed = body.rstrip()
            end = len(trimmed) - 1 if trimmed.endswith("}") else len(trimmed)  # the object's own brace
            self._emit_args(out, body, len(body[:end].rstrip()))
        self._pos = close + len(TOOL_CALL_END)
        self._in_call = False

    def _emit_args(self, out: ToolCallDeltas, body: str, end: int) -> None:
        if end > self._args_sent:
            fragment = body[self._args_sent : end]
            self._args_sent = end
            out.append({"tool_calls": [{"index": self._index, "function": {"arguments": fragment}}]})
