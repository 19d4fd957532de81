"""The OpenAI-compatible server end to end: a real uvicorn server over AsyncLLM and a fake engine.

The server runs over the real EngineCore (its busy loop in a thread, behind the ZMQ sockets `serve` uses)
with the letter runner of tests/engine_fakes.py, whose tokens follow a known rule, so every text, usage
count and metric value has an oracle. Synchronisation is by bounded waits on state (the runner's gate,
response headers), never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import unittest
from typing import Any

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.metrics import METRIC_NAMES
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.chat_utils import ChatTemplate
from attention_kv_caceh.entrypoints.openai.api_server import build_app
from tests.engine_fakes import TEXT_VOCAB, CharTokenizer, expected_text, make_text_core
from tests.serve_helpers import MODEL, ServerThread, fake_server

TOK = CharTokenizer()


def client(base_url: str, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=20)


def chat_prompt_ids(messages: list[dict[str, str]]) -> list[int]:
    return TOK.encode(ChatTemplate().render(messages, True))


async def fetch(method: str, url: str, **kwargs: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.request(method, url, **kwargs) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text


def request(method: str, url: str, **kwargs: Any) -> tuple[int, Any]:
    return asyncio.run(fetch(method, url, **kwargs))


def scrape(base_url: str) -> dict[str, float]:
    """{sample name with sorted labels: value} from /metrics, parsed by prometheus_client."""
    status, text = request("GET", base_url + "/metrics")
    assert status == 200
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


class StreamingTest(unittest.TestCase):
    """One server for the read-only streaming checks."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.thread, cls.engine, cls.llm = fake_server(max_num_seqs=4, eos_at=None)
        cls.thread.__enter__()
        cls.url = cls.thread.base_url
        cls.oai = client(cls.url)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.oai.close()
        cls.thread.__exit__(None, None, None)

    def test_streamed_completion_deltas_concatenate_to_the_whole_text_and_the_oracle(self) -> None:
        prompt = "hello world"
        whole = self.oai.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
        chunks = list(
            self.oai.completions.create(
                model=MODEL, prompt=prompt, max_tokens=20, stream=True, stream_options={"include_usage": True}
            )
        )
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = expected_text(TOK.encode(prompt), 20)
        self.assertEqual(whole.choices[0].text, expected)
        self.assertEqual(streamed, expected)
        self.assertEqual(whole.choices[0].finish_reason, "length")
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finish, ["length"])
        assert whole.usage is not None and chunks[-1].usage is not None
        self.assertEqual((whole.usage.prompt_tokens, whole.usage.completion_tokens), (len(prompt), 20))
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(
            (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens), (len(prompt), 20)
        )

    def test_prompt_as_token_ids_equals_prompt_as_text(self) -> None:
        ids = TOK.encode("abc")
        by_ids = self.oai.completions.create(model=MODEL, prompt=ids, max_tokens=7)
        self.assertEqual(by_ids.choices[0].text, expected_text(ids, 7))

    def test_streamed_chat_opens_with_role_then_content_then_finish_then_usage(self) -> None:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        whole = self.oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=9)  # type: ignore[arg-type]
        chunks = list(
            self.oai.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=9,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        prompt_ids = chat_prompt_ids(messages)
        expected = expected_text(prompt_ids, 9)
        self.assertEqual(whole.choices[0].message.content, expected)
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        self.assertIsNone(chunks[0].choices[0].delta.content)
        content = [c.choices[0].delta.content or "" for c in chunks[1:] if c.choices]
        self.assertEqual("".join(content), expected)
        self.assertEqual(chunks[-2].choices[0].finish_reason, "length")
        self.assertEqual(chunks[-1].choices, [])
        assert chunks[-1].usage is not None and whole.usage is not None
        self.assertEqual(chunks[-1].usage.prompt_tokens, len(prompt_ids))
        self.assertEqual(chunks[-1].usage.completion_tokens, 9)
        self.assertEqual(whole.usage.prompt_tokens, len(prompt_ids))

    def test_continuous_usage_counts_the_tokens_so_far(self) -> None:
        chunks = list(
            self.oai.completions.create(
                model=MODEL,
                prompt="xy",
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": False, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            )
        )
        text_chunks = [c for c in chunks if c.usage is not None and c.choices[0].text]
        counts = [c.usage.completion_tokens for c in text_chunks if c.usage is not None]
        lengths = [len(c.choices[0].text) for c in text_chunks]
        # one character per token: each chunk's count is the characters streamed so far
        self.assertEqual(counts, list(itertools.accumulate(lengths)))
        self.assertEqual(counts[-1], 5)

    def test_stop_string_trims_the_text_in_stream_and_whole(self) -> None:
        prompt = "q"
        full = expected_text(TOK.encode(prompt), 30)
        stop = full[10:13]
        cut = full.index(stop)
        whole = self.oai.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=[stop, "@@"])
        streamed = self.oai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, stop=stop, stream=True
        )
        chunks = list(streamed)
        self.assertEqual(whole.choices[0].text, full[:cut])
        self.assertEqual(whole.choices[0].finish_reason, "stop")
        self.assertEqual("".join(c.choices[0].text for c in chunks), full[:cut])
        self.assertEqual(chunks[-1].choices[0].finish_reason, "stop")

    def test_models_tokenize_and_detokenize_have_vllm_shapes(self) -> None:
        models = self.oai.models.list()
        self.assertEqual([m.id for m in models.data], [MODEL])
        status, body = request(
            "POST", self.url + "/tokenize", json={"prompt": "abc", "return_token_strs": True}
        )
        self.assertEqual(status, 200)
        self.assertEqual(
            body,
            {"count": 3, "max_model_len": 256, "tokens": TOK.encode("abc"), "token_strs": ["a", "b", "c"]},
        )
        messages = [{"role": "user", "content": "hi"}]
        status, body = request("POST", self.url + "/tokenize", json={"messages": messages})
        self.assertEqual(body["tokens"], chat_prompt_ids(messages))
        status, body = request("POST", self.url + "/detokenize", json={"tokens": TOK.encode("hi")})
        self.assertEqual((status, body), (200, {"prompt": "hi"}))

    def test_debug_step_stats_returns_the_engines_last_steps_and_refuses_a_bad_count(self) -> None:
        self.oai.completions.create(model=MODEL, prompt="abc", max_tokens=3)
        status, body = request("GET", self.url + "/debug/step_stats?last=2")
        self.assertEqual(status, 200)
        steps = self.engine.step_stats[-2:]
        self.assertEqual(len(body["data"]), len(steps))
        self.assertEqual(
            [(d["num_running"], d["num_waiting"]) for d in body["data"]],
            [(s.num_running, s.num_waiting) for s in steps],
        )
        for bad in ("0", "100001", "x"):
            status, body = request("GET", self.url + f"/debug/step_stats?last={bad}")
            self.assertEqual(status, 400, bad)
            self.assertIn("error", body)

    def test_bad_requests_get_their_status_and_error_body_and_the_server_keeps_serving(self) -> None:
        cases: list[tuple[str, dict[str, Any], int, str | None]] = [
            ("/v1/completions", {"data": "{not json"}, 400, None),
            (
                "/v1/completions",
                {"json": {"model": MODEL, "prompt": "a", "max_tokens": 0}},
                400,
                "max_tokens",
            ),
            (
                "/v1/completions",
                {"json": {"model": MODEL, "prompt": "a", "max_tokens": -3}},
                400,
                "max_tokens",
            ),
            ("/v1/completions", {"json": {"model": MODEL, "prompt": "a" * 256}}, 400, "prompt"),
            (
                "/v1/completions",
                {"json": {"model": MODEL, "prompt": "a" * 250, "max_tokens": 257}},
                400,
                "max_tokens",
            ),
            ("/v1/completions", {"json": {"model": "other", "prompt": "a"}}, 404, "model"),
            (
                "/v1/completions",
                {"json": {"model": MODEL, "prompt": "a", "max_tokens": "many"}},
                400,
                "max_tokens",
            ),
            ("/v1/completions", {"json": {"model": MODEL, "prompt": 5}}, 400, "prompt"),
            ("/v1/completions", {"json": {"model": MODEL, "prompt": [65, TEXT_VOCAB]}}, 400, "prompt"),
            ("/v1/completions", {"json": {"model": MODEL, "prompt": [65, -1]}}, 400, "prompt"),
            ("/v1/completions", {"json": {"model": MODEL, "prompt": "a", "n": 0}}, 400, "n"),
            ("/v1/completions", {"json": {"model": MODEL, "prompt": "a", "best_of": 2}}, 400, "best_of"),
            ("/v1/completions", {"json": {"model": MODEL, "prompt": "a", "top_p": 0}}, 400, "top_p"),
            ("/v1/chat/completions", {"json": {"model": MODEL, "messages": "hi"}}, 400, "messages"),
            ("/v1/chat/completions", {"json": {"model": MODEL}}, 400, "messages"),
        ]
        for path, kwargs, status, param in cases:
            with self.subTest(path=path, body=kwargs):
                headers = {"Content-Type": "application/json"}
                got, body = request("POST", self.url + path, headers=headers, **kwargs)
                self.assertEqual(got, status)
                self.assertEqual(set(body["error"]), {"message", "type", "param", "code"})
                self.assertEqual(body["error"]["code"], status)
                if param is not None:
                    self.assertEqual(body["error"]["param"], param)
        self.assertEqual(request("GET", self.url + "/health")[0], 200)
        ok = self.oai.completions.create(model=MODEL, prompt="a", max_tokens=2)
        self.assertEqual(ok.choices[0].text, expected_text(TOK.encode("a"), 2))

    def test_every_sampling_field_is_checked_at_the_boundary_with_its_param(self) -> None:
        """Non-finite floats, bools for ints, out-of-range values and unsupported options are 400s naming
        the field; none is a 500 (the engine's own ValueError must never be reached)."""
        chat = "/v1/chat/completions"
        comp = "/v1/completions"
        raw_cases: list[tuple[str, str, str | None]] = [
            (comp, '{"prompt": "a", "temperature": NaN}', "temperature"),
            (comp, '{"prompt": "a", "temperature": Infinity}', "temperature"),
            (chat, '{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', "temperature"),
            (comp, '{"prompt": "a", "top_p": -Infinity}', "top_p"),
            (comp, '{"prompt": "a", "top_p": NaN}', "top_p"),
            (comp, '{"prompt": "a", "max_tokens": true}', "max_tokens"),
            (comp, '{"prompt": "a", "max_tokens": 2.0}', "max_tokens"),
            (comp, '{"prompt": "a", "top_k": false}', "top_k"),
            (comp, '{"prompt": "a", "top_k": -2}', "top_k"),
            (comp, '{"prompt": "a", "seed": -1}', "seed"),
            (comp, '{"prompt": "a", "seed": true}', "seed"),
            (comp, '{"prompt": "a", "temperature": true}', "temperature"),
            (comp, '{"prompt": "a", "logprobs": 21}', "logprobs"),
            (comp, '{"prompt": "a", "logprobs": -1}', "logprobs"),
            (comp, '{"prompt": "a", "logprobs": true}', "logprobs"),
            (chat, '{"messages": [{"role": "user", "content": "a"}], "echo": true}', "echo"),
            (chat, '{"messages": [{"role": "user", "content": "a"}], "logprobs": 2}', "logprobs"),
            (chat, '{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}', "top_logprobs"),
            (chat, '{"messages": []}', "messages"),
            (chat, '{"messages": [{"role": "wizard", "content": "a"}]}', "messages"),
            (comp, '{"model": "m", "prompt": "a", "max_tokens": }', None),
        ]
        for path, raw, param in raw_cases:
            with self.subTest(path=path, body=raw):
                headers = {"Content-Type": "application/json"}
                got, body = request("POST", self.url + path, headers=headers, data=raw.encode())
                self.assertEqual(got, 400, body)
                self.assertEqual(body["error"]["param"], param)
                self.assertEqual(body["error"]["code"], 400)
        got, body = request("POST", self.url + comp, headers=headers, data=raw_cases[-1][1].encode())
        self.assertIn("not valid JSON", body["error"]["message"])
        self.assertIn("character 44", body["error"]["message"])
        got, body = request("POST", self.url + comp, headers=headers, data=b'{"prompt": "\xff"}')
        self.assertEqual(got, 400, body)
        self.assertEqual(set(body), {"error"})
        self.assertEqual(set(body["error"]), {"message", "type", "param", "code"})
        ok = self.oai.completions.create(
            model=MODEL, prompt="a", max_tokens=2, temperature=0, seed=0, extra_body={"top_k": -1}
        )
        self.assertEqual(ok.choices[0].text, expected_text(TOK.encode("a"), 2))


