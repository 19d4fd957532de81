"""Every token-event edge case as a scripted stream from a local server, through the real HTTP backend.

The server (`ScriptedServer`) runs on 127.0.0.1 on a free port inside the test's event loop, is started
and stopped by each test, and sends exactly the bytes and delays each test scripts. Timing assertions
use generous margins around scripted delays of 100+ ms and never assert absolute speed.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import unittest
from time import perf_counter_ns
from typing import Any
from urllib.parse import unquote

import aiohttp

from attention_kv_caceh.harness.backends import OpenAIBackend, RequestSpec
from attention_kv_caceh.harness.load import SmokeTestError, smoke_test
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.scripted_server import (
    DONE,
    Script,
    ScriptedServer,
    Step,
    chat_chunk,
    completion_chunk,
    sse,
)
from attention_kv_caceh.harness.server_metrics import ServerMetricsPoller, metrics_url

SPEC = RequestSpec(0, prompt_tokens=4, output_tokens=8, prompt="hello there")


def usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 4, "completion_tokens": n}


class StreamCaseTest(unittest.IsolatedAsyncioTestCase):
    async def run_script(
        self, script: Script, endpoint: str = "completions", base_url: str | None = None
    ) -> RequestRecord:
        """Send SPEC through OpenAIBackend to a server answering `script`; return the record."""
        self.payloads: list[dict[str, Any]] = []
        self.write_ns: list[list[int]] = []

        async def go(url: str) -> RequestRecord:
            async with aiohttp.ClientSession() as session:
                backend = OpenAIBackend(
                    session,
                    base_url=url,
                    model="m",
                    endpoint="chat" if endpoint == "chat" else "completions",
                    api_key="secret",
                    timeout_s=10,
                )
                record = RequestRecord(0, 0, SPEC.prompt_tokens)
                from time import perf_counter_ns

                record.arrival_ns = record.sent_ns = perf_counter_ns()
                await backend.generate(SPEC, record)
                return record

        if base_url is not None:
            return await go(base_url)
        async with ScriptedServer(lambda payload, path: script) as server:
            record = await go(server.base_url)
            self.payloads = server.counters.payloads
            self.write_ns = server.counters.write_ns
            return record

    def assert_ok_invariant(self, record: RequestRecord) -> None:
        self.assertEqual(record.status, "ok", record.error)
        m = record.metrics()
        assert m.ttft_ms is not None
        assert m.e2el_ms is not None
        self.assertAlmostEqual(m.e2el_ms, m.ttft_ms + sum(m.itl_ms), places=6)

    async def test_role_only_first_chunk_is_not_the_first_token(self) -> None:
        script = Script(
            (
                Step(0, chat_chunk(role="assistant")),
                Step(0.15, chat_chunk("Hel")),
                Step(0.01, chat_chunk("lo")),
                Step(0, DONE),
            )
        )
        record = await self.run_script(script, endpoint="chat")
        self.assert_ok_invariant(record)
        self.assertEqual(record.tokens_per_event, [1, 1])
        ttft = record.metrics().ttft_ms
        assert ttft is not None
        self.assertGreater(ttft, 140.0)  # the role chunk came at ~0 ms and must not count
        self.assertEqual(record.output_tokens_source, "chunks")
        body = self.payloads[0]
        self.assertEqual(body["messages"][0]["content"], SPEC.prompt)
        self.assertEqual(body["max_completion_tokens"], SPEC.output_tokens)
        self.assertTrue(body["stream_options"]["continuous_usage_stats"])

    async def test_usage_only_last_chunk_does_not_move_the_finish(self) -> None:
        script = Script(
            (
                Step(0, completion_chunk("a", usage(1))),
                Step(0.01, completion_chunk("b", usage(2))),
                Step(0.2, completion_chunk(None, usage(2))),
                Step(0, DONE),
            )
        )
        record = await self.run_script(script)
        self.assert_ok_invariant(record)
        self.assertEqual(record.tokens_per_event, [1, 1])
        assert record.finish_ns is not None
        assert record.stream_end_ns is not None
        self.assertGreater(record.stream_end_ns - record.finish_ns, 150_000_000)
        self.assertLess(record.finish_ns, self.write_ns[0][2])  # before the usage-only chunk was written
        self.assertEqual((record.output_tokens, record.output_tokens_source), (2, "usage"))
        self.assertEqual(self.payloads[0]["prompt"], SPEC.prompt)

    async def test_several_tokens_per_chunk_including_the_first(self) -> None:
        script = Script(
            (
                Step(0.1, completion_chunk("abc", usage(3))),
                Step(0.1, completion_chunk("de", usage(5))),
                Step(0.1, completion_chunk("f", usage(6))),
                Step(0, completion_chunk(None, usage(6))),
                Step(0, DONE),
            )
        )
        record = await self.run_script(script)
        self.assert_ok_invariant(record)
        self.assertEqual(record.tokens_per_event, [3, 2, 1])
        self.assertEqual(record.output_tokens, 6)
        m = record.metrics()
        assert m.tpot_ms is not None
        assert record.finish_ns is not None
        assert record.first_token_ns is not None
        # TPOT divides the decode time by the 3 tokens after the first event, not by 5 or 2
        self.assertAlmostEqual(m.tpot_ms, (record.finish_ns - record.first_token_ns) / 1e6 / 3)
        self.assertGreater(m.tpot_ms, 50.0)
        self.assertEqual(len(m.itl_ms), 2)

    async def test_one_token_response_has_no_itl_and_no_tpot(self) -> None:
        script = Script((Step(0.05, completion_chunk("x", usage(1))), Step(0, DONE)))
        record = await self.run_script(script)
        self.assert_ok_invariant(record)
        line = record.to_json()
        self.assertEqual(line["itl_ms"], [])
        self.assertIsNone(line["tpot_ms"])
        self.assertEqual(line["e2el_ms"], line["ttft_ms"])

    async def test_error_event_mid_stream(self) -> None:
        script = Script(
            (
                Step(0, completion_chunk("a")),
                Step(0, sse({"error": {"message": "engine died", "code": 500}})),
                Step(0, DONE),
            )
        )
        record = await self.run_script(script)
        self.assertEqual(record.status, "stream_error")
        self.assertIn("engine died", record.error or "")
        self.assertEqual(record.http_status, 200)
        self.assertEqual(record.tokens_per_event, [1])  # what came before the error is kept

    async def test_http_500(self) -> None:
        record = await self.run_script(Script(status=500, body=b"internal trouble"))
        self.assertEqual((record.status, record.http_status), ("http_error", 500))
        self.assertIn("internal trouble", record.error or "")
        self.assertIsNone(record.to_json()["ttft_ms"])

    async def test_stream_ending_without_done(self) -> None:
        script = Script((Step(0, completion_chunk("a")), Step(0, completion_chunk("b"))))
        record = await self.run_script(script)
        self.assertEqual(record.status, "incomplete_stream")
        self.assertIn("[DONE]", record.error or "")
        self.assertEqual(record.tokens_per_event, [1, 1])

    async def test_stream_cut_mid_way(self) -> None:
        script = Script((Step(0, completion_chunk("a")), Step(0, b'data: {"choi')), abort=True)
        record = await self.run_script(script)
        self.assertEqual(record.status, "stream_cut")
        self.assertEqual(record.tokens_per_event, [1])

    async def test_malformed_data_line(self) -> None:
        script = Script((Step(0, completion_chunk("a")), Step(0, b"data: {not json\n\n"), Step(0, DONE)))
        record = await self.run_script(script)
        self.assertEqual(record.status, "malformed_sse")
        self.assertIn("not json", record.error or "")

    async def test_connection_refused_is_recorded_and_fails_the_smoke_test(self) -> None:
        with socket.socket() as sock:  # a port that was free a moment ago and has no listener
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        record = await self.run_script(Script(), base_url=url)
        self.assertEqual(record.status, "connection_error")
        self.assertIsNone(record.http_status)
        async with aiohttp.ClientSession() as session:
            backend = OpenAIBackend(session, base_url=url, model="m", endpoint="completions")
            with self.assertRaisesRegex(SmokeTestError, "connection_error.*server running"):
                await smoke_test(backend, SPEC, url)

    async def test_a_chunked_stream_split_at_any_byte_gives_the_same_tokens_on_one_connection(
        self,
    ) -> None:
        events = [completion_chunk(t) for t in ("a", "b", "c")]
        events.append(completion_chunk(None, usage(3)))
        body = b"".join(f"{len(e):x};ext=1\r\n".encode() + e + b"\r\n" for e in [*events, DONE])
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        answer += b"Transfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
        for split in (1, 3, 7, len(answer)):
            with self.subTest(split=split):
                peers: list[object] = []

                async def handle(
                    reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter,
                    split: int = split,
                    peers: list[object] = peers,
                ) -> None:
                    peers.append(writer.get_extra_info("peername"))
                    try:
                        while True:
                            head = await reader.readuntil(b"\r\n\r\n")
                            length = next(
                                int(line.split(b":")[1])
                                for line in head.split(b"\r\n")
                                if line.lower().startswith(b"content-length")
                            )
                            await reader.readexactly(length)
                            for pos in range(0, len(answer), split):
                                writer.write(answer[pos : pos + split])
                                await writer.drain()
                                await asyncio.sleep(0)
                    except (asyncio.IncompleteReadError, ConnectionError):
                        pass
                    finally:
                        writer.close()

                server = await asyncio.start_server(handle, "127.0.0.1", 0)
                port = server.sockets[0].getsockname()[1]
                try:
                    async with aiohttp.ClientSession() as session:
                        backend = OpenAIBackend(
                            session, base_url=f"http://127.0.0.1:{port}", model="m", endpoint="completions"
                        )
                        records = [RequestRecord(k, 0, SPEC.prompt_tokens) for k in range(2)]
                        for record in records:
                            record.arrival_ns = record.sent_ns = perf_counter_ns()
                            await backend.generate(SPEC, record)
                finally:
                    server.close()
                    await server.wait_closed()
                for record in records:
                    self.assert_ok_invariant(record)
                    self.assertEqual(record.output_tokens, 3)
                    self.assertEqual(sum(record.tokens_per_event), 3)
                    self.assertEqual(record.token_times_ns, sorted(record.token_times_ns))
                self.assertEqual(len(peers), 1)  # the second request reused the first's connection

    async def test_prometheus_metrics_are_polled_and_summed_over_labels(self) -> None:
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        )
        three = threading.Event()
        async with ScriptedServer(lambda p, path: Script(), metrics_text=text) as server:
            poller = ServerMetricsPoller(
                0.01,
                url=metrics_url(server.base_url + "/v1"),
                on_sample=lambda s: three.set() if len(poller.samples) >= 3 else None,
            )
            poller.start()
            await asyncio.to_thread(three.wait)
            await poller.stop()
            queries = server.counters.metrics_queries
        self.assertGreaterEqual(len(poller.samples), 3)
        sample = poller.samples[-1]
        self.assertEqual((sample.running, sample.waiting, sample.kv_cache_usage), (5.0, 7.0, 0.25))
        self.assertEqual(poller.errors, [])
        self.assertIn("name[]=vllm:num_requests_running", unquote(queries[0]))  # only what is needed
        times = [s.time_ns for s in poller.samples]
        self.assertEqual(times, sorted(times))
        assert poller.achieved_interval_s is not None
        self.assertGreater(poller.achieved_interval_s, 0.0)

    async def test_missing_metrics_endpoint_stops_polling_quietly(self) -> None:
        async with ScriptedServer(lambda p, path: Script()) as server:
            poller = ServerMetricsPoller(0.01, url=metrics_url(server.base_url))
            poller.start()
            await poller.stop()  # joins the thread, which ends by itself at the 404
            self.assertFalse(await asyncio.to_thread(poller.poll_once))
        self.assertTrue(poller.unsupported)
        self.assertEqual(poller.samples, [])

    async def test_polling_never_runs_in_the_event_loop_thread(self) -> None:
        threads: list[int] = []
        done = threading.Event()
        async with ScriptedServer(lambda p, path: Script(), live_metrics=True) as server:
            poller = ServerMetricsPoller(
                0.01,
                url=metrics_url(server.base_url),
                on_sample=lambda s: (threads.append(threading.get_ident()), done.set()),
            )
            poller.start()
            await asyncio.to_thread(done.wait)
            await poller.stop()
        self.assertNotIn(threading.get_ident(), threads)


if __name__ == "__main__":
    unittest.main()
