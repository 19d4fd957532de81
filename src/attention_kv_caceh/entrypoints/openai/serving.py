"""One generation request from the HTTP side: sampling checks and OpenAI's chunk shapes.

Corresponds to vLLM's `vllm/entrypoints/openai/serving_completion.py` and `serving_chat.py` at a small
size. `sampling_params_for` turns a request body into the engine's SamplingParams (or an HTTP error),
`stop` strings included: AsyncLLM's OutputProcessor applies them to the text (engine/output_processor.py). The
chunk builders give OpenAI's stream shapes; the fan-out over prompts and `n` samples and the
response bodies are in serving_response.py.

Left out: reasoning parsers,
beam search, multimodal content, LoRA model names, a request-level chat template (refused), and `best_of` and
`suffix` (refused).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from typing import Any

from attention_kv_caceh.engine.request import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, SamplingParams
from attention_kv_caceh.engine.structured_output.params import StructuredOutputsParams
from attention_kv_caceh.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    refused_field,
)

__all__ = [
    "DEFAULT_MAX_LOGPROBS",
    "DEFAULT_MAX_SEQS_PER_REQUEST",
    "DONE",
    "MAX_N",
    "HTTPError",
    "chat_chunk",
    "check_fan_out",
    "check_request_fields",
    "completion_chunk",
    "sampling_params_for",
    "sse",
    "usage",
]

DONE = b"data: [DONE]\n\n"
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_N = 128  # most samples per prompt (each is an engine request)
DEFAULT_MAX_SEQS_PER_REQUEST = 4096  # most engine requests (prompts x n) one HTTP request may fan out to


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


def _check_token_ids(ids: Sequence[int], vocab_size: int | None, param: str) -> None:
    for t in ids:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            upper = "" if vocab_size is None else f", {vocab_size}"
            raise HTTPError(400, f"{param} must hold token ids in [0{upper}), got {t}", param)


def _logit_bias(raw: dict[str, float] | None, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    pairs: list[tuple[int, float]] = []
    for key, bias in raw.items():
        if re.fullmatch(r"-?[0-9]{1,20}", key) is None:  # int() would also take " 5", "1_0" and 5000 digits
            raise HTTPError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        token_id = int(key)
        _check_token_ids([token_id], vocab_size, "logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise HTTPError(400, f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
        pairs.append((token_id, bias))
    return tuple(pairs)


def check_request_fields(body: GenerationRequest, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
    """The checks that do not depend on the prompt: refused fields, `stream_options` without `stream`
    (a 400, as vLLM answers), `n`, echo in chat, the logprobs counts. Raises HTTPError(400) naming the
    field."""
    refused = refused_field(body)
    if refused is not None:
        raise HTTPError(400, f"`{refused}` is not supported by this server", refused)
    if body.stream_options is not None and not body.stream:
        raise HTTPError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    if not 1 <= body.n <= MAX_N:
        raise HTTPError(400, f"n must be in [1, {MAX_N}], got {body.n}", "n")
    if isinstance(body, ChatCompletionRequest):
        if body.echo:
            raise HTTPError(400, "echo is not supported for chat completions", "echo")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= max_logprobs:
            raise HTTPError(
                400, f"top_logprobs must be in [0, {max_logprobs}], got {body.top_logprobs}", "top_logprobs"
            )
        if body.top_logprobs and not body.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = body.logprobs if isinstance(body, CompletionRequest) else None
    if logprobs is not None and not 0 <= logprobs <= max_logprobs:
        raise HTTPError(400, f"logprobs must be in [0, {max_logprobs}], got {logprobs}", "logprobs")


def prompt_too_long(max_model_len: int, num_tokens: int, exact: bool, param: str = "prompt") -> HTTPError:
    """The 400 for a prompt of `num_tokens` tokens (`exact` False: at least that many, the tokenizer's
    lower bound for a text too long to encode whole, see Tokenizer.encode_counted) that leaves no room
    for a completion in `max_model_len`."""
    size = f"{num_tokens} tokens" if exact else f"at least {num_tokens} tokens"
    return HTTPError(
        400,
        f"This model's maximum context length is {max_model_len} tokens; the prompt is {size} and "
        "leaves no room for a completion.",
        param,
    )


def check_fan_out(num_prompts: int, n: int, max_seqs_per_request: int) -> None:
    """Refuse a request that fans out to more than `max_seqs_per_request` engine requests (`num_prompts`
    prompts times `n` samples; the server's --max-seqs-per-request): HTTPError(400) naming the count and
    the limit, `param` "prompt" when the prompts alone are too many, else "n"."""
    count = num_prompts * n
    if count > max_seqs_per_request:
        param = "prompt" if num_prompts > max_seqs_per_request else "n"
        raise HTTPError(
            400,
            f"the request fans out to {count} sequences ({num_prompts} prompts x n = {n}); this server "
            f"serves at most {max_seqs_per_request} per request (--max-seqs-per-request)",
            param,
        )


def sampling_params_for(
    body: GenerationRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int | None,
    *,
    vocab_size: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams for a prompt of `num_prompt_tokens` tokens (with `n` > 1, AsyncLLM gives sample `i`
    the seed `seed + i`, engine/parallel_sampling.py).

    `max_completion_tokens` wins over `max_tokens`; when neither is given, `default_max_tokens` (None: the
    rest of the context). Either way max_tokens is then capped to the rest of the context,
    `max_model_len - num_prompt_tokens`, as vLLM's `get_max_tokens` caps it: a request whose prompt and
    max_tokens pass the context is served with fewer tokens (finish_reason "length"), not refused.
    `max_tokens: 0` is accepted with `echo` only (the engine then runs one token, which the response
    drops). `temperature` defaults to 1.0 as in OpenAI's API; `top_k` of 0 or -1 disables it.
    `structured_outputs`: the compiled constraint the output follows (None: none). The body has passed
    `check_request_fields` (OpenAIServing.check_generation, once per request, before any tokenizing).
    Raises HTTPError(400), naming the field as `param`, for an empty prompt, a prompt of `max_model_len` tokens or more (the message
    gives its exact length), max_tokens <= 0 (without echo; a chat request's message names no echo) or
    above `max_model_len`, a sampling value
    out of range (temperature not finite or < 0, top_p not in (0, 1], top_k < -1, seed < 0, min_tokens
    not in [0, max_tokens] after the cap, a frequency or presence penalty outside [-2, 2], a
    repetition_penalty outside [1e-100, 1e100], a logit_bias value outside [-100, 100]), a token id
    (stop_token_ids, logit_bias) outside [0, vocab_size), or min_tokens with stop_token_ids that list
    every token id (nothing could be sampled).
    """
    echo = isinstance(body, CompletionRequest) and body.echo
    max_tokens, room = _max_tokens(body, num_prompt_tokens, max_model_len, default_max_tokens, echo)
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
    if not 0 <= body.min_tokens <= max_tokens:
        capped = "" if max_tokens == room else " (capped to the context left after the prompt)"
        raise HTTPError(
            400,
            f"min_tokens must be in [0, max_tokens = {max_tokens}]{capped}, got {body.min_tokens}",
            "min_tokens",
        )
    stop_ids = list(body.stop_token_ids or [])
    _check_token_ids(stop_ids, vocab_size, "stop_token_ids")
    penalties, repetition = _penalties(body)
    if body.min_tokens > 0 and vocab_size is not None and len(set(stop_ids)) >= vocab_size:
        raise HTTPError(
            400,
            f"stop_token_ids list every token id, so min_tokens = {body.min_tokens} leaves nothing to sample",
            "stop_token_ids",
        )
    num_logprobs = body.num_logprobs
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        stop_token_ids=tuple(dict.fromkeys(stop_ids)),
        min_tokens=body.min_tokens,
        frequency_penalty=penalties["frequency_penalty"],
        presence_penalty=penalties["presence_penalty"],
        repetition_penalty=repetition,
        logit_bias=_logit_bias(body.logit_bias, vocab_size),
        logprobs=num_logprobs,
        prompt_logprobs=num_logprobs if echo else None,
        stop=_stop_strings(body.stop_strings),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        structured_outputs=structured_outputs,
    )


