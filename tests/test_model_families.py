"""Gemma 3, Gemma 2 and Phi-3 against transformers: the engine's greedy tokens equal transformers' float64 greedy.

Oracle: tests/data/<family>/reference.json, written with the tiny checkpoint beside it by
scripts/family_references.py (transformers' Gemma3ForCausalLM / Gemma2ForCausalLM / Phi3ForCausalLM, float64 throughout,
full recompute per token). The engine runs the same folder, and the GGUF file llama.cpp's converter
would write for it (tests/gguf_families.py; Gemma's norms stored as 1 + w), through chunked prefill (8 tokens a
step), preemption (a pool too small for all three prompts) and prefix-cache hits, with prompts longer
than the sliding window. float32 (the packed path where the CPU has it) must give the same tokens: each
prompt's smallest top-1 / top-2 gap in the reference is checked to exceed 1e-3, far above float32's
error on these sizes, so no near-tie excuses a difference. The GGUF files' metadata and refusals are
in tests/test_model_families_gguf.py.
"""

from __future__ import annotations

import json
import tempfile
import unittest
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import Request, SamplingParams
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.kernels.decode_attention import paged_decode_attention
from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.model_executor.model_config import ModelConfig
from attention_kv_caceh.model_executor.paged_attention import (
    AttentionMetadata,
    pack_kv_blocks,
    paged_attention,
)
from tests.gguf_families import family_gguf

DATA = Path(__file__).parent / "data"
FAMILIES = ("gemma3", "gemma2", "phi3")  # as Hugging Face folders and as GGUF files


def reference(family: str) -> dict[str, Any]:
    return json.loads((DATA / family / "reference.json").read_text())


# Pools small enough that the three prompts preempt one another. A block holds one layer's K/V in
# Gemma 3 (groups of one layer: five sliding, one full), two in Gemma 2, three in Phi-3 (one sliding
# group), so the counts differ; Phi-3's 6 blocks (24 positions) hold less than one request's 32
# positions, which only freeing the blocks behind the window allows.
NUM_KV_BLOCKS = {"gemma3": 34, "gemma2": 14, "phi3": 6}


def run_engine(path: Path, dtype: str) -> tuple[list[list[int]], list[int], LLMEngine]:
    """(tokens of the three reference prompts run together, of prompt 1 run again, the engine)."""
    family = path.parent.name if path.suffix == ".gguf" else path.name
    ref = reference(family)
    config = EngineConfig(
        dtype=dtype,
        num_kv_blocks=NUM_KV_BLOCKS[family],
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=8,
    )
    engine = LLMEngine.from_pretrained(str(path), config)
    params = SamplingParams(max_tokens=ref["max_tokens"], ignore_eos=True)
    together = engine.generate(ref["prompts"], params)
    again = engine.generate([ref["prompts"][1]], params)[0]  # shares 16 tokens (4 blocks) with prompt 0
    return together, again, engine


class GemmaFamiliesTest(unittest.TestCase):
    def check(self, path: Path, family: str, dtype: str) -> None:
        ref = reference(family)
        together, again, engine = run_engine(path, dtype)
        self.assertEqual(together, ref["tokens"])
        self.assertEqual(again, ref["tokens"][1])
        self.assertGreater(engine.scheduler.num_preemptions, 0)
        self.assertGreater(engine.scheduler.kv_cache_manager.prefix_cache_hits, 0)

    def test_prompts_cross_the_sliding_window(self) -> None:
        for family in FAMILIES:
            model = Model.load(DATA / family, "float64")
            window = model.config.sliding_window
            self.assertIsNotNone(window)
            assert window is not None
            self.assertTrue(all(len(p) > window for p in reference(family)["prompts"][:2]))
            self.assertIn("sliding_attention", model.config.layer_types)
            if family != "phi3":  # Phi-3: the window on every layer
                self.assertIn("full_attention", model.config.layer_types)

    def test_hf_folder_float64_equals_transformers(self) -> None:
        for family in FAMILIES:
            with self.subTest(family=family):
                self.check(DATA / family, family, "float64")

    def test_hf_folder_float32_equals_transformers(self) -> None:
        for family in FAMILIES:
            with self.subTest(family=family):
                self.assertGreater(min(reference(family)["min_gap"]), 1e-3)
                self.check(DATA / family, family, "float32")

    def test_gguf_file_float64_equals_transformers(self) -> None:
        for family in FAMILIES:
            with self.subTest(family=family), tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp) / family
                folder.mkdir()
                path = family_gguf(DATA / family, folder / "model.gguf")
                self.check(path, family, "float64")


