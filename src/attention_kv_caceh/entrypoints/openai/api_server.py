"""The OpenAI-compatible HTTP server over AsyncLLM (FastAPI; run it with uvicorn).

Corresponds to vLLM's `vllm/entrypoints/openai/api_server.py`, small: `POST /v1/completions` and
`POST /v1/chat/completions` (streamed as server-sent events or whole), `GET /v1/models`, `GET /health`,
`POST /tokenize`, `POST /detokenize` (vLLM's shapes), `GET /metrics` (Prometheus, vLLM's names; see
engine/metrics.py), and one endpoint of this project's own, `GET /debug/step_stats?last=N`: the engine's last N
StepStats (engine/core.py; num_running / num_waiting after each step, step_time_ms), the exact per-step
record that /metrics only samples or buckets (the harness's `--backend engine` reads it at the run's end). Stream chunks have OpenAI's shapes; a chat stream opens with a role-only chunk, then content
deltas, a chunk with the `finish_reason`, an optional usage-only chunk (`choices: []`), then `data: [DONE]`.

`POST /reset_prefix_cache` (vLLM's) forgets the engine core's prefix cache: 200 when done, 409 while
requests hold KV blocks.

The request fields (protocol.py) and how they are served (serving.py): `prompt` in vLLM's four forms,
`n` fanned out by AsyncLLM into one engine request per prompt and sample (engine/parallel_sampling.py), `echo`, `logprobs`, `stop_token_ids`,
`min_tokens`, the penalties and `logit_bias` (applied per request by the engine's sampler). Unknown fields
are logged in one warning line naming them, and the request is served, as vLLM does.

Faults: a body larger than `max_request_bytes` is a 413 before it is parsed (a body up to 8 times the
limit is read and dropped first, so a client that reads only after writing its whole body sees the 413),
and a large body past the budget of large bodies in flight a 503 with Retry-After (body_budget.py); a
bad request (malformed JSON, a known field of the wrong type or out of range, a field this server does
not serve such as `best_of` or `tools`, text that is not valid Unicode, max_tokens <= 0 or above
`max_model_len`, a prompt of `max_model_len` tokens or more (the message gives its exact length, or "at
least N" for a text too long to encode whole, see Tokenizer.encode_counted), a request that fans out to
more than `max_seqs_per_request` engine requests, a request whose prompt and max_tokens could never fit
in the KV cache) is a 400
naming the field as `param` (`stream_options` without `stream: true` too, as vLLM answers), a body sent
with a Content-Type that is not JSON (text/plain) a 415 (FastAPI reads only a JSON-typed or untyped body
as JSON), and an unknown model a 404, all with OpenAI's error body; with `api_key` set, every path
needs `Authorization: Bearer <key>` (else 401) except OPEN_PATHS (`/health`, `/metrics` and the API
docs, vLLM's public endpoints); with `max_queue` set, a request that would make more
than `max_queue` requests wait (beyond the engine's `max_num_seqs` running ones) is a 503. A client that
disconnects mid-stream aborts its request (its KV blocks are freed at the core's next step). An engine
step that raises fails the requests it was running: a stream gets an error event then `[DONE]`, a whole
response a 500. A dead engine core (EngineDeadError) ends every open stream with an error event then
`[DONE]`; new requests get 503 and `/health` answers 503. A drain that runs out of time ends each cut
stream with a chunk whose finish_reason is "abort", then `[DONE]`.

Tokenizing a prompt and /tokenize, /detokenize run in a worker thread (`asyncio.to_thread`; the
tokenizer releases the GIL while it encodes), so a long prompt never stalls the other streams; text
deltas arrive already detokenized from AsyncLLM's output thread. A generation request's prompt is
counted whole but its list of ids is built only up to `max_model_len`, so what is built with the GIL held
is bounded by the context, not by the body. A core slow to read its input makes the sends queue (see
engine/core_client.py); the core is declared dead only when it has exited. After a large body, glibc's
`malloc_trim(0)` hands the freed heap back to the OS (middleware.py).

The routes are thin, as vLLM's are: each reads its serving object from `app.state` and calls it
(serving_completion.py, serving_chat.py, serving_tokenization.py, over serving_engine.py's OpenAIServing).

Left out: vLLM's other endpoints (embeddings, pooling, score and rerank, audio, the Responses API, LoRA
loading, sleep / wake_up, profiling, `/version`, `/tokenizer_info`), TLS and CORS options, and several
API-server processes (`--api-server-count`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.message
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from attention_kv_caceh.engine.async_llm import AsyncLLM, TokenizerLike
from attention_kv_caceh.engine.core_client import EngineDeadError
from attention_kv_caceh.engine.metrics import ServerMetrics
from attention_kv_caceh.entrypoints.chat_utils import ChatTemplate
from attention_kv_caceh.entrypoints.openai.body_budget import BodyBudgetMiddleware, BodyOverBudget
from attention_kv_caceh.entrypoints.openai.middleware import (
    OPEN_PATHS,
    ApiKeyMiddleware,
    BodySizeMiddleware,
)
from attention_kv_caceh.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_response,
    validation_error,
)
from attention_kv_caceh.entrypoints.openai.serving import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_SEQS_PER_REQUEST,
    HTTPError,
)
from attention_kv_caceh.entrypoints.openai.serving_chat import OpenAIServingChat
from attention_kv_caceh.entrypoints.openai.serving_completion import OpenAIServingCompletion
from attention_kv_caceh.entrypoints.openai.serving_engine import OpenAIServing
from attention_kv_caceh.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "OPEN_PATHS", "build_app", "router"]

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Largest request body the server reads by default (8 MiB); a larger one is a 413 before parsing."""

