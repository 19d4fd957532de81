"""What the harness does with hostile or broken servers: bad numbers, redirect loops, closed
connections, huge SSE events. Loopback only; no test depends on timing."""

from __future__ import annotations

import asyncio
import json
import socket
import unittest
from time import perf_counter_ns
from types import SimpleNamespace
from typing import Any
from unittest import mock

import aiohttp

from attention_kv_caceh.harness.backends import OpenAIBackend, RequestSpec
from attention_kv_caceh.harness.client_errors import UNREACHABLE_KINDS, classify_client_error
from attention_kv_caceh.harness.load import LengthRange, SmokeTestError, smoke_test
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import MIN_SERVER_SAMPLES, HarnessConfig, run_harness
from attention_kv_caceh.harness.scripted_server import (
    DONE,
    Script,
    ScriptedServer,
    Step,
    completion_chunk,
    timed_token_script,
)
from attention_kv_caceh.harness.server_metrics import (
    BadServerValueError,
    _wanted_lines,  # pyright: ignore[reportPrivateUsage]
    parse_vllm_metrics,
    sample_from_metrics,
)
from attention_kv_caceh.harness.sse import EventTooLargeError, SSEEvent, SSEParser
from attention_kv_caceh.harness.summary_text import format_summary

SPEC = RequestSpec(0, prompt_tokens=4, output_tokens=4, prompt="hi")


def gauges(running: str, waiting: str = "0", kv: str = "0.5") -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
    )


async def send(url: str, *, max_event_bytes: int | None = None) -> RequestRecord:
    async with aiohttp.ClientSession() as session:
        kwargs = {} if max_event_bytes is None else {"max_event_bytes": max_event_bytes}
        backend = OpenAIBackend(session, base_url=url, model="m", endpoint="completions", **kwargs)
        record = RequestRecord(0, perf_counter_ns(), 4)
        record.sent_ns = record.arrival_ns
        await backend.generate(SPEC, record)
        return record


class ServerNumbersTest(unittest.TestCase):
    def test_infinite_nan_or_negative_gauges_are_refused(self) -> None:
        for running, waiting, kv in (
            ("+Inf", "0", "0.1"),
            ("NaN", "0", "0.1"),
            ("1", "-2", "0.1"),
            ("1", "0", "7"),
        ):
            with (
                self.subTest(running=running, waiting=waiting, kv=kv),
                self.assertRaises(BadServerValueError),
            ):
                sample_from_metrics(gauges(running, waiting, kv), 0)
        sample = sample_from_metrics(gauges("3", "1"), 5)
        assert sample is not None
        self.assertEqual((sample.running, sample.waiting, sample.kv_cache_usage), (3.0, 1.0, 0.5))


def whole_exposition(kv_name: str = "vllm:kv_cache_usage_perc") -> str:
    """A vLLM-0.32-like unfiltered `/metrics`: two engines, the three gauges among ~600 other lines,
    including `vllm:num_requests_waiting_by_reason` (a name that starts like a wanted one)."""
    lines: list[str] = []
    for k in range(40):
        lines += [f"# HELP vllm:histogram_{k} Some histogram.", f"# TYPE vllm:histogram_{k} histogram"]
        lines += [f'vllm:histogram_{k}_bucket{{le="{b}",engine="0"}} {b * 3}' for b in range(12)]
        lines += [f'vllm:histogram_{k}_count{{engine="0"}} 36', f'vllm:histogram_{k}_sum{{engine="0"}} 9.5']
    for name, values in (
        ("vllm:num_requests_running", ("3.0", "2.0")),
        ("vllm:num_requests_waiting", ("1.0", "4.0")),
        ("vllm:num_requests_waiting_by_reason", ("7.0", "9.0")),
        (kv_name, ("0.25", "0.5")),
    ):
        lines += [f"# HELP {name} A gauge.", f"# TYPE {name} gauge"]
        lines += [f'{name}{{engine="{e}",model_name="m"}} {v}' for e, v in enumerate(values)]
    return "\n".join(lines) + "\n"


