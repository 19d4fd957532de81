"""Token accounting on scripted streams, through the real HTTP backend on both OpenAI endpoints.

Each stream comes from a public report on another benchmark client: usage only on the finish chunk
(llama.cpp, TGI), a text chunk whose usage adds 0, tokens arriving as tool-call deltas, and a stream
that ends with a `finish_reason` and a clean close but no `data: [DONE]`. The rule checked throughout:
the tokens per event sum to the final usage count, no event is invented, and a multi-token response
never has a TPOT of exactly 0.
"""

from __future__ import annotations

import unittest
from time import perf_counter_ns
from typing import Literal

import aiohttp

from attention_kv_caceh.harness.backends import OpenAIBackend, RequestSpec
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.scripted_server import (
    DONE,
    Script,
    ScriptedServer,
    Step,
    chat_chunk,
    completion_chunk,
    sse,
)
from attention_kv_caceh.harness.summary import summarize_run

Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[Endpoint, ...] = ("completions", "chat")
SPEC = RequestSpec(0, prompt_tokens=4, output_tokens=10, prompt="hello there")
GAP_S = 0.03  # between scripted chunks: separate reads, so separate timestamps


def usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 4, "completion_tokens": n}


def text(endpoint: Endpoint, t: str, n: int | None = None, finish: str | None = None) -> bytes:
    u = usage(n) if n is not None else None
    if endpoint == "chat":
        return chat_chunk(t, usage=u, finish_reason=finish)
    return completion_chunk(t, u, finish_reason=finish)


async def run_script(script: Script, endpoint: Endpoint) -> RequestRecord:
    async with (
        ScriptedServer(lambda payload, path: script) as server,
        aiohttp.ClientSession() as session,
    ):
        backend = OpenAIBackend(session, base_url=server.base_url, model="m", endpoint=endpoint, timeout_s=10)
        record = RequestRecord(0, perf_counter_ns(), SPEC.prompt_tokens)
        record.sent_ns = record.arrival_ns
        await backend.generate(SPEC, record)
        return record


def steps(*chunks: bytes) -> Script:
    return Script(tuple(Step(GAP_S, c) for c in chunks))


class StreamTestCase(unittest.IsolatedAsyncioTestCase):
    def check_invariants(self, record: RequestRecord) -> None:
        """ok, events sum to output_tokens, E2EL = TTFT + sum(ITL), TPOT never exactly 0."""
        self.assertEqual(record.status, "ok", record.error)
        self.assertEqual(sum(record.tokens_per_event), record.output_tokens)
        self.assertTrue(all(n >= 1 for n in record.tokens_per_event))
        m = record.metrics()
        assert m.ttft_ms is not None and m.e2el_ms is not None
        self.assertAlmostEqual(m.e2el_ms, m.ttft_ms + sum(m.itl_ms), places=6)
        if record.output_tokens > 1:
            self.assertNotEqual(m.tpot_ms, 0.0)


class TokenAccountingTest(StreamTestCase):
    async def test_usage_only_on_the_finish_chunk_adds_no_event(self) -> None:
        for endpoint in ENDPOINTS:
            with self.subTest(endpoint=endpoint):
                chunks = [text(endpoint, f"w{k}") for k in range(10)]
                chunks.append(text(endpoint, "", 10, finish="stop"))  # empty text + usage (llama.cpp)
                record = await run_script(steps(*chunks, DONE), endpoint)
                self.check_invariants(record)
                self.assertEqual(record.tokens_per_event, [1] * 10)
                self.assertIsNone(record.token_reconciliation)
                self.assertEqual(record.output_tokens, 10)
                self.assertEqual(len(record.token_times_ns), 10)

    async def test_final_usage_above_the_chunk_count_is_reconciled_onto_the_last_event(self) -> None:
        for endpoint in ENDPOINTS:
            with self.subTest(endpoint=endpoint):
                chunks = [text(endpoint, f"w{k}") for k in range(8)]
                chunks.append(text(endpoint, "", 10, finish="stop"))
                record = await run_script(steps(*chunks, DONE), endpoint)
                self.check_invariants(record)
                self.assertEqual(record.tokens_per_event, [1] * 7 + [3])
                self.assertIn("+2 on the last event", record.token_reconciliation or "")
                self.assertEqual(record.tokens_per_event_source, "chunks")

    async def test_a_text_chunk_whose_usage_adds_nothing_is_not_a_token_event(self) -> None:
        for endpoint in ENDPOINTS:
            with self.subTest(endpoint=endpoint):
                chunks = [text(endpoint, f"w{k}", k + 1) for k in range(4)]
                chunks.append(text(endpoint, "\n", 4, finish="stop"))  # trailing newline, no new token
                record = await run_script(steps(*chunks, DONE), endpoint)
                self.check_invariants(record)
                self.assertEqual(record.tokens_per_event, [1, 1, 1, 1])
                assert record.stream_end_ns is not None and record.finish_ns is not None
                # the newline chunk came GAP_S after the 4th token and did not move the finish
                self.assertEqual(record.finish_ns, record.token_times_ns[3])

    async def test_stream_with_finish_reason_and_no_done_is_ok_with_the_flag(self) -> None:
        for endpoint in ENDPOINTS:
            with self.subTest(endpoint=endpoint):
                chunks = [text(endpoint, "a", 1), text(endpoint, "b", 2, finish="length")]
                record = await run_script(steps(*chunks), endpoint)
                self.check_invariants(record)
                self.assertIs(record.done_marker, False)
                summary = summarize_run([record], 1.0)
                self.assertEqual(summary["num_without_done_marker"], 1)
                with_done = await run_script(steps(*chunks, DONE), endpoint)
                self.assertIs(with_done.done_marker, True)

    async def test_stream_without_finish_reason_and_without_done_stays_incomplete(self) -> None:
        for endpoint in ENDPOINTS:
            with self.subTest(endpoint=endpoint):
                record = await run_script(steps(text(endpoint, "a", 1), text(endpoint, "b", 2)), endpoint)
                self.assertEqual(record.status, "incomplete_stream")


