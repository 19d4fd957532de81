"""Gemma 3 and Gemma 2 against transformers: the engine's greedy tokens equal transformers' float64 greedy.

Oracle: tests/data/<family>/reference.json, written with the tiny checkpoint beside it by
scripts/family_references.py (transformers' Gemma3ForCausalLM / Gemma2ForCausalLM, float64 throughout,
full recompute per token). The engine runs the same folder, and the GGUF file llama.cpp's converter
would write for it (tests/gguf_families.py, norms stored as 1 + w), through chunked prefill (8 tokens a
step), preemption (a pool too small for all three prompts) and prefix-cache hits, with prompts longer
than the sliding window. float32 (the packed path where the CPU has it) must give the same tokens: each
prompt's smallest top-1 / top-2 gap in the reference is checked to exceed 1e-3, far above float32's
error on these sizes, so no near-tie excuses a difference.
"""

from __future__ import annotations

import json
import tempfile
import unittest
from pathlib import Path
from typing import Any

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.model_executor.model import Model
from tests.gguf_families import gemma_gguf

DATA = Path(__file__).parent / "data"
FAMILIES = ("gemma3", "gemma2")


def reference(family: str) -> dict[str, Any]:
    return json.loads((DATA / family / "reference.json").read_text())


def run_engine(path: Path, dtype: str) -> tuple[list[list[int]], list[int], LLMEngine]:
    """(tokens of the three reference prompts run together, of prompt 1 run again, the engine)."""
    ref = reference(path.parent.name if path.suffix == ".gguf" else path.name)
    config = EngineConfig(
        dtype=dtype, num_kv_blocks=14, block_size=4, max_num_seqs=3, max_num_batched_tokens=8
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
                path = gemma_gguf(DATA / family, folder / "model.gguf")
                self.check(path, family, "float64")


if __name__ == "__main__":
    unittest.main()
