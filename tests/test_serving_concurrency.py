"""Client concurrency is not the server's batch, as a test: the client's concurrency and the server's max_num_seqs are different limits.

Setup: the real server (entrypoints/openai/api_server.py over the real AsyncLLM and EngineCore on a `make-model` tiny
checkpoint) runs in a thread of the test on a loopback port, as `serve --max-num-seqs N` would, with the
core's busy loop in a thread behind the same sockets `serve` uses; the harness's own `run_harness` drives
it (openai-completions, all requests at once, exact prompt lengths from the checkpoint's tokenizer). The
core runs in-process so that the test reads its own StepStats (`core.step_stats`: num_running and
num_waiting after every step) instead of sampling /metrics.

Claims:
1. concurrency 16 against max_num_seqs 4: the client had 16 in flight, the engine never ran more than 4
   and at least 8 waited (12, in fact).
2. concurrency 4 against max_num_seqs 8: never more than 4 running although 8 were allowed.

Why the claims are forced and not a matter of timing: the engine's first step is held until every
request the client can have in flight (16, resp. 4) has reached AsyncLLM (`_GatedCore`: an Event set
by the AsyncLLM's add_request, waited on with a bound; no sleep). Holding the first step stands for "a
step longer than the arrival of the requests", the situation this test is about; it changes no scheduling
decision. Then: no request can finish before the gate opens, so the client has all 16 (resp. 4) in
flight at once; the step after the gate admits all pending adds, and the scheduler runs min(16, 4) = 4
and leaves 12 waiting (resp. runs 4 of 4 with 8 allowed). Every request needs OUTPUT_LEN = 8 > 2 steps
(ignore_eos), so none finishes within the first two steps: the 12 are still waiting after the second.
The smoke test is off (its single request would wait at the gate forever).
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.core import EngineCore, EngineCoreOutputs
from attention_kv_caceh.engine.core_client import MPClient
from attention_kv_caceh.engine.output_processor import RequestStream
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.openai.api_server import build_app
from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.run import HarnessConfig, RunResult, run_harness
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.serve_helpers import ServerThread

OUTPUT_LEN = 8
PROMPT_LEN = 16
GATE_TIMEOUT_S = 120.0  # a bound, not a synchronisation: the gate opens on an event


class _GatedCore(EngineCore):
    """EngineCore whose first step waits (bounded) for `gate`; every later step is the core's own."""

    gate: threading.Event

    def step(self, on_schedule: Callable[[], None] | None = None) -> EngineCoreOutputs:
        if not self.gate.wait(GATE_TIMEOUT_S):
            raise AssertionError("not every request reached the server")
        return super().step(on_schedule)


class _CountingAsyncLLM(AsyncLLM):
    """AsyncLLM that sets `gate` once `expected` requests were added."""

    def __init__(self, core: _GatedCore, tokenizer: Tokenizer, expected: int) -> None:
        client = MPClient.launch_thread(core)
        super().__init__(
            client, tokenizer, max_num_seqs=core.config.max_num_seqs, max_model_len=core.max_model_len
        )
        self.expected = expected
        self.gate = core.gate

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> RequestStream:
        stream = super().add_request(request_id, prompt_token_ids, sampling_params)
        if self.num_unfinished >= self.expected:
            self.gate.set()
        return stream


class ServingConcurrencyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.dir = tempfile.TemporaryDirectory()
        cls.model = write_random_checkpoint(Path(cls.dir.name) / "tiny", "llama", "tiny", seed=0)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.dir.cleanup()

    def run_harness_against(
        self, max_num_seqs: int, concurrency: int, num_requests: int
    ) -> tuple[_GatedCore, RunResult]:
        config = EngineConfig(max_num_seqs=max_num_seqs, num_kv_blocks=256, block_size=16)
        engine = _GatedCore.from_pretrained(str(self.model), config)
        assert isinstance(engine, _GatedCore)
        engine.gate = threading.Event()
        tokenizer = Tokenizer.load(self.model)
        llm = _CountingAsyncLLM(engine, tokenizer, min(concurrency, num_requests))
        app = build_app(llm, tokenizer, "tiny", engine.max_model_len)
        with ServerThread(app) as server:
            harness = HarnessConfig(
                backend="openai-completions",
                base_url=server.base_url,
                model="tiny",
                num_requests=num_requests,
                concurrency=concurrency,
                prompt_len=LengthRange(PROMPT_LEN, PROMPT_LEN),
                output_len=LengthRange(OUTPUT_LEN, OUTPUT_LEN),
                ignore_eos=True,
                smoke_test=False,
                server_metrics_interval_s=0,
                tokenizer=str(self.model),
                timeout_s=GATE_TIMEOUT_S,
            )
            result = asyncio.run(run_harness(harness))
        self.assertTrue(all(r.ok for r in result.records), [r.error for r in result.records])
        self.assertEqual({r.output_tokens for r in result.records}, {OUTPUT_LEN})
        self.assertFalse(engine.has_unfinished_requests())
        return engine, result

    def test_16_in_flight_against_max_num_seqs_4_runs_4_and_queues_the_rest_in_the_server(self) -> None:
        engine, result = self.run_harness_against(max_num_seqs=4, concurrency=16, num_requests=16)
        summary: dict[str, Any] = result.summary
        self.assertEqual(summary["max_client_in_flight"], 16)
        running = [s.num_running for s in engine.step_stats]
        waiting = [s.num_waiting for s in engine.step_stats]
        self.assertEqual(max(running), 4)  # never more than max_num_seqs, and the limit was reached
        self.assertGreaterEqual(max(waiting), 8)
        self.assertEqual(max(waiting), 12)  # 16 - 4: every other request queued in the scheduler

    def test_4_in_flight_against_max_num_seqs_8_never_runs_more_than_4(self) -> None:
        engine, result = self.run_harness_against(max_num_seqs=8, concurrency=4, num_requests=12)
        self.assertEqual(engine.config.max_num_seqs, 8)
        self.assertEqual(result.summary["max_client_in_flight"], 4)
        self.assertEqual(max(s.num_running for s in engine.step_stats), 4)
        self.assertEqual(max(s.num_waiting for s in engine.step_stats), 0)  # the client is the limit


if __name__ == "__main__":
    unittest.main()
