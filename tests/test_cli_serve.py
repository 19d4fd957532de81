"""`serve`: flag checks before anything loads, and a SIGTERM that drains a running stream and exits 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import signal
import tempfile
import threading
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp

from attention_kv_caceh.cli import serve
from attention_kv_caceh.cli.common import UsageError
from attention_kv_caceh.engine.make_model import write_random_checkpoint
from tests.fake_engine import FakeEngine, FakeTokenizer, expected_text


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
        with mock.patch("attention_kv_caceh.engine.async_llm.load_engine", loader):
            with self.assertRaisesRegex(UsageError, "config.json"):
                serve.run(parse(["--model", empty.name]))
            with (
                mock.patch.dict(os.environ, {}, clear=True),
                self.assertRaisesRegex(UsageError, "NO_SUCH_VAR"),
            ):
                serve.run(parse(["--model", str(self.model), "--api-key-env", "NO_SUCH_VAR"]))
        with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            parse(["--model", str(self.model), "--num-kv-blocks", "4", "--kv-cache-memory", "100"])
        with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            parse(["--model", str(self.model), "--max-num-seqs", "0"])
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
        }
        with mock.patch("attention_kv_caceh.engine.async_llm.load_engine", loader):
            for names, flags in cases.items():
                with self.subTest(flags=flags):
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                        code = serve.main(["--model", str(self.model), "--port", "0", *flags])
                    self.assertEqual(code, 2, err.getvalue())
                    self.assertEqual(len(err.getvalue().splitlines()), 1, err.getvalue())
                    self.assertIn(names, err.getvalue())
        loader.assert_not_called()

    def test_flags_become_the_engine_config(self) -> None:
        args = parse(["--model", "m", "--max-num-seqs", "3", "--num-kv-blocks", "64", "--no-prefix-caching"])
        config = serve.engine_config_kwargs(args)
        self.assertEqual(config["max_num_seqs"], 3)
        self.assertEqual(config["num_kv_blocks"], 64)
        self.assertIsNone(config["kv_cache_memory"])
        self.assertIs(config["enable_prefix_caching"], False)

    def test_sigterm_drains_the_running_stream_and_exits_0(self) -> None:
        engine = FakeEngine(max_num_seqs=2)
        engine.gate.clear()  # the request's first step waits until the SIGTERM was sent
        out = _Announce()
        result: dict[str, Any] = {}

        async def client(url: str) -> None:
            body = {"model": "fake", "prompt": "d", "max_tokens": 12, "stream": True}
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/health") as health:
                    result["health"] = health.status
                async with session.post(url + "/v1/completions", json=body) as resp:
                    self.assertTrue(await asyncio.to_thread(engine.wait_for, lambda: engine.blocked))
                    os.kill(os.getpid(), signal.SIGTERM)
                    engine.gate.set()
                    result["events"] = [line async for line in resp.content if line.startswith(b"data: ")]

        def drive() -> None:
            try:
                if out.ready.wait(20):
                    asyncio.run(client(out.url))
            except BaseException as exc:  # reported by the main thread
                result["error"] = exc
                os.kill(os.getpid(), signal.SIGTERM)

        loaded = (engine, FakeTokenizer(), 256)
        args = parse(["--model", str(self.model), "--port", "0", "--served-model-name", "fake"])
        with (
            mock.patch("attention_kv_caceh.engine.async_llm.load_engine", return_value=loaded),
            contextlib.redirect_stdout(out),
        ):
            helper = threading.Thread(target=drive)
            helper.start()
            code = serve.run(args)
            helper.join(20)
        self.assertNotIn("error", result)
        self.assertEqual(code, 0)
        self.assertEqual(result["health"], 200)
        events = result["events"]
        self.assertEqual(events[-1], b"data: [DONE]\n")
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks), expected_text([100], 12))
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "length")


if __name__ == "__main__":
    unittest.main()
