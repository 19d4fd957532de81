"""A request of n samples (engine/parallel_sampling.py, AsyncLLM.add_parallel_request): vLLM's child ids and
seeds, the first child added at once and its siblings after its first token, every child served in full."""

from __future__ import annotations

import asyncio
import unittest

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.output_processor import EngineDrainingError
from attention_kv_caceh.engine.parallel_sampling import ChildRequest, ParentRequest
from attention_kv_caceh.engine.request import SamplingParams
from tests.engine_fakes import CharTokenizer, expected_ids, make_text_core


class ParentRequestTest(unittest.TestCase):
    def test_children_get_vllms_ids_and_consecutive_seeds(self) -> None:
        parent = ParentRequest("cmpl-1", 3, SamplingParams(max_tokens=4, seed=7, temperature=1.0))
        infos = [parent.child_info(i) for i in range(3)]
        self.assertEqual([rid for rid, _ in infos], ["0_cmpl-1", "1_cmpl-1", "2_cmpl-1"])
        self.assertEqual([p.seed for _, p in infos], [7, 8, 9])
        self.assertEqual({(p.max_tokens, p.temperature) for _, p in infos}, {(4, 1.0)})

    def test_one_sample_keeps_the_parents_id_and_an_unseeded_request_stays_unseeded(self) -> None:
        params = SamplingParams(max_tokens=2)
        self.assertEqual(ParentRequest("r", 1, params).child_info(0), ("r", params))
        self.assertEqual(
            [ParentRequest("r", 2, params).child_info(i)[1].seed for i in range(2)], [None, None]
        )

    def test_no_samples_is_refused(self) -> None:
        with self.assertRaises(ValueError):
            ParentRequest("r", 0, SamplingParams())


class AddParallelRequestTest(unittest.TestCase):
    def test_the_first_child_starts_at_once_the_others_after_its_first_token_and_all_finish(self) -> None:
        core, _runner = make_text_core(max_num_seqs=4)
        prompt = list(range(40, 80))  # two full 16-token blocks the siblings can share

        async def go() -> tuple[list[bool], int, list[list[int]], list[str]]:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            params = SamplingParams(max_tokens=5, ignore_eos=True)
            children = llm.add_parallel_request("p", prompt, params, 3, first_index=6)
            started = [c.stream is not None for c in children]
            tracked = llm.num_unfinished

            async def tokens(child: ChildRequest) -> list[int]:
                return [t async for d in child.deltas() for t in d.new_token_ids]

            got = await asyncio.gather(*(tokens(c) for c in children))
            await llm.shutdown(5)
            return started, tracked, list(got), [f"{c.index}:{c.request_id}" for c in children]

        started, tracked, got, names = asyncio.run(go())
        self.assertEqual(started, [True, False, False])
        self.assertEqual(tracked, 1)
        self.assertEqual(names, ["6:0_p", "7:1_p", "8:2_p"])
        self.assertEqual(got, [expected_ids(prompt, 5)] * 3)  # greedy: every sample is the oracle's
        self.assertFalse(core.has_unfinished_requests())
        kv = core.scheduler.kv_cache_manager
        self.assertEqual(kv.prefix_cache_hits, 2 * 32)  # each sibling found the leader's two full blocks
        self.assertEqual(kv.num_free_blocks, kv.num_blocks)

    def test_a_first_child_that_cannot_be_added_leaves_nothing_tracked(self) -> None:
        core, _runner = make_text_core()

        async def go() -> int:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            await llm.shutdown(5)
            with self.assertRaises(EngineDrainingError):
                llm.add_parallel_request("p", [1, 2], SamplingParams(), 2)
            return llm.num_unfinished

        self.assertEqual(asyncio.run(go()), 0)


if __name__ == "__main__":
    unittest.main()
