"""The choices of one response, over prompts and samples, streamed interleaved or gathered.

Corresponds to the response builders of vLLM's `vllm/entrypoints/openai/serving_completion.py` /
`serving_chat.py`. A request with several prompts and `n` samples is `len(prompts) * n` engine
requests (AsyncLLM.add_parallel_request fans each prompt out, engine/parallel_sampling.py), choice
index `prompt_index * n + sample_index`. `stream_events`
interleaves the choices' chunks as they come, each index finishing once; `whole_response` gathers them,
sorted by index. Usage counts each prompt once and every completion token. `echo` puts the prompt's text
(and, with logprobs, its tokens' logprobs, the first null) before each choice's text; `max_tokens: 0`
with `echo` returns the prompt alone (the engine samples one token, which is dropped, as vLLM does).
Logprobs objects come from engine/logprobs.py. A chat request with tools (tool_calls.py's ToolsPlan)
has each choice's output read as tool calls: the message's `tool_calls` (whole) or OpenAI's `tool_calls`
deltas (streamed), and finish_reason "tool_calls" when the output made calls and stopped on its own.

Left out: vLLM's gathering of a request's samples in the engine's output processor (each sample has its
own stream, interleaved or gathered here), and beam search.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response

from attention_kv_caceh.engine.core_client import EngineDeadError
from attention_kv_caceh.engine.logprobs import chat_logprobs, completion_logprobs
from attention_kv_caceh.engine.output_processor import (
    EngineRequestError,
    EngineStepError,
    RequestDelta,
)
from attention_kv_caceh.engine.parallel_sampling import ChildRequest
from attention_kv_caceh.engine.request import TokenLogprobs, decode_logprobs_payloads
from attention_kv_caceh.engine.tokenizer import TextDecoder
from attention_kv_caceh.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    error_body,
    error_response,
)
from attention_kv_caceh.entrypoints.openai.serving import DONE, chat_chunk, completion_chunk, sse, usage
from attention_kv_caceh.entrypoints.openai.tool_calls import ToolCallStream, ToolsPlan

__all__ = ["Choice", "close_all", "stream_events", "whole_response"]


@dataclass
class Choice(ChildRequest):
    """One choice of a response: its engine request (a ChildRequest, whose `index` is the choice index,
    prompt_index * n + sample_index, and whose siblings start after its leader's first token; see
    engine/parallel_sampling.py) and what its output needs.

    Attributes:
        echo_text: the prompt's text to put before the choice's text ("" without echo).
        echo_only: `max_tokens: 0` with echo: the prompt alone, the sampled token dropped.
        the others: filled while the response is written.
    """

    echo_text: str = ""
    echo_only: bool = False
    text_offset: int = 0
    num_echo_tokens: int = 0  # prompt tokens at the head of logprob_tokens
    started: bool = False
    finished: bool = False
    num_output_tokens: int = 0
    parts: list[str] = field(default_factory=list[str])
    logprob_tokens: list[tuple[int, TokenLogprobs | None]] = field(
        default_factory=list[tuple[int, TokenLogprobs | None]]
    )
    chat_entries: list[TokenLogprobs] = field(default_factory=list[TokenLogprobs])

    @property
    def first_prompt(self) -> bool:
        """Whether this choice's prompt is counted in the usage: the first sample of a prompt."""
        return self.leader is None


def _prompt_logprob_tokens(
    prompt: list[int], entries: tuple[TokenLogprobs, ...] | None
) -> list[tuple[int, TokenLogprobs | None]]:
    """(token, logprobs) of the echoed prompt: the first token has none; missing entries give None."""
    got = entries or ()
    return [(t, None if j == 0 or j - 1 >= len(got) else got[j - 1]) for j, t in enumerate(prompt)]


