"""Exact prompt lengths: `--prompt-len N` gives N prompt tokens as the server counts them, with the
server's /tokenize or a local tokenizer.json, on both OpenAI backends; without either, the run says
once how far off the approximate lengths were. Requested and actual lengths are both recorded."""

from __future__ import annotations

import asyncio
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers

from attention_kv_caceh.harness.dataset import read_dataset
from attention_kv_caceh.harness.load import _WORDS, LengthRange  # pyright: ignore[reportPrivateUsage]
from attention_kv_caceh.harness.run import (
    BackendName,
    ContextLengthError,
    HarnessConfig,
    RunResult,
    run_harness,
)
from attention_kv_caceh.harness.scripted_server import (
    DONE,
    Script,
    ScriptedServer,
    Step,
    WordTokenizer,
    chat_chunk,
    timed_token_script,
)

BACKENDS: tuple[BackendName, ...] = ("openai-completions", "openai-chat")


def word_count(payload: dict[str, Any]) -> int:
    """Prompt tokens as a one-token-per-word server without BOS counts them."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list):
        return len(cast("list[Any]", prompt))
    if prompt is None:
        prompt = " ".join(m["content"] for m in payload["messages"])
    return len(str(prompt).split())


def tokenizing_server() -> ScriptedServer:
    """A server with /tokenize whose usage counts prompts with the same WordTokenizer (BOS included)."""
    tokenizer = WordTokenizer()
    server = ScriptedServer(
        lambda p, path: timed_token_script(0, 0, 2, prompt_tokens=tokenizer.prompt_tokens(p)), tokenizer=True
    )
    server.tokenizer = tokenizer
    return server


def word_level_tokenizer(folder: str, *, split_punctuation: bool = False) -> Tokenizer:
    """A word-level tokenizer.json in `folder` (one token per word of the synthetic prompts; with
    `split_punctuation`, punctuation marks are tokens of their own); returned too."""
    vocab = {w: i for i, w in enumerate(("[UNK]", *_WORDS, "hello", ",", "."))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    split = pre_tokenizers.Whitespace() if split_punctuation else pre_tokenizers.WhitespaceSplit()
    tok.pre_tokenizer = split  # pyright: ignore[reportAttributeAccessIssue]
    tok.save(str(Path(folder) / "tokenizer.json"))
    return tok


def config(url: str, backend: BackendName, **kw: Any) -> HarnessConfig:
    base: dict[str, Any] = {
        "backend": backend,
        "base_url": url,
        "num_requests": 6,
        "prompt_len": LengthRange(32, 32),
        "output_len": LengthRange(2, 2),
        "server_metrics_interval_s": 0,
    }
    return HarnessConfig(**(base | kw))


class ExactPromptTest(unittest.IsolatedAsyncioTestCase):
    def assert_exact(self, result: RunResult, payloads: list[dict[str, Any]], n: int) -> None:
        self.assertEqual(result.summary["failed"], 0, result.summary["failures"])
        for r in result.records:
            self.assertEqual((r.requested_prompt_tokens, r.prompt_tokens), (n, n))
        self.assertEqual(result.summary["prompt_tokens_off_pct"], 0.0)
        self.assertEqual(result.summary["prompt_lengths"], "exact")
        self.assertFalse(any("prompt" in w for w in result.summary["warnings"]))
        self.assertEqual(len(payloads), 1 + len(result.records))  # smoke test + measured

    async def test_server_tokenize_gives_exactly_n_prompt_tokens_on_both_backends(self) -> None:
        for backend in BACKENDS:
            with self.subTest(backend=backend):
                async with tokenizing_server() as server:
                    result = await run_harness(config(server.base_url, backend))
                    payloads = server.counters.payloads
                self.assert_exact(result, payloads, 32)
                self.assertTrue(str(result.summary["tokenizer_id"]).endswith("/tokenize"))
                if backend == "openai-completions":  # sent as token ids
                    self.assertEqual(len(payloads[-1]["prompt"]), 32)
                else:  # text whose 28 words and the 4 tokens of the chat template make 32
                    self.assertEqual(len(payloads[-1]["messages"][0]["content"].split()), 28)

    async def test_local_tokenizer_gives_exactly_n_prompt_tokens_on_both_backends(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            word_level_tokenizer(tmp)
            for backend in BACKENDS:
                with self.subTest(backend=backend):
                    script = lambda p, path: timed_token_script(0, 0, 2, prompt_tokens=word_count(p))  # noqa: E731
                    async with ScriptedServer(script) as server:
                        result = await run_harness(config(server.base_url, backend, tokenizer=tmp))
                        payloads = server.counters.payloads
                    self.assert_exact(result, payloads, 32)
                    self.assertEqual(result.summary["tokenizer_id"], tmp)

    async def test_a_local_tokenizer_is_not_exact_for_chat_when_the_server_counts_a_template(self) -> None:
        # the server's chat template adds 4 tokens that a tokenizer.json cannot know about
        with tempfile.TemporaryDirectory() as tmp:
            word_level_tokenizer(tmp)
            script = lambda p, path: timed_token_script(0, 0, 2, prompt_tokens=word_count(p) + 4)  # noqa: E731
            async with ScriptedServer(script) as server:
                result = await run_harness(config(server.base_url, "openai-chat", tokenizer=tmp))
        s = result.summary
        self.assertEqual(s["prompt_lengths"], "approximate")
        self.assertEqual([r.prompt_tokens for r in result.records], [36] * 6)  # the server's count
        self.assertEqual(sum("chat template" in w for w in s["warnings"]), 1, s["warnings"])

    async def test_a_chat_template_longer_than_the_requested_length_is_not_exact(self) -> None:
        # the server's template alone is 4 tokens: a 2-token chat prompt cannot be built
        async with tokenizing_server() as server:
            result = await run_harness(config(server.base_url, "openai-chat", prompt_len=LengthRange(2, 2)))
        s = result.summary
        self.assertEqual(s["failed"], 0, s["failures"])
        self.assertTrue(all(r.prompt_tokens is not None and r.prompt_tokens > 2 for r in result.records))
        self.assertEqual(s["prompt_lengths"], "approximate")
        self.assertEqual(sum("approximate" in w for w in s["warnings"]), 1, s["warnings"])

    async def test_a_local_chat_count_is_never_recorded_as_what_the_server_saw(self) -> None:
        # a chat server without usage: the length it saw is unknown, not the template-less local count
        with tempfile.TemporaryDirectory() as tmp:
            word_level_tokenizer(tmp)
            chunks = (Step(0, chat_chunk(role="assistant")), Step(0, chat_chunk("a")), Step(0, DONE))
            async with ScriptedServer(lambda p, path: Script(chunks)) as server:
                result = await run_harness(config(server.base_url, "openai-chat", tokenizer=tmp))
        self.assertEqual(result.summary["completed"], 6)
        self.assertEqual([r.prompt_tokens for r in result.records], [None] * 6)
        self.assertEqual(result.summary["prompt_lengths"], "approximate")

    async def test_without_a_tokenizer_the_run_says_how_far_off_the_lengths_were(self) -> None:
        # a server that counts a BOS besides the words: 33 tokens for 32 words (+3.1 %)
        script = lambda p, path: timed_token_script(0, 0, 2, prompt_tokens=word_count(p) + 1)  # noqa: E731
        async with ScriptedServer(script) as server:
            result = await run_harness(config(server.base_url, "openai-completions"))
        s = result.summary
        self.assertEqual(s["prompt_lengths"], "approximate")
        self.assertAlmostEqual(s["prompt_tokens_off_pct"], 100 / 32)
        self.assertEqual(sum("approximate" in w for w in s["warnings"]), 1)
        self.assertTrue(any("more than 2 % off" in w for w in s["warnings"]))
        self.assertEqual([r.prompt_tokens for r in result.records], [33] * 6)

    async def test_a_failed_request_does_not_record_the_requested_length_as_actual(self) -> None:
        async with ScriptedServer(lambda p, path: Script(status=500, body=b"no")) as server:
            result = await run_harness(config(server.base_url, "openai-completions", smoke_test=False))
        for r in result.records:
            self.assertEqual((r.requested_prompt_tokens, r.prompt_tokens), (32, None))
            self.assertIsNone(r.to_json()["prompt_tokens"])


class DatasetTest(unittest.IsolatedAsyncioTestCase):
    async def test_dataset_prompts_and_output_lengths_are_sent(self) -> None:
        rows = [{"prompt": f"the cache {i}", "output_len": i + 1} for i in range(4)]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "d.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            async with ScriptedServer(lambda p, path: timed_token_script(0, 0, 1)) as server:
                cfg = config(server.base_url, "openai-completions", num_requests=3, dataset=str(path))
                await run_harness(cfg)
                sent = server.counters.payloads[1:]
        self.assertEqual(sorted(p["prompt"] for p in sent), [r["prompt"] for r in rows[:3]])
        self.assertEqual(sorted(p["max_tokens"] for p in sent), [1, 2, 3])

    async def test_with_a_tokenizer_a_dataset_prompt_is_requested_at_its_token_count(self) -> None:
        # 3 words but 5 tokens each: the requested length is the tokenizer's count, not the word count
        rows = [{"prompt": "the cache, keys.", "output_len": 2} for _ in range(4)]
        with tempfile.TemporaryDirectory() as tmp:
            tok = word_level_tokenizer(tmp, split_punctuation=True)
            path = Path(tmp) / "d.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

            def script(payload: dict[str, Any], _path: str) -> Script:
                prompt = payload["prompt"]
                n = len(prompt) if isinstance(prompt, list) else len(tok.encode(prompt).ids)
                return timed_token_script(0, 0, 2, prompt_tokens=n)

            async with ScriptedServer(script) as server:
                cfg = config(
                    server.base_url, "openai-completions", num_requests=4, dataset=str(path), tokenizer=tmp
                )
                result = await run_harness(cfg)
        s = result.summary
        self.assertEqual([(r.requested_prompt_tokens, r.prompt_tokens) for r in result.records], [(5, 5)] * 4)
        self.assertEqual(s["prompt_tokens_off_pct"], 0.0)
        self.assertEqual(s["prompt_lengths"], "exact")
        self.assertFalse(any("prompt" in w for w in s["warnings"]), s["warnings"])

    def test_bad_dataset_lines_are_named(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "d.jsonl"
            for text, message in (
                ('{"prompt": "a"}\n{oops\n', "line 2: not JSON"),
                ('{"prompt": ""}\n', "non-empty string"),
                ('{"prompt": "a", "output_len": 0}\n', "output_len"),
                ("\n", "no entries"),
            ):
                path.write_text(text)
                with self.subTest(text=text), self.assertRaisesRegex(ValueError, message):
                    read_dataset(path)
        with self.assertRaisesRegex(ValueError, "^dataset: '/nonexistent/d.jsonl'"):
            HarnessConfig(dataset="/nonexistent/d.jsonl")
        with self.assertRaisesRegex(ValueError, "^tokenizer: '/nonexistent'"):
            HarnessConfig(tokenizer="/nonexistent")


class DatasetCheckedUpFrontTest(unittest.TestCase):
    def test_bad_dataset_contents_are_a_usage_error_before_any_request(self) -> None:
        import contextlib
        import io

        from attention_kv_caceh import cli

        with tempfile.TemporaryDirectory() as tmp:
            cases = {
                "not json": '{"prompt": "a"}\nnot json\n',
                "empty": "",
                "no prompt": '{"text": "a"}\n',
                "bad output_len": '{"prompt": "a", "output_len": 1.5}\n',
                "too few": '{"prompt": "a"}\n',
                "output_len over the cap": '{"prompt": "a", "output_len": 99999999}\n{"prompt": "b"}\n',
            }
            for name, text in cases.items():
                with self.subTest(name):
                    path = Path(tmp) / "d.jsonl"
                    path.write_text(text, encoding="utf-8")
                    out, err = io.StringIO(), io.StringIO()
                    argv = [
                        "harness",
                        "--backend",
                        "simulated",
                        "--num-requests",
                        "2",
                        "--dataset",
                        str(path),
                    ]
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                        code = cli.main(argv)
                    self.assertEqual(code, 2, err.getvalue())
                    self.assertEqual(len(err.getvalue().strip().splitlines()), 1, err.getvalue())
                    self.assertIn("--dataset", err.getvalue())
                    self.assertEqual(out.getvalue(), "")


class ContextServer(ScriptedServer):
    """A scripted server whose GET /v1/models gives a max_model_len, as vLLM's and serve's do."""

    def __init__(self, max_model_len: int) -> None:
        super().__init__(lambda p, path: timed_token_script(0, 0, 2))
        self.max_model_len = max_model_len

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": "scripted", "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})


class ContextLengthTest(unittest.IsolatedAsyncioTestCase):
    async def test_requests_beyond_the_servers_context_are_refused_before_any_is_sent(self) -> None:
        cases = {
            "--prompt-len": {"prompt_len": LengthRange(8, 64)},  # 64 >= 64: no room for an output token
            "--output-len": {"prompt_len": LengthRange(32, 32), "output_len": LengthRange(40, 40)},
        }
        for flag, kw in cases.items():
            with self.subTest(flag):
                async with ContextServer(64) as server:
                    with self.assertRaises(ContextLengthError) as caught:
                        await run_harness(config(server.base_url, "openai-completions", **kw))
                    self.assertEqual(server.counters.requests, 0)  # not even the smoke test
                self.assertIn(flag, str(caught.exception))
                self.assertIn("64", str(caught.exception))

    async def test_requests_that_fit_run(self) -> None:
        async with ContextServer(64) as server:
            cfg = config(server.base_url, "openai-completions", prompt_len=LengthRange(62, 62))
            result = await run_harness(cfg)
        self.assertEqual(result.summary["completed"], 6)

    async def test_a_counted_dataset_prompt_beyond_the_context_is_named(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            word_level_tokenizer(tmp)
            path = Path(tmp) / "d.jsonl"
            long = " ".join(["the"] * 70)
            path.write_text(json.dumps({"prompt": "the cache"}) + "\n" + json.dumps({"prompt": long}) + "\n")
            async with ContextServer(64) as server:
                cfg = config(
                    server.base_url, "openai-completions", num_requests=2, dataset=str(path), tokenizer=tmp
                )
                with self.assertRaisesRegex(ContextLengthError, "entry 2"):
                    await run_harness(cfg)
                self.assertEqual(server.counters.requests, 0)


class ContextLengthCliTest(unittest.TestCase):
    def test_the_cli_exits_2_with_one_line_naming_the_flag(self) -> None:
        import contextlib
        import io
        import threading

        from attention_kv_caceh import cli

        ready = threading.Event()
        stop: list[Any] = []
        urls: list[str] = []

        def serve() -> None:
            async def main() -> None:
                async with ContextServer(64) as server:
                    urls.append(server.base_url)
                    done = asyncio.Event()
                    stop.append((asyncio.get_running_loop(), done))
                    ready.set()
                    await done.wait()

            asyncio.run(main())

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            self.assertTrue(ready.wait(30))
            out, err = io.StringIO(), io.StringIO()
            argv = [
                "harness",
                "--backend",
                "openai-completions",
                "--base-url",
                urls[0],
                "--prompt-len",
                "100",
            ]
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main([*argv, "--server-metrics-interval", "0", "--temperature", "0"])
        finally:
            loop, done = stop[0]
            loop.call_soon_threadsafe(done.set)
            thread.join(30)
        self.assertEqual(code, 2, err.getvalue())
        self.assertEqual(len(err.getvalue().strip().splitlines()), 1, err.getvalue())
        self.assertIn("--prompt-len", err.getvalue())


if __name__ == "__main__":
    unittest.main()


class GGUFTokenizerTest(unittest.IsolatedAsyncioTestCase):
    async def test_a_gguf_tokenizer_encodes_synthetic_text_as_its_folders_tokenizer_json_does(self) -> None:
        from attention_kv_caceh.harness.prompts import LocalTokenizer
        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
        from tests.gguf_files import gguf_from_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            folder = write_random_checkpoint(Path(tmp) / "m", "llama", "tiny")
            gguf = gguf_from_checkpoint(folder, Path(tmp) / "m.gguf")
            text = " ".join(_WORDS[i % len(_WORDS)] for i in range(64))
            from_json, from_gguf = LocalTokenizer(folder), LocalTokenizer(gguf)
            for _ in range(2):  # the second time from the words' cached ids
                ids = await from_gguf.encode(text)
                self.assertEqual(ids, await from_json.encode(text))
                self.assertEqual(await from_gguf.decode(ids), text)
