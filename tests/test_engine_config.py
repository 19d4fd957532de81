"""EngineConfig validation and KV cache sizing, Request stop checks, LLMEngine text deltas.

Oracles: block counts computed by hand; stop reasons from the rules in request.check_stop; text deltas
whose concatenation must equal the decode of all output tokens, never splitting a UTF-8 character.
"""

from __future__ import annotations

import unittest

import numpy as np

from attention_kv_caceh.engine.config import (
    DEFAULT_KV_CACHE_FRACTION,
    DEFAULT_KV_CACHE_MAX_BYTES,
    EngineConfig,
    available_memory_bytes,
)
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import Request, RequestStatus, SamplingParams, check_stop
from attention_kv_caceh.engine.scheduler import SchedulerOutput


class EngineConfigTest(unittest.TestCase):
    def test_invalid_values_are_refused_naming_the_field(self) -> None:
        cases = [
            ({"max_num_seqs": 0}, "max_num_seqs"),
            ({"block_size": -1}, "block_size"),
            ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens"),
            ({"num_kv_blocks": 4, "kv_cache_memory": 1024}, "not both"),
            ({"num_kv_blocks": 0}, "num_kv_blocks"),
            ({"max_model_len": 0}, "max_model_len"),
            ({"dtype": "float16"}, "dtype"),
            ({"activations": "int4"}, "activations"),
        ]
        for kwargs, message in cases:
            with self.subTest(kwargs=kwargs), self.assertRaisesRegex(ValueError, message):
                EngineConfig(**kwargs)

    def test_num_blocks_from_explicit_count_memory_or_default_fraction(self) -> None:
        self.assertEqual(EngineConfig(num_kv_blocks=7).num_blocks_for(1000, 10**9), 7)
        self.assertEqual(EngineConfig(kv_cache_memory=10_500).num_blocks_for(1000), 10)
        self.assertEqual(
            EngineConfig().num_blocks_for(1000, 10**9), int(DEFAULT_KV_CACHE_FRACTION * 10**9) // 1000
        )
        self.assertEqual(
            EngineConfig().num_blocks_for(1024, 10**15), DEFAULT_KV_CACHE_MAX_BYTES // 1024
        )  # capped

    def test_the_default_is_capped_at_the_blocks_a_full_batch_needs_and_a_size_given_is_kept(self) -> None:
        self.assertEqual(EngineConfig().num_blocks_for(1000, 10**9, blocks_needed=1024), 1024)
        self.assertEqual(EngineConfig().num_blocks_for(1000, 10**6, blocks_needed=1024), 250)  # memory first
        self.assertEqual(
            EngineConfig(num_kv_blocks=5000).num_blocks_for(1000, 10**9, blocks_needed=1024), 5000
        )
        self.assertEqual(EngineConfig(kv_cache_memory=10**7).num_blocks_for(1000, blocks_needed=1024), 10_000)
        with self.assertRaisesRegex(ValueError, "blocks_needed"):
            EngineConfig().num_blocks_for(1000, 10**9, blocks_needed=0)

    def test_num_blocks_refuses_a_budget_below_one_block(self) -> None:
        with self.assertRaisesRegex(ValueError, "holds no block"):
            EngineConfig(kv_cache_memory=999).num_blocks_for(1000)
        with self.assertRaisesRegex(ValueError, "bytes_per_block"):
            EngineConfig().num_blocks_for(0, 10**9)

    def test_available_memory_is_positive(self) -> None:
        self.assertGreater(available_memory_bytes(), 0)

    def test_max_model_len_may_only_lower_the_checkpoints(self) -> None:
        self.assertEqual(EngineConfig().resolve_max_model_len(4096), 4096)
        self.assertEqual(EngineConfig(max_model_len=512).resolve_max_model_len(4096), 512)
        with self.assertRaisesRegex(ValueError, "8192"):
            EngineConfig(max_model_len=8192).resolve_max_model_len(4096)


