"""The server over the real LLMEngine (scheduler, KV blocks) with the scheduler tests' fake model runner.

Skipped until the engine modules are present (they come from the engine branches at merge). The oracle
is the fake runner's full-recompute reference: the tokens each stream carries equal `reference_generate`
of its prompt alone, while the engine batched the requests; the engine's own StepStats show it never ran
more than max_num_seqs and that requests waited.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import unittest
from typing import Any

import aiohttp

_HAVE_ENGINE = (
    all(
        importlib.util.find_spec(name) is not None
        for name in ("attention_kv_caceh.engine.llm_engine", "attention_kv_caceh.engine.config")
    )
    and importlib.util.find_spec("tests.engine_fakes") is not None
)

VOCAB = 40


class CharTokenizer:
    """Token id i is the character chr(65 + i) (ids < VOCAB)."""

    eos_token_id: int | None = 0
    vocab_size: int = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        return [(ord(c) - 65) % VOCAB for c in text[:max_length]]

    def encode_counted(
        self, text: str, add_special_tokens: bool = True, max_length: int | None = None
    ) -> tuple[list[int], int, bool]:
        return self.encode(text, add_special_tokens, max_length), len(text), True

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i) for i in ids)


@unittest.skipUnless(_HAVE_ENGINE, "the engine modules are not in this tree yet")
class RealEngineServerTest(unittest.TestCase):
    def test_streams_equal_the_one_at_a_time_oracle_and_the_batch_stays_within_max_num_seqs(self) -> None:
        from attention_kv_caceh.engine.async_llm import AsyncLLM
        from attention_kv_caceh.engine.config import EngineConfig
        from attention_kv_caceh.engine.core import EngineCore
        from attention_kv_caceh.engine.request import SamplingParams
        from attention_kv_caceh.entrypoints.openai.api_server import build_app
        from tests.engine_fakes import FakeModelRunner, reference_generate  # pyright: ignore
        from tests.serve_helpers import ServerThread

        max_model_len, max_tokens, n = 128, 12, 8
        config = EngineConfig(max_num_seqs=2, num_kv_blocks=64, block_size=4, max_model_len=max_model_len)
        tokenizer = CharTokenizer()
        engine = EngineCore(config, FakeModelRunner(64, 4, VOCAB), eos_token_id=0)
        llm = AsyncLLM.from_engine_core(engine, tokenizer)
        app = build_app(llm, tokenizer, "real", max_model_len)
        prompts = [[(7 * i + j) % (VOCAB - 1) + 1 for j in range(3 + i)] for i in range(n)]

        async def one(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict[str, Any]:
            body = {
                "model": "real",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with session.post(url + "/v1/completions", json=body) as resp:
                lines = [line async for line in resp.content if line.startswith(b"data: {")]
            chunks = [json.loads(line[6:]) for line in lines]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            return {"text": text, "usage": chunks[-1]["usage"]}

        async def go(url: str) -> list[dict[str, Any]]:
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(one(session, url, p) for p in prompts))

        with ServerThread(app) as thread:
            results = asyncio.run(go(thread.base_url))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for prompt, result in zip(prompts, results, strict=True):
            tokens, _reason = reference_generate(prompt, params, max_model_len, vocab=VOCAB)
            self.assertEqual(result["text"], tokenizer.decode(tokens))
            self.assertEqual(result["usage"]["prompt_tokens"], len(prompt))
            self.assertEqual(result["usage"]["completion_tokens"], max_tokens)
        self.assertLessEqual(max(s.num_running for s in engine.step_stats), 2)
        self.assertGreaterEqual(max(s.num_running for s in engine.step_stats), 2)
        self.assertFalse(engine.has_unfinished_requests())


class CheckpointServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        import tempfile
        from pathlib import Path

        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

        cls.dir = tempfile.TemporaryDirectory()
        cls.model = str(write_random_checkpoint(Path(cls.dir.name) / "tiny", "llama", "tiny", seed=1))

    @classmethod
    def tearDownClass(cls) -> None:
        cls.dir.cleanup()

    def test_greedy_text_through_http_from_the_core_process_equals_generate(self) -> None:
        """The engine core in its own process (as `serve` runs it): several prompts sent at once (batched,
        at most max_num_seqs 2 per step) give, token for token, the text LLMEngine.generate (what
        `generate` runs, the core in-process) gives them from the same tiny checkpoint."""
        from attention_kv_caceh.engine.async_llm import AsyncLLM
        from attention_kv_caceh.engine.config import EngineConfig
        from attention_kv_caceh.engine.llm_engine import LLMEngine
        from attention_kv_caceh.engine.request import SamplingParams
        from attention_kv_caceh.engine.tokenizer import Tokenizer
        from attention_kv_caceh.entrypoints.openai.api_server import build_app
        from tests.serve_helpers import ServerThread

        prompts = ["hello world", "the cat sat on", "a", "serving engines batch requests", "x y z"]
        max_tokens = 12
        config = EngineConfig(max_num_seqs=2, num_kv_blocks=64, block_size=4)
        reference = LLMEngine.from_pretrained(self.model, config)
        tokenizer = Tokenizer.load(self.model)
        max_model_len = reference.scheduler.max_model_len
        llm = AsyncLLM.from_checkpoint(self.model, config, tokenizer, max_model_len)
        self.assertIsNotNone(llm.client.process)
        app = build_app(llm, tokenizer, "tiny", max_model_len)

        async def one(session: aiohttp.ClientSession, url: str, prompt: str) -> dict[str, Any]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as resp:
                self.assertEqual(resp.status, 200)
                return (await resp.json())["choices"][0]

        async def go(url: str) -> list[dict[str, Any]]:
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(one(session, url, p) for p in prompts))

        with ServerThread(app) as thread:
            choices = asyncio.run(go(thread.base_url))
        ids = [tokenizer.encode(p) for p in prompts]
        outputs = reference.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        self.assertLessEqual(max(s.num_running for s in llm.step_stats), 2)
        for prompt, choice, tokens in zip(prompts, choices, outputs, strict=True):
            self.assertEqual(choice["text"], tokenizer.decode(tokens), prompt)
            self.assertEqual(choice["finish_reason"], "length" if len(tokens) == max_tokens else "stop")
        assert llm.client.process is not None
        self.assertFalse(llm.client.process.is_alive())  # the server's shutdown stopped the core

    def test_killing_the_core_process_mid_stream_ends_every_stream_with_an_error_and_health_503(self) -> None:
        """SIGKILL of the core while streams run: each stream gets an error event then [DONE], /health
        answers 503 and a new request 503 with OpenAI's error body (EngineDeadError); every request sent
        in the instant of the death is answered, and the /metrics gauges read 0; nothing hangs (every
        wait below is bounded)."""
        import os
        import signal
        import urllib.error
        import urllib.request

        from attention_kv_caceh.engine.async_llm import AsyncLLM
        from attention_kv_caceh.engine.config import EngineConfig
        from attention_kv_caceh.engine.tokenizer import Tokenizer
        from attention_kv_caceh.entrypoints.openai.api_server import build_app
        from tests.serve_helpers import ServerThread

        config = EngineConfig(max_num_seqs=4, num_kv_blocks=256, block_size=16, max_model_len=2048)
        tokenizer = Tokenizer.load(self.model)
        llm = AsyncLLM.from_checkpoint(self.model, config, tokenizer, 2048)
        process = llm.client.process
        assert process is not None and process.pid is not None
        app = build_app(llm, tokenizer, "tiny", 2048)

        async def one(session: aiohttp.ClientSession, url: str, i: int, started: asyncio.Event) -> list[Any]:
            body = {
                "model": "tiny",
                "prompt": f"p{i}",
                "max_tokens": 2000,
                "stream": True,
                "ignore_eos": True,
            }
            events: list[Any] = []
            async with session.post(url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
                        started.set()
            return events

        async def instant(session: aiohttp.ClientSession, url: str, i: int) -> int:
            body = {"model": "tiny", "prompt": f"q{i}", "max_tokens": 50, "n": 1 + i % 2}
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status

        async def go(url: str) -> tuple[list[list[Any]], list[int]]:
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                starts = [asyncio.Event() for _ in range(3)]
                tasks = [asyncio.ensure_future(one(session, url, i, starts[i])) for i in range(3)]
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 120)
                # requests arriving in the instant of the death: before, during and after the kill
                around = [asyncio.ensure_future(instant(session, url, i)) for i in range(10)]
                await asyncio.sleep(0.01)
                os.kill(process.pid, signal.SIGKILL)  # pyright: ignore[reportArgumentType]
                around += [asyncio.ensure_future(instant(session, url, i)) for i in range(10, 20)]
                return await asyncio.gather(*tasks), await asyncio.gather(*around)

        with ServerThread(app) as thread:
            streams, statuses = asyncio.run(go(thread.base_url))
            with urllib.request.urlopen(thread.base_url + "/metrics", timeout=30) as resp:
                metrics = resp.read().decode()
            with self.assertRaises(urllib.error.HTTPError) as health:
                urllib.request.urlopen(thread.base_url + "/health", timeout=30)
            request = urllib.request.Request(
                thread.base_url + "/v1/completions",
                json.dumps({"prompt": "x", "max_tokens": 2}).encode(),
                {"Content-Type": "application/json"},
            )
            with self.assertRaises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            body = json.loads(refused.exception.read())
        self.assertEqual(health.exception.code, 503)
        self.assertEqual(refused.exception.code, 503)
        self.assertEqual(len(statuses), 20)  # every request of the instant was answered (200 or 503)
        self.assertLessEqual(set(statuses), {200, 503})
        self.assertEqual(llm.num_unfinished, 0)
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            self.assertIn(f'vllm:{gauge}{{model_name="tiny"}} 0.0', metrics)
        self.assertEqual(body["error"]["code"], 503)
        for events in streams:
            self.assertEqual(events[-1], b"[DONE]")
            error = json.loads(events[-2])
            self.assertEqual(error["error"]["code"], 503)

    def test_100_clients_that_leave_after_their_first_token_leave_nothing_running_or_allocated(self) -> None:
        """The fault test of test_engine_server.py against the real model: every block is back in the
        free pool and the gauges read 0 once the server has applied the aborts."""
        import urllib.request

        from attention_kv_caceh.engine.async_llm import AsyncLLM
        from attention_kv_caceh.engine.config import EngineConfig
        from attention_kv_caceh.engine.core import EngineCore
        from attention_kv_caceh.engine.tokenizer import Tokenizer
        from attention_kv_caceh.entrypoints.openai.api_server import build_app
        from tests.engine_fakes import wait_for  # pyright: ignore
        from tests.serve_helpers import ServerThread

        config = EngineConfig(max_num_seqs=16, num_kv_blocks=512, block_size=4)
        engine = EngineCore.from_pretrained(self.model, config)
        tokenizer = Tokenizer.load(self.model)
        max_model_len = engine.max_model_len
        llm = AsyncLLM.from_engine_core(engine, tokenizer)
        app = build_app(llm, tokenizer, "tiny", max_model_len)
        kv = engine.scheduler.kv_cache_manager

        async def one(session: aiohttp.ClientSession, url: str, i: int) -> bool:
            # ignore_eos and max_tokens near max_model_len: a request ends by its client leaving
            body = {"model": "tiny", "prompt": f"p{i}", "max_tokens": max_model_len - 16, "stream": True}
            body["ignore_eos"] = True
            async with session.post(url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        return True
            return False

        async def go(url: str) -> list[bool]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                return await asyncio.gather(*(one(session, url, i) for i in range(100)))

        with ServerThread(app) as thread:
            firsts = asyncio.run(go(thread.base_url))
            wait_for(lambda: llm.num_unfinished == 0 and not engine.has_unfinished_requests(), 120)
            wait_for(lambda: llm.kv_cache_usage == 0.0, 30)
            with urllib.request.urlopen(thread.base_url + "/metrics", timeout=30) as resp:
                metrics = resp.read().decode()
        self.assertTrue(all(firsts))
        self.assertEqual(llm.num_unfinished, 0)
        self.assertFalse(engine.has_unfinished_requests())
        self.assertEqual(kv.num_free_blocks, kv.num_blocks)
        self.assertEqual(kv.usage, 0.0)
        self.assertIn('vllm:num_requests_running{model_name="tiny"} 0.0', metrics)
        self.assertIn('vllm:kv_cache_usage_perc{model_name="tiny"} 0.0', metrics)
        self.assertLessEqual(max(s.num_running for s in engine.step_stats), 16)


if __name__ == "__main__":
    unittest.main()
