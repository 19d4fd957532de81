"""`--workers N`: the load split over worker processes on one schedule gives every request once, with
the same per-request metrics as one process on the scripted server, in the same files; Ctrl-C keeps
what finished; the client's own CPU and the warning when it was the bottleneck."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any

from attention_kv_caceh.harness.backends import RequestSpec
from attention_kv_caceh.harness.client_cpu import CpuSpan, client_cpu_summary, client_cpu_warning
from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import HarnessConfig, run_harness
from attention_kv_caceh.harness.scripted_server import Script, ScriptedServer, timed_token_script
from attention_kv_caceh.harness.workers import (  # pyright: ignore[reportPrivateUsage]
    _merge_in_flight,
    cut_short,
    spawn_worker,
    split_load,
)

TTFT_S, ITL_S = 0.03, 0.02


TAG = 1000  # the scripted usage's prompt_tokens is TAG + the request's index at the server


def _server() -> ScriptedServer:
    server: ScriptedServer | None = None

    def script_for(payload: dict[str, Any], path: str) -> Script:
        assert server is not None
        index = server.counters.requests - 1
        return timed_token_script(TTFT_S, ITL_S, int(payload["max_tokens"]), prompt_tokens=TAG + index)

    server = ScriptedServer(script_for)
    return server


class SplitTest(unittest.TestCase):
    def test_round_robin_with_the_concurrency_split(self) -> None:
        specs = [RequestSpec(i, 1, 1) for i in range(7)]
        parts = split_load(specs, [0.1 * i for i in range(7)], 5, 3)
        self.assertEqual([[s.request_id for s in p[0]] for p in parts], [[0, 3, 6], [1, 4], [2, 5]])
        self.assertEqual([p[1] for p in parts][1], [0.1, 0.4])
        self.assertEqual([p[2] for p in parts], [2, 2, 1])
        with self.assertRaisesRegex(ValueError, "cannot be split"):
            split_load(specs, [0.0] * 7, 2, 3)

    def test_in_flight_series_are_summed(self) -> None:
        merged, peak = _merge_in_flight([[(1, 1), (5, 0)], [(2, 1), (3, 2), (6, 1), (7, 0)]])
        self.assertEqual(merged, [(1, 1), (2, 2), (3, 3), (5, 2), (6, 1), (7, 0)])
        self.assertEqual(peak, 3)

    def test_a_worker_starts_outside_the_terminals_process_group_and_leaves_quietly(self) -> None:
        # a terminal's Ctrl-C goes to its foreground process group: a worker is never in it, even
        # while it imports; a parent gone before sending its plan ends it without a traceback
        ours, theirs = socket.socketpair()
        with theirs:
            proc = spawn_worker(theirs.fileno())
        try:
            self.assertEqual(os.getpgid(proc.pid), proc.pid)
            self.assertNotEqual(os.getpgid(proc.pid), os.getpgid(0))
        finally:
            ours.close()
            self.assertEqual(proc.wait(timeout=60), 0)

    def test_requests_failed_after_ctrl_c_are_cut_short_not_server_failures(self) -> None:
        def record(status: str, end_ns: int) -> RequestRecord:
            r = RequestRecord(0, 100)
            r.sent_ns, r.stream_end_ns = 110, end_ns
            if status != "ok":
                r.fail(status, "the server is shutting down", end_ns)
            else:
                r.status = status
            return r

        interrupt = 1000
        self.assertTrue(cut_short(record("http_error", 1001), interrupt))  # the server shutting down
        self.assertFalse(cut_short(record("http_error", 999), interrupt))  # a failure before Ctrl-C
        self.assertFalse(cut_short(record("ok", 1001), interrupt))  # a whole request is a sample

    def test_config_refuses_what_workers_cannot_split(self) -> None:
        for kwargs, message in (
            ({}, "simulated server lives in the client's process"),
            ({"backend": "openai-completions", "concurrency": 1}, "at least the number of workers"),
            ({"backend": "openai-completions", "workers": 65}, r"^workers: must be in \[1, 64\]"),
        ):
            with self.subTest(kwargs=kwargs), self.assertRaisesRegex(ValueError, message):
                HarnessConfig(**({"workers": 2} | kwargs))


class WorkersAgainstTheScriptedServerTest(unittest.IsolatedAsyncioTestCase):
    async def test_two_workers_give_the_metrics_of_one(self) -> None:
        """Each token is seen after the server wrote it and after its scripted time, in one process and
        over two: the same schedule and the same token counts from two processes' clocks (one
        CLOCK_MONOTONIC)."""
        results = {}
        async with _server() as server:
            for workers in (1, 2):
                config = HarnessConfig(
                    backend="openai-completions",
                    base_url=server.base_url,
                    model="scripted",
                    num_requests=24,
                    concurrency=8,
                    request_rate=200.0,
                    output_len=LengthRange(6, 6),
                    server_metrics_interval_s=0,
                    smoke_test=False,
                    workers=workers,
                )
                seen: list[Any] = []
                results[workers] = (await run_harness(config, on_record=seen.append), seen)
            counters = server.counters
        one, two = results[1][0], results[2][0]
        self.assertEqual([r.request_id for r in two.records], list(range(24)))
        self.assertEqual(sorted(r.request_id for r in results[2][1]), list(range(24)))  # each sent on once
        self.assertEqual(two.summary["failed"], 0)
        # one schedule: the same arrival offsets in both runs
        offsets = [[r.arrival_ns - res.records[0].arrival_ns for r in res.records] for res in (one, two)]
        self.assertEqual(offsets[0], offsets[1])
        for res in (one, two):
            for r in res.records:
                i = (r.prompt_tokens or 0) - TAG
                arrival, writes = counters.arrival_ns[i], counters.write_ns[i]
                self.assertLessEqual(r.sent_ns or 0, arrival)
                self.assertEqual(len(r.token_times_ns), 6)
                for k, t in enumerate(r.token_times_ns):
                    self.assertGreaterEqual(t, writes[k])  # never before the server wrote it
                    self.assertGreaterEqual(t, arrival + int((TTFT_S + k * ITL_S) * 1e9) - 1_000_000)
                    # (how soon after the write it came is a measurement, not a property: the
                    # client's CPU share decides it, see scripts/client_cpu.py)
        cpu = two.summary["client_cpu"]
        self.assertEqual((cpu["workers"], cpu["requests"], cpu["token_events"]), (2, 24, 24 * 6))
        self.assertEqual(sum(w["requests"] for w in cpu["per_worker"]), 24)
        self.assertIsNotNone(cpu["coordinator_cpu_s"])
        self.assertLessEqual(two.summary["max_client_in_flight"], 8)


class WorkersCommandTest(unittest.TestCase):
    def test_the_jsonl_of_two_workers_is_one_processs_file_and_ctrl_c_keeps_what_finished(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            server = subprocess.Popen(
                [sys.executable, "-m", "attention_kv_caceh.cli.scripted_server", "--ttft-ms", "5",
                 "--itl-ms", "50"],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                assert server.stdout is not None
                url = f"http://127.0.0.1:{int(server.stdout.readline().split()[1])}"
                jsonl = Path(tmp) / "w.jsonl"
                argv = [sys.executable, "-m", "attention_kv_caceh.benchmark", "harness", "--backend",
                        "openai-completions", "--base-url", url, "--model", "scripted", "--num-requests", "40",
                        "--concurrency", "4", "--output-len", "12", "--workers", "2", "--jsonl", str(jsonl),
                        "--server-metrics-interval", "0"]  # fmt: skip
                run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
                self.assertEqual(run.returncode, 0, run.stderr)
                self.assertNotIn("Unclosed", run.stderr)  # every worker's and the parent's session closed
                lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
                self.assertEqual(sorted(line["request_id"] for line in lines), list(range(40)))
                self.assertEqual(set(lines[0]), {*lines[0]})  # the keys a one-process run writes
                meta = json.loads((Path(tmp) / "w.jsonl.meta.json").read_text())
                self.assertEqual(
                    (meta["status"], meta["records"], meta["config"]["workers"]), ("complete", 40, 2)
                )
                # interrupted after the first requests finished: what finished is kept
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and (
                    not jsonl.exists()
                    or meta_mtime(jsonl) is not None
                    or len(jsonl.read_text().splitlines()) < 4
                ):
                    time.sleep(0.05)
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=60)
                self.assertEqual(proc.returncode, 130, err)
                kept = [json.loads(line) for line in jsonl.read_text().splitlines()]
                self.assertGreaterEqual(len(kept), 4)
                self.assertLess(len(kept), 40)
                self.assertEqual(len({k["request_id"] for k in kept}), len(kept))
                self.assertIn(f"{len(kept)} finished requests kept", err)
                self.assertEqual(
                    json.loads((Path(tmp) / "w.jsonl.meta.json").read_text())["status"], "interrupted"
                )
                time.sleep(0.5)
                workers = subprocess.run(
                    ["pgrep", "-f", "attention_kv_caceh.harness.workers"], capture_output=True, text=True
                )
                self.assertNotIn(str(proc.pid), workers.stdout)
            finally:
                server.terminate()
                server.wait(timeout=10)
                if server.stdout is not None:
                    server.stdout.close()


def meta_mtime(jsonl: Path) -> float | None:
    """The mtime of the JSONL's metadata, None while the run has not written it (it is removed at the
    run's first record)."""
    meta = jsonl.with_name(jsonl.name + ".meta.json")
    return meta.stat().st_mtime if meta.exists() else None


