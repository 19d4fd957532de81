"""The `--backend engine` launcher: a child `serve` process, its /health wait, and its stop."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import tempfile
import unittest
import urllib.request
from pathlib import Path

from attention_kv_caceh.harness.engine_server import ServerStartError, serve_command, serve_process

_HAVE_ENGINE = all(
    importlib.util.find_spec(f"attention_kv_caceh.{name}") is not None
    for name in (
        *(
            "engine.llm_engine",
            "engine.config",
            "model_executor.model",
            "engine.model_runner",
            "engine.tokenizer",
        ),
        "toy_model.make_model",
    )
)


class ServeProcessTest(unittest.TestCase):
    def test_command_listens_on_a_free_loopback_port_with_the_engine_flags(self) -> None:
        argv = serve_command("/m", ["--max-num-seqs", "4"])
        self.assertEqual(argv[1:4], ["-m", "attention_kv_caceh.cli.serve", "--model"])
        self.assertEqual(argv[-6:], ["--host", "127.0.0.1", "--port", "0", "--max-num-seqs", "4"])

    def test_a_child_that_exits_before_serving_raises_with_its_exit_code(self) -> None:
        # no config.json: serve's usage error, exit code 2
        with (
            tempfile.TemporaryDirectory() as empty,
            self.assertRaisesRegex(ServerStartError, "code 2"),
            serve_process(empty, startup_timeout_s=60, stderr=subprocess.DEVNULL),
        ):
            self.fail("the server cannot have started")

    @unittest.skipUnless(_HAVE_ENGINE, "the engine modules are not in this tree yet")
    def test_a_random_checkpoint_is_served_until_the_block_ends(self) -> None:
        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint  # pyright: ignore

        with tempfile.TemporaryDirectory() as d:
            model = write_random_checkpoint(Path(d) / "tiny", "llama", "tiny", seed=0)
            flags = ["--max-num-seqs", "2", "--num-kv-blocks", "64", "--served-model-name", "tiny"]
            with serve_process(model, flags, stop_timeout_s=30) as server:
                url = server.base_url
                body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
                request = urllib.request.Request(
                    url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(request, timeout=120) as resp:
                    answer = json.loads(resp.read())
            self.assertEqual(answer["usage"]["completion_tokens"], 4)
            with self.assertRaises(OSError):  # stopped: nothing listens any more
                urllib.request.urlopen(url + "/health", timeout=5)


if __name__ == "__main__":
    unittest.main()
