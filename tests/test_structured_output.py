"""Structured outputs in the engine (engine/structured_output/): every output satisfies its constraint.

The oracles: `jsonschema` validates each JSON output against its schema, `re.fullmatch` each regex output,
the choice list holds each choice output, llguidance's own matcher accepts each Lark output; the mask an
engine step applies equals, token by token over the whole vocabulary, what the matcher accepts; greedy
tokens under a grammar are the same with n-gram drafts as without. On the real model (SmolLM2-135M), loaded
once for the module; a few tokens per request.
"""

from __future__ import annotations

import json
import re
import unittest
from typing import Any

import jsonschema
import llguidance
import numpy as np

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.outputs import EngineCoreRequest
from attention_kv_caceh.engine.request import Request, SamplingParams
from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig
from attention_kv_caceh.engine.structured_output import StructuredOutputManager, StructuredOutputsParams
from attention_kv_caceh.engine.structured_output.backend_guidance import (
    GrammarCompileError,
    build_llg_tokenizer,
    compile_grammar,
)
from attention_kv_caceh.engine.structured_output.utils import allowed_tokens, apply_token_bitmask
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.chat_utils import load_chat_template
from attention_kv_caceh.model_executor.model import Model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def json_params(schema: dict[str, Any], **kw: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps(schema), **kw)


class ParamsTest(unittest.TestCase):
    def test_exactly_one_kind(self) -> None:
        with self.assertRaisesRegex(ValueError, "none are specified"):
            StructuredOutputsParams()
        with self.assertRaisesRegex(ValueError, "multiple are specified: json, regex"):
            StructuredOutputsParams(json="{}", regex="a")
        with self.assertRaisesRegex(ValueError, "not valid JSON"):
            StructuredOutputsParams(json="{")
        with self.assertRaisesRegex(ValueError, "choice"):
            StructuredOutputsParams(choice=())
        self.assertEqual(StructuredOutputsParams(choice=("a",)).kind, "choice")

    def test_min_tokens_is_refused_with_a_constraint(self) -> None:
        with self.assertRaisesRegex(ValueError, "min_tokens"):
            SamplingParams(min_tokens=1, structured_outputs=StructuredOutputsParams(regex="a"))

    def test_the_mask_forbids_what_its_bits_say_and_ids_past_it(self) -> None:
        words = np.zeros(2, dtype=np.uint32)  # 64 ids
        words[0] = (1 << 3) | (1 << 31)
        words[1] = 1 << 0  # id 32
        mask = words.view(np.int32)
        row = np.arange(70, dtype=np.float32)
        out = apply_token_bitmask(row, mask)
        self.assertEqual(list(np.flatnonzero(np.isfinite(out))), [3, 31, 32])
        self.assertEqual(list(np.flatnonzero(allowed_tokens(mask, 70))), [3, 31, 32])
        with self.assertRaisesRegex(ValueError, "no token"):
            apply_token_bitmask(row, np.zeros(3, dtype=np.int32))