class StopCheckTest(unittest.TestCase):
    def _after(self, tokens: list[int], params: SamplingParams, max_model_len: int = 100) -> RequestStatus:
        req = Request("r", [1, 2, 3], params, eos_token_id=0)
        for t in tokens:
            self.assertFalse(req.is_finished)
            req.append_output_token(t)
            check_stop(req, max_model_len)
        return req.status

    def test_stop_rules(self) -> None:
        self.assertEqual(self._after([5, 0], SamplingParams(max_tokens=5)), RequestStatus.FINISHED_STOPPED)
        self.assertEqual(
            self._after([5, 0, 6], SamplingParams(max_tokens=5, ignore_eos=True)), RequestStatus.WAITING
        )
        self.assertEqual(
            self._after([5, 9], SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=(9,))),
            RequestStatus.FINISHED_STOPPED,
        )
        self.assertEqual(
            self._after([5, 6], SamplingParams(max_tokens=2)), RequestStatus.FINISHED_LENGTH_CAPPED
        )
        self.assertEqual(
            self._after([5, 6], SamplingParams(), max_model_len=5), RequestStatus.FINISHED_LENGTH_CAPPED
        )
        # eos on the last allowed token is a natural stop
        self.assertEqual(self._after([5, 0], SamplingParams(max_tokens=2)), RequestStatus.FINISHED_STOPPED)

    def test_finish_reasons(self) -> None:
        self.assertEqual(
            [s.finish_reason for s in RequestStatus],
            [None, None, None, None, "stop", "length", "abort"],  # WAITING_FOR_FSM is not finished
        )

    def test_invalid_sampling_params_are_refused(self) -> None:
        for kwargs in (
            {"max_tokens": 0},
            {"temperature": -1.0},
            {"top_p": 0.0},
            {"top_k": -1},
            {"stop_token_ids": (-1,)},
        ):
            with self.subTest(kwargs=kwargs), self.assertRaises(ValueError):
                SamplingParams(**kwargs)


class _ScriptedRunner:
    """Logits that pick script[number of outputs so far] for every request."""

    def __init__(self, script: list[int], vocab: int = 256) -> None:
        self.script = script
        self.vocab = vocab

    def execute_model(self, so: SchedulerOutput) -> np.ndarray:
        logits = np.zeros((len(so.scheduled_requests), self.vocab))
        for i, r in enumerate(so.scheduled_requests):
            logits[i, self.script[min(r.num_output_tokens, len(self.script) - 1)]] = 1.0
        return logits


class _ByteTokenizer:
    eos_token_id: int | None = None

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


class TextDeltaTest(unittest.TestCase):
    def test_deltas_concatenate_to_the_full_text_without_splitting_characters(self) -> None:
        script = list("hé €!".encode())  # é and € are 2 and 3 bytes
        engine = LLMEngine(
            EngineConfig(num_kv_blocks=10, max_model_len=64), _ScriptedRunner(script), _ByteTokenizer()
        )
        engine.add_request("a", [1, 2], SamplingParams(max_tokens=len(script)))
        deltas: list[str] = []
        finish: list[str | None] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                deltas.append(out.text_delta)
                finish.append(out.finish_reason)
        self.assertEqual("".join(deltas), "hé €!")
        self.assertNotIn("\ufffd", "".join(deltas))
        self.assertEqual(deltas[:3], ["h", "", "é"])
        self.assertEqual(finish[-1], "length")

    def test_extra_eos_ids_stop_requests_unless_ignore_eos(self) -> None:
        def run(params: SamplingParams) -> tuple[list[int], str | None]:
            engine = LLMEngine(
                EngineConfig(num_kv_blocks=10, max_model_len=64),
                _ScriptedRunner([3, 5, 7, 8]),
                eos_token_id=2,
                extra_eos_token_ids=(2, 5),
            )
            engine.add_request("a", [1], params)
            outs = [o for _ in range(10) for o in engine.step()]
            return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason

        self.assertEqual(run(SamplingParams(max_tokens=4)), ([3, 5], "stop"))
        self.assertEqual(run(SamplingParams(max_tokens=4, ignore_eos=True)), ([3, 5, 7, 8], "length"))

    def test_engine_without_block_count_or_model_len_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "num_blocks"):
            LLMEngine(EngineConfig(max_model_len=8), _ScriptedRunner([1]))
        with self.assertRaisesRegex(ValueError, "max_model_len"):
            LLMEngine(EngineConfig(num_kv_blocks=8), _ScriptedRunner([1]))


if __name__ == "__main__":
    unittest.main()
