"""Server counters around a run: parsing vLLM's exposition, the differences, the prefix-cache reset, and
the scripted server's prefix-cache model against a brute-force oracle."""

from __future__ import annotations

import asyncio
import unittest
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.harness.scripted_server import PrefixCacheModel, ScriptedServer, timed_token_script
from attention_kv_caceh.harness.server_counters import (
    CounterSnapshot,
    counter_delta,
    counter_warnings,
    parse_counters,
    read_counters,
    reset_prefix_cache,
)

# Shaped as vLLM 0.x exposes them: `_total` samples with `_created` beside them, two label sets.
VLLM_TEXT = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 24.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1024.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 256.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 10.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 6.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 0.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def brute_hits(earlier: list[list[int]], ids: list[int], block: int) -> int:
    """The oracle: the longest block-aligned prefix (at most len - 1 tokens) that some earlier prompt's
    full blocks cover."""
    best = 0
    for old in earlier:
        k = 0
        while k < min(len(old), len(ids)) and old[k] == ids[k]:
            k += 1
        usable = min(k, len(old) // block * block, len(ids) - 1)
        best = max(best, usable // block * block)
    return best


class ParseTest(unittest.TestCase):
    def test_vllm_exposition_summed_over_label_sets_finish_reasons_kept(self) -> None:
        snap = parse_counters(VLLM_TEXT)
        self.assertEqual(snap.values["prefix_cache_queries"], 1024.0)
        self.assertEqual(snap.values["prefix_cache_hits"], 512.0)
        self.assertEqual(snap.values["preemptions"], 3.0)
        self.assertEqual(snap.values["prompt_tokens"], 1024.0)
        self.assertEqual(snap.values["generation_tokens"], 256.0)
        self.assertEqual(dict(snap.finished), {"length": 10.0, "stop": 6.0, "abort": 0.0})

    def test_negative_or_nan_counter_is_refused(self) -> None:
        for value in ("-1", "NaN"):
            with self.subTest(value=value), self.assertRaises(ValueError):
                parse_counters(f"# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total {value}\n")

    def test_delta_hit_rate_finish_reasons_and_client_comparison(self) -> None:
        before = CounterSnapshot(
            {
                "prefix_cache_queries": 100,
                "prefix_cache_hits": 40,
                "prompt_tokens": 100,
                "generation_tokens": 10,
            },
            {"length": 2},
        )
        after = CounterSnapshot(
            {
                "prefix_cache_queries": 300,
                "prefix_cache_hits": 190,
                "prompt_tokens": 300,
                "generation_tokens": 50,
            },
            {"length": 5, "stop": 1},
        )
        d = counter_delta(before, after, client_prompt_tokens=200, client_output_tokens=41)
        self.assertEqual((d["prefix_cache_queries"], d["prefix_cache_hits"]), (200, 150))
        self.assertAlmostEqual(d["prefix_cache_hit_rate"], 0.75)
        self.assertIsNone(d["preemptions"])  # not exported by either snapshot
        self.assertEqual(d["finished_requests"], {"length": 3, "stop": 1})
        self.assertEqual((d["prompt_tokens_diff"], d["generation_tokens_diff"]), (0, -1))
        self.assertEqual(len(counter_warnings(d)), 1)  # the generation tokens only

    def test_counter_that_went_down_is_none_and_listed(self) -> None:
        before = CounterSnapshot({"prompt_tokens": 500}, {})
        after = CounterSnapshot({"prompt_tokens": 20}, {})
        d = counter_delta(before, after, client_prompt_tokens=20, client_output_tokens=0)
        self.assertIsNone(d["prompt_tokens"])
        self.assertEqual(d["counter_resets"], ["vllm:prompt_tokens_total"])


class PrefixCacheModelTest(unittest.TestCase):
    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=6),
        st.integers(1, 4),
    )
    def test_hits_equal_the_brute_force_oracle(self, prompts: list[list[int]], block: int) -> None:
        model = PrefixCacheModel(block)
        for i, ids in enumerate(prompts):
            self.assertEqual(model.admit(ids), brute_hits(prompts[:i], ids, block))
        self.assertEqual(model.queries, sum(len(p) for p in prompts))

    def test_disabled_and_reset_never_hit(self) -> None:
        off = PrefixCacheModel(2, enabled=False)
        off.admit([1, 2, 3, 4, 5])
        self.assertEqual(off.admit([1, 2, 3, 4, 5]), 0)
        on = PrefixCacheModel(2)
        on.admit([1, 2, 3, 4, 5])
        on.reset()
        self.assertEqual(on.admit([1, 2, 3, 4, 5]), 0)
        self.assertEqual(on.admit([1, 2, 3, 4, 5]), 4)  # capped at len - 1, whole blocks


def _script(payload: dict[str, Any], path: str) -> Any:
    return timed_token_script(0.0, 0.0, 2)


class ServerEndpointsTest(unittest.IsolatedAsyncioTestCase):
    async def test_reset_endpoint_answers_200_and_empties_the_cache(self) -> None:
        async with ScriptedServer(_script, counters=True, prefix_block_size=2) as server:
            server.prefix_cache.admit([1, 2, 3, 4, 5])
            ok, why = await asyncio.to_thread(reset_prefix_cache, server.base_url + "/v1")
            self.assertEqual((ok, why), (True, ""))
            self.assertEqual(server.counters.resets, 1)
            self.assertEqual(server.prefix_cache.admit([1, 2, 3, 4, 5]), 0)
            snap, _ = await asyncio.to_thread(read_counters, server.base_url)
            assert snap is not None
            self.assertEqual(snap.values["prefix_cache_queries"], 10)

    async def test_server_without_reset_or_metrics_is_recorded_not_raised(self) -> None:
        async with ScriptedServer(_script, reset_endpoint=False) as server:
            ok, why = await asyncio.to_thread(reset_prefix_cache, server.base_url)
            self.assertFalse(ok)
            self.assertIn("404", why)
            snap, why = await asyncio.to_thread(read_counters, server.base_url)
            self.assertIsNone(snap)
            self.assertIn("404", why)


if __name__ == "__main__":
    unittest.main()
