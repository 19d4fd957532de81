"""The scripts of the scripted server (`scripted_server.py`): SSE frames, OpenAI completion and chat
chunks, and a `Script` (the HTTP status and a list of (delay, bytes) steps). `timed_token_script` builds
the common case: the first token `ttft_s` after the request arrives, then one token every `itl_s`,
scheduled on absolute deadlines (so the server's own lateness does not pile up), with vLLM-style
continuous usage, a final usage-only chunk and `[DONE]`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["DONE", "Script", "Step", "chat_chunk", "completion_chunk", "sse", "timed_token_script"]

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One `data:` event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def completion_chunk(
    text: str | None, usage: dict[str, int] | None = None, *, finish_reason: str | None = None
) -> bytes:
    """A `/v1/completions` stream chunk; `text=None` gives a usage-only chunk (`choices: []`)."""
    choices: list[dict[str, Any]] = (
        [] if text is None else [{"index": 0, "text": text, "finish_reason": finish_reason}]
    )
    obj: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion", "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return sse(obj)


def chat_chunk(
    content: str | None = None,
    *,
    role: str | None = None,
    usage: dict[str, int] | None = None,
    no_choices: bool = False,
    tool_arguments: str | None = None,
    finish_reason: str | None = None,
) -> bytes:
    """A `/v1/chat/completions` stream chunk (a role-only chunk when only `role` is given);
    `tool_arguments` puts a fragment of a tool call's arguments in `delta.tool_calls`."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_arguments is not None:
        delta["tool_calls"] = [{"index": 0, "function": {"arguments": tool_arguments}}]
    choices: list[dict[str, Any]] = (
        [] if no_choices else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    )
    obj: dict[str, Any] = {"id": "chat-1", "object": "chat.completion.chunk", "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return sse(obj)


@dataclass(frozen=True)
class Step:
    """Wait `delay_s` (relative to the previous step, or absolute from the request's arrival when
    `absolute` is set), then write `data`."""

    delay_s: float
    data: bytes
    absolute: bool = False


@dataclass(frozen=True)
class Script:
    """How to answer one request: a non-200 `status` answers `body` at once; a 200 streams `steps`;
    `abort` then drops the connection without ending the chunked body (a stream cut mid-way);
    `headers` are added to a non-200 answer (e.g. a `Location` for a redirect)."""

    steps: tuple[Step, ...] = ()
    status: int = 200
    body: bytes = b""
    abort: bool = False
    headers: tuple[tuple[str, str], ...] = ()


def timed_token_script(
    ttft_s: float, itl_s: float, n_tokens: int, *, chat: bool = False, prompt_tokens: int = 8
) -> Script:
    """First token at `ttft_s` after arrival, token k at `ttft_s + k * itl_s` (absolute deadlines), each
    chunk with cumulative usage; then a usage-only chunk and `[DONE]`. Chat streams open with a
    role-only chunk at arrival."""
    steps: list[Step] = []
    if chat:
        steps.append(Step(0.0, chat_chunk(role="assistant"), absolute=True))
    for k in range(n_tokens):
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": k + 1}
        data = chat_chunk(f" t{k}", usage=usage) if chat else completion_chunk(f" t{k}", usage)
        steps.append(Step(ttft_s + k * itl_s, data, absolute=True))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens}
    final = chat_chunk(usage=usage, no_choices=True) if chat else completion_chunk(None, usage)
    steps += [Step(0.0, final), Step(0.0, DONE)]
    return Script(tuple(steps))
