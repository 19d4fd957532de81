"""The OpenAI-compatible HTTP server over AsyncLLM (FastAPI; run it with uvicorn).

Corresponds to vLLM's `vllm/entrypoints/openai/api_server.py`, small: `POST /v1/completions` and
`POST /v1/chat/completions` (streamed as server-sent events or whole), `GET /v1/models`, `GET /health`,
`POST /tokenize`, `POST /detokenize` (vLLM's shapes), `GET /metrics` (Prometheus, vLLM's names; see
metrics.py), and one endpoint of this project's own, `GET /debug/step_stats?last=N`: the engine's last N
StepStats (llm_engine.py; num_running / num_waiting after each step, step_time_ms), the exact per-step
record that /metrics only samples or buckets (the harness's `--backend engine` reads it at the run's end). Stream chunks have OpenAI's shapes; a chat stream opens with a role-only chunk, then content
deltas, a chunk with the `finish_reason`, an optional usage-only chunk (`choices: []`), then `data: [DONE]`.

Faults: a bad request (malformed JSON, a known field of the wrong type, max_tokens <= 0, a prompt too long
for `max_model_len`) is a 400 and an unknown model a 404, both with OpenAI's error body; with `api_key`
set, `/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer <key>` (else 401; `/health` and
`/metrics` stay open, as in vLLM); with `max_queue` set, a request that would make more than `max_queue`
requests wait (beyond the engine's `max_num_seqs` running ones) is a 503. A client that disconnects
mid-stream aborts its request (its KV blocks are freed at the next step). An engine step that raises fails
the requests it was running: a stream gets an error event then `[DONE]`, a whole response a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.chat_utils import ChatTemplate
from attention_kv_caceh.engine.metrics import ServerMetrics
from attention_kv_caceh.engine.output_processor import (
    EngineDrainingError,
    EngineRequestError,
    EngineStepError,
    RequestStream,
)
from attention_kv_caceh.engine.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
    error_body,
    error_response,
    validation_error,
)
from attention_kv_caceh.engine.serving import (
    DONE,
    HTTPError,
    chat_chunk,
    completion_chunk,
    sampling_params_for,
    sse,
    text_deltas,
    usage,
)
from attention_kv_caceh.engine.tokenizer import Tokenizer

__all__ = ["build_app"]

logger = logging.getLogger(__name__)

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
_MAX_STEP_STATS = 100_000  # most StepStats one GET /debug/step_stats returns


def build_app(
    async_llm: AsyncLLM,
    tokenizer: Tokenizer,
    served_model_name: str,
    max_model_len: int,
    api_key: str | None = None,
    max_queue: int | None = None,
    *,
    chat_template: ChatTemplate | None = None,
    drain_timeout_s: float = 30.0,
) -> FastAPI:
    """The FastAPI app serving `async_llm` under the model name `served_model_name`.

    The app starts `async_llm` at startup (unless already started) and drains it at shutdown (running
    requests get up to `drain_timeout_s` seconds). `chat_template` None uses chat_utils'
    PLAIN_CHAT_TEMPLATE. Raises ValueError for max_model_len < 2 or max_queue < 0.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_queue is not None and max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    template = chat_template if chat_template is not None else ChatTemplate()
    metrics = ServerMetrics(
        served_model_name,
        running=lambda: async_llm.num_running,
        waiting=lambda: async_llm.num_waiting,
        kv_usage=lambda: async_llm.kv_cache_usage,
    )
    async_llm.add_stat_logger(metrics.record)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncGenerator[None]:
        if not async_llm.is_running:
            async_llm.start()
        yield
        await async_llm.shutdown(drain_timeout_s)

    app = FastAPI(title="attention-kv-caceh engine", lifespan=lifespan)
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:  # pyright: ignore[reportUnusedFunction]
        status, message, param = validation_error(list(exc.errors()))
        return error_response(status, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:  # pyright: ignore[reportUnusedFunction]
        # FastAPI's own refusals (a body that is not UTF-8, an unknown path, a wrong method) in OpenAI's shape
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(HTTPError)
    async def _http_error(_request: Request, exc: HTTPError) -> JSONResponse:  # pyright: ignore[reportUnusedFunction]
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:  # pyright: ignore[reportUnusedFunction]
        logger.exception("request failed", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise HTTPError(404, f"The model `{model}` does not exist.", "model")

    def admit(
        request_id: str, prompt_ids: list[int], body: GenerationRequest, default: int | None
    ) -> RequestStream:
        params = sampling_params_for(body, len(prompt_ids), max_model_len, default)
        if max_queue is not None and async_llm.num_unfinished >= async_llm.max_num_seqs + max_queue:
            raise HTTPError(503, f"the server's queue is full ({max_queue} requests waiting); retry later")
        try:
            return async_llm.add_request(request_id, prompt_ids, params)
        except EngineDrainingError as exc:
            raise HTTPError(503, str(exc)) from exc

    def chat_prompt(messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        rendered = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            # the template writes the special tokens itself (a BOS included), as vLLM's chat path does
            return tokenizer.encode(
                template.render(rendered, add_generation_prompt), add_special_tokens=False
            )
        except ValueError as exc:
            raise HTTPError(400, str(exc), "messages") from exc

    def completion_prompt(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        # an id the model has no embedding row for would fail the whole engine step, not just this request
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise HTTPError(
                400, f"prompt token ids must be in [0, {tokenizer.vocab_size}), got {bad[0]}", "prompt"
            )
        return list(prompt)

    @app.get("/health")
    async def health() -> Response:  # pyright: ignore[reportUnusedFunction]
        return Response(status_code=200 if async_llm.is_running else 503)

    @app.get("/metrics")
    async def scrape() -> Response:  # pyright: ignore[reportUnusedFunction]
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/step_stats")
    async def step_stats(last: int = 1000) -> dict[str, Any]:  # pyright: ignore[reportUnusedFunction]
        if not 1 <= last <= _MAX_STEP_STATS:
            raise HTTPError(400, f"last must be in [1, {_MAX_STEP_STATS}], got {last}", "last")
        # list() of the bounded deque runs in C under the GIL: one consistent copy against the engine thread
        recent = list(async_llm.engine.step_stats)[-last:]
        return {"object": "list", "data": [dataclasses.asdict(s) for s in recent]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:  # pyright: ignore[reportUnusedFunction]
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "attention-kv-caceh",
            "root": served_model_name,
            "parent": None,
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:  # pyright: ignore[reportUnusedFunction]
        check_model(body.model)
        if body.messages is not None:
            tokens = chat_prompt(body.messages, body.add_generation_prompt)
        elif body.prompt is not None:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise HTTPError(400, "give `prompt` or `messages`", "prompt")
        strs = [tokenizer.decode([t]) for t in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:  # pyright: ignore[reportUnusedFunction]
        check_model(body.model)
        if any(not 0 <= t < tokenizer.vocab_size for t in body.tokens):
            raise HTTPError(400, f"token ids must be in [0, {tokenizer.vocab_size})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:  # pyright: ignore[reportUnusedFunction]
        check_model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = admit(request_id, completion_prompt(body.prompt), body, _COMPLETIONS_DEFAULT_MAX_TOKENS)
        if body.stream:
            return _sse_response(_stream_events(stream, body, tokenizer, served_model_name, chat=False))
        return await _unless_disconnected(raw, _whole(stream, body, tokenizer, served_model_name, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:  # pyright: ignore[reportUnusedFunction]
        check_model(body.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt_ids = chat_prompt(body.messages, body.add_generation_prompt)
        stream = admit(request_id, prompt_ids, body, None)
        if body.stream:
            return _sse_response(_stream_events(stream, body, tokenizer, served_model_name, chat=True))
        return await _unless_disconnected(raw, _whole(stream, body, tokenizer, served_model_name, chat=True))

    return app


class _ApiKeyMiddleware:
    """401 for `/v1/*`, `/tokenize` and `/detokenize` without `Authorization: Bearer <api_key>` (a plain
    ASGI middleware: it leaves streaming and disconnect detection untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] == "http" and (path.startswith("/v1") or path in ("/tokenize", "/detokenize")):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                message = "missing or wrong API key (Authorization: Bearer <key>)"
                await error_response(401, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def _stream_flags(body: GenerationRequest) -> tuple[bool, bool]:
    options = body.stream_options
    if options is None:
        return False, False
    return options.include_usage, options.continuous_usage_stats


async def _stream_events(
    stream: RequestStream,
    body: CompletionRequest | ChatCompletionRequest,
    tokenizer: Tokenizer,
    model: str,
    *,
    chat: bool,
) -> AsyncIterator[bytes]:
    """One streamed request as SSE events in OpenAI's shapes.

    Chat: a role-only first chunk, then `delta.content` chunks; completions: `text` chunks. Then a chunk
    with the finish_reason, a usage-only chunk (`choices: []`) with `stream_options.include_usage`, and
    `data: [DONE]`. With `continuous_usage_stats` every chunk carries the usage so far, and a token whose
    text is not complete yet still gets a chunk (empty text) so a client can time it (see
    `serving.text_deltas`). An engine error ends the stream with an error event (400 for a request the
    engine refused, 500 for a failed step).
    """
    include_usage, continuous = _stream_flags(body)
    created = int(time.time())
    rid = stream.request_id

    def chunk(
        text: str | None, finish_reason: str | None = None, usage_obj: dict[str, int] | None = None
    ) -> bytes:
        """text None: the usage-only chunk; "" with a finish_reason: the finish chunk."""
        if not chat:
            return sse(completion_chunk(rid, model, created, text, finish_reason, usage_obj))
        delta = None if text is None else {} if finish_reason is not None and not text else {"content": text}
        return sse(chat_chunk(rid, model, created, delta, finish_reason, usage_obj))

    counts = (0, 0)
    try:
        if chat:
            yield sse(chat_chunk(rid, model, created, {"role": "assistant"}))
        async for delta in text_deltas(stream, tokenizer, body.stop_strings):
            counts = (delta.num_prompt_tokens, delta.num_output_tokens)
            per_chunk = usage(*counts) if continuous else None
            if delta.text or (continuous and delta.finish_reason is None):
                yield chunk(delta.text, None, per_chunk)
            if delta.finish_reason is not None:
                yield chunk("", delta.finish_reason, per_chunk)
        if include_usage:
            yield chunk(None, usage_obj=usage(*counts))
    except EngineRequestError as exc:
        yield sse(error_body(400, str(exc)))
    except EngineStepError as exc:
        yield sse(error_body(500, str(exc)))
    finally:
        stream.close()  # a client that left cancels this generator: abort its request
    yield DONE


async def _whole(
    stream: RequestStream, body: GenerationRequest, tokenizer: Tokenizer, model: str, *, chat: bool
) -> Response:
    parts: list[str] = []
    finish_reason = "stop"
    counts = (0, 0)
    try:
        async for delta in text_deltas(stream, tokenizer, body.stop_strings):
            parts.append(delta.text)
            counts = (delta.num_prompt_tokens, delta.num_output_tokens)
            if delta.finish_reason is not None:
                finish_reason = delta.finish_reason
    except EngineRequestError as exc:
        return error_response(400, str(exc))
    except EngineStepError as exc:
        return error_response(500, str(exc))
    finally:
        stream.close()
    text = "".join(parts)
    choice: dict[str, Any]
    if chat:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    obj = {
        "id": stream.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(*counts),
    }
    return JSONResponse(obj)
