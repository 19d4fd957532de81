"""A budget on the large request bodies served at once: past it, 503 with Retry-After, never more memory.

The API process holds a request body several times while it serves it: the bytes received, the parsed
JSON, the validated request, the prompt's text and tokens (about 5 times the body for a prompt of
`/v1/completions`, about 9 times for `/tokenize`, whose answer lists every token; measured in
docs/results.md). `--max-request-bytes` bounds one body; this bounds how many are served together. Every
body of `LARGE_BODY_BYTES` or more reserves its size from a budget of `max_bytes_in_flight` for as long as
its request is served (a stream: until it ends). The bytes are reserved as they arrive, whatever the
Content-Length says, so a client that declares a large body and sends nothing holds nothing; a body is
refused with 503 and `Retry-After: 1` in OpenAI's error shape when its next chunk does not fit (vLLM
answers an overloaded server with 503 too), after its remaining bytes are read and dropped
(`drop_body`), so a client that writes its whole body before reading sees the 503. Smaller bodies are not counted: they cost little, and a budget on them would refuse
ordinary traffic. A `/tokenize` body counts `TOKENIZE_WEIGHT` times its size (at most the whole budget,
so one is always served alone): it must count every token, and a text with no space to cut it at is
tokenized whole, about 150 bytes per character while the `tokenizers` library works (generation
requests read only the head of such a text; engine/tokenizer.py).

vLLM has no counterpart: its API server reads each request body whole and puts no bound on the bytes of the
bodies it holds at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from attention_kv_caceh.entrypoints.openai.protocol import error_body, error_response

__all__ = [
    "BODY_TIMEOUT_S",
    "DROP_TIMEOUT_S",
    "LARGE_BODY_BYTES",
    "TOKENIZE_WEIGHT",
    "BodyBudgetMiddleware",
    "drop_body",
]

LARGE_BODY_BYTES = 256 * 1024
"""A body this large or larger counts against the budget (256 KiB)."""

RETRY_AFTER_S = 1
TOKENIZE_WEIGHT = 4


DROP_TIMEOUT_S = 10.0
"""The longest a refused body is read (and dropped) before its answer goes out (`drop_body`)."""

BODY_TIMEOUT_S = 60.0
"""A large body must have arrived whole this many seconds after its request began, or it gets 408 and its
bytes go back to the budget: a client that declares 8 MB and sends nothing holds none for long."""


class BodyOverBudget(StarletteHTTPException):
    """A chunk of a body did not fit the budget. An HTTPException, so that FastAPI, reading the body,
    lets it through instead of answering 400; the app's handler for it re-raises it, so that this
    middleware answers (it drops the rest of the body first)."""

    def __init__(self) -> None:
        super().__init__(503, "over the budget of large bodies")


class _Stalled(StarletteHTTPException):
    """A large body did not arrive in time (an HTTPException: FastAPI answers it when it is reading the
    body, this middleware when the size check was)."""

    def __init__(self) -> None:
        super().__init__(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s")


class BodyBudgetMiddleware:
    """Reserve each large body's bytes from `max_bytes_in_flight` while its request is served; refuse
    with 503 + Retry-After a body that does not fit. A body whose Content-Length is over
    `max_request_bytes` is left to the 413 of the size check (never refused as 503). A plain ASGI
    middleware: streaming and disconnect detection are untouched.

    Attributes:
        in_flight: bytes reserved now; refused: bodies refused so far.
    """

    def __init__(self, app: ASGIApp, max_bytes_in_flight: int, max_request_bytes: int) -> None:
        if max_bytes_in_flight < max_request_bytes:
            raise ValueError(
                f"max_bytes_in_flight ({max_bytes_in_flight}) must be >= max_request_bytes "
                f"({max_request_bytes}), or a body of the largest size would never be served"
            )
        self.app = app
        self.max_bytes_in_flight = max_bytes_in_flight
        self.max_request_bytes = max_request_bytes
        self.in_flight = 0
        self.refused = 0

    def _take(self, n: int) -> bool:
        # one event loop runs every request: no lock is needed between the check and the add
        if self.in_flight + n > self.max_bytes_in_flight:
            return False
        self.in_flight += n
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if length is not None and length.isdigit():
            size = int(length)
            if size < LARGE_BODY_BYTES or size > self.max_request_bytes:
                await self.app(scope, receive, send)
                return
        await self._serve_counted(scope, receive, send)

    def _cost(self, scope: Scope, size: int) -> int:
        """What a body of `size` bytes reserves: its size, TOKENIZE_WEIGHT times that for /tokenize."""
        weight = TOKENIZE_WEIGHT if str(scope.get("path", "")).rstrip("/") == "/tokenize" else 1
        return min(size * weight, self.max_bytes_in_flight)

    async def _serve_counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, its body's bytes reserved as they arrive: 503 (after dropping the rest of the body)
        when a chunk does not fit, 408 when the body stalls, both only before anything was answered."""
        received = 0
        reserved = 0
        started = False
        more = True  # more of the body is to come
        timed = _deadline(receive)

        async def counting_receive() -> Message:
            nonlocal received, reserved, more
            message = await timed()
            if message["type"] == "http.request":
                more = bool(message.get("more_body", False))
                received += len(message.get("body", b""))
                cost = self._cost(scope, received)
                if received >= LARGE_BODY_BYTES and cost > reserved:
                    if not self._take(cost - reserved):
                        raise BodyOverBudget
                    reserved = cost
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyOverBudget:
            if started:
                raise
            self.in_flight -= reserved  # nothing of it is kept while the rest is dropped
            reserved = 0
            if more:
                await drop_body(timed, received, self.max_request_bytes, DROP_TIMEOUT_S)
            length = Headers(scope=scope).get("content-length")
            await self._refuse(scope, receive, send, int(length) if length and length.isdigit() else received)
        except _Stalled as exc:
            if started:
                raise
            await error_response(408, str(exc.detail))(scope, receive, send)
        finally:
            self.in_flight -= reserved

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        self.refused += 1
        message = (
            f"the server is serving {self.in_flight} bytes of large request bodies, and this one "
            f"({size} bytes) would pass its limit of {self.max_bytes_in_flight} "
            f"(--max-request-bytes-in-flight); retry in {RETRY_AFTER_S} s"
        )
        body: dict[str, Any] = error_body(503, message)
        response = JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        await response(scope, receive, send)


async def drop_body(receive: Receive, received: int, limit: int, timeout_s: float) -> None:
    """Read and drop the rest of a request body while the bytes read (`received` so far) stay within
    `limit` and for at most `timeout_s` seconds; return at its end, or when the client leaves. A
    server that answers and closes with unread bytes in its socket sends RST, so a client that writes
    its whole body before reading its answer (Python's urllib and http.client) would see a
    BrokenPipe or a reset instead of the answer."""
    with contextlib.suppress(TimeoutError, _Stalled):
        async with asyncio.timeout(timeout_s):
            while received <= limit:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


def _deadline(receive: Receive) -> Receive:
    """`receive`, raising _Stalled when the body is not whole BODY_TIMEOUT_S after the first call; the
    messages after the body (a disconnect the server waits for) are not timed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_TIMEOUT_S
    whole = False

    async def timed() -> Message:
        nonlocal whole
        if whole:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
        except TimeoutError:
            raise _Stalled from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            whole = True
        return message

    return timed