def _apply_delta(
    choice: Choice, delta: RequestDelta, body: GenerationRequest, tokenizer: TextDecoder, *, chat: bool
) -> tuple[str, dict[str, Any] | None]:
    """Record `delta` in `choice`; return the text this delta adds to the choice and its logprobs object
    (None when the request asked for none, or the delta adds no token)."""
    text = delta.text
    tokens: list[tuple[int, TokenLogprobs | None]] = []
    want = body.num_logprobs is not None
    sampled, prompt_logprobs = decode_logprobs_payloads(delta.new_logprobs) if want else ([], None)
    if not choice.started:
        choice.started = True
        if choice.echo_text or choice.echo_only:
            text = choice.echo_text + ("" if choice.echo_only else text)
            if want:
                tokens.extend(_prompt_logprob_tokens(choice.prompt_token_ids, prompt_logprobs))
                choice.num_echo_tokens = len(tokens)
    elif choice.echo_only:
        text = ""
    if not choice.echo_only:
        choice.num_output_tokens = delta.num_output_tokens
        if want:
            tokens.extend(zip(delta.new_token_ids, sampled, strict=False))
    choice.parts.append(text)
    if not want or not tokens:
        return text, None
    if chat:
        entries = [e for _, e in tokens if e is not None]
        choice.chat_entries.extend(entries)
        return text, chat_logprobs(entries, tokenizer)
    head = len(choice.logprob_tokens)
    choice.logprob_tokens.extend(tokens)
    obj, choice.text_offset = _completion_logprobs(choice, tokenizer, head, choice.text_offset)
    return text, obj


def _completion_logprobs(
    choice: Choice, tokenizer: TextDecoder, start: int, text_offset: int
) -> tuple[dict[str, Any], int]:
    """The logprobs object of `choice.logprob_tokens[start:]` from `text_offset`: the echoed prompt's
    tokens count as the echo text holds them (no special tokens: a text prompt's BOS is not in it), the
    output's as `skip_special_tokens` leaves them."""
    tokens = choice.logprob_tokens[start:]
    split = max(choice.num_echo_tokens - start, 0)
    head, offset = completion_logprobs(tokens[:split], tokenizer, text_offset)
    tail, offset = completion_logprobs(
        tokens[split:], tokenizer, offset, skip_special_tokens=choice.params.skip_special_tokens
    )
    return {key: head[key] + tail[key] for key in head}, offset


def _usage_of(choices: Sequence[Choice]) -> dict[str, int]:
    prompt = sum(len(c.prompt_token_ids) for c in choices if c.first_prompt)
    return usage(prompt, sum(c.num_output_tokens for c in choices))


_END = object()