class ClientCpuTest(unittest.TestCase):
    def test_summary_and_the_bottleneck_warning(self) -> None:
        busy = CpuSpan(process_ns=950_000_000, loop_ns=920_000_000, requests=10, token_events=100)
        idle = CpuSpan(process_ns=100_000_000, loop_ns=90_000_000, requests=10, token_events=100)
        cpu = client_cpu_summary([busy, idle], CpuSpan(50_000_000, 0), 1.0)
        self.assertAlmostEqual(cpu["process_cpu_s"], 1.1)
        self.assertAlmostEqual(cpu["per_request_us"], 1.1e6 / 20)
        self.assertAlmostEqual(cpu["per_token_event_us"], 1.1e6 / 200)
        self.assertAlmostEqual(cpu["loop_busy_fraction"], 0.92)
        warning = client_cpu_warning(cpu, 1.0)
        assert warning is not None
        self.assertIn("the client was the bottleneck", warning)
        self.assertIn("--workers 4", warning)
        self.assertIsNone(client_cpu_warning(client_cpu_summary([idle], None, 1.0), 1.0))

    def test_the_summary_line_states_the_clients_cpu(self) -> None:
        from attention_kv_caceh import cli

        argv = ["harness", "--num-requests", "20", "--concurrency", "5", "--prefill-ms", "1",
                "--per-token-ms", "1", "--output-len", "4", "--server-metrics-interval", "0"]  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()) as out:
            self.assertEqual(cli.main(argv), 0)
        self.assertRegex(out.getvalue(), r"client CPU: [\d.]+ µs per token event, \d+ µs per request")


if __name__ == "__main__":
    unittest.main()