class BodySizeAndPrefixCacheTest(unittest.TestCase):
    def test_a_body_over_max_request_bytes_is_413_before_parsing_and_the_server_keeps_serving(self) -> None:
        thread, _engine, _llm = fake_server(max_request_bytes=1000)

        async def chunked(url: str, size: int) -> tuple[int, Any]:
            async def body():  # no Content-Length: the server counts the chunks as they come
                yield b'{"prompt": "'
                yield b"a" * size
                yield b'", "max_tokens": 1}'

            async with aiohttp.ClientSession() as session:
                headers = {"Content-Type": "application/json"}
                async with session.post(url + "/v1/completions", data=body(), headers=headers) as resp:
                    return resp.status, await resp.json(content_type=None)

        with thread:
            big = {"prompt": "a" * 2000, "max_tokens": 1}
            status, body = request("POST", thread.base_url + "/v1/completions", json=big)
            # not JSON at all: a parser would have answered 400, the size check answers first
            raw = request("POST", thread.base_url + "/v1/completions", data=b"{" * 5000)
            stream_status, stream_body = asyncio.run(chunked(thread.base_url, 5000))
            small_chunked = asyncio.run(chunked(thread.base_url, 10))[0]
            ok = request("POST", thread.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        self.assertEqual((status, body["error"]["code"]), (413, 413))
        self.assertEqual(raw[0], 413)
        self.assertEqual((stream_status, stream_body["error"]["code"]), (413, 413))
        self.assertEqual(small_chunked, 200)
        self.assertEqual(ok[0], 200)

    def test_a_prompt_far_past_max_model_len_is_a_short_400_and_the_server_keeps_serving(self) -> None:
        # 300 kB of prompt: past the size after which the server hands freed memory back to the OS
        calls: list[int | None] = []

        class Recording(CharTokenizer):
            def encode(
                self, text: str, add_special_tokens: bool = True, max_length: int | None = None
            ) -> list[int]:
                calls.append(max_length)
                return super().encode(text, add_special_tokens, max_length)

        core, _runner = make_text_core(max_num_seqs=2, max_model_len=256)
        tokenizer = Recording()
        llm = AsyncLLM.from_engine_core(core, tokenizer)
        prompt = "abcd" * 75_000
        with ServerThread(build_app(llm, tokenizer, MODEL, 256)) as thread:
            url = thread.base_url
            completion = request("POST", url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            messages = [{"role": "user", "content": prompt}]
            chat = request("POST", url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
            generation_calls = list(calls)
            counted = request("POST", url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False})
            ok = request("POST", url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        for status, body, length in ((*completion, len(prompt)), (*chat, len(chat_prompt_ids(messages)))):
            self.assertEqual((status, body["error"]["code"], body["error"]["param"]), (400, 400, "prompt"))
            self.assertNotIn("abcd" * 100, body["error"]["message"])  # the prompt is not echoed back
            self.assertIn(f"the prompt is {length} tokens", body["error"]["message"])  # its exact length
        # a generation request builds no more than max_model_len ids: enough to refuse it
        self.assertEqual(generation_calls, [256, 256])
        self.assertEqual(counted[1]["count"], len(prompt))  # /tokenize still counts the whole prompt
        self.assertEqual(ok[0], 200)
        self.assertEqual(ok[1]["usage"]["completion_tokens"], 2)

    def test_reset_prefix_cache_forgets_the_cache_when_idle_and_is_409_while_blocks_are_held(self) -> None:
        thread, engine, llm = fake_server(max_num_seqs=2, max_model_len=60_000)
        prompt = "a long prompt of several blocks " * 3
        with thread, client(thread.base_url) as oai:
            oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            hits_before = sum(s.prefix_cache_hits for s in engine.step_stats)
            status = request("POST", thread.base_url + "/reset_prefix_cache")[0]
            oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            hits_after = sum(s.prefix_cache_hits for s in engine.step_stats)

            async def busy(url: str) -> int:
                # 50 000 tokens: the request holds its blocks for far longer than the call takes
                body = {"model": MODEL, "prompt": "b", "max_tokens": 50_000, "stream": True}
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(url + "/v1/completions", json=body) as resp,
                ):
                    await resp.content.readline()  # a first event: the request runs
                    return (await fetch("POST", url + "/reset_prefix_cache"))[0]

            refused = asyncio.run(busy(thread.base_url))
            drained = engine.wait_for(
                lambda: llm.num_unfinished == 0 and not engine.has_unfinished_requests()
            )
        self.assertGreater(hits_before, 0)  # the second request found the first one's blocks
        self.assertEqual(status, 200)
        self.assertEqual(hits_after, hits_before)  # after the reset the same prompt found nothing
        self.assertEqual(refused, 409)
        self.assertTrue(drained)


class EosTest(unittest.TestCase):
    def test_eos_stops_with_stop_and_ignore_eos_runs_to_length(self) -> None:
        thread, _engine, _llm = fake_server(eos_at=4)
        with thread, client(thread.base_url) as oai:
            stopped = oai.completions.create(model=MODEL, prompt="e", max_tokens=10)
            ignored = oai.completions.create(
                model=MODEL, prompt="e", max_tokens=10, extra_body={"ignore_eos": True}
            )
        self.assertEqual(stopped.choices[0].text, expected_text(TOK.encode("e"), 4))
        self.assertEqual(stopped.choices[0].finish_reason, "stop")
        assert stopped.usage is not None
        self.assertEqual(stopped.usage.completion_tokens, 5)  # the EOS token is generated and counted
        self.assertEqual(ignored.choices[0].text, expected_text(TOK.encode("e"), 10))
        self.assertEqual(ignored.choices[0].finish_reason, "length")


class MetricsTest(unittest.TestCase):
    def test_metrics_parse_and_count_what_was_served(self) -> None:
        thread, _engine, _llm = fake_server(max_num_seqs=2)
        prompts = ["one", "three", "seven"]
        with thread, client(thread.base_url) as oai:
            for p in prompts:
                oai.completions.create(model=MODEL, prompt=p, max_tokens=6)
            samples = scrape(thread.base_url)
        names = {name.split("{")[0] for name in samples}
        for metric in METRIC_NAMES:
            with self.subTest(metric=metric):
                self.assertTrue(any(n == metric or n.startswith(metric + "_") for n in names), metric)
        self.assertEqual(samples["vllm:prompt_tokens_total{}"], sum(len(p) for p in prompts))
        self.assertEqual(samples["vllm:generation_tokens_total{}"], 6 * len(prompts))
        self.assertEqual(samples["vllm:request_success_total{finished_reason=length}"], 3)
        self.assertEqual(samples["vllm:time_to_first_token_seconds_count{}"], 3)
        self.assertEqual(samples["vllm:inter_token_latency_seconds_count{}"], 3 * 5)
        self.assertEqual(samples["vllm:e2e_request_latency_seconds_count{}"], 3)
        self.assertEqual(samples["vllm:request_queue_time_seconds_count{}"], 3)
        self.assertEqual(samples["vllm:iteration_tokens_total_sum{}"], sum(len(p) + 5 for p in prompts))
        self.assertEqual(samples["vllm:num_requests_running{}"], 0)
        self.assertEqual(samples["vllm:kv_cache_usage_perc{}"], 0)

    def test_running_and_waiting_are_read_at_the_moment_of_the_scrape(self) -> None:
        thread, engine, llm = fake_server(max_num_seqs=1)
        engine.gate.clear()  # the engine admits the first request, then its step waits

        async def go(url: str) -> dict[str, float]:
            body = {"model": MODEL, "prompt": "w", "max_tokens": 3, "stream": True}
            async with aiohttp.ClientSession() as session:
                responses = [await session.post(url + "/v1/completions", json=body) for _ in range(3)]
                # the core reports an admission before the step runs: wait (bounded) for the report
                self.assertTrue(engine.wait_for(lambda: engine.blocked and llm.num_running == 1))
                samples = await asyncio.to_thread(scrape, url)
                engine.gate.set()
                for resp in responses:
                    await resp.read()
                    resp.release()
                return samples

        with thread:
            samples = asyncio.run(go(thread.base_url))
        self.assertEqual(samples["vllm:num_requests_running{}"], 1)
        self.assertEqual(samples["vllm:num_requests_waiting{}"], 2)


class FaultTest(unittest.TestCase):
    def test_clients_that_disconnect_after_the_first_token_leave_nothing_running_or_allocated(self) -> None:
        # max_tokens far beyond what the test's lifetime allows: every request can only end by the abort
        thread, engine, llm = fake_server(max_num_seqs=16, max_model_len=60_000)
        total_blocks = engine.num_free_blocks

        async def one(session: aiohttp.ClientSession, url: str, i: int) -> str:
            body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 50_000, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        return json.loads(line[6:])["choices"][0]["text"]
            return ""

        async def go(url: str) -> list[str]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                return await asyncio.gather(*(one(session, url, i) for i in range(100)))

        with thread:
            firsts = asyncio.run(go(thread.base_url))
            drained = engine.wait_for(
                lambda: llm.num_unfinished == 0 and not engine.has_unfinished_requests()
            )
            samples = scrape(thread.base_url)
        self.assertTrue(drained)
        # a first chunk carries every token produced before it was written (at least one)
        self.assertTrue(all(firsts))
        self.assertEqual(firsts, [expected_text(TOK.encode(f"p{i}"), len(f)) for i, f in enumerate(firsts)])
        self.assertEqual(engine.num_free_blocks, total_blocks)
        self.assertEqual(samples["vllm:num_requests_running{}"], 0)
        self.assertEqual(samples["vllm:num_requests_waiting{}"], 0)
        self.assertEqual(samples["vllm:request_success_total{finished_reason=abort}"], 100)
        self.assertLessEqual(max(s.num_running for s in engine.step_stats), 16)

    def test_a_client_that_leaves_a_whole_response_aborts_its_request(self) -> None:
        thread, engine, llm = fake_server(max_num_seqs=2, max_model_len=60_000)
        engine.gate.clear()  # the request's first step waits: the client leaves meanwhile

        async def go(url: str) -> None:
            body = {"model": MODEL, "prompt": "w", "max_tokens": 50_000}
            async with aiohttp.ClientSession() as session:
                task = asyncio.ensure_future(session.post(url + "/v1/completions", json=body))
                self.assertTrue(await asyncio.to_thread(engine.wait_for, lambda: engine.blocked))
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            engine.gate.set()

        with thread:
            asyncio.run(go(thread.base_url))
            drained = engine.wait_for(
                lambda: llm.num_unfinished == 0 and not engine.has_unfinished_requests()
            )
            samples = scrape(thread.base_url)
        self.assertTrue(drained)
        self.assertEqual(samples["vllm:request_success_total{finished_reason=abort}"], 1)

    def test_an_unexpected_error_in_a_handler_is_a_500_with_an_error_body(self) -> None:
        class Exploding(CharTokenizer):
            def encode(
                self, text: str, add_special_tokens: bool = True, max_length: int | None = None
            ) -> list[int]:
                if text == "boom":
                    raise RuntimeError("tokenizer bug")
                return super().encode(text, add_special_tokens, max_length)

        tokenizer = Exploding()
        app = build_app(AsyncLLM.from_engine_core(make_text_core()[0], tokenizer), tokenizer, MODEL, 256)
        with ServerThread(app) as thread:
            with (
                self.assertLogs("attention_kv_caceh.entrypoints.openai.api_server", "ERROR"),
                self.assertLogs("uvicorn.error"),
            ):
                status, body = request("POST", thread.base_url + "/v1/completions", json={"prompt": "boom"})
            health = request("GET", thread.base_url + "/health")[0]
            ok = request("POST", thread.base_url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        self.assertEqual((status, body["error"]["code"]), (500, 500))
        self.assertIn("tokenizer bug", body["error"]["message"])
        self.assertEqual((health, ok[0]), (200, 200))

    def test_api_key_is_required_everywhere_but_health_metrics_and_docs(self) -> None:
        """Fail closed, as vLLM's newer AuthenticationMiddleware: every endpoint needs the key except the
        health probe, the metrics scrape and the API docs, none of which names a request; the engine's
        step record lists request ids, so it needs the key."""
        thread, _engine, _llm = fake_server(api_key="sesame")
        keyed = [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
            ("POST", "/tokenize", {"prompt": "a"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("POST", "/reset_prefix_cache", None),
            ("GET", "/debug/step_stats", None),
            ("GET", "/debug/step_stats/", None),
            ("GET", "/no/such/path", None),
        ]
        with thread:
            with (
                client(thread.base_url, api_key="wrong") as bad,
                self.assertRaises(openai.AuthenticationError),
            ):
                bad.completions.create(model=MODEL, prompt="a", max_tokens=1)
            with client(thread.base_url, api_key="sesame") as good:
                ok = good.completions.create(model=MODEL, prompt="a", max_tokens=1)
            for method, path, body in keyed:
                with self.subTest(path=path):
                    status, got = request(method, thread.base_url + path, json=body)
                    self.assertEqual((status, got["error"]["code"]), (401, 401))
            for path in ("/health", "/metrics", "/docs", "/openapi.json"):
                with self.subTest(path=path):
                    status, got = request("GET", thread.base_url + path)
                    self.assertEqual(status, 200)
                    self.assertNotIn(ok.id.removeprefix("cmpl-"), str(got))  # no request named there
            headers = {"Authorization": "Bearer sesame"}
            status, stats = request("GET", thread.base_url + "/debug/step_stats", headers=headers)
        self.assertEqual(status, 200)
        self.assertTrue(any(s["num_scheduled_tokens"] for s in stats["data"]))  # with the key: every id
        self.assertEqual(ok.choices[0].text, expected_text(TOK.encode("a"), 1))

    def test_requests_beyond_max_queue_waiting_get_503(self) -> None:
        thread, engine, _llm = fake_server(max_num_seqs=1, max_queue=1)
        engine.gate.clear()

        async def go(url: str) -> tuple[int, Any, list[int]]:
            body = {"model": MODEL, "prompt": "m", "max_tokens": 2, "stream": True}
            async with aiohttp.ClientSession() as session:
                admitted = [await session.post(url + "/v1/completions", json=body) for _ in range(2)]
                status, rejected = await fetch("POST", url + "/v1/completions", json=body)
                engine.gate.set()
                for resp in admitted:
                    await resp.read()
                    resp.release()
                return status, rejected, [r.status for r in admitted]

        with thread:
            status, rejected, admitted = asyncio.run(go(thread.base_url))
            after = request(
                "POST", thread.base_url + "/v1/completions", json={"prompt": "m", "max_tokens": 2}
            )
        self.assertEqual(admitted, [200, 200])
        self.assertEqual(status, 503)
        self.assertEqual(rejected["error"]["type"], "ServiceUnavailableError")
        self.assertEqual(after[0], 200)

    def test_a_failing_step_fails_its_requests_with_an_error_event_and_the_server_keeps_serving(self) -> None:
        thread, engine, llm = fake_server()
        engine.fail_steps = 1
        with thread, client(thread.base_url) as oai:
            with (
                self.assertLogs("attention_kv_caceh.engine.async_llm", "ERROR") as logs,
                self.assertLogs("attention_kv_caceh.engine.core", "ERROR"),
            ):
                stream = oai.completions.create(model=MODEL, prompt="f", max_tokens=4, stream=True)
                with self.assertRaises(openai.APIError):
                    list(stream)
            engine.fail_steps = 1
            with (
                self.assertRaises(openai.InternalServerError),
                self.assertLogs("attention_kv_caceh", "ERROR"),
            ):
                oai.completions.create(model=MODEL, prompt="f", max_tokens=4)
            self.assertEqual(request("GET", thread.base_url + "/health")[0], 200)
            ok = oai.completions.create(model=MODEL, prompt="f", max_tokens=4)
        self.assertEqual(len(logs.records), 1)
        self.assertEqual(ok.choices[0].text, expected_text(TOK.encode("f"), 4))
        self.assertEqual(llm.num_failed_steps, 2)
        self.assertFalse(engine.has_unfinished_requests())


if __name__ == "__main__":
    unittest.main()


def bos_tokenizer() -> Tokenizer:
    """A real Tokenizer over the letter runner's ids (id i is chr(32 + i)) whose encode puts a
    `<|begin_of_text|>` (id 94, 17 characters when kept) first, as Llama 3's does; id 95 ends the text."""
    vocab = {chr(32 + i): i for i in range(TEXT_VOCAB - 2)}
    vocab |= {"<|begin_of_text|>": TEXT_VOCAB - 2, "<|end_of_text|>": TEXT_VOCAB - 1}
    hf = HFTokenizer(WordLevel(vocab, unk_token="?"))
    hf.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", TEXT_VOCAB - 2)]
    )
    return Tokenizer(hf, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})


class BoundaryTest(unittest.TestCase):
    """Integers out of range, query parameters, stream_options and content types at the boundary."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.thread, cls.engine, cls.llm = fake_server(max_num_seqs=4)
        cls.thread.__enter__()
        cls.url = cls.thread.base_url

    @classmethod
    def tearDownClass(cls) -> None:
        cls.thread.__exit__(None, None, None)

    def post(
        self, path: str, body: dict[str, Any], content_type: str = "application/json"
    ) -> tuple[int, Any]:
        data = json.dumps(body).encode()
        return request("POST", self.url + path, data=data, headers={"Content-Type": content_type})

    def test_integers_past_64_bits_are_400s_naming_the_field_and_leave_nothing_counted(self) -> None:
        huge = 99999999999999999999999
        chat = {"messages": [{"role": "user", "content": "a"}]}
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("/v1/completions", {"prompt": "a", "seed": huge}, "seed"),
            ("/v1/completions", {"prompt": "a", "seed": 2**64}, "seed"),
            ("/v1/completions", {"prompt": "a", "top_k": 2**64}, "top_k"),
            ("/v1/completions", {"prompt": "a", "top_k": -(2**64)}, "top_k"),
            ("/v1/completions", {"prompt": "a", "max_tokens": 2**64}, "max_tokens"),
            ("/v1/completions", {"prompt": "a", "min_tokens": huge}, "min_tokens"),
            ("/v1/completions", {"prompt": "a", "n": huge}, "n"),
            ("/v1/completions", {"prompt": "a", "logprobs": huge}, "logprobs"),
            ("/v1/completions", {"prompt": [65, huge]}, "prompt"),
            ("/v1/completions", {"prompt": [[65], [2**64]]}, "prompt"),
            ("/v1/completions", {"prompt": "a", "stop_token_ids": [2**64]}, "stop_token_ids"),
            ("/v1/completions", {"prompt": "a", "logit_bias": {str(huge): 1}}, "logit_bias"),
            ("/v1/completions", {"prompt": "a", "logit_bias": {" 5": 1}}, "logit_bias"),
            ("/v1/chat/completions", {**chat, "max_completion_tokens": huge}, "max_completion_tokens"),
            ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": huge}, "top_logprobs"),
            ("/v1/chat/completions", {**chat, "seed": 2**64}, "seed"),
            ("/detokenize", {"tokens": [huge]}, "tokens"),
            ("/tokenize", {"prompt": [huge]}, "prompt"),
        ]
        for path, body, param in cases:
            with self.subTest(path=path, body=body):
                status, got = self.post(path, body)
                self.assertEqual(status, 400, got)
                self.assertEqual(got["error"]["param"], param)
        self.assertEqual(self.llm.num_unfinished, 0)
        samples = scrape(self.url)
        self.assertEqual(samples["vllm:num_requests_waiting{}"], 0)
        self.assertEqual(samples["vllm:num_requests_running{}"], 0)
        # the largest seed vLLM takes is served, every sample's seed (seed + i) included
        status, got = self.post(
            "/v1/completions", {"prompt": "a", "max_tokens": 2, "seed": 2**63 - 1, "n": 2}
        )
        self.assertEqual(status, 200, got)
        self.assertEqual([c["text"] for c in got["choices"]], [expected_text(TOK.encode("a"), 2)] * 2)

    def test_a_bad_query_parameter_is_named_as_param(self) -> None:
        for bad in ("abc", "1.5", str(2**64)):
            status, body = request("GET", self.url + f"/debug/step_stats?last={bad}")
            self.assertEqual(status, 400, body)
            self.assertEqual(body["error"]["param"], "last")

    def test_stream_options_without_stream_is_a_400_naming_it(self) -> None:
        options = {"include_usage": True}
        chat = {"messages": [{"role": "user", "content": "a"}]}
        for path, body in (
            ("/v1/completions", {"prompt": "a", "max_tokens": 2, "stream_options": options}),
            ("/v1/completions", {"prompt": "a", "max_tokens": 2, "stream": False, "stream_options": options}),
            ("/v1/chat/completions", {**chat, "max_tokens": 2, "stream_options": options}),
        ):
            with self.subTest(path=path, body=body):
                status, got = self.post(path, body)
                self.assertEqual(status, 400, got)
                self.assertEqual(got["error"]["param"], "stream_options")
        status, got = self.post(
            "/v1/completions", {"prompt": "a", "max_tokens": 2, "stream": True, "stream_options": options}
        )
        self.assertEqual(status, 200)

    def test_a_json_body_sent_as_text_plain_is_a_415_about_the_content_type(self) -> None:
        body = {"prompt": "a", "max_tokens": 2}
        status, got = self.post("/v1/completions", body, "text/plain")
        self.assertEqual(status, 415, got)
        self.assertEqual(got["error"]["code"], 415)
        self.assertIn("text/plain", got["error"]["message"])
        for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
            with self.subTest(content_type=content_type):
                status, got = self.post("/v1/completions", body, content_type)
                self.assertEqual(status, 200, got)
        status, got = self.post("/v1/completions", {"prompt": 5}, "application/json")
        self.assertEqual((status, got["error"]["param"]), (400, "prompt"))  # a JSON body keeps its 400

    def test_a_json_body_with_no_content_type_is_read_as_json(self) -> None:
        """No Content-Type header at all (http.client sends none unless told; urllib and curl send a form
        type): the body is read as JSON, as the docs say and FastAPI did before its strict default."""
        import http.client
        from urllib.parse import urlsplit

        parts = urlsplit(self.url)
        for path, body in (
            ("/v1/completions", {"prompt": "a", "max_tokens": 2, "temperature": 0}),
            ("/tokenize", {"prompt": "ab"}),
        ):
            with self.subTest(path=path):
                conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
                try:
                    conn.putrequest("POST", path, skip_accept_encoding=True)
                    data = json.dumps(body).encode()
                    conn.putheader("Content-Length", str(len(data)))
                    conn.endheaders(data)
                    resp = conn.getresponse()
                    got = json.loads(resp.read())
                finally:
                    conn.close()
                self.assertEqual(resp.status, 200, got)
        self.assertEqual(got["tokens"], TOK.encode("ab"))


class EchoOffsetTest(unittest.TestCase):
    def test_echo_text_offsets_index_the_returned_text_not_the_skipped_bos(self) -> None:
        tokenizer = bos_tokenizer()
        core, _runner = make_text_core(max_num_seqs=2)
        llm = AsyncLLM.from_engine_core(core, tokenizer)
        app = build_app(llm, tokenizer, MODEL, 256)
        prompt = "to be"
        with ServerThread(app) as thread:
            for stream in (False, True):
                with self.subTest(stream=stream):
                    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "stream": stream}
                    status, got = request("POST", thread.base_url + "/v1/completions", json=body)
                    self.assertEqual(status, 200, got)
                    if stream:
                        events = [json.loads(line[6:]) for line in got.split("\n") if line[6:7] == "{"]
                        chunks = [e["choices"][0] for e in events if e["choices"]]
                        text = "".join(c["text"] for c in chunks)
                        logprobs = [c["logprobs"] for c in chunks if c["logprobs"]]
                        tokens = [t for lp in logprobs for t in lp["tokens"]]
                        offsets = [o for lp in logprobs for o in lp["text_offset"]]
                    else:
                        choice = got["choices"][0]
                        text, tokens = choice["text"], choice["logprobs"]["tokens"]
                        offsets = choice["logprobs"]["text_offset"]
                    ids = tokenizer.encode(prompt)
                    self.assertEqual(ids[0], tokenizer.bos_token_id)
                    self.assertTrue(text.startswith(prompt))
                    self.assertEqual(len(tokens), len(ids) + 3)
                    self.assertEqual(tokens[0], "<|begin_of_text|>")
                    # the BOS is not in the text: it starts at 0 and takes no characters
                    self.assertEqual(offsets, [0, *range(len(text))])
                    for token, offset in zip(tokens[1:], offsets[1:], strict=True):
                        self.assertEqual(text[offset : offset + len(token)], token)