async def _interleaved(
    choices: Sequence[Choice], body: GenerationRequest, tokenizer: TextDecoder
) -> AsyncIterator[tuple[Choice, RequestDelta]]:
    """Every choice's RequestDeltas, in the order they come (one task per choice feeds one queue).

    Raises the first EngineStepError / EngineRequestError a choice's stream raises.
    """

    if len(choices) == 1:
        async for delta in choices[0].deltas():
            yield choices[0], delta
        return
    queue: asyncio.Queue[tuple[Choice, object]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in choice.deltas():
                queue.put_nowait((choice, delta))
        except Exception as exc:  # handed to the reader, which raises it
            queue.put_nowait((choice, exc))
        finally:
            queue.put_nowait((choice, _END))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            choice, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            elif isinstance(item, RequestDelta):
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()


def _stream_flags(body: GenerationRequest) -> tuple[bool, bool]:
    options = body.stream_options
    if options is None:
        return False, False
    return options.include_usage, options.continuous_usage_stats


def close_all(choices: Sequence[Choice]) -> None:
    """Abort every choice's engine request that has not finished (idempotent)."""
    for choice in choices:
        choice.close()


async def stream_events(
    response_id: str,
    choices: Sequence[Choice],
    body: CompletionRequest | ChatCompletionRequest,
    tokenizer: TextDecoder,
    model: str,
    tools: ToolsPlan | None = None,
) -> AsyncIterator[bytes]:
    """The choices as SSE events in OpenAI's shapes, interleaved as their tokens come.

    Chat: a role-only first chunk per choice, then `delta.content` chunks; completions: `text` chunks (the
    first one carries the echo). Then a chunk with each choice's finish_reason (once per index), a
    usage-only chunk (`choices: []`) with `stream_options.include_usage`, and `data: [DONE]`. Every delta
    that brings tokens gets a chunk, with empty text when its text is not complete yet (a UTF-8 character
    cut, or text held back for a stop string), so a client can time every token, as vLLM's
    `completion_stream_generator` does. With `continuous_usage_stats` every chunk carries the usage so
    far. An engine error
    ends the stream with an error event (400 for a request the engine refused, 500 for a failed step).
    """
    chat = isinstance(body, ChatCompletionRequest)
    include_usage, continuous = _stream_flags(body)
    created = int(time.time())
    tool_streams: dict[int, ToolCallStream] = {}
    if chat and tools is not None:
        tool_streams = {c.index: tools.new_stream() for c in choices}

    def chunk(
        choice: Choice | None,
        text: str | None,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        usage_obj: dict[str, int] | None = None,
    ) -> bytes:
        """text None: the usage-only chunk; "" with a finish_reason: the finish chunk."""
        index = 0 if choice is None else choice.index
        if not chat:
            return sse(
                completion_chunk(
                    response_id,
                    model,
                    created,
                    text,
                    finish_reason,
                    usage_obj,
                    index=index,
                    logprobs=logprobs,
                )
            )
        delta = None if text is None else {} if finish_reason is not None and not text else {"content": text}
        return sse(
            chat_chunk(
                response_id, model, created, delta, finish_reason, usage_obj, index=index, logprobs=logprobs
            )
        )

    try:
        if chat:
            for choice in choices:
                yield sse(chat_chunk(response_id, model, created, {"role": "assistant"}, index=choice.index))
        async for choice, delta in _interleaved(choices, body, tokenizer):
            if choice.finished:
                continue
            text, logprobs = _apply_delta(choice, delta, body, tokenizer, chat=chat)
            per_chunk = _usage_of(choices) if continuous else None
            parser = tool_streams.get(choice.index)
            if parser is not None:
                final = delta.finish_reason is not None
                for i, tool_delta in enumerate(
                    parser.feed(text, final) or ([{}] if delta.new_token_ids and not final else [])
                ):
                    lp = logprobs if i == 0 else None
                    yield sse(
                        chat_chunk(
                            response_id,
                            model,
                            created,
                            tool_delta,
                            None,
                            per_chunk,
                            index=choice.index,
                            logprobs=lp,
                        )
                    )
            elif text or logprobs is not None or (delta.new_token_ids and delta.finish_reason is None):
                yield chunk(choice, text, None, logprobs, per_chunk)
            if delta.finish_reason is not None:
                choice.finished = True
                reason = "length" if choice.echo_only else delta.finish_reason
                if parser is not None and parser.num_calls and reason == "stop":
                    reason = "tool_calls"
                yield chunk(choice, "", reason, None, per_chunk)
            if choice.echo_only:
                choice.finished = True
                choice.close()
        if include_usage:
            yield chunk(None, None, usage_obj=_usage_of(choices))
    except EngineRequestError as exc:
        yield sse(error_body(400, str(exc)))
    except EngineStepError as exc:
        yield sse(error_body(500, str(exc)))
    except EngineDeadError as exc:
        yield sse(error_body(503, f"EngineDeadError: {exc}"))
    finally:
        close_all(choices)  # a client that left cancels this generator: abort its requests
    yield DONE


async def whole_response(
    response_id: str,
    choices: Sequence[Choice],
    body: CompletionRequest | ChatCompletionRequest,
    tokenizer: TextDecoder,
    model: str,
    tools: ToolsPlan | None = None,
) -> Response:
    """The choices gathered into one OpenAI response (choices sorted by index), or an error response;
    with `tools`, each chat message's tool calls read from its output."""
    chat = isinstance(body, ChatCompletionRequest)
    reasons: dict[int, str] = {}
    try:
        async for choice, delta in _interleaved(choices, body, tokenizer):
            if choice.index in reasons:
                continue
            _apply_delta(choice, delta, body, tokenizer, chat=chat)
            if delta.finish_reason is not None or choice.echo_only:
                reasons[choice.index] = "length" if choice.echo_only else delta.finish_reason or "stop"
                choice.close()
    except EngineRequestError as exc:
        return error_response(400, str(exc))
    except EngineStepError as exc:
        return error_response(500, str(exc))
    except EngineDeadError as exc:
        return error_response(503, f"EngineDeadError: {exc}")
    finally:
        close_all(choices)
    out: list[dict[str, Any]] = []
    for choice in sorted(choices, key=lambda c: c.index):
        text = "".join(choice.parts)
        reason = reasons.get(choice.index, "stop")
        logprobs: dict[str, Any] | None = None
        if body.num_logprobs is not None:
            if chat:
                logprobs = chat_logprobs(choice.chat_entries, tokenizer)
            else:
                logprobs = _completion_logprobs(choice, tokenizer, 0, 0)[0]
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tools is not None:
                content, calls = tools.new_stream().whole(text)
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                if calls and reason == "stop":
                    reason = "tool_calls"
            out.append(
                {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
            )
        else:
            out.append({"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": reason})
    obj = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": _usage_of(choices),
    }
    return JSONResponse(obj)
