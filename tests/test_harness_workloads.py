"""Workloads: shared prefixes that a prefix cache finds as the workload implies, multi-turn conversations
that send their whole history (with the server's own answers) turn after turn, replayed conversations,
and the group and turn on every record."""

from __future__ import annotations

import itertools
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any

import numpy as np

from attention_kv_caceh.harness.load import LengthRange, make_request_specs
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import HarnessConfig, run_harness
from attention_kv_caceh.harness.scripted_server import Script, ScriptedServer, timed_token_script
from attention_kv_caceh.harness.workloads import (
    Workload,
    implied_prefix_hits,
    read_conversations,
    render_history,
    shared_prefix_specs,
)


def _server(**kwargs: Any) -> ScriptedServer:
    server: ScriptedServer | None = None

    def script_for(payload: dict[str, Any], path: str) -> Script:
        assert server is not None
        n = int(payload.get("max_tokens") or payload.get("max_completion_tokens") or 4)
        prompt = len(server.prompt_ids(payload))
        return timed_token_script(0.002, 0.0005, n, chat="chat" in path, prompt_tokens=prompt)

    server = ScriptedServer(script_for, counters=True, tokenizer=True, **kwargs)
    return server


def _config(base_url: str, **kwargs: Any) -> HarnessConfig:
    settings: dict[str, Any] = {
        "backend": "openai-completions",
        "base_url": base_url,
        "server_metrics_interval_s": 0.0,
        "output_len": LengthRange(3, 3),
        "prompt_len": LengthRange(5, 5),
        "smoke_test": False,
    }
    return HarnessConfig(**(settings | kwargs))


class SpecsTest(unittest.TestCase):
    def test_shared_prefix_specs_are_the_random_prompts_after_the_group_prefix(self) -> None:
        workload = Workload("shared-prefix", num_prefixes=3, prefix_len=7)
        plain = make_request_specs(8, LengthRange(4, 4), LengthRange(2, 2), np.random.default_rng(5))
        specs = shared_prefix_specs(
            workload, 8, LengthRange(4, 4), LengthRange(2, 2), np.random.default_rng(5), 5
        )
        prefixes: dict[int, str] = {}
        for spec, base in zip(specs, plain, strict=True):
            self.assertEqual(spec.group, spec.request_id % 3)
            words = spec.prompt.split()
            self.assertEqual(len(words), 7 + 4)
            self.assertEqual(" ".join(words[7:]), base.prompt)  # the suffix is the random workload's prompt
            self.assertEqual(prefixes.setdefault(spec.group, " ".join(words[:7])), " ".join(words[:7]))
            self.assertEqual(spec.prompt_tokens, 11)
        self.assertEqual(len(set(prefixes.values())), 3)

    def test_implied_hits(self) -> None:
        workload = Workload("shared-prefix", num_prefixes=4, prefix_len=10)
        self.assertEqual(implied_prefix_hits(workload, 16, 4), 12 * 8)
        self.assertEqual(implied_prefix_hits(workload, 3, 4), 0)

    def test_config_refuses_what_does_not_fit(self) -> None:
        with self.assertRaisesRegex(ValueError, "^num_requests: 10: .*turns=4"):
            HarnessConfig(num_requests=10, workload=Workload("multi-turn", turns=4))
        with self.assertRaisesRegex(ValueError, "^turns: must be >= 1, got 0"):
            Workload("multi-turn", turns=0)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "d.jsonl"
            path.write_text('{"prompt": "hi"}\n' * 16)
            with self.assertRaisesRegex(ValueError, "^dataset: "):
                HarnessConfig(dataset=str(path), workload=Workload("shared-prefix"))


class ConversationFileTest(unittest.TestCase):
    def test_both_message_shapes_and_errors_naming_the_line(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "c.jsonl"
            rows = [
                {"conversation": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"},
                                  {"role": "assistant", "content": "x"}, {"role": "user", "content": "c"}]},
                {"conversation": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]},
            ]  # fmt: skip
            path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
            self.assertEqual(read_conversations(path), [("be brief", ("a b", "c")), (None, ("hello",))])
            path.write_text(
                json.dumps(rows[0]) + "\n" + json.dumps({"conversation": [{"role": "bot"}]}) + "\n"
            )
            with self.assertRaisesRegex(ValueError, "line 2"):
                read_conversations(path)


