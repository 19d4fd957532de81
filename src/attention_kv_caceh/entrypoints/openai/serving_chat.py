"""OpenAIServingChat: `POST /v1/chat/completions`, from the messages to the admitted choices.

Corresponds to vLLM's `vllm/entrypoints/openai/serving_chat.py` (OpenAIServingChat.create_chat_completion),
small: the body is checked before any tokenizing, the conversation is rendered with the chat template
(entrypoints/chat_utils.py) and tokenized in a worker thread, without the tokenizer's special tokens (the
template writes them, a BOS included, as vLLM's chat path does), and its ids are cut at `max_model_len`
while it is counted whole. The base class (serving_engine.py) admits and answers the choices; a stream
opens with a role-only chunk per choice (serving_response.py). max_tokens defaults to the rest of the
context.

Left out: tools and tool calls, reasoning parsers, `response_format` and a request-level `chat_template`
(both refused by protocol.py), multimodal content parts, `chat_template_kwargs`, `continue_final_message`,
and `echo` (refused for chat).
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from fastapi.responses import Response

from attention_kv_caceh.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from attention_kv_caceh.entrypoints.openai.serving import HTTPError, prompt_too_long
from attention_kv_caceh.entrypoints.openai.serving_engine import OpenAIServing

__all__ = ["OpenAIServingChat"]


class OpenAIServingChat(OpenAIServing):
    """`POST /v1/chat/completions` over the base class's engine, tokenizer, chat template and limits."""

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """The chat completion of `body`, streamed or whole. Raises HTTPError (4xx, 503) as the checks do."""
        self.check_generation(body, 1)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt_ids, num_prompt_tokens = await asyncio.to_thread(
            self.chat_prompt, body.messages, body.add_generation_prompt, self.max_model_len
        )
        choices = self.admit(response_id, [(prompt_ids, "", num_prompt_tokens)], body, None)
        return await self.respond(raw, response_id, choices, body)

    def chat_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool, max_length: int | None = None
    ) -> tuple[list[int], int]:
        """The rendered conversation's token ids (cut at `max_length`) and its exact token count. Raises
        HTTPError 400 naming `messages` when the template fails, and for a conversation too long to count
        whole."""
        try:
            # the template writes the special tokens itself (a BOS included), as vLLM's chat path does
            ids, count, exact = self.tokenizer.encode_counted(
                self.render_chat(messages, add_generation_prompt),
                add_special_tokens=False,
                max_length=max_length,
            )
        except ValueError as exc:
            raise HTTPError(400, str(exc), "messages") from exc
        if not exact:
            raise prompt_too_long(self.max_model_len, count, exact)
        return ids, count
