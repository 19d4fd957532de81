"""The harness measures known delays, and the client's semaphore is not the server's batch.

1. Against the scripted server (127.0.0.1, in this process's event loop, TTFT 60 ms, one token every
   40 ms on absolute deadlines, 6 tokens), 2 x concurrency requests at concurrency 1, 16 and 128. The
   server stamps each request's arrival and each write (`perf_counter_ns`, the records' clock) and tags
   each stream with its own `usage.prompt_tokens`, so every record is paired with the server's own
   times. No assertion is a wall-clock bound that a loaded machine can break:
   - physics: no token is seen before the server wrote it, nor before its scripted deadline
     (arrival + TTFT + k x ITL); no request reaches the server before the client sent it;
   - attribution (concurrency 1 and 16): the median gap between a write and the client's timestamp of
     that token is under half an ITL, i.e. each token is timed at its own write, not at a neighbour's
     (load delays the server's write and the client's read alike; the gap measures only the path
     between them). At 128 the server writes 128 tokens in one burst in the same event loop and the
     client reads them one after another, so the gap measures the burst's backlog, not attribution;
     only the bounds above are checked there;
   - the semaphore: the k-th request sent (k >= concurrency) left only after k - concurrency + 1
     requests had finished, and the second wave's queue time is at least one scripted E2EL.
2. Client concurrency against server slots, on the simulated backend: concurrency 4 with 8 server slots never has
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
from typing import Any

from attention_kv_caceh.files import JsonlWriter
from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import HarnessConfig, RunResult, run_harness
from attention_kv_caceh.harness.scripted_server import Script, ScriptedServer, timed_token_script

TTFT_MS, ITL_MS, TOKENS = 60.0, 40.0, 6
E2EL_MS = TTFT_MS + (TOKENS - 1) * ITL_MS
TAG = 1000  # usage.prompt_tokens of the i-th request to reach the server is TAG + i


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class KnownDelaysTest(unittest.TestCase):
    def measure(self, concurrency: int) -> tuple[RunResult, ScriptedServer]:
        server: ScriptedServer | None = None

        def script_for(payload: dict[str, Any], path: str) -> Script:
            assert server is not None
            index = len(server.counters.payloads) - 1  # this request's, in arrival order
            return timed_token_script(TTFT_MS / 1000, ITL_MS / 1000, TOKENS, prompt_tokens=TAG + index)

        async def run() -> RunResult:
            nonlocal server
            async with ScriptedServer(script_for) as server:
                config = HarnessConfig(
                    backend="openai-completions",
                    base_url=server.base_url,
                    model="scripted",
                    num_requests=2 * concurrency,
                    concurrency=concurrency,
                    output_len=LengthRange(TOKENS, TOKENS),
                    server_metrics_interval_s=0,
                    timeout_s=60,
                    smoke_test=False,
                )
                return await run_harness(config)

        result = asyncio.run(run())
        assert server is not None
        return result, server

    def test_known_ttft_itl_and_queue_at_concurrency_1_16_128(self) -> None:
        for concurrency in (1, 16, 128):
            with self.subTest(concurrency=concurrency):
                result, server = self.measure(concurrency)
                s = result.summary
                self.assertEqual(s["failed"], 0, s["failures"])
                self.assertEqual(s["max_client_in_flight"], concurrency)
                self.assertEqual(s["total_output_tokens"], 2 * concurrency * TOKENS)
                self.assertEqual(
                    sorted(r.prompt_tokens for r in result.records),
                    [TAG + i for i in range(2 * concurrency)],
                )  # one record per server request
                gaps_ms: list[float] = []
                for r in result.records:
                    i = r.prompt_tokens - TAG
                    arrival, writes = server.counters.arrival_ns[i], server.counters.write_ns[i]
                    self.assertEqual(r.tokens_per_event, [1] * TOKENS)
                    self.assertEqual(r.output_tokens_source, "usage")
                    self.assertLessEqual(r.sent_ns or 0, arrival)
                    for k, seen in enumerate(r.token_times_ns):
                        self.assertGreaterEqual(seen, writes[k])  # never before it was written
                        # 1 ms for the two clocks the server reads (loop.time, perf_counter_ns)
                        deadline = arrival + int((TTFT_MS + k * ITL_MS - 1.0) * 1e6)
                        self.assertGreaterEqual(seen, deadline)  # nor before its scripted time
                        gaps_ms.append((seen - writes[k]) / 1e6)
                    ttft = r.metrics().ttft_ms or 0.0
                    self.assertGreaterEqual(ttft, TTFT_MS - 1.0)
                if concurrency <= 16:
                    self.assertLess(median(gaps_ms), ITL_MS / 2)
                sent = sorted(r.sent_ns or 0 for r in result.records)
                ended = sorted(r.stream_end_ns or 0 for r in result.records)
                for k in range(concurrency, len(sent)):  # a slot frees only when a request ends
                    self.assertGreaterEqual(sent[k], ended[k - concurrency])
                queues = sorted(r.metrics().queue_ms or 0.0 for r in result.records)
                self.assertGreaterEqual(queues[concurrency], E2EL_MS)


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
        # (lower bounds are the simulated server's sleeps; the comparison is between two measured times)
        queues = [r.metrics().queue_ms or 0.0 for r in result.records]
        ttfts = sorted(r.metrics().ttft_ms or 0.0 for r in result.records)
        # The server's waves are timed from the first request's start, not from each request's own
        # send (on a loaded machine the client may send the fifth request milliseconds after the first).
        first_sent = min(r.sent_ns or 0 for r in result.records)
        firsts_ms = sorted(((r.first_token_ns or 0) - first_sent) / 1e6 for r in result.records)
        self.assertGreaterEqual(firsts_ms[4], 55.0 + 20.0 - 1.0)  # second wave waited one E2EL
        self.assertGreaterEqual(firsts_ms[-1], 3 * 55.0 + 20.0 - 1.0)  # fourth wave waited three E2ELs
        self.assertGreater(ttfts[4], 20.0 + 20.0)  # its TTFT holds the server's wait, not only its prefill
        self.assertLess(max(queues), ttfts[4] - 20.0)  # no client queue as long as the server's wait


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
            self.assertGreaterEqual(r.sent_ns or 0, r.arrival_ns)
        # no slot is ever waited for: the median queue is well under the mean gap between arrivals
        self.assertLess(median([r.metrics().queue_ms or 0.0 for r in result.records]), 50.0 / 2)


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