class UnfilteredExpositionTest(unittest.TestCase):
    """vLLM 0.32 ignores `name[]=`; the poller parses only the gauges' lines of its whole answer."""

    def test_the_gauges_lines_give_the_same_sample_as_the_whole_exposition(self) -> None:
        for kv_name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            with self.subTest(kv_name=kv_name):
                text = whole_exposition(kv_name)
                totals = parse_vllm_metrics(text)  # oracle: the whole text through prometheus_client
                sample = sample_from_metrics(text, 7)
                assert sample is not None
                expected = (
                    totals["vllm:num_requests_running"],
                    totals["vllm:num_requests_waiting"],
                    totals[kv_name],
                )
                self.assertEqual((sample.running, sample.waiting, sample.kv_cache_usage), expected)
                self.assertEqual(expected, (5.0, 5.0, 0.75))

    def test_only_the_three_gauges_lines_are_parsed(self) -> None:
        kept = _wanted_lines(whole_exposition()).splitlines()
        self.assertEqual(len(kept), 3 * 4)  # HELP, TYPE and one sample per engine, for each gauge
        self.assertFalse([line for line in kept if "histogram" in line or "by_reason" in line])


class ErrorNamingTest(unittest.TestCase):
    def test_dns_failure_and_refusal_are_told_apart(self) -> None:
        key: Any = SimpleNamespace(host="no.such.host", port=80, ssl=True, is_ssl=False)
        dns = aiohttp.ClientConnectorDNSError(key, socket.gaierror(-2, "Name or service not known"))
        refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "Connection refused"))
        kind, message = classify_client_error(dns, after_headers=False)
        self.assertEqual(kind, "dns_error")
        self.assertIn("DNS lookup", message)
        kind, message = classify_client_error(refused, after_headers=False)
        self.assertEqual(kind, "connection_error")
        self.assertIn("connection refused", message)
        self.assertIn("dns_error", UNREACHABLE_KINDS)


