"""The OutputProcessor's text deltas and stop strings, the incremental detokenizer, sampling checks and
chat templates."""

from __future__ import annotations

import asyncio
import itertools
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.engine.core import EngineCoreOutput, EngineCoreOutputs
from attention_kv_caceh.engine.output_processor import OutputProcessor, RequestDelta, RequestStream
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.tokenizer import IncrementalDetokenizer, TextDecoder
from attention_kv_caceh.entrypoints.chat_utils import PLAIN_CHAT_TEMPLATE, ChatTemplate, load_chat_template
from attention_kv_caceh.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from attention_kv_caceh.entrypoints.openai.serving import HTTPError, sampling_params_for
from tests.engine_fakes import CharTokenizer


class ByteTokenizer:
    """One token per UTF-8 byte: a multi-byte character is incomplete until its last byte arrives."""

    eos_token_id: int | None = None
    vocab_size: int = 256

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        return list(text.encode()[:max_length])

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


class _Aborts:
    """Stands in for AsyncLLM: records aborts."""

    def __init__(self) -> None:
        self.aborted: list[tuple[str, str]] = []

    def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        self.aborted.append((request_id, finish_reason))


def deltas_of(tokens: list[list[int]]) -> list[RequestDelta]:
    """One RequestDelta per step; the last one finishes with "length"."""
    out: list[RequestDelta] = []
    count = 0
    for i, ids in enumerate(tokens):
        count += len(ids)
        last = i == len(tokens) - 1
        out.append(RequestDelta("r", tuple(ids), "", last, "length" if last else None, 2, count))
    return out


