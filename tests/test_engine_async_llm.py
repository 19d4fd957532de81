"""AsyncLLM without HTTP: one step serves every running request, aborts free blocks, shutdown drains."""

from __future__ import annotations

import asyncio
import unittest

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.output_processor import EngineDrainingError, EngineStepError, RequestDelta
from attention_kv_caceh.engine.request import SamplingParams
from tests.fake_engine import FakeEngine, FakeTokenizer, letter


async def collect(llm: AsyncLLM, rid: str, prompt: list[int], max_tokens: int) -> list[RequestDelta]:
    return [d async for d in llm.generate(rid, prompt, SamplingParams(max_tokens=max_tokens))]


class AsyncLLMTest(unittest.TestCase):
    def test_requests_added_together_share_every_step_and_get_their_own_tokens(self) -> None:
        engine = FakeEngine(max_num_seqs=4)
        engine.gate.clear()  # hold the first step until all four requests are in

        async def go() -> list[list[RequestDelta]]:
            llm = AsyncLLM(engine, FakeTokenizer())
            llm.start()
            tasks = [asyncio.ensure_future(collect(llm, f"r{i}", [60 + i], 5)) for i in range(4)]
            # the tasks' adds were queued when this coroutine first waited; the engine admitted some and
            # holds its step, the rest join at the next step
            await asyncio.to_thread(engine.wait_for, lambda: engine.blocked)
            engine.gate.set()
            results = await asyncio.gather(*tasks)
            await llm.shutdown(5)
            return results

        results = asyncio.run(go())
        for i, deltas in enumerate(results):
            tokens = [t for d in deltas for t in d.new_token_ids]
            self.assertEqual(tokens, [letter([60 + i], k) for k in range(5)])
            self.assertEqual((deltas[-1].finished, deltas[-1].finish_reason), (True, "length"))
        self.assertLessEqual(max(s.num_running for s in engine.step_stats), 4)
        self.assertEqual(sum(len(s.num_scheduled_tokens) for s in engine.step_stats), 4 * 5)
        self.assertEqual(max(len(s.num_scheduled_tokens) for s in engine.step_stats), 4)  # one step, all four

    def test_shutdown_aborts_what_outlives_the_drain_and_then_refuses_new_requests(self) -> None:
        engine = FakeEngine(max_num_seqs=2)
        engine.gate.clear()

        async def go() -> tuple[list[RequestDelta], bool]:
            llm = AsyncLLM(engine, FakeTokenizer())
            llm.start()
            task = asyncio.ensure_future(collect(llm, "long", [70], 10**6))
            await asyncio.to_thread(engine.wait_for, lambda: engine.blocked)
            shutdown = asyncio.ensure_future(llm.shutdown(0.0))  # 10**6 tokens cannot finish in a 0 s drain
            engine.gate.set()
            deltas = await task
            await shutdown
            try:
                llm.add_request("late", [1], SamplingParams())
            except EngineDrainingError:
                return deltas, not llm.is_running
            return deltas, False

        deltas, stopped = asyncio.run(go())
        self.assertEqual(deltas[-1].finish_reason, "abort")
        self.assertTrue(stopped)
        self.assertFalse(engine.has_unfinished_requests())
        self.assertEqual(engine.num_free_blocks, engine.scheduler.kv_cache_manager.num_blocks)

    def test_a_step_that_schedules_nothing_waits_for_the_next_command_instead_of_spinning(self) -> None:
        engine = FakeEngine()
        engine.stalled = True

        async def go() -> None:
            llm = AsyncLLM(engine, FakeTokenizer())
            llm.start()
            stream = llm.add_request("r", [65], SamplingParams(max_tokens=3))
            await asyncio.to_thread(engine.wait_for, lambda: engine.step_calls > 0)
            stream.close()
            await asyncio.to_thread(engine.wait_for, lambda: not engine.has_unfinished_requests())
            await llm.shutdown(1)

        asyncio.run(go())
        self.assertEqual(engine.step_calls, 1)

    def test_a_bug_outside_the_step_fails_the_requests_and_stops_the_loop(self) -> None:
        engine = FakeEngine()

        def broken() -> bool:
            raise RuntimeError("bookkeeping bug")

        engine.has_unfinished_requests = broken  # type: ignore[method-assign]

        async def go() -> tuple[BaseException | None, bool]:
            llm = AsyncLLM(engine, FakeTokenizer())
            llm.start()
            try:
                await collect(llm, "r", [65], 3)
            except EngineStepError as exc:
                await asyncio.to_thread(llm._thread.join, 5)  # type: ignore[union-attr]
                return exc, llm.is_running
            return None, llm.is_running

        with self.assertLogs("attention_kv_caceh.engine.async_llm", "ERROR"):
            error, running = asyncio.run(go())
        self.assertIsInstance(error, EngineStepError)
        self.assertFalse(running)


if __name__ == "__main__":
    unittest.main()