def _max_tokens(
    body: GenerationRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int | None,
    echo: bool,
) -> tuple[int, int]:
    """(max_tokens capped to the context left after the prompt, that room), as sampling_params_for
    documents; HTTPError 400 for an empty or too long prompt and a max_tokens out of range."""
    if num_prompt_tokens == 0:
        raise HTTPError(400, "the prompt is empty", "prompt")
    if num_prompt_tokens >= max_model_len:
        raise prompt_too_long(max_model_len, num_prompt_tokens, exact=True)
    room = max_model_len - num_prompt_tokens
    param, max_tokens = body.requested_max_tokens
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else default_max_tokens
    if max_tokens == 0 and echo:
        max_tokens = 1  # the prompt's logprobs only: one token is sampled and dropped
    if max_tokens <= 0:  # `echo` is a completions field: a chat request's message names chat fields only
        with_echo = " (or 0 with echo)" if isinstance(body, CompletionRequest) else ""
        raise HTTPError(400, f"{param} must be at least 1{with_echo}, got {max_tokens}", param)
    if max_tokens > max_model_len:
        raise HTTPError(
            400,
            f"{param} = {max_tokens} is more than this model's maximum context length, {max_model_len} "
            "tokens",
            param,
        )
    return min(max_tokens, room), room


def _penalties(body: GenerationRequest) -> tuple[dict[str, float], float]:
    """({"frequency_penalty", "presence_penalty"}, repetition_penalty) with their defaults; HTTPError 400
    naming the first one out of range."""
    penalties = {
        "frequency_penalty": 0.0 if body.frequency_penalty is None else body.frequency_penalty,
        "presence_penalty": 0.0 if body.presence_penalty is None else body.presence_penalty,
    }
    for name, value in penalties.items():
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise HTTPError(400, f"{name} must be in [-2, 2], got {value}", name)
    repetition = 1.0 if body.repetition_penalty is None else body.repetition_penalty
    if not 1 / MAX_REPETITION_PENALTY <= repetition <= MAX_REPETITION_PENALTY:  # keeps the sampler finite
        raise HTTPError(
            400, f"repetition_penalty must be in [1e-100, 1e100], got {repetition}", "repetition_penalty"
        )
    return penalties, repetition


def _stop_strings(stops: list[str]) -> tuple[str, ...]:
    """`stop` checked: HTTPError 400 (param "stop") for an empty string, which vLLM's SamplingParams
    refuses too ("stop cannot contain an empty string")."""
    if any(not s for s in stops):
        raise HTTPError(400, f"stop cannot contain an empty string (got {stops!r})", "stop")
    return tuple(stops)


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
        "choices": [] if choice is None else [choice],
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
    *,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A /v1/completions stream chunk for choice `index`; `text=None` gives a usage-only chunk (`choices: []`)."""
    choice = None
    if text is not None:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _stream_chunk("text_completion", request_id, model, created, choice, usage_obj)


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage_obj: dict[str, int] | None = None,
    *,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A /v1/chat/completions stream chunk for choice `index`; `delta=None` gives a usage-only chunk."""
    choice = None
    if delta is not None:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _stream_chunk("chat.completion.chunk", request_id, model, created, choice, usage_obj)


def now_s() -> int:
    """Unix time in whole seconds (the `created` field)."""
    return int(time.time())
