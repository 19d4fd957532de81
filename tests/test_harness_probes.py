"""Probe requests beside a load: one at a time, outside the client's concurrency limit, kept out of the
load's statistics, with their own TTFT and E2EL; the report shows them apart."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any

from attention_kv_caceh.harness.backends import SimulatedBackend, SimulatedServer
from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.probes import PROBE_ID_BASE, probe_spec, probe_summary, run_probes
from attention_kv_caceh.harness.run import HarnessConfig, run_harness
from attention_kv_caceh.harness.scripted_server import Script, ScriptedServer, timed_token_script


class ProbeLoopTest(unittest.IsolatedAsyncioTestCase):
    async def test_one_at_a_time_on_a_grid_and_slots_overrun_are_skipped(self) -> None:
        server = SimulatedServer(1, prefill_ms=30, per_token_ms=0)  # each probe takes 30 ms
        stop = asyncio.Event()
        start = asyncio.get_running_loop().time()
        from time import perf_counter_ns

        task = asyncio.create_task(
            run_probes(SimulatedBackend(server), probe_spec(), 100.0, perf_counter_ns(), stop)
        )
        await asyncio.sleep(0.2)
        stop.set()
        records = await task
        self.assertGreater(len(records), 2)
        self.assertLess(len(records), 9)  # at 100/s, but one 30 ms probe at a time: about 7
        for a, b in itertools.pairwise(records):
            assert a.stream_end_ns is not None and b.sent_ns is not None
            self.assertGreaterEqual(b.sent_ns, a.stream_end_ns)  # never two in flight
            self.assertEqual((b.arrival_ns - records[0].arrival_ns) % 10_000_000, 0)  # on the 10 ms grid
        self.assertTrue(all(r.probe and r.ok and r.output_tokens == 1 for r in records))
        self.assertEqual(records[0].request_id, PROBE_ID_BASE)
        self.assertLess(asyncio.get_running_loop().time() - start, 1.0)

    def test_summary_keys(self) -> None:
        summary = probe_summary([], 2.0)
        self.assertEqual((summary["probe_completed"], summary["probe_failed"]), (0, 0))
        self.assertIsNone(summary["probe_median_e2el_ms"])
        with self.assertRaisesRegex(ValueError, "probe rate"):
            backend = SimulatedBackend(SimulatedServer(1, 0, 0))
            asyncio.run(run_probes(backend, probe_spec(), 0.0, 0, asyncio.Event()))


class ProbesBesideALoadTest(unittest.IsolatedAsyncioTestCase):
    async def test_a_saturating_load_delays_the_probes_which_are_reported_apart(self) -> None:
        # 2 batch slots, 12 requests of 40 ms in flight at once: a probe waits in the server's queue
        config = HarnessConfig(
            num_requests=12,
            concurrency=12,
            server_slots=2,
            prefill_ms=20,
            per_token_ms=5,
            output_len=LengthRange(5, 5),
            probe_rate=20.0,
            server_metrics_interval_s=0,
        )
        seen: list[Any] = []
        result = await run_harness(config, on_record=seen.append)
        summary = result.summary
        self.assertEqual((summary["num_requests"], summary["completed"]), (12, 12))  # probes left out
        probes = result.probe_records
        self.assertGreaterEqual(len(probes), 2)
        self.assertEqual(summary["probe_completed"], len(probes))
        self.assertEqual(len(seen), 12 + len(probes))  # every probe record went out to be written too
        # the first probe arrives with the burst and waits for a slot behind the load: its TTFT is the
        # queue, far above an idle server's 20 ms
        self.assertGreater(summary["probe_max_ttft_ms"], 3 * 20)
        self.assertEqual(summary["probe_count_e2el"], len(probes))
        self.assertFalse(any(r.probe for r in result.records))

    async def test_the_servers_counters_count_the_probes_as_the_clients(self) -> None:
        server: ScriptedServer | None = None

        def script_for(payload: dict[str, Any], path: str) -> Script:
            assert server is not None
            prompt = len(server.prompt_ids(payload))
            return timed_token_script(0.01, 0.002, int(payload["max_tokens"]), prompt_tokens=prompt)

        server = ScriptedServer(script_for, counters=True, tokenizer=True)
        async with server:
            config = HarnessConfig(
                backend="openai-completions",
                base_url=server.base_url,
                num_requests=6,
                concurrency=2,
                output_len=LengthRange(8, 8),
                probe_rate=50.0,
                server_metrics_interval_s=0,
                smoke_test=False,
            )
            result = await run_harness(config)
        counters = result.summary["server_counters"]
        self.assertGreaterEqual(result.summary["probe_completed"], 1)
        self.assertEqual((counters["prompt_tokens_diff"], counters["generation_tokens_diff"]), (0, 0))
        probes = [p for p in server.counters.payloads if p["max_tokens"] == 1]
        self.assertEqual(len(probes), len(result.probe_records))
        self.assertTrue(all(len(p["prompt"]) == 1 for p in probes))  # one token id


class ProbeFilesTest(unittest.TestCase):
    def test_probes_are_in_the_jsonl_and_the_report_keeps_them_apart(self) -> None:
        from attention_kv_caceh import cli
        from attention_kv_caceh.report import build_report

        with tempfile.TemporaryDirectory() as tmp:
            jsonl = Path(tmp) / "run.jsonl"
            argv = ["harness", "--num-requests", "8", "--concurrency", "8", "--server-slots", "2",
                    "--prefill-ms", "10", "--per-token-ms", "5", "--output-len", "4", "--probe-rate", "40",
                    "--jsonl", str(jsonl)]  # fmt: skip
            with contextlib.redirect_stdout(io.StringIO()) as out:
                self.assertEqual(cli.main(argv), 0)
            self.assertRegex(out.getvalue(), r"probes \(1 token in, 1 out, 40/s beside the load\): \d+ ok")
            lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
            probes = [line for line in lines if line["probe"]]
            self.assertEqual(len(lines) - len(probes), 8)
            self.assertGreaterEqual(len(probes), 1)
            report = build_report(tmp, Path(tmp) / "REPORT.md", plot=False).markdown
        self.assertIn("8 request(s), 8 completed", report)
        self.assertIn(
            f"Probes (one-token requests sent beside the load, not in the table): {len(probes)}", report
        )


if __name__ == "__main__":
    unittest.main()
