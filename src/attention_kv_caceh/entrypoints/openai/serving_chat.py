"""OpenAIServingChat: `POST /v1/chat/completions`, from the messages to the admitted choices.

Corresponds to vLLM's `vllm/entrypoints/openai/serving_chat.py` (OpenAIServingChat.create_chat_completion),
small: the body is checked before any tokenizing, the conversation is rendered with the chat template
(entrypoints/chat_utils.py) and tokenized in a worker thread, without the tokenizer's special tokens (the
template writes them, a BOS included, as vLLM's chat path does), and its ids are cut at `max_model_len`
while it is counted whole. The base class (serving_engine.py) admits and answers the choices; a stream
opens with a role-only chunk per choice (serving_response.py). max_tokens defaults to the rest of the
context.

Structured outputs (`response_format`, `structured_outputs`) are compiled before admission
(structured_outputs.py) and tools planned (tool_calls.py: `required` and a named function become a
grammar, `auto` needs `--enable-auto-tool-choice --tool-call-parser`). Left out: reasoning parsers,
a request-level `chat_template` (refused by protocol.py), multimodal content parts, `chat_template_kwargs`, `continue_final_message`,
and `echo` (refused for chat).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from attention_kv_caceh.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from attention_kv_caceh.entrypoints.openai.serving import HTTPError, prompt_too_long
from attention_kv_caceh.entrypoints.openai.serving_engine import OpenAIServing
from attention_kv_caceh.entrypoints.openai.tool_calls import plan_tools
from attention_kv_caceh.entrypoints.openai.tool_parsers import TOOL_PARSERS

__all__ = ["OpenAIServingChat"]


class OpenAIServingChat(OpenAIServing):
    """`POST /v1/chat/completions` over the base class's engine, tokenizer, chat template and limits."""

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """The chat completion of `body`, streamed or whole. Raises HTTPError (4xx, 503) as the checks do."""
        self.check_generation(body, 1)
        tools = plan_tools(body, self.enable_auto_tool_choice, self.tool_call_parser)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if tools is not None and tools.structured_outputs is not None:  # required / named: a grammar
            structured = tools.structured_outputs
            await asyncio.to_thread(self.structured_outputs.check, structured, "tools")
        else:
            structured = await asyncio.to_thread(self.structured_outputs.params_for, body)
        prompt_ids, num_prompt_tokens = await asyncio.to_thread(
            self.chat_prompt,
            body.messages,
            body.add_generation_prompt,
            self.max_model_len,
            None if tools is None else tools.tools,
        )
        choices = self.admit(response_id, [(prompt_ids, "", num_prompt_tokens)], body, None, structured)
        return await self.respond(
            raw, response_id, choices, body, tools if tools and tools.mode != "none" else None
        )

    def configure_tools(self, enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
        """vLLM's `--enable-auto-tool-choice` and `--tool-call-parser`. Raises ValueError for a parser
        name that is not one of tool_parsers.TOOL_PARSERS, or auto tool choice without a parser."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {tool_call_parser!r}"
            )
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        max_length: int | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], int]:
        """The rendered conversation's token ids (cut at `max_length`) and its exact token count. Raises
        HTTPError 400 naming `messages` when the template fails, and for a conversation too long to count
        whole."""
        try:
            # the template writes the special tokens itself (a BOS included), as vLLM's chat path does
            ids, count, exact = self.tokenizer.encode_counted(
                self.render_chat(messages, add_generation_prompt, tools),
                add_special_tokens=False,
                max_length=max_length,
            )
        except ValueError as exc:
            raise HTTPError(400, str(exc), "messages") from exc
        if not exact:
            raise prompt_too_long(self.max_model_len, count, exact)
        return ids, count
