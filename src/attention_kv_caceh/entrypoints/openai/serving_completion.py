"""OpenAIServingCompletion: `POST /v1/completions`, from the body to the admitted choices.

Corresponds to vLLM's `vllm/entrypoints/openai/serving_completion.py` (OpenAIServingCompletion.
create_completion), small: the body is checked (OpenAIServing.check_generation) before any tokenizing,
each of vLLM's four prompt forms becomes token ids in a worker thread (the tokenizer releases the GIL,
so the other streams go on), and the choices are admitted and answered by the base class
(serving_engine.py); the stream and the whole response are written by serving_response.py. A text
prompt is counted whole (its 400 gives its exact length) but its ids are cut at `max_model_len`, which
keeps the list built with the GIL held bounded by the context, whatever the body's size. max_tokens
defaults to 16, OpenAI's and vLLM's default for this endpoint.

`response_format` and `structured_outputs` are compiled first (structured_outputs.py: a 400 when they
cannot be). Left out: `suffix`, `best_of` and `tools` (refused), beam search, prompt embeddings, LoRA model
names, and vLLM's `prompt_logprobs` field (echo with logprobs gives the prompt's logprobs).
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from fastapi.responses import Response

from attention_kv_caceh.entrypoints.openai.protocol import CompletionRequest, Prompt
from attention_kv_caceh.entrypoints.openai.serving import HTTPError, prompt_too_long
from attention_kv_caceh.entrypoints.openai.serving_engine import OpenAIServing, PromptTokens

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "OpenAIServingCompletion"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


class OpenAIServingCompletion(OpenAIServing):
    """`POST /v1/completions` over the base class's engine, tokenizer and limits."""

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        """The completion of `body`, streamed or whole. Raises HTTPError (4xx, 503) as the checks do."""
        self.check_generation(body, _num_prompts(body.prompt))  # before any tokenizing
        _check_no_empty_text(body.prompt)
        if body.model_extra and ({"tools", "tool_choice"} & set(body.model_extra)):
            raise HTTPError(400, "tools are served by /v1/chat/completions only", "tools")
        response_id = f"cmpl-{uuid.uuid4().hex}"
        structured = await asyncio.to_thread(self.structured_outputs.params_for, body)
        prompts = await asyncio.to_thread(
            self.completion_prompts, body.prompt, with_text=body.echo, max_length=self.max_model_len
        )
        choices = self.admit(response_id, prompts, body, COMPLETIONS_DEFAULT_MAX_TOKENS, structured)
        return await self.respond(raw, response_id, choices, body)

    def completion_prompts(
        self,
        prompt: Prompt,
        add_special_tokens: bool = True,
        with_text: bool = False,
        max_length: int | None = None,
    ) -> list[PromptTokens]:
        """(token ids, text, exact token count) of each prompt; the text of token ids is decoded only when
        `with_text`; a text prompt is counted whole but its ids are cut at `max_length`. Raises HTTPError
        400 for a text too long to count whole and for token ids outside the vocabulary."""
        out: list[PromptTokens] = []
        tokenizer = self.tokenizer
        for item in self.prompt_list(prompt):
            if isinstance(item, str):
                ids, count, exact = tokenizer.encode_counted(item, add_special_tokens, max_length)
                if not exact:
                    raise prompt_too_long(self.max_model_len, count, exact)
                out.append((ids, item, count))
            else:
                ids = self.check_ids(item, "prompt")
                out.append((ids, tokenizer.decode(ids) if with_text else "", len(ids)))
        return out


def _check_no_empty_text(prompt: Prompt) -> None:
    """A generation request's text prompt must not be empty (HTTPError 400 naming `prompt`), as vLLM
    refuses `"prompt": ""`; its tokenizer's BOS alone would otherwise be served as a prompt."""
    texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
    if any(not text for text in texts):
        raise HTTPError(
            400, "the prompt is empty" if isinstance(prompt, str) else "a prompt is empty", "prompt"
        )


def _num_prompts(prompt: Prompt) -> int:
    """How many prompts `prompt` holds in vLLM's four forms (an empty list counts 1: it is refused later)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)
