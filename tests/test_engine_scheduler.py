"""The engine's greedy tokens equal one-prompt-at-a-time full recompute, whatever the scheduler does.

Oracle: tests/engine_fakes.py. The fake runner reads each request's context back through its block table
from a paged token cache, so tokens only match the reference if block allocation, prefix caching, slot
mapping, chunked prefill and preemption all put and find the right tokens in the right slots. Every run
also checks, after every step: the token budget, max_num_seqs, ref counts == block-table entries; at the
end every block is free. Plus exact schedules for two hand-worked cases and the up-front refusals.
"""

from __future__ import annotations

import random
import unittest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import RequestStatus, SamplingParams
from tests.engine_fakes import (
    Arrival,
    assert_all_blocks_free,
    make_engine,
    reference_generate,
    run_workload,
)


def _prompts(
    rng: random.Random, n: int, lo: int, hi: int, shared: list[int] | None = None
) -> list[list[int]]:
    out: list[list[int]] = []
    for _ in range(n):
        body = [rng.randrange(1, 40) for _ in range(rng.randint(lo, hi))]
        out.append((shared or []) + body)
    return out


class EngineEqualsReferenceTest(unittest.TestCase):
    def check(self, engine_and_runner, arrivals: dict[int, list[Arrival]], max_model_len: int = 256) -> None:
        engine, _ = engine_and_runner
        tokens, reasons = run_workload(engine, arrivals)
        for batch in arrivals.values():
            for rid, prompt, params in batch:
                want, reason = reference_generate(prompt, params, max_model_len)
                self.assertEqual(tokens[rid], want, f"request {rid}")
                self.assertEqual(reasons[rid], reason, f"request {rid}")
        assert_all_blocks_free(engine)

    def test_many_prompts_with_chunking_prefix_caching_and_preemption_match_reference(self) -> None:
        rng = random.Random(0)
        shared = [rng.randrange(1, 40) for _ in range(10)]
        prompts = _prompts(rng, 6, 1, 30) + _prompts(rng, 6, 0, 12, shared)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        # 14 blocks of 4 = 56 slots for 12 requests of up to 41 positions: preemption is forced.
        engine, runner = make_engine(num_blocks=14, max_num_seqs=5, max_num_batched_tokens=12)
        self.check((engine, runner), {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
        self.assertGreater(engine.scheduler.num_preemptions, 0)
        self.assertGreater(engine.scheduler.kv_cache_manager.prefix_cache_hits, 0)
        self.assertTrue(any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.step_stats))

    def test_eos_and_stop_tokens_end_requests_like_reference(self) -> None:
        rng = random.Random(1)
        prompts = _prompts(rng, 20, 1, 20)
        params = SamplingParams(max_tokens=40, stop_token_ids=(7,))
        engine, runner = make_engine(num_blocks=40, max_num_batched_tokens=20)
        arrivals = {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]}
        self.check((engine, runner), arrivals)
        # the reference itself stops early for some prompts, so the stop paths were exercised
        lengths = [len(reference_generate(p, params, 256)[0]) for p in prompts]
        self.assertLess(min(lengths), 40)

    def test_chunks_ending_exactly_on_block_boundaries_match_reference(self) -> None:
        rng = random.Random(2)
        prompts = [[rng.randrange(1, 40) for _ in range(n)] for n in (20, 16, 8)]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        engine, runner = make_engine(num_blocks=30, max_num_seqs=1, max_num_batched_tokens=8)
        self.check((engine, runner), {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
        chunk_ends = [c + n for snap in runner.snapshots for c, n in snap.values() if n > 1]
        self.assertEqual(chunk_ends[:3], [8, 16, 20])  # the first prompt's chunks end on blocks 2 and 4
        self.assertTrue(all(e % 4 == 0 for e in chunk_ends))

    def test_prompt_fully_matching_a_cached_prefix_recomputes_only_its_last_token(self) -> None:
        prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # 3 full blocks of 4
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        engine, runner = make_engine(num_blocks=20)
        self.check((engine, runner), {0: [("a", prompt, params)], 10: [("b", prompt, params)]})
        snaps_b = [snap["b"] for snap in runner.snapshots if "b" in snap]
        # blocks 0 and 1 hit; block 2 would cover the last token, so positions 8..11 are computed
        self.assertEqual(snaps_b[0], (8, 4))
        # a longer prompt whose first 12 tokens are cached hits all three blocks
        engine2, runner2 = make_engine(num_blocks=20)
        self.check((engine2, runner2), {0: [("a", prompt, params)], 10: [("c", [*prompt, 17, 18], params)]})
        self.assertEqual(next(s["c"] for s in runner2.snapshots if "c" in s), (12, 2))

    def test_block_holding_the_uncomputed_last_token_is_not_cached(self) -> None:
        # A: 6-token prompt, 2 outputs. Its second block (positions 4..7) becomes full when the 2nd output
        # is sampled, but position 7 (that output) is never computed, so the block must not be cached.
        engine, runner = make_engine(num_blocks=20)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        prompt = [3, 1, 4, 1, 5, 9]
        tokens, _ = run_workload(engine, {0: [("a", prompt, params)]})
        b_prompt = [*prompt, *tokens["a"], 2]  # 9 tokens: blocks 0 and 1 could hit
        self.check((engine, runner), {0: [("b", b_prompt, params)]})
        self.assertEqual(runner.snapshots[-2]["b"], (4, 5))  # only block 0 hit

    def test_request_aborted_mid_prefill_leaves_only_computed_blocks_cached(self) -> None:
        engine, runner = make_engine(num_blocks=20, max_num_batched_tokens=6)
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
        engine.add_request("a", prompt, params)
        engine.step()  # positions 0..5: block 0 full and computed, block 1 half computed
        engine.abort_request("a")
        self.check((engine, runner), {0: [("b", prompt, params)]})
        self.assertEqual(runner.snapshots[1]["b"], (4, 5))

    def test_repeated_blocks_in_one_prompt_get_distinct_blocks(self) -> None:
        block = [7, 8, 9, 10]
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        engine, runner = make_engine(num_blocks=20)
        self.check(
            (engine, runner),
            {0: [("a", [*block, 1, 2, 3, 4, 5], params)], 5: [("b", [*block, *block, 6], params)]},
        )
        # b hits a's first block only: its second block has equal tokens after a different prefix
        self.assertEqual(next(s["b"] for s in runner.snapshots if "b" in s), (4, 5))

    def test_identical_prompts_admitted_together_match_reference(self) -> None:
        prompt = list(range(1, 19))
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        engine, runner = make_engine(num_blocks=30, max_num_batched_tokens=64)
        self.check((engine, runner), {0: [(f"r{i}", prompt, params) for i in range(3)]})

    def test_requests_added_while_others_decode_match_reference(self) -> None:
        rng = random.Random(3)
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        arrivals: dict[int, list[Arrival]] = {}
        for k, p in enumerate(_prompts(rng, 10, 1, 15)):
            arrivals.setdefault(3 * k, []).append((f"r{k}", p, params))
        engine, runner = make_engine(num_blocks=24, max_num_batched_tokens=10)
        self.check((engine, runner), arrivals)
        self.assertTrue(any(so.scheduled_new_request_ids and so.num_decode_tokens for so in runner.outputs))

    def test_prefix_caching_off_gives_the_same_tokens_and_no_hits(self) -> None:
        rng = random.Random(4)
        shared = list(range(1, 13))
        prompts = _prompts(rng, 6, 1, 6, shared)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        engine, runner = make_engine(num_blocks=16, enable_prefix_caching=False)
        self.check((engine, runner), {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
        self.assertEqual(engine.scheduler.kv_cache_manager.prefix_cache_hits, 0)

    def test_max_model_len_caps_output_with_length_reason(self) -> None:
        engine, runner = make_engine(num_blocks=20, max_model_len=13)
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        self.check((engine, runner), {0: [("a", list(range(1, 11)), params)]}, max_model_len=13)
        # prefill (samples token 11) + 2 decodes (tokens 12, 13): 13 tokens in all
        self.assertEqual([so.num_scheduled_tokens for so in runner.outputs], [{"a": 10}, {"a": 1}, {"a": 1}])

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        data=st.data(),
        block_size=st.integers(1, 6),
        max_num_seqs=st.integers(1, 5),
        extra_budget=st.integers(0, 20),
        caching=st.booleans(),
    )
    def test_random_workloads_match_reference(
        self, data: st.DataObject, block_size: int, max_num_seqs: int, extra_budget: int, caching: bool
    ) -> None:
        shared = data.draw(st.lists(st.integers(1, 39), min_size=0, max_size=12), label="shared prefix")
        n_requests = data.draw(st.integers(1, 8), label="requests")
        arrivals: dict[int, list[Arrival]] = {}
        max_need = 1
        for i in range(n_requests):
            tail = data.draw(st.lists(st.integers(1, 39), min_size=0 if shared else 1, max_size=16))
            use_shared = data.draw(st.booleans())
            prompt = (shared if use_shared else []) + tail or [1]
            params = SamplingParams(
                max_tokens=data.draw(st.integers(1, 10)), ignore_eos=data.draw(st.booleans())
            )
            step = data.draw(st.integers(0, 8))
            arrivals.setdefault(step, []).append((f"r{i}", prompt, params))
            max_need = max(max_need, -(-(len(prompt) + params.max_tokens - 1) // block_size))
        num_blocks = max_need + data.draw(st.integers(0, 12), label="spare blocks")
        engine, runner = make_engine(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + extra_budget,
            enable_prefix_caching=caching,
        )
        self.check((engine, runner), arrivals)


class KnownScheduleTest(unittest.TestCase):
    def test_chunked_prefill_then_joint_decode_schedule(self) -> None:
        engine, runner = make_engine(num_blocks=10, max_num_seqs=2, max_num_batched_tokens=8)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add_request("A", list(range(1, 11)), params)  # 10 tokens
        engine.add_request("B", [1, 2, 3], params)
        while engine.has_unfinished_requests():
            engine.step()
        self.assertEqual(
            [so.num_scheduled_tokens for so in runner.outputs], [{"A": 8}, {"A": 2, "B": 3}, {"A": 1, "B": 1}]
        )
        self.assertEqual(
            [(so.num_prefill_tokens, so.num_decode_tokens) for so in runner.outputs], [(8, 0), (5, 0), (0, 2)]
        )
        self.assertEqual([so.scheduled_new_request_ids for so in runner.outputs], [["A"], ["B"], []])
        assert_all_blocks_free(engine)

    def test_preemption_then_own_prefix_hit_schedule(self) -> None:
        # block_size 2, 4 blocks. A and B: 3-token prompts, 4 output tokens (6 positions = 3 blocks each).
        engine, runner = make_engine(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=16)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        a = engine.add_request("A", [1, 2, 3], params)
        b = engine.add_request("B", [4, 5, 6], params)
        tokens: dict[str, list[int]] = {"A": [], "B": []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        self.assertEqual(
            [so.num_scheduled_tokens for so in runner.outputs],
            [
                {"A": 3, "B": 3},  # both prefill, all 4 blocks taken
                {"A": 1, "B": 1},  # positions 3 fit in the second blocks
                {"A": 1},  # A needs a 3rd block: B (admitted last) is preempted; no admission this step
                {"A": 1},  # B (5 tokens) hits its cached first block but needs 2 more, only 1 is free
                {"B": 3},  # A finished; B hits block [4, 5] again and recomputes positions 2..4
                {"B": 1},
            ],
        )
        self.assertEqual([so.preempted_request_ids for so in runner.outputs], [[], [], ["B"], [], [], []])
        self.assertEqual(
            [(s.prefix_cache_queries, s.prefix_cache_hits) for s in engine.step_stats][4], (5, 2)
        )
        self.assertEqual((b.num_preemptions, b.num_cached_tokens, a.num_preemptions), (1, 2, 0))
        self.assertEqual(engine.scheduler.num_preemptions, 1)
        self.assertEqual(tokens["A"], reference_generate([1, 2, 3], params, 256)[0])
        self.assertEqual(tokens["B"], reference_generate([4, 5, 6], params, 256)[0])
        assert_all_blocks_free(engine)


class PreemptionTest(unittest.TestCase):
    def test_preempted_request_goes_to_the_front_keeping_its_output_tokens(self) -> None:
        engine, _ = make_engine(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=16)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.add_request("A", [1, 2, 3], params)
        b = engine.add_request("B", [4, 5, 6], params)
        engine.add_request("C", [7], params)  # waits: max_num_seqs is 2
        engine.step()
        engine.step()
        self.assertEqual(len(b.output_token_ids), 2)
        engine.step()  # A needs a third block: B, admitted last, is preempted
        self.assertEqual([r.request_id for r in engine.scheduler.waiting], ["B", "C"])
        self.assertEqual((b.status, b.num_computed_tokens, b.block_ids), (RequestStatus.PREEMPTED, 0, []))
        self.assertEqual(len(b.output_token_ids), 2)
        self.assertEqual(b.num_tokens, 5)  # its outputs are recomputed as part of its "prompt"


class AdmissionAndAbortTest(unittest.TestCase):
    def test_prompt_longer_than_max_model_len_is_refused(self) -> None:
        engine, _ = make_engine(num_blocks=100, max_model_len=8)
        with self.assertRaisesRegex(ValueError, "max_model_len"):
            engine.add_request("a", list(range(1, 10)), SamplingParams())
        self.assertFalse(engine.has_unfinished_requests())

    def test_request_larger_than_the_whole_pool_is_refused(self) -> None:
        engine, _ = make_engine(num_blocks=3)  # 12 slots
        with self.assertRaisesRegex(ValueError, "needs 4 KV blocks"):
            engine.add_request("a", list(range(1, 11)), SamplingParams(max_tokens=4))  # 13 positions
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        tokens, _ = run_workload(engine, {0: [("b", list(range(1, 11)), params)]})  # 12 positions: fits
        self.assertEqual(tokens["b"], reference_generate(list(range(1, 11)), params, 256)[0])
        assert_all_blocks_free(engine)

    def test_duplicate_request_id_is_refused(self) -> None:
        engine, _ = make_engine(num_blocks=10)
        engine.add_request("a", [1, 2], SamplingParams())
        with self.assertRaisesRegex(ValueError, "already in use"):
            engine.add_request("a", [3], SamplingParams())

    def test_empty_prompt_is_refused(self) -> None:
        engine, _ = make_engine(num_blocks=10)
        with self.assertRaisesRegex(ValueError, "empty"):
            engine.add_request("a", [], SamplingParams())

    def test_aborts_of_running_waiting_and_preempted_requests_free_every_block(self) -> None:
        rng = random.Random(5)
        prompts = _prompts(rng, 8, 5, 20)
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        engine, _ = make_engine(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=8)
        reqs = {f"r{i}": engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)}
        statuses: set[RequestStatus] = set()
        step = 0
        while engine.has_unfinished_requests():
            engine.step()
            step += 1
            if step in (3, 6, 9):
                victims = [engine.scheduler.running[0], engine.scheduler.waiting[-1]]
                statuses.update(r.status for r in victims)
                engine.abort_request([r.request_id for r in victims])
                self.assertTrue(
                    all(r.status == RequestStatus.FINISHED_ABORTED and not r.block_ids for r in victims)
                )
        self.assertIn(RequestStatus.RUNNING, statuses)
        self.assertTrue(statuses & {RequestStatus.WAITING, RequestStatus.PREEMPTED})
        assert_all_blocks_free(engine)
        for rid, r in reqs.items():  # the survivors still match the oracle
            if r.status != RequestStatus.FINISHED_ABORTED:
                self.assertEqual(
                    r.output_token_ids, reference_generate(prompts[int(rid[1:])], params, 256)[0]
                )

    def test_abort_reports_the_ids_to_the_runner_once(self) -> None:
        engine, runner = make_engine(num_blocks=10)
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
        engine.add_request("b", [4, 5], SamplingParams(max_tokens=5, ignore_eos=True))
        engine.step()
        engine.abort_request("a")
        engine.abort_request("a")  # already finished: ignored
        engine.step()
        engine.step()
        self.assertEqual([so.finished_request_ids for so in runner.outputs], [[], ["a"], []])
        engine.abort_request("b")
        self.assertEqual(engine.step(), [])  # nothing to compute: the runner is not called
        engine.add_request("c", [1], SamplingParams(max_tokens=1))
        engine.step()
        self.assertEqual(runner.outputs[-1].finished_request_ids, ["b"])


class StepStatsTest(unittest.TestCase):
    def test_step_stats_count_tokens_queues_and_blocks(self) -> None:
        engine, _ = make_engine(num_blocks=10, max_num_seqs=2, max_num_batched_tokens=8)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add_request("A", list(range(1, 11)), params)
        engine.add_request("B", [1, 2, 3], params)
        engine.add_request("C", [9], params)
        while engine.has_unfinished_requests():
            engine.step()
        s = engine.step_stats
        self.assertEqual([x.step_index for x in s], list(range(len(s))))
        self.assertEqual(s[0].num_scheduled_tokens, {"A": 8})
        self.assertEqual((s[0].num_running, s[0].num_waiting), (1, 2))
        self.assertEqual(s[0].num_free_blocks, 8)  # A holds 2 blocks of 4 for 8 positions
        self.assertAlmostEqual(s[0].kv_cache_usage, 0.2)
        self.assertEqual(s[-1].num_free_blocks, 10)
        self.assertTrue(all(x.step_time_ms >= 0 for x in s))
        # one thread's CPU time cannot exceed the wall time around it (1 us of clock granularity)
        self.assertTrue(all(0 <= x.step_cpu_ms <= x.step_time_ms + 1e-3 for x in s), s)

    def test_step_stats_keep_only_the_newest_max_step_stats_with_indices_counting_on(self) -> None:
        engine, runner = make_engine(num_blocks=10)
        engine = LLMEngine(engine.config, runner, max_step_stats=3, eos_token_id=engine.eos_token_id)
        engine.add_request("A", [1, 2], SamplingParams(max_tokens=6, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        self.assertEqual(engine.num_steps, 6)
        self.assertEqual([x.step_index for x in engine.step_stats], [3, 4, 5])
        with self.assertRaisesRegex(ValueError, "max_step_stats"):
            LLMEngine(engine.config, runner, max_step_stats=0)


if __name__ == "__main__":
    unittest.main()
