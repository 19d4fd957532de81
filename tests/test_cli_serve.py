"""`serve`: flag checks before anything loads, a SIGTERM that drains a running stream and exits 0, a drain
that runs out of time ending the stream properly, and the engine-core process's life with its parent."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
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

import aiohttp

from attention_kv_caceh.cli import main, serve
from attention_kv_caceh.cli.common import UsageError
from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints import launcher
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.engine_fakes import CharTokenizer, expected_text, make_text_core, wait_for


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


class _Announce(io.StringIO):
    """stdout that sets `ready` once the server printed its URL."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = threading.Event()
        self.url = ""

    def write(self, s: str) -> int:
        if s.startswith("serving "):
            self.url = s.split(" at ")[1].strip()
            self.ready.set()
        return super().write(s)


class ServeCliTest(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.model = write_random_checkpoint(Path(self.dir.name) / "m", "llama", "tiny")

    def test_bad_input_is_a_usage_error_before_the_engine_loads(self) -> None:
        empty = tempfile.TemporaryDirectory()
        self.addCleanup(empty.cleanup)
        loader = mock.Mock(side_effect=AssertionError("loaded"))
        with mock.patch.object(AsyncLLM, "from_checkpoint", loader):
            with self.assertRaisesRegex(UsageError, "config.json"):
                serve.run(parse(["--model", empty.name]))
            with (
                mock.patch.dict(os.environ, {}, clear=True),
                self.assertRaisesRegex(UsageError, "NO_SUCH_VAR"),
            ):
                serve.run(parse(["--model", str(self.model), "--api-key-env", "NO_SUCH_VAR"]))
        with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            parse(["--model", str(self.model), "--num-kv-blocks", "4", "--kv-cache-memory", "100"])
        with self.assertRaisesRegex(UsageError, "--max-num-seqs"):  # bounds: the config's, not argparse's
            serve.run(parse(["--model", str(self.model), "--max-num-seqs", "0"]))
        # vLLM's --api-key names what to give instead, never read as an abbreviation of --api-key-env
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(main(["serve", "--model", str(self.model), "--api-key", "sekrit"]), 2)
        self.assertIn("--api-key-env", err.getvalue())
        self.assertNotIn("sekrit", err.getvalue())
        loader.assert_not_called()

    def test_engine_checks_exit_2_before_loading_as_in_generate(self) -> None:
        """serve makes generate's checks (cli/engine_args.py) before any weight is read: same exit code 2."""
        loader = mock.Mock(side_effect=AssertionError("loaded"))
        cases = {
            "--max-model-len": ["--max-model-len", "100000"],
            "holds no block": ["--kv-cache-memory", "10"],
            "--kv-cache-memory 1000000000000000": ["--kv-cache-memory", str(10**15)],
            "--num-kv-blocks 1000000000000": ["--num-kv-blocks", str(10**12)],
            "--max-num-seqs": ["--max-num-seqs", "9", "--max-num-batched-tokens", "4"],
            "--max-request-bytes-in-flight: 999": [
                *("--max-request-bytes", "1000", "--max-request-bytes-in-flight", "999"),
            ],
        }
        with mock.patch.object(AsyncLLM, "from_checkpoint", loader):
            for names, flags in cases.items():
                with self.subTest(flags=flags):
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                        code = serve.main(["--model", str(self.model), "--port", "0", *flags])
                    self.assertEqual(code, 2, err.getvalue())
                    self.assertEqual(len(err.getvalue().splitlines()), 1, err.getvalue())
                    self.assertIn(names, err.getvalue())
        loader.assert_not_called()

    def test_an_engine_core_cpu_this_process_may_not_use_exits_2_before_loading(self) -> None:
        loader = mock.Mock(side_effect=AssertionError("loaded"))
        err = io.StringIO()
        with (
            mock.patch.object(AsyncLLM, "from_checkpoint", loader),
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            code = serve.main(["--model", str(self.model), "--port", "0", "--engine-core-cpu", "100000"])
        self.assertEqual(code, 2, err.getvalue())
        self.assertIn("--engine-core-cpu", err.getvalue())
        loader.assert_not_called()

    def test_flags_become_the_engine_config(self) -> None:
        args = parse(["--model", "m", "--max-num-seqs", "3", "--num-kv-blocks", "64", "--no-prefix-caching"])
        config = serve.engine_config_kwargs(args)
        self.assertEqual(config["max_num_seqs"], 3)
        self.assertEqual(config["num_kv_blocks"], 64)
        self.assertIsNone(config.get("kv_cache_memory"))
        self.assertIs(config["enable_prefix_caching"], False)

    def serve_with_client(
        self, client: Any, flags: list[str], max_model_len: int = 256
    ) -> tuple[int, dict[str, Any], Any]:
        """serve.run with its engine core replaced by the text fake in a thread; `client(url, runner,
        result)` runs against it from another thread. Returns (exit code, result, runner)."""
        core, runner = make_text_core(max_num_seqs=2, max_model_len=max_model_len)
        llm = AsyncLLM.from_engine_core(core, CharTokenizer())
        out = _Announce()
        result: dict[str, Any] = {}

        def drive() -> None:
            try:
                if out.ready.wait(20):
                    asyncio.run(client(out.url, runner, result))
            except BaseException as exc:  # reported by the main thread
                result["error"] = exc
                os.kill(os.getpid(), signal.SIGTERM)

        args = parse(["--model", str(self.model), "--port", "0", "--served-model-name", "fake", *flags])
        with (
            mock.patch.object(AsyncLLM, "from_checkpoint", return_value=llm),
            contextlib.redirect_stdout(out),
        ):
            helper = threading.Thread(target=drive)
            helper.start()
            code = serve.run(args)
            helper.join(20)
        return code, result, runner

    def test_sigterm_drains_the_running_stream_and_exits_0(self) -> None:
        async def client(url: str, runner: Any, result: dict[str, Any]) -> None:
            runner.gate.clear()  # the request's first step waits until the SIGTERM was sent
            body = {"model": "fake", "prompt": "d", "max_tokens": 12, "stream": True}
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/health") as health:
                    result["health"] = health.status
                result["frozen"] = gc.get_freeze_count()
                async with session.post(url + "/v1/completions", json=body) as resp:
                    self.assertTrue(await asyncio.to_thread(wait_for, lambda: runner.blocked))
                    os.kill(os.getpid(), signal.SIGTERM)
                    runner.gate.set()
                    result["events"] = [line async for line in resp.content if line.startswith(b"data: ")]

        code, result, _runner = self.serve_with_client(client, [])
        self.assertNotIn("error", result)
        self.assertEqual(code, 0)
        self.assertEqual(result["health"], 200)
        # the startup heap is frozen out of the collector while serving, and unfrozen after
        self.assertGreater(result["frozen"], 0)
        self.assertEqual(gc.get_freeze_count(), 0)
        events = result["events"]
        self.assertEqual(events[-1], b"data: [DONE]\n")
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        prompt_ids = Tokenizer.load(self.model).encode("d")
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks), expected_text(prompt_ids, 12))
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "length")

    def test_a_drain_that_runs_out_of_time_ends_the_stream_with_abort_then_done(self) -> None:
        """The step stays held until the stream ended, so the request cannot finish within the drain."""

        async def client(url: str, runner: Any, result: dict[str, Any]) -> None:
            runner.gate.clear()
            body = {"model": "fake", "prompt": "d", "max_tokens": 100, "stream": True}
            async with (
                aiohttp.ClientSession() as session,
                session.post(url + "/v1/completions", json=body) as resp,
            ):
                self.assertTrue(await asyncio.to_thread(wait_for, lambda: runner.blocked))
                os.kill(os.getpid(), signal.SIGTERM)
                result["events"] = [line async for line in resp.content if line.startswith(b"data: ")]
            runner.gate.set()

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code, result, _runner = self.serve_with_client(client, ["--drain-timeout", "0.5"])
        self.assertNotIn("error", result)
        self.assertEqual(code, 0)
        events = result["events"]
        self.assertEqual(events[-1], b"data: [DONE]\n")
        last = json.loads(events[-2][6:])
        self.assertEqual(last["choices"][0]["finish_reason"], "abort")
        self.assertNotIn("CancelledError", err.getvalue())