logger = logging.getLogger(__name__)

_MAX_STEP_STATS = 100_000  # most StepStats one GET /debug/step_stats returns

_S = TypeVar("_S", bound=OpenAIServing)


def build_app(
    async_llm: AsyncLLM,
    tokenizer: TokenizerLike,
    served_model_name: str,
    max_model_len: int,
    api_key: str | None = None,
    max_queue: int | None = None,
    *,
    chat_template: ChatTemplate | None = None,
    drain_timeout_s: float = 30.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_request_bytes_in_flight: int | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    cache_config: Mapping[str, str] | None = None,
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST,
    num_speculative_tokens: int = 0,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `async_llm` under the model name `served_model_name`.

    The app starts `async_llm` at startup (unless already started) and drains it at shutdown (running
    requests get up to `drain_timeout_s` seconds; `serve` drains before uvicorn closes the connections,
    see cli/serve.py). `chat_template` None uses chat_utils' PLAIN_CHAT_TEMPLATE. A body larger than
    `max_request_bytes` is a 413; large bodies served at once may total `max_request_bytes_in_flight`
    bytes (None: 4 * max_request_bytes), past it a 503 with Retry-After (body_budget.py). `max_logprobs` caps `logprobs` / `top_logprobs` (vLLM's --max-logprobs).
    A request whose prompt and max_tokens could never fit in the KV pool the engine core reported is
    refused up front with a 400 (OpenAIServing._check_kv_capacity).
    `cache_config`: the KV cache's settings for `/metrics`' `vllm:cache_config_info` (see ServerMetrics).
    `num_speculative_tokens`: the engine's K (0: speculative decoding off), for vLLM's spec-decode metrics.
    `enable_auto_tool_choice`, `tool_call_parser`: vLLM's flags for `tool_choice: auto` (a parser name of
    tool_parsers.TOOL_PARSERS; ValueError for another, or auto without one).
    `max_seqs_per_request` caps the engine requests one request fans out to (its prompts times `n`;
    above it a 400 names the count and the limit).
    Raises ValueError for max_model_len < 2, max_queue < 0, max_request_bytes < 1, max_logprobs < 0,
    max_seqs_per_request < 1 or max_request_bytes_in_flight < max_request_bytes.
    """
    _check_arguments(
        max_model_len,
        max_queue,
        max_request_bytes,
        max_request_bytes_in_flight,
        max_logprobs,
        max_seqs_per_request,
    )
    metrics = ServerMetrics(
        served_model_name,
        running=lambda: async_llm.num_running,
        waiting=lambda: async_llm.num_waiting,
        kv_usage=lambda: async_llm.kv_cache_usage,
        cache_config=cache_config,
        num_speculative_tokens=num_speculative_tokens,
    )
    async_llm.add_stat_logger(metrics.record)

    def serving(cls: type[_S]) -> _S:
        return cls(
            async_llm,
            tokenizer,
            served_model_name,
            max_model_len,
            chat_template=chat_template,
            max_queue=max_queue,
            max_logprobs=max_logprobs,
            max_seqs_per_request=max_seqs_per_request,
        )

    # strict_content_type=False: a body sent with no Content-Type is read as JSON (FastAPI's strict default
    # would refuse it as "not a JSON object"); a non-JSON type still gets the 415 of _bad_request
    app = FastAPI(
        title="attention-kv-caceh engine",
        lifespan=_lifespan(async_llm, drain_timeout_s),
        strict_content_type=False,
    )
    app.state.metrics = metrics
    app.state.openai_serving_completion = serving(OpenAIServingCompletion)
    app.state.openai_serving_chat = serving(OpenAIServingChat)
    app.state.openai_serving_chat.configure_tools(enable_auto_tool_choice, tool_call_parser)
    app.state.openai_serving_tokenization = serving(OpenAIServingTokenization)
    _add_exception_handlers(app)
    app.add_middleware(BodySizeMiddleware, max_bytes=max_request_bytes)
    in_flight = 4 * max_request_bytes if max_request_bytes_in_flight is None else max_request_bytes_in_flight
    app.add_middleware(  # before any byte of a body is buffered or parsed
        BodyBudgetMiddleware, max_bytes_in_flight=in_flight, max_request_bytes=max_request_bytes
    )
    if api_key is not None:  # outermost: a client without the key holds nothing of the budget
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, max_request_bytes=max_request_bytes)
    app.include_router(router)
    return app


def _check_arguments(
    max_model_len: int,
    max_queue: int | None,
    max_request_bytes: int,
    max_request_bytes_in_flight: int | None,
    max_logprobs: int,
    max_seqs_per_request: int,
) -> None:
    """build_app's ValueErrors, each naming the argument and its value."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if max_logprobs < 0:
        raise ValueError(f"max_logprobs must be >= 0, got {max_logprobs}")
    if max_request_bytes_in_flight is not None and max_request_bytes_in_flight < max_request_bytes:
        raise ValueError(
            f"max_request_bytes_in_flight must be >= max_request_bytes ({max_request_bytes}), "
            f"got {max_request_bytes_in_flight}"
        )
    if max_queue is not None and max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    if max_seqs_per_request < 1:
        raise ValueError(f"max_seqs_per_request must be >= 1, got {max_seqs_per_request}")


def _lifespan(
    async_llm: AsyncLLM, drain_timeout_s: float
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Start `async_llm` at startup (unless started), drain it for up to `drain_timeout_s` at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncGenerator[None]:
        if not async_llm.is_started:
            async_llm.start()
        yield
        await async_llm.shutdown(drain_timeout_s)

    return lifespan


# -- errors in OpenAI's body ---------------------------------------------------------------------------


def _add_exception_handlers(app: FastAPI) -> None:
    """Every error answered in OpenAI's body (protocol.error_response)."""
    app.exception_handler(RequestValidationError)(_bad_request)
    app.exception_handler(BodyOverBudget)(_over_budget)
    app.exception_handler(StarletteHTTPException)(_starlette_error)
    app.exception_handler(HTTPError)(_http_error)
    app.exception_handler(Exception)(_internal_error)


async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    content_type = request.headers.get("content-type")
    body_errors = [e for e in errors if tuple(e.get("loc", ()))[:1] == ("body",)]
    if body_errors and content_type is not None and not _is_json_type(content_type):
        # FastAPI parses a body as JSON only when it is sent as JSON (or with no Content-Type)
        message = f"the body was sent as Content-Type: {content_type}; send it as application/json"
        return error_response(415, message)
    status, message, param = validation_error(errors)
    return error_response(status, message, param)


async def _over_budget(_request: Request, exc: BodyOverBudget) -> JSONResponse:
    raise exc  # BodyBudgetMiddleware answers it: it reads and drops the rest of the body first


async def _starlette_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # FastAPI's own refusals (a body that is not UTF-8, an unknown path, a wrong method) in OpenAI's shape
    return error_response(exc.status_code, str(exc.detail))


async def _http_error(_request: Request, exc: HTTPError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
    logger.exception("request failed", exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _is_json_type(content_type: str) -> bool:
    """Whether FastAPI reads a body of `content_type` as JSON (application/json or application/*+json)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


# -- the routes: each reads its serving object from app.state, as vLLM's do ----------------------------

router = APIRouter()


def _completion(raw: Request) -> OpenAIServingCompletion:
    return raw.app.state.openai_serving_completion


def _chat(raw: Request) -> OpenAIServingChat:
    return raw.app.state.openai_serving_chat


def _tokenization(raw: Request) -> OpenAIServingTokenization:
    return raw.app.state.openai_serving_tokenization


@router.get("/health")
async def health(raw: Request) -> Response:
    return Response(status_code=200 if _completion(raw).async_llm.is_running else 503)


@router.get("/metrics")
async def scrape(raw: Request) -> Response:
    metrics: ServerMetrics = raw.app.state.metrics
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request) -> Response:
    try:
        done = await _completion(raw).async_llm.reset_prefix_cache()
    except EngineDeadError as exc:
        raise HTTPError(503, f"EngineDeadError: {exc}") from exc
    if not done:
        raise HTTPError(409, "the prefix cache was not reset: requests hold KV blocks; retry when idle")
    return Response(status_code=200)


@router.get("/debug/step_stats")
async def step_stats(raw: Request, last: int = 1000) -> dict[str, Any]:
    if not 1 <= last <= _MAX_STEP_STATS:
        raise HTTPError(400, f"last must be in [1, {_MAX_STEP_STATS}], got {last}", "last")
    # list() of the bounded deque runs in C under the GIL: one consistent copy against the output thread
    recent = list(_completion(raw).async_llm.step_stats)[-last:]
    return {"object": "list", "data": [dataclasses.asdict(s) for s in recent]}


@router.get("/v1/models")
async def models(raw: Request) -> dict[str, Any]:
    return _completion(raw).show_models()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> Response:
    return await _tokenization(raw).tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> dict[str, Any]:
    return await _tokenization(raw).detokenize(body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request) -> Response:
    return await _completion(raw).create_completion(body, raw)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
    return await _chat(raw).create_chat_completion(body, raw)
