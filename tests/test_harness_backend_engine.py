"""`harness --backend engine`: usage errors before anything starts, the server recorded, no orphan server.

The process tests run the real command in a child process (as a user would) on a `make-model` tiny
checkpoint; the server's pid comes from the line the harness prints once the server is healthy. "No
orphan" is checked by the pid: the harness waits for its child, so after the harness exits that pid
names no process; a server left running would still have it (re-parented, never reaped by the harness).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

from attention_kv_caceh.cli import main
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests import ctrl_c_as_in_a_terminal

ctrl_c_as_in_a_terminal()  # the Ctrl-C tests also pass as a background job (tests/__init__.py)

_HEALTHY = re.compile(r"^harness: serve \(pid (\d+)\) is healthy at (http://127\.0\.0\.1:\d+)$")
_COMMAND = [sys.executable, "-c", "import sys; from attention_kv_caceh.cli import main; sys.exit(main())"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _running(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by whoever adopted it) has stopped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return _alive(pid) if not Path("/proc").is_dir() else False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill_if_alive(pid: int) -> None:
    """Cleanup only: a server the test failed to see stopped must not outlive the test."""
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


class HarnessEngineUsageTest(unittest.TestCase):
    def test_usage_errors_exit_2_with_one_line_before_any_server_or_file(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            model = Path(d) / "m"
            model.mkdir()
            (model / "config.json").write_text("{}")
            empty = Path(d) / "empty"
            empty.mkdir()
            jsonl = Path(d) / "out.jsonl"
            cases = {
                "needs --model": ["--backend", "engine"],
                "neither config.json": ["--backend", "engine", "--model", str(empty)],
                "--base-url": ["--backend", "engine", "--model", str(model), "--base-url", "http://x:1"],
                # a checkpoint without its tokenizer (and a config.json serve cannot read): the message
                # names --model, the flag given, not --tokenizer
                f"--model {model}: no tokenizer.json": ["--backend", "engine", "--model", str(model)],
                "engine flag": ["--backend", "openai-completions", "--max-num-seqs", "4"],
                "not allowed with": [
                    *("--backend", "engine", "--model", str(model)),
                    *("--num-kv-blocks", "4", "--kv-cache-memory", "100"),
                ],
            }
            starter = mock.Mock(side_effect=AssertionError("a server was started"))
            for expected, argv in cases.items():
                with (
                    self.subTest(expected),
                    mock.patch("attention_kv_caceh.harness.engine_server.serve_process", starter),
                ):
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                        code = main(["harness", *argv, "--jsonl", str(jsonl)])
                    self.assertEqual(code, 2, err.getvalue())
                    self.assertIn(expected, err.getvalue())
                    self.assertNotIn("--tokenizer", err.getvalue())
                    self.assertEqual(len(err.getvalue().strip().splitlines()), 1, err.getvalue())
            starter.assert_not_called()
            self.assertFalse(jsonl.exists())

    def test_an_unreadable_tokenizer_or_config_exits_2_before_any_server(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            good = write_random_checkpoint(Path(d) / "good", "llama", "tiny")
            bad_config = Path(d) / "bad_config"
            bad_config.mkdir()
            (bad_config / "config.json").write_text("{}")
            (bad_config / "tokenizer.json").write_bytes((good / "tokenizer.json").read_bytes())
            broken = Path(d) / "broken"
            broken.mkdir()
            (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {')
            garbage = Path(d) / "garbage.gguf"
            garbage.write_bytes(bytes(range(256)) * 8)
            cases = {
                "broken tokenizer.json": (
                    ["--backend", "engine", "--model", str(good), "--tokenizer", str(broken)],
                    str(broken),
                ),
                "not a GGUF tokenizer": (
                    ["--backend", "engine", "--model", str(good), "--tokenizer", str(garbage)],
                    str(garbage),
                ),
                "a config serve cannot read": (
                    ["--backend", "engine", "--model", str(bad_config)],
                    str(bad_config),
                ),
                "a tokenizer the simulated backend ignores": (
                    ["--backend", "simulated", "--tokenizer", str(good)],
                    "--tokenizer",
                ),
                "an empty tokenizer": (
                    ["--backend", "openai-completions", "--model", "m", "--tokenizer", ""],
                    "--tokenizer",
                ),
                "an unreadable tokenizer for a server": (
                    ["--backend", "openai-completions", "--model", "m", "--tokenizer", str(garbage)],
                    str(garbage),
                ),
            }
            starter = mock.Mock(side_effect=AssertionError("a server was started"))
            for name, (argv, named) in cases.items():
                with (
                    self.subTest(name),
                    mock.patch("attention_kv_caceh.harness.engine_server.serve_process", starter),
                ):
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                        code = main(["harness", *argv, "--num-requests", "1"])
                    self.assertEqual(code, 2, err.getvalue())
                    self.assertIn(named, err.getvalue())
                    self.assertEqual(len(err.getvalue().strip().splitlines()), 1, err.getvalue())
            starter.assert_not_called()

    def test_serve_refusing_its_arguments_makes_the_harness_and_sweep_exit_2(self) -> None:
        from attention_kv_caceh.harness.engine_server import ServerStartError

        with tempfile.TemporaryDirectory() as d:
            good = write_random_checkpoint(Path(d) / "good", "llama", "tiny")
            for returncode, expected in ((2, 2), (1, 1), (None, 1)):
                failure = ServerStartError("the server exited before serving", returncode)
                for argv in (
                    ["harness", "--backend", "engine", "--model", str(good), "--num-requests", "1"],
                    [
                        "sweep",
                        "--backend",
                        "engine",
                        "--model",
                        str(good),
                        "--out-dir",
                        str(Path(d) / "s"),
                        "--concurrency",
                        "1",
                        "--num-requests",
                        "1",
                    ],
                ):
                    with (
                        self.subTest(argv[0], returncode=returncode),
                        mock.patch(
                            "attention_kv_caceh.cli.harness_engine.run_against_engine", side_effect=failure
                        ),
                    ):
                        err = io.StringIO()
                        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                            code = main(argv)
                        self.assertEqual(code, expected, err.getvalue())


class HarnessEngineProcessTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.dir = tempfile.TemporaryDirectory()
        cls.model = write_random_checkpoint(Path(cls.dir.name) / "tiny", "llama", "tiny", seed=0)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.dir.cleanup()

    def start(self, *flags: str) -> tuple[subprocess.Popen[str], int]:
        """Start the harness; return it and its server's pid once the server is healthy."""
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        argv = [*_COMMAND, "harness", "--backend", "engine", "--model", str(self.model), *flags]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.addCleanup(proc.kill)
        assert proc.stdout is not None
        for line in proc.stdout:
            match = _HEALTHY.match(line.strip())
            if match:
                pid = int(match.group(1))
                self.addCleanup(_kill_if_alive, pid)
                return proc, pid
        _, err = proc.communicate(timeout=60)
        self.fail(f"the harness exited with {proc.returncode} before its server was healthy: {err}")

    def test_a_run_records_the_server_flags_and_stops_the_server(self) -> None:
        out = Path(self.dir.name)
        proc, pid = self.start(
            *("--max-num-seqs", "2", "--num-kv-blocks", "64", "--num-requests", "4"),
            *("--concurrency", "4", "--output-len", "4", "--prompt-len", "8", "--ignore-eos"),
            *("--jsonl", str(out / "r.jsonl"), "--summary-json", str(out / "s.json")),
        )
        _, err = proc.communicate(timeout=300)
        self.assertEqual(proc.returncode, 0, err)
        self.assertFalse(_alive(pid))
        summary = json.loads((out / "s.json").read_text())
        meta = json.loads((out / "r.jsonl.meta.json").read_text())
        for doc in (summary, meta):
            server = doc["server"]
            self.assertEqual(server["flags"], ["--max-num-seqs", "2", "--num-kv-blocks", "64"])
            self.assertEqual(server["engine_config"]["max_num_seqs"], 2)
            self.assertEqual(server["engine_config"]["block_size"], 16)  # serve's default, filled in
            self.assertIn("attention_kv_caceh.cli.serve", server["command"])
            steps = server["engine_steps"]  # the engine's own StepStats, read before the stop
            self.assertIn(steps["max_num_running"], (1, 2))  # never above max_num_seqs
            self.assertGreater(steps["count_decode_step_time"], 0)
            self.assertEqual(steps["count_decode_step_cpu_time"], steps["count_decode_step_time"])
            self.assertGreater(steps["median_decode_step_cpu_time_ms"], 0)  # a step does work
        self.assertEqual(summary["completed"], 4)
        self.assertEqual(summary["prompt_lengths"], "exact")  # the checkpoint's own tokenizer

    def test_a_closed_stdout_after_the_run_keeps_every_file_and_stops_the_server(self) -> None:
        # `harness ... | head -2`: the reader leaves; printing the summary raises BrokenPipeError
        class ClosedAtSummary(io.StringIO):
            def write(self, s: str) -> int:
                if "duration:" in s or getattr(self, "tripped", False):
                    self.tripped = True
                    raise BrokenPipeError
                return super().write(s)

        out = Path(self.dir.name) / "pipe"
        out.mkdir()
        stdout, err = ClosedAtSummary(), io.StringIO()
        argv = ["harness", "--backend", "engine", "--model", str(self.model), "--num-requests", "6"]
        argv += [
            "--output-len",
            "8",
            "--prompt-len",
            "8",
            "--jsonl",
            str(out / "r.jsonl"),
            "--temperature",
            "0",
        ]
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
            code = main(argv)
        self.assertEqual((code, err.getvalue()), (1, ""))
        self.assertEqual(len((out / "r.jsonl").read_text().splitlines()), 6)
        meta = json.loads((out / "r.jsonl.meta.json").read_text())
        self.assertEqual((meta["status"], meta["records"]), ("complete", 6))
        pid = int(re.findall(r"serve \(pid (\d+)\)", stdout.getvalue())[0])
        self.assertFalse(_alive(pid))

    def test_sigterm_or_ctrl_c_mid_run_stops_the_server_too(self) -> None:
        for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
            with self.subTest(signal=sig.name):
                proc, pid = self.start(
                    *("--num-requests", "8", "--concurrency", "8", "--output-len", "1500", "--ignore-eos")
                )
                self.assertTrue(_alive(pid))
                proc.send_signal(sig)  # to the harness alone: stopping the server is its job
                _, err = proc.communicate(timeout=120)
                self.assertEqual(proc.returncode, code, err)
                self.assertFalse(_alive(pid))

    @unittest.skipUnless(sys.platform.startswith("linux"), "PR_SET_PDEATHSIG is Linux's")
    def test_a_sigkilled_harness_takes_its_server_with_it(self) -> None:
        proc, pid = self.start(
            *("--num-requests", "8", "--concurrency", "8", "--output-len", "1500", "--ignore-eos")
        )
        proc.kill()  # SIGKILL: the harness cannot stop its server itself
        proc.wait(timeout=60)  # not communicate(): a surviving server would hold the stderr pipe open
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        deadline = time.monotonic() + 120  # the server's own SIGTERM shutdown, on a loaded machine
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertFalse(_running(pid), "the server outlived its killed harness")

    def test_requests_beyond_the_models_context_are_refused_before_the_server_starts(self) -> None:
        cases = {  # the tiny checkpoint's max_position_embeddings, or --max-model-len
            "--prompt-len": ["--max-model-len", "16", "--prompt-len", "32", "--output-len", "4"],
            "--output-len": ["--max-model-len", "16", "--prompt-len", "8", "--output-len", "9"],
            "max_position_embeddings": ["--prompt-len", "100000"],
        }
        starter = mock.Mock(side_effect=AssertionError("a server was started"))
        for expected, flags in cases.items():
            with (
                self.subTest(expected),
                mock.patch("attention_kv_caceh.harness.engine_server.serve_process", starter),
            ):
                err = io.StringIO()
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    code = main(["harness", "--backend", "engine", "--model", str(self.model), *flags])
                self.assertEqual(code, 2, err.getvalue())
                self.assertIn(expected, err.getvalue())
                self.assertEqual(len(err.getvalue().strip().splitlines()), 1, err.getvalue())
        starter.assert_not_called()

    def test_a_failing_run_exits_1_and_stops_the_server(self) -> None:
        # a per-request timeout no request can meet: the smoke test (or model discovery) fails
        proc, pid = self.start(*("--timeout", "0.001", "--prompt-len", "8", "--output-len", "4"))
        _, err = proc.communicate(timeout=120)
        self.assertEqual(proc.returncode, 1, err)
        self.assertIn("error", err)
        self.assertFalse(_alive(pid))


if __name__ == "__main__":
    unittest.main()