def _proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a process from /proc (Linux), None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    state, ppid = text[text.rindex(")") + 2 :].split()[:2]
    return comm, state, int(ppid)


def _children(pid: int) -> dict[int, str]:
    """{child pid: comm} of `pid` (Linux /proc)."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[2] == pid:
                found[int(entry.name)] = stat[0]
    return found


class ServeChildTest(unittest.TestCase):
    """A real `serve` process: what a shell, `timeout` or `uv run` see."""

    def setUp(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.model = write_random_checkpoint(Path(self.dir.name) / "m", "llama", "tiny")

    def start(self, *flags: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "attention_kv_caceh.cli.serve", "--model", str(self.model), *flags]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        return proc

    def test_sigterm_twice_exits_0_without_a_traceback(self) -> None:
        proc = self.start("--port", "0", "--drain-timeout", "30")
        assert proc.stdout is not None
        line = proc.stdout.readline()
        self.assertTrue(line.startswith("serving "), line)
        host, port = line.split("http://")[1].strip().rsplit(":", 1)
        # A request whose body is still coming keeps the drain waiting until the client leaves.
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the drain is under way
            proc.send_signal(signal.SIGTERM)  # what `uv run` or `timeout` add when the whole group got one
            time.sleep(0.3)
        _, err = proc.communicate(timeout=60)  # the client left: the drain ends
        self.assertEqual(proc.returncode, 0, err)
        self.assertNotIn("Traceback", err)
        self.assertNotIn("CancelledError", err)

    @unittest.skipUnless(sys.platform.startswith("linux"), "reads /proc")
    def test_the_engine_core_is_its_own_process_and_exits_when_serve_is_killed(self) -> None:
        proc = self.start("--port", "0", "--num-kv-blocks", "64")
        assert proc.stdout is not None
        line = proc.stdout.readline()
        self.assertTrue(line.startswith("serving "), line)
        cores = [pid for pid, comm in _children(proc.pid).items() if comm == "EngineCore"]
        self.assertEqual(len(cores), 1)  # what `ps -o pid,ppid,comm` shows
        proc.kill()  # SIGKILL: serve cannot tell the core anything
        proc.communicate(timeout=30)

        def gone() -> bool:
            stat = _proc_stat(cores[0])
            return stat is None or stat[1] == "Z"

        self.assertTrue(wait_for(gone, 60))  # a bound on the wait, not a measured time

    def test_a_port_over_65535_is_a_usage_error_and_ipv6_is_bracketed(self) -> None:
        proc = self.start("--port", "70000")
        _, err = proc.communicate(timeout=60)
        self.assertEqual(proc.returncode, 2, err)
        self.assertIn("--port", err)
        self.assertNotIn("Traceback", err)
        self.assertEqual(launcher.url_of("::1", 8793), "http://[::1]:8793")
        self.assertEqual(launcher.url_of("127.0.0.1", 8793), "http://127.0.0.1:8793")
        for host, loopback in (("127.0.0.1", True), ("127.3.0.1", True), ("::1", True), ("localhost", True)):
            self.assertIs(launcher.is_loopback(host), loopback)
        for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
            self.assertFalse(launcher.is_loopback(host))

    def test_a_non_loopback_host_without_an_api_key_warns_on_stderr(self) -> None:
        out = io.StringIO()
        err = io.StringIO()
        args = parse(["--model", str(self.model), "--host", "0.0.0.0", "--port", "0"])
        with (
            mock.patch.object(launcher, "DrainingServer") as server,
            mock.patch.object(AsyncLLM, "from_checkpoint") as loader,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            loader.return_value = AsyncLLM.from_engine_core(make_text_core()[0], CharTokenizer())
            server.return_value.serve = mock.AsyncMock(return_value=None)
            self.assertEqual(serve.run(args), 0)
        warnings = [line for line in err.getvalue().splitlines() if "warning" in line]
        self.assertEqual(len(warnings), 1, err.getvalue())  # the threads line is not a warning
        self.assertIn("listening on 0.0.0.0", warnings[0])

    def test_an_explicit_thread_count_beside_a_busy_cpu_warns_once_and_is_kept(self) -> None:
        from attention_kv_caceh import cpu_load
        from attention_kv_caceh.cpus import numba_pool_size, usable_cpus

        if usable_cpus().count < 2 or numba_pool_size() < 2:
            self.skipTest("needs two usable CPUs and a Numba pool of two")
        err = io.StringIO()
        args = parse(["--model", str(self.model), "--port", "0", "--threads", "2"])
        with (
            mock.patch.object(launcher, "DrainingServer") as server,
            mock.patch.object(AsyncLLM, "from_checkpoint") as loader,
            mock.patch.object(cpu_load, "measure_others_busy", return_value=1.0),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(err),
        ):
            loader.return_value = AsyncLLM.from_engine_core(make_text_core()[0], CharTokenizer())
            server.return_value.serve = mock.AsyncMock(return_value=None)
            self.assertEqual(serve.run(args), 0)
        self.assertEqual(loader.call_args.args[1].threads, 2)  # the count given, not the governor's
        warnings = [line for line in err.getvalue().splitlines() if "warning" in line]
        self.assertEqual(len(warnings), 1, err.getvalue())
        self.assertIn("serve: warning: --threads 2 on", warnings[0])
        self.assertIn("follows the load", warnings[0])
        self.assertIn("KV cache: ", err.getvalue())  # the pool's blocks and bytes, beside the threads line


class ListeningSocketTest(unittest.TestCase):
    def test_accepted_connections_have_nagle_off(self) -> None:
        # asyncio turns TCP_NODELAY on for accepted sockets only when the listening socket's proto is
        # IPPROTO_TCP; with Nagle on, every chunk of a stream on a reused connection waited ~40 ms.
        async def go() -> int:
            accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                sock = writer.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                writer.close()

            listener = launcher.listen("127.0.0.1", 0)
            server = await asyncio.start_server(handle, sock=listener)
            port = listener.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            nodelay = await asyncio.wait_for(accepted, 30)
            writer.close()
            server.close()
            await server.wait_closed()
            return nodelay

        self.assertNotEqual(asyncio.run(go()), 0)


if __name__ == "__main__":
    unittest.main()
