"""Keep-alive connections a server closes: the harness retries a request once, on a fresh connection, when
a reused connection failed before any byte of the response, and never after a byte.

The server here speaks HTTP/1.1 over asyncio streams and closes connections the ways cpp-httplib's server
(llama.cpp's `llama-server`) does: right after every streamed response while its headers announce
`Keep-Alive: timeout=5, max=100` (llama-server's content provider returns false after its last chunk,
which cpp-httplib takes as a cancelled write and closes), after a number of requests on one connection
(100), and after the connection sat idle past its keep-alive timeout (5 s). The moment a server's close
and a client's next request cross on the wire is made deterministic: the server closes the connection
when that request arrives, without answering it (llama-server's close after every stream is then a
limit of one request a connection). Oracles: the server's own log of every
request it received, answered or not, with its arrival time (`perf_counter_ns`, the clock of the
records). No test depends on timing.
"""

from __future__ import annotations

import asyncio
import json
import unittest
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

from attention_kv_caceh.harness.backends import OpenAIBackend, RequestSpec, load_session
from attention_kv_caceh.harness.load import run_requests
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.scripted_server import timed_token_script
from attention_kv_caceh.harness.summary import summarize_run
from attention_kv_caceh.harness.summary_text import format_summary

TOKENS = 3


@dataclass
class _Connection:
    served: int = 0
    idle: bool = False
    expired: bool = False


@dataclass
class ClosingServer:
    """`max_requests`: a connection's next request after that many is closed unanswered (cpp-httplib's
    keep-alive max count, met as the client sends); `expire_idle()`: every connection idle now is closed
    when its next request arrives (the keep-alive timeout, met as the client sends); `cut` (prompts):
    those requests get their headers and one token, then the connection closes (a stream cut);
    `close_first`: the first request of every connection is closed unanswered (a server that answers
    nothing, on fresh connections too)."""

    max_requests: int | None = None
    cut: frozenset[str] = frozenset()
    close_first: bool = False
    answered: list[tuple[str, int]] = field(default_factory=lambda: list[tuple[str, int]]())
    unanswered: list[tuple[str, int]] = field(default_factory=lambda: list[tuple[str, int]]())
    connections: list[_Connection] = field(default_factory=lambda: list[_Connection]())

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self._server.close()
        await self._server.wait_closed()

    def expire_idle(self) -> None:
        for conn in self.connections:
            conn.expired = conn.expired or conn.idle

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection()
        self.connections.append(conn)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrival = perf_counter_ns()
                conn.idle = False
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                payload: dict[str, Any] = json.loads(await reader.readexactly(length))
                prompt = str(payload["prompt"])
                full = self.max_requests is not None and conn.served >= self.max_requests
                if full or conn.expired or (self.close_first and conn.served == 0):
                    self.unanswered.append((prompt, arrival))
                    return
                conn.served += 1
                self.answered.append((prompt, arrival))
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                    b"Keep-Alive: timeout=5, max=100\r\n\r\n"
                )
                for i, step in enumerate(timed_token_script(0.0, 0.0, TOKENS).steps):
                    writer.write(b"%x\r\n%s\r\n" % (len(step.data), step.data))
                    if prompt in self.cut and i == 0:
                        await writer.drain()
                        return
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                conn.idle = True
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


def specs(n: int, start: int = 0) -> list[RequestSpec]:
    return [RequestSpec(i, 2, TOKENS, prompt=f"p{i}") for i in range(start, start + n)]


async def run(backend: OpenAIBackend, batch: list[RequestSpec], concurrency: int) -> list[RequestRecord]:
    return await run_requests(backend, batch, [0.0] * len(batch), concurrency)


