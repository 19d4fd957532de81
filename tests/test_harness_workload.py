"""What a run records about itself: measured prompts independent of warm-ups, the model and settings
actually used, client lateness apart from queue time, and vLLM's key names with vLLM's meanings."""

from __future__ import annotations

import unittest
from dataclasses import replace
from time import perf_counter_ns
from typing import Any

from attention_kv_caceh.harness.backends import RequestSpec
from attention_kv_caceh.harness.load import LengthRange, run_requests
from attention_kv_caceh.harness.metrics import compute_request_metrics
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import HarnessConfig, plan_requests, run_harness
from attention_kv_caceh.harness.scripted_server import ScriptedServer, timed_token_script
from attention_kv_caceh.harness.summary import second_bucket_peaks, summarize_run

NS = 1_000_000_000


def scripted(payload: dict[str, Any], path: str) -> Any:
    return timed_token_script(0.0, 0.0, 2)


class WarmupTest(unittest.IsolatedAsyncioTestCase):
    def test_plan_of_measured_requests_ignores_warmups(self) -> None:
        base = HarnessConfig(num_requests=8, prompt_len=LengthRange(3, 40), request_rate=5.0, seed=7)
        _, specs0, offsets0 = plan_requests(base)
        warm, specs5, offsets5 = plan_requests(replace(base, warmup_requests=5))
        self.assertEqual(len(warm), 5)
        self.assertEqual((specs0, offsets0), (specs5, offsets5))

    async def test_server_sees_the_same_measured_prompts_with_and_without_warmups(self) -> None:
        seen: list[list[str]] = []
        for warmups in (0, 3):
            async with ScriptedServer(scripted) as server:
                config = HarnessConfig(
                    backend="openai-completions",
                    base_url=server.base_url,
                    num_requests=4,
                    concurrency=1,
                    prompt_len=LengthRange(2, 30),
                    output_len=LengthRange(2, 2),
                    warmup_requests=warmups,
                    server_metrics_interval_s=0,
                    seed=3,
                )
                await run_harness(config)
                seen.append([p["prompt"] for p in server.counters.payloads[-4:]])
        self.assertEqual(seen[0], seen[1])


class RecordWhatWasUsedTest(unittest.IsolatedAsyncioTestCase):
    async def test_model_from_v1_models_is_recorded_and_simulated_settings_are_not(self) -> None:
        async with ScriptedServer(scripted) as server:
            config = HarnessConfig(
                backend="openai-chat",
                base_url=server.base_url,
                num_requests=2,
                output_len=LengthRange(2, 2),
                server_metrics_interval_s=0,
                label="nightly",
            )
            result = await run_harness(config)
        described = result.config.describe()
        self.assertEqual(described["model"], "scripted")
        for key in ("server_slots", "prefill_ms", "per_token_ms"):
            self.assertNotIn(key, described)
        self.assertEqual(result.summary["model_id"], "scripted")
        self.assertEqual(result.summary["label"], "nightly")
        simulated = HarnessConfig().describe()
        self.assertIn("server_slots", simulated)
        self.assertNotIn("base_url", simulated)


class LatenessTest(unittest.IsolatedAsyncioTestCase):
    def test_lateness_and_queue_are_split_at_dispatch(self) -> None:
        m = compute_request_metrics(
            arrival_ns=0,
            dispatch_ns=5_000_000,
            sent_ns=7_000_000,
            first_token_ns=10_000_000,
            token_times_ns=[10_000_000],
            tokens_per_event=[1],
            finish_ns=10_000_000,
            output_tokens=1,
        )
        self.assertEqual((m.lateness_ms, m.queue_ms, m.ttft_ms), (5.0, 2.0, 3.0))

    async def test_a_late_client_shows_as_lateness_not_queue_time(self) -> None:
        class Instant:
            async def generate(self, spec: RequestSpec, record: RequestRecord) -> None:
                record.add_token_event(perf_counter_ns(), 1)
                record.status = "ok"

        specs = [RequestSpec(i, 1, 1) for i in range(4)]
        # arrivals scheduled a whole second before the loop starts them: every request is >= 1 s late
        records = await run_requests(Instant(), specs, [0.0] * 4, 100, start_ns=perf_counter_ns() - NS)
        for r in records:
            m = r.metrics()
            assert m.lateness_ms is not None and m.queue_ms is not None
            self.assertGreaterEqual(m.lateness_ms, 1000.0)
            self.assertLess(m.queue_ms, m.lateness_ms)  # the semaphore was free: no queue
        summary = summarize_run(records, 2.0)
        self.assertTrue(any("lateness P99" in w for w in summary["warnings"]))
        self.assertGreaterEqual(summary["p99_lateness_ms"], 1000.0)


class VllmKeyTest(unittest.TestCase):
    def record(self, rid: int, sent_s: float, token_s: list[float]) -> RequestRecord:
        r = RequestRecord(rid, int(sent_s * NS), 1, sent_ns=int(sent_s * NS))
        for t in token_s:
            r.add_token_event(int(t * NS), 2)
        r.output_tokens = 2 * len(token_s)
        r.status = "ok"
        return r

    def test_second_buckets_as_vllm_defines_them(self) -> None:
        records = [
            self.record(0, 0.0, [0.1, 0.2, 0.3]),  # active in second 0
            self.record(1, 0.5, [1.2, 1.4]),  # seconds 0-1
            self.record(2, 1.5, [2.5]),  # seconds 1-2
        ]
        # second 0: requests 0, 1 active; tokens 6. second 1: requests 1, 2; tokens 4. second 2: 1 request
        self.assertEqual(second_bucket_peaks(records), (2, 6.0))
        summary = summarize_run(records, 3.0, peak_in_flight=3)
        self.assertEqual(summary["max_client_in_flight"], 3)
        self.assertEqual(summary["max_concurrent_requests"], 2)
        self.assertEqual(summary["max_output_tokens_per_s"], 6.0)


if __name__ == "__main__":
    unittest.main()
