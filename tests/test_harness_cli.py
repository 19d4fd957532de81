"""The harness command: files written, argument errors before any file, runtime failures as one line,
Ctrl-C, real HTTP end to end."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

from attention_kv_caceh import cli
from attention_kv_caceh.cli.common import UsageError
from attention_kv_caceh.cli.harness import add_arguments, run
from attention_kv_caceh.files import write_json_atomic
from attention_kv_caceh.harness import overhead
from attention_kv_caceh.harness.records import JSONL_KEYS
from attention_kv_caceh.harness.run import HarnessConfig, run_harness
from attention_kv_caceh.harness.scripted_server import scripted_server_process
from attention_kv_caceh.memory import memory_budget_bytes
from tests import ctrl_c_as_in_a_terminal

ctrl_c_as_in_a_terminal()  # the Ctrl-C tests also pass as a background job (tests/__init__.py)

FAST = ["--prefill-ms", "5", "--per-token-ms", "2", "--output-len", "4"]
GREEDY = ["--temperature", "0"]  # an HTTP run without it prints a warning line first


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    return cli.main(["harness", *argv])


def quietly(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def free_port() -> int:
    """A loopback port that was free a moment ago and has no listener."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def no_output_check(path: object, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """Stands in for files.check_output_path where a path passes the check but cannot be written
    (as /proc/x once did): the failure then comes during the run."""
    return Path(str(path))


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
        self.assertEqual(doc["max_client_in_flight"], 2)
        self.assertEqual(doc["good_requests"], 6)
        self.assertIn("environment", doc)
        self.assertEqual(plot.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
        meta = json.loads((self.tmp / "r.jsonl.meta.json").read_text())
        self.assertEqual(meta["status"], "complete")
        self.assertEqual(meta["records"], 6)
        self.assertEqual(meta["config"]["concurrency"], 2)
        self.assertIn("python", meta["environment"])
        self.assertIn(f"wrote: {jsonl}, {jsonl}.meta.json, {summary}, {plot}", out)
        self.assertIn("TTFT (first token - sent)", out)
        self.assertIn("peak client in-flight: 2", out)

    def test_bad_arguments_raise_before_any_file_is_created(self) -> None:
        jsonl = self.tmp / "r.jsonl"
        cases = {
            "--output-len=0": "'0'",
            "--prompt-len=8:2": "'8:2'",
            "--concurrency=0": "0",
            "--num-requests=-3": "-3",
            "--num-requests=0": "0",  # refused, not read as "not given" (16 requests, or the trace's rows)
            "--request-rate=-1": "-1",
            "--burstiness=0": "0",
            "--seed=-1": "-1",
            "--warmup-requests=-1": "-1",
            "--server-slots=0": "0",
            "--prefill-ms=-1": "-1",
            "--per-token-ms=nan": "nan",
            "--goodput=ttft:fast": "ttft:fast",
            "--timeout=0": "0",
            "--server-metrics-interval=-1": "-1",
            f"--summary-json={self.tmp / 'file.txt' / 's.json'}": "file.txt",
            "--num-requests=1000000000": "1000000000",
            "--warmup-requests=1000000000": "1000000000",
            "--prompt-len=1000000000": "1000000000",
            "--output-len=1:1000000000": "1:1000000000",
        }
        (self.tmp / "file.txt").write_text("a file, not a folder\n")
        for arg, value in cases.items():
            flag = arg.partition("=")[0]
            with self.subTest(arg=arg):
                args = parse([arg, "--jsonl", str(jsonl)])
                out = io.StringIO()
                with contextlib.redirect_stdout(out), self.assertRaises(UsageError) as caught:
                    run(args)
                self.assertIn(flag, str(caught.exception))  # the message names the flag ...
                self.assertIn(value, str(caught.exception))  # ... and the value
                self.assertEqual(out.getvalue(), "")  # refused before the run
                self.assertFalse(jsonl.exists())
        # a wrong suffix is refused while parsing (the flag's type), naming the flag and the value
        code, out, err = quietly([f"--plot={self.tmp / 'x.jpg'}", "--jsonl", str(jsonl)])
        self.assertEqual((code, out), (2, ""))
        self.assertIn("--plot", err)
        self.assertIn("x.jpg", err)
        self.assertFalse(jsonl.exists())
        for url in ("http://", "ftp://h", "http://h:99999", "http://[::1"):
            with self.subTest(url=url):
                args = parse(["--backend", "openai-chat", "--base-url", url])
                with self.assertRaisesRegex(UsageError, "--base-url"):
                    run(args)
        code, out, err = quietly(["--seed", "-1"])
        self.assertEqual((code, out), (2, ""))
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("--seed", err)

    def test_runs_needing_more_memory_than_allowed_are_refused_with_one_line(self) -> None:
        jsonl = self.tmp / "r.jsonl"
        cases = {
            ("--num-requests", "1000"): "--num-requests: got 1000:",
            ("--num-requests", "1", "--prompt-len", "100000"): "--prompt-len: got 100000:",
            ("--num-requests", "2", "--output-len", "10:20000"): "--output-len: got 10:20000:",
        }
        for argv, start in cases.items():
            with (
                self.subTest(argv=argv),
                mock.patch("attention_kv_caceh.harness.config.memory_budget_bytes", return_value=2**20),
            ):
                code, out, err = quietly([*argv, "--jsonl", str(jsonl)])
                self.assertEqual((code, out), (2, ""))
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertTrue(err.startswith(f"attention-kv-caceh: error: {start}"), err)
                self.assertIn("of memory", err)
                self.assertFalse(jsonl.exists())
        limit = memory_budget_bytes()  # this machine's: positive, at most half its memory
        assert limit is not None
        self.assertGreater(limit, 0)
        self.assertLessEqual(limit, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)

    def test_help_shows_a_meaningful_default_or_none(self) -> None:
        # (each flag's default shown once: tests/test_cli.py, for every command)
        flat = " ".join(cli.build_parser("harness").format_help().split())
        for bad in ("None", "", "[]", "False"):
            self.assertNotIn(f"(default: {bad})", flat)

    def test_outputs_must_differ_including_the_jsonl_metadata(self) -> None:
        jsonl = self.tmp / "r.jsonl"
        args = parse(["--jsonl", str(jsonl), "--summary-json", f"{jsonl}.meta.json"])
        with self.assertRaisesRegex(UsageError, "differ"):
            run(args)
        self.assertEqual(list(self.tmp.iterdir()), [])

    def test_jsonl_write_failure_during_the_run_stops_it_with_one_line(self) -> None:
        (self.tmp / "file.txt").write_text("a file, not a folder\n")
        jsonl = self.tmp / "file.txt" / "r.jsonl"
        summary = self.tmp / "s.json"
        with mock.patch("attention_kv_caceh.cli.common.check_output_path", no_output_check):
            code, out, err = quietly(
                [*FAST, "--num-requests", "8", "--jsonl", str(jsonl), "--summary-json", str(summary)]
            )
        self.assertEqual(code, 1)
        self.assertEqual(len(err.splitlines()), 1, err)  # no asyncio callback tracebacks
        self.assertRegex(err, r"^attention-kv-caceh: error: could not write --jsonl .*r\.jsonl")
        self.assertNotIn("wrote:", out)
        self.assertFalse(summary.exists())

    def test_summary_write_failure_after_the_run_is_one_line_and_lists_only_written_files(self) -> None:
        (self.tmp / "file.txt").write_text("a file, not a folder\n")
        jsonl = self.tmp / "r.jsonl"
        summary = self.tmp / "file.txt" / "s.json"
        with mock.patch("attention_kv_caceh.cli.common.check_output_path", no_output_check):
            code, out, err = quietly(
                [*FAST, "--num-requests", "4", "--jsonl", str(jsonl), "--summary-json", str(summary)]
            )
        self.assertEqual(code, 1)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("attention-kv-caceh: error: could not write an output file", err)
        self.assertIn(f"wrote: {jsonl}, {jsonl}.meta.json\n", out)
        self.assertNotIn("s.json", out)
        self.assertEqual(len(jsonl.read_text().splitlines()), 4)

    def test_every_request_failing_prints_one_line(self) -> None:
        code, _, err = quietly(
            [
                "--backend",
                "openai-chat",
                "--base-url",
                f"http://127.0.0.1:{free_port()}",
                "--no-smoke-test",
                "--model",
                "m",
                "--num-requests",
                "3",
                *GREEDY,
            ]
        )
        self.assertEqual(code, 1)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertRegex(
            err, r"^attention-kv-caceh: error: 3 of 3 requests failed; first: request 0: connection_error"
        )

    def test_unreachable_server_is_a_runtime_error_and_leaves_earlier_files_alone(self) -> None:
        url = f"http://127.0.0.1:{free_port()}"
        jsonl = self.tmp / "r.jsonl"
        jsonl.write_text("earlier\n")
        Path(f"{jsonl}.meta.json").write_text("{}\n")
        for model in (["--model", "m"], []):  # smoke test; model discovery (GET /v1/models)
            with self.subTest(model=model):
                code, _, err = quietly(
                    [
                        "--backend",
                        "openai-completions",
                        "--base-url",
                        url,
                        *model,
                        "--jsonl",
                        str(jsonl),
                        *GREEDY,
                    ]
                )
                self.assertEqual(code, 1)
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn("attention-kv-caceh: error: ", err)
                self.assertIn(f"the server at {url} could not be reached", err)
                self.assertNotIn("pass --model", err)
                self.assertEqual(jsonl.read_text(), "earlier\n")
                self.assertEqual(Path(f"{jsonl}.meta.json").read_text(), "{}\n")

    def test_model_list_answering_404_is_reported_with_its_status_and_body(self) -> None:
        class NotFound(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b"no such route: /v1/models\n"
                self.send_response(404)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            code, _, err = quietly(["--backend", "openai-chat", "--base-url", url, *GREEDY])
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
        self.assertEqual(code, 1)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn(f"GET {url}/v1/models answered HTTP 404: no such route: /v1/models; pass --model", err)
        self.assertNotIn("JSONDecodeError", err)

    def test_second_ctrl_c_during_the_final_writes_does_not_cut_the_save_short(self) -> None:
        jsonl, summary = self.tmp / "h.jsonl", self.tmp / "s.json"
        written: list[str] = []

        async def interrupted_run(config: HarnessConfig, sink: Any, on_record: Any) -> None:
            for record in (await run_harness(config)).records:  # these finish, then Ctrl-C
                on_record(record)
                sink.write(record)
            raise KeyboardInterrupt

        def write_with_ctrl_c(path: Path, obj: Any) -> Path:
            signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, forwarded by uv
            written.append(path.name)
            return write_json_atomic(path, obj)

        with (
            mock.patch("attention_kv_caceh.harness.run_files._run_until_write_fails", interrupted_run),
            mock.patch("attention_kv_caceh.recorder.write_json_atomic", write_with_ctrl_c),  # the metadata
            mock.patch("attention_kv_caceh.harness.run_files.write_json_atomic", write_with_ctrl_c),
        ):
            code, out, err = quietly(
                [*FAST, "--num-requests", "3", "--jsonl", str(jsonl), "--summary-json", str(summary)]
            )
        self.assertEqual(code, 130, err)
        self.assertEqual(written, ["h.jsonl.meta.json", "s.json"])
        self.assertEqual(err, f"attention-kv-caceh: interrupted; 3 finished requests kept in {jsonl}\n")
        self.assertIn(f"wrote: {jsonl}, {jsonl}.meta.json, {summary}\n", out)
        self.assertEqual(len(jsonl.read_text().splitlines()), 3)
        self.assertEqual(json.loads(Path(f"{jsonl}.meta.json").read_text())["status"], "interrupted")
        self.assertTrue(json.loads(summary.read_text())["interrupted"])
        self.assertIs(signal.getsignal(signal.SIGINT), signal.default_int_handler)  # restored

    def test_ctrl_c_keeps_records_and_draws_the_timeline_of_what_finished(self) -> None:
        jsonl, summary, plot = self.tmp / "h.jsonl", self.tmp / "s.json", self.tmp / "h.png"
        argv = [
            *("--num-requests", "500", "--concurrency", "1", "--per-token-ms", "20", "--output-len", "4"),
            *("--jsonl", str(jsonl), "--summary-json", str(summary), "--plot", str(plot)),
        ]
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "attention_kv_caceh.benchmark", "harness", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            # Python turns SIGINT into KeyboardInterrupt only when it is not ignored at start.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 30
            while not (jsonl.exists() and jsonl.stat().st_size > 0) and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        self.assertEqual(proc.returncode, 130, err)
        kept = len(jsonl.read_text().splitlines())
        self.assertGreaterEqual(kept, 1)
        self.assertEqual(err, f"attention-kv-caceh: interrupted; {kept} finished requests kept in {jsonl}\n")
        # the timeline of the requests that finished is drawn too
        self.assertIn(f"wrote: {jsonl}, {jsonl}.meta.json, {summary}, {plot}\n", out)
        self.assertEqual(plot.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
        self.assertEqual(json.loads(Path(f"{jsonl}.meta.json").read_text())["status"], "interrupted")
        self.assertTrue(json.loads(summary.read_text())["interrupted"])

    def test_sigterm_is_treated_like_ctrl_c_and_exits_143(self) -> None:
        # Whether or not SIGINT was ignored at start (a background job), SIGTERM saves like a Ctrl-C.
        for sigint in (signal.SIG_DFL, signal.SIG_IGN):
            with self.subTest(sigint=sigint):
                jsonl, summary = self.tmp / f"t{int(sigint)}.jsonl", self.tmp / f"t{int(sigint)}.json"
                argv = [
                    *("--num-requests", "500", "--concurrency", "1", "--per-token-ms", "20"),
                    *("--output-len", "4", "--jsonl", str(jsonl), "--summary-json", str(summary)),
                ]
                env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
                proc = subprocess.Popen(
                    [sys.executable, "-m", "attention_kv_caceh.benchmark", "harness", *argv],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    preexec_fn=lambda sigint=sigint: signal.signal(signal.SIGINT, sigint),
                )
                try:
                    deadline = time.monotonic() + 30
                    while not (jsonl.exists() and jsonl.stat().st_size > 0) and time.monotonic() < deadline:
                        time.sleep(0.02)
                    proc.send_signal(signal.SIGTERM)
                    _, err = proc.communicate(timeout=30)
                finally:
                    proc.kill()
                self.assertEqual(proc.returncode, 143, err)
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertEqual(json.loads(Path(f"{jsonl}.meta.json").read_text())["status"], "interrupted")
                self.assertTrue(json.loads(summary.read_text())["interrupted"])

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


class OverheadCommandTest(unittest.TestCase):
    def test_help_shows_every_default(self) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertRaises(SystemExit):
            cli.main(["overhead", "--help"])
        text = " ".join(out.getvalue().split())
        self.assertIn("usage: attention-kv-caceh overhead", text)
        for default in ("[1, 64, 256]", "10.0", "20.0", "50", "2"):
            self.assertIn(f"(default: {default})", text)
        self.assertIn("max(16, waves * concurrency)", overhead.__doc__ or "")

    def test_bad_flags_exit_2_with_one_line_before_the_server_starts(self) -> None:
        for argv in (
            ["--concurrency", "0"],
            ["--waves", "0"],
            ["--tokens", "0"],
            ["--tokens", "1"],  # no ITL: used to fail on an empty list after the whole run
            ["--waves", "100000000"],  # beyond MAX_REQUESTS: used to escape as a traceback
            ["--itl-ms", "nan"],
        ):
            with self.subTest(argv=argv):
                err = io.StringIO()
                with (
                    contextlib.redirect_stderr(err),
                    mock.patch(
                        "attention_kv_caceh.harness.scripted_server.scripted_server_process",
                        side_effect=AssertionError("started"),
                    ),
                ):
                    code = cli.main(["overhead", *argv])
                self.assertEqual(code, 2)
                self.assertEqual(len(err.getvalue().splitlines()), 1)
                self.assertIn(argv[0], err.getvalue())

    def test_the_command_refuses_a_bad_flag_in_a_process_of_its_own(self) -> None:
        entry = "import sys; from attention_kv_caceh.cli import main; sys.exit(main())"
        proc = subprocess.run(
            [sys.executable, "-c", entry, "overhead", "--waves", "0"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertIn("--waves", proc.stderr)


class ClosedStdout(io.StringIO):
    """A stdout that raises `exc` at the first write containing `marker` (and, for a closed pipe, at
    every write after it): a reader of `| head` that left, or a Ctrl-C arriving while it prints."""

    def __init__(self, marker: str, exc: type[BaseException], *, once: bool = False) -> None:
        super().__init__()
        self.marker, self.exc, self.once, self.tripped = marker, exc, once, 0

    def write(self, s: str) -> int:
        if (self.tripped and not self.once) or (not self.tripped and self.marker in s):
            self.tripped += 1
            raise self.exc
        return super().write(s)


class FilesBeforePrintingTest(unittest.TestCase):
    """The files of a run are written before its summary is printed: a closed stdout or a Ctrl-C while
    printing loses none of them."""

    def run_with(self, stdout: ClosedStdout, out: Path, *extra: str) -> tuple[int, str]:
        argv = ["harness", *FAST, "--num-requests", "5", "--jsonl", str(out / "r.jsonl")]
        argv += ["--summary-json", str(out / "s.json"), *extra]
        err = io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        return code, err.getvalue()

    def assert_files(self, out: Path, status: str) -> None:
        self.assertEqual(len((out / "r.jsonl").read_text().splitlines()), 5)
        meta = json.loads((out / "r.jsonl.meta.json").read_text())
        self.assertEqual((meta["status"], meta["records"]), (status, 5))
        self.assertEqual(json.loads((out / "s.json").read_text())["completed"], 5)

    def test_ctrl_c_while_the_summary_prints_keeps_every_file(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            code, _ = self.run_with(ClosedStdout("duration:", KeyboardInterrupt, once=True), Path(d))
            self.assertEqual(code, 130)
            self.assert_files(Path(d), "complete")

    def test_closed_stdout_keeps_every_file_and_exits_1_quietly(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            stdout = ClosedStdout("duration:", BrokenPipeError)
            code, err = self.run_with(stdout, Path(d), "--plot", str(Path(d) / "t.png"))
            self.assertEqual((code, err), (1, ""))
            self.assert_files(Path(d), "complete")
            self.assertGreater((Path(d) / "t.png").stat().st_size, 0)
            self.assertGreater(stdout.tripped, 0)


class MultiTurnPromptLengthsTest(unittest.TestCase):
    def test_multi_turn_prompt_lengths_are_not_called_exact(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            summary = Path(d) / "s.json"
            argv = [*FAST, "--workload", "multi-turn", "--turns", "2", "--num-requests", "4"]
            code, out, _ = quietly([*argv, "--summary-json", str(summary)])
            self.assertEqual(code, 0, out)
            doc = json.loads(summary.read_text())
            self.assertEqual(doc["completed"], 4)
            self.assertEqual(doc["prompt_lengths"], "not requested")


if __name__ == "__main__":
    unittest.main()