class KeepAliveTest(unittest.TestCase):
    def check_each_answered_once(self, server: ClosingServer, records: list[RequestRecord]) -> None:
        """Every request ok, answered exactly once; a retried one also met one unanswered send first,
        and its `sent_ns` is no later than that first send's arrival (latency counts from it)."""
        self.assertEqual([r.status for r in records], ["ok"] * len(records))
        answered = [p for p, _ in server.answered]
        self.assertEqual(sorted(answered), sorted(f"p{r.request_id}" for r in records))
        closed = {p: t for p, t in server.unanswered}
        self.assertEqual(len(closed), len(server.unanswered))  # none was sent unanswered twice
        for r in records:
            prompt = f"p{r.request_id}"
            with self.subTest(request=r.request_id):
                self.assertEqual(r.retried_fresh_connection, prompt in closed)
                if r.retried_fresh_connection:
                    assert r.sent_ns is not None and r.first_token_ns is not None
                    self.assertLessEqual(r.sent_ns, closed[prompt])
                    self.assertIn("closed the connection", r.first_error or "")
                    self.assertEqual(r.metrics().ttft_ms, (r.first_token_ns - r.sent_ns) / 1e6)
                else:
                    self.assertIsNone(r.first_error)

    def test_a_server_that_closes_after_every_stream_loses_no_request(self) -> None:
        server = ClosingServer(max_requests=1)  # llama-server: no second request on a connection

        async def main() -> list[RequestRecord]:
            url = await server.start()
            try:
                async with load_session() as session:
                    backend = OpenAIBackend(session, base_url=url, model="m", endpoint="completions")
                    return await run(backend, specs(40), 4)
            finally:
                await server.stop()

        records = asyncio.run(main())
        self.check_each_answered_once(server, records)
        self.assertGreater(len(server.unanswered), 0)
        self.assertTrue(all(c.served <= 1 for c in server.connections))

    def test_a_connection_closed_after_its_nth_request_is_retried_on_a_fresh_one(self) -> None:
        server = ClosingServer(max_requests=3)

        async def main() -> list[RequestRecord]:
            url = await server.start()
            try:
                async with load_session() as session:
                    backend = OpenAIBackend(session, base_url=url, model="m", endpoint="completions")
                    return await run(backend, specs(40), 4)
            finally:
                await server.stop()

        records = asyncio.run(main())
        self.check_each_answered_once(server, records)
        self.assertGreater(len(server.unanswered), 0)
        self.assertTrue(all(c.served <= 3 for c in server.connections))
        summary = summarize_run(records, 1.0)
        self.assertEqual(summary["num_retried_fresh_connection"], len(server.unanswered))
        self.assertIn(f"retried on a fresh connection: {len(server.unanswered)}", format_summary(summary))
        self.assertEqual(
            records[0].to_json()["retried_fresh_connection"], records[0].retried_fresh_connection
        )

    def test_connections_closed_after_their_keep_alive_timeout_are_retried(self) -> None:
        server = ClosingServer()

        async def main() -> tuple[list[RequestRecord], list[RequestRecord]]:
            url = await server.start()
            try:
                async with load_session() as session:
                    backend = OpenAIBackend(session, base_url=url, model="m", endpoint="completions")
                    first = await run(backend, specs(4), 4)
                    server.expire_idle()  # every pooled connection is past the server's timeout now
                    return first, await run(backend, specs(4, 4), 4)
            finally:
                await server.stop()

        first, second = asyncio.run(main())
        self.check_each_answered_once(server, first + second)
        self.assertFalse(any(r.retried_fresh_connection for r in first))
        self.assertEqual({p for p, _ in server.unanswered}, {f"p{r.request_id}" for r in second})

    def test_a_stream_cut_after_its_first_bytes_fails_and_is_not_sent_again(self) -> None:
        server = ClosingServer(cut=frozenset({"p1"}))

        async def main() -> list[RequestRecord]:
            url = await server.start()
            try:
                async with load_session() as session:
                    backend = OpenAIBackend(session, base_url=url, model="m", endpoint="completions")
                    return await run(backend, specs(2), 1)  # p1 goes out on p0's connection
            finally:
                await server.stop()

        records = asyncio.run(main())
        self.assertEqual([r.status for r in records], ["ok", "stream_cut"])
        self.assertEqual([p for p, _ in server.answered], ["p0", "p1"])
        self.assertEqual(server.unanswered, [])
        self.assertFalse(records[1].retried_fresh_connection)

    def test_a_fresh_connection_closed_unanswered_fails_and_is_not_sent_again(self) -> None:
        server = ClosingServer(close_first=True)

        async def main() -> list[RequestRecord]:
            url = await server.start()
            try:
                async with load_session() as session:
                    backend = OpenAIBackend(session, base_url=url, model="m", endpoint="completions")
                    return await run(backend, specs(2), 1)
            finally:
                await server.stop()

        records = asyncio.run(main())
        self.assertEqual([r.status for r in records], ["connection_closed", "connection_closed"])
        self.assertEqual(sorted(p for p, _ in server.unanswered), ["p0", "p1"])  # each sent once
        self.assertFalse(any(r.retried_fresh_connection for r in records))


if __name__ == "__main__":
    unittest.main()
