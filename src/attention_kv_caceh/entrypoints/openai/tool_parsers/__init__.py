"""Tool-call parsers: the model's tool-call text as OpenAI's `tool_calls`, chosen by `--tool-call-parser`.

Corresponds to vLLM's `vllm/entrypoints/openai/tool_parsers/__init__.py` (ToolParserManager: parsers by
name) and `abstract_tool_parser.py` (extract_tool_calls, extract_tool_calls_streaming). Left out: every
parser but `hermes` (Hermes 2 Pro, Qwen2.5, SmolLM2-style `<tool_call>{json}</tool_call>`), plugin
parsers loaded from a file, and the token-id form of the streaming interface (text deltas here).
"""

from __future__ import annotations

from .hermes_tool_parser import Hermes2ProToolParser, ToolCallDeltas, make_tool_call_id

__all__ = ["TOOL_PARSERS", "Hermes2ProToolParser", "ToolCallDeltas", "make_tool_call_id"]

# --tool-call-parser NAME -> the parser class (vLLM's registered names)
TOOL_PARSERS: dict[str, type[Hermes2ProToolParser]] = {"hermes": Hermes2ProToolParser}
