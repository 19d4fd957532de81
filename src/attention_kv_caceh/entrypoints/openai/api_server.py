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
`n` fanned out into one engine request per prompt and sample, `echo`, `logprobs`, `stop_token_ids`,
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
engine/core_client.py); the core is declared dead only when it has exited. After a body of `_RELEASE_AFTER_BYTES` or
more, glibc's `malloc_trim(0)` hands the freed heap back to the OS (engine/malloc.py).

Left out: vLLM's other endpoints (embeddings, pooling, score and rerank, audio, the Responses API, LoRA
loading, sleep / wake_up, profiling, `/version`, `/tokenizer_info`), TLS and CORS options, and several
API-server processes (`--api-server-count`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.message
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterator, Mapping
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from attention_kv_caceh.engine.async_llm import AsyncLLM, TokenizerLike
from attention_kv_caceh.engine.core_client import EngineDeadError
from attention_kv_caceh.engine.malloc import release_freed_memory
from attention_kv_caceh.engine.metrics import ServerMetrics
from attention_kv_caceh.engine.output_processor import EngineDrainingError
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.entrypoints.chat_utils import ChatTemplate
from attention_kv_caceh.entrypoints.openai.body_budget import (
    DROP_TIMEOUT_S,
    BodyBudgetMiddleware,
    BodyOverBudget,
    drop_body,
)
from attention_kv_caceh.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    Prompt,
    TokenizeRequest,
    error_response,
    validation_error,
)
from attention_kv_caceh.entrypoints.openai.serving import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_SEQS_PER_REQUEST,
    HTTPError,
    check_fan_out,
    check_request_fields,
    prompt_too_long,
    sampling_params_for,
)
from attention_kv_caceh.entrypoints.openai.serving_response import (
    Choice,
    close_all,
    stream_events,
    whole_response,
)
from attention_kv_caceh.entrypoints.openai.serving_tokenization import encode_pieces, tokenize_json

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "OPEN_PATHS", "build_app"]

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Largest request body the server reads by default (8 MiB); a larger one is a 413 before parsing."""

logger = logging.getLogger(__name__)

_RELEASE_AFTER_BYTES = 256 * 1024  # after a request body this large, hand the freed heap back to the OS
_DRAIN_FACTOR = 8  # a refused body up to this many times --max-request-bytes is read (and dropped) first
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
_MAX_STEP_STATS = 100_000  # most StepStats one GET /debug/step_stats returns


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
    kv_capacity_tokens: int | None = None,
    cache_config: Mapping[str, str] | None = None,
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST,
    num_speculative_tokens: int = 0,
) -> FastAPI:
    """The FastAPI app serving `async_llm` under the model name `served_model_name`.

    The app starts `async_llm` at startup (unless already started) and drains it at shutdown (running
    requests get up to `drain_timeout_s` seconds; `serve` drains before uvicorn closes the connections,
    see cli/serve.py). `chat_template` None uses chat_utils' PLAIN_CHAT_TEMPLATE. A body larger than
    `max_request_bytes` is a 413; large bodies served at once may total `max_request_bytes_in_flight`
    bytes (None: 4 * max_request_bytes), past it a 503 with Retry-After (body_budget.py). `max_logprobs` caps `logprobs` / `top_logprobs` (vLLM's --max-logprobs).
    `kv_capacity_tokens` (the KV pool's blocks * block_size) refuses up front, with a 400, a request
    whose prompt and max_tokens could never fit in the pool; None leaves that check to the engine.
    `cache_config`: the KV cache's settings for `/metrics`' `vllm:cache_config_info` (see ServerMetrics).
    `num_speculative_tokens`: the engine's K (0: speculative decoding off), for vLLM's spec-decode metrics.
    `max_seqs_per_request` caps the engine requests one request fans out to (its prompts times `n`;
    above it a 400 names the count and the limit).
    Raises ValueError for max_model_len < 2, max_queue < 0, max_request_bytes < 1, max_logprobs < 0,
    max_seqs_per_request < 1 or max_request_bytes_in_flight < max_request_bytes.
    """
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
    template = chat_template if chat_template is not None else ChatTemplate()
    metrics = ServerMetrics(
        served_model_name,
        running=lambda: async_llm.num_running,
        waiting=lambda: async_llm.num_waiting,
        kv_usage=lambda: async_llm.kv_cache_usage,
        cache_config=cache_config,
        num_speculative_tokens=num_speculative_tokens,
    )
    async_llm.add_stat_logger(metrics.record)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncGenerator[None]:
        if not async_llm.is_started:
            async_llm.start()
        yield
        await async_llm.shutdown(drain_timeout_s)

    # strict_content_type=False: a body sent with no Content-Type is read as JSON (FastAPI's strict default
    # would refuse it as "not a JSON object"); a non-JSON type still gets the 415 below
    app = FastAPI(title="attention-kv-caceh engine", lifespan=lifespan, strict_content_type=False)
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:  # pyright: ignore[reportUnusedFunction]
        errors = list(exc.errors())
        content_type = request.headers.get("content-type")
        body_errors = [e for e in errors if tuple(e.get("loc", ()))[:1] == ("body",)]
        if body_errors and content_type is not None and not _is_json_type(content_type):
            # FastAPI parses a body as JSON only when it is sent as JSON (or with no Content-Type)
            message = f"the body was sent as Content-Type: {content_type}; send it as application/json"
            return error_response(415, message)
        status, message, param = validation_error(errors)
        return error_response(status, message, param)

    @app.exception_handler(BodyOverBudget)
    async def _over_budget(_request: Request, exc: BodyOverBudget) -> JSONResponse:  # pyright: ignore[reportUnusedFunction]
        raise exc  # BodyBudgetMiddleware answers it: it reads and drops the rest of the body first

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

    app.add_middleware(_BodySizeMiddleware, max_bytes=max_request_bytes)
    in_flight = 4 * max_request_bytes if max_request_bytes_in_flight is None else max_request_bytes_in_flight
    app.add_middleware(  # before any byte of a body is buffered or parsed
        BodyBudgetMiddleware, max_bytes_in_flight=in_flight, max_request_bytes=max_request_bytes
    )
    if api_key is not None:  # outermost: a client without the key holds nothing of the budget
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key, max_request_bytes=max_request_bytes)

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise HTTPError(404, f"The model `{model}` does not exist.", "model")

    def warn_ignored(
        body: CompletionRequest | ChatCompletionRequest | TokenizeRequest | DetokenizeRequest,
    ) -> None:
        ignored = body.ignored_fields
        if ignored:  # as vLLM does: one line naming them, and the request is served
            logger.warning("The following fields were present in the request but ignored: %s", ignored)

    def check_kv_capacity(num_prompt_tokens: int, params: SamplingParams) -> None:
        if kv_capacity_tokens is None:
            return
        # the last sampled token is never computed: the cache holds at most prompt + max_tokens - 1 positions
        positions = min(num_prompt_tokens + params.max_tokens, max_model_len) - 1
        if positions > kv_capacity_tokens:
            param = "prompt" if num_prompt_tokens > kv_capacity_tokens else "max_tokens"
            raise HTTPError(
                400,
                f"the prompt ({num_prompt_tokens} tokens) and max_tokens ({params.max_tokens}) need "
                f"{positions} KV cache positions; the server's KV cache holds {kv_capacity_tokens}",
                param,
            )

    def admit(
        response_id: str,
        prompts: list[tuple[list[int], str, int]],
        body: CompletionRequest | ChatCompletionRequest,
        default: int | None,
    ) -> list[Choice]:
        """Validate every child first, then add them all (or none). `prompts`: (token ids, text, the
        prompt's exact token count; the ids of a prompt past the context are cut, and it is refused)."""
        echo = isinstance(body, CompletionRequest) and body.echo
        given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        echo_only = echo and given == 0
        choices: list[Choice] = []  # index = prompt_index * n + i, as vLLM numbers them
        for p, (prompt_ids, text, num_prompt_tokens) in enumerate(prompts):
            base = response_id if len(prompts) == 1 else f"{response_id}-{p}"
            for i in range(body.n):
                params = sampling_params_for(
                    body,
                    num_prompt_tokens,
                    max_model_len,
                    default,
                    vocab_size=tokenizer.vocab_size,
                    max_logprobs=max_logprobs,
                    index=i,
                )
                check_kv_capacity(num_prompt_tokens, params)
                choice = Choice(
                    len(choices),
                    base if body.n == 1 else f"{i}_{base}",  # vLLM's child request ids
                    prompt_ids,
                    params,
                    async_llm.add_request,
                    leader=None if i == 0 else choices[len(choices) - i],
                    echo_text=text if echo else "",
                    echo_only=echo_only,
                    first_prompt=i == 0,
                )
                choices.append(choice)
        if (
            max_queue is not None
            and async_llm.num_unfinished + len(choices) > async_llm.max_num_seqs + max_queue
        ):
            raise HTTPError(503, f"the server's queue is full ({max_queue} requests waiting); retry later")
        try:
            for choice in choices:
                if choice.leader is None:
                    choice.start()
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

    def chat_prompt(
        messages: list[ChatMessage], add_generation_prompt: bool, max_length: int | None = None
    ) -> tuple[list[int], int]:
        """The rendered conversation's token ids (cut at `max_length`) and its exact token count."""
        rendered = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            # the template writes the special tokens itself (a BOS included), as vLLM's chat path does
            ids, count, exact = tokenizer.encode_counted(
                template.render(rendered, add_generation_prompt),
                add_special_tokens=False,
                max_length=max_length,
            )
        except ValueError as exc:
            raise HTTPError(400, str(exc), "messages") from exc
        if not exact:
            raise prompt_too_long(max_model_len, count, exact)
        return ids, count

    def check_ids(ids: list[int], param: str) -> list[int]:
        # an id the model has no embedding row for would fail the whole engine step, not just this request
        for t in ids:
            if not 0 <= t < tokenizer.vocab_size:
                raise HTTPError(
                    400, f"{param} token ids must be in [0, {tokenizer.vocab_size}), got {t}", param
                )
        return ids  # the validated request's own list: a copy of millions of ids would cost as much again

    def prompt_list(prompt: Prompt) -> list[str | list[int]]:
        """vLLM's four prompt forms as a list of prompts (a text or token ids each)."""
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

    def completion_prompts(
        prompt: Prompt,
        add_special_tokens: bool = True,
        with_text: bool = False,
        max_length: int | None = None,
    ) -> list[tuple[list[int], str, int]]:
        """(token ids, text, exact token count) of each prompt; the text of token ids is decoded only when
        `with_text`; a text prompt is counted whole but its ids are cut at `max_length` (the Python list
        built with the GIL held stays bounded by the context, whatever the body's size)."""
        out: list[tuple[list[int], str, int]] = []
        for item in prompt_list(prompt):
            if isinstance(item, str):
                ids, count, exact = tokenizer.encode_counted(item, add_special_tokens, max_length)
                if not exact:
                    raise prompt_too_long(max_model_len, count, exact)
                out.append((ids, item, count))
            else:
                ids = check_ids(item, "prompt")
                out.append((ids, tokenizer.decode(ids) if with_text else "", len(ids)))
        return out

    @app.get("/health")
    async def health() -> Response:  # pyright: ignore[reportUnusedFunction]
        return Response(status_code=200 if async_llm.is_running else 503)

    @app.get("/metrics")
    async def scrape() -> Response:  # pyright: ignore[reportUnusedFunction]
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:  # pyright: ignore[reportUnusedFunction]
        try:
            done = await async_llm.reset_prefix_cache()
        except EngineDeadError as exc:
            raise HTTPError(503, f"EngineDeadError: {exc}") from exc
        if not done:
            raise HTTPError(409, "the prefix cache was not reset: requests hold KV blocks; retry when idle")
        return Response(status_code=200)

    @app.get("/debug/step_stats")
    async def step_stats(last: int = 1000) -> dict[str, Any]:  # pyright: ignore[reportUnusedFunction]
        if not 1 <= last <= _MAX_STEP_STATS:
            raise HTTPError(400, f"last must be in [1, {_MAX_STEP_STATS}], got {last}", "last")
        # list() of the bounded deque runs in C under the GIL: one consistent copy against the output thread
        recent = list(async_llm.step_stats)[-last:]
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
    async def tokenize(body: TokenizeRequest) -> Response:  # pyright: ignore[reportUnusedFunction]
        check_model(body.model)
        warn_ignored(body)
        if body.messages is not None and body.prompt is not None:  # one form or the other, never both
            raise HTTPError(400, "give either prompt or messages, not both", "messages")

        def pieces() -> Iterator[list[int]]:
            """Every prompt's ids, piece by piece (serving_tokenization.py: the answer costs its size)."""
            if body.messages is not None:
                rendered = [{"role": m.role, "content": m.text()} for m in body.messages]
                try:
                    text = template.render(rendered, body.add_generation_prompt)
                except ValueError as exc:
                    raise HTTPError(400, str(exc), "messages") from exc
                yield from encode_pieces(tokenizer, text, False)  # the template writes the specials
            elif body.prompt is not None:
                for item in prompt_list(body.prompt):
                    if isinstance(item, str):
                        yield from encode_pieces(tokenizer, item, body.add_special_tokens)
                    else:
                        yield check_ids(item, "prompt")
            else:
                raise HTTPError(400, "give `prompt` or `messages`", "prompt")

        def work() -> bytes:  # in a worker thread: a long text never stalls the other streams
            decode = tokenizer.decode if body.return_token_strs else None
            return tokenize_json(pieces(), max_model_len, decode)

        return Response(await asyncio.to_thread(work), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:  # pyright: ignore[reportUnusedFunction]
        check_model(body.model)
        warn_ignored(body)
        lists = [check_ids(ids, "tokens") for ids in body.tokens if isinstance(ids, list)]
        flat = check_ids([t for t in body.tokens if isinstance(t, int)], "tokens")
        if lists:
            return {"prompt": await asyncio.to_thread(lambda: [tokenizer.decode(ids) for ids in lists])}
        return {"prompt": await asyncio.to_thread(tokenizer.decode, flat)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:  # pyright: ignore[reportUnusedFunction]
        check_model(body.model)
        warn_ignored(body)
        check_request_fields(body, max_logprobs)
        check_fan_out(_num_prompts(body.prompt), body.n, max_seqs_per_request)  # before any tokenizing
        _check_no_empty_text(body.prompt)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        # tokenizing runs in a worker thread (the tokenizer releases the GIL), so other streams go on; a
        # prompt is counted whole (its 400 gives its exact length) but its ids are cut at max_model_len,
        # which keeps the list built for a huge one, with the GIL held, to a bounded size
        prompts = await asyncio.to_thread(
            completion_prompts, body.prompt, with_text=body.echo, max_length=max_model_len
        )
        choices = admit(response_id, prompts, body, _COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await respond(raw, response_id, choices, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:  # pyright: ignore[reportUnusedFunction]
        check_model(body.model)
        warn_ignored(body)
        check_request_fields(body, max_logprobs)
        check_fan_out(1, body.n, max_seqs_per_request)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt_ids, num_prompt_tokens = await asyncio.to_thread(
            chat_prompt, body.messages, body.add_generation_prompt, max_model_len
        )
        choices = admit(response_id, [(prompt_ids, "", num_prompt_tokens)], body, None)
        return await respond(raw, response_id, choices, body)

    async def respond(
        raw: Request, response_id: str, choices: list[Choice], body: CompletionRequest | ChatCompletionRequest
    ) -> Response:
        if body.stream:
            return _sse_response(stream_events(response_id, choices, body, tokenizer, served_model_name))
        try:
            return await _unless_disconnected(
                raw, whole_response(response_id, choices, body, tokenizer, served_model_name)
            )
        finally:
            close_all(choices)  # also when the work was cancelled before it started

    return app


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


def _is_json_type(content_type: str) -> bool:
    """Whether FastAPI reads a body of `content_type` as JSON (application/json or application/*+json)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


# With an API key, every path needs it except these: health probes, metrics scraping and the API's own
# docs, the public endpoints of vLLM's AuthenticationMiddleware that this server has. None of them names
# a request (/debug/step_stats, which lists request ids, needs the key).
OPEN_PATHS = ("/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class _BodySizeMiddleware:
    """413 with OpenAI's error body for a request body over `max_bytes`: at once when Content-Length says
    so, else as soon as the received chunks pass it; nothing of such a body is parsed (a plain ASGI
    middleware, so streaming and disconnect detection are untouched)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send, int(length))
            return
        if length is not None and length.isdigit():
            await self._serve(scope, receive, send, int(length))  # the server stops at Content-Length
            return
        # chunked: read the body here, bounded, then hand it on
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], message, receive), send)
                return
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, None, size if message.get("more_body") else None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self._serve(scope, _replay(chunks, None, receive), send, size)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if size >= _RELEASE_AFTER_BYTES:  # a big body's prompt and token lists are garbage now
                await asyncio.to_thread(release_freed_memory)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, declared: int | None, received: int | None = 0
    ) -> None:
        """Answer 413. First read and drop the rest of the body (`declared` bytes by Content-Length, or
        chunks after the `received` so far; None: nothing left) while it stays within _DRAIN_FACTOR times
        the limit and DROP_TIMEOUT_S: a client that writes its whole body before it reads (Python's
        urllib, http.client) otherwise has the connection reset under it (a socket closed with unread
        data sends RST) and sees a BrokenPipe instead of the 413. A larger body is refused at once."""
        limit = _DRAIN_FACTOR * self.max_bytes
        if received is not None and (declared is None or declared <= limit):
            await drop_body(receive, received, limit, DROP_TIMEOUT_S)
        text = f"the request body is larger than the server's limit of {self.max_bytes} bytes"
        await error_response(413, text)(scope, receive, send)


def _replay(chunks: list[bytes], first: Any, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body (or `first`) once, then the connection's own messages."""
    pending: list[Any] = (
        [first]
        if first is not None
        else [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
    )

    async def replay() -> Any:
        if pending:
            return pending.pop()
        return await receive()

    return replay


class _ApiKeyMiddleware:
    """401 for every path but OPEN_PATHS without `Authorization: Bearer <api_key>`: fail closed, so a
    route added later is keyed too (a plain ASGI middleware: it leaves streaming and disconnect
    detection untouched). The body of a refused request, up to `max_request_bytes`, is read and
    dropped first (`body_budget.drop_body`), so a client that writes it whole before reading sees the
    401, not a reset; a larger one is refused at once."""

    def __init__(self, app: ASGIApp, api_key: str, max_request_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] == "http" and path.rstrip("/") not in OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                message = "missing or wrong API key (Authorization: Bearer <key>)"
                length = Headers(scope=scope).get("content-length")
                if length is None or (length.isdigit() and int(length) <= self.max_request_bytes):
                    await drop_body(receive, 0, self.max_request_bytes, DROP_TIMEOUT_S)
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
