"""OpenAIServing: the state and checks the OpenAI endpoints share, and the admission of a request's choices.

Corresponds to vLLM's `vllm/entrypoints/openai/serving_engine.py` (OpenAIServing: the base class of
OpenAIServingCompletion, OpenAIServingChat and OpenAIServingTokenization), small. It holds the AsyncLLM,
the tokenizer, the served model name, the chat template and the server's limits, and it does what every
endpoint needs: refuse an unknown model (404), log the fields it ignores (one warning naming them, as
vLLM does), check token ids against the vocabulary, read vLLM's four prompt forms, admit the choices of
a generation request (every choice checked before any is added: its SamplingParams, the KV cache, the
queue), and answer them streamed or whole. The subclasses add one endpoint family each
(serving_completion.py, serving_chat.py, serving_tokenization.py).

Left out: vLLM's request logger, LoRA and prompt-adapter model names (`OpenAIServingModels`), multimodal
and embedding prompts, `truncate_prompt_tokens`, and the tracing headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from attention_kv_caceh.engine.async_llm import AsyncLLM, TokenizerLike
from attention_kv_caceh.engine.core_client import EngineDeadError
from attention_kv_caceh.engine.kv_cache_manager import RequestTooLargeError
from attention_kv_caceh.engine.output_processor import EngineDrainingError
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.structured_output.params import StructuredOutputsParams
from attention_kv_caceh.entrypoints.chat_utils import ChatTemplate
from attention_kv_caceh.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    Prompt,
    TokenizeRequest,
)
from attention_kv_caceh.entrypoints.openai.serving import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_SEQS_PER_REQUEST,
    HTTPError,
    check_fan_out,
    check_request_fields,
    sampling_params_for,
)
from attention_kv_caceh.entrypoints.openai.serving_response import (
    Choice,
    close_all,
    stream_events,
    whole_response,
)
from attention_kv_caceh.entrypoints.openai.structured_outputs import StructuredOutputsValidator
from attention_kv_caceh.entrypoints.openai.tool_calls import ToolsPlan

__all__ = ["OpenAIServing", "PromptTokens"]

# the server's one logger (api_server.py's): "ignored fields" warnings and failed requests are found under it
logger = logging.getLogger("attention_kv_caceh.entrypoints.openai.api_server")

PromptTokens = tuple[list[int], str, int]
"""One prompt of a request: its token ids (cut at max_model_len), its text ("" when not needed), and its
exact token count (the 400 of a prompt past the context gives it)."""


class OpenAIServing:
    """What the endpoints share: the engine, the tokenizer, the model's name and the server's limits.

    `chat_template` None uses chat_utils' PLAIN_CHAT_TEMPLATE. `max_queue` (None: no bound) refuses with
    503 a request that would make more than that many requests wait beyond the engine's `max_num_seqs`.
    `max_logprobs` caps `logprobs` / `top_logprobs`; a prompt and max_tokens that could never fit the
    KV pool the engine core reported are refused up front; `max_seqs_per_request`
    caps the engine requests one request fans out to. The arguments are checked by `build_app`.
    """

    def __init__(
        self,
        async_llm: AsyncLLM,
        tokenizer: TokenizerLike,
        served_model_name: str,
        max_model_len: int,
        *,
        chat_template: ChatTemplate | None = None,
        max_queue: int | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST,
    ) -> None:
        self.async_llm = async_llm
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.chat_template = chat_template if chat_template is not None else ChatTemplate()
        self.max_queue = max_queue
        self.max_logprobs = max_logprobs
        self.max_seqs_per_request = max_seqs_per_request
        self.created = int(time.time())
        # a `tokenizers` tokenizer (engine/tokenizer.py) is what llguidance reads
        backend_json: Any = getattr(tokenizer, "backend_json", None)
        eos: Any = getattr(tokenizer, "eos_token_id", None)
        self.structured_outputs = StructuredOutputsValidator(
            str(backend_json()) if callable(backend_json) else None,
            (int(eos),) if isinstance(eos, int) else (),
        )

    def show_models(self) -> dict[str, Any]:
        """GET /v1/models: the one served model's card (vLLM's OpenAIServingModels.show_available_models)."""
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "attention-kv-caceh",
            "root": self.served_model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    # -- checks every endpoint makes -------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """HTTPError 404 naming `model` unless it is None or the served model's name."""
        if model is not None and model != self.served_model_name:
            raise HTTPError(404, f"The model `{model}` does not exist.", "model")

    @staticmethod
    def warn_ignored(
        body: CompletionRequest | ChatCompletionRequest | TokenizeRequest | DetokenizeRequest,
    ) -> None:
        """Log one warning naming the body's unknown fields (none: nothing), as vLLM does."""
        ignored = body.ignored_fields
        if ignored:  # as vLLM does: one line naming them, and the request is served
            logger.warning("The following fields were present in the request but ignored: %s", ignored)

    def check_generation(self, body: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> None:
        """The checks of a generation request before any tokenizing: its model, its ignored fields, the
        fields that do not depend on the prompt, and its fan-out (`num_prompts` times `n`)."""
        self.check_model(body.model)
        self.warn_ignored(body)
        check_request_fields(body, self.max_logprobs)
        check_fan_out(num_prompts, body.n, self.max_seqs_per_request)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        """`ids` itself when every id is in [0, vocab_size), else HTTPError 400 naming `param`."""
        # an id the model has no embedding row for would fail the whole engine step, not just this request
        vocab_size = self.tokenizer.vocab_size
        for t in ids:
            if not 0 <= t < vocab_size:
                raise HTTPError(400, f"{param} token ids must be in [0, {vocab_size}), got {t}", param)
        return ids  # the validated request's own list: a copy of millions of ids would cost as much again

    @staticmethod
    def prompt_list(prompt: Prompt) -> list[str | list[int]]:
        """vLLM's four prompt forms as a list of prompts (a text or token ids each); an empty list is
        HTTPError 400 naming `prompt`."""
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise HTTPError(400, "the prompt is empty", "prompt")
        first = prompt[0]
        if isinstance(first, int):
            return [cast("list[int]", prompt)]  # one form per list (protocol.py validated it)
        out: list[str | list[int]] = []
        for item in prompt:
            if isinstance(item, (str, list)):
                out.append(item)
        return out

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as the chat template writes it, with `tools` when given; an assistant
        message's tool calls reach the template with their arguments as objects (as vLLM passes them).
        Raises ValueError when the template fails."""
        rendered: list[dict[str, Any]] = []
        for m in messages:
            entry: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                entry["tool_calls"] = [_template_tool_call(c.model_dump()) for c in m.tool_calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                entry["name"] = m.name
            rendered.append(entry)
        return self.chat_template.render(rendered, add_generation_prompt, tools)

    def _check_kv_capacity(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """HTTPError 400 when a prompt of `num_prompt_tokens` and `params.max_tokens` could never fit the
        KV pool the engine core reported (`KVCacheConfig.check_request_fits`, the engine's one rule and
        message; `param` "prompt" when the prompt alone does not fit, else "max_tokens"). With no pool
        reported, the check is the engine's."""
        pool = self.async_llm.kv_cache_config
        if pool is None:
            return
        try:
            pool.check_request_fits(num_prompt_tokens, params.max_tokens)
        except RequestTooLargeError as exc:
            raise HTTPError(400, str(exc), exc.param) from None

    # -- a generation request's choices ----------------------------------------------------------------

    def admit(
        self,
        response_id: str,
        prompts: list[PromptTokens],
        body: CompletionRequest | ChatCompletionRequest,
        default_max_tokens: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> list[Choice]:
        """Validate every prompt first, then add them all (or none), each fanned out to `body.n` samples by
        AsyncLLM.add_parallel_request (one call per prompt); `default_max_tokens` is the endpoint's
        max_tokens when the body gives none (None: the rest of the context); `structured_outputs`: the
        compiled constraint every choice follows (`StructuredOutputsValidator.params_for`). Raises HTTPError 400 for a
        bad sampling field or a request the KV cache could never hold, 503 for a full queue, a draining
        server or a dead engine core."""
        echo = isinstance(body, CompletionRequest) and body.echo
        echo_only = echo and body.requested_max_tokens[1] == 0
        params: list[SamplingParams] = []
        for _ids, _text, num_prompt_tokens in prompts:
            params.append(
                sampling_params_for(
                    body,
                    num_prompt_tokens,
                    self.max_model_len,
                    default_max_tokens,
                    vocab_size=self.tokenizer.vocab_size,
                    structured_outputs=structured_outputs,
                )
            )
            self._check_kv_capacity(num_prompt_tokens, params[-1])
        self._check_queue(len(prompts) * body.n)
        choices: list[Choice] = []  # index = prompt_index * n + i, as vLLM numbers them
        try:
            for p, ((prompt_ids, text, _count), prompt_params) in enumerate(
                zip(prompts, params, strict=True)
            ):
                choices += self.async_llm.add_parallel_request(
                    response_id if len(prompts) == 1 else f"{response_id}-{p}",
                    prompt_ids,
                    prompt_params,
                    body.n,
                    first_index=len(choices),
                    make_child=functools.partial(Choice, echo_text=text if echo else "", echo_only=echo_only),
                )
        except EngineDrainingError as exc:
            close_all(choices)
            raise HTTPError(503, str(exc)) from exc
        except EngineDeadError as exc:
            close_all(choices)
            raise HTTPError(503, f"EngineDeadError: {exc}") from exc
        except BaseException:
            close_all(choices)  # the choices already added must not stay counted
            raise
        return choices

    def _check_queue(self, num_new: int) -> None:
        """HTTPError 503 when `num_new` more requests would make more than `max_queue` wait."""
        llm, max_queue = self.async_llm, self.max_queue
        if max_queue is not None and llm.num_unfinished + num_new > llm.max_num_seqs + max_queue:
            raise HTTPError(503, f"the server's queue is full ({max_queue} requests waiting); retry later")

    async def respond(
        self,
        raw: Request,
        response_id: str,
        choices: list[Choice],
        body: CompletionRequest | ChatCompletionRequest,
        tools: ToolsPlan | None = None,
    ) -> Response:
        """The choices as an SSE stream (`body.stream`) or one JSON response; a client that disconnects
        before the whole response is ready cancels it (499, never read). `tools`: read each chat
        choice's output as tool calls."""
        model = self.served_model_name
        if body.stream:
            return _sse_response(stream_events(response_id, choices, body, self.tokenizer, model, tools))
        try:
            return await _unless_disconnected(
                raw, whole_response(response_id, choices, body, self.tokenizer, model, tools)
            )
        finally:
            close_all(choices)  # also when the work was cancelled before it started


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call for the chat template: `function.arguments` parsed into an object when it is JSON."""
    function = dict(call.get("function") or {})
    with contextlib.suppress(json.JSONDecodeError):
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    return {**call, "function": function}


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Await `work`, or cancel it when the client disconnects first (its `finally` aborts the request);
    the answer to a client that left is never read."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # nginx's "client closed request"


def _sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