class SlidingWindowBlocksTest(unittest.TestCase):
    """The engine lays Gemma 3 out in KV cache groups (one full, five sliding) and frees, in each sliding
    group, the blocks behind the window as a request advances (vLLM's SlidingWindowManager). Oracle:
    the rule itself, checked at every allocation (a sliding table's entries before the block of position
    c - W + 1 are -1, the rest are blocks of the pool), and transformers' tokens with the pool filled
    with NaN at the start and every freed block's K/V overwritten by NaN, so a kernel that read a freed
    block, or a -1 entry, would change or fail the output."""

    def test_blocks_behind_every_window_are_freed_and_never_read(self) -> None:
        ref = reference("gemma3")
        config = EngineConfig(
            dtype="float64", num_kv_blocks=40, block_size=4, max_num_seqs=1, max_num_batched_tokens=8
        )
        engine = LLMEngine.from_pretrained(str(DATA / "gemma3"), config)
        runner = engine.model_runner
        assert isinstance(runner, ModelRunner)
        groups = runner.kv_cache_groups
        window = runner.model.config.sliding_window
        self.assertEqual([g.sliding_window for g in groups], [None] + [window] * 5)
        self.assertEqual(len({id(k) for k, _ in runner.kv_caches}), 1)  # one buffer: groups of one layer
        kv = engine.scheduler.kv_cache_manager
        pool = kv.block_pool
        seen: list[tuple[int, tuple[list[int], ...]]] = []
        allocate, free = kv.allocate_slots, pool.free_blocks

        def allocate_and_look(request: Request, *args: Any) -> list[int] | None:
            c = request.num_computed_tokens
            out = allocate(request, *args)
            seen.append((c, tuple(list(t) for t in kv.get_block_ids(request))))
            return out

        def free_and_poison(blocks: Any) -> None:
            for k_cache, v_cache in runner.kv_caches:
                for block in blocks:
                    k_cache[block.block_id] = np.nan
                    v_cache[block.block_id] = np.nan
            free(blocks)

        for k_cache, v_cache in runner.kv_caches:  # a slot read before it is written shows too
            k_cache[...] = np.nan
            v_cache[...] = np.nan
        kv.allocate_slots = allocate_and_look  # type: ignore[method-assign]
        pool.free_blocks = free_and_poison  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=ref["max_tokens"], ignore_eos=True)
        self.assertEqual(engine.generate([ref["prompts"][1]], params)[0], ref["tokens"][1])
        assert window is not None
        for c, tables in seen:
            first = max(0, c - window + 1) // 4
            self.assertTrue(all(0 <= b < 40 for b in tables[0]))  # full attention keeps every block
            for table in tables[1:]:
                self.assertEqual(table[:first], [-1] * first, msg=f"c={c}")
                self.assertTrue(all(0 <= b < 40 for b in table[first:]), msg=f"c={c}")
        last_c, last = seen[-1]
        self.assertEqual(last_c, 27 + ref["max_tokens"] - 2)  # the last decode step
        held = [sum(b >= 0 for b in t) for t in last]
        self.assertEqual(held[0], 9)  # 36 positions
        self.assertTrue(all(n <= 3 for n in held[1:]), held)  # positions 30 .. 35 of window 6
        self.assertEqual(kv.num_free_blocks, 40)

    def test_the_runner_refuses_tables_that_do_not_fit_its_groups(self) -> None:
        model = Model.load(DATA / "gemma2", "float64")  # groups: full (1, 3), sliding (0, 2)
        runner = ModelRunner(model, EngineConfig(dtype="float64", block_size=4, num_kv_blocks=20), 20)
        self.assertEqual(len(runner.kv_cache_groups), 2)
        self.assertEqual(len({id(k) for k, _ in runner.kv_caches}), 2)
        prompt = list(range(1, 15))  # 14 tokens; computed 12, the step computes 2 (window 6)
        full, sliding = [0, 1, 2, 3], [-1, 6, 4, 5]  # positions 7 .. 13 are read: blocks 1 .. 3
        request = Request("r", prompt, SamplingParams(max_tokens=1))
        request.num_computed_tokens = 12

        def step(tables: tuple[list[int], ...]) -> SchedulerOutput:
            return SchedulerOutput([request], {"r": 2}, 2, 2, 0, block_ids={"r": tables})

        inputs = runner.prepare_inputs(step((full, sliding)))  # -1 before the window is fine
        np.testing.assert_array_equal(inputs.layer_metadata[0].slot_mapping, [5 * 4 + 0, 5 * 4 + 1])
        np.testing.assert_array_equal(inputs.layer_metadata[1].slot_mapping, [3 * 4 + 0, 3 * 4 + 1])
        with self.assertRaisesRegex(ValueError, "KV cache groups"):
            runner.prepare_inputs(step((full,)))
        with self.assertRaisesRegex(ValueError, "group 1"):
            runner.prepare_inputs(step((full, [-1, -1, 4, 5])))  # block 1 holds position 7


