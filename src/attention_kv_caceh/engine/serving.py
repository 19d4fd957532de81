"""One generation request from the HTTP side: sampling checks and OpenAI's chunk shapes.

Corresponds to vLLM's `vllm/entrypoints/openai/serving_completion.py` and `serving_chat.py` at a small
size. `sampling_params_for` turns a request body into the engine's SamplingParams (or an HTTP error),
`stop` strings included: AsyncLLM's OutputProcessor applies them to the text (output_processor.py). The
chunk builders give OpenAI's stream shapes.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from attention_kv_caceh.engine.protocol import GenerationRequest
from attention_kv_caceh.engine.request import SamplingParams

__all__ = [
    "DONE",
    "HTTPError",
    "chat_chunk",
    "completion_chunk",
    "sampling_params_for",
    "sse",
    "usage",
]

DONE = b"data: [DONE]\n\n"


class HTTPError(Exception):
    """A request the server answers with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def sse(obj: Any) -> bytes:
    """One server-sent `data:` event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sampling_params_for(
    body: GenerationRequest, num_prompt_tokens: int, max_model_len: int, default_max_tokens: int | None
) -> SamplingParams:
    """SamplingParams for a request whose prompt has `num_prompt_tokens` tokens.

    `max_completion_tokens` wins over `max_tokens`; when neither is given, `default_max_tokens` (None: the
    rest of the context) capped to the rest of the context. `temperature` defaults to 1.0 as in OpenAI's
    API; `top_k` of 0 or -1 disables it. Raises HTTPError(400), naming the field as `param`, for n != 1,
    `logprobs` / `top_logprobs` / `echo` asked for (not supported), an empty prompt, a prompt of
    `max_model_len` tokens or more, max_tokens <= 0, a total over `max_model_len`, or a sampling value out
    of range (temperature not finite or < 0, top_p not in (0, 1], top_k < -1, seed < 0). The request
    models (protocol.py) already refuse bools for numbers and NaN / Infinity; the finiteness checks here
    repeat that for bodies built in code.
    """
    if body.n != 1:
        raise HTTPError(400, f"only n = 1 is supported, got n = {body.n}", "n")
    if body.logprobs not in (None, False, 0) or body.logprobs is True:
        raise HTTPError(400, "logprobs are not supported by this server", "logprobs")
    if body.top_logprobs not in (None, 0):
        raise HTTPError(400, "top_logprobs is not supported by this server", "top_logprobs")
    if body.echo:
        raise HTTPError(400, "echo is not supported by this server", "echo")
    if num_prompt_tokens == 0:
        raise HTTPError(400, "the prompt is empty", "prompt")
    if num_prompt_tokens >= max_model_len:
        raise HTTPError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens and leaves no room for a completion.",
            "prompt",
        )
    room = max_model_len - num_prompt_tokens
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    if max_tokens <= 0:
        raise HTTPError(400, f"{param} must be at least 1, got {max_tokens}", param)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise HTTPError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
            "in the completion).",
            param,
        )
    temperature = 1.0 if body.temperature is None else body.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise HTTPError(400, f"temperature must be finite and >= 0, got {temperature}", "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise HTTPError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if body.top_k is None or body.top_k == -1 else body.top_k
    if top_k < 0:
        raise HTTPError(400, f"top_k must be >= 0 (or -1 to disable), got {body.top_k}", "top_k")
    if body.seed is not None and body.seed < 0:
        raise HTTPError(400, f"seed must be >= 0, got {body.seed}", "seed")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        stop=tuple(body.stop_strings),
    )


def _stream_chunk(
    obj: str,
    request_id: str,
    model: str,
    created: int,
    choice: dict[str, Any] | None,
    usage_obj: dict[str, int] | None,
) -> dict[str, Any]:
    """The envelope both stream chunk shapes share; `choice=None` gives `choices: []` (usage-only)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [] if choice is None else [{"index": 0, **choice}],
    }
    if usage_obj is not None:
        chunk["usage"] = usage_obj
    return chunk


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    usage_obj: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A /v1/completions stream chunk; `text=None` gives a usage-only chunk (`choices: []`)."""
    choice = None if text is None else {"text": text, "logprobs": None, "finish_reason": finish_reason}
    return _stream_chunk("text_completion", request_id, model, created, choice, usage_obj)


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, str] | None,
    finish_reason: str | None = None,
    usage_obj: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A /v1/chat/completions stream chunk; `delta=None` gives a usage-only chunk (`choices: []`)."""
    choice = None if delta is None else {"delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _stream_chunk("chat.completion.chunk", request_id, model, created, choice, usage_obj)


def now_s() -> int:
    """Unix time in whole seconds (the `created` field)."""
    return int(time.time())
