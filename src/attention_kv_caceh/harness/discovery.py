"""What the server says about itself before a run: the model it serves and that model's context.

`discover_model` reads the first model of `GET /v1/models` when no `--model` was given;
`served_context` its `max_model_len` (vLLM and `serve` list it), against which `context_problem` and
`dataset_context_problem` check the requests before any is sent (the server would refuse each with
HTTP 400).
"""

from __future__ import annotations

from typing import Any, cast

import aiohttp

from attention_kv_caceh.harness.backends import RequestSpec
from attention_kv_caceh.harness.client_errors import UNREACHABLE_KINDS, classify_client_error
from attention_kv_caceh.harness.config import HarnessConfig
from attention_kv_caceh.harness.load import unreachable_message
from attention_kv_caceh.harness.trace import read_trace

__all__ = [
    "ContextLengthError",
    "ModelDiscoveryError",
    "context_problem",
    "dataset_context_problem",
    "discover_model",
    "served_context",
]


class ModelDiscoveryError(RuntimeError):
    """No --model was given and none could be read from the server's GET /v1/models."""


async def discover_model(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str:
    """The first model id from GET /v1/models. Raises ModelDiscoveryError if none can be found (the
    server cannot be reached, does not answer in time, or lists no model)."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    limit_s = min(timeout_s, 30.0)
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit_s)) as response:
            if response.status != 200:
                text = (await response.content.read(200)).decode("utf-8", errors="replace")
                raise ModelDiscoveryError(
                    f"no --model given and GET {url} answered HTTP {response.status}"
                    + (f": {' '.join(text.split())[:200]}" if text.strip() else "")
                    + "; pass --model"
                )
            body: Any = await response.json(content_type=None)
    except aiohttp.ClientError as exc:
        kind, detail = classify_client_error(exc, after_headers=False)
        if kind in UNREACHABLE_KINDS and isinstance(exc, aiohttp.ClientConnectionError):
            raise ModelDiscoveryError(unreachable_message(base_url, f"GET {url}: {detail}")) from None
        raise ModelDiscoveryError(
            f"no --model given and GET {url} failed: {kind}: {detail}; pass --model"
        ) from None
    except TimeoutError:
        raise ModelDiscoveryError(
            f"the server at {base_url} did not answer GET {url} within {limit_s:g} s"
        ) from None
    except ValueError as exc:
        raise ModelDiscoveryError(
            f"no --model given and GET {url} failed ({type(exc).__name__}: {exc}); pass --model"
        ) from None
    data: object = cast("dict[str, Any]", body).get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data:
        first: object = cast("list[Any]", data)[0]
        if isinstance(first, dict):
            model_id: object = cast("dict[str, Any]", first).get("id")
            if isinstance(model_id, str):
                return model_id
    raise ModelDiscoveryError(f"no --model given and {url} lists no model; pass --model")


class ContextLengthError(ValueError):
    """The requests asked for cannot fit the model's context (max_model_len): bad input, found before
    any request is sent."""


def context_problem(config: HarnessConfig, limit: int, what: str) -> str | None:
    """Why `config`'s synthetic requests cannot fit a context of `limit` tokens (`what` names the limit
    and its source in the message), or None. A server refuses a prompt of `limit` tokens or more (no
    room for an output token, HTTP 400) and serves a prompt + max_tokens above `limit` with fewer output
    tokens than asked (vLLM and `serve` cap max_tokens to the context left), which a benchmark must not
    take for the requested length; a trace's rows each. Dataset prompts are checked once counted
    (`dataset_context_problem`)."""
    if config.dataset is not None:
        return None
    if config.trace is not None:
        for row in read_trace(config.trace)[: config.num_requests]:
            if row.input_length >= limit or row.input_length + row.output_length > limit:
                return (
                    f"--trace {config.trace.path!r} line {row.line}: input_length {row.input_length} and "
                    f"output_length {row.output_length} do not fit the model's context, {what}"
                )
        return None
    prompt, output = config.prompt_len.high, config.output_len.high
    if prompt >= limit:
        return (
            f"--prompt-len {config.prompt_len}: a prompt of {prompt} tokens does not fit the model's "
            f"context, {what}, with room for an output token"
        )
    if prompt + output > limit:
        return (
            f"--prompt-len {config.prompt_len} + --output-len {config.output_len}: up to {prompt + output} "
            f"tokens per request, more than the model's context, {what}"
        )
    return None


def dataset_context_problem(config: HarnessConfig, specs: list[RequestSpec], limit: int) -> str | None:
    """Why a counted dataset prompt (with its output length) cannot fit `limit` tokens, or None."""
    for spec in specs:
        n = spec.prompt_tokens_checked
        if spec.from_dataset and n is not None and (n >= limit or n + spec.output_tokens > limit):
            return (
                f"--dataset {config.dataset}: entry {spec.request_id + 1} has a prompt of {n} tokens and "
                f"an output of {spec.output_tokens}, more than the model's context, max_model_len {limit}"
            )
    return None


async def served_context(
    session: aiohttp.ClientSession, base_url: str, model: str, timeout_s: float
) -> int | None:
    """The `max_model_len` of `model` in the server's GET /v1/models (vLLM and `serve` list it), or None
    when the server does not say (then the server itself refuses what does not fit)."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=min(timeout_s, 30.0))) as response:
            body: Any = await response.json(content_type=None) if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    data: object = cast("dict[str, Any]", body).get("data") if isinstance(body, dict) else None
    for card in cast("list[Any]", data) if isinstance(data, list) else []:
        if isinstance(card, dict) and cast("dict[str, Any]", card).get("id") == model:
            limit: object = cast("dict[str, Any]", card).get("max_model_len")
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                return limit
    return None
