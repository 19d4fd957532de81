"""The hermes tool parser and the tool-choice plans, against texts whose calls are known.

The oracle: the calls written into each text. Streamed, the deltas are fed in every split of the text
(one character at a time, and at random cut points) and must accumulate into the same calls and content
as the whole text parsed at once, with each call's id and name in its first delta.
"""

from __future__ import annotations

import json
import random
import unittest
from typing import Any

from attention_kv_caceh.entrypoints.openai.protocol import ChatCompletionRequest
from attention_kv_caceh.entrypoints.openai.serving import HTTPError
from attention_kv_caceh.entrypoints.openai.tool_calls import plan_tools
from attention_kv_caceh.entrypoints.openai.tool_parsers import Hermes2ProToolParser

TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": {"a": [1, 2]}}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
)
CALLS = [("get_weather", {"city": "Paris", "n": {"a": [1, 2]}}), ("get_time", {"zone": "CET"})]


def accumulate(deltas: list[dict[str, Any]]) -> tuple[str, dict[int, dict[str, str]]]:
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            if "id" in tc:
                assert not entry["id"], "a call's id comes once"
                entry["id"] = tc["id"]
                entry["name"] = tc["function"]["name"]
            entry["arguments"] += tc["function"].get("arguments", "")
    return content, calls


class HermesParserTest(unittest.TestCase):
    def test_whole_text(self) -> None:
        content, calls = Hermes2ProToolParser().extract_tool_calls(TEXT)
        self.assertEqual(content, "Let me check. ")
        self.assertEqual(
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], CALLS
        )
        self.assertEqual(len(Hermes2ProToolParser(parallel_tool_calls=False).extract_tool_calls(TEXT)[1]), 1)
        self.assertEqual(Hermes2ProToolParser().extract_tool_calls("no calls"), ("no calls", []))
        broken = "<tool_call>{not json}</tool_call>"
        self.assertEqual(Hermes2ProToolParser().extract_tool_calls(broken), (broken, []))

    def test_every_split_streams_the_same_calls(self) -> None:
        whole_arguments = [
            c["function"]["arguments"] for c in Hermes2ProToolParser().extract_tool_calls(TEXT)[1]
        ]
        rng = random.Random(0)
        splits = [[1] * len(TEXT)] + [[rng.randint(1, 12) for _ in range(len(TEXT))] for _ in range(20)]
        for sizes in splits:
            parser = Hermes2ProToolParser()
            deltas: list[dict[str, Any]] = []
            pos = 0
            for size in sizes:
                if pos >= len(TEXT):
                    break
                deltas += parser.feed(TEXT[pos : pos + size])
                pos += size
            deltas += parser.feed("", final=True)
            content, calls = accumulate(deltas)
            self.assertEqual(content, "Let me check. ")
            got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
            self.assertEqual(got, CALLS)
            # the fragments concatenate to the arguments' own text: no space from after the colon
            self.assertEqual([calls[i]["arguments"] for i in sorted(calls)], whole_arguments)
            self.assertTrue(all(c["id"].startswith("chatcmpl-tool-") for c in calls.values()))


def request(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **kw})


TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


class PlanToolsTest(unittest.TestCase):
    def test_each_tool_choice(self) -> None:
        self.assertIsNone(plan_tools(request(), False, None))
        with self.assertRaisesRegex(HTTPError, "enable-auto-tool-choice"):
            plan_tools(request(tools=[TOOL]), False, None)
        auto = plan_tools(request(tools=[TOOL]), True, "hermes")
        assert auto is not None
        self.assertEqual((auto.mode, auto.structured_outputs), ("auto", None))
        named = plan_tools(
            request(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}}), False, None
        )
        assert named is not None and named.structured_outputs is not None and named.structured_outputs.json
        self.assertEqual(json.loads(named.structured_outputs.json), TOOL["function"]["parameters"])
        required = plan_tools(
            request(tools=[TOOL], tool_choice="required", parallel_tool_calls=False), False, None
        )
        assert (
            required is not None
            and required.structured_outputs is not None
            and required.structured_outputs.json
        )
        schema = json.loads(required.structured_outputs.json)
        self.assertEqual((schema["minItems"], schema["maxItems"]), (1, 1))
        with self.assertRaisesRegex(HTTPError, "not among the tools"):
            plan_tools(
                request(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
                False,
                None,
            )
        with self.assertRaisesRegex(HTTPError, "no tools"):
            plan_tools(request(tool_choice="required"), False, None)
        stream = named.new_stream()
        self.assertEqual(stream.whole('{"a": 1}')[1][0]["function"], {"name": "f", "arguments": '{"a": 1}'})
        rstream = required.new_stream()
        calls = rstream.whole('[{"name": "f", "parameters": {"a": 2}}]')[1]
        self.assertEqual(json.loads(calls[0]["function"]["arguments"]), {"a": 2})

    def test_a_required_array_cut_by_max_tokens_keeps_its_text_as_content(self) -> None:
        required = plan_tools(request(tools=[TOOL], tool_choice="required"), False, None)
        assert required is not None
        cut = '[{"name": "f", "param'
        self.assertEqual(required.new_stream().whole(cut), (cut, []))
        stream = required.new_stream()
        deltas = stream.feed(cut[:5], False) + stream.feed(cut[5:], True)
        self.assertEqual(deltas, [{"content": cut}])
        self.assertEqual(stream.num_calls, 0)


if __name__ == "__main__":
    unittest.main()
