"""A lean HTTP/1.1 client for the load's streamed POSTs: the bytes of a response body go to the stream
decoder inside the transport's read callback (`buffer_updated`), timestamped there.

Why not aiohttp for these: every read of a stream went through aiohttp's StreamReader (a Python call per
HTTP chunk of the chunked body, a future and a task switch per read), about as much CPU as decoding the
SSE events themselves, and a client that spends its core there reads a fast server slower than it
streams. Here one `buffer_updated` call does everything for the bytes it got: it takes the chunked
framing apart with a few `bytes.find` calls and hands the payload to `on_body(data, time_ns)`, with
`time_ns` the moment the bytes were handed over by the event loop, before any task ran.

What it does: `http://` only; `POST` with a `Content-Length` body; keep-alive connections, reused last
in first out, opened on demand (or ahead, `open`, each by a `GET`); bodies framed by `Transfer-Encoding: chunked`, by
`Content-Length`, or by the connection's close; `Content-Encoding: gzip` or `deflate` decoded (it asks
for `identity`). What it leaves to aiohttp (the caller's fallback): TLS, redirects, proxies, other
encodings. Failures are raised as StreamHTTPError with a `records.FAILURE_KINDS` kind:
`connection_error` / `dns_error` (could not connect), `connection_closed` (closed before the status
line), `stream_cut` (closed or unparsable after it); a timeout as TimeoutError.
"""

from __future__ import annotations

import asyncio
import socket
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, cast

__all__ = ["StreamClient", "StreamHTTPError", "StreamResponse"]

_READ_BYTES = 256 * 1024  # one read's buffer, as asyncio's transports read
_MAX_HEAD_BYTES = 64 * 1024  # a status line and headers longer than this are not an HTTP answer
_MAX_ERROR_BODY = 64 * 1024  # of a non-200 answer, what is kept for the record's error text

BodySink = Callable[[bytes, int], bool]  # (payload bytes, their time in ns) -> True once done


class StreamHTTPError(Exception):
    """A request that failed below HTTP: `kind` is a records.FAILURE_KINDS name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class StreamResponse:
    """The answer's status, its headers (lower-case names) and, unless it was 200, its body (bytes, cut
    at _MAX_ERROR_BODY)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=lambda: dict[str, str]())
    body: bytes = b""


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection and the response being read on it. A buffered protocol: the transport
    reads into this connection's own buffer (`get_buffer`), where a plain protocol's transport allocates
    256 KiB for every read."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._read = bytearray(_READ_BYTES)
        self._view = memoryview(self._read)
        self._reset(None, None)
        self.done = None

    def _reset(self, sink: BodySink | None, done: asyncio.Future[StreamResponse] | None) -> None:
        self.sink = sink
        self.done = done
        self.response = StreamResponse()
        # "head" (status line and headers), then the body: "size" / "data" / "crlf" / "trailers" of a
        # chunked one, "length" or "close" of the others; "end" once it is read to its end
        self.state = "head"
        self.left = 0  # bytes left of the current chunk ("data") or of the body ("length")
        self.finished = False  # the sink said it has what it needs
        self.inflate: Any = None
        self._buffer.clear()

    # -------------------------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # a stream transport (uvloop's too)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is None or self.done.done():
            return
        if self.state == "close":
            self.state = "end"
            self._complete()  # a body framed by the close: its end
        elif self.state == "head" and not self._buffer:
            why = exc or "EOF"
            self._fail("connection_closed", f"the server closed the connection without answering ({why})")
        else:
            self._fail("stream_cut", f"the connection broke mid-stream ({exc or 'EOF'})")

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        now = perf_counter_ns()
        if self.done is None or self.done.done():
            return  # bytes after a finished response: the connection is not reused
        self._buffer += self._view[:nbytes]
        try:
            pieces = self._parse()
            payload = b"".join(pieces)
            if payload and self.inflate is not None:
                payload = self.inflate.decompress(payload)
        except (ValueError, zlib.error) as exc:
            self._fail("stream_cut", f"the response could not be read ({type(exc).__name__}: {exc})")
            return
        if payload and self.sink is not None and not self.finished and self.sink(payload, now):
            self.finished = True
        if self.finished or self.state == "end":
            self._complete()

    # -------------------------------------------------------------------------------------- parsing

    def _parse(self) -> list[bytes | bytearray]:
        """Take what is complete off the buffer; returns the body's payload pieces. Raises ValueError for
        bytes that are not an HTTP response."""
        buffer, pieces, pos = self._buffer, list[bytes | bytearray](), 0
        while self.state != "end":
            n = len(buffer)
            if self.state == "head":
                end = buffer.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > _MAX_HEAD_BYTES:
                        raise ValueError(f"no end of the headers in {n - pos} bytes")
                    break
                self._read_head(bytes(buffer[pos:end]))
                pos = end + 4
            elif self.state in ("data", "length", "close"):
                take = n - pos if self.state == "close" else min(self.left, n - pos)
                if take == 0 and self.state != "length":
                    break
                pieces.append(buffer[pos : pos + take])
                pos += take
                self.left -= take if self.state != "close" else 0
                if self.state == "close" or self.left:
                    break
                self.state = "crlf" if self.state == "data" else "end"
            elif self.state == "crlf":
                if n - pos < 2:
                    break
                if not buffer.startswith(b"\r\n", pos):
                    raise ValueError("a chunk does not end in CRLF")
                pos += 2
                self.state = "size"
            elif self.state == "size" and (fast := self._whole_chunks(buffer, pos, pieces)) != pos:
                pos = fast  # whole chunks, taken in a tight loop; what is left goes the general way
            elif self.state == "size":
                eol = buffer.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > 1024:
                        raise ValueError("a chunk-size line longer than 1024 bytes")
                    break
                size = int(bytes(buffer[pos:eol]).split(b";", 1)[0].strip(), 16)
                if size < 0:
                    raise ValueError(f"a negative chunk size {size}")
                pos = eol + 2
                self.state, self.left = ("data", size) if size else ("trailers", 0)
            else:  # "trailers": nothing, or header lines, then an empty line
                if buffer.startswith(b"\r\n", pos):
                    pos += 2
                    self.state = "end"
                    continue
                end = buffer.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                pos = end + 4
                self.state = "end"
        del buffer[:pos]
        return pieces

    @staticmethod
    def _whole_chunks(buffer: bytearray, pos: int, pieces: list[bytes | bytearray]) -> int:
        """The common case of a chunked body: whole non-empty chunks `SIZE CRLF DATA CRLF` one after
        another, each put in `pieces`; returns where the first one that is not whole (or is the last
        chunk, or has an extension) starts."""
        find, n = buffer.find, len(buffer)
        while True:
            eol = find(b"\r\n", pos)
            if eol < 0 or eol - pos > 16:
                return pos
            try:
                size = int(buffer[pos:eol], 16)
            except ValueError:  # an extension, or not a size: the general path reads it
                return pos
            end = eol + 2 + size
            if size <= 0 or end + 2 > n or not buffer.startswith(b"\r\n", end):
                return pos
            pieces.append(buffer[eol + 2 : end])
            pos = end + 2

    def _read_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.response.status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.response.headers = headers
        coding = headers.get("transfer-encoding", "").lower()
        if self.response.status in range(100, 200):
            self.state = "head"  # an interim answer: the real one follows
            return
        if "chunked" in coding:
            self.state = "size"
        elif "content-length" in headers:
            self.state, self.left = "length", int(headers["content-length"])
        else:
            self.state = "close"
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding in ("gzip", "x-gzip"):
            self.inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self.inflate = zlib.decompressobj()
        elif encoding not in ("identity", ""):
            raise ValueError(f"Content-Encoding {encoding!r} is not one this client decodes")
        if self.response.status != 200:  # an error answer: its body is kept, not streamed
            self.sink = self._keep_body

    def _keep_body(self, data: bytes, time_ns: int) -> bool:
        if len(self.response.body) < _MAX_ERROR_BODY:
            self.response.body += data[: _MAX_ERROR_BODY - len(self.response.body)]
        return False

    def _complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(self.response)

    def _fail(self, kind: str, message: str) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(StreamHTTPError(kind, message))
        if self.transport is not None:
            self.transport.close()

    @property
    def reusable(self) -> bool:
        """The last response was read to its end on an open connection the server keeps open."""
        keep = self.response.headers.get("connection", "").lower() != "close"
        return not self.closed and keep and self.state == "end" and not self._buffer

    def start(self, request: bytes, sink: BodySink, done: asyncio.Future[StreamResponse]) -> None:
        self._reset(sink, done)
        assert self.transport is not None
        self.transport.write(request)