class SharedPrefixRunTest(unittest.IsolatedAsyncioTestCase):
    async def run_shared(self, caching: bool) -> dict[str, Any]:
        async with _server(prefix_block_size=4, prefix_caching=caching) as server:
            config = _config(
                server.base_url,
                num_requests=12,
                concurrency=1,
                workload=Workload("shared-prefix", num_prefixes=3, prefix_len=10),
            )
            result = await run_harness(config)
        self.assertEqual([r.group for r in result.records], [i % 3 for i in range(12)])
        return result.summary

    async def test_server_hits_are_what_the_workload_implies(self) -> None:
        summary = await self.run_shared(True)
        counters = summary["server_counters"]
        # prompts are sent as token ids (the server's /tokenize): prefix of 10 ids, whole blocks of 4 hit
        self.assertEqual(
            counters["prefix_cache_hits"], implied_prefix_hits(Workload("shared-prefix", 3, 10), 12, 4)
        )
        self.assertEqual(counters["prefix_cache_queries"], 12 * 15)
        self.assertEqual(counters["prompt_tokens_diff"], 0)
        self.assertEqual(counters["generation_tokens_diff"], 0)
        self.assertEqual(counters["finished_requests"], {"length": 12})
        self.assertEqual(summary["implied_prefix_hit_tokens"], 9 * 10)

    async def test_no_prefix_caching_gives_zero(self) -> None:
        summary = await self.run_shared(False)
        self.assertEqual(summary["server_counters"]["prefix_cache_hits"], 0)
        self.assertEqual(summary["server_counters"]["prefix_cache_hit_rate"], 0.0)


