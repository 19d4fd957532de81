"""The SSE events of one streamed choice, from stand-in RequestDeltas (no engine, no HTTP)."""

from __future__ import annotations

import asyncio
import json
import unittest
from collections.abc import AsyncIterator

from attention_kv_caceh.engine.output_processor import RequestDelta
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from attention_kv_caceh.entrypoints.openai.serving_response import Choice, stream_events
from tests.engine_fakes import CharTokenizer


class ScriptedStream:
    """A RequestStream stand-in that yields the given deltas."""

    def __init__(self, deltas: list[RequestDelta]) -> None:
        self.deltas = deltas
        self.closed_with: str | None = None

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[RequestDelta]:
        for delta in self.deltas:
            yield delta

    def close(self, finish_reason: str = "abort") -> None:
        self.closed_with = finish_reason


def delta(token: int, text: str, n: int, finish: str | None = None) -> RequestDelta:
    return RequestDelta("r", (token,), text, finish is not None, finish, 2, n)


# the second token's text is incomplete (a cut UTF-8 character, or held back for a stop string)
DELTAS = [delta(5, "a", 1), delta(6, "", 2), delta(7, "bc", 3), delta(8, "", 4, "length")]


def events(body: CompletionRequest | ChatCompletionRequest) -> list[dict[str, object]]:
    stream = ScriptedStream(DELTAS)
    choice = Choice(0, "r", [1, 2], SamplingParams(max_tokens=4), lambda *_: stream)  # type: ignore[arg-type, return-value]

    async def collect() -> list[bytes]:
        return [event async for event in stream_events("cmpl-1", [choice], body, CharTokenizer(), "m")]

    out: list[dict[str, object]] = []
    for event in asyncio.run(collect()):
        payload = event.decode().removeprefix("data: ").strip()
        if payload != "[DONE]":
            out.append(json.loads(payload))
    return out


class EmptyTextChunkTest(unittest.TestCase):
    def test_a_token_without_text_yet_still_gets_its_own_chunk_without_continuous_usage(self) -> None:
        body = CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "max_tokens": 4, "stream": True}
        )
        chunks = events(body)
        texts = [c["choices"][0]["text"] for c in chunks]  # type: ignore[index]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks]  # type: ignore[index]
        # one chunk per token-bearing delta (the empty one included), then the finish chunk
        self.assertEqual(texts, ["a", "", "bc", ""])
        self.assertEqual(reasons, [None, None, None, "length"])
        self.assertTrue(all("usage" not in c or c["usage"] is None for c in chunks))

    def test_chat_sends_an_empty_content_chunk_for_the_token_without_text(self) -> None:
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True}
        )
        chunks = events(body)
        deltas = [c["choices"][0]["delta"] for c in chunks]  # type: ignore[index]
        self.assertEqual(deltas[0], {"role": "assistant"})
        self.assertEqual([d.get("content") for d in deltas[1:4]], ["a", "", "bc"])  # type: ignore[union-attr]


if __name__ == "__main__":
    unittest.main()
