"""`tools` and `tool_choice` of a chat request: the grammar that enforces a call, and the calls read back.

Corresponds to vLLM's `ChatCompletionRequest._get_json_schema_from_tool` (`vllm/entrypoints/openai/
protocol.py`) and the tool branches of `OpenAIServingChat` (`serving_chat.py`: named and required
choices constrained by a JSON schema, `auto` parsed by the `--tool-call-parser`, the checks of
`--enable-auto-tool-choice`). Left out: `tool_choice` with tools excluded from the template
(`--exclude-tools-when-tool-choice-none`), reasoning parsers, and the streaming of a `required` array's
arguments piece by piece (each call is sent whole when the array is complete).

As vLLM does:
- named function: the output is the function's arguments, constrained by its `parameters` schema;
- `required`: the output is a JSON array of `{"name": <one of the tools>, "parameters": <its schema>}`
  (at least one item; one exactly with `parallel_tool_calls: false`);
- `auto` (the default when tools are given): unconstrained; the parser finds the calls in the text
  (needs `--enable-auto-tool-choice --tool-call-parser NAME`, else a 400);
- `none`: the tools reach the template, the output is plain content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast

from attention_kv_caceh.engine.structured_output.params import StructuredOutputsParams
from attention_kv_caceh.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from attention_kv_caceh.entrypoints.openai.serving import HTTPError
from attention_kv_caceh.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    Hermes2ProToolParser,
    ToolCallDeltas,
    make_tool_call_id,
)

__all__ = ["ToolCallStream", "ToolsPlan", "plan_tools"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(function: Any) -> dict[str, Any]:
    params: dict[str, Any] | None = function.parameters
    return params if params else {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolsPlan:
    """What a chat request's tools ask for.

    Attributes:
        mode: "none", "auto", "required" or "named".
        tools: the `tools` as dicts for the chat template (`apply_chat_template(tools=...)`).
        structured_outputs: the constraint of "required" / "named", else None.
        function_name: the named function ("named" only).
        parser_name: the `--tool-call-parser` of "auto".
        parallel_tool_calls: the request's flag.
    """

    mode: str
    tools: list[dict[str, Any]] = field(default_factory=list[dict[str, Any]])
    structured_outputs: StructuredOutputsParams | None = None
    function_name: str = ""
    parser_name: str | None = None
    parallel_tool_calls: bool = True

    def new_stream(self) -> ToolCallStream:
        """A parser for one choice's output."""
        return ToolCallStream(self)


def plan_tools(
    body: ChatCompletionRequest, enable_auto_tool_choice: bool, tool_call_parser: str | None
) -> ToolsPlan | None:
    """The ToolsPlan of `body` (None without tools and tool_choice).

    Raises HTTPError(400) naming the field: tool_choice without tools, a named function not in tools,
    `auto` without --enable-auto-tool-choice and --tool-call-parser (vLLM's message), tool_choice
    required / named together with response_format or structured_outputs."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise HTTPError(400, "tool_choice is set but no tools are given", "tool_choice")
        return None
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolsPlan("none", rendered)
    if choice == "auto":
        if not enable_auto_tool_choice or tool_call_parser is None:
            raise HTTPError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        return ToolsPlan(
            "auto", rendered, parser_name=tool_call_parser, parallel_tool_calls=body.parallel_tool_calls
        )
    if body.structured_outputs is not None or (
        body.response_format is not None and body.response_format.type != "text"
    ):
        raise HTTPError(
            400, "tool_choice required or named cannot be combined with a response format", "tool_choice"
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        match = next((t for t in tools if t.function.name == name), None)
        if match is None:
            raise HTTPError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        so = StructuredOutputsParams(json=json.dumps(_parameters(match.function)))
        return ToolsPlan("named", rendered, so, function_name=name)
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t.function),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return ToolsPlan(
        "required",
        rendered,
        StructuredOutputsParams(json=json.dumps(schema)),
        parallel_tool_calls=body.parallel_tool_calls,
    )


class ToolCallStream:
    """One choice's output read as tool calls under a ToolsPlan (`whole` for a whole text, `feed` while it
    streams)."""

    def __init__(self, plan: ToolsPlan) -> None:
        self.plan = plan
        self._parser: Hermes2ProToolParser | None = None
        if plan.mode == "auto" and plan.parser_name is not None:
            self._parser = TOOL_PARSERS[plan.parser_name](plan.parallel_tool_calls)
        self._text = ""
        self._named_id = ""
        self.num_calls = 0

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole output."""
        mode = self.plan.mode
        if mode == "named":
            call = {"id": make_tool_call_id(), "type": "function"}
            return None, [{**call, "function": {"name": self.plan.function_name, "arguments": text}}]
        if mode == "required":
            calls = self._required_calls(text)
            # cut by max_tokens, no call is whole: the partial text is the content, never dropped
            return (text, []) if calls is None else (None, calls)
        if self._parser is not None:
            return self._parser.extract_tool_calls(text)
        return text, []

    def _required_calls(self, text: str) -> list[dict[str, Any]] | None:
        """The calls of a whole `required` array; None when the text is no whole JSON value (cut by
        max_tokens)."""
        try:
            items: Any = json.loads(text)
        except json.JSONDecodeError:
            return None
        calls: list[dict[str, Any]] = []
        for item in cast(list[Any], items) if isinstance(items, list) else []:
            if isinstance(item, dict):
                obj: dict[str, Any] = item  # pyright: ignore[reportUnknownVariableType]
                arguments = json.dumps(obj.get("parameters", _ANY_OBJECT), ensure_ascii=False)
                calls.append(
                    {
                        "id": make_tool_call_id(),
                        "type": "function",
                        "function": {"name": str(obj.get("name", "")), "arguments": arguments},
                    }
                )
        return calls

    def feed(self, delta_text: str, final: bool) -> ToolCallDeltas:
        """The chat deltas for the next piece of the output (`final`: it is the last)."""
        mode = self.plan.mode
        if mode == "named":
            out: ToolCallDeltas = []
            if not self._named_id:
                self._named_id = make_tool_call_id()
                self.num_calls = 1
                header = {"name": self.plan.function_name, "arguments": ""}
                out.append(
                    {
                        "tool_calls": [
                            {"index": 0, "id": self._named_id, "type": "function", "function": header}
                        ]
                    }
                )
            if delta_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]})
            return out
        if mode == "required":
            self._text += delta_text
            if not final:
                return []
            calls = self._required_calls(self._text)
            if calls is None:  # cut by max_tokens: the partial text as content, as whole() gives it
                return [{"content": self._text}] if self._text else []
            self.num_calls = len(calls)
            return [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)]
        if self._parser is not None:
            deltas = self._parser.feed(delta_text, final)
            self.num_calls = self._parser.num_calls
            return deltas
        return [{"content": delta_text}] if delta_text else []
