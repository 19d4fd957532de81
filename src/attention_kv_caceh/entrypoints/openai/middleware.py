"""The ASGI middleware in front of every route: the API key, and the bound on one request body's size.

Both are plain ASGI middleware (not Starlette's BaseHTTPMiddleware), so streaming and disconnect
detection are untouched. `ApiKeyMiddleware` corresponds to vLLM's `AuthenticationMiddleware`
(`vllm/entrypoints/openai/api_server.py`): with `--api-key`, 401 on every path but OPEN_PATHS, failing
closed so a route added later is keyed too. `BodySizeMiddleware` answers 413 for a body over
`max_bytes` before any of it is parsed, and after a body of `_RELEASE_AFTER_BYTES` or more hands the
freed heap back to the OS (glibc's `malloc_trim(0)`, engine/malloc.py). A refused body is read and
dropped first, within bounds (`body_budget.drop_body`), so a client that writes its whole body before
it reads sees the answer, not a reset connection.

vLLM has no counterpart of the body limit: its server reads each body whole. Left out: vLLM's other
middleware (CORS, the request-id header, `--middleware` plug-ins, the scaling middleware).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from attention_kv_caceh.engine.malloc import release_freed_memory
from attention_kv_caceh.entrypoints.openai.body_budget import DROP_TIMEOUT_S, drop_body
from attention_kv_caceh.entrypoints.openai.protocol import error_response

__all__ = ["OPEN_PATHS", "ApiKeyMiddleware", "BodySizeMiddleware"]

_RELEASE_AFTER_BYTES = 256 * 1024  # after a request body this large, hand the freed heap back to the OS
_DRAIN_FACTOR = 8  # a refused body up to this many times --max-request-bytes is read (and dropped) first

# With an API key, every path needs it except these: health probes, metrics scraping and the API's own
# docs, the public endpoints of vLLM's AuthenticationMiddleware that this server has. None of them names
# a request (/debug/step_stats, which lists request ids, needs the key).
OPEN_PATHS = ("/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class BodySizeMiddleware:
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


class ApiKeyMiddleware:
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