class HeldBackTextTest(StreamTestCase):
    """vLLM streams a token whose bytes end inside a UTF-8 character (byte-level BPE: CJK, emoji, a
    random model) as a choice with `"text": ""` and per-chunk usage one higher; its text comes with a
    later chunk. The token arrived with that chunk, and vLLM's `bench serve` counts the chunk."""

    async def test_empty_text_chunks_with_growing_usage_are_token_events(self) -> None:
        for endpoint in ENDPOINTS:
            with self.subTest(endpoint=endpoint):
                # tokens 1 and 3-4 hold their text back; token 5 releases "é" and a letter
                texts = ["", "a", "", "", "\u00e9b", "c"]
                chunks = [text(endpoint, t, k + 1) for k, t in enumerate(texts)]
                chunks.append(text(endpoint, "", 6, finish="length"))  # finish chunk: no new token
                record = await run_script(steps(*chunks, DONE), endpoint)
                self.check_invariants(record)
                self.assertEqual(record.tokens_per_event, [1] * 6)
                self.assertEqual(record.tokens_per_event_source, "usage")
                # 6 events, so the first (empty) chunk is the first token and sets TTFT
                self.assertEqual(len(record.token_times_ns), 6)
                self.assertEqual(len(record.metrics().itl_ms), 5)  # one gap per chunk, as vLLM's itl

    async def test_a_final_usage_report_on_an_empty_chunk_is_still_reconciled(self) -> None:
        for endpoint in ENDPOINTS:
            with self.subTest(endpoint=endpoint):
                # chunks counted one by one (no usage), then the first usage on an empty chunk
                chunks = [text(endpoint, "a"), text(endpoint, "b"), text(endpoint, "", 5)]
                record = await run_script(
                    steps(*chunks, text(endpoint, "", 5, finish="stop"), DONE), endpoint
                )
                self.check_invariants(record)
                self.assertEqual(record.tokens_per_event, [1, 4])
                self.assertEqual(len(record.token_times_ns), 2)


class NonTextDeltaTest(StreamTestCase):
    async def test_tool_call_deltas_after_content_are_token_events(self) -> None:
        chunks = [chat_chunk(role="assistant", usage=usage(0))]
        chunks += [chat_chunk(f"c{k}", usage=usage(k + 1)) for k in range(2)]
        chunks += [chat_chunk(tool_arguments=f'{{"a{k}', usage=usage(3 + k)) for k in range(8)]
        chunks.append(chat_chunk(usage=usage(10), no_choices=True))
        record = await run_script(steps(*chunks, DONE), "chat")
        self.check_invariants(record)
        self.assertEqual(record.tokens_per_event, [1] * 10)
        self.assertEqual(record.finish_ns, record.token_times_ns[-1])
        tpot = record.metrics().tpot_ms
        assert tpot is not None
        self.assertGreater(tpot, 0.0)

    async def test_tool_call_only_stream_has_tokens(self) -> None:
        chunks = [chat_chunk(role="assistant")]
        chunks += [chat_chunk(tool_arguments=f"x{k}") for k in range(5)]
        chunks.append(chat_chunk(usage=usage(10), no_choices=True))
        record = await run_script(steps(*chunks, DONE), "chat")
        self.assertEqual(record.status, "ok", record.error)
        self.assertEqual(record.output_tokens, 10)
        self.assertEqual(sum(record.tokens_per_event), 10)
        self.assertEqual(len(record.tokens_per_event), 5)

    async def test_completions_logprobs_only_chunk_is_a_token_event(self) -> None:
        lp = sse({"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["<0x0A>"]}}]})
        record = await run_script(steps(completion_chunk("a"), lp, DONE), "completions")
        self.assertEqual(record.status, "ok", record.error)
        self.assertEqual(record.tokens_per_event, [1, 1])


class MoreTokensThanAskedTest(unittest.IsolatedAsyncioTestCase):
    async def test_a_server_streaming_past_max_tokens_is_warned_about(self) -> None:
        from attention_kv_caceh.harness.load import LengthRange
        from attention_kv_caceh.harness.run import HarnessConfig, run_harness
        from attention_kv_caceh.harness.scripted_server import timed_token_script

        async with ScriptedServer(lambda payload, path: timed_token_script(0, 0, 2000)) as server:
            config = HarnessConfig(
                backend="openai-completions",
                base_url=server.base_url,
                num_requests=3,
                output_len=LengthRange(16, 16),
                server_metrics_interval_s=0,
            )
            result = await run_harness(config)
        self.assertEqual(result.summary["completed"], 3)  # well-formed streams: still ok
        self.assertEqual(result.summary["num_over_requested_output"], 3)
        for record in result.records:
            line = record.to_json()
            self.assertEqual((line["requested_output_tokens"], line["output_tokens"]), (16, 2000))
        warnings = [w for w in result.summary["warnings"] if "max_tokens" in w]
        self.assertEqual(len(warnings), 1, result.summary["warnings"])
        self.assertIn("2000", warnings[0])


if __name__ == "__main__":
    unittest.main()
