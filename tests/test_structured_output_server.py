"""Structured outputs and tool calls through `serve`'s app, with the OpenAI SDK unchanged, on the real model.

The oracles: the SDK's own parsing (`chat.completions.parse` returns the Pydantic object, tool calls parse
into its types, streamed deltas accumulate into whole calls), `jsonschema` on every JSON output and every
tool call's arguments against the function's schema, and the 400s naming the field for what cannot be
served (a schema llguidance cannot compile is never answered unconstrained).
"""

from __future__ import annotations

import json
import re
import unittest
from typing import Any

import jsonschema
import openai
import pydantic

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.core import EngineCore
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.structured_output import StructuredOutputManager
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.chat_utils import load_chat_template
from attention_kv_caceh.entrypoints.openai.api_server import build_app
from attention_kv_caceh.model_executor.model import Model
from tests.serve_helpers import ServerThread

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    population: int = pydantic.Field(ge=0, le=10**8)


def _ask(question: str) -> list[Any]:
    return [{"role": "user", "content": question}]


class StructuredServerTest(unittest.TestCase):
    server: ServerThread
    client: openai.OpenAI
    app: Any

    @classmethod
    def setUpClass(cls) -> None:
        model = Model.load("smollm2", "float32")
        tokenizer = Tokenizer.load("smollm2")
        cfg = EngineConfig(num_kv_blocks=96, max_num_seqs=4)
        runner = ModelRunner(model, cfg, 96)
        eos = tokenizer.eos_token_id
        assert eos is not None
        core = EngineCore(
            cfg,
            runner,
            num_blocks=96,
            max_model_len=512,
            eos_token_id=eos,
            structured_output_manager=StructuredOutputManager(tokenizer.backend_json(), [eos]),
        )
        llm = AsyncLLM.from_engine_core(core, tokenizer)
        cls.app = build_app(
            llm,
            tokenizer,
            "smollm2",
            512,
            chat_template=load_chat_template("smollm2"),
            enable_auto_tool_choice=True,
            tool_call_parser="hermes",
        )
        cls.server = ServerThread(cls.app).__enter__()
        cls.client = openai.OpenAI(
            base_url=cls.server.base_url + "/v1", api_key="none", max_retries=0, timeout=120
        )

    @classmethod
    def tearDownClass(cls) -> None:
        cls.server.__exit__(None, None, None)

    def chat(self, **kw: Any) -> Any:
        kw.setdefault("model", "smollm2")
        kw.setdefault("temperature", 0)
        return self.client.chat.completions.create(**kw)

    def test_parse_with_a_pydantic_model_returns_the_object(self) -> None:
        reply = self.client.chat.completions.parse(
            model="smollm2",
            messages=_ask("Name a large city and its population."),
            response_format=City,
            max_tokens=48,
            temperature=0,
        )
        parsed = reply.choices[0].message.parsed
        self.assertIsInstance(parsed, City)

    def test_json_schema_streamed_and_not_and_n_validate(self) -> None:
        schema = {
            "type": "object",
            "properties": {"colors": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}},
            "required": ["colors"],
            "additionalProperties": False,
        }
        fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
        reply = self.chat(
            messages=_ask("Some colors?"), response_format=fmt, max_tokens=40, n=2, temperature=1, seed=3
        )
        self.assertEqual(len(reply.choices), 2)
        for choice in reply.choices:
            self.assertEqual(choice.finish_reason, "stop")
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
        stream = self.chat(messages=_ask("Some colors?"), response_format=fmt, max_tokens=40, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        jsonschema.validate(json.loads(text), schema)
        completion = self.client.completions.create(
            model="smollm2",
            prompt="Colors:",
            max_tokens=40,
            temperature=0,
            extra_body={"response_format": fmt},
        )
        jsonschema.validate(json.loads(completion.choices[0].text), schema)

    def test_structured_outputs_choice_and_regex(self) -> None:
        reply = self.chat(
            messages=_ask("Is water wet?"),
            max_tokens=8,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        self.assertIn(reply.choices[0].message.content, ("yes", "no"))
        reply = self.chat(
            messages=_ask("A date?"),
            max_tokens=16,
            logprobs=True,
            extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}},
        )
        self.assertIsNotNone(re.fullmatch(r"20[0-9]{2}-[01][0-9]", reply.choices[0].message.content or ""))
        self.assertIsNotNone(reply.choices[0].logprobs)

    def test_what_cannot_be_served_is_a_400_naming_the_field(self) -> None:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs"),
            ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs"),
            ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs"),
            ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
            ({"structured_outputs": {}}, "structured_outputs"),
            (
                {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                "structured_outputs",
            ),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
            ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens"),
            ({"guided_json": {"type": "object"}}, "guided_json"),
        ]
        for extra, param in cases:
            with self.subTest(extra=extra), self.assertRaises(openai.BadRequestError) as ctx:
                self.chat(messages=_ask("hi"), max_tokens=4, extra_body=extra)
            body: Any = ctx.exception.body
            self.assertEqual(body.get("param"), param, body)

    def check_calls(self, calls: Any, names: set[str]) -> None:
        self.assertTrue(calls)
        for call in calls:
            self.assertIn(call.function.name, names)
            self.assertTrue(call.id)
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    def test_tool_choice_named_and_required_streamed_and_not(self) -> None:
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice, names in ((named, {"get_weather"}), ("required", {"get_weather", "get_time"})):
            with self.subTest(tool_choice=choice):
                reply = self.chat(
                    messages=_ask("Weather in Paris?"),
                    tools=[WEATHER, TIME],
                    tool_choice=choice,
                    max_tokens=60,
                )
                self.assertEqual(reply.choices[0].finish_reason, "tool_calls")
                self.check_calls(reply.choices[0].message.tool_calls, names)
                stream = self.chat(
                    messages=_ask("Weather in Paris?"),
                    tools=[WEATHER, TIME],
                    tool_choice=choice,
                    max_tokens=60,
                    stream=True,
                )
                calls: dict[int, dict[str, str]] = {}
                reasons: list[str] = []
                for chunk in stream:
                    for c in chunk.choices:
                        if c.finish_reason:
                            reasons.append(c.finish_reason)
                        for d in c.delta.tool_calls or []:
                            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                            if d.id:
                                entry["id"] = d.id
                            if d.function is not None:
                                entry["name"] += d.function.name or ""
                                entry["arguments"] += d.function.arguments or ""
                self.assertEqual(reasons, ["tool_calls"])
                for entry in calls.values():
                    self.assertIn(entry["name"], names)
                    self.assertTrue(entry["id"])
                    jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])

    def test_auto_is_served_with_the_flags_and_refused_without(self) -> None:
        reply = self.chat(
            messages=_ask("Weather in Paris?"), tools=[WEATHER], tool_choice="auto", max_tokens=24
        )
        message = reply.choices[0].message
        self.assertTrue(message.content or message.tool_calls)
        chat = self.app.state.openai_serving_chat
        chat.configure_tools(False, None)
        try:
            with self.assertRaises(openai.BadRequestError) as ctx:
                self.chat(messages=_ask("hi"), tools=[WEATHER], max_tokens=4)
            self.assertIn("--enable-auto-tool-choice", str(ctx.exception))
        finally:
            chat.configure_tools(True, "hermes")
        with self.assertRaises(openai.BadRequestError):
            self.chat(messages=_ask("hi"), tool_choice="required", max_tokens=4)

    def test_a_second_turn_with_the_tool_result_continues(self) -> None:
        messages: list[Any] = _ask("Weather in Paris?")
        first = self.chat(messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=60)
        call = first.choices[0].message.tool_calls[0]
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'})
        second = self.chat(messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=16)
        self.assertTrue(second.choices[0].message.content)
        self.assertFalse(second.choices[0].message.tool_calls)


if __name__ == "__main__":
    unittest.main()
