"""Speculative decoding through the real model, the front end, the server and the CLI.

Oracles: the runner's logits at a request's last token and each draft, computed in one flattened batch,
against the logits of the same positions computed one token per step (float64); the engine's greedy
tokens with and without speculation on a random checkpoint; a stop string inside a multi-token output
cuts the tokens where one token per step would have; the server's spec-decode counters against the
engine core's own step counts; `generate`'s acceptance line against its trace.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any

import numpy as np
import openai

from attention_kv_caceh import cli
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.core import EngineCoreOutput, EngineCoreOutputs
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.output_processor import OutputProcessor, RequestDelta
from attention_kv_caceh.engine.request import Request, SamplingParams
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig
from attention_kv_caceh.engine.spec_decode.metrics import SpecDecodingStats
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.engine_fakes import CharTokenizer, copy_letter_logits, expected_text
from tests.serve_helpers import MODEL, fake_server
from tests.test_engine_server import scrape

TOK = CharTokenizer()


def spec(k: int = 4, lo: int = 1, hi: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(k, lo, hi, ((1, 64, k),))


class TestRealModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.path = write_random_checkpoint(Path(cls._tmp.name) / "llama", "llama", "tiny")

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def test_logits_at_every_draft_position_equal_one_token_per_step(self) -> None:
        model = Model.load(self.path, "float64")
        config = EngineConfig(block_size=4, num_kv_blocks=64, dtype="float64")
        tokens = [5, 9, 13, 5, 9, 13, 5, 9, 21, 40, 41]
        drafts = [13, 5, 9]

        def step(runner: ModelRunner, reqs: list[tuple[Request, int, list[int]]]) -> np.ndarray:
            for r, n, _ in reqs:
                r.block_ids = list(range(int(r.request_id) * 8, int(r.request_id) * 8 + 8))
                assert n >= 1
            out = SchedulerOutput(
                scheduled_requests=[r for r, _, _ in reqs],
                num_scheduled_tokens={r.request_id: n for r, n, _ in reqs},
                total_num_scheduled_tokens=sum(n for _, n, _ in reqs),
                num_prefill_tokens=0,
                num_decode_tokens=0,
                scheduled_spec_decode_tokens={r.request_id: d for r, _, d in reqs if d},
                num_computed_tokens={r.request_id: r.num_computed_tokens for r, _, _ in reqs},
            )
            return runner.execute_model(out)

        # one token per step: the reference rows, from a fresh cache each time (full recompute)
        reference = []
        for end in range(len(tokens), len(tokens) + len(drafts) + 1):
            r = Request("0", (tokens + drafts)[:end], SamplingParams())
            reference.append(step(ModelRunner(model, config, 64), [(r, end, [])])[0])
        for other_prefill in (False, True):  # the verify-only layout, and the one shared with a prefill
            with self.subTest(other_prefill=other_prefill):
                runner = ModelRunner(model, config, 64)
                r = Request("0", tokens, SamplingParams())
                step(runner, [(r, len(tokens) - 1, [])])  # the context's K/V, but the last token's
                r.num_computed_tokens = len(tokens) - 1
                batch = [(r, 1 + len(drafts), drafts)]
                if other_prefill:
                    batch.append((Request("1", [7, 8, 9, 10, 11], SamplingParams()), 5, []))
                else:
                    other = Request("1", [7, 8, 9, 10, 11], SamplingParams())
                    step(runner, [(other, 4, [])])
                    other.num_computed_tokens = 4
                    batch.append((other, 1, []))
                logits = step(runner, batch)
                self.assertEqual(logits.shape[0], len(drafts) + 2)
                np.testing.assert_allclose(logits[: len(drafts) + 1], np.array(reference), rtol=0, atol=1e-9)

    def test_greedy_tokens_equal_without_speculation(self) -> None:
        prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [30, 31, 30, 31, 30], [7] * 6, list(range(40, 60))]
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        for dtype in ("float64", "float32"):
            with self.subTest(dtype=dtype):
                base = EngineConfig(
                    max_num_seqs=3, max_num_batched_tokens=12, block_size=4, num_kv_blocks=40, dtype=dtype
                )
                plain = LLMEngine.from_pretrained(str(self.path), base).generate(prompts, params)
                engine = LLMEngine.from_pretrained(
                    str(self.path), EngineConfig(**{**base.__dict__, "speculative_config": spec(4, 1, 3)})
                )
                self.assertEqual(engine.generate(prompts, params), plain)
                accepted = sum(
                    s.spec_decoding.num_accepted_tokens for s in engine.step_stats if s.spec_decoding
                )
                self.assertGreater(accepted, 0)  # the random model repeats itself: drafts were kept


class TestOutputProcessor(unittest.TestCase):
    def test_a_stop_string_inside_a_multi_token_output_cuts_the_tokens_after_it(self) -> None:
        for include in (False, True):
            with self.subTest(include_stop_str_in_output=include):
                processor = OutputProcessor(TOK)
                params = SamplingParams(
                    max_tokens=20, stop=("cd",), include_stop_str_in_output=include, logprobs=0
                )
                processor.add_request("a", 2, params, 0.0)
                ids = TOK.encode("abcdef")
                payloads = [[[t, -1.0, 1, []], None] for t in ids]
                out = processor.process_outputs(
                    EngineCoreOutputs([EngineCoreOutput("a", ids, None, new_logprobs=payloads)]), 1.0
                )
                _, delta = out.deliveries[0]
                assert isinstance(delta, RequestDelta)
                self.assertEqual(delta.text, "abcd" if include else "ab")
                self.assertEqual((delta.finished, delta.finish_reason), (True, "stop"))
                self.assertEqual(delta.new_token_ids, tuple(TOK.encode("abcd")))  # 'd' completed the stop
                self.assertEqual(delta.num_output_tokens, 4)
                self.assertEqual(len(delta.new_logprobs or []), 4)
                self.assertEqual(out.stats.num_generation_tokens, 4)
                self.assertEqual(out.reqs_to_abort, ["a"])


class TestServer(unittest.TestCase):
    def test_streams_are_unchanged_and_the_counters_are_the_cores(self) -> None:
        config = spec(3, 1, 2)
        thread, engine, _llm = fake_server(max_num_seqs=4, speculative_config=config)
        prompts = ["abcabcabcab", "xyxyxyxy", "hello hello hello"]
        with thread, openai.OpenAI(base_url=thread.base_url + "/v1", api_key="x", max_retries=0) as oai:
            before = scrape(thread.base_url)
            for p in prompts:
                answer = oai.completions.create(model=MODEL, prompt=p, max_tokens=30)
                self.assertEqual(answer.choices[0].text, expected_text(TOK.encode(p), 30))
            after = scrape(thread.base_url)
        total = SpecDecodingStats(3)
        for s in engine.step_stats:
            if s.spec_decoding is not None:
                total.add(s.spec_decoding)
        self.assertGreater(total.num_drafts, 0)

        def delta(name: str) -> float:
            return after[name] - before.get(name, 0.0)

        self.assertEqual(before["vllm:spec_decode_num_drafts_total{}"], 0)  # exported from the start
        self.assertEqual(delta("vllm:spec_decode_num_drafts_total{}"), total.num_drafts)
        self.assertEqual(delta("vllm:spec_decode_num_draft_tokens_total{}"), total.num_draft_tokens)
        self.assertEqual(delta("vllm:spec_decode_num_accepted_tokens_total{}"), total.num_accepted_tokens)
        for pos in range(3):
            name = f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}"
            self.assertEqual(delta(name), total.num_accepted_tokens_per_pos[pos])
        self.assertEqual(delta("vllm:generation_tokens_total{}"), 30 * len(prompts))

    def test_n_and_stop_strings_keep_their_meaning(self) -> None:
        """A copying letter model: the drafts are accepted, so the stop string "fg" is completed inside a
        multi-token step and the tokens after it must go, as with one token per step."""
        thread, engine, _llm = fake_server(
            max_num_seqs=4, speculative_config=spec(4, 1, 2), logits_fn=copy_letter_logits
        )
        prompt = "abcdefghabcdefgh"
        with thread, openai.OpenAI(base_url=thread.base_url + "/v1", api_key="x", max_retries=0) as oai:
            answer = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=40, n=2, stop=["fg"])
            streamed = "".join(
                chunk.choices[0].text
                for chunk in oai.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=40, stop=["fg"], stream=True
                )
                if chunk.choices
            )
            full = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
        self.assertEqual(full.choices[0].text, "abcdefghabcdefghabcd")  # the model copies
        self.assertEqual([c.text for c in answer.choices], ["abcde", "abcde"])
        self.assertEqual([c.finish_reason for c in answer.choices], ["stop", "stop"])
        assert answer.usage is not None
        self.assertEqual(answer.usage.completion_tokens, 2 * len("abcdefg"))  # up to the stop's last token
        self.assertEqual(streamed, "abcde")
        accepted = sum(s.spec_decoding.num_accepted_tokens for s in engine.step_stats if s.spec_decoding)
        self.assertGreater(accepted, 0)

    def test_no_spec_decode_metrics_without_speculation(self) -> None:
        thread, _engine, _llm = fake_server(max_num_seqs=1)
        with thread:
            names = scrape(thread.base_url)
        self.assertFalse(any(n.startswith("vllm:spec_decode") for n in names))


def quietly(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


class TestGenerateCli(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        cls.model = str(write_random_checkpoint(cls.root / "m", "llama", "tiny"))

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def test_draft_columns_acceptance_line_and_trace(self) -> None:
        trace = self.root / "steps.jsonl"
        config = (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
        )
        argv = [
            "generate",
            "--model",
            self.model,
            "--max-tokens",
            "20",
            "--ignore-eos",
            "--prompt",
            "a b a b a b a b",
        ]
        code, plain_out, _ = quietly([*argv, "--output", str(self.root / "plain.jsonl")])
        self.assertEqual(code, 0)
        self.assertNotIn("draft/acc", plain_out)
        code, out, err = quietly(
            [
                *argv,
                "--speculative-config",
                config,
                "--trace",
                str(trace),
                "--output",
                str(self.root / "spec.jsonl"),
            ]
        )
        self.assertEqual(code, 0, err)
        self.assertIn("draft/acc", out)
        steps: list[dict[str, Any]] = [json.loads(line) for line in trace.read_text().splitlines()]
        drafted = sum(s["spec_decoding"]["num_draft_tokens"] for s in steps if s["spec_decoding"])
        accepted = sum(s["spec_decoding"]["num_accepted_tokens"] for s in steps if s["spec_decoding"])
        self.assertGreater(drafted, 0)
        self.assertIn(f"{drafted} draft tokens, {accepted} accepted", out)
        texts = [json.loads((self.root / f"{n}.jsonl").read_text())["token_ids"] for n in ("plain", "spec")]
        self.assertEqual(texts[0], texts[1])

    def test_bad_speculative_configs_exit_2_with_one_line(self) -> None:
        for config, message in (
            ('{"method": "suffix", "num_speculative_tokens": 2}', "'suffix' is not available"),
            ('{"method": "ngram"}', "num_speculative_tokens must be provided"),
            ('{"method": "ngram", "num_speculative_tokens": -1}', "greater than zero"),
            ("ngram", "not valid JSON"),
        ):
            with self.subTest(config=config):
                code, _, err = quietly(
                    [
                        "generate",
                        "--model",
                        self.model,
                        "--max-tokens",
                        "2",
                        "--prompt",
                        "x",
                        "--speculative-config",
                        config,
                    ]
                )
                self.assertEqual(code, 2)
                self.assertIn(message, err)
                self.assertEqual(len(err.strip().splitlines()), 1)


if __name__ == "__main__":
    unittest.main()