class RealModelStructuredTest(unittest.TestCase):
    model: Model
    tokenizer: Tokenizer
    lltok: llguidance.LLTokenizer

    @classmethod
    def setUpClass(cls) -> None:
        cls.model = Model.load("smollm2", "float32")
        cls.tokenizer = Tokenizer.load("smollm2")
        cls.lltok = build_llg_tokenizer(cls.tokenizer.backend_json(), [2])

    def engine(self, **config: Any) -> LLMEngine:
        cfg = EngineConfig(num_kv_blocks=96, **config)
        assert cfg.num_kv_blocks is not None
        runner = ModelRunner(self.model, cfg, cfg.num_kv_blocks)
        return LLMEngine(
            cfg,
            runner,
            self.tokenizer,
            num_blocks=cfg.num_kv_blocks,
            max_model_len=512,
            extra_eos_token_ids=self.model.config.eos_token_ids,
        )

    def prompt(self, question: str) -> list[int]:
        template = load_chat_template("smollm2")
        assert template is not None
        text = template.render([{"role": "user", "content": question}])
        return self.tokenizer.encode(text, add_special_tokens=False)

    def run_one(self, engine: LLMEngine, question: str, so: StructuredOutputsParams, **kw: Any) -> str:
        params = SamplingParams(max_tokens=kw.pop("max_tokens", 48), structured_outputs=so, **kw)
        (out,) = engine.generate([self.prompt(question)], params)
        return self.tokenizer.decode(out)

    def test_json_schema_regex_choice_and_lark_outputs_satisfy_their_constraint(self) -> None:
        engine = self.engine()
        text = self.run_one(engine, "Describe a person as JSON.", json_params(PERSON), max_tokens=40)
        jsonschema.validate(json.loads(text), PERSON)
        text = self.run_one(
            engine, "Is the sky blue?", StructuredOutputsParams(choice=("yes", "no", "maybe"))
        )
        self.assertIn(text, ("yes", "no", "maybe"))
        pattern = r"[A-Z][a-z]{1,8}, [0-9]{1,3}"
        text = self.run_one(engine, "Name a city and a number.", StructuredOutputsParams(regex=pattern))
        self.assertIsNotNone(re.fullmatch(pattern, text), text)
        lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
        text = self.run_one(engine, "Write a sum.", StructuredOutputsParams(grammar=lark), max_tokens=24)
        matcher = llguidance.LLMatcher(self.lltok, llguidance.grammar_from("lark", lark), log_level=0)
        self.assertEqual(
            matcher.validate_tokens(self.tokenizer.encode(text, add_special_tokens=False)),
            len(self.tokenizer.encode(text, add_special_tokens=False)),
        )
        self.assertIsNotNone(re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text)

    def test_json_object_without_whitespace_and_with_bounded_runs(self) -> None:
        engine = self.engine()
        compact_so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
        params = SamplingParams(max_tokens=64, structured_outputs=compact_so)
        (out,) = engine.generate([self.prompt("Give a JSON object.")], params)
        compact = self.tokenizer.decode(out)
        if len(out) < 64:  # finished: a whole object; cut by max_tokens: a prefix of one
            self.assertIsInstance(json.loads(compact), dict)
        self.assertTrue(compact.startswith("{"), compact)
        self.assertIsNone(re.search(r"\s", _outside_strings(compact)), compact)
        loose = self.run_one(
            engine,
            "Give a JSON object.",
            StructuredOutputsParams(json_object=True, whitespace_pattern=r"[ \n]{0,2}"),
            max_tokens=48,
        )
        self.assertIsNone(re.search(r"\n\s{2,}|\s{3,}", _outside_strings(loose)), loose)

    def test_a_schema_that_does_not_compile_fails_that_request_alone(self) -> None:
        engine = self.engine()
        bad = SamplingParams(max_tokens=8, structured_outputs=json_params({"type": "strin"}))
        good = SamplingParams(max_tokens=4)
        prompt = self.prompt("Hello")
        engine.add_request("bad", prompt, bad)
        engine.add_request("good", prompt, good)
        reasons: dict[str, str | None] = {}
        core_outputs: list[Any] = []
        client = engine.engine_core_client
        while engine.has_unfinished_requests():
            outs = client.get_output()
            core_outputs.extend(outs.outputs)
        for out in core_outputs:
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        self.assertEqual(reasons, {"bad": "rejected", "good": "length"})
        error = next(o.error for o in core_outputs if o.request_id == "bad")
        self.assertIn("strin", error)
        with self.assertRaises(GrammarCompileError):
            compile_grammar(StructuredOutputsParams(regex="(?<=a)b"), self.lltok)

    def test_a_grammar_the_engine_gives_up_on_in_a_step_fails_that_request_alone(self) -> None:
        # 3,000 choices compile, but llguidance refuses a parser row of more than 2,000 items when the
        # first token is accepted (ParserTooComplex): that request fails, the step's others run on
        engine = self.engine()
        many = tuple("x" * (i + 1) for i in range(3000))
        prompt = self.prompt("Hello")
        engine.add_request(
            "big",
            prompt,
            SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=many)),
        )
        engine.add_request("plain", prompt, SamplingParams(max_tokens=6))
        core_outputs: list[Any] = []
        client = engine.engine_core_client
        while engine.has_unfinished_requests():
            core_outputs.extend(client.get_output().outputs)
        reasons = {o.request_id: o.finish_reason for o in core_outputs if o.finished}
        self.assertEqual(reasons, {"big": "error", "plain": "length"})
        plain_tokens = sum(len(o.new_token_ids) for o in core_outputs if o.request_id == "plain")
        self.assertEqual(plain_tokens, 6)
        error = next(o.error for o in core_outputs if o.request_id == "big")
        self.assertIn("grammar", error or "")

    def test_the_step_mask_is_what_the_matcher_accepts_token_by_token(self) -> None:
        so = json_params(PERSON)
        manager = StructuredOutputManager(self.tokenizer.backend_json(), [2])
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=so))
        manager.grammar_init(request)
        assert request.structured_output_request is not None and request.structured_output_request.future
        grammar = request.structured_output_request.future.result()
        prefix = self.tokenizer.encode('{"name": "Al', add_special_tokens=False)
        self.assertTrue(grammar.accept_tokens(prefix))
        bitmask = np.full((1, (self.lltok.vocab_size + 31) // 32), -1, dtype=np.int32)
        grammar.fill_bitmask(bitmask, 0)
        mask = allowed_tokens(bitmask[0], self.lltok.vocab_size)
        oracle = llguidance.LLMatcher(
            self.lltok, llguidance.grammar_from("json", json.dumps(PERSON)), log_level=0
        )
        # the oracle: a fresh matcher of the schema with llguidance's default options agrees on the
        # string-interior position, where whitespace options play no part
        self.assertTrue(oracle.consume_tokens(prefix))
        accepted = np.array(
            [oracle.validate_tokens([t]) == 1 for t in range(self.lltok.vocab_size)], dtype=bool
        )
        np.testing.assert_array_equal(mask, accepted)
        self.assertLess(mask.sum(), self.lltok.vocab_size)
        manager.shutdown()

    def test_drafts_are_cut_at_the_first_token_the_grammar_rejects(self) -> None:
        manager = StructuredOutputManager(self.tokenizer.backend_json(), [2])
        so = StructuredOutputsParams(regex=r"ab+c")
        request = Request("r", [1], SamplingParams(max_tokens=8, structured_outputs=so))
        manager.grammar_init(request)
        assert request.structured_output_request is not None and request.structured_output_request.future
        request.structured_output_request.future.result()
        a, b, c, x = (self.tokenizer.encode(s, add_special_tokens=False)[0] for s in "abcx")
        self.assertEqual(manager.validate_draft_tokens(request, [a, b, b, x, c]), [a, b, b])
        self.assertEqual(manager.validate_draft_tokens(request, [x]), [])
        manager.shutdown()

    def test_greedy_tokens_under_a_grammar_are_the_same_with_and_without_drafts(self) -> None:
        schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 6, "maxItems": 6}
        so = json_params(schema, disable_any_whitespace=True)
        prompts = [self.prompt('List colors as JSON: ["red","red","green","red","red","green"]')]
        params = SamplingParams(max_tokens=40, structured_outputs=so)
        plain = self.engine().generate(prompts, params)
        spec_engine = self.engine(speculative_config=SpeculativeConfig(4, 1, 3))
        drafted = spec_engine.generate(prompts, params)
        self.assertEqual(drafted, plain)
        jsonschema.validate(json.loads(self.tokenizer.decode(plain[0])), schema)
        stats = [s.spec_decoding for s in spec_engine.step_stats if s.spec_decoding is not None]
        self.assertGreater(sum(s.num_draft_tokens for s in stats), 0)  # drafts were verified

    def test_the_request_stops_when_its_grammar_is_complete(self) -> None:
        engine = self.engine()
        params = SamplingParams(
            max_tokens=30, ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=("yes", "no"))
        )
        (out,) = engine.generate([self.prompt("Yes or no?")], params)
        self.assertIn(self.tokenizer.decode(out), ("yes", "no"))
        self.assertLess(len(out), 30)

    def test_a_structural_tag_constrains_the_tagged_segment_only(self) -> None:
        tag = {
            "structures": [
                {
                    "begin": "<function=f>",
                    "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    "end": "</function>",
                }
            ],
            "triggers": ["<function="],
        }
        grammar = compile_grammar(StructuredOutputsParams(structural_tag=json.dumps(tag)), self.lltok)
        good = self.tokenizer.encode('Sure. <function=f>{"a": 1}</function> done', add_special_tokens=False)
        self.assertEqual(grammar.validate_tokens(good), good)
        bad = self.tokenizer.encode('Sure. <function=f>{"a": "x"}', add_special_tokens=False)
        self.assertLess(len(grammar.validate_tokens(bad)), len(bad))
        with self.assertRaises(GrammarCompileError):
            compile_grammar(StructuredOutputsParams(structural_tag='{"structures": []}'), self.lltok)

    def test_core_requests_carry_the_params_over_msgpack(self) -> None:
        import msgspec

        so = json_params(PERSON, disable_any_whitespace=True)
        req = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=so))
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
        self.assertEqual(back.sampling_params.structured_outputs, so)


def _outside_strings(text: str) -> str:
    """`text` with the contents of JSON strings removed (whitespace inside a string is the model's), an
    unterminated last string included."""
    closed = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return re.sub(r'"(?:[^"\\]|\\.)*$', '"', closed)  # a string cut by max_tokens


if __name__ == "__main__":
    unittest.main()
