"""The one SSE parser and the OpenAI stream decoder: framing, and what counts as a token event."""

from __future__ import annotations

import unittest

from attention_kv_caceh.harness.scripted_server import DONE, chat_chunk, completion_chunk, sse
from attention_kv_caceh.harness.sse import (
    InvalidUsageError,
    MalformedSSEError,
    OpenAIStreamDecoder,
    SSEEvent,
    SSEParser,
    StreamErrorEvent,
)


class SSEParserTest(unittest.TestCase):
    def test_events_survive_any_split_of_the_bytes(self) -> None:
        stream = b'data: {"a": 1}\r\n\r\n: comment\n\nevent: error\ndata: x\ndata: y\r\rdata: [DONE]\n\n'
        expected = [SSEEvent('{"a": 1}'), SSEEvent("x\ny", "error"), SSEEvent("[DONE]")]
        for size in (1, 2, 3, 7, len(stream)):
            parser = SSEParser()
            events: list[SSEEvent] = []
            for i in range(0, len(stream), size):
                events += parser.feed(stream[i : i + size])
            self.assertEqual(events, expected, f"split every {size} bytes")
            self.assertFalse(parser.pending)

    def test_an_event_without_its_blank_line_is_pending_not_dispatched(self) -> None:
        parser = SSEParser()
        self.assertEqual(parser.feed(b"data: half"), [])
        self.assertTrue(parser.pending)


def decode(*chunks: bytes) -> tuple[OpenAIStreamDecoder, list[int]]:
    decoder = OpenAIStreamDecoder()
    counts: list[int] = []
    for chunk in chunks:
        counts += decoder.feed(chunk)
        if decoder.failure is not None:
            raise decoder.failure
    return decoder, counts


class DecoderTest(unittest.TestCase):
    def test_role_only_chat_chunk_is_not_a_token(self) -> None:
        decoder, counts = decode(chat_chunk(role="assistant"), chat_chunk("Hi"), chat_chunk("!"), DONE)
        self.assertEqual(counts, [1, 1])
        self.assertTrue(decoder.done)
        self.assertEqual((decoder.output_tokens, decoder.output_tokens_source), (2, "chunks"))

    def test_usage_only_last_chunk_is_not_a_token_but_sets_the_count(self) -> None:
        usage = {"prompt_tokens": 5, "completion_tokens": 7}
        decoder, counts = decode(completion_chunk("a"), completion_chunk(None, usage), DONE)
        self.assertEqual(counts, [1])
        self.assertEqual((decoder.output_tokens, decoder.output_tokens_source), (7, "usage"))
        self.assertEqual(decoder.prompt_tokens, 5)

    def test_continuous_usage_counts_several_tokens_per_chunk_including_the_first(self) -> None:
        def u(n: int) -> dict[str, int]:
            return {"prompt_tokens": 3, "completion_tokens": n}

        decoder, counts = decode(
            chat_chunk(role="assistant", usage=u(0)),
            chat_chunk("abc", usage=u(3)),
            chat_chunk("de", usage=u(5)),
            chat_chunk("f", usage=u(6)),
            chat_chunk(usage=u(6), no_choices=True),
            DONE,
        )
        self.assertEqual(counts, [3, 2, 1])
        self.assertEqual((decoder.output_tokens, decoder.output_tokens_source), (6, "usage"))

    def test_logprobs_token_lists_count_tokens_without_usage(self) -> None:
        chunk = sse({"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}}]})
        decoder, counts = decode(chunk, completion_chunk("c"), DONE)
        self.assertEqual(counts, [2, 1])
        self.assertEqual((decoder.output_tokens, decoder.output_tokens_source), (3, "logprobs"))

    def test_error_object_and_error_event_raise(self) -> None:
        with self.assertRaisesRegex(StreamErrorEvent, "out of memory"):
            decode(completion_chunk("a"), sse({"error": {"message": "out of memory"}}))
        with self.assertRaisesRegex(StreamErrorEvent, "boom"):
            decode(b"event: error\ndata: boom\n\n")
        with self.assertRaisesRegex(StreamErrorEvent, "bad"):
            decode(sse({"object": "error", "message": "bad"}))

    def test_malformed_data_raises(self) -> None:
        with self.assertRaisesRegex(MalformedSSEError, "not a JSON object"):
            decode(completion_chunk("a"), b"data: {oops\n\n")
        with self.assertRaises(MalformedSSEError):
            decode(b"data: [1, 2]\n\n")
        with self.assertRaises(MalformedSSEError):
            decode(b"data: \xff\xfe\n\n")

    def test_chunks_of_the_wrong_shape_are_malformed_not_skipped(self) -> None:
        bad = {
            "choices a string": {"choices": "nope"},
            "a null choice": {"choices": [None]},
            "a number as text": {"choices": [{"text": 5}]},
            "a list as delta": {"choices": [{"delta": [1]}]},
            "a number as content": {"choices": [{"delta": {"content": 7}}]},
            "an object as finish_reason": {"choices": [{"text": "a", "finish_reason": {}}]},
        }
        for name, obj in bad.items():
            with self.subTest(name), self.assertRaises(MalformedSSEError):
                decode(completion_chunk("a"), sse(obj), DONE)
        with self.assertRaises(InvalidUsageError):
            decode(completion_chunk("a"), sse({"choices": [], "usage": 5}), DONE)
        # null fields and an absent or null `choices` stay what they were: no token, no failure
        decoder, counts = decode(
            sse({"choices": None}),
            sse({"choices": [{"text": None, "finish_reason": None}]}),
            completion_chunk("a"),
            sse({"choices": [{"delta": None, "text": "b"}], "usage": None}),
            DONE,
        )
        self.assertEqual(counts, [1, 1])
        self.assertTrue(decoder.done)

    def test_events_before_an_error_in_the_same_read_are_kept(self) -> None:
        decoder = OpenAIStreamDecoder()
        counts = decoder.feed(completion_chunk("a") + b"data: {oops\n\n" + completion_chunk("b"))
        self.assertEqual(counts, [1])
        self.assertIsInstance(decoder.failure, MalformedSSEError)
        self.assertEqual(decoder.feed(completion_chunk("c")), [])

    def test_data_after_done_is_ignored(self) -> None:
        decoder, counts = decode(completion_chunk("a") + DONE + completion_chunk("b"))
        self.assertEqual(counts, [1])
        self.assertTrue(decoder.done)


class TokenRuleTest(unittest.TestCase):
    def test_finish_chunk_usage_is_reconciled_not_a_new_event(self) -> None:
        final = completion_chunk("", {"prompt_tokens": 2, "completion_tokens": 5})
        decoder, counts = decode(completion_chunk("a"), completion_chunk("b"), final, DONE)
        self.assertEqual(counts, [1, 1])
        self.assertEqual(
            decoder.reconciled_counts(), ([1, 4], "final usage 5 > 2 counted: +3 on the last event")
        )

    def test_final_usage_below_the_count_is_taken_from_the_last_events(self) -> None:
        lp = sse({"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b", "c"]}}]})
        final = completion_chunk(None, {"prompt_tokens": 2, "completion_tokens": 3})
        decoder, counts = decode(completion_chunk("x"), lp, final, DONE)
        self.assertEqual(counts, [1, 3])
        self.assertEqual(decoder.reconciled_counts()[0], [1, 2])

    def test_negative_or_decreasing_usage_is_invalid(self) -> None:
        with self.assertRaisesRegex(InvalidUsageError, "decreased from 5 to 3"):
            decode(
                completion_chunk("a", {"prompt_tokens": 1, "completion_tokens": 5}),
                completion_chunk("b", {"prompt_tokens": 1, "completion_tokens": 3}),
            )
        with self.assertRaisesRegex(InvalidUsageError, "-1"):
            decode(completion_chunk("a", {"prompt_tokens": -1, "completion_tokens": 1}))
        with self.assertRaisesRegex(InvalidUsageError, "1.5"):
            decode(completion_chunk("a", {"prompt_tokens": 1, "completion_tokens": 1.5}))  # type: ignore[dict-item]


