"""The request fields vLLM serves, through the real engine on a tiny random checkpoint.

Oracles: logprobs are a float64 log-softmax of `reference_logits` (the float64 forward written out
loop by loop, tests/test_engine_model.py); each of the n samples equals the same sample requested alone
with its own seed; a batch of prompts equals each prompt alone; echo is the prompt's text then the
completion's; children's shared KV blocks are read from the block pool's reference counts.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import unittest
from pathlib import Path
from typing import Any

import numpy as np
import openai

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.core import EngineCore
from attention_kv_caceh.engine.llm_engine import LLMEngine, RequestOutput
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.stats import IterationStats
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.openai.api_server import build_app
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.serve_helpers import ServerThread
from tests.test_engine_model import reference_logits
from tests.test_engine_server import request

MODEL = "tiny"
TOL = 1e-4  # float32 engine against the float64 reference, or two float32 runs batched differently


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class _Checkpoint(unittest.TestCase):
    folder: Path

    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.folder = write_random_checkpoint(Path(cls._tmp.name) / "tiny", "llama", "tiny", seed=11)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    @classmethod
    def config(cls, **fields: Any) -> EngineConfig:
        return EngineConfig(
            **{"num_kv_blocks": 64, "block_size": 4, "max_model_len": 96, "max_num_seqs": 8, **fields}
        )

    @classmethod
    def engine(cls, **fields: Any) -> LLMEngine:
        return LLMEngine.from_pretrained(str(cls.folder), cls.config(**fields))

    @classmethod
    def async_llm(cls, **fields: Any) -> tuple[EngineCore, AsyncLLM]:
        core = EngineCore.from_pretrained(str(cls.folder), cls.config(**fields))
        return core, AsyncLLM.from_engine_core(core, Tokenizer.load(cls.folder))


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


class EngineLogprobsTest(_Checkpoint):
    def test_sampled_and_prompt_logprobs_equal_the_float64_log_softmax_of_the_reference_forward(self) -> None:
        engine = self.engine(
            max_num_batched_tokens=5, max_num_seqs=2
        )  # chunked prefill: prompt logprobs over 3 chunks
        prompt = [int(t) for t in np.random.default_rng(1).integers(3, 500, size=11)]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
        outs = run(engine, {"a": (prompt, params)})["a"]
        tokens = [t for o in outs for t in o.new_token_ids]
        sampled = [lp for o in outs for lp in o.logprobs]
        prompt_lps = outs[0].prompt_logprobs
        assert prompt_lps is not None
        ref = log_softmax64(reference_logits(self.folder, prompt + tokens[:-1]))  # [P + 3, V]
        self.assertEqual(len(prompt_lps), len(prompt) - 1)
        for j, entry in enumerate(prompt_lps, start=1):
            self.assertEqual(entry.token_id, prompt[j])
            self.assertAlmostEqual(entry.logprob, ref[j - 1, prompt[j]], delta=TOL)
            top_ids = [t for t, _ in entry.top]
            self.assertEqual(top_ids, list(np.argsort(-ref[j - 1], kind="stable")[:3]))
        for i, entry in enumerate(sampled):
            row = ref[len(prompt) - 1 + i]
            self.assertEqual(entry.token_id, tokens[i])
            self.assertAlmostEqual(entry.logprob, row[tokens[i]], delta=TOL)
            self.assertEqual(entry.rank, 1)  # greedy: the token is top-1
            self.assertEqual(entry.top[0][0], tokens[i])
            for t, lp in entry.top:
                self.assertAlmostEqual(lp, row[t], delta=TOL)

    def test_a_prefix_cache_hit_does_not_skip_prompt_logprobs(self) -> None:
        engine = self.engine()
        prompt = [int(t) for t in np.random.default_rng(2).integers(3, 500, size=13)]
        warm = SamplingParams(max_tokens=1, temperature=0.0)
        run(engine, {"warm": (prompt, warm)})  # its full blocks are now in the prefix cache
        asks = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        again = run(engine, {"again": (prompt, asks)})["again"][0].prompt_logprobs
        plain = run(engine, {"plain": (prompt, warm)})
        self.assertGreater(engine.step_stats[-1].prefix_cache_hits, 0)  # the cache would have hit
        assert again is not None and plain
        ref = log_softmax64(reference_logits(self.folder, prompt))
        self.assertEqual(len(again), len(prompt) - 1)
        for j, entry in enumerate(again, start=1):
            self.assertAlmostEqual(entry.logprob, ref[j - 1, prompt[j]], delta=TOL)


class ServerFieldsTest(_Checkpoint):
    """One real-engine server for the HTTP tests."""

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.core, cls.llm = cls.async_llm()
        cls.tok = Tokenizer.load(cls.folder)
        app = build_app(cls.llm, cls.tok, MODEL, 96)
        cls.server = ServerThread(app)
        cls.server.__enter__()
        cls.url = cls.server.base_url
        cls.oai = openai.OpenAI(base_url=cls.url + "/v1", api_key="none", max_retries=0, timeout=60)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.oai.close()
        cls.server.__exit__(None, None, None)
        super().tearDownClass()

    def post(self, path: str, body: dict[str, Any] | str) -> tuple[int, Any]:
        data = body if isinstance(body, str) else json.dumps(body)
        headers = {"Content-Type": "application/json"}
        return request("POST", self.url + path, data=data.encode("utf-8", "surrogatepass"), headers=headers)

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        status, text = self.post(path, {**body, "stream": True})
        self.assertEqual(status, 200)
        lines = [line[6:] for line in str(text).splitlines() if line.startswith("data: {")]
        return [json.loads(line) for line in lines]

    def test_n_samples_each_equal_the_child_alone_and_the_openai_client_reads_them_with_logprobs(
        self,
    ) -> None:
        body = {"model": MODEL, "prompt": "the cache", "max_tokens": 6, "temperature": 1.0, "seed": 5}
        whole = self.oai.completions.create(**body, n=2, logprobs=2)  # pyright: ignore[reportArgumentType, reportCallIssue]
        self.assertEqual(sorted(c.index for c in whole.choices), [0, 1])
        prompt_len = len(self.tok.encode("the cache"))
        assert whole.usage is not None
        self.assertEqual(whole.usage.prompt_tokens, prompt_len)  # the prompt once
        self.assertEqual(whole.usage.completion_tokens, 12)
        for choice in whole.choices:
            alone = self.oai.completions.create(**{**body, "seed": 5 + choice.index}, logprobs=2)  # pyright: ignore[reportArgumentType, reportCallIssue]
            self.assertEqual(choice.text, alone.choices[0].text)
            assert choice.logprobs is not None and alone.choices[0].logprobs is not None
            self.assertEqual(choice.logprobs.tokens, alone.choices[0].logprobs.tokens)
            np.testing.assert_allclose(  # float32: other batch shapes round differently
                np.array(choice.logprobs.token_logprobs),
                np.array(alone.choices[0].logprobs.token_logprobs),
                atol=TOL,
            )
        self.assertNotEqual(whole.choices[0].text, whole.choices[1].text)  # the seeds differ
        chunks = list(self.oai.completions.create(**body, n=2, logprobs=2, stream=True))  # pyright: ignore[reportArgumentType, reportCallIssue]
        texts = {0: "", 1: ""}
        lps: dict[int, list[float]] = {0: [], 1: []}
        finishes: list[int] = []
        for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.logprobs is not None:
                    lps[c.index] += [float(x) for x in c.logprobs.token_logprobs or []]
                if c.finish_reason is not None:
                    finishes.append(c.index)
        self.assertEqual(sorted(finishes), [0, 1])  # each index finishes once
        by_index = {c.index: c for c in whole.choices}
        for i in (0, 1):
            self.assertEqual(texts[i], by_index[i].text)
            logprobs = by_index[i].logprobs
            assert logprobs is not None
            np.testing.assert_allclose(lps[i], logprobs.token_logprobs or [], atol=TOL)

    def test_children_share_the_prompts_kv_blocks(self) -> None:
        pool = self.core.scheduler.kv_cache_manager.block_pool
        most: list[int] = [0]
        hits: list[int] = [0]

        def record(stats: IterationStats) -> None:  # runs in the output thread after every step
            most[0] = max(most[0], max(b.ref_cnt for b in pool.blocks))
            hits[0] += stats.prefix_cache_hits

        self.llm.add_stat_logger(record)
        prompt = [int(t) for t in np.random.default_rng(3).integers(3, 500, size=10)]  # two full blocks
        body = {"prompt": prompt, "n": 3, "max_tokens": 40, "seed": 1, "ignore_eos": True}
        status, got = self.post("/v1/completions", body)
        self.assertEqual(status, 200, got)
        self.assertEqual(len(got["choices"]), 3)
        self.assertEqual(hits[0], 2 * 8)  # each later child found the prompt's two full blocks cached
        self.assertEqual(most[0], 3)  # one copy of those blocks, held by all three children at once

    def test_echo_with_max_tokens_0_gives_the_prompts_logprobs_and_echo_prefixes_the_text(self) -> None:
        prompt = [int(t) for t in np.random.default_rng(4).integers(3, 500, size=9)]
        ref = log_softmax64(reference_logits(self.folder, prompt))
        status, body = self.post(
            "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
        )
        self.assertEqual(status, 200, body)
        choice = body["choices"][0]
        self.assertEqual(choice["text"], self.tok.decode(prompt))
        lp = choice["logprobs"]
        self.assertIsNone(lp["token_logprobs"][0])
        self.assertEqual(len(lp["token_logprobs"]), len(prompt))
        expected = [ref[j - 1, prompt[j]] for j in range(1, len(prompt))]
        np.testing.assert_allclose(lp["token_logprobs"][1:], expected, atol=TOL)
        self.assertEqual(lp["tokens"], [self.tok.decode([t], skip_special_tokens=False) for t in prompt])
        self.assertEqual(body["usage"]["completion_tokens"], 0)
        echo = {"prompt": "the cache", "echo": True, "max_tokens": 5, "temperature": 0}
        plain = {**echo, "echo": False}
        self.assertEqual(
            self.post("/v1/completions", echo)[1]["choices"][0]["text"],
            "the cache" + self.post("/v1/completions", plain)[1]["choices"][0]["text"],
        )

    def test_streamed_echo_opens_the_first_chunk_and_adds_up_to_the_whole(self) -> None:
        body = {"prompt": "the cache", "echo": True, "max_tokens": 5, "temperature": 0}
        chunks = self.stream("/v1/completions", body)
        texts = [ch["text"] for c in chunks for ch in c["choices"]]
        self.assertTrue(texts[0].startswith("the cache"))
        self.assertEqual("".join(texts), self.post("/v1/completions", body)[1]["choices"][0]["text"])

    def test_include_stop_str_in_output_and_skip_special_tokens(self) -> None:
        body = {"prompt": "the cache", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        text = self.post("/v1/completions", body)[1]["choices"][0]["text"]
        stop = text[3:5]
        cut = text.index(stop)
        for include, expected in ((False, text[:cut]), (True, text[: cut + len(stop)])):
            with self.subTest(include_stop_str_in_output=include):
                extra = {"stop": [stop], "include_stop_str_in_output": include}
                got = self.post("/v1/completions", {**body, **extra})[1]["choices"][0]
                self.assertEqual((got["text"], got["finish_reason"]), (expected, "stop"))
        eos = self.tok.eos_token_id
        assert eos is not None and self.tok.eos_token is not None
        forced = {**body, "max_tokens": 3, "logit_bias": {str(eos): 100}}
        skipped = self.post("/v1/completions", forced)[1]["choices"][0]["text"]
        kept = self.post("/v1/completions", {**forced, "skip_special_tokens": False})[1]["choices"][0]["text"]
        self.assertEqual((skipped, kept), ("", self.tok.eos_token * 3))

    def test_batched_prompts_equal_each_prompt_alone(self) -> None:
        ids = [int(t) for t in np.random.default_rng(5).integers(3, 500, size=6)]
        forms: list[list[Any]] = [["one", "two words"], [ids, [7, 8, 9]]]
        for prompts in forms:
            with self.subTest(prompts=prompts):
                body = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2, "logprobs": 0}
                status, got = self.post("/v1/completions", body)
                self.assertEqual(status, 200, got)
                self.assertEqual([c["index"] for c in got["choices"]], [0, 1, 2, 3])
                prompt_tokens = 0
                for p, prompt in enumerate(prompts):
                    _, alone = self.post("/v1/completions", {**body, "prompt": prompt, "n": 1})
                    prompt_tokens += alone["usage"]["prompt_tokens"]
                    for i in range(2):
                        self.assertEqual(got["choices"][2 * p + i]["text"], alone["choices"][0]["text"])
                self.assertEqual(got["usage"]["prompt_tokens"], prompt_tokens)

    def test_chat_logprobs_bytes_rebuild_the_text_and_streamed_logprobs_add_up(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "héllo ✓"}],
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 3,
            "logprobs": True,
            "top_logprobs": 2,
        }
        status, whole = self.post("/v1/chat/completions", body)
        self.assertEqual(status, 200, whole)
        content = whole["choices"][0]["logprobs"]["content"]
        text = whole["choices"][0]["message"]["content"]
        rebuilt = b"".join(bytes(e["bytes"]) for e in content)
        self.assertEqual(rebuilt.decode("utf-8", errors="replace"), text)
        self.assertTrue(all(len(e["top_logprobs"]) == 2 for e in content))
        streamed = [
            e
            for c in self.stream("/v1/chat/completions", body)
            for ch in c["choices"]
            if ch["logprobs"]
            for e in ch["logprobs"]["content"]
        ]
        self.assertEqual([e["token"] for e in streamed], [e["token"] for e in content])
        np.testing.assert_allclose(
            [e["logprob"] for e in streamed], [e["logprob"] for e in content], atol=TOL
        )

    def test_multi_byte_characters_rebuild_from_token_bytes(self) -> None:
        text = "héllo wörld ✓ 日本"
        ids = self.tok.encode(text, add_special_tokens=False)
        self.assertEqual(b"".join(self.tok.token_bytes(t) for t in ids).decode("utf-8"), text)
        self.assertTrue(any("\ufffd" in self.tok.decode([t]) for t in ids))  # some token is half a character

    def test_stop_token_ids_stop_out_of_the_text_and_bad_ones_are_refused_beside_a_running_stream(
        self,
    ) -> None:
        body = {"prompt": "stop here", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        plain = self.post("/v1/completions", body)[1]["choices"][0]
        ids = self.tok.encode("stop here")
        # the greedy ids, from an engine of its own (the oracle of where the stop falls)
        (greedy,) = self.engine().generate(
            [ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        j = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
        status, got = self.post("/v1/completions", {**body, "prompt": ids, "stop_token_ids": [greedy[j]]})
        self.assertEqual(status, 200, got)
        self.assertEqual(got["choices"][0]["finish_reason"], "stop")
        self.assertEqual(got["choices"][0]["text"], self.tok.decode(greedy[:j]))
        self.assertEqual(got["usage"]["completion_tokens"], j + 1)
        status, held = self.post(
            "/v1/completions", {**body, "prompt": ids, "stop_token_ids": [greedy[j]], "min_tokens": j + 1}
        )
        self.assertEqual(status, 200, held)
        self.assertGreater(held["usage"]["completion_tokens"], j + 1)
        # bad ids are refused while a neighbour streams, and the neighbour's text is unchanged
        result: list[list[dict[str, Any]]] = []
        neighbour = threading.Thread(target=lambda: result.append(self.stream("/v1/completions", body)))
        neighbour.start()
        for bad in ("[512]", "[-1]", "[1.5]", '"7"', "[true]"):
            with self.subTest(stop_token_ids=bad):
                status, err = self.post("/v1/completions", f'{{"prompt": "a", "stop_token_ids": {bad}}}')
                self.assertEqual(status, 400, err)
                self.assertEqual(err["error"]["param"], "stop_token_ids")
        neighbour.join(60)
        streamed = "".join(ch["text"] for c in result[0] for ch in c["choices"])
        self.assertEqual(streamed, plain["text"])

    def test_refused_unknown_and_malformed_fields(self) -> None:
        comp = "/v1/completions"
        chat = "/v1/chat/completions"
        msgs = '[{"role": "user", "content": "a"}]'
        cases = [
            (comp, '{"prompt": "a", "suffix": "b"}', "suffix"),
            (comp, '{"prompt": "a", "best_of": 2}', "best_of"),
            (
                chat,
                f'{{"messages": {msgs}, "response_format": {{"type": "json_schema", "json_schema": '
                '{"name": "x", "schema": {"type": "strin"}}}}',
                "response_format",
            ),
            (chat, f'{{"messages": {msgs}, "tools": [{{"type": "function"}}]}}', "tools"),
            (chat, f'{{"messages": {msgs}, "tool_choice": "auto"}}', "tool_choice"),
            (chat, f'{{"messages": {msgs}, "chat_template": "x"}}', "chat_template"),
            (comp, '{"prompt": "a", "logprobs": 21}', "logprobs"),
            (chat, f'{{"messages": {msgs}, "logprobs": true, "top_logprobs": 21}}', "top_logprobs"),
            (comp, '{"prompt": "a", "min_tokens": 5, "max_tokens": 4}', "min_tokens"),
            (comp, '{"prompt": "a", "logit_bias": {"512": 1}}', "logit_bias"),
            (comp, '{"prompt": "a", "logit_bias": {"x": 1}}', "logit_bias"),
            (comp, '{"prompt": "a", "frequency_penalty": 3}', "frequency_penalty"),
            (comp, '{"prompt": "a", "repetition_penalty": 0}', "repetition_penalty"),
            (comp, '{"prompt": "a", "repetition_penalty": 1e101}', "repetition_penalty"),
            (comp, '{"prompt": "a", "repetition_penalty": 1e-300}', "repetition_penalty"),
            (
                comp,
                f'{{"prompt": "a", "min_tokens": 1, "stop_token_ids": {list(range(512))}}}',
                "stop_token_ids",
            ),
            (comp, '{"prompt": ["a", [1, 2]]}', "prompt"),
            (comp, '{"prompt": [[1, 600]]}', "prompt"),
            (comp, '{"prompt": []}', "prompt"),
            (comp, '{"prompt": "\\ud800"}', "prompt"),
            (comp, '{"prompt": ["ok", "\\udfff"]}', "prompt"),
            (chat, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
            ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
            (comp, '{"prompt": "a", "stop": [1]}', "stop"),
            (comp, '{"prompt": "a", "stop": ["x", ""]}', "stop"),  # an empty stop string, as vLLM refuses
            (comp, '{"prompt": "a", "stop": ""}', "stop"),
            ("/tokenize", '{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "messages"),
            (comp, '{"prompt": "a", "max_tokens": 0}', "max_tokens"),
            (comp, '{"prompt": "a", "max_tokens": 97}', "max_tokens"),
        ]
        for path, raw, param in cases:
            with self.subTest(body=raw):
                status, body = self.post(path, raw)
                self.assertEqual(status, 400, body)
                self.assertEqual(body["error"]["param"], param)
                self.assertNotIn("Input should", body["error"]["message"])
                self.assertIn(param, body["error"]["message"])
        with self.assertLogs("attention_kv_caceh.entrypoints.openai.api_server", logging.WARNING) as logs:
            status, body = self.post(comp, '{"prompt": "a", "max_tokens": 1, "frobnicate": 1, "zz": 2}')
        self.assertEqual(status, 200, body)
        self.assertEqual(len(logs.records), 1)
        self.assertIn("frobnicate", logs.output[0])
        self.assertIn("zz", logs.output[0])
        # a field refused by name is a 400 naming it, and is not also logged as an ignored field
        with self.assertLogs("attention_kv_caceh.entrypoints.openai.api_server", logging.WARNING) as logs:
            status, body = self.post(comp, '{"prompt": "a", "max_tokens": 1, "guided_json": {}, "zz": 2}')
        self.assertEqual((status, body["error"]["param"]), (400, "guided_json"))
        self.assertEqual(len(logs.records), 1)
        self.assertIn("zz", logs.output[0])
        self.assertNotIn("guided_json", logs.output[0])

    def test_tokenize_and_detokenize_accept_what_prompt_accepts(self) -> None:
        status, one = self.post("/tokenize", {"prompt": "ab cd", "add_special_tokens": False})
        self.assertEqual(status, 200)
        status, many = self.post("/tokenize", {"prompt": ["ab", " cd"], "add_special_tokens": False})
        self.assertEqual(many["tokens"], self.tok.encode("ab", False) + self.tok.encode(" cd", False))
        status, ids = self.post("/tokenize", {"prompt": [[5, 6], [7]]})
        self.assertEqual(ids["tokens"], [5, 6, 7])
        status, text = self.post("/detokenize", {"tokens": [[5, 6], [7]]})
        self.assertEqual(text["prompt"], [self.tok.decode([5, 6]), self.tok.decode([7])])
        status, err = self.post("/detokenize", {"tokens": [[5, 600]]})
        self.assertEqual((status, err["error"]["param"]), (400, "tokens"))
        self.assertEqual(self.post("/detokenize", {"tokens": one["tokens"]})[1]["prompt"], "ab cd")


class KVPoolTooSmallTest(_Checkpoint):
    def test_a_request_that_can_never_fit_the_kv_pool_is_a_400_up_front(self) -> None:
        _core, llm = self.async_llm(num_kv_blocks=4)  # 16 positions
        app = build_app(llm, Tokenizer.load(self.folder), MODEL, 96)
        with ServerThread(app) as server:
            body = {"prompt": [5] * 10, "max_tokens": 8, "stream": True}
            status, err = request("POST", server.base_url + "/v1/completions", json=body)
            self.assertEqual((status, err["error"]["param"]), (400, "max_tokens"))
            status, ok = request("POST", server.base_url + "/v1/completions", json={**body, "max_tokens": 7})
            self.assertEqual(status, 200, ok)


if __name__ == "__main__":
    unittest.main()