class HostileServerTest(unittest.IsolatedAsyncioTestCase):
    async def test_infinite_gauges_never_reach_the_summary_and_it_is_strict_json(self) -> None:
        script = Script(
            (Step(0.0, completion_chunk("a", {"prompt_tokens": 1, "completion_tokens": 1})), Step(0, DONE))
        )
        async with ScriptedServer(lambda p, path: script, metrics_text=gauges("+Inf", "NaN")) as server:
            config = HarnessConfig(
                backend="openai-completions",
                base_url=server.base_url,
                model="m",
                num_requests=4,
                output_len=LengthRange(1, 1),
                server_metrics_interval_s=0.01,
            )
            result = await run_harness(config)
        self.assertIsNone(result.summary["peak_server_running"])
        json.dumps(result.summary, allow_nan=False)  # raises ValueError on NaN/Infinity
        self.assertTrue(any("not a finite number" in e for e in result.server_metrics_errors))

    async def test_sample_count_and_interval_are_recorded_and_few_samples_warn(self) -> None:
        script = Script(
            (Step(0.0, completion_chunk("a", {"prompt_tokens": 1, "completion_tokens": 1})), Step(0, DONE))
        )
        async with ScriptedServer(lambda p, path: script, live_metrics=True) as server:
            config = HarnessConfig(
                backend="openai-completions",
                base_url=server.base_url,
                model="m",
                num_requests=2,
                output_len=LengthRange(1, 1),
                server_metrics_interval_s=60.0,  # only the first and the last sample in a run this short
            )
            result = await run_harness(config)
        n = result.summary["server_metrics_samples"]
        self.assertIn(n, (1, 2))  # the first, and a last one begun after the run (unless both are one)
        self.assertEqual(len(result.server_samples), n)
        if n == 2:
            self.assertGreater(result.summary["server_metrics_interval_achieved_s"], 0.0)
        self.assertTrue(any(f"only {n} server metrics samples" in w for w in result.summary["warnings"]))
        # a peak of one or two samples is a guess (a sample at an idle moment reads 0): none is reported
        self.assertIsNone(result.summary["peak_server_running"])
        self.assertIsNone(result.summary["peak_server_waiting"])
        self.assertNotRegex(format_summary(result.summary), r"peak server (running|waiting): \d")
        json.dumps(result.summary, allow_nan=False)

    async def test_with_enough_samples_the_server_peaks_are_whole_counts(self) -> None:
        async with ScriptedServer(
            lambda p, path: timed_token_script(0, 0.02, 25), live_metrics=True
        ) as server:
            config = HarnessConfig(
                backend="openai-completions",
                base_url=server.base_url,
                model="m",
                num_requests=2,
                concurrency=2,
                output_len=LengthRange(25, 25),
                server_metrics_interval_s=0.01,  # about 50 samples over the half-second streams
            )
            # polls unstretched (the cost budget would stretch them past this short run)
            with mock.patch("attention_kv_caceh.harness.server_metrics.COST_BUDGET", 1.0):
                result = await run_harness(config)
        self.assertGreaterEqual(result.summary["server_metrics_samples"], MIN_SERVER_SAMPLES)
        self.assertIsInstance(result.summary["peak_server_running"], int)  # printed as 2, not 2.00
        self.assertIn(result.summary["peak_server_running"], (1, 2))
        self.assertRegex(format_summary(result.summary), r"peak server running: [12] ")

    async def test_decreasing_usage_is_a_failed_request_not_a_negative_throughput(self) -> None:
        script = Script(
            (
                Step(0, completion_chunk("a", {"prompt_tokens": 1, "completion_tokens": 9000})),
                Step(0, completion_chunk("b", {"prompt_tokens": 1, "completion_tokens": 2})),
                Step(0, DONE),
            )
        )
        async with ScriptedServer(lambda p, path: script) as server:
            record = await send(server.base_url)
        self.assertEqual(record.status, "invalid_usage")
        self.assertIn("decreased", record.error or "")

    async def test_redirect_loop_is_named(self) -> None:
        loop = Script(status=307, headers=(("Location", "/v1/completions"),))
        async with ScriptedServer(lambda p, path: loop) as server:
            record = await send(server.base_url)
            self.assertEqual(record.status, "too_many_redirects")
            async with aiohttp.ClientSession() as session:
                backend = OpenAIBackend(session, base_url=server.base_url, model="m", endpoint="completions")
                with self.assertRaises(SmokeTestError) as caught:
                    await smoke_test(backend, SPEC, server.base_url)
        self.assertIn("too_many_redirects", str(caught.exception))
        self.assertNotIn("server running", str(caught.exception))

    async def test_connection_closed_by_the_server_is_named(self) -> None:
        async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1)
            writer.close()

        server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            record = await send(f"http://127.0.0.1:{port}")
        finally:
            server.close()
            await server.wait_closed()
        self.assertEqual(record.status, "connection_closed")
        self.assertIn("closed the connection", record.error or "")

    async def test_tls_to_a_plain_http_server_is_named(self) -> None:
        async with ScriptedServer(lambda p, path: Script()) as server:
            record = await send(server.base_url.replace("http://", "https://"))
        self.assertEqual(record.status, "tls_error")
        self.assertIn("TLS", record.error or "")

    async def test_an_event_over_the_cap_fails_that_request_clearly(self) -> None:
        big = b"data: " + b"x" * 5000  # no line end: one event growing past the 4 KiB cap
        script = Script((Step(0, completion_chunk("a")), Step(0, big), Step(0, b"\n\n"), Step(0, DONE)))
        async with ScriptedServer(lambda p, path: script) as server:
            record = await send(server.base_url, max_event_bytes=4096)
        self.assertEqual(record.status, "event_too_large")
        self.assertIn("4096 bytes", record.error or "")
        self.assertEqual(record.tokens_per_event, [1])

    async def test_http_error_text_names_the_status_once(self) -> None:
        async with ScriptedServer(lambda p, path: Script(status=400, body=b"bad prompt")) as server:
            record = await send(server.base_url)
        self.assertEqual((record.status, record.http_status, record.error), ("http_error", 400, "bad prompt"))


class SSELinearityTest(unittest.TestCase):
    def scanned(self, size: int, piece: int = 64) -> int:
        parser = SSEParser(max_event_bytes=1 << 30)
        stream = b"data: " + b"x" * size + b"\n\n"
        events: list[SSEEvent] = []
        for i in range(0, len(stream), piece):
            events += parser.feed(stream[i : i + piece])
        self.assertEqual(len(events), 1)
        self.assertEqual(len(events[0].data), size)
        return parser.bytes_scanned

    def test_work_grows_linearly_with_a_line_split_in_small_pieces(self) -> None:
        small, large = self.scanned(64_000), self.scanned(256_000)
        # each byte is searched once and copied into its line once: work = 2 x bytes, at any split
        self.assertLessEqual(small, 2 * (64_000 + 10))
        self.assertLessEqual(large / small, 4.01)

    def test_the_cap_names_itself(self) -> None:
        parser = SSEParser(max_event_bytes=100)
        with self.assertRaisesRegex(EventTooLargeError, "exceeded 100 bytes"):
            for _ in range(20):
                parser.feed(b"data: " + b"y" * 10 + b"\n")  # data lines without a blank line


if __name__ == "__main__":
    unittest.main()
