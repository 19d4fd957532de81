"""A request's prefix-cache block hashes are computed when the request is built, not inside step().

Oracle: the chained hash recomputed over the request's current tokens (`_recompute`), block by block with
the formula block_pool documents (sha256 of the parent hash and the block's int64 token ids), and checked
against `hash_block_tokens`. Calls to `hash_block_bytes` are counted (and their threads recorded) by
patching it in block_pool, where the block hasher looks it up.
"""

from __future__ import annotations

import hashlib
import threading
import unittest
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from unittest import mock

import numpy as np

from attention_kv_caceh.engine import block_pool
from attention_kv_caceh.engine.block_pool import (
    BlockHash,
    get_request_block_hasher,
    hash_block_bytes,
    hash_block_tokens,
)
from attention_kv_caceh.engine.core import EngineCoreRequest
from attention_kv_caceh.engine.core_client import MPClient
from attention_kv_caceh.engine.request import Request, SamplingParams
from tests.engine_fakes import assert_all_blocks_free, make_engine, make_text_core, reference_generate

_real_hash_bytes = hash_block_bytes


def _recompute(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of every full block of token_ids, from scratch."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256(parent or b"")  # the documented formula, written out
        h.update(np.asarray(token_ids[start : start + block_size], dtype=np.int64).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


@contextmanager
def _counting_hash() -> Iterator[list[str]]:
    """Patch block_pool.hash_block_bytes; yields the names of the threads that called it, one per call."""
    calls: list[str] = []
    lock = threading.Lock()

    def counted(parent: BlockHash | None, token_bytes: bytes | memoryview) -> BlockHash:
        with lock:
            calls.append(threading.current_thread().name)
        return _real_hash_bytes(parent, token_bytes)

    with mock.patch.object(block_pool, "hash_block_bytes", counted):
        yield calls


class RequestBlockHasherTest(unittest.TestCase):
    def test_prompt_blocks_are_hashed_at_construction_and_outputs_as_blocks_fill(self) -> None:
        with _counting_hash() as calls:
            req = Request("r", list(range(1, 11)), SamplingParams(), block_hasher=get_request_block_hasher(4))
            self.assertEqual(req.block_hashes, _recompute(req.all_token_ids, 4))
            self.assertEqual(len(req.block_hashes), 2)  # 10 tokens: 2 full blocks, 2 tokens left over
            for token in [11, 12, 13, 14, 15, 16, 17]:  # crosses the block boundaries at 12 and 16
                req.append_output_token(token)
                self.assertEqual(req.block_hashes, _recompute(req.all_token_ids, 4))
        self.assertEqual(len(req.block_hashes), 4)
        self.assertEqual(len(calls), 4)  # each block hashed once

    def test_prompt_of_exact_blocks_and_blocks_made_only_of_output_tokens(self) -> None:
        req = Request("r", [5, 6, 7, 8], SamplingParams(), block_hasher=get_request_block_hasher(2))
        self.assertEqual(req.block_hashes, _recompute([5, 6, 7, 8], 2))
        for token in [9, 10, 11]:
            req.append_output_token(token)
        self.assertEqual(req.block_hashes, _recompute(req.all_token_ids, 2))
        self.assertEqual(len(req.block_hashes), 3)

    def test_a_request_without_a_hasher_is_not_hashed(self) -> None:
        with _counting_hash() as calls:
            req = Request("r", list(range(1, 20)), SamplingParams())
            req.append_output_token(3)
        self.assertEqual((req.block_hashes, calls), ([], []))

    def test_oracle_agrees_with_hash_block_tokens(self) -> None:
        tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
        want = [hash_block_tokens(None, tokens[:4])]
        want.append(hash_block_tokens(want[0], tokens[4:8]))
        self.assertEqual(_recompute(tokens, 4), want)

    def test_block_size_below_one_is_refused(self) -> None:
        with self.assertRaises(ValueError):
            get_request_block_hasher(0)


class EngineHashesAtAddTest(unittest.TestCase):
    def test_fresh_prompt_is_hashed_at_add_and_not_during_its_prefill_step(self) -> None:
        engine, _ = make_engine(num_blocks=32, block_size=4, max_num_batched_tokens=64)
        prompt = [(7 * i) % 39 + 1 for i in range(40)]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        with _counting_hash() as calls:
            req = engine.add_request("a", prompt, params)
            self.assertEqual(req.block_hashes, _recompute(prompt, 4))
            self.assertEqual(len(calls), 10)
            engine.step()  # the whole prompt is prefilled and one token sampled: 41 tokens, no new block
            self.assertEqual(len(calls), 10)
            while engine.has_unfinished_requests():
                engine.step()
                self.assertEqual(req.block_hashes, _recompute(req.all_token_ids, 4))
        self.assertEqual(len(calls), 11)  # 46 tokens: one more full block, hashed once
        assert_all_blocks_free(engine)

    def test_hashes_stay_right_through_preemption_and_recompute_without_rehashing(self) -> None:
        # block_size 2, 4 blocks, two 3-token prompts with 4 outputs each: B is preempted and recomputed
        # (see test_engine_scheduler's preemption schedule).
        engine, _ = make_engine(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=16)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        with _counting_hash() as calls:
            a = engine.add_request("A", [1, 2, 3], params)
            b = engine.add_request("B", [4, 5, 6], params)
            tokens: dict[str, list[int]] = {"A": [], "B": []}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens[out.request_id] += out.new_token_ids
                for req in (a, b):
                    self.assertEqual(req.block_hashes, _recompute(req.all_token_ids, 2))
        self.assertEqual(engine.scheduler.num_preemptions, 1)
        self.assertEqual(b.num_cached_tokens, 2)  # the recompute hit its own cached first block
        self.assertEqual(len(calls), 3 + 3)  # 7 tokens each: 3 full blocks each, every one hashed once
        self.assertEqual(tokens["B"], reference_generate([4, 5, 6], params, 256)[0])
        assert_all_blocks_free(engine)

    def test_prefix_caching_off_hashes_nothing(self) -> None:
        engine, _ = make_engine(num_blocks=32, block_size=4, enable_prefix_caching=False)
        with _counting_hash() as calls:
            req = engine.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=5, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
        self.assertEqual((req.block_hashes, calls), ([], []))

    def test_prompt_logprobs_request_is_hashed_and_its_blocks_cached_for_others(self) -> None:
        engine, _ = make_engine(num_blocks=32, block_size=4, max_num_batched_tokens=64)
        prompt = list(range(1, 14))
        req = engine.add_request("a", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
        self.assertEqual(req.block_hashes, _recompute(prompt, 4))
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("b", prompt, SamplingParams(max_tokens=1))
        engine.step()
        self.assertEqual(engine.step_stats[-1].prefix_cache_hits, 12)


class CoreProcHashesInInputThreadTest(unittest.TestCase):
    def test_prompt_blocks_are_hashed_by_the_input_thread_not_the_busy_loop(self) -> None:
        core, _ = make_text_core(block_size=4, max_model_len=256)
        prompt = [(3 * i) % 90 + 1 for i in range(41)]  # 10 full blocks
        with _counting_hash() as calls:
            client = MPClient.launch_thread(core)
            try:
                client.add_request(
                    EngineCoreRequest("a", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
                )
                tokens: list[int] = []
                finished = False
                while not finished:
                    outputs = client.get_output(60.0)
                    self.assertIsNotNone(outputs)
                    assert outputs is not None
                    for out in outputs.outputs:
                        tokens += out.new_token_ids
                        finished = finished or out.finished
            finally:
                client.shutdown()
                client.close()
        self.assertEqual(len(tokens), 8)  # 49 tokens: 12 full blocks
        self.assertEqual(calls[:10], ["core-input"] * 10)
        self.assertEqual(len(calls), 12)
        self.assertNotIn("core-input", calls[10:])  # output tokens' blocks: hashed where they are appended

    def test_a_prompt_the_input_thread_refuses_is_reported_rejected(self) -> None:
        core, _ = make_text_core(block_size=4)
        client = MPClient.launch_thread(core)
        try:
            client.add_request(EngineCoreRequest("bad", [3, -1, 4], SamplingParams()))
            outputs = client.get_output(60.0)
            assert outputs is not None
            self.assertEqual(
                [(o.request_id, o.finish_reason) for o in outputs.outputs], [("bad", "rejected")]
            )
            self.assertFalse(core.has_unfinished_requests())
        finally:
            client.shutdown()
            client.close()


if __name__ == "__main__":
    unittest.main()