class StreamClient:
    """Keep-alive HTTP/1.1 connections to one `host:port` for streamed POSTs (module docstring)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._idle: list[_Connection] = []
        self._host_header = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await loop.create_connection(_Connection, self.host, self.port)
        except socket.gaierror as exc:
            raise StreamHTTPError("dns_error", f"DNS lookup of {self.host} failed: {exc}") from None
        except ConnectionRefusedError as exc:
            raise StreamHTTPError("connection_error", f"connection refused: {exc}") from None
        except OSError as exc:
            raise StreamHTTPError(
                "connection_error", f"could not connect: {type(exc).__name__}: {exc}"
            ) from None
        return protocol

    async def open(self, n: int, path: str, headers: dict[str, str], timeout_s: float) -> int:
        """Open up to `n` keep-alive connections now, each by a `GET path` read to its end (so that a
        burst of requests finds them open and known to answer); returns how many answered. Failures
        are left to the requests to meet."""

        async def one() -> _Connection | None:
            try:
                async with asyncio.timeout(timeout_s):
                    connection = await self._connect()
                    done: asyncio.Future[StreamResponse] = asyncio.get_running_loop().create_future()
                    connection.start(self._request("GET", path, headers, b""), lambda data, now: False, done)
                    await done
            except (StreamHTTPError, TimeoutError, OSError):
                return None
            return connection if connection.reusable else None

        opened = [c for c in await asyncio.gather(*(one() for _ in range(n))) if c is not None]
        self._idle += opened
        return len(opened)

    def _request(self, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self._host_header}", f"Content-Length: {len(body)}"]
        lines += ["Accept-Encoding: identity", *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def _take(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        return None

    async def post(
        self, path: str, headers: dict[str, str], body: bytes, sink: BodySink, timeout_s: float
    ) -> StreamResponse:
        """POST `body` to `path`; every piece of a 200 answer's body goes to `sink(data, time_ns)` as it
        arrives, until the body ends or `sink` returns True. Returns the answer (with its body when not
        200). Raises StreamHTTPError, or TimeoutError after `timeout_s` in all."""
        request = self._request("POST", path, headers, body)
        connection: _Connection | None = None
        try:
            async with asyncio.timeout(timeout_s):
                connection = self._take() or await self._connect()
                done: asyncio.Future[StreamResponse] = asyncio.get_running_loop().create_future()
                connection.start(request, sink, done)
                response = await done
        except BaseException:
            if connection is not None and connection.transport is not None:
                connection.transport.close()
            raise
        if connection.reusable:
            self._idle.append(connection)
        elif connection.transport is not None:
            connection.transport.close()
        return response

    def close(self) -> None:
        """Close every idle connection."""
        for connection in self._idle:
            if connection.transport is not None:
                connection.transport.close()
        self._idle.clear()
