"""The harness measures known delays, and the client's semaphore is not the server's batch.

1. Against the scripted server in a child process (127.0.0.1, TTFT 60 ms, one token every 15 ms, 6 tokens,
   so E2EL 135 ms), 2 x concurrency requests at concurrency 1, 16 and 128. Stated tolerances (upper
   bounds grow with concurrency because client and server share this 2-core machine; lower bounds are
   physics: nothing arrives before its scripted time):
   - median TTFT in [60, 60 + 20 / 40 / 200] ms;
   - median ITL in 15 +- 5 / 5 / 10 ms;
   - the first wave's client queue time < 10 / 150 / 400 ms; the second wave's in
     [135, 135 + 40 / 150 / 500] ms (each waits for a first-wave request to finish).
   The upper bounds were set by running with two CPU hogs beside the test: idle, the medians are within
   about 1 / 5 / 16 ms of the script (TTFT) and 0.3 ms (ITL).
2. The user's notes' acceptance, on the simulated backend: concurrency 4 with 8 server slots never has
   more than 4 requests in flight at either end; concurrency 16 with 4 slots has 16 in flight at the
   client but never more than 4 running at the server, and the wait shows up as TTFT, not queue time.
3. Ctrl-C (cancellation) keeps every finished record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.files import JsonlWriter
from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import HarnessConfig, RunResult, run_harness
from attention_kv_caceh.harness.scripted_server import scripted_server_process

TTFT_MS, ITL_MS, TOKENS = 60.0, 15.0, 6
E2EL_MS = TTFT_MS + (TOKENS - 1) * ITL_MS
# concurrency: (TTFT slack, ITL tolerance, first-wave queue bound, second-wave queue slack), ms
TOLERANCES = {1: (20.0, 5.0, 10.0, 40.0), 16: (40.0, 5.0, 150.0, 150.0), 128: (200.0, 10.0, 400.0, 500.0)}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class KnownDelaysTest(unittest.TestCase):
    url = ""

    @classmethod
    def setUpClass(cls) -> None:
        cls._server = scripted_server_process(TTFT_MS, ITL_MS)
        cls.url = cls._server.__enter__()

    @classmethod
    def tearDownClass(cls) -> None:
        cls._server.__exit__(None, None, None)

    def measure(self, concurrency: int) -> RunResult:
        config = HarnessConfig(
            backend="openai-completions",
            base_url=self.url,
            num_requests=2 * concurrency,
            concurrency=concurrency,
            output_len=LengthRange(TOKENS, TOKENS),
            server_metrics_interval_s=0,
            timeout_s=30,
        )
        return asyncio.run(run_harness(config))

    def test_known_ttft_itl_and_queue_at_concurrency_1_16_128(self) -> None:
        for concurrency, (ttft_slack, itl_tol, first_wave, second_slack) in TOLERANCES.items():
            with self.subTest(concurrency=concurrency):
                result = self.measure(concurrency)
                s = result.summary
                self.assertEqual(s["failed"], 0, s["failures"])
                self.assertEqual(s["max_client_in_flight"], concurrency)
                self.assertEqual(s["total_output_tokens"], 2 * concurrency * TOKENS)
                for r in result.records:
                    self.assertEqual(r.tokens_per_event, [1] * TOKENS)
                    self.assertEqual(r.output_tokens_source, "usage")
                ttfts = [r.metrics().ttft_ms or 0.0 for r in result.records]
                self.assertGreaterEqual(min(ttfts), TTFT_MS - 0.5)
                self.assertLessEqual(median(ttfts), TTFT_MS + ttft_slack)
                itls = [x for r in result.records for x in r.metrics().itl_ms]
                self.assertAlmostEqual(median(itls), ITL_MS, delta=itl_tol)
                queues = sorted(r.metrics().queue_ms or 0.0 for r in result.records)
                if concurrency == 1:  # strictly one after another: request k waits k E2ELs
                    for k, q in enumerate(queues):
                        self.assertGreaterEqual(q, k * (E2EL_MS - 0.5))
                        self.assertLessEqual(q, k * (E2EL_MS + second_slack) + first_wave)
                else:
                    self.assertLess(queues[concurrency - 1], first_wave)
                    self.assertGreaterEqual(queues[concurrency], E2EL_MS - 0.5)
                    self.assertLess(queues[-1], E2EL_MS + second_slack)


def simulated(num_requests: int, concurrency: int, slots: int) -> HarnessConfig:
    return HarnessConfig(
        backend="simulated",
        num_requests=num_requests,
        concurrency=concurrency,
        server_slots=slots,
        prefill_ms=20.0,
        per_token_ms=5.0,
        output_len=LengthRange(8, 8),  # E2EL 55 ms when a slot is free
        server_metrics_interval_s=0.005,
    )


class SemaphoreIsNotTheBatchTest(unittest.TestCase):
    def test_client_concurrency_4_below_8_server_slots(self) -> None:
        result = asyncio.run(run_harness(simulated(16, 4, 8)))
        s = result.summary
        self.assertEqual(s["completed"], 16)
        self.assertEqual(max(c for _, c in result.in_flight), 4)  # reached, never exceeded
        self.assertEqual(s["max_client_in_flight"], 4)
        self.assertLessEqual(max(x.running for x in result.server_exact), 4)  # 8 were free
        self.assertEqual(s["peak_server_waiting"], 0)
        # the other 12 requests waited in the client's queue, three waves of about 55 ms
        queues = sorted(r.metrics().queue_ms or 0.0 for r in result.records)
        self.assertGreater(queues[4], 50.0)
        self.assertGreater(queues[-1], 150.0)
        self.assertTrue(result.server_samples)  # polled beside the exact series

    def test_client_concurrency_16_above_4_server_slots(self) -> None:
        result = asyncio.run(run_harness(simulated(16, 16, 4)))
        s = result.summary
        self.assertEqual(s["completed"], 16)
        self.assertEqual(s["max_client_in_flight"], 16)
        self.assertEqual(max(x.running for x in result.server_exact), 4)
        self.assertEqual(s["peak_server_running"], 4)
        self.assertEqual(s["peak_server_waiting"], 12)
        # the wait is server waiting time, so it shows in TTFT, not in the client's queue time
        queues = [r.metrics().queue_ms or 0.0 for r in result.records]
        ttfts = sorted(r.metrics().ttft_ms or 0.0 for r in result.records)
        self.assertLess(max(queues), 20.0)
        self.assertLess(ttfts[3], 45.0)  # first wave: prefill only
        self.assertGreater(ttfts[-1], 3 * 55.0 + 20.0 - 5.0)  # fourth wave waited three E2ELs


class WarmupAndRateTest(unittest.TestCase):
    def test_warmup_requests_are_not_recorded_and_honour_the_limit(self) -> None:
        config = dataclasses.replace(simulated(4, 2, 8), warmup_requests=3)
        result = asyncio.run(run_harness(config))
        self.assertEqual(sorted(r.request_id for r in result.records), [0, 1, 2, 3])
        self.assertEqual(result.summary["num_requests"], 4)

    def test_poisson_arrivals_spread_the_requests(self) -> None:
        config = dataclasses.replace(simulated(6, 6, 8), request_rate=20.0, seed=3)
        result = asyncio.run(run_harness(config))
        arrivals = sorted(r.arrival_ns for r in result.records)
        self.assertEqual(arrivals[0], result.start_ns)
        self.assertGreater(arrivals[-1] - arrivals[0], 50_000_000)  # 5 gaps of mean 50 ms
        for r in result.records:  # each request is sent at (or just after) its arrival
            self.assertLess(r.metrics().queue_ms or 0.0, 20.0)
            self.assertGreaterEqual(r.sent_ns or 0, r.arrival_ns)


class InterruptTest(unittest.TestCase):
    def test_cancelling_a_run_keeps_every_finished_record(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "requests.jsonl"
            finished: list[RequestRecord] = []

            async def interrupted_run() -> None:
                with JsonlWriter(path, fsync=False) as writer:

                    def on_record(record: RequestRecord) -> None:
                        finished.append(record)
                        writer.write(record.to_json())

                    config = simulated(12, 2, 8)  # six waves of 55 ms
                    task = asyncio.create_task(run_harness(config, on_record=on_record))
                    while len(finished) < 3:
                        await asyncio.sleep(0.005)
                    task.cancel()
                    with self.assertRaises(asyncio.CancelledError):
                        await task

            asyncio.run(interrupted_run())
            lines = [json.loads(line) for line in path.read_text().splitlines()]
        self.assertGreaterEqual(len(lines), 3)
        self.assertLess(len(lines), 12)
        self.assertEqual([line["request_id"] for line in lines], [r.request_id for r in finished])
        self.assertTrue(all(line["status"] == "ok" for line in lines))


if __name__ == "__main__":
    unittest.main()