class MultiTurnRunTest(unittest.IsolatedAsyncioTestCase):
    async def test_each_turn_sends_the_history_with_the_servers_answers(self) -> None:
        finished: list[RequestRecord] = []
        async with _server(prefix_block_size=2) as server:
            config = _config(
                server.base_url,
                backend="openai-chat",
                num_requests=9,
                concurrency=2,
                workload=Workload("multi-turn", turns=3),
            )
            result = await run_harness(config, on_record=finished.append)
            payloads = list(server.counters.payloads)
        self.assertEqual(len(payloads), 9)
        by_conv: dict[int, list[tuple[int, RequestRecord]]] = {}
        for record in result.records:
            assert record.group is not None and record.turn is not None
            by_conv.setdefault(record.group, []).append((record.turn, record))
        self.assertEqual(sorted(by_conv), [0, 1, 2])
        answer = " t0 t1 t2"  # what the timed script streams for 3 tokens
        for conv in by_conv.values():
            self.assertEqual([t for t, _ in sorted(conv, key=lambda x: x[0])], [0, 1, 2])
        for payload in payloads:
            messages = payload["messages"]
            turn = len(messages) // 2
            self.assertEqual([m["role"] for m in messages], ["user", "assistant"] * turn + ["user"])
            self.assertTrue(all(m["content"] == answer for m in messages[1::2]))
        # a turn goes out only after the previous answer of its conversation has ended
        records = {(r.group, r.turn): r for r in result.records}
        for (group, turn), record in records.items():
            if turn:
                previous = records[(group, turn - 1)]
                assert previous.stream_end_ns is not None and record.sent_ns is not None
                self.assertGreater(record.sent_ns, previous.stream_end_ns)
        rows = result.summary["per_turn"]
        rates = [row["prefix_cache_hit_rate"] for row in rows]
        # turn 0 hits only the chat template's opening block; each later turn repeats more of its prompt
        self.assertLess(rates[0], 0.2)
        self.assertTrue(all(b > a for a, b in itertools.pairwise(rates)), rates)
        self.assertEqual(len(finished), 9)
        self.assertTrue(all(r.requested_prompt_tokens is None for r in finished))

    async def test_dataset_conversations_replayed_in_order(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "c.jsonl"
            lines = [
                {"conversation": [{"role": "system", "content": "sys"}, {"role": "user", "content": "first q"},
                                  {"role": "assistant", "content": "recorded"}, {"role": "user", "content": "second q"}]},
                {"conversation": [{"role": "user", "content": "only q"}]},
            ]  # fmt: skip
            path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
            async with _server() as server:
                config = _config(
                    server.base_url,
                    num_requests=4,
                    dataset=str(path),
                    workload=Workload("multi-turn", turns=2),
                )
                result = await run_harness(config)
                prompts = [p["prompt"] for p in server.counters.payloads]
        self.assertEqual(len(result.records), 3)  # the second conversation has one turn
        first = [("system", "sys"), ("user", "first q")]
        self.assertEqual(set(prompts[:2]), {render_history(first), render_history([("user", "only q")])})
        self.assertEqual(
            prompts[2], render_history([*first, ("assistant", " t0 t1 t2"), ("user", "second q")])
        )


class EngineSharedPrefixTest(unittest.TestCase):
    """Against the project's own `serve` (a tiny random checkpoint, block size 16): the server's own
    counters find exactly what the workload implies."""

    def test_serve_hits_what_the_workload_implies(self) -> None:
        import contextlib
        import io

        from attention_kv_caceh import cli
        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            model = write_random_checkpoint(Path(tmp) / "tiny", "llama", "tiny", seed=0)
            summary_path = Path(tmp) / "s.json"
            argv = ["harness", "--backend", "engine", "--model", str(model), "--workload", "shared-prefix",
                    "--num-prefixes", "2", "--prefix-len", "40", "--prompt-len", "4", "--output-len", "2",
                    "--num-requests", "6", "--concurrency", "1", "--block-size", "16",
                    "--server-metrics-interval", "0", "--summary-json", str(summary_path)]  # fmt: skip
            with contextlib.redirect_stdout(io.StringIO()) as out:
                self.assertEqual(cli.main(argv), 0, out.getvalue())
            summary = json.loads(summary_path.read_text())
        counters = summary["server_counters"]
        workload = Workload("shared-prefix", num_prefixes=2, prefix_len=40)
        self.assertEqual(counters["prefix_cache_hits"], implied_prefix_hits(workload, 6, 16))  # 4 x 32
        self.assertEqual(counters["prefix_cache_queries"], 6 * 44)
        self.assertEqual((counters["prompt_tokens_diff"], counters["generation_tokens_diff"]), (0, 0))


class ExactSharedPrefixTest(unittest.TestCase):
    def test_exact_prompts_keep_each_suffix_when_a_word_is_several_tokens(self) -> None:
        import asyncio

        from attention_kv_caceh.harness.prompts import LocalTokenizer, exact_prompts
        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

        workload = Workload("shared-prefix", num_prefixes=2, prefix_len=40)
        specs = shared_prefix_specs(
            workload, 6, LengthRange(4, 4), LengthRange(2, 2), np.random.default_rng(5), 5
        )
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = LocalTokenizer(write_random_checkpoint(Path(tmp) / "tiny", "llama", "tiny", seed=0))
            exact = asyncio.run(exact_prompts(specs, tokenizer, token_ids=True))
            # the tiny checkpoint's byte-level BPE splits these words into several tokens each
            self.assertGreater(len(asyncio.run(tokenizer.encode(specs[0].prefix))), 40)
        ids = [spec.prompt_token_ids for spec in exact]
        for spec, prompt in zip(exact, ids, strict=True):
            assert prompt is not None
            self.assertEqual(len(prompt), 44)
            self.assertEqual(prompt[:40], ids[spec.request_id % 2][:40])  # the group's prefix, exactly
        self.assertEqual(len(set(ids)), 6)  # and every request its own suffix


if __name__ == "__main__":
    unittest.main()
