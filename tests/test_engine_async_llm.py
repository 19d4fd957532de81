"""AsyncLLM over a real EngineCore (its busy loop in a thread, behind the ZMQ sockets): one step serves every
running request, aborts free blocks, shutdown drains, and a core that dies or fails ends every stream."""

from __future__ import annotations

import asyncio
import unittest
from typing import Any

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.core import EngineCoreOutputs
from attention_kv_caceh.engine.core_client import EngineDeadError
from attention_kv_caceh.engine.output_processor import EngineDrainingError, EngineStepError, RequestDelta
from attention_kv_caceh.engine.request import SamplingParams
from tests.engine_fakes import CharTokenizer, expected_ids, hold_input, make_text_core, wait_for


async def collect(llm: AsyncLLM, rid: str, prompt: list[int], max_tokens: int) -> list[RequestDelta]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [d async for d in llm.generate(prompt, params, rid)]


class AsyncLLMTest(unittest.TestCase):
    def test_requests_added_together_share_every_step_and_get_their_own_tokens(self) -> None:
        core, runner = make_text_core(max_num_seqs=4)
        runner.gate.clear()  # hold the first step until all four requests are in

        async def go() -> list[list[RequestDelta]]:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            tasks = [asyncio.ensure_future(collect(llm, f"r{i}", [60 + i], 5)) for i in range(4)]
            await asyncio.sleep(0)  # the tasks send their requests
            proc = llm.client.proc
            assert proc is not None
            # the core admitted some and holds its step; the others wait in its input queue
            arrived = lambda: len(core.scheduler.requests) + proc.input_queue.qsize() == 4  # noqa: E731
            await asyncio.to_thread(wait_for, lambda: runner.blocked and arrived())
            runner.gate.set()
            results = await asyncio.gather(*tasks)
            await llm.shutdown(5)
            return results

        results = asyncio.run(go())
        for i, deltas in enumerate(results):
            tokens = [t for d in deltas for t in d.new_token_ids]
            self.assertEqual(tokens, expected_ids([60 + i], 5))
            self.assertEqual("".join(d.text for d in deltas), CharTokenizer().decode(tokens))
            self.assertEqual((deltas[-1].finished, deltas[-1].finish_reason), (True, "length"))
        self.assertLessEqual(max(s.num_running for s in core.step_stats), 4)
        self.assertEqual(sum(len(s.num_scheduled_tokens) for s in core.step_stats), 4 * 5)
        self.assertEqual(max(len(s.num_scheduled_tokens) for s in core.step_stats), 4)  # one step, all four

    def test_shutdown_aborts_what_outlives_the_drain_and_then_refuses_new_requests(self) -> None:
        core, runner = make_text_core(max_num_seqs=2, max_model_len=4096)
        runner.gate.clear()

        async def go() -> tuple[list[RequestDelta], bool]:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            task = asyncio.ensure_future(collect(llm, "long", [70], 4000))
            await asyncio.sleep(0)
            await asyncio.to_thread(wait_for, lambda: runner.blocked)
            shutdown = asyncio.ensure_future(llm.shutdown(0.0))  # 4000 tokens cannot finish in a 0 s drain
            await asyncio.sleep(0)
            runner.gate.set()
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
        self.assertFalse(core.has_unfinished_requests())  # the abort reached the core before it stopped
        kv = core.scheduler.kv_cache_manager
        self.assertEqual(kv.num_free_blocks, kv.num_blocks)

    def test_a_step_that_schedules_nothing_waits_for_the_next_input_instead_of_spinning(self) -> None:
        core, _runner = make_text_core()
        calls: list[int] = []
        real_step = core.step

        def stalled(on_schedule: object = None) -> EngineCoreOutputs:
            calls.append(1)
            return core.snapshot(EngineCoreOutputs())  # scheduled nothing (as when the KV pool is full)

        core.step = stalled  # type: ignore[method-assign]

        async def go() -> None:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            stream = llm.add_request("r", [65], SamplingParams(max_tokens=3))
            await asyncio.to_thread(wait_for, lambda: len(calls) > 0)
            stream.close()
            await asyncio.to_thread(wait_for, lambda: not core.has_unfinished_requests())
            await llm.shutdown(1)

        asyncio.run(go())
        self.assertEqual(len(calls), 1)
        self.assertIsNotNone(real_step)

    def test_a_bug_outside_the_step_fails_the_requests_with_engine_dead_and_stops(self) -> None:
        core, _runner = make_text_core()

        def broken() -> bool:
            raise RuntimeError("bookkeeping bug")

        async def go() -> tuple[BaseException | None, bool, type[BaseException] | None]:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            core.has_unfinished_requests = broken  # type: ignore[method-assign]
            error: BaseException | None = None
            try:
                await collect(llm, "r", [65], 3)
            except EngineDeadError as exc:
                error = exc
            await asyncio.to_thread(wait_for, lambda: not llm.is_running)
            late: type[BaseException] | None = None
            try:
                llm.add_request("late", [1], SamplingParams())
            except EngineDeadError as exc:
                late = type(exc)
            running = llm.is_running
            await llm.shutdown(1)
            return error, running, late

        with self.assertLogs("attention_kv_caceh.engine", "ERROR"):
            error, running, late = asyncio.run(go())
        self.assertIsInstance(error, EngineDeadError)
        self.assertFalse(running)
        self.assertIs(late, EngineDeadError)

    def test_a_failing_step_fails_its_requests_frees_their_blocks_and_the_core_keeps_serving(self) -> None:
        core, runner = make_text_core()
        runner.fail_steps = 1

        async def go() -> tuple[BaseException | None, list[RequestDelta]]:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            error: BaseException | None = None
            try:
                await collect(llm, "bad", [65], 3)
            except EngineStepError as exc:
                error = exc
            ok = await collect(llm, "good", [66], 3)
            await llm.shutdown(1)
            return error, ok

        with self.assertLogs("attention_kv_caceh.engine", "ERROR"):
            error, ok = asyncio.run(go())
        self.assertIsInstance(error, EngineStepError)
        self.assertEqual([t for d in ok for t in d.new_token_ids], expected_ids([66], 3))
        kv = core.scheduler.kv_cache_manager
        self.assertEqual(kv.num_free_blocks, kv.num_blocks)

    def test_a_stop_string_ends_the_text_and_frees_the_blocks_in_the_core(self) -> None:
        core, _runner = make_text_core(max_model_len=4096)
        tok = CharTokenizer()
        full = tok.decode(expected_ids([67], 40))
        stop = full[5:7]

        async def go() -> list[RequestDelta]:
            llm = AsyncLLM.from_engine_core(core, tok)
            llm.start()
            params = SamplingParams(max_tokens=4000, ignore_eos=True, stop=(stop,))
            deltas = [d async for d in llm.generate([67], params, "s")]
            await asyncio.to_thread(wait_for, lambda: not core.has_unfinished_requests())
            await llm.shutdown(1)
            return deltas

        deltas = asyncio.run(go())
        self.assertEqual("".join(d.text for d in deltas), full[: full.index(stop)])
        self.assertEqual(deltas[-1].finish_reason, "stop")
        kv = core.scheduler.kv_cache_manager
        self.assertEqual(kv.num_free_blocks, kv.num_blocks)

    def test_reset_prefix_cache_goes_through_the_core(self) -> None:
        core, _runner = make_text_core()
        prompt = list(range(1, 40))

        async def go() -> bool:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            await collect(llm, "a", prompt, 2)
            done = await llm.reset_prefix_cache()
            await collect(llm, "b", prompt, 2)
            await llm.shutdown(1)
            return done

        self.assertTrue(asyncio.run(go()))
        # the second run of the same prompt found nothing cached: the cache was forgotten in between
        self.assertEqual(sum(s.prefix_cache_hits for s in core.step_stats), 0)
        self.assertGreater(sum(s.prefix_cache_queries for s in core.step_stats), 0)

    def test_a_request_that_fails_on_its_way_to_the_core_is_not_left_counted(self) -> None:
        """msgspec cannot carry a seed past 2**64 - 1: the send raises after the OutputProcessor tracked
        the request, which must then be untracked (the gauges and the drain read that count)."""
        core, _runner = make_text_core(max_num_seqs=2)

        async def go() -> tuple[type[BaseException] | None, int, int, list[int]]:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            raised: type[BaseException] | None = None
            try:
                llm.add_request("r", [65], SamplingParams(max_tokens=2, seed=2**64, ignore_eos=True))
            except Exception as exc:
                raised = type(exc)
            counts = (llm.num_unfinished, llm.num_waiting)
            tokens = [t for d in await collect(llm, "r", [65], 2) for t in d.new_token_ids]  # the id is free
            await llm.shutdown(5)
            return raised, *counts, tokens

        raised, unfinished, waiting, tokens = asyncio.run(go())
        self.assertIs(raised, OverflowError)
        self.assertEqual((unfinished, waiting), (0, 0))
        self.assertEqual(tokens, expected_ids([65], 2))

    def test_a_core_that_stops_reading_makes_sends_queue_not_fail_and_every_request_is_served(self) -> None:
        """Backpressure is not death: while the core's input thread reads nothing, 3,000 requests (more than
        ZMQ's default high-water marks hold, 1,000 a side) are added without an error; once it reads
        again, every one gets its own tokens and the engine never looked dead."""
        core, _runner = make_text_core(max_num_seqs=64, max_num_batched_tokens=512)
        reading = hold_input(core)
        num_requests = 3000

        async def go() -> tuple[list[list[RequestDelta]], bool, bool]:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            streams = [llm.add_request(f"r{i}", [1 + i % 90], params) for i in range(num_requests)]
            alive_while_held = llm.is_running
            reading.set()

            async def read(stream: object) -> list[RequestDelta]:
                return [d async for d in stream]  # type: ignore[attr-defined]

            results = await asyncio.gather(*(read(s) for s in streams))
            alive = llm.is_running
            await llm.shutdown(5)
            return results, alive_while_held, alive

        results, alive_while_held, alive = asyncio.run(go())
        self.assertTrue(alive_while_held and alive)
        for i, deltas in enumerate(results):
            self.assertEqual([t for d in deltas for t in d.new_token_ids], expected_ids([1 + i % 90], 2))
            self.assertEqual(deltas[-1].finish_reason, "length")

    def test_a_request_added_while_the_core_dies_is_ended_and_the_gauges_read_zero(self) -> None:
        """The core dies between add_request's liveness check and the moment the request is tracked, and
        the transport takes the message without a word (a ZMQ pipe may, before it sees the peer go): the
        request must not stay tracked, and running, waiting and KV usage must read 0."""
        from attention_kv_caceh.engine.core import RequestType

        core, _runner = make_text_core(max_num_seqs=2)

        def broken() -> bool:
            raise RuntimeError("the core's loop fails")

        async def go() -> tuple[type[BaseException] | None, int, int, int, float]:
            llm = AsyncLLM.from_engine_core(core, CharTokenizer())
            llm.start()
            await collect(llm, "warm", [65], 2)  # the core has reported a KV usage above 0 once
            proc, thread = llm.client.proc, llm._thread  # pyright: ignore[reportPrivateUsage]
            assert proc is not None and thread is not None
            track = llm.output_processor.add_request

            def die_then_track(*args: Any, **kwargs: Any) -> Any:
                core.has_unfinished_requests = broken  # type: ignore[method-assign]
                proc.input_queue.put((RequestType.ABORT, []))  # wakes the idle loop, which then fails
                thread.join(30)  # the output thread saw the death and failed every tracked request
                return track(*args, **kwargs)

            llm.output_processor.add_request = die_then_track  # type: ignore[method-assign]
            llm.client.add_request = lambda request: None  # type: ignore[method-assign]
            raised: type[BaseException] | None = None
            try:
                stream = llm.add_request("late", [66], SamplingParams(max_tokens=2, ignore_eos=True))
                await asyncio.wait_for(stream.__anext__(), 5)
            except (EngineDeadError, TimeoutError) as exc:
                raised = type(exc)
            counts = (llm.num_unfinished, llm.num_running, llm.num_waiting, llm.kv_cache_usage)
            await llm.shutdown(1)
            return raised, *counts

        with self.assertLogs("attention_kv_caceh.engine", "ERROR"):
            raised, unfinished, running, waiting, kv = asyncio.run(go())
        self.assertIs(raised, EngineDeadError)
        self.assertEqual((unfinished, running, waiting, kv), (0, 0, 0, 0.0))


if __name__ == "__main__":
    unittest.main()
