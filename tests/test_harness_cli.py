"""The harness command: files written, argument errors before any file, real HTTP end to end."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import socket
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.harness.cli import add_arguments, main, run
from attention_kv_caceh.harness.records import JSONL_KEYS
from attention_kv_caceh.harness.scripted_server import scripted_server_process

FAST = ["--prefill-ms", "5", "--per-token-ms", "2", "--output-len", "4"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def quietly(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


class CliTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = Path(self._tmp.name)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_simulated_run_writes_jsonl_summary_and_plot(self) -> None:
        jsonl, summary, plot = self.tmp / "r.jsonl", self.tmp / "s.json", self.tmp / "t.png"
        code, out, _ = quietly(
            [
                *FAST,
                "--num-requests",
                "6",
                "--concurrency",
                "2",
                "--jsonl",
                str(jsonl),
                "--summary-json",
                str(summary),
                "--plot",
                str(plot),
                "--goodput",
                "ttft:1000",
            ]
        )
        self.assertEqual(code, 0, out)
        lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
        self.assertEqual(len(lines), 6)
        self.assertEqual(sorted(line["request_id"] for line in lines), list(range(6)))
        for line in lines:
            self.assertEqual(tuple(line), JSONL_KEYS)
            self.assertEqual(line["status"], "ok")
            self.assertEqual(line["tokens_per_event"], [1, 1, 1, 1])
        doc = json.loads(summary.read_text())
        for key in ("mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_itl_ms", "mean_e2el_ms"):
            self.assertIsInstance(doc[key], float, key)
        self.assertEqual(doc["completed"], 6)
        self.assertEqual(doc["max_concurrent_requests"], 2)
        self.assertEqual(doc["good_requests"], 6)
        self.assertIn("environment", doc)
        self.assertEqual(plot.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
        self.assertIn("TTFT (first token - sent)", out)
        self.assertIn("peak client in-flight: 2", out)

    def test_bad_arguments_raise_before_any_file_is_created(self) -> None:
        jsonl = self.tmp / "r.jsonl"
        cases = {
            "--output-len=0": "'0'",
            "--prompt-len=8:2": "'8:2'",
            "--concurrency=0": "concurrency",
            "--num-requests=-3": "-3",
            "--request-rate=-1": "-1",
            "--burstiness=0": "burstiness",
            "--server-slots=0": "slots",
            "--goodput=ttft:fast": "ttft:fast",
            "--timeout=0": "timeout",
            "--server-metrics-interval=-1": "interval",
            f"--plot={self.tmp / 'x.jpg'}": "x.jpg",
        }
        for flag, named in cases.items():
            with self.subTest(flag=flag):
                args = parse([flag, "--jsonl", str(jsonl)])
                with self.assertRaisesRegex(ValueError, named):
                    run(args)
                self.assertFalse(jsonl.exists())
        code, _, err = quietly(["--concurrency", "0"])
        self.assertEqual(code, 2)
        self.assertIn("concurrency", err)

    def test_unreachable_server_fails_fast_and_leaves_no_file(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        jsonl = self.tmp / "r.jsonl"
        code, _, err = quietly(
            [
                "--backend",
                "openai-completions",
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--model",
                "m",
                "--jsonl",
                str(jsonl),
            ]
        )
        self.assertEqual(code, 1)
        self.assertIn("smoke test", err)
        self.assertIn("server running", err)
        self.assertFalse(jsonl.exists())

    def test_openai_chat_and_completions_end_to_end(self) -> None:
        with scripted_server_process(20, 5) as url:
            for backend in ("openai-chat", "openai-completions"):
                with self.subTest(backend=backend):
                    jsonl = self.tmp / f"{backend}.jsonl"
                    code, out, err = quietly(
                        [
                            "--backend",
                            backend,
                            "--base-url",
                            url + "/v1",
                            "--num-requests",
                            "8",
                            "--concurrency",
                            "4",
                            "--output-len",
                            "3:5",
                            "--jsonl",
                            str(jsonl),
                        ]
                    )
                    self.assertEqual(code, 0, out + err)
                    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
                    self.assertEqual(len(lines), 8)
                    for line in lines:
                        self.assertEqual(line["output_tokens"], len(line["token_times_ns"]))
                        self.assertIn(line["output_tokens"], (3, 4, 5))
                        self.assertEqual(line["output_tokens_source"], "usage")
                        self.assertGreaterEqual(line["ttft_ms"], 19.5)


if __name__ == "__main__":
    unittest.main()
