"""The lean HTTP/1.1 client of the load: a response's body is the same bytes however the server splits
its writes (chunked framing with extensions and trailers, Content-Length, the connection's close, gzip),
an error answer's body is kept, connections are reused only when a response was read to its end, and
failures have their kind."""

from __future__ import annotations

import asyncio
import gzip
import random
import unittest
from collections.abc import Awaitable, Callable

from attention_kv_caceh.harness.http_stream import StreamClient, StreamHTTPError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    return head + await reader.readexactly(length)


def _chunked(parts: list[bytes], trailer: bytes = b"") -> bytes:
    body = b"".join(f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n" for p in parts)
    return body + b"0\r\n" + trailer + b"\r\n"


class LeanClientTest(unittest.IsolatedAsyncioTestCase):
    async def serve(
        self, answers: list[bytes], split: int | None, close: bool = False
    ) -> tuple[str, int, list[bytes]]:
        """A server that answers each request on a connection with the next of `answers`, written in
        pieces of `split` bytes (random pieces when 0), and closes after the last when `close`."""
        requests: list[bytes] = []
        rng = random.Random(3)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                for answer in answers:
                    requests.append(await _read_request(reader))
                    pos = 0
                    while pos < len(answer):
                        size = split or rng.randint(1, 40)
                        writer.write(answer[pos : pos + size])
                        await writer.drain()
                        await asyncio.sleep(0)
                        pos += size
                if not close:
                    await reader.read()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.addAsyncCleanup(self._stop, server)
        return "127.0.0.1", server.sockets[0].getsockname()[1], requests

    @staticmethod
    async def _stop(server: asyncio.Server) -> None:
        server.close()
        await server.wait_closed()

    async def test_chunked_body_arrives_whole_at_any_split_and_the_connection_is_reused(self) -> None:
        body = [b"data: one\n\n", b"data: two\n\n", b"", b"data: [DONE]\n\n"]
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(
            [p for p in body if p], b"X-T: 1\r\n"
        )
        for split in (1, 2, 3, 7, 0, len(answer)):
            with self.subTest(split=split):
                host, port, requests = await self.serve([answer, answer], split)
                client = StreamClient(host, port)
                got: list[bytes] = []
                times: list[int] = []

                def sink(data: bytes, time_ns: int, got: list[bytes] = got, times: list[int] = times) -> bool:
                    got.append(data)
                    times.append(time_ns)
                    return False

                for _ in range(2):
                    response = await client.post("/v1/x", {"H": "v"}, b"{}", sink, 5)
                    self.assertEqual(response.status, 200)
                self.assertEqual(b"".join(got), b"".join(body) * 2)
                self.assertEqual(times, sorted(times))
                self.assertEqual(len(requests), 2)  # both on one connection: it was reused
                self.assertTrue(requests[0].startswith(b"POST /v1/x HTTP/1.1\r\n"))
                self.assertIn(b"\r\nH: v\r\n", requests[0])
                client.close()

    async def test_an_error_answer_keeps_its_body(self) -> None:
        answer = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 10\r\n\r\nbad prompt"
        host, port, _ = await self.serve([answer], 3)
        response = await StreamClient(host, port).post("/", {}, b"", lambda d, t: False, 5)
        self.assertEqual((response.status, response.body), (400, b"bad prompt"))

    async def test_gzip_and_a_body_that_ends_with_the_connection(self) -> None:
        packed = gzip.compress(b"data: x\n\n" * 50)
        answer = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nConnection: close\r\n\r\n" + packed
        host, port, _ = await self.serve([answer], 17, close=True)
        got: list[bytes] = []
        response = await StreamClient(host, port).post("/", {}, b"", lambda d, t: bool(got.append(d)), 5)
        self.assertEqual(response.status, 200)
        self.assertEqual(b"".join(got), b"data: x\n\n" * 50)

    async def test_an_interim_answer_is_skipped(self) -> None:
        answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        host, port, _ = await self.serve([answer], 5)
        got: list[bytes] = []
        response = await StreamClient(host, port).post("/", {}, b"", lambda d, t: bool(got.append(d)), 5)
        self.assertEqual((response.status, b"".join(got)), (200, b"ok"))

    async def test_failures_have_their_kind(self) -> None:
        cut = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nda"
        host, port, _ = await self.serve([cut], 4, close=True)
        with self.assertRaises(StreamHTTPError) as caught:
            await StreamClient(host, port).post("/", {}, b"", lambda d, t: False, 5)
        self.assertEqual(caught.exception.kind, "stream_cut")
        host, port, _ = await self.serve([b""], 4, close=True)
        with self.assertRaises(StreamHTTPError) as caught:
            await StreamClient(host, port).post("/", {}, b"", lambda d, t: False, 5)
        self.assertEqual(caught.exception.kind, "connection_closed")
        garbage = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
        host, port, _ = await self.serve([garbage], 4)
        with self.assertRaises(StreamHTTPError) as caught:
            await StreamClient(host, port).post("/", {}, b"", lambda d, t: False, 5)
        self.assertEqual(caught.exception.kind, "stream_cut")
        with self.assertRaises(StreamHTTPError) as caught:
            await StreamClient("127.0.0.1", 9).post("/", {}, b"", lambda d, t: False, 5)
        self.assertEqual(caught.exception.kind, "connection_error")
        slow = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        host, port, _ = await self.serve([slow], 100)
        with self.assertRaises(TimeoutError):
            await StreamClient(host, port).post("/", {}, b"", lambda d, t: False, 0.2)

    async def test_a_sink_that_has_what_it_needs_ends_the_request_and_the_connection_is_not_reused(
        self,
    ) -> None:
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"3\r\nabc\r\n"  # never ends
        host, port, _ = await self.serve([answer, answer], 100)
        client = StreamClient(host, port)
        response = await client.post("/", {}, b"", lambda d, t: True, 5)
        self.assertEqual(response.status, 200)
        self.assertEqual(client._idle, [])  # pyright: ignore[reportPrivateUsage]


if __name__ == "__main__":
    unittest.main()