def run_deltas(
    tokens: list[list[int]],
    stops: list[str],
    tokenizer: TextDecoder,
    finish: str = "length",
    **fields: Any,
) -> tuple[list[RequestDelta], list[str]]:
    """Feed one core output per step (the last finishing with `finish`) through an OutputProcessor;
    (the request's deltas until it finished, the requests it asked to abort). `fields`: more
    SamplingParams fields."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=10**6, stop=tuple(stops), **fields)
    processor.add_request("r", 2, params, 0.0)
    deltas: list[RequestDelta] = []
    aborts: list[str] = []
    for i, ids in enumerate(tokens):
        reason = finish if i == len(tokens) - 1 else None
        result = processor.process_outputs(EngineCoreOutputs([EngineCoreOutput("r", ids, reason)]), 1.0)
        aborts += result.reqs_to_abort
        for _state, item in result.deliveries:
            assert isinstance(item, RequestDelta)
            deltas.append(item)
    return deltas, aborts


class RequestStreamTest(unittest.TestCase):
    def test_deltas_waiting_in_the_queue_come_out_merged_and_an_error_after_them(self) -> None:
        async def go() -> tuple[list[RequestDelta], BaseException | None]:
            queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
            for delta in deltas_of([[1], [2, 3], [4]])[:2]:
                queue.put_nowait(delta)
            queue.put_nowait(RuntimeError("step failed"))
            stream = RequestStream("r", queue, _Aborts().abort)
            got: list[RequestDelta] = []
            try:
                async for delta in stream:
                    got.append(delta)
            except RuntimeError as exc:
                return got, exc
            return got, None

        got, error = asyncio.run(go())
        self.assertEqual(
            [(d.new_token_ids, d.num_output_tokens, d.finished) for d in got], [((1, 2, 3), 3, False)]
        )
        self.assertIsInstance(error, RuntimeError)


class TextDeltaTest(unittest.TestCase):
    def test_min_tokens_include_stop_str_and_a_stop_token_kept_out_of_the_text(self) -> None:
        tok = CharTokenizer()
        steps = [tok.encode(c) for c in "abcabcab"]
        cases: list[tuple[dict[str, Any], str]] = [
            ({}, "a"),  # the first "b" stops
            ({"min_tokens": 3}, "abca"),  # a stop string within the first 3 tokens does not count
            ({"min_tokens": 3, "include_stop_str_in_output": True}, "abcab"),
            ({"min_tokens": 1}, "a"),  # the "b" is the 2nd token: it counts
        ]
        for fields, expected in cases:
            with self.subTest(fields=fields):
                deltas, aborts = run_deltas(steps, ["b"], tok, **fields)
                self.assertEqual("".join(d.text for d in deltas), expected)
                self.assertEqual((deltas[-1].finish_reason, aborts), ("stop", ["r"]))
        stopped, _ = run_deltas(steps, [], tok, finish="stop")  # ended by eos or a stop token id
        self.assertEqual("".join(d.text for d in stopped), "abcabca")
        self.assertEqual(stopped[-1].num_output_tokens, 8)  # still counted
        kept, _ = run_deltas(steps, [], tok, finish="stop", include_stop_str_in_output=True)
        self.assertEqual("".join(d.text for d in kept), "abcabcab")

    def test_every_step_yields_a_delta_even_when_its_token_completes_no_character(self) -> None:
        # "é" is two UTF-8 bytes, so its first byte-token has no text yet. vLLM still sends a chunk
        # (empty text, usage one higher) so a client can time that token; so must we.
        tokens = [[ord("a")], ["é".encode()[0]], ["é".encode()[1]], [ord("b")]]
        deltas, _ = run_deltas(tokens, [], ByteTokenizer())
        self.assertEqual([d.text for d in deltas], ["a", "", "é", "b"])
        self.assertEqual([d.num_output_tokens for d in deltas], [1, 2, 3, 4])

    def test_stop_string_straddling_two_steps_is_never_streamed(self) -> None:
        tok = CharTokenizer()
        steps = [tok.encode(s) for s in ["hel", "lo wo", "rld", "!!"]]
        deltas, aborts = run_deltas(steps, ["o w"], tok)
        self.assertEqual("".join(d.text for d in deltas), "hell")
        self.assertEqual(deltas[-1].finish_reason, "stop")
        self.assertEqual(len(deltas), 2)  # nothing of the request after the stop string
        self.assertEqual(aborts, ["r"])  # the core is told to free its blocks

    def test_without_a_stop_every_character_arrives_and_the_finish_is_length(self) -> None:
        tok = CharTokenizer()
        deltas, aborts = run_deltas([tok.encode(s) for s in ["ab", "c", "de"]], [], tok)
        self.assertEqual([d.text for d in deltas], ["ab", "c", "de"])
        self.assertEqual(deltas[-1].finish_reason, "length")
        self.assertEqual(deltas[-1].num_output_tokens, 5)
        self.assertEqual(aborts, [])

    @settings(max_examples=60, deadline=None)
    @given(
        text=st.text(alphabet="abc xé€", min_size=1, max_size=30),
        cuts=st.lists(st.integers(1, 40), max_size=8),
        stop=st.text(alphabet="abc x", min_size=1, max_size=3),
    )
    def test_streamed_text_equals_the_whole_text_cut_at_the_first_stop(
        self, text: str, cuts: list[int], stop: str
    ) -> None:
        tok = ByteTokenizer()
        ids = tok.encode(text)
        bounds = sorted({c for c in cuts if c < len(ids)} | {0, len(ids)})
        steps = [ids[a:b] for a, b in itertools.pairwise(bounds)]
        deltas, _ = run_deltas(steps, [stop], tok)
        streamed = "".join(d.text for d in deltas)
        index = text.find(stop)
        self.assertEqual(streamed, text if index < 0 else text[:index])
        self.assertNotIn("\ufffd", streamed)


class DetokenizerTest(unittest.TestCase):
    def test_an_incomplete_utf8_character_is_held_back_until_its_last_byte(self) -> None:
        tok = ByteTokenizer()
        detok = IncrementalDetokenizer(tok)
        euro = list("€".encode())  # three bytes
        self.assertEqual(detok.add([97]), "a")
        self.assertEqual(detok.add(euro[:1]), "")
        self.assertEqual(detok.add(euro[1:2]), "")
        self.assertEqual(detok.add(euro[2:]), "€")
        self.assertEqual(detok.add(euro[:1]), "")
        self.assertEqual(detok.flush(), "\ufffd")


class SamplingParamsTest(unittest.TestCase):
    def test_a_prompt_past_max_model_len_names_its_exact_length(self) -> None:
        body = CompletionRequest(prompt="x")
        for num_tokens in (3000, 101, 100):
            with self.assertRaises(HTTPError) as caught:
                sampling_params_for(body, num_tokens, 100, 16)
            self.assertEqual((caught.exception.status, caught.exception.param), (400, "prompt"))
            self.assertIn(f"the prompt is {num_tokens} tokens", caught.exception.message)

    def test_the_context_boundary_as_vllm_serves_it(self) -> None:
        """Prompts of 254..257 tokens in a 256-token context, max_tokens 1, 100 or none (completions'
        default 16), as vLLM 0.32 answers them: max_tokens is capped to the context left (served with
        finish_reason "length"), a prompt that fills the context or passes it is a 400."""
        expected = {  # prompt tokens -> max_tokens served for max_tokens (1, 100, None); None: a 400
            254: (1, 2, 2),
            255: (1, 1, 1),
            256: (None, None, None),
            257: (None, None, None),
        }
        for num_tokens, served in expected.items():
            for max_tokens, want in zip((1, 100, None), served, strict=True):
                body = CompletionRequest(prompt="x", max_tokens=max_tokens)
                if want is not None:
                    self.assertEqual(sampling_params_for(body, num_tokens, 256, 16).max_tokens, want)
                    continue
                with self.assertRaises(HTTPError) as caught:
                    sampling_params_for(body, num_tokens, 256, 16)
                self.assertEqual(caught.exception.status, 400)
                self.assertIn(str(num_tokens), caught.exception.message)

    def test_defaults_and_limits(self) -> None:
        body = CompletionRequest(prompt="x")
        self.assertEqual(sampling_params_for(body, 4, 100, 16).max_tokens, 16)
        self.assertEqual(sampling_params_for(body, 90, 100, 16).max_tokens, 10)
        self.assertEqual(sampling_params_for(body, 4, 100, None).max_tokens, 96)
        self.assertEqual(sampling_params_for(body, 4, 100, 16).temperature, 1.0)
        both = CompletionRequest(prompt="x", max_tokens=5, max_completion_tokens=7, top_k=-1)
        params = sampling_params_for(both, 4, 100, 16)
        self.assertEqual((params.max_tokens, params.top_k), (7, 0))
        capped = sampling_params_for(CompletionRequest(prompt="x", max_completion_tokens=100), 4, 100, 16)
        self.assertEqual(capped.max_tokens, 96)  # up to the context, capped to what the prompt leaves
        for name in ("max_tokens", "max_completion_tokens"):
            with self.assertRaises(HTTPError) as caught:
                sampling_params_for(CompletionRequest.model_validate({"prompt": "x", name: 101}), 4, 100, 16)
            self.assertEqual((caught.exception.status, caught.exception.param), (400, name))
            self.assertIn("101", caught.exception.message)
        with self.assertRaises(HTTPError) as caught:  # min_tokens above the capped max_tokens
            sampling_params_for(CompletionRequest(prompt="x", max_tokens=100, min_tokens=5), 98, 100, 16)
        self.assertEqual((caught.exception.status, caught.exception.param), (400, "min_tokens"))
        with self.assertRaises(HTTPError):
            sampling_params_for(CompletionRequest(prompt="x", temperature=-0.5), 4, 100, 16)

    def test_a_max_tokens_below_one_names_echo_only_on_completions(self) -> None:
        messages = [{"role": "user", "content": "u"}]
        for value, name in itertools.product((-1, 0), ("max_tokens", "max_completion_tokens")):
            with self.subTest(value=value, name=name):
                with self.assertRaises(HTTPError) as chat:
                    body = ChatCompletionRequest.model_validate({"messages": messages, name: value})
                    sampling_params_for(body, 4, 100, 16)
                self.assertEqual((chat.exception.status, chat.exception.param), (400, name))
                self.assertEqual(chat.exception.message, f"{name} must be at least 1, got {value}")
                self.assertNotIn("echo", chat.exception.message)
                with self.assertRaises(HTTPError) as comp:
                    sampling_params_for(
                        CompletionRequest.model_validate({"prompt": "x", name: value}), 4, 100, 16
                    )
                self.assertIn("(or 0 with echo)", comp.exception.message)


class ChatTemplateTest(unittest.TestCase):
    def test_plain_template_is_one_line_per_message_then_the_assistant_prompt(self) -> None:
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        self.assertEqual(
            ChatTemplate(PLAIN_CHAT_TEMPLATE).render(messages), "system: s\nuser: u\nassistant: "
        )
        self.assertEqual(ChatTemplate().render(messages, add_generation_prompt=False), "system: s\nuser: u\n")

    def test_checkpoint_template_with_special_tokens_and_the_named_list_form(self) -> None:
        source = (
            "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
        with tempfile.TemporaryDirectory() as d:
            config = {
                "chat_template": [
                    {"name": "tool_use", "template": "x"},
                    {"name": "default", "template": source},
                ],
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
            }
            (Path(d) / "tokenizer_config.json").write_text(json.dumps(config))
            template = load_chat_template(d)
        assert template is not None
        rendered = template.render([{"role": "user", "content": "hi"}])
        self.assertEqual(rendered, "<s><|user|>hi</s><|assistant|>")

    def test_chat_template_jinja_is_read_and_wins_over_the_config_key(self) -> None:
        # transformers writes the template to chat_template.jinja and prefers that file when loading
        jinja_source = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "chat_template.jinja").write_text(jinja_source, encoding="utf-8")
            alone = load_chat_template(d)  # no tokenizer_config.json at all
            config = {"chat_template": "{{ 'from the config' }}", "eos_token": "</s>"}
            (Path(d) / "tokenizer_config.json").write_text(json.dumps(config))
            both = load_chat_template(d)
        assert alone is not None and both is not None
        messages = [{"role": "user", "content": "hi"}]
        self.assertEqual(alone.render(messages), "[user]hi")
        self.assertEqual(both.render(messages), "[user]hi</s>")

    def test_no_config_means_no_template_and_a_failing_template_is_a_value_error(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            self.assertIsNone(load_chat_template(d))
        failing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
        with self.assertRaisesRegex(ValueError, "roles must alternate"):
            failing.render([{"role": "user", "content": "x"}])


if __name__ == "__main__":
    unittest.main()
