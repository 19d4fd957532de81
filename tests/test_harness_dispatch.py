"""Dispatch at a burst: the client's own work is done before the clock starts, and the lateness warning
says what happened.

At `--request-rate inf` every request arrives at once and one event loop starts them one after another,
so whatever a start costs delays every later request. Opening a TCP connection was most of that cost;
the run opens its connections (and encodes its request bodies) before the measured requests, and every
measured request then goes out on a connection opened before the clock started. A full garbage
collection in the middle of a burst was the other large cost; the objects built before the clock are
frozen out of the collector for the run.
"""

from __future__ import annotations

import gc
import unittest
from typing import Any

from aiohttp import web

from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import HarnessConfig, run_harness
from attention_kv_caceh.harness.scripted_server import ScriptedServer, timed_token_script
from attention_kv_caceh.harness.summary import summarize_run

MS = 1_000_000


class PeerRecordingServer(ScriptedServer):
    """Records the client port of every GET /v1/models and of every streamed request."""

    def __init__(self) -> None:
        super().__init__(lambda payload, path: timed_token_script(0, 0, 2))
        self.models_ports: list[int] = []
        self.stream_ports: list[int] = []

    @staticmethod
    def _port(request: web.Request) -> int:
        assert request.transport is not None
        return int(request.transport.get_extra_info("peername")[1])

    async def _models(self, request: web.Request) -> web.Response:
        self.models_ports.append(self._port(request))
        return await super()._models(request)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        self.stream_ports.append(self._port(request))
        return await super()._stream(request)


class ConnectionsOpenedBeforeTheClockTest(unittest.IsolatedAsyncioTestCase):
    async def test_every_request_of_a_burst_reuses_a_connection_opened_before_it(self) -> None:
        async with PeerRecordingServer() as server:
            config = HarnessConfig(
                backend="openai-completions",
                base_url=server.base_url,
                model="scripted",
                num_requests=12,
                concurrency=12,
                output_len=LengthRange(2, 2),
                server_metrics_interval_s=0,
                smoke_test=False,
            )
            result = await run_harness(config)
            opened, used = set(server.models_ports), server.stream_ports
        self.assertEqual(result.summary["completed"], 12)
        self.assertEqual(len(used), 12)
        self.assertEqual(len(opened), 12)  # one per concurrency slot
        self.assertTrue(set(used) <= opened, f"requests on new connections: {set(used) - opened}")


class FirstScrapeBeforeTheClockTest(unittest.IsolatedAsyncioTestCase):
    async def test_the_first_metrics_scrape_is_done_before_the_first_request_is_due(self) -> None:
        # the polling thread's first scrape holds the GIL for milliseconds: not while a burst starts
        script = lambda payload, path: timed_token_script(0, 0, 2)  # noqa: E731
        async with ScriptedServer(script, live_metrics=True) as server:
            config = HarnessConfig(
                backend="openai-completions",
                base_url=server.base_url,
                model="scripted",
                num_requests=4,
                concurrency=4,
                output_len=LengthRange(2, 2),
                server_metrics_interval_s=60.0,
            )
            result = await run_harness(config)
        self.assertGreaterEqual(len(result.server_samples), 1)
        self.assertLess(result.server_samples[0].time_ns, result.start_ns)


class HeapFrozenDuringTheLoadTest(unittest.IsolatedAsyncioTestCase):
    async def test_objects_built_before_the_clock_are_not_collected_during_the_load(self) -> None:
        # a full collection over the process's heap (tens of ms of CPU) in the middle of a burst would
        # start every later request that much later; gc.freeze() leaves collections only the run's own
        frozen_while_running: list[int] = []
        config = HarnessConfig(num_requests=4, concurrency=4, prefill_ms=1, per_token_ms=1)
        await run_harness(config, on_record=lambda r: frozen_while_running.append(gc.get_freeze_count()))
        self.assertEqual(len(frozen_while_running), 4)
        self.assertTrue(all(n > 0 for n in frozen_while_running), frozen_while_running)
        self.assertEqual(gc.get_freeze_count(), 0)  # unfrozen after the run


def burst_record(rid: int, arrival_ns: int, dispatch_ns: int) -> RequestRecord:
    r = RequestRecord(rid, arrival_ns, 1, dispatch_ns=dispatch_ns, sent_ns=dispatch_ns)
    r.add_token_event(dispatch_ns + 10 * MS, 1)
    r.output_tokens = 1
    r.status = "ok"
    return r


class LatenessWarningTest(unittest.TestCase):
    def lateness_warning(self, records: list[RequestRecord]) -> str:
        summary: dict[str, Any] = summarize_run(records, 1.0)
        found = [w for w in summary["warnings"] if "lateness" in w]
        self.assertEqual(len(found), 1, summary["warnings"])
        return found[0]

    def test_at_a_burst_it_gives_the_time_to_start_every_request_not_rate_advice(self) -> None:
        # 11 requests arriving together, started 2 ms apart: the last 20 ms after the first
        text = self.lateness_warning([burst_record(i, 0, 2 * MS * i) for i in range(11)])
        self.assertIn("--request-rate inf", text)
        self.assertIn("20.0 ms", text)
        self.assertIn("2.000 ms", text)
        self.assertNotIn("lower --request-rate", text)

    def test_at_a_finite_rate_it_says_the_client_fell_behind_the_schedule(self) -> None:
        text = self.lateness_warning([burst_record(i, 10 * MS * i, 10 * MS * i + 5 * MS) for i in range(11)])
        self.assertIn("lower --request-rate", text)
        self.assertNotIn("--request-rate inf", text)


if __name__ == "__main__":
    unittest.main()
