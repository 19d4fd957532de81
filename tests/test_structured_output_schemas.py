"""Hypothesis-generated JSON schemas on the real model: every output validates against its schema.

Schemas of objects (required and optional fields, no extra properties), arrays, enums, nesting, strings
with a pattern or a length bound, integers and numbers with bounds, booleans; each is compiled by the
engine's llguidance backend and decoded greedily on SmolLM2-135M, and `jsonschema` is the oracle. The
examples are derandomized (the same schemas on every run) and few, so the module stays fast.
"""

from __future__ import annotations

import json
import unittest
from typing import Any

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.structured_output import StructuredOutputsParams
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.chat_utils import load_chat_template
from attention_kv_caceh.model_executor.model import Model

_NAMES = st.sampled_from(["id", "name", "size", "tags", "ok", "color", "items", "score"])


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    number = st.integers(-10, 10).map(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 5})
    enum = st.lists(
        st.sampled_from(["red", "green", "blue", "x", "yes"]), min_size=1, max_size=3, unique=True
    ).map(lambda vs: {"enum": vs})
    pattern = st.sampled_from(["^[a-z]{1,6}$", "^[A-Z][0-9]{2}$", "^(ab|cd)+$"]).map(
        lambda p: {"type": "string", "pattern": p}
    )
    bounded = st.integers(1, 10).map(lambda n: {"type": "string", "maxLength": n})
    return st.one_of(integer, number, enum, pattern, bounded, st.just({"type": "boolean"}))


def _containers(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    array = st.tuples(children, st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}
    )

    def obj(fields: dict[str, dict[str, Any]], required: list[bool]) -> dict[str, Any]:
        names = sorted(fields)
        return {
            "type": "object",
            "properties": fields,
            "required": [n for n, r in zip(names, required, strict=False) if r],
            "additionalProperties": False,
        }

    objects = st.builds(
        obj, st.dictionaries(_NAMES, children, min_size=1, max_size=3), st.lists(st.booleans(), max_size=3)
    )
    return st.one_of(array, objects)


SCHEMAS = st.recursive(_leaf(), _containers, max_leaves=5)


class GeneratedSchemaTest(unittest.TestCase):
    engine: LLMEngine
    tokenizer: Tokenizer
    prompt: list[int]

    @classmethod
    def setUpClass(cls) -> None:
        model = Model.load("smollm2", "float32")
        cls.tokenizer = Tokenizer.load("smollm2")
        cfg = EngineConfig(num_kv_blocks=64)
        runner = ModelRunner(model, cfg, 64)
        cls.engine = LLMEngine(
            cfg,
            runner,
            cls.tokenizer,
            num_blocks=64,
            max_model_len=512,
            extra_eos_token_ids=model.config.eos_token_ids,
        )
        template = load_chat_template("smollm2")
        assert template is not None
        text = template.render([{"role": "user", "content": "Answer with JSON."}])
        cls.prompt = cls.tokenizer.encode(text, add_special_tokens=False)

    @settings(
        max_examples=6,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(schema=SCHEMAS, compact=st.booleans())
    def test_every_output_validates_against_its_schema(self, schema: dict[str, Any], compact: bool) -> None:
        so = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=compact)
        params = SamplingParams(max_tokens=200, structured_outputs=so)
        (out,) = self.engine.generate([self.prompt], params)
        text = self.tokenizer.decode(out)
        jsonschema.validate(json.loads(text), schema)


if __name__ == "__main__":
    unittest.main()