def _loop_attention(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    positions: Iterable[int],
    scale: float,
    window: int | None,
    cap: float | None,
) -> np.ndarray:
    """Float64 loop: each query (position p) over the keys at s <= p, s > p - window, capped scores."""
    import math

    out = np.zeros_like(q)
    h, h_kv = q.shape[1], keys.shape[1]
    for i, p in enumerate(positions):
        for head in range(h):
            g = head // (h // h_kv)
            seen = [s for s in range(p + 1) if window is None or s > p - window]
            sc = [float(q[i, head] @ keys[s, g]) * scale for s in seen]
            sc = [cap * math.tanh(x / cap) if cap else x for x in sc]
            m = max(sc)
            e = [math.exp(x - m) for x in sc]
            out[i, head] = sum(w / sum(e) * values[s, g] for w, s in zip(e, seen, strict=True))
    return out


class WindowedAttentionTest(unittest.TestCase):
    """paged_attention and the decode fallback with window / softcap against a float64 loop; the blocks
    wholly before the window hold NaN, so reading one would show."""

    def setUp(self) -> None:
        rng = np.random.default_rng(3)
        self.t, self.bs, self.h, self.h_kv, self.d = 19, 4, 4, 2, 8
        self.keys = rng.standard_normal((self.t, self.h_kv, self.d))
        self.values = rng.standard_normal((self.t, self.h_kv, self.d))
        self.q = rng.standard_normal((self.t, self.h, self.d))
        nb = 8
        kb = np.full((nb, self.bs, self.h_kv, self.d), np.nan)
        vb = np.full((nb, self.bs, self.h_kv, self.d), np.nan)
        self.table = np.array([[6, 2, 5, 0, 3, -1, -1]], dtype=np.int32)  # positions 0..19 -> blocks
        for pos in range(self.t):
            kb[self.table[0, pos // self.bs], pos % self.bs] = self.keys[pos]
            vb[self.table[0, pos // self.bs], pos % self.bs] = self.values[pos]
        self.kb, self.vb = kb, vb

    def caches(self, window: int | None, first_query: int) -> tuple[np.ndarray, np.ndarray]:
        kb, vb = self.kb.copy(), self.vb.copy()
        if window is not None:  # blocks wholly before the first query's window: garbage
            for b in range(max(0, first_query - window + 1) // self.bs):
                kb[self.table[0, b]] = np.nan
                vb[self.table[0, b]] = np.nan
        return pack_kv_blocks(
            np.nan_to_num(kb, nan=0.0) if window is None else kb, vb if window else np.nan_to_num(vb)
        )

    def test_prefill_chunk_matches_the_loop(self) -> None:
        for window, cap in ((6, None), (5, 2.0), (None, 1.5), (1, None), (40, None)):
            with self.subTest(window=window, cap=cap):
                n = 7  # the last 7 positions are this step's queries
                k_cache, v_cache = self.caches(window, self.t - n)
                meta = AttentionMetadata(
                    slot_mapping=np.zeros(n, dtype=np.int64),
                    query_start_loc=np.array([0, n], dtype=np.int64),
                    block_tables=self.table,
                    context_lens=np.array([self.t], dtype=np.int64),
                    block_size=self.bs,
                )
                got = paged_attention(
                    self.q[-n:], k_cache, v_cache, meta, scale=0.3, window=window, softcap=cap
                )
                want = _loop_attention(
                    self.q[-n:], self.keys, self.values, range(self.t - n, self.t), 0.3, window, cap
                )
                np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)

    def test_decode_fallback_matches_the_loop(self) -> None:
        for window, cap in ((6, None), (3, 2.0), (None, 1.5)):
            with self.subTest(window=window, cap=cap):
                k_cache, v_cache = self.caches(window, self.t - 1)
                got = paged_decode_attention(
                    self.q[-1:],
                    k_cache,
                    v_cache,
                    self.table,
                    np.array([self.t], dtype=np.int32),
                    scale=0.3,
                    window=window,
                    softcap=cap,
                )
                want = _loop_attention(self.q[-1:], self.keys, self.values, [self.t - 1], 0.3, window, cap)
                np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)

    def test_decode_refuses_a_bad_window_or_cap(self) -> None:
        k_cache, v_cache = self.caches(None, 0)
        lens = np.array([self.t], dtype=np.int32)
        with self.assertRaisesRegex(ValueError, "window"):
            paged_decode_attention(self.q[-1:], k_cache, v_cache, self.table, lens, window=0)
        with self.assertRaisesRegex(ValueError, "softcap"):
            paged_decode_attention(self.q[-1:], k_cache, v_cache, self.table, lens, softcap=0.0)


class FamilyConfigTest(unittest.TestCase):
    def config(self, family: str, **changes: Any) -> dict[str, Any]:
        hf = json.loads((DATA / family / "config.json").read_text())
        hf.update(changes)
        return hf

    def test_unimplemented_settings_are_refused_by_key(self) -> None:
        cases = [
            (
                "gemma3",
                {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
                "rope_parameters",
            ),
            ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
            ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
            ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
            ("gemma2", {"layer_types": ["sliding_attention"]}, "layer_types"),
            ("gemma2", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters"),
            (
                "phi3",
                {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
                "rope_parameters",
            ),
            (
                "phi3",
                {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
                "rope_parameters",
            ),
            ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ]
        for family, changes, key in cases:
            with self.subTest(key=key, changes=changes):
                with self.assertRaises(CheckpointError) as caught:
                    ModelConfig.from_hf_config(self.config(family, **changes))
                self.assertIn(repr(key), str(caught.exception))

    def test_defaults_follow_the_config_classes(self) -> None:
        hf = self.config("gemma3")
        for key in ("layer_types", "rope_parameters", "query_pre_attn_scalar"):
            del hf[key]
        c = ModelConfig.from_hf_config(hf)
        self.assertEqual(c.layer_types, ("sliding_attention",) * 5 + ("full_attention",))  # pattern 6
        self.assertEqual((c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar), (1e6, 1e4, 256.0))
        g2 = ModelConfig.from_hf_config(
            {k: v for k, v in self.config("gemma2").items() if k != "layer_types"}
        )
        self.assertEqual(g2.layer_types, ("sliding_attention", "full_attention") * 2)

    def test_mistral_sliding_window_applies_to_every_layer(self) -> None:
        hf = {
            "architectures": ["MistralForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "sliding_window": 5,
        }
        c = ModelConfig.from_hf_config(hf)
        self.assertEqual((c.sliding_window, c.layer_types), (5, ("sliding_attention",) * 2))
        qwen = hf | {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}
        with self.assertRaisesRegex(CheckpointError, "'sliding_window'"):
            ModelConfig.from_hf_config(qwen)

    def test_gemma2_logits_are_soft_capped(self) -> None:
        model = Model.load(DATA / "gemma2", "float64")
        cap = model.config.final_logit_softcapping
        assert cap is not None
        hidden = np.random.default_rng(0).standard_normal((3, model.config.hidden_size)) * 10
        raw = hidden @ model.lm_head.dense().T
        np.testing.assert_allclose(model.compute_logits(hidden), cap * np.tanh(raw / cap), rtol=1e-12)


if __name__ == "__main__":
    unittest.main()
