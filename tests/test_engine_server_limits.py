"""The server under requests that push its limits: a request that fans out to thousands of engine
requests, with neighbours that must get their answers, the refusal above the fan-out limit, prompts
at the context's boundary, and a body over the size limit from a client that reads only after writing.

The server runs over the real EngineCore with the letter runner (tests/engine_fakes.py), so every text
has an oracle (`expected_text`).
"""

from __future__ import annotations

import asyncio
import json
import time
import unittest
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from attention_kv_caceh.entrypoints.chat_utils import ChatTemplate
from tests.engine_fakes import CharTokenizer, expected_text, hold_input
from tests.serve_helpers import MODEL, fake_server

TOK = CharTokenizer()


def request_json(base_url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def scrape(base_url: str) -> dict[str, float]:
    """{sample name: value} of /metrics (the samples of this one model), parsed by prometheus_client."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels.keys() - {"model_name"}
    }


def chat_prompt_ids(messages: list[dict[str, str]]) -> list[int]:
    return TOK.encode(ChatTemplate().render(messages, True))


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


class FanOutTest(unittest.TestCase):
    def test_3000_prompts_are_served_while_the_core_lags_and_five_neighbours_all_get_200(self) -> None:
        """The core's input thread reads nothing while a 3,000-prompt request is admitted (more frames
        than ZMQ's default high-water marks hold) and five ordinary requests come after it: every one is
        served, each choice with its own prompt's text, and the engine never looked dead."""
        thread, engine, llm = fake_server(max_num_seqs=64)
        reading = hold_input(engine.core)
        prompts = [chr(33 + i % 90) + chr(33 + i // 90) for i in range(3000)]

        async def go(url: str) -> tuple[tuple[int, Any], list[tuple[int, Any]], bool]:
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                big = asyncio.ensure_future(
                    post(session, url, {"model": MODEL, "prompt": prompts, "max_tokens": 2, "temperature": 0})
                )
                # admitted, or answered at once (as a core that looks dead would have it)
                await asyncio.to_thread(engine.wait_for, lambda: llm.num_unfinished == 3000 or big.done())
                admitted = not big.done()
                if not admitted:
                    reading.set()
                    return await big, [], admitted
                neighbours = [
                    asyncio.ensure_future(
                        post(session, url, {"model": MODEL, "prompt": f"n{i}", "max_tokens": 3})
                    )
                    for i in range(5)
                ]
                await asyncio.to_thread(engine.wait_for, lambda: llm.num_unfinished == 3005)
                reading.set()
                return await big, list(await asyncio.gather(*neighbours)), admitted

        with thread:
            (status, body), neighbours, admitted = asyncio.run(go(thread.base_url))
            alive = llm.is_running
        self.assertEqual(status, 200, body)
        self.assertTrue(admitted)
        self.assertEqual(len(body["choices"]), 3000)
        for prompt, choice in zip(prompts, body["choices"], strict=True):
            self.assertEqual(choice["text"], expected_text(TOK.encode(prompt), 2))
        self.assertEqual([s for s, _ in neighbours], [200] * 5)
        for i, (_status, answer) in enumerate(neighbours):
            self.assertEqual(answer["choices"][0]["text"], expected_text(TOK.encode(f"n{i}"), 3))
        self.assertTrue(alive)

    def test_a_fan_out_over_the_limit_is_a_400_naming_the_count_and_the_limit(self) -> None:
        thread, _engine, _llm = fake_server(max_seqs_per_request=10)

        async def go(url: str) -> list[tuple[int, Any]]:
            async with aiohttp.ClientSession() as session:
                return [
                    await post(session, url, {"prompt": ["a"] * 11, "max_tokens": 1}),
                    await post(session, url, {"prompt": ["a", "b", "c"], "n": 4, "max_tokens": 1}),
                    await post(session, url, {"prompt": ["a"] * 5, "n": 2, "max_tokens": 1}),
                    await post(session, url, {"prompt": [1, 2, 3] * 20, "n": 10, "max_tokens": 1}),
                ]

        with thread:
            prompts, samples, at_limit, ids = asyncio.run(go(thread.base_url))
        self.assertEqual((prompts[0], prompts[1]["error"]["param"]), (400, "prompt"))
        self.assertIn("11", prompts[1]["error"]["message"])
        self.assertIn("10", prompts[1]["error"]["message"])
        self.assertEqual((samples[0], samples[1]["error"]["param"]), (400, "n"))
        self.assertIn("12", samples[1]["error"]["message"])
        self.assertEqual(at_limit[0], 200)
        self.assertEqual(len(at_limit[1]["choices"]), 10)
        self.assertEqual(ids[0], 200)  # one prompt of token ids is one prompt


class EmptyPromptTest(unittest.TestCase):
    def test_an_empty_text_prompt_is_a_400_as_vllm_answers_and_tokenize_still_counts_it(self) -> None:
        thread, _engine, _llm = fake_server()
        with thread:
            alone = request_json(thread.base_url, {"prompt": "", "max_tokens": 1})
            listed = request_json(thread.base_url, {"prompt": ["a", ""], "max_tokens": 1})
            ids = request_json(thread.base_url, {"prompt": [[65], []], "max_tokens": 1})
            req = urllib.request.Request(
                thread.base_url + "/tokenize", b'{"prompt": ""}', {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                counted = json.loads(resp.read())
        for status, body in (alone, listed, ids):
            self.assertEqual((status, body["error"]["param"]), (400, "prompt"))
        self.assertEqual(counted["count"], 0)  # the character tokenizer adds no BOS


class ContextBoundaryTest(unittest.TestCase):
    def test_prompts_of_254_to_257_tokens_in_a_256_token_context_are_answered_as_vllm_answers(self) -> None:
        """max_tokens 1 and 100 after prompts of 254..257 tokens (text, token ids, chat), as vLLM 0.32
        answers them: 200 with max_tokens capped to the context left (finish_reason "length"), a prompt
        of 256 tokens or more a 400 that gives the prompt's exact length."""
        thread, _engine, _llm = fake_server(max_model_len=256)
        template_tokens = len(chat_prompt_ids([{"role": "user", "content": ""}]))

        def bodies(num_tokens: int, max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
            text = "q" * num_tokens  # one token per character
            chat = [{"role": "user", "content": "q" * (num_tokens - template_tokens)}]
            return [
                ("/v1/completions", {"prompt": text, "max_tokens": max_tokens}),
                ("/v1/completions", {"prompt": TOK.encode(text), "max_tokens": max_tokens}),
                ("/v1/chat/completions", {"messages": chat, "max_tokens": max_tokens}),
            ]

        async def go(url: str) -> list[tuple[int, int, tuple[int, Any]]]:
            out: list[tuple[int, int, tuple[int, Any]]] = []
            async with aiohttp.ClientSession() as session:
                for num_tokens in (254, 255, 256, 257):
                    for max_tokens in (1, 100):
                        for path, body in bodies(num_tokens, max_tokens):
                            async with session.post(url + path, json=body) as resp:
                                answer = (resp.status, await resp.json(content_type=None))
                            out.append((num_tokens, max_tokens, answer))
            return out

        with thread:
            answers = asyncio.run(go(thread.base_url))
        self.assertEqual(len(answers), 24)
        for num_tokens, max_tokens, (status, body) in answers:
            with self.subTest(num_tokens=num_tokens, max_tokens=max_tokens):
                if num_tokens >= 256:
                    self.assertEqual((status, body["error"]["param"]), (400, "prompt"))
                    self.assertIn(f"the prompt is {num_tokens} tokens", body["error"]["message"])
                    continue
                self.assertEqual(status, 200, body)
                self.assertEqual(body["usage"]["prompt_tokens"], num_tokens)
                self.assertEqual(body["usage"]["completion_tokens"], min(max_tokens, 256 - num_tokens))
                self.assertEqual(body["choices"][0]["finish_reason"], "length")


class BodyLimitTest(unittest.TestCase):
    def test_urllib_sending_a_body_over_the_limit_sees_the_413_not_a_broken_pipe(self) -> None:
        """urllib writes the whole body before it reads: a server that answers and closes without reading
        the body resets the connection under it. 24 MiB (more than loopback sockets buffer) against a
        4 MiB limit, with Content-Length and chunked, then an ordinary request on the same server."""
        limit = 4 << 20
        thread, _engine, _llm = fake_server(max_request_bytes=limit)
        body = json.dumps({"prompt": "a" * (24 << 20), "max_tokens": 1}).encode()

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(body), 1 << 20):
                yield body[i : i + (1 << 20)]

        def send(data: bytes | Iterable[bytes]) -> tuple[int, Any]:
            req = urllib.request.Request(
                thread.base_url + "/v1/completions", data, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        with thread:
            sized = send(body)
            chunked = send(chunks())
            ok = send(json.dumps({"prompt": "a", "max_tokens": 1}).encode())
        for status, answer in (sized, chunked):
            self.assertEqual((status, answer["error"]["code"]), (413, 413))
            self.assertIn(str(limit), answer["error"]["message"])
        self.assertEqual(ok[0], 200)


class PrefixCountersTest(unittest.TestCase):
    def test_with_prefix_caching_off_the_prefix_cache_counters_stay_at_zero(self) -> None:
        """vLLM v1 counts a prefix-cache query only for a request that looked the cache up; with caching
        off none does. The same requests on a server with caching on count every prompt token (the
        oracle: the prompts' lengths) and hit the repeated prompt's full blocks."""
        prompt = "a prompt of several blocks, " * 3  # 84 tokens: 5 full blocks of 16
        counted: dict[bool, dict[str, float]] = {}
        for caching in (False, True):
            thread, _engine, _llm = fake_server(enable_prefix_caching=caching)
            with thread:
                for _ in range(2):
                    status, _body = request_json(thread.base_url, {"prompt": prompt, "max_tokens": 1})
                    self.assertEqual(status, 200)
                # a step's counters reach the metrics just after its outputs reach the handler: wait
                # until both requests' prompt tokens are counted (its answer may come first)
                for _ in range(100):
                    counted[caching] = scrape(thread.base_url)
                    if counted[caching]["vllm:prompt_tokens_total"] >= 2 * len(prompt):
                        break
                    time.sleep(0.05)
                self.assertEqual(counted[caching]["vllm:prompt_tokens_total"], 2 * len(prompt))
        self.assertEqual(counted[False]["vllm:prefix_cache_queries_total"], 0)
        self.assertEqual(counted[False]["vllm:prefix_cache_hits_total"], 0)
        self.assertEqual(counted[True]["vllm:prefix_cache_queries_total"], 2 * len(prompt))
        self.assertEqual(counted[True]["vllm:prefix_cache_hits_total"], 5 * 16)


if __name__ == "__main__":
    unittest.main()