if __name__ == "__main__":
    unittest.main()


class ReadSplitEquivalenceTest(unittest.TestCase):
    """The decoder's state after a stream is the same however the stream's bytes are split into reads:
    whole, one event a read (both through the one-split path of whole `data:` events), or in small
    pieces (the line-by-line path), for streams mixing good chunks with every kind of bad one."""

    @staticmethod
    def feed_all(reads: list[bytes]) -> tuple[object, ...]:
        decoder = OpenAIStreamDecoder()
        counts: list[int] = []
        for read in reads:
            counts += decoder.feed(read)
        failure = decoder.failure
        return (
            counts,
            decoder.counts,
            decoder.done,
            decoder.finish_reason,
            decoder.prompt_tokens,
            decoder.usage_completion_tokens,
            decoder.reconciled_counts(),
            decoder.output_tokens_source,
            decoder.tokens_per_event_source,
            None if failure is None else (type(failure).__name__, str(failure)),
        )

    def test_any_split_gives_the_same_decoding(self) -> None:
        from hypothesis import given, settings
        from hypothesis import strategies as st

        pieces = {
            "text": lambda k: completion_chunk(f" t{k}", {"prompt_tokens": 3, "completion_tokens": k + 1}),
            "plain": lambda k: completion_chunk(f" t{k}"),
            "held": lambda k: completion_chunk("", {"prompt_tokens": 3, "completion_tokens": k + 1}),
            "chat": lambda k: chat_chunk(f"c{k}", usage={"prompt_tokens": 3, "completion_tokens": k + 1}),
            "role": lambda k: chat_chunk(role="assistant"),
            "usage": lambda k: completion_chunk(None, {"prompt_tokens": 3, "completion_tokens": k + 2}),
            "finish": lambda k: completion_chunk("", finish_reason="length"),
            "logprobs": lambda k: sse({"choices": [{"text": "x", "logprobs": {"tokens": ["a", "b"]}}]}),
            "tools": lambda k: sse({"choices": [{"delta": {"tool_calls": [{"function": {"name": "f"}}]}}]}),
            "down": lambda k: completion_chunk(" d", {"completion_tokens": 0}),
            "negative": lambda k: completion_chunk(" n", {"completion_tokens": -1}),
            "boolean": lambda k: completion_chunk(" b", {"completion_tokens": True}),
            "badtext": lambda k: sse({"choices": [{"text": 5}]}),
            "notobject": lambda k: b"data: [1, 2]\n\n",
            "notjson": lambda k: b"data: {nope\n\n",
            "error": lambda k: sse({"error": {"message": "boom"}}),
            "comment": lambda k: b": keep-alive\n\n",
            "crlf": lambda k: completion_chunk(f" r{k}").replace(b"\n", b"\r\n"),
            "done": lambda k: DONE,
        }

        @settings(max_examples=150, deadline=None)
        @given(st.lists(st.sampled_from(sorted(pieces)), min_size=1, max_size=12), st.integers(1, 200))
        def check(kinds: list[str], size: int) -> None:
            events = [pieces[kind](k) for k, kind in enumerate(kinds)]
            stream = b"".join(events)
            small = self.feed_all([stream[i : i + size] for i in range(0, len(stream), size)])
            self.assertEqual(self.feed_all([stream]), small, kinds)
            self.assertEqual(self.feed_all(events), small, kinds)

        check()
